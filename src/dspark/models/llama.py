"""The GQA target family: Llama, Qwen2 and Qwen3 decoders over paged K/V rows.

Parameter names equal HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` names
(``model.layers.{i}.self_attn.q_proj.weight``, ``model.layers.{i}.mlp.gate_proj.weight``, ...), so HF checkpoints
load without renaming. One page row per token per layer holds ``[rope(k) | v]`` of every KV head
(2·n_kv·head_dim values; 384 for SmolLM2), the same layout as DeepSpec's GQA drafters, so a drafter with the
target's KV geometry shares the pool. Taps: layer i's raw output (HF ``hidden_states[i+1]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import dspark.native as native
from dspark.config import GQATargetConfig
from dspark.models.layers import (
    CAUSAL,
    Backbone,
    DecoderTarget,
    RMSNorm,
    SwiGLU,
    attention_bias,
    causal_mask,
    causal_sdpa,
    fuse_rows,
    grouped_sdpa,
    is_reduced_precision,
    no_empty_rows,
    remembered_rows,
    same_dtype,
)
from dspark.models.packing import Linear, Packable, PackedWeight, packed_linear
from dspark.models.protocol import CacheView, PageFormat, TargetOutput, head_output
from dspark.models.quantized import QuantGroup, QuantLinear
from dspark.models.rope import apply_rope_half, half_rotation_tables
from dspark.profiling import scope

# a GGUF layer runs as one native call for every row count (decode, verification, prefill chunks): another path
# for longer chunks would make a prompt's rows depend on the chunks it was prefilled in; tests lower it to run the
# modules
NATIVE_LAYER_ROWS: int | None = None


class GQAttention(nn.Module, Packable):
    """Grouped-query attention (H query heads share n_kv K/V heads); Qwen3 adds RMSNorm over q and k heads.

    Inference in bf16/fp16 (``fuse()``, no grad) runs q/k/v as one GEMM over a fused weight and rotates q and k in
    one call; fp32, training and unfused modules run the three projections (the same values up to rounding:
    tested)."""

    def __init__(self, cfg: GQATargetConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(D, self.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(D, self.num_kv * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(D, self.num_kv * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * hd, D, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = hd**-0.5

    # ---- fused q|k|v for inference ----------------------------------------------------------------------
    def fuse(self) -> None:
        """Store q/k/v weights (and biases) as row blocks of one tensor; idempotent. Quantized projections
        (``QuantLinear``) are grouped instead: their blocks concatenated for one product, each keeping a row slice
        (mixed block types stay three products)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        if any(isinstance(p, QuantLinear) for p in parts):
            self.__dict__["_qkv_quant"] = QuantGroup.regroup(self.__dict__.get("_qkv_quant"), parts)
            return
        if self._linked_qkv() is None:
            self.__dict__["_qkv"] = fuse_rows((self.q_proj, self.k_proj, self.v_proj))

    def _linked_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return remembered_rows(self, "_qkv", (self.q_proj, self.k_proj, self.v_proj))

    def pack(self) -> None:
        fused = self._linked_qkv()
        self.__dict__["_qkv_packed"] = None if fused is None else PackedWeight.of(fused[0])
        if fused is not None:
            for lin in (self.q_proj, self.k_proj, self.v_proj):
                lin.__dict__["_packed"] = None

    def packed_count(self) -> int:
        fused, packed = self._linked_qkv(), self.__dict__.get("_qkv_packed")
        return int(fused is not None and packed is not None and packed.matches(fused[0]))

    # ---- projections ------------------------------------------------------------------------------------
    def kv_rows(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """x [B, T, D]; rotation tables [B, T, 1, hd] (``half_rotation_tables``) → page rows [B, T, 2·n_kv·hd]
        = [rope(k) | v]."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope_half(k, cos2, sin2)
        return torch.cat((k.flatten(2), self.v_proj(x)), -1)

    def project(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D]; rotation tables [B, T, 1, hd] → (rope(q) [B, H, T, hd], page rows [B, T, 2·n_kv·hd])."""
        B, T, _ = x.shape
        H, n_kv, hd = self.num_heads, self.num_kv, self.head_dim
        group = self.__dict__.get("_qkv_quant")
        quant = None if group is None else group.current((self.q_proj, self.k_proj, self.v_proj), x)
        # fp32 (the bit-exact reference) keeps three GEMMs: one wider GEMM may round a few outputs differently
        fused = None if quant is not None or torch.is_grad_enabled() or x.dtype == torch.float32 else self._linked_qkv()
        if quant is None and fused is None:
            rows = self.kv_rows(x, cos2, sin2)
            q = self.q_proj(x).view(B, T, H, hd)
            if self.q_norm is not None:
                q = self.q_norm(q)
            q = apply_rope_half(q, cos2, sin2)
            return q.transpose(1, 2), rows
        if quant is not None:  # GGUF blocks: one native product for q|k|v
            qkv = same_dtype(quant.forward_f32(x), x.dtype).view(B, T, H + 2 * n_kv, hd)
        else:
            qkv = packed_linear(x, fused[0], fused[1], self.__dict__.get("_qkv_packed")).view(B, T, H + 2 * n_kv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H : H + n_kv])), 2)
        else:
            qk = qkv[:, :, : H + n_kv]
        qk = apply_rope_half(qk, cos2, sin2)  # q and k heads in one call
        rows = torch.cat((qk[:, :, H:].flatten(2), qkv[:, :, H + n_kv :].flatten(2)), -1)
        return qk[:, :, :H].transpose(1, 2), rows

    def forward(self, x, cos2, sin2, mask: torch.Tensor, cache: CacheView | None) -> torch.Tensor:
        """x [B, T, D]; rotation tables [B, T, 1, hd] (``half_rotation_tables``); mask [B, T, S] (or its
        attention_bias [B, 1, T, S]) over the keys the cache returns → [B, T, D]."""
        B, T, _ = x.shape
        with scope("attn.proj"):
            q, rows = self.project(x, cos2, sin2)  # q [B, H, T, hd]
        if cache is not None and mask is not CAUSAL:
            out = self.attend_in_place(q, rows, mask, cache)
            if out is not None:
                return self.o_proj(out.transpose(1, 2).flatten(2))
        with scope("cache"):
            kv = rows if cache is None else cache.update(self.layer_idx, rows)
        with scope("attn.core"):
            S = kv.shape[1]
            kv = same_dtype(kv, q.dtype)
            k, v = kv.view(B, S, 2, self.num_kv, self.head_dim).unbind(2)  # [B, S, n_kv, hd] each
            if mask is CAUSAL:
                out = causal_sdpa(q, k.transpose(1, 2), v.transpose(1, 2), self.scale)
            else:
                bias = same_dtype(attention_bias(mask), q.dtype)
                out = grouped_sdpa(q, k.transpose(1, 2), v.transpose(1, 2), bias, self.scale)
            return self.o_proj(out.transpose(1, 2).flatten(2))

    def attend_in_place(self, q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, cache: CacheView):
        """Attention over the paged cache, any number of rows (decode, verification, prefill): write the new rows,
        then the native kernel reads keys and values where they lie in the pool (no gathered copy), each query row
        alone, so a row's result does not depend on its chunk, a cached prefix or the batch; None where the cache or
        the kernels cannot (the caller's path, torch's attention, then writes the same rows again)."""
        attend = getattr(cache, "paged_attention", None)
        if attend is None or native.inference_ops() is None:  # grad mode: torch's (the kernel has no backward)
            return None
        with scope("cache"):
            cache.write(self.layer_idx, rows)
        with scope("attn.core"):
            bias = attention_bias(mask)
            return attend(self.layer_idx, q, bias, self.num_kv, self.num_kv * self.head_dim, self.scale)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GQATargetConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GQAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)  # Llama's MLP

    def forward(self, h, cos2, sin2, mask, cache: CacheView | None) -> torch.Tensor:
        fused = self.native_forward(h, cos2, sin2, mask, cache)
        if fused is not None:
            return fused
        with scope("norm"):
            x = self.input_layernorm(h)
        a = self.self_attn(x, cos2, sin2, mask, cache)
        with scope("norm"):
            x, h = self.post_attention_layernorm.add_forward(a, h)  # h + a, then its norm
        with scope("mlp"):
            return h + self.mlp(x)

    def native_forward(self, h, cos2, sin2, mask, cache: CacheView | None) -> torch.Tensor | None:
        """The whole layer as one native call (``gqa_layer``, dspark/native/layer.cpp) where it applies: fp32
        inference over GGUF blocks (q|k|v and gate|up grouped, o and down quantized, the native norms), a paged
        fp32 cache, any number of rows per sequence (``NATIVE_LAYER_ROWS``), however many sequences. A decode step,
        a verification and a prefill chunk all take it, row by row the same arithmetic whatever shares the forward
        (24 requests' verifications are 192 rows; another path above some row count would change a row's result), so
        speculative output equals plain decoding and a prompt's rows do not depend on its chunks;
        None elsewhere (the modules below run)."""
        B, T, _ = h.shape
        if (NATIVE_LAYER_ROWS is not None and T > NATIVE_LAYER_ROWS) or h.dtype != torch.float32 or mask is CAUSAL:
            return None
        plane_of = getattr(cache, "plane_and_slots", None)
        ops = native.ops()
        if plane_of is None or ops is None or torch.is_grad_enabled() or not hasattr(ops, "gqa_layer"):
            return None
        weights = self.native_weights()
        if weights is None or not h.is_contiguous():
            return None
        plane, writes, slots = plane_of(self.self_attn.layer_idx)
        bias = mask[:, 0]
        if plane.dtype != torch.float32 or bias.dtype != torch.float32:
            return None
        qkv, o, gate_up, down = weights
        attn = self.self_attn
        with scope("layer"):
            return ops.gqa_layer(
                h, self.input_layernorm.weight, self.post_attention_layernorm.weight, self.input_layernorm.eps,
                *_blocks(qkv), *_blocks(o), *_blocks(gate_up), *_blocks(down),
                cos2, sin2, plane, writes, slots, bias.contiguous(),
                attn.num_heads, attn.num_kv, attn.head_dim, attn.scale, qkv.int8,
            )  # fmt: skip

    def native_weights(self) -> tuple[QuantLinear, QuantLinear, QuantLinear, QuantLinear] | None:
        """(q|k|v, o, gate|up, down) as block products while the layer still holds exactly those modules, else
        None (dense weights, unfused or mixed block types, per-head q/k norms, another activation)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, gate_up = attn.__dict__.get("_qkv_quant"), mlp.__dict__.get("_gate_up_quant")
        o, down = attn.o_proj, mlp.down_proj
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if (
            qkv is None
            or gate_up is None
            or not isinstance(o, QuantLinear)
            or not isinstance(down, QuantLinear)
            or attn.q_norm is not None
            or type(mlp).activate is not SwiGLU.activate
            or not all(n.__dict__.get("_native") and n.eps == norms[0].eps for n in norms)
            or not qkv.holds((attn.q_proj, attn.k_proj, attn.v_proj))
            or not gate_up.holds((mlp.gate_proj, mlp.up_proj))
            or len({qkv.fused.int8, o.int8, gate_up.fused.int8, down.int8}) != 1
        ):
            return None
        return qkv.fused, o, gate_up.fused, down


def _blocks(lin: QuantLinear) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    return *lin.kernel_blocks(), lin.bias_f32


def stack_identity(layers: Sequence[DecoderLayer]) -> list:
    """Every object ``stack_arguments`` reads, by identity: each layer, its modules (and theirs), the q|k|v and
    gate|up groups, each module's blocks, fp32 bias, weight and native flag, and the norms' eps. A forward
    compares it with the last one's (the same object at every place, ~0.1 ms for 30 layers against ~0.9 ms to check and
    collect the arguments again): any module, group or weight swapped since means the arguments are collected anew."""
    key: list = [len(layers)]
    for layer in layers:
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        key += (layer, attn.__dict__.get("_qkv_quant"), mlp.__dict__.get("_gate_up_quant"))
        for m in (*layer._modules.values(), *attn._modules.values(), *mlp._modules.values()):
            if m is None:
                key.append(None)
                continue
            d = m.__dict__
            key += (m, d.get("qweight"), d.get("bias_f32"), d.get("_native"), d.get("eps"))
            key.append(d["_parameters"].get("weight"))
    return key


def stack_arguments(layers: Sequence[DecoderLayer]) -> tuple | None:
    """gqa_stack's per-layer lists (norms, blocks, types, biases) and the shared settings (eps, heads, KV heads,
    head size, scale, int8), when every layer would run as one native call (``native_weights``) with the same
    settings, in pool order; else None."""
    norms, blocks, types, biases, shared = [], [], [], [], None
    for i, layer in enumerate(layers):
        weights, attn = layer.native_weights(), layer.self_attn
        if weights is None or attn.layer_idx != i:
            return None
        settings = (layer.input_layernorm.eps, attn.num_heads, attn.num_kv, attn.head_dim, attn.scale, weights[0].int8)
        if shared not in (None, settings):
            return None
        shared = settings
        norms += (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        for lin in weights:
            blk, qtype, bias = _blocks(lin)
            blocks.append(blk)
            types.append(qtype)
            biases.append(bias)
    return (norms, blocks, types, biases, shared) if shared is not None else None


class LlamaTarget(DecoderTarget):
    """Llama / Qwen2 / Qwen3 decoder over a batch of sequences with a paged K/V cache (a ``Target``)."""

    tap_streams = ("residual",)  # what a tap can read: the output of its decoder layer

    def __init__(self, cfg: GQATargetConfig) -> None:
        layers = (DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        model = Backbone(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        super().__init__(cfg, model, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope)

    @property
    def page_format(self) -> PageFormat:
        cfg = self.config
        return PageFormat("gqa", 2 * cfg.num_key_value_heads * cfg.head_dim, cfg.num_hidden_layers)

    def native_stack(
        self, h: torch.Tensor, cos2, sin2, mask, cache: CacheView | None, taps: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Every layer in one native call (``gqa_stack``: each layer's ``gqa_layer``, one dispatch per forward instead
        of a Python call per layer) where every layer would take its native call; (h, the tapped layers' outputs),
        or None (the layers run one by one)."""
        B, T, _ = h.shape
        stack_of = getattr(cache, "pool_and_slots", None)
        ops = native.ops()
        if (
            stack_of is None
            or ops is None
            or not hasattr(ops, "gqa_stack")
            or torch.is_grad_enabled()
            or (NATIVE_LAYER_ROWS is not None and T > NATIVE_LAYER_ROWS)
            or h.dtype != torch.float32
            or mask is CAUSAL
            or not h.is_contiguous()
        ):
            return None
        args = self.stack_arguments()
        pool, offset, writes, slots = stack_of()
        if args is None or pool.dtype != torch.float32 or mask.dtype != torch.float32:
            return None
        norms, blocks, types, biases, (eps, H, n_kv, hd, scale, int8) = args
        with scope("layer"):
            return ops.gqa_stack(
                h, norms, eps, blocks, types, biases, cos2, sin2, pool, offset, writes, slots, mask[:, 0].contiguous(),
                H, n_kv, hd, scale, int8, taps,
            )  # fmt: skip

    def stack_arguments(self) -> tuple | None:
        """``stack_arguments`` of the layers, remembered while ``stack_identity`` finds the same objects."""
        key = stack_identity(self.model.layers)
        ids, memo = tuple(map(id, key)), self.__dict__.get("_stack_memo")
        if memo is not None and memo[1] == ids:  # the memo keeps its objects alive: an equal id is the same object
            return memo[2]
        args = stack_arguments(self.model.layers)
        self.__dict__["_stack_memo"] = (key, ids, args)
        return args

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: CacheView | None = None,
        tap_layers: Sequence[int] = (),
        logits_rows: torch.Tensor | None = None,
        absorbed: bool = True,  # MLA's attention form, chosen by code that drives every family: GQA has one
        compute_logits: bool = True,
    ) -> TargetOutput:
        """input_ids [B, T]; positions [B, T] (default 0..T-1); mask [B, T, S] bool (default causal, S = T);
        logits_rows [B, N] row indices into T (default all rows)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        with scope("embed"):
            if mask is None and cache is None and is_reduced_precision():
                mask = CAUSAL  # a whole-sequence prefill (training features): torch's causal kernel, no bias
            else:
                mask = no_empty_rows(causal_mask(positions, positions) if mask is None else mask)
                mask = attention_bias(mask).to(self.model.embed_tokens.weight.dtype)  # once for every layer
            cos2, sin2 = half_rotation_tables(*self.rotary.cos_sin(positions))  # once for every layer
            h = self.model.embed_tokens(input_ids)
        wanted = set(tap_layers)
        taps = [h] if -1 in wanted else []
        tapped_layers = sorted(i for i in wanted if 0 <= i < len(self.model.layers))
        stacked = self.native_stack(h, cos2, sin2, mask, cache, tapped_layers)
        if stacked is not None:
            h, tapped = stacked
            taps += tapped
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, cos2, sin2, mask, cache)
                if i in wanted:
                    taps.append(h)
        with scope("lm_head"):
            h = self.model.norm(h)
            return head_output(h, taps, logits_rows, self.compute_logits if compute_logits else None)
