"""The MLA target: the DeepSeek-V3 / Kimi-K2 decoder (MLA, dense first layers, MoE with shared experts).

Parameter names equal the HF ``DeepseekV3ForCausalLM`` names (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, ...), so HF checkpoints load without renaming.
Taps: ``target_layer_ids[i]`` is the output of decoder layer i (HF ``hidden_states[i+1]``), never the final
post-norm state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import TargetConfig
from dspark.models.layers import RMSNorm, SwiGLU, causal_mask, no_empty_rows
from dspark.models.mla import LatentStore, MLAttention
from dspark.models.protocol import PageFormat, StateSpec, TargetOutput
from dspark.models.rope import RotaryEmbedding


class MoEGate(nn.Module):
    """Sigmoid (or softmax) router with the noaux_tc correction bias and group-limited top-k."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None and cfg.num_experts_per_tok is not None
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts), persistent=True)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] → expert indices [N, k], weights [N, k] (fp32)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
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
        return idx, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts is not None
        self.gate = MoEGate(cfg)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        if cfg.n_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → [B, T, D]; loops over the experts that received tokens."""
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows]) * weights[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


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
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, store, absorbed)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLATarget(nn.Module):
    """DeepSeek-V3 / Kimi-K2 decoder over a batch of sequences with a shared latent store."""

    tap_streams = ("residual",)  # what a tap can read: the output of its decoder layer

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope)

    # the Target protocol ---------------------------------------------------------------------------
    @property
    def page_format(self) -> PageFormat:
        return PageFormat("mla", self.config.mla.latent_dim, self.config.num_hidden_layers)

    @property
    def state_spec(self) -> StateSpec | None:
        return None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def latent_dim(self) -> int:
        return self.config.mla.latent_dim

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [..., D] → fp32 logits [..., V]."""
        return self.lm_head(hidden).float()

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
        mask = no_empty_rows(mask)
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
        h = self.model.norm(h)
        logits = None
        if compute_logits:
            rows = h if logits_rows is None else h.gather(1, logits_rows[..., None].expand(-1, -1, h.shape[-1]))
            logits = self.compute_logits(rows)
        return TargetOutput(logits=logits, taps=torch.cat(taps, -1) if taps else None, hidden=h)
