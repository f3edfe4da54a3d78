"""Speculation that never runs slower than plain decoding: a measured on/off switch for drafting.

A speculative round pays when its accepted tokens outweigh its cost (a drafter pass plus a K+1-row verify). That
depends on what the engine cannot know in advance: how predictable the text is (τ falls with context depth, on chat,
at high temperature), how many requests share the step (verify rows stop being free at high concurrency), and the
machine. ``SpeculationGuard`` measures it instead. For every batch-size bucket it keeps the tokens emitted per
second of speculative rounds and of plain steps (exponential moving averages of tokens and of seconds), lets the
faster mode lead, and every ``period`` steps of the leader runs ``probe`` steps of the other mode to refresh its
estimate (the text, the depth and the machine's load drift). While plain steps keep winning, each confirming probe
doubles the wait before the next one (up to ``max_period``), so a drafter that does not pay costs less and less; a
probe that drafting wins (by ``margin``: a lucky probe of two rounds must not buy ``period`` losing ones) brings the
period back to ``period``, and while drafting leads, every round compares its fresh rate with the plain steps' last
one, so drafting that stops paying hands the lead back at once. Either way the lead changes hands only when the
other mode is faster by ``margin``: a round's tokens vary widely (1 to K+1), and a few unlucky rounds early in an
answer must not switch off drafting that the rest of the answer repays (on a near tie the leader keeps the lead).
Either mode samples from the target's distribution, so switching never changes what a request can produce (greedy
output is identical token for token); only seeded sampled output, which depends on the rounds taken, would differ
from run to run, so the engine leaves a step with a seeded sampled request out of the guard (it drafts).

It is on by default (``speculation_guard`` in the speculative config): where a round costs more than its accepted
tokens repay (a weak drafter, quantized target weights that make plain steps cheap, a slow host), drafting goes off
after the first probe and ``describe()`` says when and why (``dspark generate`` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Mode:
    tokens: float = 0.0  # EMA of tokens emitted per step
    seconds: float = 0.0  # EMA of seconds per step
    steps: int = 0  # warm steps, the ones the averages hold
    cold: int = 0  # first steps left out (one-time costs: new shapes, first allocations)

    def observe(self, tokens: int, seconds: float, alpha: float, cold: int) -> None:
        if self.cold < cold:
            self.cold += 1
            return
        if self.steps == 0:
            self.tokens, self.seconds = float(tokens), seconds
        else:
            self.tokens += alpha * (tokens - self.tokens)
            self.seconds += alpha * (seconds - self.seconds)
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    draft: _Mode = field(default_factory=_Mode)
    plain: _Mode = field(default_factory=_Mode)
    leader_drafts: bool = True  # speculation leads until plain steps have been measured against it
    until_probe: int = 0  # leader steps left before the next probe
    probe_left: int = 0  # probe steps (the other mode) still to run
    off_at: int | None = None  # the bucket's step count when drafting last lost the lead (None: it never did)
    off_rates: tuple[float, float, float] = (0.0, 0.0, 0.0)  # then: round tok/s, plain tok/s, tokens per round
    period: int = 0  # leader steps until the next probe after this one (doubles while plain steps keep winning)

    @property
    def steps(self) -> int:
        return self.draft.steps + self.plain.steps


@dataclass
class SpeculationGuard:
    period: int = 32  # leader steps between two probes of the other mode
    max_period: int = 512  # the longest wait between probes while plain steps keep winning
    probe: int = 2  # steps per probe
    warmup: int = 16  # warm speculative rounds before the first probe of plain decoding (once per engine and
    # batch-size bucket: a round's tokens vary from 1 to K+1, so fewer rounds cannot tell a 10 % difference)
    alpha: float = 0.3  # EMA weight of the newest step
    cold: int = 2  # the first steps of each mode in a bucket pay one-time costs: left out of its rate
    margin: float = 0.1  # the leading mode keeps the lead until the other is this much faster: a lucky probe of a
    # few rounds must not buy ``period`` rounds that lose, and a few unlucky rounds (a round's tokens vary widely:
    # 1 to K+1) must not hand the lead to plain steps that are no faster
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            self.period < 1
            or self.max_period < self.period
            or self.probe < 1
            or self.warmup < 0
            or self.cold < 0
            or not 0.0 < self.alpha <= 1.0
            or self.margin < 0.0
        ):
            raise ValueError(
                f"speculation guard: period={self.period}, max_period={self.max_period}, probe={self.probe}, "
                f"warmup={self.warmup}, alpha={self.alpha}, margin={self.margin}; need period >= 1, max_period >= "
                "period, probe >= 1, warmup >= 0, 0 < alpha <= 1, margin >= 0"
            )

    def _bucket(self, batch_size: int) -> _Bucket:
        key = max(1, batch_size).bit_length()  # 1, 2-3, 4-7, 8-15, ...: similar verify economics
        if key not in self.buckets:
            self.buckets[key] = _Bucket(until_probe=self.warmup)
        return self.buckets[key]

    def drafting(self, batch_size: int) -> bool:
        """Whether a decode step over ``batch_size`` requests should draft."""
        b = self._bucket(batch_size)
        return b.leader_drafts != (b.probe_left > 0)

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """Record one decode step: whether it drafted, the tokens it emitted and its wall time."""
        b = self._bucket(batch_size)
        mode = b.draft if drafted else b.plain
        mode.observe(tokens, seconds, self.alpha, self.cold)
        if drafted != b.leader_drafts:  # a probe step: it ends once it has measured ``probe`` warm steps
            b.probe_left = max(0, b.probe_left - 1) if mode.steps else b.probe_left
            if b.probe_left == 0:
                self._elect(b)
            return
        if drafted and b.plain.steps and b.draft.rate * (1.0 + self.margin) < b.plain.rate:
            self._hand_back(b)
            return
        b.until_probe -= 1 if mode.steps else 0
        if b.until_probe <= 0 and b.probe_left == 0:
            b.probe_left = self.probe

    def _elect(self, b: _Bucket) -> None:
        """After a probe: the faster measured mode leads until the next probe, ``period`` steps away, or twice as
        far as last time when plain steps were leading and still are."""
        kept_plain = False
        if b.draft.steps and b.plain.steps:
            drafted = b.leader_drafts
            b.leader_drafts = b.draft.rate * (1.0 + self.margin if drafted else 1.0) >= b.plain.rate * (
                1.0 if drafted else 1.0 + self.margin
            )
            kept_plain = not drafted and not b.leader_drafts
            if drafted and not b.leader_drafts:
                b.off_at, b.off_rates = b.steps, (b.draft.rate, b.plain.rate, b.draft.tokens)
        b.period = min(2 * b.period, self.max_period) if kept_plain else self.period
        b.until_probe = b.period

    def _hand_back(self, b: _Bucket) -> None:
        """Drafting leads, but its own rate (fresh every round) fell below the plain steps' last measured rate: plain
        steps lead from this step on, not ``period`` rounds later (a probe that a few lucky rounds won buys only the
        rounds it takes the average to fall back), and the wait before the next probe grows as after a probe that
        plain steps win."""
        b.leader_drafts = False
        b.off_at, b.off_rates = b.steps, (b.draft.rate, b.plain.rate, b.draft.tokens)
        b.period = min(2 * max(b.period, self.period), self.max_period)
        b.until_probe, b.probe_left = b.period, 0

    def report(self) -> dict[str, dict[str, float | int | bool]]:
        """Per batch-size bucket ('1', '2-3', ...): measured tokens/s of each mode, steps, and who leads."""
        out = {}
        for key, b in sorted(self.buckets.items()):
            lo, hi = 1 << (key - 1), (1 << key) - 1
            out[str(lo) if lo == hi else f"{lo}-{hi}"] = {
                "draft_tok_s": round(b.draft.rate, 2),
                "plain_tok_s": round(b.plain.rate, 2),
                "draft_steps": b.draft.steps,
                "plain_steps": b.plain.steps,
                "drafting": b.leader_drafts,
                "switched_off_at_step": b.off_at,
            }
        return out

    def describe(self) -> list[str]:
        """One line per batch-size bucket: drafting on or off, and why (the measured rates)."""
        lines = []
        for size, b in zip(self.report(), (self.buckets[k] for k in sorted(self.buckets))):
            where = f"batch size {size}"
            if not b.plain.steps:
                lines.append(f"{where}: drafting on ({b.draft.steps} rounds, plain decoding not measured yet)")
            elif b.leader_drafts:
                lines.append(
                    f"{where}: drafting on: rounds {b.draft.rate:.1f} tok/s >= plain steps {b.plain.rate:.1f} tok/s"
                    + (f" (it was off from step {b.off_at})" if b.off_at is not None else "")
                )
            else:
                draft, plain, tokens = b.off_rates
                lines.append(
                    f"{where}: drafting switched off at step {b.off_at}: speculative steps emitted {tokens:.2f} "
                    f"tokens each, {draft:.1f} tok/s, plain steps {plain:.1f} tok/s (a round costs more than its "
                    f"accepted tokens repay); re-measured {self.probe} rounds after {b.period} steps, then less often "
                    f"(up to every {self.max_period}) while plain steps keep winning"
                )
        return lines
