"""Acceptance statistics from the engine's own counters (vLLM semantics), as deltas around a measured run.

τ (mean acceptance length) = 1 + accepted / drafts, counting the bonus token; per-position acceptance
= accepted_per_pos[i] / drafts, where a draft is a request step with at least one draft token (as in vLLM);
verify rate = Σ(n+1) / Σ(L+1) = (accepted + drafts + undrafted steps) / verify_tokens, the share of verified target
rows that became output. Nothing here re-derives these from generated text.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest

from dspark.engine.metrics import SpecDecodingMetrics


@dataclass(frozen=True)
class SpecCounters:
    """A snapshot (or a difference of snapshots) of the speculative-decoding counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    verify_tokens: int = 0  # target rows verified (anchor + drafts)
    num_steps: int = 0
    num_undrafted: int = 0  # request steps with no draft token (not drafts; one verified row each)

    @classmethod
    def of(cls, m: SpecDecodingMetrics) -> SpecCounters:
        return cls(
            m.num_drafts,
            m.num_draft_tokens,
            m.num_accepted_tokens,
            tuple(m.accepted_per_pos),
            m.verify_tokens,
            m.num_steps,
            m.num_undrafted,
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        pairs = zip_longest(self.accepted_per_pos, other.accepted_per_pos, fillvalue=0)
        per_pos = tuple(a + sign * b for a, b in pairs)
        return SpecCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            per_pos,
            self.verify_tokens + sign * other.verify_tokens,
            self.num_steps + sign * other.num_steps,
            self.num_undrafted + sign * other.num_undrafted,
        )

    @property
    def acceptance_length(self) -> float | None:
        """τ = 1 + accepted / drafts (the bonus token counted); None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position_acceptance(self) -> list[float] | None:
        if not self.num_drafts:
            return None
        return [a / self.num_drafts for a in self.accepted_per_pos]

    @property
    def verify_rate(self) -> float | None:
        """Σ(n+1)/Σ(L+1): output tokens per verified target row."""
        if not self.verify_tokens:
            return None
        return (self.num_accepted_tokens + self.num_drafts + self.num_undrafted) / self.verify_tokens


def sum_counters(parts: list[SpecCounters | None]) -> SpecCounters | None:
    """Sum of the parts; None when no part carries counters (a method without an engine: HF baselines)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    total = SpecCounters()
    for p in present:
        total = total + p
    return total
