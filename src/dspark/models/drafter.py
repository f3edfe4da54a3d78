"""The DSpark drafter: a block-parallel, anchor-first, non-causal drafter conditioned on target taps.

Reference: k3-mla-architecture.md §1 and §5, dspark-method.md §3. Data flow for one proposal:
1. context fusion: taps [.., m·Dt] → context_proj → context_norm (one D-vector per context token);
2. context injection: each layer runs only its own kv_a_proj_with_mqa + kv_a_layernorm + RoPE on the fused
   context and stores the latent; context rows never see q, o or the MLP;
3. query block [anchor, mask × (K−1)] at positions p..p+K−1 (target embedding) attends non-causally to the
   context < p and to the whole block; slot k predicts the token at p+k+1;
4. final_norm → base logits with the (borrowed) lm_head; Markov and confidence heads on top.

Two backbones share this class: ``K3DSparkModel`` (MLA) and DeepSpec's ``Qwen3DSparkModel`` (GQA with q/k
RMSNorm); the latter is stored under DeepSpec's names (``fc``, ``hidden_norm``, ``norm``) via ``GQA_NAMES``.
What differs between them is one ``Backbone`` each, picked by the config's architecture (``BACKBONES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import DraftConfig
from dspark.models.heads import ConfidenceHead, MarkovHead
from dspark.models.layers import RMSNorm, SwiGLU, attention_bias, grouped_sdpa, no_empty_rows
from dspark.models.mla import LatentStore, MLAttention
from dspark.models.packing import Linear
from dspark.models.protocol import PageFormat
from dspark.models.rope import RotaryEmbedding, apply_rope
from dspark.profiling import scope

# our module name prefix → DeepSpec Qwen3DSparkModel name prefix
GQA_NAMES = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm."}


class GQAttention(nn.Module):
    """Qwen3-style GQA attention exposing the same latent interface as MLA: the cached row is [k | v]."""

    def __init__(self, cfg: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None and cfg.num_key_value_heads is not None
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(D, self.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(D, self.num_kv * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(D, self.num_kv * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.interleave = cfg.rope.interleave
        self.scale = hd**-0.5
        self.backend = "sdpa"  # "sdpa" | "torch"

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → [B, T, 2·kvH·hd] = [rope(k_norm(k)) | v]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv, self.head_dim))
        k = apply_rope(k, cos[:, :, None], sin[:, :, None], self.interleave)
        return torch.cat((k.flatten(2), self.v_proj(x)), -1)

    def attend_from_kv(self, x, cos, sin, kv, mask, absorbed: bool = True) -> torch.Tensor:
        B, T, _ = x.shape
        S = kv.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        q = apply_rope(q, cos[:, :, None], sin[:, :, None], self.interleave).transpose(1, 2)
        k, v = kv.to(q.dtype).view(B, S, 2, self.num_kv, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kvH, S, hd]
        if self.backend == "sdpa":
            bias = attention_bias(mask).to(q.dtype)  # [B, 1, T, S]
            out = grouped_sdpa(q, k, v, bias, self.scale)
        else:  # explicit: repeat the KV heads, fp32 scores and softmax
            rep = self.num_heads // self.num_kv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale  # [B, H, T, S]
            probs = (scores + attention_bias(mask)).softmax(-1)
            out = probs.to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2))


def _mla_attention(cfg: DraftConfig, layer_idx: int) -> MLAttention:
    return MLAttention(cfg.mla, layer_idx)


def _mla_row(cfg: DraftConfig) -> int:  # the latent [c_kv | k_pe]
    return cfg.mla.latent_dim


def _mla_expanded_row(cfg: DraftConfig) -> int:  # per-head K (nope + rope) and V
    return cfg.mla.num_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)


def _gqa_row(cfg: DraftConfig) -> int:  # [k | v] of every KV head
    assert cfg.num_key_value_heads is not None and cfg.head_dim is not None
    return 2 * cfg.num_key_value_heads * cfg.head_dim


@dataclass(frozen=True)
class Backbone:
    """What the drafter's two backbones differ in: attention, cached rows, checkpoint names."""

    page_kind: str  # the PageFormat kind of its cached rows
    attention: Callable[[DraftConfig, int], GQAttention | MLAttention]  # (config, layer index) -> attention
    row_width: Callable[[DraftConfig], int]  # values per token per layer in the shared pages
    separate_row_width: Callable[[DraftConfig], int]  # the same in a cache of its own, heads expanded
    names: Mapping[str, str]  # our module name prefix -> its checkpoint's


