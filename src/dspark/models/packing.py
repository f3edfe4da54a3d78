"""Prepacked weights: the inference fast path of every linear layer in bf16 on CPU.

``F.linear`` on a plain row-major bf16 weight lets oneDNN re-lay the weight out on every call; at decode sizes
(1–64 rows) that dominates the product. oneDNN can lay a weight out once for the GEMM kernel it will use
(``torch.ops.mkldnn._reorder_linear_weight``) and run on that copy (``_linear_pointwise``), the same prepacking
vLLM's CPU backend does at load time. Measured on this machine's 1 thread (bf16, weights of SmolLM2-135M's
shapes, M = 1 → 64 rows): 1.5–3× faster per product, the lm_head 7.4 → 2.9 ms at M = 1. The same oneDNN kernels
do the arithmetic: outputs equal ``F.linear``'s bit for bit without a bias, within one bf16 rounding with one
(tested).

A ``Linear`` is an ``nn.Linear`` (same parameters, names, training path) that runs on its packed copy once
``pack_for_inference`` gave it one. The copy is ignored, and ``F.linear`` used, whenever it could be stale or does
not apply: in grad mode (training), after the weight changed (an in-place write bumps its version; a new tensor has
a new address), or for a dtype/device oneDNN cannot pack. The copy costs as much memory as the weight itself, so
``EngineConfig.prepack_weights`` can turn it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native

PACK_ROWS_HINT = 8  # the row count oneDNN lays the weight out for: an 8-token verify; fastest from M=1 to 64 here


def version_of(t: torch.Tensor) -> int:
    """In-place modification counter (inference tensors have none and cannot change outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packs bf16 CPU weights on machines with bf16 support (fp32, the bit-exact reference, stays as is)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedWeight:
    """A packed copy of one weight and the identity (address, version) of the weight it was made from."""

    __slots__ = ("packed", "ptr", "version")

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        self.ptr, self.version = weight.data_ptr(), version_of(weight)

    def matches(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.ptr and version_of(weight) == self.version

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight | None:
        return cls(weight) if can_pack(weight) else None


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on ``packed`` when it is a current copy of ``weight`` and no grad is needed.
    fp32 inference runs the native ``dense_linear`` where it applies: MKL's fp32 GEMMs block their sums by the row
    count, so a row's result would depend on its chunk and its batch (oneDNN's bf16 ones, packed, do not)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device.type == "cpu":
        ops = native.inference_ops()
        if ops is not None and weight.is_contiguous():
            return ops.dense_linear(x, weight, bias)
    if packed is None or torch.is_grad_enabled() or x.dtype != torch.bfloat16 or not packed.matches(weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [None], "")


class Packable:
    """A module that keeps packed copies of (some of) its weights for inference: ``pack()`` makes or refreshes
    them, ``packed_count()`` says how many are current."""

    def pack(self) -> None:
        raise NotImplementedError

    def packed_count(self) -> int:
        raise NotImplementedError


class Linear(nn.Linear, Packable):
    """``nn.Linear`` that runs on a prepacked copy of its weight once ``pack()`` made one (see the module doc), or
    on the native dense product once ``use_native_rows()`` asked for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = x.dtype in (torch.bfloat16, torch.float16)
        if reduced and self.__dict__.get("_native_rows") and not torch.is_grad_enabled():
            ops = native.inference_ops()
            if ops is not None and self.weight.dtype == x.dtype and self.weight.is_contiguous():
                return ops.dense_linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias, self.__dict__.get("_packed"))

    def use_native_rows(self, on: bool = True) -> None:
        """bf16/fp16 inference through the native dense product (``dense_linear``: each row alone, at every row
        count) instead of oneDNN's packed GEMM: for the few-row products of a step (the lm_head, the drafter's
        context projection), where oneDNN's per-call cost on cold weights was most of the time."""
        self.__dict__["_native_rows"] = on

    def pack(self) -> None:
        self.__dict__["_packed"] = PackedWeight.of(self.weight)  # outside _parameters/_buffers: not in state_dict

    def packed_count(self) -> int:
        packed = self.__dict__.get("_packed")
        return int(packed is not None and packed.matches(self.weight))


def pack_for_inference(module: nn.Module) -> int:
    """Pack every ``Packable`` under ``module``: each ``Linear``, and the fused weights of the modules that run
    their own products (SwiGLU's fused gate|up, stacked experts). Returns how many weights are packed (0 where
    oneDNN cannot pack: fp32, no bf16 support). Idempotent; call again after changing weights."""
    with torch.inference_mode(False), torch.no_grad():
        # innermost first (reversed pre-order puts every descendant before its module): a module whose fused
        # weights replace its children's then drops their packs
        parts = [m for m in reversed(list(module.modules())) if isinstance(m, Packable)]
        for m in parts:
            m.pack()
    return sum(m.packed_count() for m in parts)
