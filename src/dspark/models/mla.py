"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2/K3 and the K3 DSpark drafter).

Reference: k3-mla-architecture.md §3. Two paths over the same weights:
- ``naive``: expand every cached latent through kv_b_proj into per-head keys and values (the oracle);
- ``absorbed``: fold W_UK into the query and W_UV into the output so attention runs directly on the cached
  (kv_lora_rank + rope dim)-wide latent (576 for K3) with one shared "KV head".
The cache only ever holds the latent ``[kv_a_layernorm(c_kv) | rope(k_pe)]``.
Either path runs its softmax(QKᵀ)V with one of two backends (``backend``): "torch" (explicit matmul + fp32
softmax, the reference) or "sdpa" (torch's fused scaled_dot_product_attention kernel).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.config import MLAConfig
from dspark.models.layers import (
    RMSNorm,
    attention_bias,
    fuse_rows,
    grouped_sdpa,
    remembered_rows,
    same_dtype,
)
from dspark.models.packing import Linear, Packable, PackedWeight, packed_linear, version_of
from dspark.models.rope import apply_rope
from dspark.profiling import scope

SCORE_BLOCK = 1 << 23  # fp32 attention scores per block of query rows in absorbed prefill (32 MiB: 128 rows of
# 2 heads over 32K keys; a block reads every key once, so 4x the rows of 8 MiB blocks cut a 32K prefill 61 -> 57 s)
# inference runs every row count through the native kernels (mla_project, mla_attend), each query row alone: a row's
# result then depends only on its own inputs, never on the chunk it is prefilled in, where a cached prefix ends or
# what shares the batch (docs/performance.md, "Invariance"). The modules stay the reference, training's path and the
# fallback; tests switch this off to run them.
NATIVE_INFERENCE = True
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LatentStore(Protocol):
    """Where a layer's latents live: ``update`` writes the new rows and returns every visible row."""

    def update(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """latent [B, T, C+R] for the new tokens → all keys [B, S, C+R] the batch's mask refers to."""
        ...


class MLAttention(nn.Module, Packable):
    """MLA over a latent store. Inference in bf16/fp16 (``fuse()``, no grad) runs the two projections of x (q or
    q_a, and kv_a) as one GEMM over a fused weight and rotates the query and key RoPE parts in one call (vLLM's
    fused_qkv_a_proj); fp32, training and unfused modules run them apart (the same values up to rounding: tested)."""

    def __init__(self, cfg: MLAConfig, layer_idx: int, backend: str = "torch") -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.backend = backend  # "torch" | "sdpa"
        H, D = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        if cfg.use_output_gate:
            self.g_proj = Linear(D, H * cfg.v_head_dim, bias=False)
        self.o_proj = Linear(H * cfg.v_head_dim, D, bias=cfg.attention_bias)
        self.scale = cfg.softmax_scale

    # ---- fused q|kv_a for inference ------------------------------------------------------------------

    def _x_projections(self) -> tuple[Linear, Linear]:
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        return first, self.kv_a_proj_with_mqa

    def fuse(self) -> None:
        """Store the weights (and biases) of the projections of x as row blocks of one tensor; idempotent. Not
        when only one of them has a bias (a fused GEMM would need a zero block)."""
        parts = self._x_projections()
        if self._linked_xproj() is None and (parts[0].bias is None) == (parts[1].bias is None):
            self.__dict__["_xproj"] = fuse_rows(parts)

    def _linked_xproj(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return remembered_rows(self, "_xproj", self._x_projections())

    def pack(self) -> None:
        fused = self._linked_xproj()
        self.__dict__["_xproj_packed"] = None if fused is None else PackedWeight.of(fused[0])
        if fused is not None:
            for lin in self._x_projections():
                lin.__dict__["_packed"] = None

    def packed_count(self) -> int:
        fused, packed = self._linked_xproj(), self.__dict__.get("_xproj_packed")
        return int(fused is not None and packed is not None and packed.matches(fused[0]))

    # ---- projections -------------------------------------------------------------------------------

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] → (cached latent [B, T, C+R], q_nope [B, T, H, Dn], rotated q_pe [B, T, H, R])."""
        native_out = self._native_project(x, cos, sin)
        if native_out is not None:
            return native_out
        # fp32 (the bit-exact reference) keeps two GEMMs: one wider GEMM may round a few outputs differently
        fused = None if torch.is_grad_enabled() or x.dtype == torch.float32 else self._linked_xproj()
        if fused is None:
            return self._module_latent(x, cos, sin), *self.query(x, cos, sin)
        B, T, _ = x.shape
        cfg, H = self.cfg, self.cfg.num_heads
        first = self._x_projections()[0].out_features
        out = packed_linear(x, fused[0], fused[1], self.__dict__.get("_xproj_packed"))
        q, c_kv, k_pe = out.split([first, cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(B, T, H, cfg.qk_head_dim).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        if not cfg.use_nope:  # the query heads and the key in one rotation
            pe = torch.cat((q_pe, k_pe[:, :, None]), 2)
            pe = apply_rope(pe, cos[:, :, None], sin[:, :, None], cfg.rope.interleave)
            q_pe, k_pe = pe[:, :, :H], pe[:, :, H]
        return torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1), q_nope, q_pe

    def _native_project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``project`` as one native call (``mla_project``, dspark/native/mla_project.cpp: the same products, norms,
        rotations and roundings, each row alone) for inference; None where it does not apply (no native kernels,
        grad mode, quantized, biased or mixed-dtype weights)."""
        ops = native.inference_ops()
        if ops is None or not NATIVE_INFERENCE or x.dtype not in NATIVE_DTYPES or cos.shape[:2] != x.shape[:2]:
            return None  # (positions broadcast over the batch: the module path)
        cfg = self.cfg
        lora = cfg.q_lora_rank is not None
        linears = (self.kv_a_proj_with_mqa, *((self.q_a_proj, self.q_b_proj) if lora else (self.q_proj,)))
        norms = (self.kv_a_layernorm, *((self.q_a_layernorm,) if lora else ()))
        if not all(type(m) is Linear and m.bias is None and m.weight.dtype == x.dtype for m in linears) or any(
            n.weight.dtype != x.dtype for n in norms
        ):
            return None
        q_a = self.q_a_layernorm if lora else None
        return ops.mla_project(
            x, cos, sin, linears[1].weight, None if q_a is None else q_a.weight, 0.0 if q_a is None else q_a.eps,
            self.q_b_proj.weight if lora else None, self.kv_a_proj_with_mqa.weight, self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.use_nope,
            cfg.rope.interleave,
        )  # fmt: skip

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → cached latent [B, T, C+R] = [kv_a_layernorm(c_kv) | rope(k_pe)]; in inference the native
        projection's (one call, as ``project``; its queries go unused)."""
        native_out = self._native_project(x, cos, sin)
        return self._module_latent(x, cos, sin) if native_out is None else native_out[0]

    def _module_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1)
        if not self.cfg.use_nope:
            k_pe = apply_rope(k_pe, cos, sin, self.cfg.rope.interleave)
        return torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] → q_nope [B, T, H, Dn], q_pe [B, T, H, R] (rotated)."""
        B, T, _ = x.shape
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, self.cfg.num_heads, self.cfg.qk_head_dim).split(
            [self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], -1
        )
        if not self.cfg.use_nope:
            q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], self.cfg.rope.interleave)
        return q_nope, q_pe

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj weight [H·(Dn+Dv), C] → W_UK [H, Dn, C], W_UV [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.cfg.num_heads, -1, self.cfg.kv_lora_rank)
        return w[:, : self.cfg.qk_nope_head_dim], w[:, self.cfg.qk_nope_head_dim :]

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, C] (a view of kv_b_proj) and W_UV transposed [H, C, Dv], contiguous outside grad mode: CPU
        bf16 GEMMs on a transposed view are ~20x slower. Cached; rebuilt whenever kv_b_proj's weight changes
        (pointer, dtype, in-place version)."""
        if torch.is_grad_enabled():
            w_uk, w_uv = self._w_uk_uv()
            return w_uk, w_uv.transpose(1, 2)
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w.dtype, version_of(w))
        cached = self.__dict__.get("_absorbed_cache")
        if cached is None or cached[0] != key:
            w_uk, w_uv = self._w_uk_uv()
            cached = (key, (w_uk, w_uv.transpose(1, 2).contiguous()))
            self.__dict__["_absorbed_cache"] = cached
        return cached[1]

    # ---- attention over latents ----------------------------------------------------------------------

    def attend_naive(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q_nope [B,T,H,Dn], q_pe [B,T,H,R], kv [B,S,C+R], mask [B,T,S] bool (or its attention_bias) → [B,T,H·Dv]."""
        B, S, _ = kv.shape
        H, Dn, Dv, C = self.cfg.num_heads, self.cfg.qk_nope_head_dim, self.cfg.v_head_dim, self.cfg.kv_lora_rank
        k_nope, v = self.kv_b_proj(kv[..., :C]).view(B, S, H, Dn + Dv).split([Dn, Dv], -1)
        k_pe = kv[..., None, C:].expand(B, S, H, self.cfg.qk_rope_head_dim)
        q = torch.cat((q_nope, q_pe), -1).transpose(1, 2)  # [B, H, T, Dn+R]
        k = torch.cat((k_nope, k_pe), -1).transpose(1, 2)  # [B, H, S, Dn+R]
        if self.backend == "sdpa":
            out = F.scaled_dot_product_attention(
                q, k, v.transpose(1, 2), attn_mask=attention_bias(mask).to(q.dtype), scale=self.scale
            )
            return out.transpose(1, 2).flatten(2)
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        probs = (scores + attention_bias(mask)).softmax(-1).to(v.dtype)
        out = probs @ v.transpose(1, 2)  # [B, H, T, Dv]
        return out.transpose(1, 2).flatten(2)

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Same contract as attend_naive, computed in latent space (MQA with one 576-wide KV head): five large
        matmuls (W_UK absorption, scores, probs·latents, W_UV) batched over requests and heads.

        Long prefill chunks run in blocks of query rows whose fp32 scores stay within ``SCORE_BLOCK`` elements:
        memory stays bounded whatever the depth, and the temporaries are reused instead of being mapped and
        zeroed by the kernel for every layer (a 2,048-row chunk over 8k keys ran 2x faster in 128-row blocks)."""
        B, T, H, _ = q_nope.shape
        rows = max(1, SCORE_BLOCK // max(1, B * H * kv.shape[1]))
        if T <= rows or self.backend == "sdpa":
            return self._attend_absorbed(q_nope, q_pe, kv, mask)
        return torch.cat(
            [
                self._attend_absorbed(q_nope[:, i : i + rows], q_pe[:, i : i + rows], kv, mask[..., i : i + rows, :])
                for i in range(0, T, rows)
            ],
            dim=1,
        )

    def _attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        B, T, H, Dn = q_nope.shape
        C = self.cfg.kv_lora_rank
        w_uk, w_uv_t = self._absorbed_weights()
        q_lat = torch.matmul(q_nope.permute(2, 0, 1, 3).reshape(H, B * T, Dn), w_uk)  # [H, B·T, C]
        q = torch.cat((q_lat.view(H, B, T, C).transpose(0, 1), q_pe.transpose(1, 2)), -1)  # [B, H, T, C+R]
        if self.backend == "sdpa":  # MQA: H query heads over one 576-wide KV head, values = its first C
            kv1 = kv[:, None]  # [B, 1, S, C+R]
            bias = attention_bias(mask).to(q.dtype)
            o_lat = grouped_sdpa(q, kv1, kv1[..., :C], bias, self.scale)  # [B, H, T, C]
        else:
            scores = latent_scores(q.reshape(B, H * T, -1), kv).mul_(self.scale).view(B, H, T, -1)  # fp32
            probs = (scores + attention_bias(mask)).softmax(-1).to(kv.dtype).view(B, H * T, -1)
            o_lat = torch.matmul(probs, kv[..., :C]).view(B, H, T, C)
        out = torch.matmul(o_lat.transpose(0, 1).reshape(H, B * T, C), w_uv_t)  # [H, B·T, Dv]
        return out.view(H, B, T, -1).permute(1, 2, 0, 3).flatten(2)  # [B, T, H·Dv]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        store: LatentStore | None = None,
        absorbed: bool = True,
    ) -> torch.Tensor:
        """x [B,T,D]; cos/sin [B,T,R/2]; mask [B,T,S] or attention_bias [B,1,T,S] (S = T without a store) → [B,T,D]."""
        with scope("attn.proj"):
            latent, q_nope, q_pe = self.project(x, cos, sin)
        with scope("cache"):
            kv = latent if store is None else store.update(self.layer_idx, latent)
        return self.attend_queries(x, (q_nope, q_pe), kv, mask, absorbed)

    def attend_from_kv(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        mask: torch.Tensor,
        absorbed: bool = True,
    ) -> torch.Tensor:
        """Queries from x [B,T,D] over given latents kv [B,S,C+R] → [B,T,D] (used by the drafter's block rows)."""
        with scope("attn.proj"):
            q_nope, q_pe = self.query(x, cos, sin)
        return self.attend_queries(x, (q_nope, q_pe), kv, mask, absorbed)

    def attend_queries(
        self,
        x: torch.Tensor,
        queries: tuple[torch.Tensor, torch.Tensor],
        kv: torch.Tensor,
        mask: torch.Tensor,
        absorbed: bool,
    ) -> torch.Tensor:
        """Projected queries (q_nope, q_pe) over latents kv [B,S,C+R], then the output projection (x feeds the
        output gate)."""
        q_nope, q_pe = queries
        with scope("attn.core"):
            out = self._native_attend(x, q_nope, q_pe, kv, mask) if absorbed else None
            if out is not None:
                return out
            attend = self.attend_absorbed if absorbed else self.attend_naive
            out = attend(q_nope, q_pe, same_dtype(kv, q_nope.dtype), mask)
            if self.cfg.use_output_gate:
                out = out * torch.sigmoid(self.g_proj(x))
            return self.o_proj(out)

    def _native_attend(
        self, x: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """The absorbed core, output gate and o_proj in one native call (``mla_attend``: the torch backend's steps
        and roundings, each query row alone) for inference; None where it does not apply (no native kernels, grad
        mode, sdpa backend, quantized or mismatched weights, other shapes). Long chunks go in blocks of query rows
        whose fp32 scores stay within ``SCORE_BLOCK`` (rows are independent: the blocks change no bit)."""
        B, T, H = q_nope.shape[:3]
        if self.backend != "torch" or not NATIVE_INFERENCE or torch.is_grad_enabled():
            return None
        ops = native.inference_ops()
        dtype = q_nope.dtype
        linears = (self.o_proj, self.kv_b_proj, *((self.g_proj,) if self.cfg.use_output_gate else ()))
        if (
            ops is None
            or dtype not in NATIVE_DTYPES
            or x.dtype != dtype
            or not all(type(m) is Linear and m.weight.dtype == dtype and m.weight.device.type == "cpu" for m in linears)
        ):
            return None
        S = kv.shape[1]
        # a bool mask becomes its bias block by block: a long prefill chunk's whole [T, S] bias (256 MiB for 2,048
        # rows over 32K keys, per layer) would be mapped and zeroed by the kernel each time
        wide = mask.shape == (B, T, S) if mask.dtype == torch.bool else mask.shape == (B, 1, T, S)
        if not wide or mask.dtype not in (torch.bool, torch.float32):
            return None
        kv = same_dtype(kv, dtype)
        rows = max(1, SCORE_BLOCK // max(1, B * H * S))
        parts = [
            self._native_block(ops, x[:, i : i + rows], q_nope[:, i : i + rows], q_pe[:, i : i + rows], kv,
                               attention_bias(mask[:, i : i + rows]) if mask.dtype == torch.bool
                               else mask[:, :, i : i + rows])
            for i in range(0, T, rows)
        ]  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _native_block(
        self, ops: Any, x: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        w_uk_t, w_uv = self._native_weights()
        gate = self.cfg.use_output_gate
        return ops.mla_attend(
            q_nope,
            q_pe,
            kv,
            bias,
            w_uk_t,
            w_uv,
            self.scale,
            x if gate else None,
            self.g_proj.weight if gate else None,
            self.o_proj.weight,
            self.o_proj.bias,
        )

    def _native_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK transposed [H, C, Dn] and W_UV [H, Dv, C], contiguous (rows over the reduced dim, as the kernel
        reads them); cached like ``_absorbed_weights``."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w.dtype, version_of(w))
        cached = self.__dict__.get("_native_cache")
        if cached is None or cached[0] != key:
            w_uk, w_uv = self._w_uk_uv()
            cached = (key, (w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()))
            self.__dict__["_native_cache"] = cached
        return cached[1]


def latent_scores(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """q [B, M, W] · kv [B, S, W]ᵀ → contiguous fp32 [B, M, S]. In reduced precision the product is taken as
    (kv · qᵀ)ᵀ: CPU bf16 GEMMs with a transposed right operand are ~10x slower, and qᵀ is small to copy."""
    if q.dtype == torch.float32:
        return torch.matmul(q, kv.transpose(1, 2))
    scores_t = torch.matmul(kv, q.transpose(1, 2).contiguous())  # [B, S, M]
    return scores_t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
