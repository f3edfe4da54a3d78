"""Small building blocks shared by the target and the drafter: RMSNorm, SwiGLU MLP, attention masks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.config import RopeConfig
from dspark.models.packing import Linear, Packable, PackedWeight, packed_linear
from dspark.models.protocol import StateSpec
from dspark.models.quantized import QuantGroup, QuantLinear, silu_mul_f32
from dspark.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 and cast back (as DeepSeek/HF do)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel; the same fp32 arithmetic as x * rsqrt(mean(x²) + eps) (bitwise, tested). Inference
        # hands it bf16/fp16 directly: it computes in fp32 and rounds once, as the cast-compute-cast path does
        # (bitwise, tested), in one op instead of three; training keeps the explicit casts (autocast-stable)
        if not torch.is_grad_enabled():
            ops = self._native_ops(x)
            if ops is not None:
                return ops.rms_norm(x, self.weight, self.eps, None)[0]
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one native kernel where ``use_native`` applies, else the two ops."""
        ops = None if torch.is_grad_enabled() else self._native_ops(x)
        if ops is not None and residual.dtype == torch.float32 and residual.shape == x.shape:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        h = residual + x
        return self(h), h

    def use_native(self, on: bool = True) -> None:
        """Run fp32 inference through the native fused kernel (``dspark.native``: the same formula, its own order
        of the sum of squares, so not bit-identical to torch's); quantized GGUF models turn it on."""
        self.__dict__["_native"] = on

    def _native_ops(self, x: torch.Tensor):
        if not self.__dict__.get("_native") or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return None
        return native.ops()


