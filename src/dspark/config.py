"""Frozen configuration dataclasses: target, drafter, speculative decoding, cache and engine.

Every default lives here once; the CLI and the engine read them from these classes. Builders take the
HF-style ``config.json`` dicts (or vLLM-style ``--speculative-config`` JSON) and raise ``ConfigError`` naming
the offending key, its value and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# config.json key that marks a model as explicitly random test weights (dspark.models.tiny): only such models
# may run without a tokenizer file (bytes stand in for text)
RANDOM_WEIGHTS_KEY = "dspark_random_weights"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key and the fix."""


REDUCED_VOCAB_FIX = (
    "checkpoints with their own reduced lm_head (d2t maps) are not supported: set it to vocab_size and reduce at "
    "inference instead (draft_vocab.json, speculative config draft_vocab_size)"
)


def _fail(source: str, key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{source}: key '{key}' = {value!r} is invalid: {fix}")


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object from ``path`` (a file, or a directory holding ``config.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: file not found; pass a model directory containing config.json")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e}); fix the file or re-download it") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    return data


def _require(d: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{source}: required key '{key}' is missing; add it to config.json")
    return d[key]


def _positive(source: str, **values: int | float | None) -> None:
    for k, v in values.items():
        if v is not None and (not isinstance(v, int | float) or v <= 0):
            raise _fail(source, k, v, "must be a positive number")


# --------------------------------------------------------------------------------------------------------
# RoPE / YaRN
# --------------------------------------------------------------------------------------------------------


# config.json keys that encode positions only: a continued pre-training (context extension) may change them
POSITION_KEYS = frozenset({"max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling"})

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (DeepSeek YaRN when ``rope_type == 'yarn'``)."""

    dim: int
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleave: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn cos/sin magnitude (None: from factor / mscale)
    truncate: bool = True  # yarn: floor/ceil the correction range

    def __post_init__(self) -> None:
        src = "rope_parameters"
        if self.rope_type not in ROPE_TYPES:
            raise _fail(src, "rope_type", self.rope_type, f"supported: {', '.join(ROPE_TYPES)}")
        if self.dim <= 0 or self.dim % 2:
            raise _fail(src, "qk_rope_head_dim", self.dim, "must be a positive even number")
        _positive(src, rope_theta=self.theta, factor=self.factor, beta_fast=self.beta_fast)
        if self.rope_type in ("yarn", "llama3") and self.original_max_position_embeddings is None:
            raise _fail(src, "original_max_position_embeddings", None, f"{self.rope_type} needs the original length")

    @property
    def is_yarn(self) -> bool:
        return self.rope_type == "yarn" and self.factor > 1.0

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], dim: int, source: str, interleave: bool = True) -> RopeConfig:
        """From an HF config dict (``rope_parameters`` or legacy ``rope_scaling`` + ``rope_theta``); ``interleave``
        is the family's default pair layout (DeepSeek: interleaved; Llama/Qwen: rotate-half)."""
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise _fail(source, "rope_parameters", params, "must be an object or null")
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type == "deepseek_yarn":
            rope_type = "yarn"
        if rope_type not in ROPE_TYPES:
            raise _fail(source, "rope_parameters.rope_type", rope_type, f"supported: {', '.join(ROPE_TYPES)}")
        return cls(
            dim=dim,
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            mscale=float(params.get("mscale", 1.0)),
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0) or 0.0),
            interleave=bool(d.get("rope_interleave", interleave)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        if self.rope_type == "default":
            return {"rope_type": "default", "rope_theta": self.theta}
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor, "rope_theta": self.theta}
        if self.rope_type == "llama3":
            return {
                "rope_type": "llama3",
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "rope_theta": self.theta,
            }
        return (
            {
                "rope_type": "yarn",
                "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "rope_theta": self.theta,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "mscale": self.mscale,
                "mscale_all_dim": self.mscale_all_dim,
            }
            | ({"attention_factor": self.attention_factor} if self.attention_factor is not None else {})
            | ({} if self.truncate else {"truncate": False})
        )


def yarn_get_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction: 1 if factor <= 1 else 0.1·mscale·ln(factor) + 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """Softmax scale d_qk^-1/2, multiplied by mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


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
        _positive(
            "mla",
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
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


@dataclass(frozen=True)
class TargetConfig:
    """An HF ``deepseek_v3`` / Kimi-K2 style ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
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
        _positive(
            src,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.hidden_act != "silu":
            raise _fail(src, "hidden_act", self.hidden_act, "only 'silu' (SwiGLU) is supported")
        if self.is_moe:
            _positive(
                src,
                moe_intermediate_size=self.moe_intermediate_size,
                num_experts_per_tok=self.num_experts_per_tok,
                n_group=self.n_group,
                topk_group=self.topk_group,
            )
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise _fail(src, "scoring_func", self.scoring_func, "use 'sigmoid' (DeepSeek-V3) or 'softmax'")
            if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
                raise _fail(src, "topk_method", self.topk_method, "use 'noaux_tc', 'greedy' or 'group_limited_greedy'")
            assert self.n_routed_experts is not None and self.num_experts_per_tok is not None
            if self.n_routed_experts % self.n_group:
                raise _fail(src, "n_group", self.n_group, f"must divide n_routed_experts={self.n_routed_experts}")
            if self.topk_group > self.n_group:
                raise _fail(src, "topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise _fail(src, "num_experts_per_tok", self.num_experts_per_tok, "must be <= n_routed_experts")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise _fail(src, name, v, f"must be in [0, vocab_size={self.vocab_size})")
        for v in self.eos_token_ids:
            if not 0 <= v < self.vocab_size:
                raise _fail(src, "eos_token_id", v, f"must be in [0, vocab_size={self.vocab_size})")

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
        return MLAConfig(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope=self.rope,
            rms_norm_eps=self.rms_norm_eps,
            use_nope=self.mla_use_nope,
            use_output_gate=self.mla_use_output_gate,
            attention_bias=self.attention_bias,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "target config.json") -> TargetConfig:
        mt = d.get("model_type", "deepseek_v3")
        if mt not in ("deepseek_v3", "kimi_k2", "deepseek_v2"):
            raise _fail(source, "model_type", mt, "the MLA target reads 'deepseek_v3' / 'kimi_k2' configs")
        rope_dim = int(_require(d, "qk_rope_head_dim", source))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        return cls(
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=int(_require(d, "hidden_size", source)),
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_hidden_layers=int(_require(d, "num_hidden_layers", source)),
            num_attention_heads=int(_require(d, "num_attention_heads", source)),
            kv_lora_rank=int(_require(d, "kv_lora_rank", source)),
            q_lora_rank=d.get("q_lora_rank"),
            qk_nope_head_dim=int(_require(d, "qk_nope_head_dim", source)),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(_require(d, "v_head_dim", source)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(d, rope_dim, source),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            n_routed_experts=d.get("n_routed_experts"),
            n_shared_experts=d.get("n_shared_experts"),
            num_experts_per_tok=d.get("num_experts_per_tok"),
            first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            scoring_func=d.get("scoring_func", "sigmoid"),
            topk_method=d.get("topk_method", "noaux_tc"),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            hidden_act=d.get("hidden_act", "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mla_use_nope=bool(d.get("mla_use_nope", False)),
            mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            model_type=mt,
        )

    @classmethod
    def load(cls, path: str | Path) -> TargetConfig:
        p = Path(path)
        return cls.from_dict(read_json(p), source=str(p / "config.json" if p.is_dir() else p))

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


# --------------------------------------------------------------------------------------------------------
# GQA targets (HF Llama / Qwen2 / Qwen3 config.json)
# --------------------------------------------------------------------------------------------------------

GQA_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class GQATargetConfig:
    """An HF ``llama`` / ``qwen2`` / ``qwen3`` ``config.json``: GQA attention with rotate-half RoPE, SwiGLU."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
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
        _positive(
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
            raise _fail(src, "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        for v in (self.bos_token_id, *self.eos_token_ids):
            if v is not None and not 0 <= v < self.vocab_size:
                raise _fail(src, "bos_token_id/eos_token_id", v, f"must be in [0, vocab_size={self.vocab_size})")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> GQATargetConfig:
        mt = d.get("model_type")
        if mt not in GQA_MODEL_TYPES:
            raise _fail(source, "model_type", mt, f"the GQA target reads {sorted(GQA_MODEL_TYPES)} configs")
        _reject_unsupported(d, source)
        heads = int(_require(d, "num_attention_heads", source))
        hidden = int(_require(d, "hidden_size", source))
        head_dim = int(d.get("head_dim") or hidden // heads)
        bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        return cls(
            model_type=mt,
            vocab_size=int(_require(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_hidden_layers=int(_require(d, "num_hidden_layers", source)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(d, head_dim, source, interleave=False),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(int(e) for e in eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def load(cls, path: str | Path) -> GQATargetConfig:
        p = Path(path)
        return cls.from_dict(read_json(p), source=str(p / "config.json" if p.is_dir() else p))


def _reject_unsupported(d: Mapping[str, Any], source: str) -> None:
    """Llama-family options our decoder does not implement: refuse rather than serve a different model."""
    if d.get("hidden_act", "silu") != "silu":
        raise _fail(source, "hidden_act", d.get("hidden_act"), "only 'silu' (SwiGLU) is supported")
    if d.get("use_sliding_window"):
        raise _fail(source, "use_sliding_window", True, "sliding-window attention is not implemented; set false")
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise _fail(source, "partial_rotary_factor", params.get("partial_rotary_factor"), "only 1.0 is supported")


# --------------------------------------------------------------------------------------------------------
# Kimi Linear / Kimi K3 hybrid target (KDA + MLA)
# --------------------------------------------------------------------------------------------------------

KIMI_LAYER_TYPES = ("linear_attention", "full_attention")
KIMI_MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class KDAConfig:
    """One Kimi Delta Attention layer's geometry (``linear_attn_config`` of a Kimi Linear config.json)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-5
    gate_lower_bound: float | None = None  # None: g = −e^A·softplus(·) (Kimi Linear); K3: g = lb·σ(e^A·(·)), lb −5
    chunk_size: int = 64  # rows per chunk of the chunkwise form
    decode_recurrent: bool = True  # one-row forwards use the recurrent form

    def __post_init__(self) -> None:
        _positive(
            "linear_attn_config",
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            short_conv_kernel_size=self.conv_kernel_size,
            chunk_size=self.chunk_size,
        )
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise _fail("linear_attn_config", "gate_lower_bound", self.gate_lower_bound, "must be negative or null")

    @property
    def state_numel(self) -> int:
        """Values per request per layer: the recurrent matrix per head + the conv tail."""
        width = self.num_heads * self.head_dim
        return self.num_heads * self.head_dim * self.head_dim + (self.conv_kernel_size - 1) * 3 * width


def _kimi_layer_types(d: Mapping[str, Any], n: int, source: str) -> tuple[str, ...]:
    """``layer_types``, else ``linear_attn_config.{kda_layers, full_attn_layers}`` (1-based), else every 4th."""
    lac = d.get("linear_attn_config") or {}
    types = d.get("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:
        types = [None] * n
        for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
            for one_based in lac[key]:
                if not 1 <= int(one_based) <= n:
                    raise _fail(source, f"linear_attn_config.{key}", one_based, f"layers are 1-based in [1, {n}]")
                types[int(one_based) - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in KIMI_LAYER_TYPES for t in types):
        raise _fail(source, "layer_types", types, f"need {n} entries from {list(KIMI_LAYER_TYPES)}")
    return tuple(types)


def _kimi_mlp_types(d: Mapping[str, Any], n: int, source: str) -> tuple[str, ...]:
    types = d.get("mlp_layer_types")
    if types is None:
        first_dense = int(d.get("first_k_dense_replace", 1))
        types = ["dense" if i < first_dense else "sparse" for i in range(n)]
    if len(types) != n or any(t not in KIMI_MLP_TYPES for t in types):
        raise _fail(source, "mlp_layer_types", types, f"need {n} entries from {list(KIMI_MLP_TYPES)}")
    return tuple(types)


def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first present key (HF attribute names and their aliases in saved configs)."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


@dataclass(frozen=True)
class KimiLinearConfig:
    """A ``kimi_linear`` config.json: KDA and MLA layers (``layer_types``), dense first layer(s) then MoE.

    ``base`` carries the MLA / MoE / embedding fields in TargetConfig form (shared with the MLA target's code);
    ``mlp_layer_types`` decides dense vs MoE per layer.
    """

    base: TargetConfig
    kda: KDAConfig
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    mla_norm_eps: float = 1e-6  # q_a/kv_a layernorms (transformers' KimiLinearAttention builds them with 1e-6)
    # Kimi K3 additions (models/k3.py); off for Kimi Linear
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "situ"
    situ_betas: tuple[float, float] = (4.0, 25.0)
    moe_latent_size: int | None = None  # routed experts in a latent space of this width
    attn_res_block_size: int | None = None  # AttnRes replaces the residual stream

    def __post_init__(self) -> None:
        src = "kimi_linear config.json"
        n = self.base.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise _fail(src, "layer_types", self.layer_types, f"need {n} entries")
        if "sparse" in self.mlp_layer_types and not self.base.is_moe:
            raise _fail(src, "num_experts", None, "sparse mlp_layer_types need experts")
        if self.hidden_act not in ("silu", "situ"):
            raise _fail(src, "hidden_act", self.hidden_act, "use 'silu' or 'situ'")
        _positive(src, moe_latent_size=self.moe_latent_size, attn_res_block_size=self.attn_res_block_size)
        if len(self.situ_betas) != 2 or min(self.situ_betas) <= 0:
            raise _fail(src, "situ_betas", self.situ_betas, "two positive numbers (gate, up), K3: [4, 25]")

    @property
    def tap_streams(self) -> tuple[str, ...]:
        """Streams a drafter may tap; the first is the default (K3 / AttnRes: "prefix")."""
        return ("prefix", "residual") if self.attn_res_block_size else ("residual",)

    # TargetInfo (what the engine, tokenizer and doctor read) ---------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return self.base.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def max_position_embeddings(self) -> int:
        return self.base.max_position_embeddings

    @property
    def bos_token_id(self) -> int | None:
        return self.base.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.base.pad_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.base.eos_token_ids

    @property
    def model_type(self) -> str:
        return "kimi_linear"

    @property
    def mla(self) -> MLAConfig:
        return replace(self.base.mla, rms_norm_eps=self.mla_norm_eps)

    def is_kda(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda(i))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_kda(i))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "kimi_linear config.json") -> KimiLinearConfig:
        if d.get("model_type") != "kimi_linear":
            raise _fail(source, "model_type", d.get("model_type"), "the hybrid target reads 'kimi_linear' configs")
        n = int(_require(d, "num_hidden_layers", source))
        base_keys = {
            "n_routed_experts": _first(d, "num_experts", "num_local_experts", "n_routed_experts"),
            "num_experts_per_tok": _first(d, "num_experts_per_token", "num_experts_per_tok"),
            "n_shared_experts": _first(d, "num_shared_experts", "n_shared_experts", default=1),
            "n_group": _first(d, "num_expert_group", "n_group", default=1),
            "norm_topk_prob": _first(d, "moe_renormalize", "norm_topk_prob", default=True),
            "max_position_embeddings": _first(d, "model_max_length", "max_position_embeddings", default=1048576),
            "first_k_dense_replace": 0,
            "routed_scaling_factor": d.get("routed_scaling_factor", 2.446),
            "rms_norm_eps": d.get("rms_norm_eps", 1e-5),
            "model_type": "deepseek_v3",
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        }
        act = d.get("hidden_act", "silu")
        base = TargetConfig.from_dict({**d, **base_keys, "hidden_act": "silu"}, source)  # the FFN act is ours
        base = replace(base, model_type="kimi_linear", mla_use_nope=bool(d.get("mla_use_nope", True)))
        lac = d.get("linear_attn_config") or {}
        kda = KDAConfig(
            hidden_size=base.hidden_size,
            num_heads=int(_first(lac, "num_heads", default=d.get("linear_num_heads", 32))),
            head_dim=int(_first(lac, "head_dim", default=d.get("linear_head_dim", 128))),
            conv_kernel_size=int(_first(lac, "short_conv_kernel_size", default=d.get("linear_conv_kernel_dim", 4))),
            rms_norm_eps=base.rms_norm_eps,
            gate_lower_bound=lac.get("gate_lower_bound"),
        )
        return cls(
            base,
            kda,
            _kimi_layer_types(d, n, source),
            _kimi_mlp_types(d, n, source),
            hidden_act=act,
            situ_betas=tuple(float(b) for b in d.get("situ_betas", (4.0, 25.0))),
            moe_latent_size=d.get("moe_latent_size"),
            attn_res_block_size=d.get("attn_res_block_size"),
        )

    @classmethod
    def load(cls, path: str | Path) -> KimiLinearConfig:
        p = Path(path)
        return cls.from_dict(read_json(p), source=str(p / "config.json" if p.is_dir() else p))

    def to_hf_dict(self) -> dict[str, Any]:
        d = self.base.to_hf_dict()
        for k in (
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "n_group",
            "first_k_dense_replace",
            "topk_method",
            "scoring_func",
            "rope_interleave",
        ):
            d.pop(k, None)
        d |= {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "num_experts": self.base.n_routed_experts,
            "num_experts_per_token": self.base.num_experts_per_tok,
            "num_shared_experts": self.base.n_shared_experts,
            "num_expert_group": self.base.n_group,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "linear_attn_config": {
                "num_heads": self.kda.num_heads,
                "head_dim": self.kda.head_dim,
                "short_conv_kernel_size": self.kda.conv_kernel_size,
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
            },
        }
        if self.kda.gate_lower_bound is not None:
            d["linear_attn_config"]["gate_lower_bound"] = self.kda.gate_lower_bound
        d["hidden_act"] = self.hidden_act
        if self.hidden_act == "situ":
            d["situ_betas"] = list(self.situ_betas)
        for key in ("moe_latent_size", "attn_res_block_size"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


# --------------------------------------------------------------------------------------------------------
# Drafter (official k3_dspark keys; DeepSpec Qwen3DSparkModel keys)
# --------------------------------------------------------------------------------------------------------

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
TAP_STREAMS = ("prefix", "residual")
DRAFT_ARCHITECTURES = ("K3DSparkModel", "Qwen3DSparkModel")


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark drafter ``config.json`` (``k3_dspark`` MLA backbone or DeepSpec ``Qwen3DSparkModel`` GQA)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_hidden_layers: int
    mask_token_id: int
    rope: RopeConfig
    max_position_embeddings: int = 32768
    # MLA backbone
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    # GQA backbone (Qwen3)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = False
    # heads
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    block_size: int | None = None
    draft_vocab_size: int | None = None
    # which target stream the taps read: "prefix" (AttnRes prefix sum, Inferact's K3 DSpark) | "residual";
    # None = the target's default (K3 / AttnRes: "prefix"; residual targets: "residual")
    aux_hidden_stream: str | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        src = "draft config.json"
        if self.architecture not in DRAFT_ARCHITECTURES:
            raise _fail(src, "architectures", self.architecture, f"supported: {list(DRAFT_ARCHITECTURES)}")
        _positive(
            src,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            target_hidden_size=self.target_hidden_size,
            target_num_hidden_layers=self.target_num_hidden_layers,
            block_size=self.block_size,
        )
        if self.aux_hidden_stream not in (None, *TAP_STREAMS):
            raise _fail(src, "aux_hidden_stream", self.aux_hidden_stream, f"use one of {list(TAP_STREAMS)} or omit it")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _fail(src, "markov_head_type", self.markov_head_type, f"use one of {list(MARKOV_HEAD_TYPES)}")
        if self.markov_rank < 0:
            raise _fail(src, "markov_rank", self.markov_rank, "must be >= 0 (0 disables the Markov head)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise _fail(src, "mask_token_id", self.mask_token_id, f"must be in [0, vocab_size={self.vocab_size})")
        ids = self.target_layer_ids
        if not ids:
            raise _fail(src, "target_layer_ids", list(ids), "list at least one target layer")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise _fail(src, "target_layer_ids", list(ids), "must be strictly increasing")
        if ids[0] < -1 or ids[-1] >= self.target_num_hidden_layers:
            raise _fail(
                src,
                "target_layer_ids",
                list(ids),
                f"each id must be in [-1, target_num_hidden_layers={self.target_num_hidden_layers})",
            )
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise _fail(src, "draft_vocab_size", self.draft_vocab_size, REDUCED_VOCAB_FIX)
        if self.is_gqa:
            _positive(src, num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim)
            if self.num_attention_heads % (self.num_key_value_heads or 1):
                raise _fail(src, "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")

    @property
    def is_gqa(self) -> bool:
        return self.architecture == "Qwen3DSparkModel"

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def mla(self) -> MLAConfig:
        return MLAConfig(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope=self.rope,
            rms_norm_eps=self.rms_norm_eps,
            use_nope=self.mla_use_nope,
            use_output_gate=self.mla_use_output_gate,
        )

    @property
    def confidence_input_dim(self) -> int:
        with_markov = self.confidence_head_with_markov and self.markov_rank > 0
        return self.hidden_size + (self.markov_rank if with_markov else 0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "draft config.json") -> DraftConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else {"k3_dspark": "K3DSparkModel"}.get(d.get("model_type", ""), "")
        if arch not in DRAFT_ARCHITECTURES:
            raise _fail(source, "architectures", archs, f"expected one of {list(DRAFT_ARCHITECTURES)}")
        gqa = arch == "Qwen3DSparkModel"
        rope_dim = int(d.get("head_dim") or 128) if gqa else int(d.get("qk_rope_head_dim", 64))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        n_target = d.get("target_num_hidden_layers") or d.get("num_target_layers")
        if gqa:
            # DeepSpec copies the target config: num_target_layers is the target depth
            n_target = d.get("num_target_layers") or d.get("target_num_hidden_layers")
        hidden = int(_require(d, "hidden_size", source))
        known = {f.name for f in fields(cls)}
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(_require(d, "intermediate_size", source)),
            num_hidden_layers=int(_require(d, "num_hidden_layers", source)),
            num_attention_heads=int(_require(d, "num_attention_heads", source)),
            vocab_size=int(_require(d, "vocab_size", source)),
            target_layer_ids=tuple(int(i) for i in _require(d, "target_layer_ids", source)),
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            target_num_hidden_layers=int(n_target or 0) or _missing(source, "target_num_hidden_layers"),
            mask_token_id=int(_require(d, "mask_token_id", source)),
            rope=_draft_rope(d, rope_dim, source, gqa),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(d.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
            v_head_dim=int(d.get("v_head_dim", 128)),
            mla_use_nope=bool(d.get("mla_use_nope", False)),
            mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
            num_key_value_heads=d.get("num_key_value_heads") if gqa else None,
            head_dim=d.get("head_dim") if gqa else None,
            attention_bias=bool(d.get("attention_bias", False)),
            markov_rank=int(d.get("markov_rank", 0)),
            markov_head_type=d.get("markov_head_type", "vanilla"),
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            block_size=d.get("block_size"),
            draft_vocab_size=d.get("draft_vocab_size"),
            aux_hidden_stream=d.get("aux_hidden_stream"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5 if not gqa else 1e-6)),
            hidden_act=d.get("hidden_act", "silu"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=str(d.get("torch_dtype", d.get("dtype", "bfloat16"))),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        p = Path(path)
        return cls.from_dict(read_json(p), source=str(p / "config.json" if p.is_dir() else p))

    def to_dict(self) -> dict[str, Any]:
        """The official-format config.json (k3_dspark keys, or DeepSpec keys for the GQA backbone)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3" if self.is_gqa else "k3_dspark",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
        }
        if self.is_gqa:
            d |= {"num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim}
            d |= {"attention_bias": self.attention_bias, "num_target_layers": self.target_num_hidden_layers}
        else:
            d |= {
                "num_key_value_heads": self.num_attention_heads,
                "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim,
                "mla_use_nope": self.mla_use_nope,
                "mla_use_output_gate": self.mla_use_output_gate,
                "num_target_layers": self.num_taps,
            }
        d |= {
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "rope_parameters": self.rope.to_hf(),
            "target_hidden_size": self.target_hidden_size,
            "target_num_hidden_layers": self.target_num_hidden_layers,
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
        }
        if self.block_size is not None:
            d["block_size"] = self.block_size
        if self.aux_hidden_stream is not None:
            d["aux_hidden_stream"] = self.aux_hidden_stream
        return d | dict(self.extra)


def _draft_rope(d: Mapping[str, Any], dim: int, source: str, gqa: bool) -> RopeConfig:
    """MLA drafts rotate interleaved pairs (DeepSeek); Qwen3 drafts rotate halves (NeoX) unless told otherwise."""
    rope = RopeConfig.from_hf(d, dim, source)
    if gqa and "rope_interleave" not in d:
        rope = replace(rope, interleave=False)
    return rope


def _missing(source: str, key: str) -> int:
    raise ConfigError(f"{source}: required key '{key}' is missing; add it to config.json")


# --------------------------------------------------------------------------------------------------------
# Speculative decoding (vLLM --speculative-config keys)
# --------------------------------------------------------------------------------------------------------

SPEC_METHODS = ("dspark", "dflash", "ngram")

# Attention backends that run here: "torch" (explicit matmul + softmax, the reference) and "sdpa"
# (torch.nn.functional.scaled_dot_product_attention, the fused kernel torch has on CPU).
ATTENTION_BACKENDS = ("torch", "sdpa")
# vLLM's AttentionBackendEnum names for dense (non-sparse) attention, and what runs in their place here:
# every fused GPU kernel (FlashInfer, FlashAttention, FlashMLA, CUTLASS, Triton, ...) becomes torch's fused
# SDPA kernel; TORCH_SDPA is that kernel already. Sparse-MLA backends need a sparse model and are not accepted.
VLLM_ATTENTION_BACKENDS: dict[str, str] = {
    name: "sdpa"
    for name in (
        "FLASHINFER_MLA",
        "FLASH_ATTN_MLA",
        "TRITON_MLA",
        "CUTLASS_MLA",
        "FLASHMLA",
        "ROCM_AITER_MLA",
        "ROCM_AITER_TRITON_MLA",
        "TOKENSPEED_MLA",
        "FLASH_ATTN",
        "FLASH_ATTN_DIFFKV",
        "FLASHINFER",
        "TRITON_ATTN",
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
        "FLEX_ATTENTION",
        "TREE_ATTN",
        "XFORMERS",
        "PALLAS",
        "IPEX",
        "CPU_ATTN",
        "TORCH_SDPA",
    )
}
_RUNS_AS_IS = ("TORCH_SDPA",)


class BackendSubstitutionWarning(UserWarning):
    """A vLLM attention backend named in a config is not available here; another one runs in its place."""


def attention_backend(name: str | None, source: str, key: str = "attention_backend") -> str | None:
    """The backend that runs here for a configured name (None = default). vLLM names are case-insensitive and
    'auto' means the default, as in vLLM; an unknown name is an error listing every accepted one."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise _fail(source, key, name, "must be a backend name (a string) or null")
    if name.lower() == "auto":
        return None
    if name in ATTENTION_BACKENDS:
        return name
    upper = name.upper()
    if upper not in VLLM_ATTENTION_BACKENDS:
        accepted = ["auto", *ATTENTION_BACKENDS, *sorted(VLLM_ATTENTION_BACKENDS)]
        raise _fail(source, key, name, f"unknown attention backend; accepted (case-insensitive): {accepted}")
    return VLLM_ATTENTION_BACKENDS[upper]


def _warn_substitute(name: str | None, source: str) -> None:
    if name is None or name.upper() not in VLLM_ATTENTION_BACKENDS or name.upper() in _RUNS_AS_IS:
        return
    import warnings

    warnings.warn(
        f"{source}: attention_backend {name!r} is not available on this machine (torch CPU); "
        f"running '{VLLM_ATTENTION_BACKENDS[name.upper()]}' (torch scaled_dot_product_attention) instead",
        BackendSubstitutionWarning,
        stacklevel=4,
    )


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    model: str | None = None
    num_speculative_tokens: int = 7
    draft_sample_method: str = "probabilistic"
    rejection_sample_method: str = "block"
    enable_adaptive_verification: bool = False
    dspark_draft_topk: int | None = None
    attention_backend: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    calibration_path: str | None = None
    cost_table_path: str | None = None
    min_verify_len: int = 0
    draft_window: int | None = None  # drafter attends to the last W context tokens (the target to all); None: all
    # drafts only from the N most frequent tokens of the drafter's draft_vocab.json (EAGLE-3's reduced draft vocab);
    # None: the file's default_size (full vocabulary without the file); 0: full vocabulary
    draft_vocab_size: int | None = None
    # drafts only while speculative rounds emit more tokens per second than plain steps, measured per batch size
    # (spec/guard.py); greedy output is unchanged, seeded sampled output may vary with the rounds taken
    speculation_guard: bool = False
    disable_by_batch_size: int | None = None  # vLLM's key: a decode step over more requests than this never drafts

    def __post_init__(self) -> None:
        src = "speculative config"
        if self.method not in SPEC_METHODS:
            raise _fail(src, "method", self.method, f"use one of {list(SPEC_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise _fail(src, "num_speculative_tokens", self.num_speculative_tokens, "must be an integer in [1, 32]")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise _fail(src, "draft_sample_method", self.draft_sample_method, "use 'greedy' or 'probabilistic'")
        if self.rejection_sample_method not in ("standard", "block"):
            raise _fail(src, "rejection_sample_method", self.rejection_sample_method, "use 'standard' or 'block'")
        if self.dspark_draft_topk is not None and (
            not isinstance(self.dspark_draft_topk, int) or self.dspark_draft_topk < 1
        ):
            raise _fail(src, "dspark_draft_topk", self.dspark_draft_topk, "must be null or a positive integer")
        attention_backend(self.attention_backend, src)  # validates; the substitute is announced once below
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise _fail(src, "prompt_lookup_min", self.prompt_lookup_min, "need 1 <= min <= prompt_lookup_max")
        if not isinstance(self.speculation_guard, bool):
            raise _fail(src, "speculation_guard", self.speculation_guard, "must be true or false")
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int)
            or isinstance(self.disable_by_batch_size, bool)
            or self.disable_by_batch_size < 1
        ):
            raise _fail(src, "disable_by_batch_size", self.disable_by_batch_size, "must be null or a positive integer")
        if not 0 <= self.min_verify_len <= self.num_speculative_tokens:
            raise _fail(src, "min_verify_len", self.min_verify_len, "must be in [0, num_speculative_tokens]")
        self._check_drafter_keys(src)
        if self.enable_adaptive_verification and self.method == "ngram":
            raise _fail(src, "enable_adaptive_verification", True, "needs a drafter with a confidence head")
        _warn_substitute(self.attention_backend, src)

    def _check_drafter_keys(self, src: str) -> None:
        """draft_window and draft_vocab_size: null or integers in range, and only for methods with a drafter."""
        for key, low, fix in (
            ("draft_window", 1, "must be null or a positive integer (context tokens)"),
            ("draft_vocab_size", 0, "must be null, 0 (the full vocabulary) or a positive number of draft tokens"),
        ):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise _fail(src, key, value, fix)
            if value and self.method == "ngram":
                raise _fail(src, key, value, "applies to a drafter; n-gram has none")

    @property
    def draft_attention_backend(self) -> str | None:
        """What runs the drafter's attention here: 'torch', 'sdpa' or None (the drafter's default)."""
        return attention_backend(self.attention_backend, "speculative config")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative config: unknown key(s) {unknown}; valid keys are {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def parse(cls, text: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Parse a JSON string, ``@file.json`` or a dict; None/'' means no speculation."""
        if text is None or text == "":
            return None
        if isinstance(text, Mapping):
            return cls.from_dict(text)
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative config: not valid JSON ({e}): {text!r}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"speculative config: expected a JSON object, got {text!r}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------------
# Cache and engine
# --------------------------------------------------------------------------------------------------------


DTYPES = ("bfloat16", "float16", "float32")  # --dtype / EngineConfig.dtype: weights, activations and KV pages


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: derived from max_num_seqs * max_model_len
    swap_space: float | None = None  # vLLM's CPU swap (GiB): only 0/None, preempted requests are recomputed

    def __post_init__(self) -> None:
        _positive("cache config", page_size=self.page_size, num_pages=self.num_pages)
        if self.swap_space not in (None, 0):
            raise _fail(
                "cache config",
                "swap_space",
                self.swap_space,
                "swapping KV pages is not supported: this engine keeps its pages in host memory and recomputes "
                "preempted requests; pass 0 or omit it",
            )


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the target's max_position_embeddings (capped at 32768)
    dtype: str = "bfloat16"
    seed: int = 0
    log_stats_interval_s: float = 10.0
    max_waiting: int = 256
    attention_backend: str | None = None  # target (and default draft) attention: vLLM's --attention-backend
    prepack_weights: bool = True  # bf16 on CPU: oneDNN-packed copies of the linear weights (faster; 2× weight memory)
    # a step's batch is split into context-length groups when the padded attention work saved exceeds one extra
    # forward, costed as this many (row, key) pairs (see dspark.engine.grouping); 0: never split. 65,536 = 8 verify
    # rows over 8k keys: a batch of decodes whose contexts differ by a few hundred tokens stays whole (on k3-mini two
    # forwards of 8 requests cost more than one of 16), one 16k request among short ones does not
    split_batch_keys: int = 65536

    def __post_init__(self) -> None:
        src = "engine config"
        attention_backend(self.attention_backend, src)
        _warn_substitute(self.attention_backend, src)
        _positive(
            src,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=self.max_waiting,
        )
        if self.dtype not in DTYPES:
            raise _fail(src, "dtype", self.dtype, f"use one of {list(DTYPES)}")
        if not isinstance(self.split_batch_keys, int) or self.split_batch_keys < 0:
            raise _fail(src, "split_batch_keys", self.split_batch_keys, "use an integer >= 0 (0 disables splitting)")

    @property
    def target_attention_backend(self) -> str | None:
        """What runs the target's attention here: 'torch', 'sdpa' or None (each model's default)."""
        return attention_backend(self.attention_backend, "engine config")
