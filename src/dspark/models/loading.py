"""Build models from HF-style directories and save them back, with strict roster checks.

One route for targets: ``load_target(dir)`` reads config.json once, picks the family from ``TARGET_FAMILIES`` by
``model_type``, builds it and loads it strictly; architectures without a native family fall back to transformers.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dspark.native as native
from dspark.checkpoint.gguf import gguf_source, read_gguf_blocks
from dspark.checkpoint.io import list_checkpoint_tensors, save_state_dict
from dspark.checkpoint.roster import TensorSpec, load_module_strict, module_roster
from dspark.config import (
    GQA_MODEL_TYPES,
    QUANTIZATIONS,
    ConfigError,
    DraftConfig,
    GQATargetConfig,
    KimiLinearConfig,
    TargetConfig,
    read_json,
)
from dspark.models.drafter import DSparkDrafter
from dspark.models.hf_target import HFTarget
from dspark.models.k3 import K3MoE
from dspark.models.kimi_linear import HybridLayer, KimiLinearTarget, checkpoint_name
from dspark.models.layers import RMSNorm
from dspark.models.llama import LlamaTarget
from dspark.models.packing import Linear
from dspark.models.protocol import Target
from dspark.models.quantized import quantize_gguf_linears
from dspark.models.target import MLATarget, MoE

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------------
# target
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


def load_target(path: str | Path, dtype: str | torch.dtype = "float32", quantization: str = "none") -> Target:
    """Load an HF model directory as a target: config.json read once, the family chosen by ``model_type``
    (missing: DeepSeek-V3), strict load; unknown architectures go through transformers with one warning.

    ``quantization``: "none" (dense weights, as exported), "gguf" (``path`` is the export of a .gguf file: its
    Q4_0/Q4_1/Q8_0 linear weights are served as stored by the native kernels, exact fp32 arithmetic; see
    ``dspark.models.quantized``), "gguf-int8" (the same with int8 activations, llama.cpp's arithmetic), or "auto"
    ("gguf" for a GGUF export when the native kernels are available, else "none")."""
    path = Path(path)
    d = read_json(path)
    quantization = choose_quantization(path, d, quantization)[0]
    quant = gguf_source(path) if quantization != "none" else None
    loader = TARGET_FAMILIES.get(d.get("model_type", "deepseek_v3"))
    if loader is None:
        warnings.warn(
            f"{path}: model_type {d.get('model_type')!r} has no native dspark family; running it through "
            "transformers (prefix recompute every step, slow)",
            stacklevel=2,
        )
        return HFTarget.load(path, torch_dtype(dtype), d)
    model = loader(path, d, torch_dtype(dtype))
    if quant is not None:
        quantize_gguf_linears(model, read_gguf_blocks(quant), torch_dtype(dtype), int8=quantization == "gguf-int8")
        for m in model.modules():  # fp32 norms (and the residual add before them) as one native kernel each
            if isinstance(m, RMSNorm):
                m.use_native()
    return model


def choose_quantization(path: Path, d: Mapping[str, Any], quantization: str) -> tuple[str, str]:
    """The weight format a target loads in, "none", "gguf" or "gguf-int8" ("auto" resolved), and why."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {list(QUANTIZATIONS)}")
    if quantization == "none":
        return "none", "dense weights, as asked"
    source = gguf_source(path)
    model_type = d.get("model_type", "deepseek_v3")
    native_family = TARGET_FAMILIES.get(model_type) is load_gqa_target
    if quantization == "auto":
        if source is None:
            return "none", "auto: not the export of a .gguf file"
        if not native_family:
            return "none", f"auto: model_type {model_type!r} is served dense only"
        if not native.available():
            return "none", f"auto: {native.status()}"
        return "gguf", f"auto: {source.name} served as stored by the native kernels"
    if source is None:
        raise ConfigError(
            f"quantization {quantization!r}: {path} is not the export of a .gguf file (or the file changed since); "
            "pass the model as its .gguf file or alias, or use quantization 'none'"
        )
    if not native_family:
        raise ConfigError(f"quantization {quantization!r}: model_type {model_type!r} is served dense only; use 'none'")
    return quantization, f"{source.name}, as asked"


