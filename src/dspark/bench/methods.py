"""What the bench measures and how a method is driven: one ``Measurement`` per batch, and the ``Method`` protocol
that our engines (``EngineMethod``) and the peer baselines (``dspark.bench.baselines``) implement."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dspark.bench.acceptance import SpecCounters
from dspark.engine.metrics import DecodeTimes, PrefillTimes
from dspark.sampling_params import SamplingParams


@dataclass(frozen=True)
class Measurement:
    output_tokens: int
    wall_s: float
    counters: SpecCounters | None  # None: the method has no speculative counters (AR baselines outside our engine)
    decode: DecodeTimes | None = None  # our engine's decode-phase times (τ-bound), None for other stacks
    requests: int = 0  # prompts in the batch (each one's first token comes from its prefill, not the decode phase)
    prefill: PrefillTimes | None = None  # the prefill phase's seconds and prompt tokens (our engine, llama.cpp)


class Method(Protocol):
    name: str
    engine_backed: bool  # runs on our engine (eligible for context-depth cells)

    def skip_reason(self, concurrency: int, temperature: float) -> str | None: ...
    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Measurement: ...
    def close(self) -> None: ...


class EngineMethod:
    """One of our engines; output tokens and counters are read from ``engine.metrics`` before and after."""

    engine_backed = True

    def __init__(self, name: str, engine: Any) -> None:
        self.name = name
        self.engine = engine

    def skip_reason(self, concurrency: int, temperature: float) -> str | None:
        limit = self.engine.cfg.max_num_seqs
        return f"concurrency {concurrency} > max_num_seqs {limit}" if concurrency > limit else None

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Measurement:
        from dspark.llm import LLM

        m = self.engine.metrics
        tokens0, spec0, decode0, prefill0 = m.generation_tokens, SpecCounters.of(m.spec), m.decode, m.prefill
        t0 = time.perf_counter()
        LLM.from_engine(self.engine).generate([list(p) for p in prompts], params)
        wall = time.perf_counter() - t0
        counters = SpecCounters.of(m.spec) - spec0 if self.engine.spec is not None else None
        delta = m.generation_tokens - tokens0
        return Measurement(delta, wall, counters, m.decode - decode0, len(prompts), m.prefill - prefill0)

    def close(self) -> None:
        pass
