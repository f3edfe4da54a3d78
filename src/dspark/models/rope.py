"""Rotary position embedding: default, linear, llama3 and YaRN (DeepSeek / HF) frequencies, on interleaved (GPT-J
style) or rotate-half (NeoX / Llama) pairs.

Reference: k3-mla-architecture.md §4. The softmax-scale part of YaRN (mscale²) lives in
``config.attention_scale``; this module gives the frequencies and the cos/sin magnitude.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark.config import RopeConfig, yarn_get_mscale


def correction_dim(num_rotations: float, dim: int, base: float, original_len: int) -> float:
    """Rotary dimension whose wavelength fits ``num_rotations`` times in the original window."""
    return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(rope: RopeConfig) -> tuple[float, float]:
    """(low, high) pair indices of the linear ramp: floor/ceil (unless truncate is off) of the beta_fast/beta_slow
    dims, clamped."""
    assert rope.original_max_position_embeddings is not None
    low = correction_dim(rope.beta_fast, rope.dim, rope.theta, rope.original_max_position_embeddings)
    high = correction_dim(rope.beta_slow, rope.dim, rope.theta, rope.original_max_position_embeddings)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope.dim - 1)


def llama3_frequencies(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths (beyond original_len / low_freq_factor) divided by factor, short ones (below
    original_len / high_freq_factor) kept, a smooth blend between."""
    assert rope.original_max_position_embeddings is not None
    orig = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * inv / rope.factor + smooth * inv
    out = torch.where(wavelen > orig / rope.low_freq_factor, inv / rope.factor, inv)
    medium = (wavelen >= orig / rope.high_freq_factor) & (wavelen <= orig / rope.low_freq_factor)
    return torch.where(medium, blended, out)


def inv_frequencies(rope: RopeConfig) -> torch.Tensor:
    """[R/2] fp32 inverse frequencies; linear divides by factor, llama3 rescales by wavelength, YaRN blends
    extrapolated and interpolated ones with a linear ramp."""
    exponents = torch.arange(0, rope.dim, 2, dtype=torch.float32) / rope.dim
    inv_extra = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_extra / rope.factor
    if rope.rope_type == "llama3":
        return llama3_frequencies(inv_extra, rope)
    if rope.rope_type != "yarn":
        return inv_extra
    inv_inter = inv_extra / rope.factor
    low, high = yarn_correction_range(rope)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope.dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp  # 1 for high-frequency pairs (kept), 0 for low-frequency pairs (÷ factor)
    return inv_inter * (1 - extrapolate) + inv_extra * extrapolate


def cos_sin_magnitude(rope: RopeConfig) -> float:
    """YaRN multiplies cos/sin by mscale(f, mscale)/mscale(f, mscale_all_dim) (1.0 for the K3 draft)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor, 1.0)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for absolute positions and rotates the rope slice of q and k."""

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        self.register_buffer("inv_freq", inv_frequencies(rope), persistent=False)
        self.magnitude = cos_sin_magnitude(rope)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] → cos, sin [..., R/2] in fp32 (angles computed in fp32, as vLLM does)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return angles.cos() * self.magnitude, angles.sin() * self.magnitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [..., T, R] by cos/sin [..., T, R/2] (broadcast over heads by the caller).

    interleave=True rotates adjacent pairs (x0, x1), (x2, x3), ... and keeps that layout (DeepSeek/vLLM
    ``is_neox_style=False``); interleave=False rotates the two halves (NeoX / Qwen3 style).
    """
    dtype = x.dtype
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)


def half_rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, R/2] → full-width tables [B, T, 1, R] for ``apply_rope_half``: (cos | cos) and (−sin | sin),
    built once per forward and shared by every layer and head."""
    return torch.cat((cos, cos), -1)[:, :, None], torch.cat((-sin, sin), -1)[:, :, None]


def apply_rope_half(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """``apply_rope(x, cos, sin, interleave=False)`` for x [B, T, heads, R] with the tables of
    ``half_rotation_tables``: x·(cos|cos) + (x2|x1)·(−sin|sin), in fewer ops and bit for bit the same values
    (x1·cos + x2·(−sin) is x1·cos − x2·sin exactly in IEEE arithmetic; tested)."""
    xf = x.float()
    return (xf * cos2 + xf.roll(xf.shape[-1] // 2, -1) * sin2).to(x.dtype)  # roll by half: (x2 | x1), one op