BACKBONES = {  # by DraftConfig.architecture (config.json's architectures[0])
    "K3DSparkModel": Backbone("mla", _mla_attention, _mla_row, _mla_expanded_row, {}),
    "Qwen3DSparkModel": Backbone("gqa", GQAttention, _gqa_row, _gqa_row, GQA_NAMES),
}


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: GQAttention | MLAttention = BACKBONES[cfg.architecture].attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor | None,
        rope_block: tuple[torch.Tensor, torch.Tensor],
        rope_ctx: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
        store: LatentStore | None,
        absorbed: bool,
    ) -> torch.Tensor:
        """h [B, K, D] block rows; ctx [B, Tc, D] fused context rows (or None) → [B, K, D]."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        queries = None
        if ctx is None and isinstance(attn, MLAttention):  # the engine's case: latent and queries in one projection
            with scope("attn.proj"):
                latent, *queries = attn.project(x, *rope_block)
        else:
            latent = attn.latent(x, *rope_block)
            if ctx is not None:
                assert rope_ctx is not None
                latent = torch.cat((attn.latent(ctx, *rope_ctx), latent), 1)  # context rows first
        with scope("cache"):
            kv = latent if store is None else store.update(attn.layer_idx, latent)
        if queries is not None:
            h = h + attn.attend_queries(x, tuple(queries), kv, mask, absorbed)
        else:
            h = h + attn.attend_from_kv(x, *rope_block, kv, mask, absorbed)
        with scope("mlp"):
            return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class DraftOutput:
    hidden: torch.Tensor  # [B, K, D] post final_norm
    base_logits: torch.Tensor | None  # [B, K, V] fp32 (None when no lm_head is attached)


class DSparkDrafter(nn.Module):
    """K3DSparkModel / Qwen3DSparkModel. The embedding and lm_head are borrowed (frozen) from the target."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = BACKBONES[cfg.architecture]
        self.context_proj = Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_head = (
            MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.markov_head_type)
            if cfg.markov_rank > 0
            else None
        )
        self.confidence_head = ConfidenceHead(cfg.confidence_input_dim) if cfg.enable_confidence_head else None
        self.rotary = RotaryEmbedding(cfg.rope)
        # borrowed, not registered as parameters (never saved in model.safetensors, never trained)
        self._borrowed: dict[str, nn.Module] = {}

    def fuse_for_inference(self) -> None:
        """Fused gate|up MLP weights for inference (see MLATarget.fuse_for_inference); the context projection takes
        the native few-row product. Idempotent."""
        with torch.inference_mode(False), torch.no_grad():
            for layer in self.layers:
                layer.mlp.fuse()
        if isinstance(self.context_proj, Linear):
            self.context_proj.use_native_rows()

    # ---- borrowed target modules -------------------------------------------------------------------
    def set_attention_backend(self, backend: str | None) -> None:
        """Run every layer's attention with backend 'torch' or 'sdpa' (None keeps each layer's default)."""
        if backend is None:
            return
        if backend not in ("torch", "sdpa"):
            raise ValueError(f"attention backend {backend!r}: use 'torch' or 'sdpa'")
        for layer in self.layers:
            assert isinstance(layer, DraftLayer)
            layer.self_attn.backend = backend

    def attach(self, embed_tokens: nn.Embedding, lm_head: nn.Module) -> None:
        """Use the target's embedding (always) and an lm_head (own lm_head.safetensors or the target's)."""
        if embed_tokens.weight.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"target embedding width {embed_tokens.weight.shape[1]} != draft hidden_size "
                f"{self.config.hidden_size}; the drafter must match the target's hidden size"
            )
        self._borrowed = {"embed_tokens": embed_tokens, "lm_head": lm_head}

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._borrowed["embed_tokens"]  # type: ignore[return-value]

    @property
    def lm_head(self) -> nn.Module:
        return self._borrowed["lm_head"]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's activations (its norms' weights stay dense whatever its linears are)."""
        return self.context_norm.weight.dtype

    def quantizable_linears(self) -> list[str]:
        """The linears ``loading.load_drafter`` may serve as Q8_0 blocks (the int8 arithmetic): the context
        projection, each MLP's and, on the GQA backbone, each attention projection; the Markov and confidence heads
        read their weights directly and stay dense, as do MLA's absorbed projections."""
        names = ["context_proj"]
        for i, layer in enumerate(self.layers):
            names += [f"layers.{i}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
            if isinstance(layer.self_attn, GQAttention):
                names += [f"layers.{i}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        return names

    @property
    def latent_dim(self) -> int:
        return self.backbone.row_width(self.config)

    @property
    def separate_cache_width(self) -> int:
        """Values per token per layer in a conventional draft cache that shares nothing with the target: MLA heads
        expanded to per-head K (nope + rope) and V; the GQA backbone's [k | v] rows are that already."""
        return self.backbone.separate_row_width(self.config)

    @property
    def page_format(self) -> PageFormat:
        """MLA latent rows, or [k | v] rows for the GQA backbone (shares the pool with a GQA target of equal width)."""
        return PageFormat(self.backbone.page_kind, self.latent_dim, self.config.num_hidden_layers)

    # ---- forward -------------------------------------------------------------------------------------
    def fuse_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, Tc, m·Dt] → fused context [B, Tc, D]."""
        return self.context_norm(self.context_proj(taps.to(self.dtype)))

    def forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        mask: torch.Tensor,
        ctx_taps: torch.Tensor | None = None,
        ctx_positions: torch.Tensor | None = None,
        store: LatentStore | None = None,
        absorbed: bool = True,
        compute_logits: bool = True,
    ) -> DraftOutput:
        """block_ids/positions [B, Kb] (Kb = A·K packed blocks in training); ctx_taps [B, Tc, m·Dt] new context
        rows at ctx_positions [B, Tc]; mask [B, Kb, S] over the keys the store returns (without a store:
        S = Tc + Kb, context rows first)."""
        h = self.embed_tokens(block_ids).to(self.dtype)
        rope_block = self.rotary.cos_sin(block_positions)
        ctx = rope_ctx = None
        if ctx_taps is not None:
            assert ctx_positions is not None
            ctx = self.fuse_context(ctx_taps)
            rope_ctx = self.rotary.cos_sin(ctx_positions)
        mask = attention_bias(no_empty_rows(mask))  # once for every layer
        for layer in self.layers:
            h = layer(h, ctx, rope_block, rope_ctx, mask, store, absorbed)
        h = self.final_norm(h)
        logits = self.lm_head(h).float() if compute_logits else None
        return DraftOutput(hidden=h, base_logits=logits)

    def inject_context(self, taps: torch.Tensor, positions: torch.Tensor, store) -> None:
        """Context injection: write each layer's latent of the fused taps [B, T, m·Dt] at positions [B, T]."""
        ctx = self.fuse_context(taps)
        cos, sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            store.write(i, layer.self_attn.latent(ctx, cos, sin))

    def confidence(self, hidden: torch.Tensor, prev_embeds: torch.Tensor | None) -> torch.Tensor | None:
        """Confidence logits [.., K] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        use_markov = self.config.confidence_head_with_markov and self.markov_head is not None
        return self.confidence_head(hidden, prev_embeds if use_markov else None)

    # ---- checkpoint names ----------------------------------------------------------------------------
    def file_name(self, name: str) -> str:
        """Module parameter name → name in model.safetensors (official k3_dspark or DeepSpec)."""
        for ours, theirs in self.backbone.names.items():
            if name.startswith(ours):
                return theirs + name[len(ours) :]
        return name


def block_mask(anchor_positions: torch.Tensor, block_size: int, num_keys: int) -> torch.Tensor:
    """Inference visibility over keys at positions 0..S-1: every block row sees the context < anchor and the
    whole block (anchor..anchor+K-1), non-causally. anchor_positions [B] → bool [B, K, S]."""
    keys = torch.arange(num_keys, device=anchor_positions.device)
    visible = keys[None, :] < (anchor_positions[:, None] + block_size)  # [B, S]
    return visible[:, None, :].expand(-1, block_size, -1)
