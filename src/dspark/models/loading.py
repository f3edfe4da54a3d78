"""Load models from HF-style directories and save them back, with strict roster checks.

One route for targets: ``load_target(spec)`` takes the model's ``ModelSpec`` (config.json read once, the family
chosen by ``dspark.models.families``), builds the family's model and loads it strictly; a target without a native
family falls back to transformers. A path works too: it is read into a spec first.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

import dspark.native as native
from dspark.checkpoint.gguf import gguf_source, read_gguf_blocks
from dspark.checkpoint.roster import load_module_strict
from dspark.config import (
    AUTO,
    QUANTIZATIONS,
    ConfigError,
    DraftConfig,
    GQATargetConfig,
    KimiLinearConfig,
    TargetConfig,
)
from dspark.models.drafter import DSparkDrafter
from dspark.models.families import (  # noqa: F401 (re-exported: the rosters' historical home)
    DSPARK,
    KIMI_LINEAR,
    MLA,
    dense_prefix,
    draft_roster,
    kimi_rename,
    kimi_roster,
    model_type,
    save_drafter,
    save_kimi_linear,
    save_target,
    target_roster,
)
from dspark.models.hf_target import HFTarget
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.layers import RMSNorm
from dspark.models.model_spec import ModelSpec, model_spec
from dspark.models.packing import Linear
from dspark.models.protocol import Target
from dspark.models.quantized import quantize_gguf_linears, quantize_linears
from dspark.precision import Precision, choose_dtype, cpu_capability, torch_dtype

SpecOrPath = str | os.PathLike[str] | ModelSpec  # a model directory, or its spec

# --------------------------------------------------------------------------------------------------------
# target
# --------------------------------------------------------------------------------------------------------


def load_target(model: SpecOrPath, dtype: str | torch.dtype = "float32", quantization: str = "none") -> Target:
    """Load an HF model directory (or its spec) as a target: its family's strict load; an architecture without a
    native family goes through transformers with one warning.

    ``quantization``: "none" (dense weights, as exported), "gguf" (``path`` is the export of a .gguf file: its
    Q4_0/Q4_1/Q8_0 linear weights are served as stored by the native kernels in llama.cpp's arithmetic: activations
    quantized per row to int8 blocks, integer dot products; see ``dspark.models.quantized``), "gguf-exact" (the same
    blocks against exact fp32 activations: the reference), or "auto" ("gguf" for a GGUF export when the native
    kernels are available, else "none")."""
    spec = model_spec(model)
    path = spec.path
    quantization = choose_quantization(spec, quantization)[0]
    quant = gguf_source(path) if quantization != "none" else None
    if spec.family is None:
        warnings.warn(
            f"{path}: model_type {model_type(spec.raw)!r} has no native dspark family; running it through "
            "transformers (prefix recompute every step, slow)",
            stacklevel=2,
        )
        return HFTarget.load(path, torch_dtype(dtype), spec.raw, spec.hf_config)
    if not spec.is_target:
        raise ConfigError(
            f"{path} is a {spec.family.name} drafter, not a target; pass it as the speculative config's 'model'"
        )
    model = spec.family.load(path, spec.config, torch_dtype(dtype), spec.weights)
    if quant is not None:
        quantize_gguf_linears(model, read_gguf_blocks(quant), torch_dtype(dtype), int8=quantization == "gguf")
        for m in model.modules():  # fp32 norms (and the residual add before them) as one native kernel each
            if isinstance(m, RMSNorm):
                m.use_native()
    return model


def choose_quantization(model: SpecOrPath, quantization: str) -> tuple[str, str]:
    """The weight format a target loads in, "none", "gguf" or "gguf-exact" ("auto" resolved), and why."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported; use one of {list(QUANTIZATIONS)}")
    if quantization == "none":
        return "none", "dense weights, as asked"
    spec = model_spec(model)
    path = spec.path
    source = gguf_source(path)
    named = model_type(spec.raw) or MLA.name  # a config without one is DeepSeek-V3's
    native_family = spec.family is not None and spec.family.quantizable
    if quantization == "auto":
        if source is None:
            return "none", "auto: not the export of a .gguf file"
        if not native_family:
            return "none", f"auto: model_type {named!r} is served dense only"
        if not native.available():
            return "none", f"auto: {native.status()}"
        return "gguf", f"auto: {source.name} served as stored by the native kernels, llama.cpp's int8 arithmetic"
    if source is None:
        raise ConfigError(
            f"quantization {quantization!r}: {path} is not the export of a .gguf file (or the file changed since); "
            "pass the model as its .gguf file or alias, or use quantization 'none'"
        )
    if not native_family:
        raise ConfigError(f"quantization {quantization!r}: model_type {named!r} is served dense only; use 'none'")
    return quantization, f"{source.name}, as asked"


