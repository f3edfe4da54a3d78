"""Kimi Delta Attention (KDA): the linear-attention layer of Kimi Linear and Kimi K3.

Reference: k3-mla-architecture.md §2.1. Per head (state S is [Dk, Dv], decay a_t = exp(g_t) per key channel):
    q, k, v = SiLU(causal_conv(W x)); q, k L2-normalised; q ← q / sqrt(Dk)
    S_t = (I − β_t k_t k_tᵀ) diag(a_t) S_{t−1} + β_t k_t v_tᵀ ;  o_t = S_tᵀ q_t
    out = W_o [σ(W_g x) ⊙ RMSNorm_head(o)]
Two evaluations of the same recurrence:
- ``kda_recurrent``: the token-by-token loop (decode);
- ``kda_chunked``: the chunkwise form (prefill / verify). Inside a chunk, with G_t = Σ_{i≤t} g_i and
  u_i = k-corrected values, S_t = diag(e^{G_t}) S_0 + Σ_{i≤t} (e^{G_t − G_i} ⊙ k_i) u_iᵀ where u solves the unit
  lower-triangular system (I + A) u = β ⊙ (v − (e^{G} ⊙ k) S_0), A_ij = β_i Σ_c k_ic k_jc e^{G_ic − G_jc} (j < i).
  The same formula gives the state after every row, which verification keeps (no recomputation on acceptance).
Padding rows (beyond a row's valid length) get g = 0 and β = 0, so they leave the state untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.config import KDAConfig
from dspark.models.layers import blocks_of, fuse_rows, remembered_link, weights_of
from dspark.models.packing import Linear, Packable, PackedWeight, packed_linear, version_of


@dataclass(frozen=True)
class KDAState:
    """One KDA layer's state for a batch (or, with a T axis after B, the state after every row)."""

    conv: torch.Tensor  # [B, K-1, 3·H·Dk] pre-conv projections of the last K-1 tokens (zeros before the start)
    recurrent: torch.Tensor  # [B, H, Dk, Dv] fp32

    def pack(self) -> torch.Tensor:
        """[..., numel] fp32: the recurrent matrices then the conv tail (the slot pool's flat layout)."""
        lead = self.recurrent.shape[:-3]
        return torch.cat((self.recurrent.reshape(*lead, -1), self.conv.float().reshape(*lead, -1)), -1)

    @staticmethod
    def unpack(flat: torch.Tensor, cfg: KDAConfig, conv_dtype: torch.dtype) -> KDAState:
        H, Dk, K = cfg.num_heads, cfg.head_dim, cfg.conv_kernel_size
        lead = flat.shape[:-1]
        rec, conv = flat.split([H * Dk * Dk, (K - 1) * 3 * H * Dk], -1)
        return KDAState(conv.reshape(*lead, K - 1, 3 * H * Dk).to(conv_dtype), rec.reshape(*lead, H, Dk, Dk))


class StateStore(Protocol):
    """Where KDA states live between forwards (a contiguous cache in tests, slots of a pool in the engine).
    States are flat fp32 vectors (``KDAState.pack``), ``KDAConfig.state_numel`` values per layer."""

    keep_per_row: bool  # also hand write() the state after every row (verification)

    def read(self, layer: int) -> torch.Tensor | None:
        """[B, numel] states before this forward's first row (None: every row starts from zeros)."""
        ...

    def write(self, layer: int, final: torch.Tensor, per_row: torch.Tensor | None) -> None:
        """final [B, numel]: after each row's last valid row; per_row [B, T, numel]: after every row (or None)."""
        ...