def load_mla_target(path: Path, d: Mapping[str, Any], dtype: torch.dtype) -> MLATarget:
    """A DeepSeek-V3 / Kimi-K2 directory (config.json + safetensors, single or sharded)."""
    cfg = TargetConfig.from_dict(d, source=str(path / "config.json"))
    model = MLATarget(cfg)
    extra_ok = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_module_strict(model, path, ignore_unexpected=("model.layers.*.mlp.experts.*.*_scale*",), extra_ok=extra_ok)
    # router weights and correction bias stay fp32 (as DeepSeek keeps them)
    model.to(dtype)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.float()
    return model.eval()


def load_gqa_target(path: Path, d: Mapping[str, Any], dtype: torch.dtype) -> LlamaTarget:
    """A Llama / Qwen2 / Qwen3 directory; HF's non-persistent rotary buffers of old checkpoints are ignored."""
    cfg = GQATargetConfig.from_dict(d, source=str(path / "config.json"))
    model = LlamaTarget(cfg)
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_module_strict(model, path, ignore_unexpected=("*.rotary_emb.inv_freq",), extra_ok=tied)
    return model.to(dtype).eval()


TARGET_FAMILIES: dict[str, Callable[[Path, Mapping[str, Any], torch.dtype], Target]] = {
    "deepseek_v3": load_mla_target,
    "deepseek_v2": load_mla_target,
    "kimi_k2": load_mla_target,
} | dict.fromkeys(GQA_MODEL_TYPES, load_gqa_target)


def save_target(model: MLATarget, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_state_dict(state, path, dtype=torch_dtype(dtype) if dtype else None)
    d = model.config.to_hf_dict()
    if dtype:
        d["torch_dtype"] = str(torch_dtype(dtype)).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(d, indent=2))


# --------------------------------------------------------------------------------------------------------
# hybrid KDA + MLA target (kimi_linear)
# --------------------------------------------------------------------------------------------------------


def _dense_prefix(path: str | Path, cfg: KimiLinearConfig) -> str:
    """Dense FFN prefix: "mlp" (Moonshot's files) or transformers' save_pretrained "block_sparse_moe"."""
    dense = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    if dense and f"model.layers.{dense[0]}.mlp.gate_proj.weight" in list_checkpoint_tensors(path):
        return "mlp"
    return "block_sparse_moe"


def kimi_roster(cfg: KimiLinearConfig, dense_prefix: str = "block_sparse_moe") -> dict[str, TensorSpec]:
    """Expected checkpoint tensors of a kimi_linear config, on the meta device: one layer of each kind (KDA/MLA ×
    dense/MoE) is built and its names repeated, so K3's 93 layers × 896 experts take about a second."""
    rename = _kimi_rename(cfg, dense_prefix)
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


def _kimi_rename(cfg: KimiLinearConfig, dense_prefix: str = "block_sparse_moe"):
    tied = cfg.base.tie_word_embeddings

    def rename(name: str) -> str | None:
        if name.startswith("rotary.") or (tied and name == "lm_head.weight"):
            return None
        return checkpoint_name(name, dense_prefix)

    return rename


def load_kimi_linear(path: str | Path, dtype: str | torch.dtype = "float32") -> KimiLinearTarget:
    """Load a ``kimi_linear`` directory (transformers' save_pretrained output or Moonshot's layout) unchanged."""
    path = Path(path)
    return load_hybrid_target(path, read_json(path), torch_dtype(dtype))


def load_hybrid_target(path: Path, d: Mapping[str, Any], dtype: torch.dtype) -> KimiLinearTarget:
    """The ``kimi_linear`` family (KDA + MLA; K3's additions behind their config keys)."""
    cfg = KimiLinearConfig.from_dict(d, source=str(path / "config.json"))
    model = KimiLinearTarget(cfg)
    load_module_strict(model, path, rename=_kimi_rename(cfg, _dense_prefix(path, cfg)))
    model.to(dtype)
    for layer in model.model.layers:  # router, correction bias and the KDA decay parameters stay fp32
        if isinstance(layer.mlp, MoE | K3MoE):
            layer.mlp.gate.float()
        if layer.is_kda:
            layer.self_attn.A_log.data = layer.self_attn.A_log.data.float()
            layer.self_attn.dt_bias.data = layer.self_attn.dt_bias.data.float()
    return model.eval()


