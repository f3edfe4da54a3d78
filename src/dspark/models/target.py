"""The MLA target: the DeepSeek-V3 / Kimi-K2 decoder (MLA, dense first layers, MoE with shared experts).

Parameter names equal the HF ``DeepseekV3ForCausalLM`` names (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...), so HF checkpoints load without renaming.
Taps: ``target_layer_ids[i]`` is the output of decoder layer i (HF ``hidden_states[i+1]``), never the final
post-norm state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.config import TargetConfig
from dspark.models.layers import (
    Backbone,
    DecoderTarget,
    RMSNorm,
    SwiGLU,
    attention_bias,
    causal_mask,
    no_empty_rows,
    remembered_link,
    weights_of,
)
from dspark.models.mla import LatentStore, MLAttention
from dspark.models.packing import Packable, version_of
from dspark.models.protocol import PageFormat, TargetOutput, head_output
from dspark.profiling import scope

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) → hidden


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MoEGate(nn.Module):
    """Sigmoid (or softmax) router with the noaux_tc correction bias and group-limited top-k."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None and cfg.num_experts_per_tok is not None
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # as nn.Linear: never uninitialised memory (NaN routing)
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=True)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] → expert indices [N, k], weights [N, k] (fp32)."""
        cfg = self.cfg
        weight, bias = self._fp32_params()
        logits = F.linear(x.float(), weight)
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores if bias is None else scores + bias
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = choice.view(x.shape[0], cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(-1).values
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights if cfg.routed_scaling_factor == 1.0 else weights * cfg.routed_scaling_factor

    def _fp32_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The router's weight and correction bias in fp32. Outside grad mode the copies are cached (rebuilt when
        either tensor changes: pointer, dtype, in-place version), so a bf16 model does not convert them per step."""
        w, b = self.weight, self.e_score_correction_bias
        if torch.is_grad_enabled():
            return w.float(), None if b is None else b.float()
        key = (w.data_ptr(), w.dtype, version_of(w), None if b is None else (b.data_ptr(), b.dtype, version_of(b)))
        cached = self.__dict__.get("_fp32_cache")
        if cached is None or cached[0] != key:
            cached = (key, (w.float(), None if b is None else b.float()))
            self.__dict__["_fp32_cache"] = cached
        return cached[1]


