"""Rotary embedding parameters: ``RopeConfig`` (default, linear, llama3 and DeepSeek's YaRN) and YaRN's two scalars,
the magnitude correction ``yarn_get_mscale`` and the softmax ``attention_scale``. The tensors live in models/rope.py."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dspark.config.common import as_is, fail, given, positive

# config.json keys that encode positions only: a continued pre-training (context extension) may change them
POSITION_KEYS = frozenset({"max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling"})

ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# the top-level config.json keys RopeConfig.from_hf reads
ROPE_KEYS = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "rope_interleave"})


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
            raise fail(src, "rope_type", self.rope_type, f"supported: {', '.join(ROPE_TYPES)}")
        if self.dim <= 0 or self.dim % 2:
            raise fail(src, "qk_rope_head_dim", self.dim, "must be a positive even number")
        positive(src, rope_theta=self.theta, factor=self.factor, beta_fast=self.beta_fast)
        if self.rope_type in ("yarn", "llama3") and self.original_max_position_embeddings is None:
            raise fail(src, "original_max_position_embeddings", None, f"{self.rope_type} needs the original length")

    @property
    def is_yarn(self) -> bool:
        return self.rope_type == "yarn" and self.factor > 1.0

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], dim: int, source: str, interleave: bool = True) -> RopeConfig:
        """From an HF config dict (``rope_parameters`` or legacy ``rope_scaling`` + ``rope_theta``); ``interleave``
        is the family's default pair layout (DeepSeek: interleaved; Llama/Qwen: rotate-half)."""
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise fail(source, "rope_parameters", params, "must be an object or null")
        rope_type = params.get("rope_type", params.get("type")) or cls.rope_type
        if rope_type == "deepseek_yarn":
            rope_type = "yarn"
        if rope_type not in ROPE_TYPES:
            raise fail(source, "rope_parameters.rope_type", rope_type, f"supported: {', '.join(ROPE_TYPES)}")
        theta = params.get("rope_theta", d.get("rope_theta"))  # legacy configs keep it at the top level
        return cls(
            dim=dim,
            rope_type=rope_type,
            interleave=bool(d.get("rope_interleave", interleave)),
            **given({"theta": theta}, {"theta": float}),
            **given(params, _HF_KEYS),
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


# rope_parameters keys read under their own name (a missing one gets RopeConfig's default)
_HF_KEYS = {
    "factor": float,
    "original_max_position_embeddings": as_is,
    "beta_fast": float,
    "beta_slow": float,
    "mscale": float,
    "mscale_all_dim": float,
    "low_freq_factor": float,
    "high_freq_factor": float,
    "attention_factor": as_is,
    "truncate": bool,
}


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
