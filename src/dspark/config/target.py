"""Target model configs: the MLA attention geometry (``MLAConfig``, shared with the drafter), the DeepSeek-V3 /
Kimi-K2 MLA target (``TargetConfig``) and the Llama / Qwen2 / Qwen3 GQA target (``GQATargetConfig``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from dspark.config.common import (
    ConfigKeys,
    as_is,
    fail,
    given,
    hf_keys,
    positive,
    read_config,
    require,
    required_ints,
    token_ids,
)
from dspark.config.rope import ROPE_KEYS, RopeConfig, attention_scale

# --------------------------------------------------------------------------------------------------------
# MLA attention geometry (shared by target and drafter)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    use_nope: bool = False  # no rotation on the rope slice (K3 target)
    use_output_gate: bool = False  # sigmoid(g_proj(x)) gate before o_proj (K3 target)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        positive(
            "mla",
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    @classmethod
    def of(cls, cfg: Any, **overrides: Any) -> MLAConfig:
        """The attention geometry of a ``TargetConfig`` or MLA ``DraftConfig`` (both use the config.json names)."""
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope=cfg.rope,
            rms_norm_eps=cfg.rms_norm_eps,
            use_nope=cfg.mla_use_nope,
            use_output_gate=cfg.mla_use_output_gate,
            **overrides,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached values per token per layer: kv_lora_rank + rope dim (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """d_qk^-1/2, times YaRN's mscale² only when the layer rotates: a NoPE MLA (K3's target) uses the plain
        scale whatever rope_scaling says (as transformers' KimiLinear and vLLM's K3 MLA do)."""
        return self.qk_head_dim**-0.5 if self.use_nope else attention_scale(self.qk_head_dim, self.rope)


# --------------------------------------------------------------------------------------------------------
# Target (DeepSeek-V3 / Kimi-K2 architecture)
# --------------------------------------------------------------------------------------------------------


MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")  # model_type values TargetConfig reads


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """An HF ``deepseek_v3`` / Kimi-K2 style ``config.json``."""

    KEYS: ClassVar[ConfigKeys]  # the config.json keys it reads and lets pass (set below the class)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None = None  # None: queries are projected without a low-rank compression
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int = 4096
    rope: RopeConfig
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        src = "target config.json"
        positive(
            src,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.hidden_act != "silu":
            raise fail(src, "hidden_act", self.hidden_act, "only 'silu' (SwiGLU) is supported")
        if self.is_moe:
            positive(
                src,
                moe_intermediate_size=self.moe_intermediate_size,
                num_experts_per_tok=self.num_experts_per_tok,
                n_group=self.n_group,
                topk_group=self.topk_group,
            )
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise fail(src, "scoring_func", self.scoring_func, "use 'sigmoid' (DeepSeek-V3) or 'softmax'")
            if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
                raise fail(src, "topk_method", self.topk_method, "use 'noaux_tc', 'greedy' or 'group_limited_greedy'")
            assert self.n_routed_experts is not None and self.num_experts_per_tok is not None
            if self.n_routed_experts % self.n_group:
                raise fail(src, "n_group", self.n_group, f"must divide n_routed_experts={self.n_routed_experts}")
            if self.topk_group > self.n_group:
                raise fail(src, "topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise fail(src, "num_experts_per_tok", self.num_experts_per_tok, "must be <= n_routed_experts")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise fail(src, name, v, f"must be in [0, vocab_size={self.vocab_size})")
        for v in self.eos_token_ids:
            if not 0 <= v < self.vocab_size:
                raise fail(src, "eos_token_id", v, f"must be in [0, vocab_size={self.vocab_size})")

    @property
    def is_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_replace

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def mla(self) -> MLAConfig:
        return MLAConfig.of(self, attention_bias=self.attention_bias)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "target config.json") -> TargetConfig:
        mt = d.get("model_type", cls.model_type)
        if mt not in MLA_MODEL_TYPES:
            raise fail(source, "model_type", mt, "the MLA target reads 'deepseek_v3' / 'kimi_k2' configs")
        rope_dim = int(require(d, "qk_rope_head_dim", source))
        # DeepSeek configs write 0 / null for a dense model's expert width and for "no expert groups": the defaults
        d = {k: v for k, v in d.items() if v or k not in ("moe_intermediate_size", "n_group", "topk_group")}
        return cls(
            **required_ints(d, source, *_REQUIRED),
            qk_rope_head_dim=rope_dim,
            rope=RopeConfig.from_hf(d, rope_dim, source),
            model_type=mt,
            **given(d, _OPTIONAL),
        )

    @classmethod
    def load(cls, path: str | Path) -> TargetConfig:
        return cls.from_dict(*read_config(path))

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope"}
        d["rope_parameters"] = self.rope.to_hf()
        d["rope_theta"] = self.rope.theta
        d["rope_interleave"] = self.rope.interleave
        d["num_key_value_heads"] = self.num_attention_heads
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        return d


# TargetConfig.from_dict: the keys it cannot do without (in the order they are checked) and the ones with a default
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
)
_OPTIONAL = {
    "q_lora_rank": as_is,
    "max_position_embeddings": int,
    "moe_intermediate_size": int,
    "n_routed_experts": as_is,
    "n_shared_experts": as_is,
    "num_experts_per_tok": as_is,
    "first_k_dense_replace": int,
    "routed_scaling_factor": float,
    "scoring_func": as_is,
    "topk_method": as_is,
    "n_group": int,
    "topk_group": int,
    "norm_topk_prob": bool,
    "hidden_act": as_is,
    "rms_norm_eps": float,
    "tie_word_embeddings": bool,
    "attention_bias": bool,
    "mla_use_nope": bool,
    "mla_use_output_gate": bool,
    "bos_token_id": as_is,
    "eos_token_id": token_ids,
    "pad_token_id": as_is,
}
TargetConfig.KEYS = hf_keys(
    {"model_type", "qk_rope_head_dim", *_REQUIRED, *_OPTIONAL, *ROPE_KEYS},
    # DeepSeek-V3's / Kimi-K2's official config.json keys dspark does not need (MTP layers, training-only knobs)
    {"num_key_value_heads", "head_dim", "qk_head_dim", "aux_loss_alpha", "ep_size", "moe_layer_freq", "seq_aux",
     "num_nextn_predict_layers"},
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# GQA targets (HF Llama / Qwen2 / Qwen3 config.json)
# --------------------------------------------------------------------------------------------------------

GQA_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # llama.cpp general.architecture values; each converts to that model_type


def gqa_header(model_type: str) -> dict[str, Any]:
    """The keys naming a GQA model in its config.json (``model_type`` and the HF architecture)."""
    return {"architectures": [GQA_MODEL_TYPES[model_type]], "model_type": model_type}


@dataclass(frozen=True, kw_only=True)
class GQATargetConfig:
    """An HF ``llama`` / ``qwen2`` / ``qwen3`` ``config.json``: GQA attention with rotate-half RoPE, SwiGLU."""

    KEYS: ClassVar[ConfigKeys]  # the config.json keys it reads and lets pass (set below the class)
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections (Qwen2 always; Llama/Qwen3 attention_bias)
    o_bias: bool = False  # o_proj (Llama/Qwen3 attention_bias; never Qwen2)
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        src = f"{self.model_type} config.json"
        positive(
            src,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(src, "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        for v in (self.bos_token_id, *self.eos_token_ids):
            if v is not None and not 0 <= v < self.vocab_size:
                raise fail(src, "bos_token_id/eos_token_id", v, f"must be in [0, vocab_size={self.vocab_size})")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> GQATargetConfig:
        mt = d.get("model_type")
        if mt not in GQA_MODEL_TYPES:
            raise fail(source, "model_type", mt, f"the GQA target reads {sorted(GQA_MODEL_TYPES)} configs")
        _reject_unsupported(d, source)
        heads = int(require(d, "num_attention_heads", source))
        hidden = int(require(d, "hidden_size", source))
        head_dim = int(d.get("head_dim") or hidden // heads)
        bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=mt,
            hidden_size=hidden,
            num_attention_heads=heads,
            **required_ints(d, source, "vocab_size", "intermediate_size", "num_hidden_layers"),
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope=RopeConfig.from_hf(d, head_dim, source, interleave=False),
            qkv_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            qk_norm=mt == "qwen3",
            **given(d, _GQA_OPTIONAL),
        )

    @classmethod
    def load(cls, path: str | Path) -> GQATargetConfig:
        return cls.from_dict(*read_config(path))


def _reject_unsupported(d: Mapping[str, Any], source: str) -> None:
    """Llama-family options our decoder does not implement: refuse rather than serve a different model."""
    if d.get("hidden_act", "silu") != "silu":
        raise fail(source, "hidden_act", d.get("hidden_act"), "only 'silu' (SwiGLU) is supported")
    if d.get("use_sliding_window"):
        raise fail(source, "use_sliding_window", True, "sliding-window attention is not implemented; set false")
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise fail(source, "partial_rotary_factor", params.get("partial_rotary_factor"), "only 1.0 is supported")


# GQATargetConfig.from_dict: the optional keys read under their own name (a missing one gets the field's default)
_GQA_OPTIONAL = {
    "max_position_embeddings": int,
    "rms_norm_eps": float,
    "tie_word_embeddings": bool,
    "mlp_bias": bool,
    "bos_token_id": as_is,
    "eos_token_id": token_ids,
    "pad_token_id": as_is,
}
GQATargetConfig.KEYS = hf_keys(
    {"model_type", "num_attention_heads", "hidden_size", "head_dim", "attention_bias", "vocab_size",
     "intermediate_size", "num_hidden_layers", "num_key_value_heads", "hidden_act", "use_sliding_window",
     "partial_rotary_factor", *_GQA_OPTIONAL, *ROPE_KEYS},
    # Llama's / Qwen2's / Qwen3's official config.json keys dspark does not need (SmolLM2 adds the last three)
    {"sliding_window", "max_window_layers", "layer_types", "rope_interleaved", "is_llama_config",
     "transformers.js_config"},
)  # fmt: skip
