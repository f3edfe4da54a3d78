"""The hybrid KDA + MLA target: the Kimi Linear decoder (and, behind config keys, Kimi K3's additions).

Layers follow ``layer_types``: "linear_attention" → Kimi Delta Attention (models/kda.py), "full_attention" → MLA
(models/mla.py, NoPE with ``mla_use_nope``, optional sigmoid output gate). FFNs follow ``mlp_layer_types``: dense
SwiGLU or the MoE of models/target.py (sigmoid router with correction bias, shared experts).
MLA layers are numbered 0..L_mla-1 in the latent store (only they have pages); KDA layers 0..L_kda-1 in the state
store. Module names are ours; ``checkpoint_name`` maps them to the names transformers' ``save_pretrained`` writes
for ``KimiLinearForCausalLM`` (Moonshot's layout: ``block_sparse_moe``, experts ``w1/w2/w3``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

import torch
from torch import nn

from dspark.config import KimiLinearConfig
from dspark.models.k3 import AttnResStream, GatedMLP, K3MoE, ResidualStream, ResMix
from dspark.models.kda import KimiDeltaAttention, StateStore
from dspark.models.layers import DecoderTarget, RMSNorm, SwiGLU, causal_mask, no_empty_rows
from dspark.models.mla import LatentStore, MLAttention
from dspark.models.protocol import PageFormat, StateSpec, head_output
from dspark.models.target import MoE, TargetOutput
from dspark.profiling import scope

_NO_SCOPE = contextlib.nullcontext()

_EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_RES_MIX = re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")


def checkpoint_name(name: str, dense_prefix: str = "block_sparse_moe") -> str:
    """Our parameter name → the Kimi Linear checkpoint name. ``dense_prefix`` names the dense FFN ("mlp" in
    Moonshot's files, "block_sparse_moe" in transformers' save_pretrained output)."""
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.", name)
    name = _RES_MIX.sub(r"\1_\2.", name)
    if any(f".mlp.{part}" in name for part in ("experts.", "gate.", "shared_experts.", "latent_")):
        return name.replace(".mlp.", ".block_sparse_moe.")
    return name.replace(".mlp.", f".{dense_prefix}.")


def _ffn(cfg: KimiLinearConfig, layer_idx: int) -> nn.Module:
    """Dense or MoE FFN; the MLA target's SwiGLU / MoE unless a K3 addition (SiTU, latent MoE) is on."""
    sparse = cfg.mlp_layer_types[layer_idx] == "sparse"
    if cfg.hidden_act == "silu" and not (sparse and cfg.moe_latent_size):
        return MoE(cfg.base) if sparse else SwiGLU(cfg.base.hidden_size, cfg.base.intermediate_size)
    if sparse:
        return K3MoE(cfg.base, cfg.hidden_act, cfg.situ_betas, cfg.moe_latent_size)
    return GatedMLP(cfg.base.hidden_size, cfg.base.intermediate_size, cfg.hidden_act, cfg.situ_betas)


class HybridLayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, layer_idx: int, attn_idx: int) -> None:
        super().__init__()
        D, eps = cfg.base.hidden_size, cfg.base.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda(layer_idx)
        self.self_attn: nn.Module = (
            KimiDeltaAttention(cfg.kda, attn_idx) if self.is_kda else MLAttention(cfg.mla, attn_idx)
        )
        self.mlp = _ffn(cfg, layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res = ResMix(D, eps) if cfg.attn_res_block_size else None
        self.mlp_res = ResMix(D, eps) if cfg.attn_res_block_size else None

    def attend(self, x, cos, sin, mask, store, states, lengths, absorbed: bool) -> torch.Tensor:
        if self.is_kda:
            return self.self_attn(x, states, lengths)
        return self.self_attn(x, cos, sin, mask, store, absorbed)

    def forward(self, stream: ResidualStream, cos, sin, mask, store, states, lengths, absorbed: bool) -> None:
        """Advance ``stream`` (residual or AttnRes) by this layer's attention and FFN outputs."""
        with scope("attnres"):
            stream.enter_layer(self.layer_idx)
            x = stream.input(self.self_attention_res)
        with scope("norm"):
            x = self.input_layernorm(x)
        with scope("kda") if self.is_kda else _NO_SCOPE:  # MLA layers scope their own pieces (attn.proj, ...)
            a = self.attend(x, cos, sin, mask, store, states, lengths, absorbed)
        with scope("attnres"):
            stream.add(a)
            x = stream.input(self.mlp_res)
        with scope("norm"):
            x = self.post_attention_layernorm(x)
        with scope("moe" if isinstance(self.mlp, (MoE, K3MoE)) else "mlp"):
            y = self.mlp(x)
        with scope("attnres"):
            stream.add(y)


class _Backbone(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.config_block_size = cfg.attn_res_block_size
        self.embed_tokens = nn.Embedding(cfg.base.vocab_size, cfg.base.hidden_size)
        ordinals = [sum(cfg.is_kda(j) == cfg.is_kda(i) for j in range(i)) for i in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(HybridLayer(cfg, i, ordinals[i]) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.base.hidden_size, cfg.base.rms_norm_eps)
        self.output_attn_res = ResMix(cfg.base.hidden_size, cfg.base.rms_norm_eps) if cfg.attn_res_block_size else None

    def stream(self, embedding: torch.Tensor) -> ResidualStream:
        block = self.config_block_size
        return ResidualStream(embedding) if block is None else AttnResStream(embedding, block)


class KimiLinearTarget(DecoderTarget):
    """Hybrid decoder over a batch of right-padded rows: MLA latents in a LatentStore, KDA states in a StateStore."""

    def __init__(self, cfg: KimiLinearConfig) -> None:
        b = cfg.base
        super().__init__(cfg, _Backbone(cfg), b.hidden_size, b.vocab_size, b.tie_word_embeddings, b.rope)


    # the Target protocol ---------------------------------------------------------------------------
    @property
    def page_format(self) -> PageFormat:
        """Only the MLA layers have pages (the shared latent format); KDA layers keep per-request state."""
        return PageFormat("mla", self.config.mla.latent_dim, len(self.config.mla_layers))

    @property
    def state_spec(self) -> StateSpec:
        """Every KDA layer's recurrent matrices + conv tail per request, flat fp32 (``KDAState.pack``)."""
        return StateSpec(len(self.config.kda_layers), (self.config.kda.state_numel,), torch.float32)

    @property
    def tap_streams(self) -> tuple[str, ...]:
        return self.config.tap_streams

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
        states: StateStore | None = None,
        lengths: torch.Tensor | None = None,
        tap_stream: str | None = None,
    ) -> TargetOutput:
        """input_ids [B, T] (right-padded; lengths [B] valid rows, default T); positions [B, T]; mask [B, T, S]
        for the MLA layers (default causal); states: KDA states before/after this forward (None: start at zero,
        keep nothing); logits_rows [B, N]; tap_stream: "residual" | "prefix" (default: the config's first)."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        with scope("embed"):
            mask = no_empty_rows(causal_mask(positions, positions) if mask is None else mask)
            cos, sin = self.rotary.cos_sin(positions)
            h = self.model.embed_tokens(input_ids)
        wanted = set(tap_layers)
        taps = [h] if -1 in wanted else []
        stream = self.model.stream(h)
        for i, layer in enumerate(self.model.layers):
            layer(stream, cos, sin, mask, store, states, lengths, absorbed)
            if i in wanted:
                taps.append(stream.tap(tap_stream or self.config.tap_streams[0]))
        with scope("lm_head"):
            h = self.model.norm(stream.output(self.model.output_attn_res))
            return head_output(h, taps, logits_rows, self.compute_logits if compute_logits else None)