def save_kimi_linear(model: KimiLinearTarget, path: str | Path, dtype: str | torch.dtype | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rename = _kimi_rename(model.config)
    state = {n: v for k, v in model.state_dict().items() if (n := rename(k)) is not None}
    save_state_dict(state, path, dtype=torch_dtype(dtype) if dtype else None)
    d = model.config.to_hf_dict()
    if dtype:
        d["torch_dtype"] = str(torch_dtype(dtype)).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(d, indent=2))


TARGET_FAMILIES["kimi_linear"] = load_hybrid_target


# --------------------------------------------------------------------------------------------------------
# drafter
# --------------------------------------------------------------------------------------------------------


def draft_roster(cfg: DraftConfig, include_embedding: bool = True) -> dict[str, TensorSpec]:
    """The official model.safetensors roster (68 tensors for Kimi-K3-DSpark), on the meta device."""
    with torch.device("meta"):
        model = DSparkDrafter(cfg)
    roster = module_roster(model, rename=model.file_name)
    if include_embedding:
        roster = {"embed_tokens.weight": TensorSpec((cfg.vocab_size, cfg.hidden_size))} | roster
    return roster


def load_drafter(path: str | Path, target: nn.Module, dtype: str | torch.dtype = "float32") -> DSparkDrafter:
    """Load a draft directory and attach the target's embedding and the lm_head (own file or the target's).

    target must expose ``embed_tokens`` and ``lm_head`` (MLATarget or HFTarget).
    """
    path = Path(path)
    cfg = DraftConfig.load(path)
    model = DSparkDrafter(cfg)
    load_module_strict(model, path, rename=model.file_name, ignore_unexpected=("embed_tokens.weight", "lm_head.weight"))
    model.to(torch_dtype(dtype))
    lm_head: nn.Module = target.lm_head
    own = path / "lm_head.safetensors"
    if own.exists():
        lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        load_module_strict(lm_head, own, rename=lambda n: "lm_head." + n)
        lm_head.to(torch_dtype(dtype)).requires_grad_(False)
    elif "lm_head.weight" in list_checkpoint_tensors(path):
        lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        load_module_strict(lm_head, path, rename=lambda n: "lm_head." + n, ignore_unexpected=("*",))
        lm_head.to(torch_dtype(dtype)).requires_grad_(False)
    model.attach(target.embed_tokens, lm_head)
    return model.eval()


def save_drafter(
    model: DSparkDrafter,
    path: str | Path,
    dtype: str | torch.dtype | None = "bfloat16",
    lm_head: nn.Module | None = None,
) -> None:
    """Write config.json + model.safetensors in the official roster (and lm_head.safetensors if given)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {model.file_name(k): v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    dt = torch_dtype(dtype) if dtype else None
    save_state_dict(state, path, dtype=dt)
    if lm_head is not None:
        save_state_dict({"lm_head.weight": lm_head.weight}, path, filename="lm_head.safetensors", dtype=dt)
    d = model.config.to_dict()
    if dtype:
        d["torch_dtype"] = str(dt).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(d, indent=2))


def read_target_config(path: str | Path) -> TargetConfig | GQATargetConfig | KimiLinearConfig:
    """A target's config.json as its family's config (the fields every family shares: vocab, eos, context...)."""
    d = read_json(path)
    source = str(Path(path) / "config.json" if Path(path).is_dir() else path)
    if d.get("model_type") in GQA_MODEL_TYPES:
        return GQATargetConfig.from_dict(d, source=source)
    if d.get("model_type") == "kimi_linear":
        return KimiLinearConfig.from_dict(d, source=source)
    return TargetConfig.from_dict(d, source=source)


def read_config_any(path: str | Path) -> TargetConfig | GQATargetConfig | DraftConfig | KimiLinearConfig:
    """A config.json (or directory) as a TargetConfig, GQATargetConfig, KimiLinearConfig or DraftConfig, by
    architecture/model_type."""
    d = read_json(path)
    if d.get("model_type") == "kimi_linear":
        return KimiLinearConfig.from_dict(d, source=str(path))
    archs = d.get("architectures") or []
    if d.get("model_type") == "k3_dspark" or any(a.endswith("DSparkModel") for a in archs):
        return DraftConfig.from_dict(d, source=str(path))
    if d.get("model_type") in GQA_MODEL_TYPES:
        return GQATargetConfig.from_dict(d, source=str(path))
    return TargetConfig.from_dict(d, source=str(path))