class MoE(nn.Module, Packable):
    """Routed experts (top-k of ``MoEGate``) + shared experts. ``make_expert(width, intermediate)`` builds each
    expert (SwiGLU, or a subclass with another activation); routed experts read ``width``-wide inputs (the
    hidden size, or a latent for K3's latent MoE), shared ones the hidden state."""

    def pack(self) -> None:
        """Stacked routed experts run batched GEMMs on the stacks: their per-expert packs would go unused."""
        if self._linked_stack() is not None:
            for expert in self.experts:
                expert.__dict__["_gate_up_packed"] = None
                expert.down_proj.__dict__["_packed"] = None

    def packed_count(self) -> int:
        return 0

    def __init__(
        self,
        cfg: TargetConfig,
        make_expert: Callable[[int, int], SwiGLU] = SwiGLU,
        width: int | None = None,
    ) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.gate = MoEGate(cfg)
        self.experts = nn.ModuleList(
            make_expert(width or cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        if cfg.n_shared_experts:
            self.shared_experts = make_expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])
        fused = self.native_forward(flat)
        if fused is not None:
            return fused.view_as(x)
        with scope("moe.route"):
            idx, weights = self.gate(flat)
        with scope("moe.experts"):
            stacked = self.stacked_experts()
            if stacked is None:
                out = self._routed_loop(flat, idx, weights)
            else:
                out = routed_experts(flat, idx, weights, self._stacked, stacked, self.experts[0].activate)
            if self.shared_experts is not None:
                out = out + self.shared_experts(flat)
        return out.view_as(x)

    def native_forward(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The whole block (router, routed experts, latent projections, shared expert, sum) as one native call
        (``moe_rows``, dspark/native/moe.cpp) for any number of rows (decode, verification, prefill) in
        inference on stacked experts: ~100-460 eager ops per layer become one. Rows are computed alone (a row's
        result does not depend on the batch: speculation stays lossless); the result equals the module path up to
        the order of the GEMM sums (fp32) or bf16/fp16 rounding. None where it does not apply (then the module path
        runs): no native build, grad mode, unstacked or quantized weights, mixed dtypes."""
        too_many = NATIVE_MOE_ROWS is not None and flat.shape[0] > NATIVE_MOE_ROWS
        if too_many or flat.dtype not in NATIVE_MOE_DTYPES or self.stacked_experts() is None:
            return None
        ops = native.inference_ops()
        cfg, dtype = self.gate.cfg, flat.dtype
        act, latent = self.native_activation(), self.native_latent(dtype)
        if ops is None or act is None or latent is None:
            return None
        gate_up, down = self._stacked
        shared = (None, None)
        if self.shared_experts is not None:
            se = self.shared_experts
            shared = (se.fused_gate_up(), plain_weight(se.down_proj, dtype))
            if se.__dict__.get("_gate_up_bias") is not None or any(w is None or w.dtype != dtype for w in shared):
                return None
        if gate_up.dtype != dtype or down.dtype != dtype:
            return None
        router, bias = self.gate._fp32_params()
        groups = 0 if cfg.topk_method == "greedy" or cfg.n_group == 1 else 1 if cfg.topk_method == "noaux_tc" else 2
        with scope("moe.experts"):
            return ops.moe_rows(
                flat, router, bias, cfg.num_experts_per_tok, cfg.scoring_func == "softmax", cfg.norm_topk_prob,
                cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group, groups, gate_up, down, *latent, *shared, *act
            )  # fmt: skip

    def native_activation(self) -> tuple[int, float, float] | None:
        """The experts' activation for ``moe_rows``, as their MLP states it for ``glu``."""
        return self.experts[0].native_activation()

    def native_latent(self, dtype: torch.dtype) -> tuple | None:
        """``moe_rows``' latent arguments (down weight, norm weight, eps, up weight): none here (K3: its latent)."""
        return (None, None, 0.0, None)

    def _routed_loop(self, flat: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference path (training / unfused weights): one masked pass per expert that received tokens."""
        out = torch.zeros_like(flat)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows]) * weights[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        return out

    def fuse(self) -> None:
        """Store the routed experts' weights stacked, gate|up as [E, 2I, D] and down as [E, D, I], with every
        expert's parameters re-pointed as views into them (names and values unchanged; no extra memory)."""
        if self._linked_stack() is not None:
            return  # already fused
        first = self.experts[0]
        E, (inter, D) = len(self.experts), first.gate_proj.weight.shape
        gate_up = first.gate_proj.weight.new_empty(E, 2 * inter, D)
        down = first.down_proj.weight.new_empty(E, D, inter)
        for e, expert in enumerate(self.experts):
            expert.fuse(gate_up[e])
            with torch.no_grad():
                down[e].copy_(expert.down_proj.weight)
            expert.down_proj.weight = nn.Parameter(down[e], requires_grad=expert.down_proj.weight.requires_grad)
        self._stacked = (gate_up, down)
        self._expert_views = list(zip(gate_up.unbind(0), down.unbind(0)))  # built once, not per forward
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def stacked_experts(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per expert (gate_up [2I, D], down [D, I]) views of the stacked weights while every expert still lives
        in them; None in grad mode (training keeps the reference loop)."""
        if torch.is_grad_enabled() or self._linked_stack() is None:
            return None
        return self._expert_views

    def _linked_stack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return remembered_link(
            self,
            "_stack_memo",
            self._check_stack,
            lambda: weights_of(m for e in self.experts for m in (e.gate_proj, e.up_proj, e.down_proj)),
        )

    def _check_stack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        stacked = self.__dict__.get("_stacked")
        if stacked is None:
            return None
        gate_up, down = stacked
        gu0, gu_step = gate_up.data_ptr(), gate_up.stride(0) * gate_up.element_size()
        d0, d_step = down.data_ptr(), down.stride(0) * down.element_size()
        for e, expert in enumerate(self.experts):  # pointer arithmetic only: no tensor op per expert
            g = expert._linked_gate_up()
            if g is None or g.data_ptr() != gu0 + e * gu_step or expert.down_proj.weight.data_ptr() != d0 + e * d_step:
                return None
            if expert.down_proj.weight.dtype != down.dtype:
                return None
        return stacked


# MoE.native_forward up to this many rows (None: any count). No cap by default: a larger batch taking another path
# (batched GEMMs that sum in another order) would make a row's bf16 result depend on the batch it shares, and greedy
# speculation then differs from plain decoding. A test may set a cap to exercise the module path.
NATIVE_MOE_ROWS: int | None = None
# ... in these dtypes: every one, fp32 too (its batched GEMMs would make a row depend on its batch and chunk; the
# module path stays the reference, in grad mode and with the native kernels off)
NATIVE_MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def plain_weight(lin: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """A bias-free ``nn.Linear``'s contiguous weight in ``dtype`` (what a native product can read), else None."""
    ok = isinstance(lin, nn.Linear) and lin.bias is None and lin.weight.dtype == dtype and lin.weight.is_contiguous()
    return lin.weight if ok else None


def grouped_experts(
    flat: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    act: Activation = silu_mul,
) -> torch.Tensor:
    """Routed experts in one grouped pass: flat [N, D], idx/weights [N, k], experts[e] = (gate_up [2I, D],
    down [D, I]) → [N, D]. The N·k (token, expert) pairs are sorted by expert once (one host read of the
    per-expert counts) and split into contiguous groups; each expert with tokens runs two GEMMs on its group;
    results are summed per token in ascending expert order, as the per-expert reference loop does."""
    k = idx.shape[1]
    order = idx.reshape(-1).argsort(stable=True)  # pairs grouped by expert, ascending
    rows = order // k  # token of each sorted pair
    counts = torch.bincount(idx.reshape(-1), minlength=len(experts)).tolist()
    outs = []
    for (gate_up, down), x in zip(experts, flat.index_select(0, rows).split(counts)):
        if x.shape[0]:
            g, u = F.linear(x, gate_up).chunk(2, dim=-1)
            outs.append(F.linear(act(g.contiguous(), u), down))  # contiguous gate: see SwiGLU
    y = torch.cat(outs) * weights.reshape(-1)[order, None].to(flat.dtype)
    return torch.zeros_like(flat).index_add_(0, rows, y)


DENSE_EXPERT_ROWS = 256  # bf16: every expert on every token while N·E stays within this (measured crossover)


def routed_experts(
    flat: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    stacks: tuple[torch.Tensor, torch.Tensor],
    views: Sequence[tuple[torch.Tensor, torch.Tensor]],
    act: Activation = silu_mul,
) -> torch.Tensor:
    """The routed experts of N tokens by the cheapest exact pass for their size. fp32 (the bit-exact reference)
    always takes ``grouped_experts``. In bf16/fp16, measured on k3-mini's experts (E = 8, I = D = 256, top-2):
    a few pairs (N·k ≤ E/2: decode) gather their experts' weights (112 vs 131 µs at N = 1); small batches
    (N·E ≤ ``DENSE_EXPERT_ROWS``: an 8-token verify) run every expert on every token as two batched GEMMs and
    weight the results (207 vs 408 µs at N = 8); larger ones group tokens by expert."""
    N, k = idx.shape
    E = len(views)
    if flat.dtype == torch.float32:
        return grouped_experts(flat, idx, weights, views, act)
    if 2 * N * k <= E:
        return gathered_experts(flat, idx, weights, *stacks, act)
    if N * E <= DENSE_EXPERT_ROWS:
        return dense_experts(flat, idx, weights, *stacks, act)
    return grouped_experts(flat, idx, weights, views, act)


def dense_experts(
    flat: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_mul,
) -> torch.Tensor:
    """Every expert on every token (two batched GEMMs over the stacks), then each token's routed outputs weighted
    by a dense [N, E] routing matrix (zero for experts it did not pick): no host read, no per-expert loop."""
    N, E = flat.shape[0], gate_up.shape[0]
    g, u = torch.bmm(flat.expand(E, N, flat.shape[1]), gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(act(g, u), down.transpose(1, 2))  # [E, N, D]
    route = y.new_zeros(N, E).scatter_(1, idx, weights.to(y.dtype))
    return torch.bmm(route[:, None, :], y.transpose(0, 1)).squeeze(1)  # Σ_e route[n, e] · y[e, n]


def gathered_experts(
    flat: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Activation = silu_mul,
) -> torch.Tensor:
    """Routed experts for a few tokens (decode: N·k pairs ≤ E/2): each (token, expert) pair's weights are gathered
    from the stacks (gate_up [E, 2I, D], down [E, D, I]) and the pairs run as two batched GEMMs, with no host
    read and no per-expert loop: ~14 tensor ops instead of ~6 per expert hit. For bf16/fp16 (fp32, the bit-exact
    reference, keeps ``grouped_experts``); equal to it up to bf16 rounding (tested)."""
    N, k = idx.shape
    sel = idx.reshape(-1)
    x = flat[:, None, :].expand(N, k, flat.shape[1]).reshape(N * k, 1, -1)
    g, u = torch.bmm(x, gate_up.index_select(0, sel).transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(act(g, u), down.index_select(0, sel).transpose(1, 2)).view(N, k, -1)
    return (y * weights[..., None].to(y.dtype)).sum(1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg.mla, layer_idx)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer_idx) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, mask, store: LatentStore | None, absorbed: bool) -> torch.Tensor:
        with scope("norm"):
            x = self.input_layernorm(h)
        h = h + self.self_attn(x, cos, sin, mask, store, absorbed)
        with scope("norm"):
            x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            return h + self.mlp(x)
        with scope("mlp"):
            return h + self.mlp(x)


class MLATarget(DecoderTarget):
    """DeepSeek-V3 / Kimi-K2 decoder over a batch of sequences with a shared latent store."""

    tap_streams = ("residual",)  # what a tap can read: the output of its decoder layer

    def __init__(self, cfg: TargetConfig) -> None:
        layers = (DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        model = Backbone(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        super().__init__(cfg, model, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope)

    # the Target protocol ---------------------------------------------------------------------------
    @property
    def page_format(self) -> PageFormat:
        return PageFormat("mla", self.config.mla.latent_dim, self.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        store: LatentStore | None = None,
        tap_layers: Sequence[int] = (),
        logits_rows: torch.Tensor | None = None,
        absorbed: bool = True,
        compute_logits: bool = True,
    ) -> TargetOutput:
        """input_ids [B, T]; positions [B, T] (default 0..T-1); mask [B, T, S] bool (default causal, S = T);
        logits_rows [B, N] row indices into T (default all rows)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if mask is None:
            mask = causal_mask(positions, positions)
        with scope("embed"):
            mask = attention_bias(no_empty_rows(mask))  # once for every layer
            cos, sin = self.rotary.cos_sin(positions)
            h = self.model.embed_tokens(input_ids)
        taps: list[torch.Tensor] = []
        wanted = set(tap_layers)
        if -1 in wanted:
            taps.append(h)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, mask, store, absorbed)
            if i in wanted:
                taps.append(h)
        with scope("lm_head"):
            h = self.model.norm(h)
            return head_output(h, taps, logits_rows, self.compute_logits if compute_logits else None)
