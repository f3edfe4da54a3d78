"""Attention backend names: the two that run here (``torch``, ``sdpa``) and vLLM's names, each mapped to what runs in
its place; ``attention_backend`` resolves a configured name, ``warn_substitute`` announces a substitution."""

from __future__ import annotations

import warnings

from dspark.config.common import fail

# Attention backends that run here: "torch" (explicit matmul + softmax, the reference) and "sdpa"
# (torch.nn.functional.scaled_dot_product_attention, the fused kernel torch has on CPU).
ATTENTION_BACKENDS = ("torch", "sdpa")
# vLLM's AttentionBackendEnum names for dense (non-sparse) attention, and what runs in their place here:
# every fused GPU kernel (FlashInfer, FlashAttention, FlashMLA, CUTLASS, Triton, ...) becomes torch's fused
# SDPA kernel; TORCH_SDPA is that kernel already. Sparse-MLA backends need a sparse model and are not accepted.
VLLM_ATTENTION_BACKENDS: dict[str, str] = {
    name: "sdpa"
    for name in (
        "FLASHINFER_MLA",
        "FLASH_ATTN_MLA",
        "TRITON_MLA",
        "CUTLASS_MLA",
        "FLASHMLA",
        "ROCM_AITER_MLA",
        "ROCM_AITER_TRITON_MLA",
        "TOKENSPEED_MLA",
        "FLASH_ATTN",
        "FLASH_ATTN_DIFFKV",
        "FLASHINFER",
        "TRITON_ATTN",
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
        "FLEX_ATTENTION",
        "TREE_ATTN",
        "XFORMERS",
        "PALLAS",
        "IPEX",
        "CPU_ATTN",
        "TORCH_SDPA",
    )
}
_RUNS_AS_IS = ("TORCH_SDPA",)


class BackendSubstitutionWarning(UserWarning):
    """A vLLM attention backend named in a config is not available here; another one runs in its place."""


def attention_backend(name: str | None, source: str, key: str = "attention_backend") -> str | None:
    """The backend that runs here for a configured name (None = default). vLLM names are case-insensitive and
    'auto' means the default, as in vLLM; an unknown name is an error listing every accepted one."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise fail(source, key, name, "must be a backend name (a string) or null")
    if name.lower() == "auto":
        return None
    if name in ATTENTION_BACKENDS:
        return name
    upper = name.upper()
    if upper not in VLLM_ATTENTION_BACKENDS:
        accepted = ["auto", *ATTENTION_BACKENDS, *sorted(VLLM_ATTENTION_BACKENDS)]
        raise fail(source, key, name, f"unknown attention backend; accepted (case-insensitive): {accepted}")
    return VLLM_ATTENTION_BACKENDS[upper]


def warn_substitute(name: str | None, source: str) -> None:
    if name is None or name.upper() not in VLLM_ATTENTION_BACKENDS or name.upper() in _RUNS_AS_IS:
        return
    warnings.warn(
        f"{source}: attention_backend {name!r} is not available on this machine (torch CPU); "
        f"running '{VLLM_ATTENTION_BACKENDS[name.upper()]}' (torch scaled_dot_product_attention) instead",
        BackendSubstitutionWarning,
        stacklevel=4,
    )
