"""The model families dspark serves natively, and ``family_of``: the one place that reads a config.json's
``model_type`` / ``architectures`` to decide what a model is.

A family is what the rest of the package needs to know about an architecture: the config class its config.json
parses into, the tensors its checkpoint must hold (the roster, built on the meta device), and how it loads
strictly. One section per family, then the registry (``FAMILIES``). A target whose ``model_type`` names no family
is served through transformers (``dspark.models.hf_target``); ``family_of`` returns None for it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.checkpoint.io import TensorInfo
from dspark.checkpoint.roster import TensorSpec, load_module_strict, module_roster
from dspark.config import (
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

Weights = Mapping[str, TensorInfo]  # a checkpoint's tensor table, from its safetensors headers

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


# --------------------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One natively served architecture: how its config.json parses, what its checkpoint holds, how it loads."""

    name: str
    role: str  # "target" | "draft" (a drafter loads onto a target: dspark.models.loading.load_drafter)
    model_types: tuple[str, ...]  # the config.json model_type values that select it
    config: type[Any]  # its config class; ``config.from_dict(raw, source=...)``
    roster: Callable[[Any, Collection[str]], dict[str, TensorSpec]]  # (config, checkpoint names) -> expected
    load: Callable[[Path, Any, torch.dtype, Weights], nn.Module] | None = None  # strict load (targets)
    roster_ignores: tuple[str, ...] = ()  # checkpoint tensors the doctor's roster check leaves unused
    quantizable: bool = False  # its GGUF export's Q4_0/Q4_1/Q8_0 linears can be served packed (native kernels)

    @property
    def is_target(self) -> bool:
        return self.role == "target"


MLA = Family(
    "deepseek_v3",
    "target",
    MLA_MODEL_TYPES,
    TargetConfig,
    _target_roster,
    load_mla_target,
    roster_ignores=("model.layers.*.mlp.experts.*.*_scale*", "lm_head.*"),
)
GQA = Family(
    "llama",
    "target",
    tuple(GQA_MODEL_TYPES),
    GQATargetConfig,
    _target_roster,
    load_gqa_target,
    roster_ignores=("*.rotary_emb.inv_freq", "lm_head.*"),
    quantizable=True,
)
KIMI_LINEAR = Family(
    "kimi_linear", "target", ("kimi_linear",), KimiLinearConfig, _kimi_roster, load_hybrid_target, ("*_scale*",)
)
DSPARK = Family("dspark", "draft", ("k3_dspark",), DraftConfig, _draft_roster)

FAMILIES: dict[str, Family] = {f.name: f for f in (MLA, GQA, KIMI_LINEAR, DSPARK)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family a config.json describes; None for a target only transformers serves.

    Drafters are known by architecture first (DeepSpec's ``Qwen3DSparkModel`` keeps ``model_type: qwen3``), targets
    by ``model_type``; a config without one is DeepSeek-V3's (its own configs predate the key)."""
    archs = config.get("architectures")
    if isinstance(archs, list) and any(str(a).endswith("DSparkModel") for a in archs):
        return DSPARK
    return _BY_MODEL_TYPE.get(config.get("model_type", MLA.model_types[0]))