class SwiGLU(nn.Module, Packable):
    """down_proj(silu(gate_proj(x)) · up_proj(x)) (biases optional, as Llama's mlp_bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quant = self._quant_gate_up(x)
        if quant is not None:  # GGUF blocks: one native product for gate|up, fp32 through to down_proj's input
            gu = quant.forward_f32(x)
            h = silu_mul_f32(gu) if type(self).activate is SwiGLU.activate else self.activate(*gu.chunk(2, dim=-1))
            return same_dtype(self.down_proj(h), x.dtype)
        gate_up = self.fused_gate_up()
        if gate_up is None:
            return self.down_proj(self.activate(self.gate_proj(x), self.up_proj(x)))
        out = self._native_forward(x, gate_up)
        if out is not None:
            return out
        packed = self.__dict__.get("_gate_up_packed")
        gate, up = packed_linear(x, gate_up, self.__dict__.get("_gate_up_bias"), packed).chunk(2, dim=-1)  # one GEMM
        # the gate made contiguous: the vectorised kernels, bit-identical to the unfused path
        return self.down_proj(self.activate(gate.contiguous(), up))

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation: silu(gate)·up (subclasses: SiTU)."""
        return F.silu(gate) * up

    def native_activation(self) -> tuple[int, float, float] | None:
        """The activation as the native ``glu`` takes it: (0, -, -) silu·up; None for another (subclasses say)."""
        return (0, 0.0, 0.0) if type(self).activate is SwiGLU.activate else None

    def _native_forward(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
        """The whole MLP in one native call (``glu``, dspark/native/moe.cpp: the packed products of dense.h, each
        row alone, every value the modules hold in x's dtype rounded to it) for bf16/fp16 inference at every row
        count: a drafter block's MLP was ~9 eager ops and ~0.37 ms. None where it does not apply (no native build,
        grad mode, fp32 (the bit-exact reference: its products are already native, its activation torch's), biases,
        mixed dtypes, another activation): the modules run."""
        act = self.native_activation()
        down = self.down_proj.weight
        if (
            act is None
            or torch.is_grad_enabled()
            or x.dtype not in (torch.bfloat16, torch.float16)
            or type(self.down_proj) is not Linear
            or self.down_proj.bias is not None
            or self.__dict__.get("_gate_up_bias") is not None
            or gate_up.dtype != x.dtype
            or down.dtype != x.dtype
            or not (gate_up.is_contiguous() and down.is_contiguous())
        ):
            return None
        ops = native.inference_ops()
        return None if ops is None else ops.glu(x, gate_up, down, *act)

    def fuse(self, gate_up: torch.Tensor | None = None) -> None:
        """Store gate_proj and up_proj weights in one [2I, D] tensor (``gate_up``, or a new one) and make the two
        weights views of it, so inference runs one GEMM for both; the parameters keep their names and values.
        Quantized projections (``QuantLinear``) are grouped instead: their blocks concatenated for one product, each
        keeping a row slice (different block types stay two products)."""
        parts = (self.gate_proj, self.up_proj)
        if any(isinstance(p, QuantLinear) for p in parts):
            self.__dict__["_gate_up_quant"] = QuantGroup.regroup(self.__dict__.get("_gate_up_quant"), parts)
            return
        inter = self.gate_proj.weight.shape[0]
        if gate_up is None and self._linked_gate_up() is not None:
            return  # already fused
        with torch.no_grad():
            if gate_up is None:
                gate_up = torch.cat((self.gate_proj.weight, self.up_proj.weight))
            else:
                gate_up.copy_(torch.cat((self.gate_proj.weight, self.up_proj.weight)))
        for lin, part in ((self.gate_proj, gate_up[:inter]), (self.up_proj, gate_up[inter:])):
            lin.weight = nn.Parameter(part, requires_grad=lin.weight.requires_grad)
        self._gate_up = gate_up
        if self.gate_proj.bias is not None:
            with torch.no_grad():
                bias = torch.cat((self.gate_proj.bias, self.up_proj.bias))
            for lin, part in ((self.gate_proj, bias[:inter]), (self.up_proj, bias[inter:])):
                lin.bias = nn.Parameter(part, requires_grad=lin.bias.requires_grad)
            self._gate_up_bias = bias

    def pack(self) -> None:
        """Pack the fused gate|up weight (the Linears it fused then keep no packs of their own)."""
        gate_up = self._linked_gate_up()
        self.__dict__["_gate_up_packed"] = None if gate_up is None else PackedWeight.of(gate_up)
        if gate_up is not None:
            self.gate_proj.__dict__["_packed"] = self.up_proj.__dict__["_packed"] = None

    def packed_count(self) -> int:
        gate_up, packed = self._linked_gate_up(), self.__dict__.get("_gate_up_packed")
        return int(gate_up is not None and packed is not None and packed.matches(gate_up))

    def _quant_gate_up(self, x: torch.Tensor):
        group = self.__dict__.get("_gate_up_quant")
        return None if group is None else group.current((self.gate_proj, self.up_proj), x)

    def fused_gate_up(self) -> torch.Tensor | None:
        """The fused [2I, D] weight while both projections still live in it (a .to() or a re-assigned weight
        breaks the link; the module then falls back to two GEMMs). None in grad mode (training)."""
        return None if torch.is_grad_enabled() else self._linked_gate_up()

    def _linked_gate_up(self) -> torch.Tensor | None:
        return remembered_link(
            self, "_gate_up_memo", self._check_gate_up, lambda: weights_of((self.gate_proj, self.up_proj))
        )

    def _check_gate_up(self) -> torch.Tensor | None:
        g = self.__dict__.get("_gate_up")
        if g is None:
            return None
        if not blocks_of(g, (self.gate_proj.weight, self.up_proj.weight)):
            return None
        if self.gate_proj.bias is not None and not blocks_of(
            self.__dict__.get("_gate_up_bias"), (self.gate_proj.bias, self.up_proj.bias)
        ):
            return None
        return g


def same_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without dispatching a no-op cast when it already has that dtype (one op less per layer)."""
    return t if t.dtype == dtype else t.to(dtype)


def blocks_of(fused: torch.Tensor | None, parts: tuple[torch.Tensor, ...]) -> bool:
    """parts are still consecutive row blocks of fused, in order (pointer arithmetic only: no tensor op)."""
    if fused is None:
        return False
    at = fused.data_ptr()
    for part in parts:
        if part.dtype != fused.dtype or part.data_ptr() != at:
            return False
        at += part.numel() * part.element_size()
    return True


T = TypeVar("T")


class WeightWatch:
    """The parameters a fused tensor was verified over: ``intact()`` holds while each is still the same Parameter
    object on the same storage. Re-assigning a weight, or converting it (``.to()`` swaps ``.data``), breaks it;
    in-place writes do not (the fused tensor shares their storage). One dict lookup and one pointer read per
    weight, instead of the module-attribute walk of a full link check on every forward (~100 µs for 8 experts)."""

    __slots__ = ("slots",)

    def __init__(self, owners: Iterable[tuple[nn.Module, str]]) -> None:
        self.slots = tuple((m._parameters, n, m._parameters[n], m._parameters[n].data_ptr()) for m, n in owners)

    def intact(self) -> bool:
        for params, name, p, ptr in self.slots:
            if params.get(name) is not p or p.data_ptr() != ptr:
                return False
        return True


def remembered_link(
    owner: nn.Module, slot: str, check: Callable[[], T | None], watched: Callable[[], Iterable[tuple[nn.Module, str]]]
) -> T | None:
    """``check()`` (a link check: the fused tensor, or None once a part left it), re-run only when a watched
    parameter changed since its last positive answer, which ``owner.__dict__[slot]`` keeps. The fused tensor keeps
    the verified storage alive, so no other tensor can take its address: an unchanged (object, pointer) pair is
    the verified weight."""
    memo = owner.__dict__.get(slot)
    if memo is not None and memo[0].intact():
        return memo[1]
    linked = check()
    owner.__dict__[slot] = None if linked is None else (WeightWatch(watched()), linked)
    return linked


def weights_of(linears: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """(module, name) of each linear's weight and, where it has one, bias."""
    return [(lin, n) for lin in linears for n in ("weight", "bias") if lin._parameters.get(n) is not None]


def linked_rows(
    fused: tuple[torch.Tensor, torch.Tensor | None] | None, parts: tuple[nn.Linear, ...]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``fused`` (the (weight, bias) of ``fuse_rows``) while every part's weight and bias are still its row blocks;
    None once a part was re-assigned or converted (the module then runs its parts apart)."""
    if fused is None:
        return None
    w, b = fused
    if not blocks_of(w, tuple(p.weight for p in parts)):
        return None
    if b is not None and not blocks_of(b, tuple(p.bias for p in parts)):
        return None
    return fused


def remembered_rows(
    owner: nn.Module, slot: str, parts: tuple[nn.Linear, ...]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``linked_rows`` of the fused (weight, bias) that ``fuse_rows`` left in ``owner.__dict__[slot]``, remembered
    (``remembered_link``) until one of the parts' parameters changes."""
    return remembered_link(
        owner, slot + "_memo", lambda: linked_rows(owner.__dict__.get(slot), parts), lambda: weights_of(parts)
    )


def fuse_rows(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store the weights (and biases) of linears sharing an input as row blocks of one tensor, re-pointing each
    parameter as a view of its block (names, values and requires_grad unchanged): one GEMM then computes all."""
    out: list[torch.Tensor | None] = []
    for attr in ("weight", "bias"):
        tensors = [getattr(lin, attr) for lin in linears]
        if tensors[0] is None:
            out.append(None)
            continue
        with torch.no_grad():
            fused = torch.cat(tensors)
        at = 0
        for lin, t in zip(linears, tensors):
            setattr(lin, attr, nn.Parameter(fused[at : at + t.shape[0]], requires_grad=t.requires_grad))
            at += t.shape[0]
        out.append(fused)
    return out[0], out[1]  # type: ignore[return-value]


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """q_positions [B, T], k_positions [B, S] → bool [B, T, S], True where key position <= query position."""
    return k_positions[:, None, :] <= q_positions[:, :, None]


def no_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Padding query rows that see no key get to see every key (their output is ignored), so softmax is finite.
    ``mask`` itself when every row sees a key (no second [B, T, S] mask for a long prefill chunk)."""
    empty = ~mask.any(-1, keepdim=True)
    return mask | empty if bool(empty.any()) else mask


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """bool mask [B, T, S] → additive fp32 bias [B, 1, T, S] (0 visible, -inf hidden), built once per forward
    for every layer; a bias passes through unchanged. Adding it equals masked_fill(-inf) bit for bit."""
    if mask.dtype != torch.bool:
        return mask
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))[:, None]


CAUSAL = torch.empty(0, dtype=torch.bool)  # sentinel mask: plain causal self-attention over the block itself


def is_reduced_precision() -> bool:
    """A bf16/fp16 CPU autocast region (training features): the fp32 reference keeps its explicit masks."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.float32


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention with grouped KV heads (q [B, H, T, d], k/v [B, n_kv, T, d]) through torch's causal
    flash kernel: no [T, T] bias is built or read and the hidden upper triangle is skipped (about 3.5× faster than
    the masked kernel for SmolLM2 at T = 2048, bf16, one thread). Reduced precision only."""
    H, n_kv = q.shape[1], k.shape[1]
    if n_kv != H:
        k, v = k.repeat_interleave(H // n_kv, 1), v.repeat_interleave(H // n_kv, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with grouped KV heads (GQA; MQA such as absorbed MLA): q [B, H, T, d], k [B, n_kv, S, d],
    v [B, n_kv, S, dv], bias [B, 1, T, S] additive → [B, H, T, dv]; query head h reads KV head h // (H / n_kv).

    In bf16/fp16 the g = H / n_kv query heads of each KV head are folded into its query rows ([B, n_kv, g·T, d]),
    so torch's CPU flash kernel reads the shared K/V once instead of taking ``enable_gqa``'s slow path: measured
    here at decode (T = 1, S = 300) 206 → 36 µs for SmolLM2's 9/3 heads, 136 → 49 µs for 8 heads over one MLA
    latent. fp32, the bit-exact reference, keeps ``enable_gqa`` (its T = 1 kernel is already fast there, and
    folding would move the last bits)."""
    B, H, T, d = q.shape
    n_kv = k.shape[1]
    if q.dtype == torch.float32 or n_kv == H:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=n_kv != H)
    g = H // n_kv
    folded_bias = bias if bias.shape[2] == 1 else bias.repeat(1, 1, g, 1)  # row j·T + t of group j is row t
    out = F.scaled_dot_product_attention(q.reshape(B, n_kv, g * T, d), k, v, attn_mask=folded_bias, scale=scale)
    return out.view(B, H, T, -1)


class Backbone(nn.Module):
    """HF's ``model`` of a decoder: the token embedding, the decoder layers and the final norm."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: Iterable[nn.Module], rms_norm_eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)


# without the native kernels every forward takes torch's modules, whose GEMMs block their sums by the row count
NO_NATIVE_NOTE = (
    "the native kernels are not built: the batch, the prefill chunks and a prefix-cache hit can change a row's "
    "rounding, and greedy text can then part where two logits tie"
)


class DecoderTarget(nn.Module):
    """What every native decoder family shares: the HF-named backbone under ``model`` (``embed_tokens``,
    ``layers``, ``norm``), an lm_head (own or tied to the embedding) and the rotary tables. Subclasses add the
    Target protocol's page format and their forward."""

    def __init__(
        self, config: object, model: nn.Module, hidden_size: int, vocab_size: int, tie: bool, rope: RopeConfig
    ) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = Linear(hidden_size, vocab_size, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(rope)

    @property
    def invariance_note(self) -> str | None:
        """None with the native kernels: every row count (decode, verification, prefill chunks) runs them one row
        at a time, so a row's logits depend on nothing but its own tokens (docs/performance.md, "Invariance")."""
        return None if native.ops() is not None else NO_NATIVE_NOTE

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def state_spec(self) -> StateSpec | None:
        """Per-request recurrent state beside the pages (none for attention-only families)."""
        return None

    def fuse_for_inference(self) -> None:
        """Fused weights for the inference path: every layer's FFN (SwiGLU gate|up, stacked experts) and its
        attention's input projections (Llama: q|k|v; MLA: q|kv_a; KDA: its six). Parameters become views (names,
        values and the training path unchanged); the lm_head takes the native few-row product. Idempotent."""
        with torch.inference_mode(False), torch.no_grad():
            for layer in self.model.layers:
                layer.mlp.fuse()
                layer.self_attn.fuse()
        if isinstance(self.lm_head, Linear):
            self.lm_head.use_native_rows()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [..., D] → fp32 logits [..., V]."""
        return self.lm_head(hidden).float()
