"""The model families dspark serves natively, and ``family_of``: the one place that reads a config.json's
``model_type`` / ``architectures`` to decide what a model is (``tests/test_families.py`` keeps it so).

A family is everything the rest of the package needs to know about an architecture: the config class its
config.json parses into, the model it builds (for serving and for training), the tensors its checkpoint must hold
(the roster, built on the meta device), how it loads strictly and saves, the GGUF architectures exported as it, the
drafter backbone a target of it gets, and what the peers of the bench cannot run. One section per family, then the
registry (``FAMILIES``) and the readers of the names. A target whose ``model_type`` names no family is served
through transformers (``dspark.models.hf_target``); ``family_of`` returns None for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.checkpoint.io import TensorInfo, save_state_dict
from dspark.checkpoint.roster import TensorSpec, load_module_strict, module_roster
from dspark.config import (
    GGUF_ARCHS,
    GQA_MODEL_TYPES,
    MLA_MODEL_TYPES,
    DraftConfig,
    GQATargetConfig,
    KimiLinearConfig,
    TargetConfig,
)
from dspark.models.drafter import DSparkDrafter
from dspark.models.k3 import K3MoE
from dspark.models.kimi_linear import HybridLayer, KimiLinearTarget, checkpoint_name
from dspark.models.llama import LlamaTarget
from dspark.models.target import MLATarget, MoE
from dspark.precision import torch_dtype

Weights = Mapping[str, TensorInfo]  # a checkpoint's tensor table, from its safetensors headers
GQA_DRAFTER = "Qwen3DSparkModel"  # DeepSpec's GQA drafter architecture (it keeps its target's model_type: qwen3)

# --------------------------------------------------------------------------------------------------------
# DeepSeek-V3 / Kimi-K2 (MLA) and Llama / Qwen2 / Qwen3 (GQA)
# --------------------------------------------------------------------------------------------------------


def target_roster(cfg: TargetConfig | GQATargetConfig) -> dict[str, TensorSpec]:
    """Expected HF tensor names and shapes for a DeepSeek-V3 (or Llama-family) config, built on the meta device.

    Layers of one kind (dense / MoE) have identical rosters, so one of each is built and its names are repeated
    for every layer index: a 61-layer Kimi-K2 roster (~70k tensors) takes about a second.
    """
    if isinstance(cfg, GQATargetConfig):
        with torch.device("meta"):
            roster = module_roster(LlamaTarget(cfg))
        return {k: v for k, v in roster.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    kinds = sorted({cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)})
    sample = {kind: next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i) == kind) for kind in kinds}
    small = replace(cfg, num_hidden_layers=max(sample.values()) + 1)
    with torch.device("meta"):
        model = MLATarget(small)
    full = module_roster(model)
    out: dict[str, TensorSpec] = {}
    per_layer = {kind: {} for kind in kinds}
    for name, spec in full.items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            for kind, i in sample.items():
                if int(idx) == i:
                    per_layer[kind][rest] = spec
        else:
            out[name] = spec
    layers = {
        f"model.layers.{i}.{rest}": spec
        for i in range(cfg.num_hidden_layers)
        for rest, spec in per_layer[cfg.is_moe_layer(i)].items()
    }
    head = {k: v for k, v in out.items() if k.startswith("model.embed")}
    tail = {k: v for k, v in out.items() if not k.startswith("model.embed")}
    return head | layers | tail


def _target_roster(cfg: TargetConfig | GQATargetConfig, names: Collection[str]) -> dict[str, TensorSpec]:
    return target_roster(cfg)


def load_mla_target(path: Path, cfg: TargetConfig, dtype: torch.dtype, weights: Weights) -> MLATarget:
    """A DeepSeek-V3 / Kimi-K2 directory (config.json + safetensors, single or sharded)."""
    model = MLATarget(cfg)
    extra_ok = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_module_strict(
        model, path, ignore_unexpected=("model.layers.*.mlp.experts.*.*_scale*",), extra_ok=extra_ok, found=weights
    )
    # router weights and correction bias stay fp32 (as DeepSeek keeps them)
    model.to(dtype)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.float()
    return model.eval()


def load_gqa_target(path: Path, cfg: GQATargetConfig, dtype: torch.dtype, weights: Weights) -> LlamaTarget:
    """A Llama / Qwen2 / Qwen3 directory; HF's non-persistent rotary buffers of old checkpoints are ignored."""
    model = LlamaTarget(cfg)
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_module_strict(model, path, ignore_unexpected=("*.rotary_emb.inv_freq",), extra_ok=tied, found=weights)
    return model.to(dtype).eval()


