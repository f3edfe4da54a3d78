"""The DSpark drafter's config: ``DraftConfig``, read from the official ``k3_dspark`` config.json (MLA backbone) or
DeepSpec's ``Qwen3DSparkModel`` one (GQA backbone), and written back in the same format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from dspark.config.common import (
    REDUCED_VOCAB_FIX,
    ConfigKeys,
    as_is,
    fail,
    given,
    hf_keys,
    missing,
    positive,
    read_config,
    require,
    required_ints,
    token_ids,
)
from dspark.config.rope import ROPE_KEYS, RopeConfig
from dspark.config.target import GQATargetConfig, MLAConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
TAP_STREAMS = ("prefix", "residual")
DRAFT_ARCHITECTURES = ("K3DSparkModel", "Qwen3DSparkModel")


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark drafter ``config.json`` (``k3_dspark`` MLA backbone or DeepSpec ``Qwen3DSparkModel`` GQA)."""

    KEYS: ClassVar[ConfigKeys]  # the config.json keys it reads and lets pass (set below the class)
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
            raise fail(src, "architectures", self.architecture, f"supported: {list(DRAFT_ARCHITECTURES)}")
        positive(
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
            raise fail(src, "aux_hidden_stream", self.aux_hidden_stream, f"use one of {list(TAP_STREAMS)} or omit it")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise fail(src, "markov_head_type", self.markov_head_type, f"use one of {list(MARKOV_HEAD_TYPES)}")
        if self.markov_rank < 0:
            raise fail(src, "markov_rank", self.markov_rank, "must be >= 0 (0 disables the Markov head)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise fail(src, "mask_token_id", self.mask_token_id, f"must be in [0, vocab_size={self.vocab_size})")
        ids = self.target_layer_ids
        if not ids:
            raise fail(src, "target_layer_ids", list(ids), "list at least one target layer")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise fail(src, "target_layer_ids", list(ids), "must be strictly increasing")
        if ids[0] < -1 or ids[-1] >= self.target_num_hidden_layers:
            raise fail(
                src,
                "target_layer_ids",
                list(ids),
                f"each id must be in [-1, target_num_hidden_layers={self.target_num_hidden_layers})",
            )
        if self.draft_vocab_size not in (None, self.vocab_size):
            raise fail(src, "draft_vocab_size", self.draft_vocab_size, REDUCED_VOCAB_FIX)
        if self.is_gqa:
            positive(src, num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim)
            if self.num_attention_heads % (self.num_key_value_heads or 1):
                raise fail(src, "num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")

    @property
    def is_gqa(self) -> bool:
        return self.architecture == "Qwen3DSparkModel"

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def mla(self) -> MLAConfig:
        return MLAConfig.of(self)

    @property
    def confidence_input_dim(self) -> int:
        with_markov = self.confidence_head_with_markov and self.markov_rank > 0
        return self.hidden_size + (self.markov_rank if with_markov else 0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "draft config.json") -> DraftConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else {"k3_dspark": "K3DSparkModel"}.get(d.get("model_type", ""), "")
        if arch not in DRAFT_ARCHITECTURES:
            raise fail(source, "architectures", archs, f"expected one of {list(DRAFT_ARCHITECTURES)}")
        gqa = arch == "Qwen3DSparkModel"
        n_target = d.get("target_num_hidden_layers") or d.get("num_target_layers")
        if gqa:
            # DeepSpec copies the target config: num_target_layers is the target depth
            n_target = d.get("num_target_layers") or d.get("target_num_hidden_layers")
        hidden = int(require(d, "hidden_size", source))
        sizes = required_ints(d, source, "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        layer_ids = tuple(int(i) for i in require(d, "target_layer_ids", source))
        if not int(n_target or 0):
            raise missing(source, "target_num_hidden_layers")
        mask_token_id = int(require(d, "mask_token_id", source))
        optional = given(d, _OPTIONAL)
        dtype = d.get("torch_dtype", d.get("dtype"))  # transformers 5 writes "dtype"
        if dtype is not None:
            optional["torch_dtype"] = str(dtype)
        if gqa:  # a DeepSpec draft copies its Qwen3 target's config, and with it the target's defaults
            optional = {"rms_norm_eps": GQATargetConfig.rms_norm_eps} | optional
            optional |= {"num_key_value_heads": d.get("num_key_value_heads"), "head_dim": d.get("head_dim")}
        rope_dim = int(d.get("head_dim") or 128) if gqa else optional.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        known = {f.name for f in fields(cls)}
        return cls(
            architecture=arch,
            hidden_size=hidden,
            **sizes,
            target_layer_ids=layer_ids,
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            target_num_hidden_layers=int(n_target),
            mask_token_id=mask_token_id,
            rope=_draft_rope(d, rope_dim, source, gqa),
            **optional,
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str | Path) -> DraftConfig:
        return cls.from_dict(*read_config(path))

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


# DraftConfig.from_dict: the optional keys read under their own name (a missing one gets the field's default)
_OPTIONAL = {
    "max_position_embeddings": int,
    "q_lora_rank": as_is,
    "kv_lora_rank": int,
    "qk_nope_head_dim": int,
    "qk_rope_head_dim": int,
    "v_head_dim": int,
    "mla_use_nope": bool,
    "mla_use_output_gate": bool,
    "attention_bias": bool,
    "markov_rank": int,
    "markov_head_type": as_is,
    "enable_confidence_head": bool,
    "confidence_head_with_markov": bool,
    "block_size": as_is,
    "draft_vocab_size": as_is,
    "aux_hidden_stream": as_is,
    "rms_norm_eps": float,
    "hidden_act": as_is,
    "tie_word_embeddings": bool,
    "bos_token_id": as_is,
    "eos_token_id": token_ids,
    "pad_token_id": as_is,
}
_DRAFT_READ = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "vocab_size", "target_layer_ids", "target_hidden_size", "target_num_hidden_layers", "num_target_layers",
    "mask_token_id", "num_key_value_heads", "head_dim", "torch_dtype", "dtype", *_OPTIONAL, *ROPE_KEYS,
}  # fmt: skip
DraftConfig.KEYS = hf_keys(
    _DRAFT_READ,
    # a DeepSpec drafter is its Qwen3 target's config.json with DeepSpec's keys added (num_anchors: training only)
    (GQATargetConfig.KEYS.read | GQATargetConfig.KEYS.passed | {"num_anchors"}) - _DRAFT_READ,
)
