"""GGUF block-quantized weights served as stored: ``QuantLinear`` over Q4_0 / Q4_1 / Q8_0 blocks.

A GGUF file's linear weights are blocks of 32 values with a fp16 scale (and Q4_1 a fp16 offset). Decoding one
token reads every weight once, so keeping the 4.5-8.5 bits per value that the file holds, instead of the dequantized
fp32/bf16 export, moves 3.5-7x fewer bytes. ``QuantWeight`` holds one weight as the file stores it (its raw blocks,
rows in HF order), which the native kernel reads directly (``dspark/native/kernels.cpp``).

``QuantLinear`` runs the native kernel in one of two arithmetics:

- exact (default): fp32 activations times each block dequantized in registers with the reference's roundings:
  ``F.linear`` over the dequantized weight up to the order of the sums (relative error ~1e-7, tested), so greedy
  decoding matches the dense fp32 model;
- ``int8``: activations quantized per block of 32 to int8 (llama.cpp's arithmetic), integer dot products; faster
  where compute bound, but each output moves by ~1-6 % of its scale on real hidden states (outlier channels), so
  greedy text drifts from the dense model's.

The block kernels dequantize each weight block once and apply it to up to 8 activation rows in registers, so a
product of M rows costs about M fp32 FMAs per weight (the FMA floor) rather than M passes over the weight; each
row's result is bit for bit its M = 1 result, so a speculative verify of K+1 rows decodes exactly what K+1 plain
steps would. In the int8 arithmetic a weight of 16k outputs is repacked once (``kernel_blocks``: 16 outputs side by
side, ~3.5x fewer operations per activation row; the file's blocks stay for the other readers), and every row
count runs the kernel. In the exact arithmetic, products of more than ``DENSE_ROWS`` rows (a prefill) run GEMMs in
the input's dtype over tiles of ``DENSE_TILE`` weight rows dequantized for the call (a few hundred KiB at a time,
never the whole weight), each tile's result bit for bit ``F.linear`` over the dequantized weight (tested).
Without the kernels (``DSPARK_NATIVE=0``, no compiler) and in grad mode it dequantizes once, lazily, and runs
``F.linear``: the export's exact values, so outputs equal the dense model's.

``quantize_gguf_linears(model, blocks)`` swaps a loaded GQA target's linears (q/k/v/o, gate/up/down and the
lm_head, tied or not) for ``QuantLinear``s over the file's blocks; tensors of other types (F32/F16, K-quants) stay
dense. The swapped modules are inference-only: their weights are neither parameters nor in ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.checkpoint.gguf import GGUFBlocks
from dspark.checkpoint.io import CheckpointError, Problem

QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # GGUF type name -> the kernel's code
BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
DENSE_ROWS = 64  # exact arithmetic: products of more rows (prefill) run as dense GEMMs over weight tiles dequantized
DENSE_TILE = 256  # weight rows dequantized per GEMM on that path
PACKED = 16  # added to a type code: the blocks are the int8 kernel's packed layout
PACK_ROWS = 16  # output rows side by side in that layout (weights with other row counts keep the file's)


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A [N, K] weight as the GGUF file stores it: each row K/32 blocks of ``d f16 [| m f16] | quants``."""

    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0"
    blocks: torch.Tensor  # uint8 [N, K/32 · BLOCK_BYTES[qtype]]

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"quantized serving supports {sorted(QTYPES)}, not {self.qtype}")
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] % BLOCK_BYTES[self.qtype] or not b.is_contiguous():
            raise ValueError(
                f"{self.qtype} blocks must be contiguous uint8 [N, K/32 · {BLOCK_BYTES[self.qtype]}], "
                f"got {b.dtype} {list(b.shape)}"
            )

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.blocks.shape[1]) // BLOCK_BYTES[self.qtype] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @classmethod
    def of(cls, blocks: GGUFBlocks) -> QuantWeight:
        return cls(blocks.qtype, torch.from_numpy(np.array(blocks.raw, dtype=np.uint8, copy=True)))

    def parts(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(quants [n, nb, 32] int64 (Q4: 0..15; Q8: -128..127), d fp32 [n, nb], m fp32 [n, nb] or None)."""
        b = self.blocks if rows is None else self.blocks[rows]
        n = b.shape[0]
        b = b.view(n, -1, BLOCK_BYTES[self.qtype])

        def f16(lo: int) -> torch.Tensor:
            return b[..., lo : lo + 2].contiguous().view(torch.float16)[..., 0].float()

        if self.qtype == "Q8_0":
            return b[..., 2:].contiguous().view(torch.int8).long(), f16(0), None
        qs = b[..., 4:] if self.qtype == "Q4_1" else b[..., 2:]
        q = torch.cat((qs & 0xF, qs >> 4), dim=-1).long()  # byte j: value j (low nibble), value j+16 (high)
        return q, f16(0), f16(2) if self.qtype == "Q4_1" else None

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [N, K] (or the given rows): bit for bit the values ``dspark.checkpoint.gguf.dequantize`` gives."""
        q, d, m = self.parts(rows)
        n = q.shape[0]
        if self.qtype == "Q8_0":
            return (d[..., None] * q.float()).view(n, -1)
        if self.qtype == "Q4_0":
            return (d[..., None] * (q.float() - 8.0)).view(n, -1)
        return (d[..., None] * q.float() + m[..., None]).view(n, -1)  # two roundings, as the numpy reference

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """The row blocks of several weights of one type and width as one weight."""
        if len({(p.qtype, p.in_features) for p in parts}) != 1:
            raise ValueError("QuantWeight.cat needs weights of one type and one width")
        return QuantWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]))