def save_target(model: MLATarget, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    """config.json + model.safetensors of a DeepSeek-V3 target (a tied lm_head is not stored)."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _write(path, state, model.config.to_hf_dict(), dtype)


def _write(path: str | Path, state: Mapping[str, torch.Tensor], config: dict[str, Any], dtype: Any) -> None:
    """model.safetensors (cast to ``dtype`` when given) and config.json (naming that dtype) under ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_state_dict(dict(state), path, dtype=torch_dtype(dtype) if dtype else None)
    if dtype:
        config["torch_dtype"] = str(torch_dtype(dtype)).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _drafter_widths(cfg: TargetConfig | GQATargetConfig) -> dict[str, Any]:
    """What every drafter copies from its target: hidden size, heads, vocab, RoPE, context, depth, special ids."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "target_num_hidden_layers": cfg.num_hidden_layers,
        "rope": cfg.rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }


def mla_drafter(cfg: TargetConfig) -> dict[str, Any]:
    """The k3_dspark (MLA) drafter of an MLA target: its latent widths, so both share the 576-wide pages."""
    return _drafter_widths(cfg) | {
        "architecture": "K3DSparkModel",
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": cfg.mla_use_nope,
        "mla_use_output_gate": cfg.mla_use_output_gate,
    }


def gqa_drafter(cfg: GQATargetConfig) -> dict[str, Any]:
    """DeepSpec's Qwen3DSparkModel (GQA) drafter of a GQA target: its KV heads and head_dim (one shared pool)."""
    return _drafter_widths(cfg) | {
        "architecture": GQA_DRAFTER,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
    }


# --------------------------------------------------------------------------------------------------------
# Kimi Linear / K3: KDA + MLA hybrid
# --------------------------------------------------------------------------------------------------------


def dense_prefix(cfg: KimiLinearConfig, names: Collection[str]) -> str:
    """Dense FFN prefix: "mlp" (Moonshot's files) or transformers' save_pretrained "block_sparse_moe", from the
    checkpoint's tensor ``names``."""
    dense = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    if dense and f"model.layers.{dense[0]}.mlp.gate_proj.weight" in names:
        return "mlp"
    return "block_sparse_moe"


def kimi_roster(cfg: KimiLinearConfig, dense_prefix: str = "block_sparse_moe") -> dict[str, TensorSpec]:
    """Expected checkpoint tensors of a kimi_linear config, on the meta device: one layer of each kind (KDA/MLA ×
    dense/MoE) is built and its names repeated, so K3's 93 layers × 896 experts take about a second."""
    rename = kimi_rename(cfg, dense_prefix)
    kinds: dict[tuple[bool, str], dict[str, TensorSpec]] = {}
    one = replace(
        cfg,
        base=replace(cfg.base, num_hidden_layers=1),
        layer_types=cfg.layer_types[:1],
        mlp_layer_types=cfg.mlp_layer_types[:1],
    )
    with torch.device("meta"):
        shell = module_roster(KimiLinearTarget(one))
        for i in range(cfg.num_hidden_layers):
            kind = (cfg.is_kda(i), cfg.mlp_layer_types[i])
            if kind not in kinds:
                kinds[kind] = module_roster(HybridLayer(cfg, i, 0))
    layers = {
        n: s
        for i in range(cfg.num_hidden_layers)
        for rest, s in kinds[(cfg.is_kda(i), cfg.mlp_layer_types[i])].items()
        if (n := rename(f"model.layers.{i}.{rest}")) is not None
    }
    out = {n: s for name, s in shell.items() if not name.startswith("model.layers.") and (n := rename(name))}
    head = {k: v for k, v in out.items() if k.startswith("model.embed")}
    return head | layers | {k: v for k, v in out.items() if k not in head}


def _kimi_roster(cfg: KimiLinearConfig, names: Collection[str]) -> dict[str, TensorSpec]:
    return kimi_roster(cfg, dense_prefix(cfg, names))


def kimi_rename(cfg: KimiLinearConfig, dense_prefix: str = "block_sparse_moe") -> Callable[[str], str | None]:
    """Module name -> checkpoint name (None: not stored, e.g. a tied lm_head)."""
    tied = cfg.base.tie_word_embeddings

    def rename(name: str) -> str | None:
        if name.startswith("rotary.") or (tied and name == "lm_head.weight"):
            return None
        return checkpoint_name(name, dense_prefix)

    return rename


def load_hybrid_target(path: Path, cfg: KimiLinearConfig, dtype: torch.dtype, weights: Weights) -> KimiLinearTarget:
    """The ``kimi_linear`` family (KDA + MLA; K3's additions behind their config keys)."""
    model = KimiLinearTarget(cfg)
    load_module_strict(model, path, rename=kimi_rename(cfg, dense_prefix(cfg, weights)), found=weights)
    model.to(dtype)
    for layer in model.model.layers:  # router, correction bias and the KDA decay parameters stay fp32
        if isinstance(layer.mlp, MoE | K3MoE):
            layer.mlp.gate.float()
        if layer.is_kda:
            layer.self_attn.A_log.data = layer.self_attn.A_log.data.float()
            layer.self_attn.dt_bias.data = layer.self_attn.dt_bias.data.float()
    return model.eval()


def save_kimi_linear(model: KimiLinearTarget, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    """config.json + model.safetensors in transformers' KimiLinearForCausalLM layout."""
    rename = kimi_rename(model.config)
    state = {n: v for k, v in model.state_dict().items() if (n := rename(k)) is not None}
    _write(path, state, model.config.to_hf_dict(), dtype)


def kimi_drafter(cfg: KimiLinearConfig) -> dict[str, Any]:
    """The MLA drafter of a hybrid target's MLA layers' widths, with RoPE (K3's drafter rotates, its target does
    not) and no output gate."""
    return mla_drafter(replace(cfg.base, mla_use_nope=False, mla_use_output_gate=False))


def kimi_peer_gap(cfg: KimiLinearConfig, peer: str) -> str | None:
    """transformers' KimiLinearForCausalLM has none of K3's additions (AttnRes, latent MoE, SiTU), and vLLM's KDA
    layers need its GPU kernels: what ``peer`` lacks for this target, None when it runs it."""
    if peer != "transformers":
        return "KDA kernels on CPU"
    k3 = cfg.attn_res_block_size or cfg.moe_latent_size or cfg.hidden_act != "silu"
    return "K3's AttnRes / latent MoE / SiTU" if k3 else None


# --------------------------------------------------------------------------------------------------------
# the DSpark drafter (k3_dspark MLA backbone, DeepSpec's Qwen3DSparkModel GQA backbone)
# --------------------------------------------------------------------------------------------------------


def draft_roster(cfg: DraftConfig, include_embedding: bool = True) -> dict[str, TensorSpec]:
    """The official model.safetensors roster (68 tensors for Kimi-K3-DSpark), on the meta device."""
    with torch.device("meta"):
        model = DSparkDrafter(cfg)
    roster = module_roster(model, rename=model.file_name)
    if include_embedding:
        roster = {"embed_tokens.weight": TensorSpec((cfg.vocab_size, cfg.hidden_size))} | roster
    return roster


def _draft_roster(cfg: DraftConfig, names: Collection[str]) -> dict[str, TensorSpec]:
    return draft_roster(cfg)


def save_drafter(
    model: DSparkDrafter,
    path: str | Path,
    dtype: str | torch.dtype | None = "bfloat16",
    lm_head: nn.Module | None = None,
) -> None:
    """Write config.json + model.safetensors in the official roster (and lm_head.safetensors if given)."""
    state = {model.file_name(k): v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    _write(path, state, model.config.to_dict(), dtype)
    if lm_head is not None:
        dt = torch_dtype(dtype) if dtype else None
        save_state_dict({"lm_head.weight": lm_head.weight}, Path(path), filename="lm_head.safetensors", dtype=dt)


# --------------------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------------------


def _runs_everywhere(cfg: Any, peer: str) -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class Family:
    """One natively served architecture: everything the package decides by what a model is."""

    name: str
    role: str  # "target" | "draft" (a drafter loads onto a target: dspark.models.loading.load_drafter)
    model_types: tuple[str, ...]  # the config.json model_type values that select it
    config: type[Any]  # its config class; ``config.from_dict(raw, source=...)``
    build: Callable[[Any], nn.Module]  # config -> the model, random weights: what ``load`` fills and training trains
    roster: Callable[[Any, Collection[str]], dict[str, TensorSpec]]  # (config, checkpoint names) -> expected
    load: Callable[[Path, Any, torch.dtype, Weights], nn.Module] | None = None  # strict load (targets)
    save: Callable[..., None] | None = None  # (model, dir, dtype): config.json + safetensors; None: dspark writes none
    roster_ignores: tuple[str, ...] = ()  # checkpoint tensors the doctor's roster check leaves unused
    gguf_archs: tuple[str, ...] = ()  # llama.cpp architectures exported as it (dspark.checkpoint.gguf)
    drafter: Callable[[Any], dict[str, Any]] | None = None  # target config -> the DraftConfig shape it gets
    peer_gap: Callable[[Any, str], str | None] = _runs_everywhere  # (config, peer) -> what the peer lacks, or None

    @property
    def is_target(self) -> bool:
        return self.role == "target"

    @property
    def quantizable(self) -> bool:
        """Its GGUF export's Q4_0/Q4_1/Q8_0 linears can be served packed (native kernels)."""
        return bool(self.gguf_archs)


MLA = Family(
    name="deepseek_v3",
    role="target",
    model_types=MLA_MODEL_TYPES,
    config=TargetConfig,
    build=MLATarget,
    roster=_target_roster,
    load=load_mla_target,
    save=save_target,
    roster_ignores=("model.layers.*.mlp.experts.*.*_scale*", "lm_head.*"),
    drafter=mla_drafter,
)
GQA = Family(
    name="llama",
    role="target",
    model_types=tuple(GQA_MODEL_TYPES),
    config=GQATargetConfig,
    build=LlamaTarget,
    roster=_target_roster,
    load=load_gqa_target,
    roster_ignores=("*.rotary_emb.inv_freq", "lm_head.*"),
    gguf_archs=GGUF_ARCHS,
    drafter=gqa_drafter,
)
KIMI_LINEAR = Family(
    name="kimi_linear",
    role="target",
    model_types=("kimi_linear",),
    config=KimiLinearConfig,
    build=KimiLinearTarget,
    roster=_kimi_roster,
    load=load_hybrid_target,
    save=save_kimi_linear,
    roster_ignores=("*_scale*",),
    drafter=kimi_drafter,
    peer_gap=kimi_peer_gap,
)
DSPARK = Family(
    name="dspark",
    role="draft",
    model_types=("k3_dspark",),
    config=DraftConfig,
    build=DSparkDrafter,
    roster=_draft_roster,
    save=save_drafter,
)

FAMILIES: dict[str, Family] = {f.name: f for f in (MLA, GQA, KIMI_LINEAR, DSPARK)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_CONFIG = {f.config: f for f in FAMILIES.values()}


def family_of(config: Any) -> Family | None:
    """The family of a config.json (a mapping) or of a parsed config (its class); None for a target only
    transformers serves.

    Drafters are known by architecture first (DeepSpec's ``Qwen3DSparkModel`` keeps ``model_type: qwen3``), targets
    by ``model_type``; a config without one is DeepSeek-V3's (its own configs predate the key)."""
    if not isinstance(config, Mapping):
        return _BY_CONFIG.get(type(config))
    if any(str(a).endswith("DSparkModel") for a in architectures(config)):
        return DSPARK
    return _BY_MODEL_TYPE.get(config.get("model_type", MLA.model_types[0]))


def model_type(config: Any) -> str | None:
    """The ``model_type`` of a config.json (None when missing) or of a loaded model's config (any ``TargetInfo``)."""
    if isinstance(config, Mapping):
        return config.get("model_type")
    return getattr(config, "model_type", None)


def architectures(config: Mapping[str, Any]) -> list[Any]:
    """A config.json's ``architectures`` list ([] when missing or not a list)."""
    archs = config.get("architectures")
    return archs if isinstance(archs, list) else []


def without_model_type(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's other keys (transformers' ``AutoConfig.for_model`` takes the model_type apart)."""
    return {k: v for k, v in config.items() if k != "model_type"}


def is_gqa_drafter(config: Mapping[str, Any]) -> bool:
    """A drafter config.json of DeepSpec's GQA backbone (its first architecture, as DraftConfig reads it)."""
    archs = architectures(config)
    return bool(archs) and archs[0] == GQA_DRAFTER


def config_header(type_name: str, *archs: str) -> dict[str, Any]:
    """The keys a config.json names its model by (what ``family_of`` reads), for code that writes one."""
    return ({"architectures": list(archs)} if archs else {}) | {"model_type": type_name}
