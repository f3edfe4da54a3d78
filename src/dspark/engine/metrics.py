"""Engine-wide counters: speculative decoding (vLLM names), verify lengths, prefix caching, requests and tokens."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger("dspark")


@dataclass
class SpecDecodingMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verify_len_hist: Counter = field(default_factory=Counter)
    num_steps: int = 0
    verify_tokens: int = 0  # target rows verified (anchor + drafts), summed over steps
    num_undrafted: int = 0  # request steps verified with no draft token (an n-gram miss, an adaptive L = 0)

    def record(self, verify_len: int, accepted: int) -> None:
        """One request's verify step. As in vLLM, a step without draft tokens is not a draft (it would dilute
        τ and the per-position rates); it still verifies one target row."""
        self.verify_len_hist[verify_len] += 1
        self.verify_tokens += verify_len + 1
        if verify_len == 0:
            self.num_undrafted += 1
            return
        self.num_drafts += 1
        self.num_draft_tokens += verify_len
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < verify_len:
            self.accepted_per_pos.extend([0] * (verify_len - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_length(self) -> float | None:
        """τ = 1 + accepted / drafts (counts the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def request_report(self) -> dict:
        """One request's counters as ``RequestOutput.spec_metrics`` shows them."""
        return {
            "acceptance_length": self.acceptance_length,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
        }

    @classmethod
    def summed(cls, reports: Sequence[Mapping]) -> SpecDecodingMetrics:
        """The counters of several ``request_report`` dicts added up (the samples of one prompt)."""
        total = cls()
        for r in reports:
            total.num_drafts += r.get("num_drafts", 0)
            total.num_draft_tokens += r.get("num_draft_tokens", 0)
            total.num_accepted_tokens += r.get("num_accepted_tokens", 0)
            per_pos = r.get("accepted_per_pos", [])
            total.accepted_per_pos.extend([0] * (len(per_pos) - len(total.accepted_per_pos)))
            for i, a in enumerate(per_pos):
                total.accepted_per_pos[i] += a
        return total

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def log_line(self) -> str:
        tau = self.acceptance_length
        rates = ", ".join(f"{r:.3f}" for r in self.per_position_acceptance)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {tau or 0.0:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}"
        )


@dataclass(frozen=True)
class PrefillTimes:
    """Wall seconds of the prefill phase (prompt chunks through the target, each finished prompt's first token
    sampled) and the prompt tokens it computed (cached prefix tokens excluded). Snapshots subtract."""

    steps: int = 0
    tokens: int = 0
    total_s: float = 0.0

    def plus(self, tokens: int, total_s: float) -> PrefillTimes:
        return self + PrefillTimes(1, tokens, total_s)

    def __sub__(self, o: PrefillTimes) -> PrefillTimes:
        return self + PrefillTimes(-o.steps, -o.tokens, -o.total_s)

    def __add__(self, o: PrefillTimes) -> PrefillTimes:
        return PrefillTimes(self.steps + o.steps, self.tokens + o.tokens, self.total_s + o.total_s)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.total_s if self.total_s > 0 else None


@dataclass(frozen=True)
class DecodeTimes:
    """Wall seconds of the decode phase (one per engine step that decodes), split into proposing the drafts
    (drafter pass + Markov loop, or n-gram lookup) and the target's verify forward. Snapshots subtract."""

    steps: int = 0
    propose_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0  # propose + verify + acceptance + commit
    grammar_s: float = 0.0  # of total_s: structured outputs' grammar masks (spec/grammar.py)

    def plus(self, propose_s: float, verify_s: float, total_s: float, grammar_s: float = 0.0) -> DecodeTimes:
        return self + DecodeTimes(1, propose_s, verify_s, total_s, grammar_s)

    def __sub__(self, o: DecodeTimes) -> DecodeTimes:
        return self + DecodeTimes(-o.steps, -o.propose_s, -o.verify_s, -o.total_s, -o.grammar_s)

    def __add__(self, o: DecodeTimes) -> DecodeTimes:
        return DecodeTimes(
            self.steps + o.steps,
            self.propose_s + o.propose_s,
            self.verify_s + o.verify_s,
            self.total_s + o.total_s,
            self.grammar_s + o.grammar_s,
        )


def tau_bound(tau: float, ar: DecodeTimes, spec: DecodeTimes) -> float | None:
    """Speed-up speculation could reach over autoregressive decoding if nothing but its measured costs counted:
    τ tokens per round for one draft pass + one verify forward, against one plain decode step per token,
    τ · t_AR_step / (t_propose + t_verify), from per-step means at the same concurrency."""
    if not ar.steps or not spec.steps or spec.propose_s + spec.verify_s <= 0:
        return None
    return tau * (ar.total_s / ar.steps) / ((spec.propose_s + spec.verify_s) / spec.steps)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, as vLLM counts them (``vllm:prefix_cache_queries`` / ``_hits``): each admission
    queries the request's tokens and hits those found cached. Re-admissions after a preemption are counted apart
    (vLLM's ``preempted_*``): their own blocks often come back and would inflate the hit rate."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Cached tokens / queried tokens (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class EngineMetrics:
    spec: SpecDecodingMetrics = field(default_factory=SpecDecodingMetrics)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    decode: DecodeTimes = field(default_factory=DecodeTimes)
    prefill: PrefillTimes = field(default_factory=PrefillTimes)
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_requests_failed: int = 0  # finished with an error (see Engine._isolated)
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    grammar_s: float = 0.0  # seconds computing structured outputs' grammar masks (first tokens included)
    log_interval_s: float = 10.0
    _last_log: float = field(default_factory=time.monotonic)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.spec.num_drafts and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            logger.info(self.spec.log_line())