def reference_quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native int8 kernel's arithmetic in plain torch (the test oracle): x [M, K] rows quantized per block of
    32 to int8 (scale max|x|/127, round half to even), integer block products scaled by both scales, plus the
    offset term over the exact fp32 block sums (Q4_1: m·Σx, Q4_0: -8·d·Σx) → fp32 [M, N]."""
    x = x.float()
    M, K = x.shape
    xb = x.view(M, -1, BLOCK)  # [M, nb, 32]
    amax = xb.abs().amax(-1)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inv[..., None])  # [M, nb, 32], integers in [-127, 127]
    q, d, m = w.parts()
    idot = torch.einsum("mbi,nbi->mnb", qx.double(), q.double())  # exact integers
    y = (idot * (d.double()[None] * dx.double()[:, None])).sum(-1)
    fsum = xb.double().sum(-1)  # [M, nb]
    if m is not None:
        y = y + fsum @ m.double().T
    elif w.qtype == "Q4_0":
        y = y - 8.0 * (fsum @ d.double().T)
    if bias is not None:
        y = y + bias.double()
    return y.float()


class QuantLinear(nn.Module):
    """``y = x Wᵀ + b`` over a ``QuantWeight``; output in the input's dtype (see the module doc)."""

    def __init__(
        self,
        qweight: QuantWeight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        int8: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.qweight = qweight  # a plain attribute: .to() and state_dict leave it alone
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.dtype = dtype  # the model's dtype: what ``weight`` returns
        self.int8 = int8  # activations quantized to int8 per block (llama.cpp's arithmetic) instead of exact fp32

    @property
    def weight(self) -> torch.Tensor:
        """The dense [N, K] weight in the model's dtype, dequantized afresh (for readers of ``.weight`` such as the
        draft-vocabulary row slices; the forward never needs it while the kernels run)."""
        return self.qweight.dequantize().to(self.dtype)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.bias_f32 is None else self.bias_f32.to(self.dtype)

    def rows(self, ids: torch.Tensor) -> QuantLinear:
        """A QuantLinear over the output rows ``ids`` [n] (their blocks copied, still quantized): a reduced draft
        vocabulary's slice of a quantized lm_head."""
        ids = ids.to(torch.long)
        qw = QuantWeight(self.qweight.qtype, self.qweight.blocks.index_select(0, ids).contiguous())
        bias = None if self.bias_f32 is None else self.bias_f32.index_select(0, ids)
        return QuantLinear(qw, bias, self.dtype, self.int8)

    def native_ok(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad) and native.enabled()

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (fp32/bf16/fp16) → fp32 [..., N] through the native kernels (callers check ``native_ok``)."""
        y = self._product(x)
        return y if y.dtype == torch.float32 else y.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ok(x):
            y = self._product(x)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        return self._dense_forward(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """The block kernel (fp32 out); in the exact arithmetic, products of more than DENSE_ROWS rows run as GEMMs
        in x's dtype over weight tiles dequantized for the call (what the dense model computes, tile by tile). The
        int8 arithmetic keeps the kernel for every row count: another arithmetic for a large batch (24 requests'
        8-row verifications are 192 rows) would make a row's result depend on what shares its forward."""
        ops = native.ops()
        if ops is None:
            return self._dense_forward(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > DENSE_ROWS and not self.int8:
            y = self._tiled_product(ops, x2)
        else:
            blocks, code = self.kernel_blocks()
            y = ops.quant_linear(x2, blocks, self.bias_f32, code, self.int8)
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_blocks(self) -> tuple[torch.Tensor, int]:
        """The blocks the native kernel reads and its type code: for the int8 arithmetic, the weight repacked once
        (16 output rows side by side, ``PACKED`` added to the code; see ``dspark/native/packed_int8.h``) when the
        kernels can pack it, else the file's blocks."""
        w, code = self.qweight, QTYPES[self.qweight.qtype]
        ops = native.ops()
        if not self.int8 or self.out_features % PACK_ROWS or ops is None or not hasattr(ops, "pack_int8"):
            return w.blocks, code
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0] is not w:  # packed per weight: a regrouped module packs its new blocks
            cached = (w, ops.pack_int8(w.blocks, code))
            self.__dict__["_packed"] = cached
        return cached[1], code + PACKED

    def _tiled_product(self, ops, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] → [M, N] in x2's dtype: per tile of DENSE_TILE weight rows, ``F.linear`` over the tile
        dequantized natively (fp32, then x2's dtype), written into its columns of the output."""
        w, code, K = self.qweight, QTYPES[self.qweight.qtype], self.in_features
        bias = self.bias_f32 if self.bias_f32 is None or x2.dtype == torch.float32 else self.bias_f32.to(x2.dtype)
        y = x2.new_empty(x2.shape[0], self.out_features)
        for n0 in range(0, self.out_features, DENSE_TILE):
            n1 = min(n0 + DENSE_TILE, self.out_features)
            tile = ops.dequantize(w.blocks[n0:n1], code, K)
            if x2.dtype != torch.float32:
                tile = tile.to(x2.dtype)
            y[:, n0:n1] = F.linear(x2, tile, None if bias is None else bias[n0:n1])
        return y

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback: ``F.linear`` over the weight dequantized once (cached per dtype)."""
        cached = self.__dict__.get("_dense")
        if cached is None or cached.dtype != x.dtype:
            with torch.inference_mode(False), torch.no_grad():
                cached = self.qweight.dequantize().to(x.dtype)
            self.__dict__["_dense"] = cached
        bias = None if self.bias_f32 is None else self.bias_f32.to(x.dtype)
        return F.linear(x, cached, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qweight.qtype}, "
            f"bias={self.bias_f32 is not None}, int8={self.int8}"
        )


class QuantGroup:
    """Several ``QuantLinear``s sharing an input (q|k|v, gate|up) as one fused ``QuantLinear`` over their row blocks,
    valid while the owner still holds the same modules over the same weights (identity checks only)."""

    __slots__ = ("parts", "weights", "fused")

    def __init__(self, parts: Sequence[QuantLinear]) -> None:
        self.parts = tuple(parts)
        fused = QuantWeight.cat([p.qweight for p in parts])
        at = 0
        for p in parts:  # each part's blocks become a row slice of the fused ones: no second copy
            p.qweight = QuantWeight(fused.qtype, fused.blocks[at : at + p.out_features])
            at += p.out_features
        self.weights = tuple(p.qweight for p in parts)
        biases = [p.bias_f32 for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)])
        self.fused = QuantLinear(fused, bias, parts[0].dtype, parts[0].int8)

    @classmethod
    def of(cls, parts: Sequence[nn.Module]) -> QuantGroup | None:
        """The group, or None unless every part is a QuantLinear of one type and width."""
        if not all(isinstance(p, QuantLinear) for p in parts):
            return None
        if len({(p.qweight.qtype, p.in_features, p.int8) for p in parts}) != 1:  # type: ignore[union-attr]
            return None
        return cls(parts)  # type: ignore[arg-type]

    @classmethod
    def regroup(cls, existing: QuantGroup | None, parts: Sequence[nn.Module]) -> QuantGroup | None:
        """``existing`` while it still groups exactly ``parts`` (fusing twice is a no-op), else a new group."""
        if existing is not None and existing.holds(parts):
            return existing
        return cls.of(parts)

    def holds(self, parts: Sequence[nn.Module]) -> bool:
        return len(parts) == len(self.parts) and all(
            p is q and p.qweight is w  # type: ignore[union-attr]
            for p, q, w in zip(parts, self.parts, self.weights)
        )

    def current(self, parts: Sequence[nn.Module], x: torch.Tensor) -> QuantLinear | None:
        """The fused module when the native kernel will run it and ``parts`` are still the grouped modules."""
        if not self.fused.native_ok(x) or native.ops() is None or not self.holds(parts):
            return None
        return self.fused


def silu_mul_f32(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 2I] → silu(gate)·up [..., I], fused when the native kernels are loaded."""
    ops = native.ops()
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_gguf_linears(
    model: nn.Module, blocks: Mapping[str, GGUFBlocks], dtype: torch.dtype, int8: bool = False
) -> int:
    """Swap every linear of ``model`` whose weight the file holds as Q4_0/Q4_1/Q8_0 blocks (by HF name; a tied
    lm_head takes the embedding's blocks) for a ``QuantLinear`` (``int8``: with int8 activations); returns how many.
    Each swapped weight is checked against the loaded dense one on a few rows (a stale export or a row-order slip is
    an error, never wrong output)."""
    targets: list[tuple[str, nn.Linear, GGUFBlocks]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        key = f"{name}.weight"
        if key not in blocks and name == "lm_head" and "lm_head.weight" not in blocks:
            key = "model.embed_tokens.weight"  # tied: the file stores the embedding only
        b = blocks.get(key)
        if b is not None and b.qtype in QTYPES:
            targets.append((name, mod, b))
    swapped = 0
    for name, mod, b in targets:
        if (b.rows, b.cols) != tuple(mod.weight.shape):
            raise CheckpointError(
                Problem(
                    f"GGUF tensor for {name}.weight is [{b.rows}, {b.cols}], the model's is {list(mod.weight.shape)}",
                    "re-export the model (its export and the .gguf disagree)",
                )
            )
        qw = QuantWeight.of(b)
        _, d, m = qw.parts()
        if not bool(torch.isfinite(d).all()) or (m is not None and not bool(torch.isfinite(m).all())):
            raise CheckpointError(Problem(f"GGUF tensor for {name}.weight has NaN/Inf block scales", "re-convert it"))
        rows = torch.tensor(sorted({0, 1, b.rows // 3, b.rows - 2}.intersection(range(b.rows))))
        with torch.no_grad():
            same = torch.equal(qw.dequantize(rows).to(mod.weight.dtype), mod.weight.detach()[rows])
        if not same:
            raise CheckpointError(
                Problem(
                    f"GGUF blocks of {name}.weight differ from the loaded weight",
                    "the export is stale: delete it (it is rebuilt from the .gguf) or load with quantization 'none'",
                )
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(qw, mod.bias, dtype, int8))
        swapped += 1
    return swapped


def quantize_dense(weight: torch.Tensor, qtype: str = "Q8_0") -> QuantWeight:
    """A dense [N, K] weight (K a multiple of 32) as GGUF blocks of ``qtype``, rounded as llama.cpp's quantizer
    rounds them (the ``gguf`` package's reference quantizer)."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[qtype])
    return QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8)))


def quantize_linears(model: nn.Module, names: Sequence[str], dtype: torch.dtype, qtype: str = "Q8_0") -> int:
    """Swap the linears ``names`` of ``model`` (those whose input width is a multiple of 32) for ``QuantLinear``s
    over their weights quantized to ``qtype``, in the int8 arithmetic; returns how many. Inference only: the
    swapped weights are no longer parameters."""
    swapped = 0
    for name in names:
        mod = model.get_submodule(name)
        if not isinstance(mod, nn.Linear) or mod.in_features % BLOCK:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(quantize_dense(mod.weight, qtype), mod.bias, dtype, int8=True))
        swapped += 1
    return swapped