class KDACache:
    """Contiguous per-batch KDA states (one entry per KDA layer): the simplest StateStore."""

    def __init__(self, keep_per_row: bool = False) -> None:
        self.keep_per_row = keep_per_row
        self.states: dict[int, torch.Tensor] = {}
        self.per_row: dict[int, torch.Tensor] = {}

    def read(self, layer: int) -> torch.Tensor | None:
        return self.states.get(layer)

    def write(self, layer: int, final: torch.Tensor, per_row: torch.Tensor | None) -> None:
        self.states[layer] = final
        if per_row is not None:
            self.per_row[layer] = per_row


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim (the FLA convention: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---- the two forms of the gated delta rule ------------------------------------------------------------


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [B, H, T, Dk] (q scaled), v [B, H, T, Dv], beta [B, H, T], state [B, H, Dk, Dv] (all fp32)
    → out [B, H, T, Dv], final state."""
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, :, None].exp()
        predicted = torch.einsum("bhc,bhcv->bhv", k[:, :, t], state)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhc,bhcv->bhv", q[:, :, t], state))
    return torch.stack(outs, 2), state


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_per_row: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of length C (shapes as kda_recurrent) → out, final state, states after every row [B,H,C,Dk,Dv]."""
    C = q.shape[2]
    G = g.cumsum(2)  # [B, H, C, Dk]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay[t, i, c] = exp(G_tc − G_ic) for i <= t, else 0
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~lower[:, :, None], float("-inf"))
    decay_k = diff.exp() * k[:, :, None, :, :]  # [B, H, C(t), C(i), Dk]
    A = torch.einsum("bhtc,bhtic->bhti", k, decay_k) * beta[..., None]
    rhs = beta[..., None] * (v - (G.exp() * k) @ state)  # [B, H, C, Dv]
    u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    out = (q * G.exp()) @ state + torch.einsum("bhtc,bhtic->bhti", q, decay_k) @ u
    final = G[:, :, -1, :, None].exp() * state + decay_k[:, :, -1].transpose(-1, -2) @ u
    per_row = None
    if keep_per_row:
        per_row = G[..., None].exp() * state[:, :, None] + torch.einsum("bhtic,bhiv->bhtcv", decay_k, u)
    return out, final, per_row


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    keep_per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunkwise form; same contract as kda_recurrent, plus the state after every row [B, H, T, Dk, Dv]."""
    outs, rows = [], []
    for s in range(0, q.shape[2], chunk_size):
        part = slice(s, s + chunk_size)
        out, state, per_row = _chunk(
            q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], state, keep_per_row
        )
        outs.append(out)
        rows.append(per_row)
    return torch.cat(outs, 2), state, torch.cat(rows, 2) if keep_per_row else None


# ---- the layer ------------------------------------------------------------------------------------------


# inference runs every row count through the native recurrent form (kda_rows): a prompt's state then has the same
# bits whatever chunks it was prefilled in or where a cached prefix ends, and a verification's rows equal the decode
# steps' (docs/performance.md, "Invariance"); it is also faster than the chunked form's matrices on a CPU. The
# modules stay the reference and training's path; tests switch this off to run them.
NATIVE_INFERENCE = True


class GatedHeadNorm(nn.Module):
    """RMSNorm over each head's Dv channels (fp32, weight fp32) times σ(gate), cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module, Packable):
    """A KDA layer. Parameter names are the Kimi Linear checkpoint names (``q_conv1d``, ``A_log``, ``dt_bias``…).

    Inference in bf16/fp16 (``fuse()``, no grad) runs the six projections of x (q, k, v, f_a, g_a, b) as one GEMM
    over a fused weight; fp32, training and unfused modules run them one by one. The conv kernels are kept
    stacked outside grad mode."""

    def __init__(self, cfg: KDAConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx  # ordinal among the KDA layers (the state store's index)
        D, H, Dk, K = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.conv_kernel_size
        width = H * Dk
        self.q_proj = Linear(D, width, bias=False)
        self.k_proj = Linear(D, width, bias=False)
        self.v_proj = Linear(D, width, bias=False)
        self.q_conv1d = nn.Conv1d(width, width, K, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, K, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, K, groups=width, bias=False)
        self.f_a_proj = Linear(D, Dk, bias=False)
        self.f_b_proj = Linear(Dk, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, H, 1))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = Linear(D, H, bias=False)
        self.g_a_proj = Linear(D, Dk, bias=False)
        self.g_b_proj = Linear(Dk, width, bias=False)
        self.o_norm = GatedHeadNorm(Dk, cfg.rms_norm_eps)
        self.o_proj = Linear(width, D, bias=False)

    def empty_state(self, batch: int, device: torch.device) -> KDAState:
        cfg = self.cfg
        width = 3 * cfg.num_heads * cfg.head_dim
        conv = torch.zeros(batch, cfg.conv_kernel_size - 1, width, dtype=self.q_proj.weight.dtype, device=device)
        rec = torch.zeros(batch, cfg.num_heads, cfg.head_dim, cfg.head_dim, dtype=torch.float32, device=device)
        return KDAState(conv, rec)

    # ---- fused input projections for inference ------------------------------------------------------------
    def _inputs(self) -> tuple[Linear, ...]:
        return (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj)

    def fuse(self) -> None:
        """Store the six input projections' weights as row blocks of one tensor; idempotent."""
        if self._linked_inputs() is None:
            self.__dict__["_fused_inputs"] = fuse_rows(self._inputs())[0]

    def _linked_inputs(self) -> torch.Tensor | None:
        parts = self._inputs()
        w = self.__dict__.get("_fused_inputs")
        return remembered_link(
            self,
            "_inputs_memo",
            lambda: w if blocks_of(w, tuple(lin.weight for lin in parts)) else None,
            lambda: weights_of(parts),
        )

    def pack(self) -> None:
        w = self._linked_inputs()
        self.__dict__["_inputs_packed"] = None if w is None else PackedWeight.of(w)
        if w is not None:
            for lin in self._inputs():
                lin.__dict__["_packed"] = None

    def packed_count(self) -> int:
        w, packed = self._linked_inputs(), self.__dict__.get("_inputs_packed")
        return int(w is not None and packed is not None and packed.matches(w))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] → (q|k|v pre-conv [B, T, 3W], f_a [B, T, Dk], g_a [B, T, Dk], b [B, T, H])."""
        # fp32 (the bit-exact reference) keeps six GEMMs: one wider GEMM rounds a few outputs differently
        w = None if torch.is_grad_enabled() or x.dtype == torch.float32 else self._linked_inputs()
        if w is None:
            z = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1)
            return z, self.f_a_proj(x), self.g_a_proj(x), self.b_proj(x)
        W, Dk, H = self.cfg.num_heads * self.cfg.head_dim, self.cfg.head_dim, self.cfg.num_heads
        out = packed_linear(x, w, None, self.__dict__.get("_inputs_packed"))
        z, fa, ga, b = out.split([3 * W, Dk, Dk, H], -1)
        return z, fa, ga, b

    def conv_weight(self) -> torch.Tensor:
        """The q, k, v depthwise kernels stacked [3W, 1, K] (cached outside grad mode until a kernel changes)."""
        parts = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        if torch.is_grad_enabled():
            return torch.cat(parts, 0)
        key = tuple((p.data_ptr(), version_of(p), p.dtype) for p in parts)
        cached = self.__dict__.get("_conv_weight")
        if cached is None or cached[0] != key:
            cached = (key, torch.cat(parts, 0))
            self.__dict__["_conv_weight"] = cached
        return cached[1]

    def forget_gate(self, x: torch.Tensor, fa: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] (or its f_a projection ``fa``) → log-decay g [B, T, H, Dk] (fp32, ≤ 0)."""
        B, T, _ = x.shape
        fa = self.f_a_proj(x) if fa is None else fa
        raw = (self.f_b_proj(fa).float() + self.dt_bias.float()).view(B, T, self.cfg.num_heads, -1)
        rate = self.A_log.float().exp()  # [1, 1, H, 1]
        if self.cfg.gate_lower_bound is None:  # Kimi Linear: g = −e^{A}·softplus(raw)
            return -rate * F.softplus(raw)
        return self.cfg.gate_lower_bound * torch.sigmoid(rate * raw)  # K3: g = lb·σ(e^{A}·raw)

    def short_conv(self, z: torch.Tensor, tail: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """z [B, T, 3W] pre-conv projections, tail [B, K-1, 3W] → SiLU(conv) [B, T, 3W], the new tail after each
        row's last valid row [B, K-1, 3W], and the windows [B, T+K-1, 3W] (rows t+1..t+K-1 = tail after row t)."""
        K = self.cfg.conv_kernel_size
        window = torch.cat((tail.to(z.dtype), z), 1)  # [B, K-1+T, 3W]
        weight = self.conv_weight()  # [3W, 1, K]
        out = F.conv1d(window.transpose(1, 2), weight, groups=weight.shape[0]).transpose(1, 2)  # [B, T, 3W]
        idx = lengths[:, None] + torch.arange(K - 1, device=z.device)  # rows len..len+K-2 of the window
        new_tail = window.gather(1, idx[..., None].expand(-1, -1, window.shape[-1]))
        return F.silu(out), new_tail, window

    def forward(
        self, x: torch.Tensor, store: StateStore | None = None, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, D]; lengths [B] valid rows per batch row (default T) → [B, T, D]."""
        B, T, _ = x.shape
        cfg = self.cfg
        H, Dk = cfg.num_heads, cfg.head_dim
        lengths = torch.full((B,), T, dtype=torch.long, device=x.device) if lengths is None else lengths
        flat = store.read(self.layer_idx) if store is not None else None
        if NATIVE_INFERENCE and cfg.decode_recurrent and native.inference_ops() is not None:
            return self._native_rows(x, flat, store, lengths)
        prev = self.empty_state(B, x.device) if flat is None else KDAState.unpack(flat, cfg, x.dtype)
        z, fa, ga, b = self.project(x)
        mixed, tail, window = self.short_conv(z, prev.conv, lengths)
        q, k, v = (t.reshape(B, T, H, Dk).transpose(1, 2).float() for t in mixed.split(H * Dk, -1))
        valid = (torch.arange(T, device=x.device)[None, :] < lengths[:, None]).float()  # [B, T]
        g = (self.forget_gate(x, fa) * valid[:, :, None, None]).transpose(1, 2)  # [B, H, T, Dk]
        beta = (torch.sigmoid(b.float()) * valid[..., None]).transpose(1, 2)  # [B, H, T]
        q = l2_normalize(q) * Dk**-0.5
        k = l2_normalize(k)
        keep = store is not None and store.keep_per_row
        if T == 1 and cfg.decode_recurrent:
            o, final = kda_recurrent(q, k, v, g, beta, prev.recurrent.float())
            per_row = final[:, :, None] if keep else None
        else:
            o, final, per_row = kda_chunked(q, k, v, g, beta, prev.recurrent.float(), cfg.chunk_size, keep)
        if store is not None:
            rows = None
            if per_row is not None:
                K1 = cfg.conv_kernel_size - 1
                tails = window.unfold(1, K1, 1)[:, 1:].transpose(-1, -2) if K1 else window[:, :0]
                rows = KDAState(tails, per_row.transpose(1, 2)).pack()  # [B, T, numel]
            store.write(self.layer_idx, KDAState(tail, final).pack(), rows)
        gate = self.g_b_proj(ga).view(B, T, H, Dk)
        out = self.o_norm(o.transpose(1, 2).to(x.dtype), gate)
        return self.o_proj(out.reshape(B, T, H * Dk))

    def _native_rows(
        self, x: torch.Tensor, flat: torch.Tensor | None, store: StateStore | None, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Every row of a sequence through ``kda_rows`` (dspark/native/kda.cpp): the recurrent form, from the input
        projections to o_proj, as one native call (the module's operations and roundings, sums in another order).
        A verification's rows then equal the decode steps' rows bit for bit. In bf16/fp16 the fused input
        projection and o_proj take the native dense product too (each row alone, as oneDNN's packed GEMMs: a decode
        step's two products were ~90 µs of oneDNN's per-call cost on cold weights)."""
        cfg = self.cfg
        ops = native.inference_ops()
        keep = store is not None and store.keep_per_row
        fused = None if x.dtype == torch.float32 else self._linked_inputs()
        if fused is None:
            z, fa, ga, b = self.project(x)
        else:
            W, Dk, H = cfg.num_heads * cfg.head_dim, cfg.head_dim, cfg.num_heads
            z, fa, ga, b = ops.dense_linear(x, fused, None).split([3 * W, Dk, Dk, H], -1)
        state = flat if flat is not None else x.new_empty(0, dtype=torch.float32)
        o, final, rows = ops.kda_rows(
            z, fa, ga, b, state, lengths, self.conv_weight(), self.f_b_proj.weight, self.dt_bias, self.A_log,
            self.g_b_proj.weight, self.o_norm.weight, cfg.num_heads, cfg.head_dim, cfg.gate_lower_bound,
            self.o_norm.eps, keep,
        )  # fmt: skip
        if store is not None:
            store.write(self.layer_idx, final, rows if keep else None)
        w = self.o_proj.weight
        if fused is not None and type(self.o_proj) is Linear and w.dtype == o.dtype and w.is_contiguous():
            return ops.dense_linear(o, w, self.o_proj.bias)
        return self.o_proj(o)