def resolve_precision(target: SpecOrPath, dtype: str = AUTO, quantization: str = AUTO) -> Precision:
    """The target's weight format, then its dtype (which depends on it), for a model directory (or its spec)."""
    quant, quant_why = choose_quantization(target, quantization)
    name, dtype_why = choose_dtype(dtype, quant)
    return Precision(name, quant, cpu_capability(), dtype_why, quant_why)


# --------------------------------------------------------------------------------------------------------
# hybrid KDA + MLA target (kimi_linear)
# --------------------------------------------------------------------------------------------------------


_kimi_rename = kimi_rename  # the name tests import


def load_kimi_linear(model: SpecOrPath, dtype: str | torch.dtype = "float32") -> KimiLinearTarget:
    """Load a ``kimi_linear`` directory (transformers' save_pretrained output or Moonshot's layout) unchanged."""
    spec = model_spec(model)
    if spec.family is not KIMI_LINEAR:
        raise ConfigError(f"{spec.config_file}: model_type {model_type(spec.raw)!r} is not 'kimi_linear'")
    return KIMI_LINEAR.load(spec.path, spec.config, torch_dtype(dtype), spec.weights)


# --------------------------------------------------------------------------------------------------------
# drafter
# --------------------------------------------------------------------------------------------------------


def choose_draft_quantization(asked: str | None, target_quantization: str) -> tuple[str, str]:
    """The drafter's linears, "q8_0" or "none" (``SpeculativeConfig.quantization``, null/"auto" resolved from the
    target's weight format), and why."""
    if asked not in (None, AUTO):
        return asked, "as asked"
    if target_quantization == "gguf":
        return "q8_0", "auto: the target runs llama.cpp's int8 arithmetic, the drafter's linears run it as Q8_0 blocks"
    return "none", "auto: dense, as the target's weights are"


def load_drafter(
    draft: SpecOrPath, target: nn.Module, dtype: str | torch.dtype = "float32", quantization: str = "none"
) -> DSparkDrafter:
    """Load a draft directory (or its spec) and attach the target's embedding and the lm_head (own file or the
    target's). ``quantization`` "q8_0": its backbone's linears (``DSparkDrafter.quantizable_linears``) become Q8_0
    blocks run by the native int8 kernels, its fp32 norms the native kernel (inference only).

    target must expose ``embed_tokens`` and ``lm_head`` (MLATarget or HFTarget).
    """
    spec = model_spec(draft)
    path, cfg, weights = spec.path, read_draft_config(spec), spec.weights
    model = DSparkDrafter(cfg)
    ignore = ("embed_tokens.weight", "lm_head.weight")
    load_module_strict(model, path, rename=model.file_name, ignore_unexpected=ignore, found=weights)
    model.to(torch_dtype(dtype))
    if quantization == "q8_0":
        quantize_linears(model, model.quantizable_linears(), torch_dtype(dtype))
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.use_native()
    lm_head: nn.Module = target.lm_head
    own = path / "lm_head.safetensors"
    if own.exists():
        lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        load_module_strict(lm_head, own, rename=lambda n: "lm_head." + n)
        lm_head.to(torch_dtype(dtype)).requires_grad_(False)
    elif "lm_head.weight" in weights:
        lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        load_module_strict(lm_head, path, rename=lambda n: "lm_head." + n, ignore_unexpected=("*",), found=weights)
        lm_head.to(torch_dtype(dtype)).requires_grad_(False)
    if lm_head is not target.lm_head and isinstance(lm_head, Linear):
        lm_head.use_native_rows()  # the drafter's own: the native few-row product, as the target's
    model.attach(target.embed_tokens, lm_head)
    return model.eval()


def read_draft_config(model: SpecOrPath) -> DraftConfig:
    """A drafter's config.json as a DraftConfig (any config reads as one: its checks name what is wrong)."""
    spec = model_spec(model)
    return spec.config if spec.family is DSPARK else DraftConfig.from_dict(spec.raw, source=str(spec.config_file))


def read_target_config(model: SpecOrPath) -> TargetConfig | GQATargetConfig | KimiLinearConfig:
    """A target's config.json as its family's config (the fields every family shares: vocab, eos, context...)."""
    spec = model_spec(model)
    if not spec.is_target:
        return TargetConfig.from_dict(spec.raw, source=str(spec.config_file))  # names the model_type it rejects
    return spec.config


def read_config_any(model: SpecOrPath) -> TargetConfig | GQATargetConfig | DraftConfig | KimiLinearConfig:
    """A config.json (or directory) as its family's config: TargetConfig, GQATargetConfig, KimiLinearConfig or
    DraftConfig (a model_type without a native family is read as DeepSeek-V3's, which names what it rejects)."""
    spec = model_spec(model)
    return spec.config if spec.family is not None else TargetConfig.from_dict(spec.raw, source=str(spec.config_file))
