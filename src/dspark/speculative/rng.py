"""Counter-based randomness for speculative sampling.

Every uniform is a pure function of ``(seed, counter, stream)``: no generator state, so a request draws the
same numbers whether it runs alone or inside any batch, in any row order.

The hash works on 32-bit words held in int64 tensors and masks after every step, so no intermediate value
leaves [0, 2^48 + 2^32) and nothing relies on signed overflow. Each word goes through the ``lowbias32`` mixer
(xor-shift / multiply, multiplies done on 16-bit halves). ``(seed, stream)`` becomes two 32-bit round keys per
row; the 64-bit counter is then mixed in with those keys, so two streams that happen to share one key still
give unrelated values.

Counters: a verification round must use counters no earlier round has used on the same stream. Block
verification looks at every acceptance uniform it draws (and, through tau, at the draft uniforms), and a
uniform that comes back in a later round is already conditioned on the earlier outcome, which biases the
output. Keying the ACCEPT or DRAFT uniforms by absolute token position does exactly that, because the next
round re-covers the rejected positions (measured: TV about 0.02-0.04 on a toy chain; token-wise verification
happens to be immune). Use ``round_counters(anchor_positions, n)``: its counter is
``anchor * MAX_SLOTS + slot``, and the anchor (the last committed token, a strictly increasing position per
request) is different in every round.
"""

from enum import IntEnum

import torch

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_GOLDEN = 0x9E3779B9
_LOWBIAS_M1 = 0x7FEB352D
_LOWBIAS_M2 = 0x846CA68B
_TWO_POW_M32 = 2.0**-32

MAX_SLOTS = 32  # slots per verification round in `round_counters`; K + 1 <= MAX_SLOTS


class Stream(IntEnum):
    DRAFT = 1  # draft-token sampling
    ACCEPT = 2  # acceptance tests of the drafts
    RESIDUAL = 3  # residual, bonus and plain (non-speculative) target sampling


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for x in [0, 2^32), exact in int64: multiply by the two 16-bit halves of c."""
    lo = x * (c & _MASK16)  # < 2^48
    hi = ((x * (c >> 16)) & _MASK16) << 16  # < 2^32
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """lowbias32 avalanche mixer; a bijection on 32-bit words."""
    x = x ^ (x >> 16)
    x = _mul32(x, _LOWBIAS_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _LOWBIAS_M2)
    return x ^ (x >> 16)


def _split64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high 32-bit words of int64 values (two's complement, so negative seeds are fine)."""
    return x & _MASK32, (x >> 32) & _MASK32


def _row_keys(seeds: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent-looking 32-bit keys per row from (seed [B], stream)."""
    lo, hi = _split64(seeds)
    s = _mix32((int(stream) * _GOLDEN) & _MASK32)  # a Python int; the mixer works on ints too
    k1 = _mix32(_mix32(hi ^ s) ^ lo)
    k2 = _mix32(_mix32(k1 ^ _GOLDEN) ^ hi)
    return k1, k2


def _hash(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """32-bit hash of (seed [B], counter [B, T], stream) -> int64 [B, T] in [0, 2^32)."""
    k1, k2 = _row_keys(seeds.to(torch.int64), stream)
    lo, hi = _split64(counters.to(torch.int64))
    h = _mix32(lo ^ k1[:, None])
    return _mix32(_mix32(h ^ k2[:, None]) ^ hi)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float64 with 32 random bits.

    seeds: [B] int64 request seeds. positions: [B, T] int64 counters (any int64 value). stream: a `Stream`.
    Returns [B, T] float64 u = (h + 0.5) / 2^32, so 2^-33 <= u <= 1 - 2^-33. Cast to float32 only after
    clamping, because float32 rounds values near 1 up to 1.0.
    """
    if seeds.dim() != 1 or positions.dim() != 2 or positions.shape[0] != seeds.shape[0]:
        raise ValueError(
            f"uniforms: expected seeds [B] and positions [B, T], got seeds {tuple(seeds.shape)} and "
            f"positions {tuple(positions.shape)}; add a trailing dim to positions with positions[:, None]"
        )
    h = _hash(seeds, positions, stream)
    return (h.to(torch.float64) + 0.5) * _TWO_POW_M32


def round_counters(anchor_positions: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Counters for one verification round: anchor * MAX_SLOTS + slot, slot = 0..num_slots-1.

    anchor_positions: [B] int64 position of each request's last committed token (the anchor; it grows
    every round). Returns [B, num_slots] int64. Suggested use: the acceptance uniforms take slots 0..K on
    Stream.ACCEPT, the draft token k takes slot k on Stream.DRAFT, and the residual/bonus takes slot 0 on
    Stream.RESIDUAL. Plain sampling of the token after position P is a round with anchor P and K = 0.
    """
    if not 0 < num_slots <= MAX_SLOTS:
        raise ValueError(f"round_counters: num_slots={num_slots} must be in 1..{MAX_SLOTS} (K + 1 <= {MAX_SLOTS})")
    slots = torch.arange(num_slots, dtype=torch.int64, device=anchor_positions.device)
    return anchor_positions.to(torch.int64)[:, None] * MAX_SLOTS + slots
