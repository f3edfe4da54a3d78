"""A generation request and its state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dspark.engine.metrics import SpecDecodingMetrics
from dspark.sampling_params import SamplingParams
from dspark.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # policy modules (the scheduler) import this one and no torch
    from dspark.speculative.grammar import GrammarMatcher
    from dspark.speculative.logprobs import TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token (params.logprobs set)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per prompt token (prompt_logprobs)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose target latents are in the cache (positions 0..num_computed-1)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    spec: SpecDecodingMetrics = field(default_factory=SpecDecodingMetrics)  # this request's counters
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    aborted: bool = False
    error: str | None = None  # what raised while processing this request (finish_reason "error")
    detok: IncrementalDetokenizer | None = None  # output text (None: built outside Engine.add_request, no text)
    grammar: GrammarMatcher | None = None  # structured output: the grammar its tokens follow (spec/grammar.py)
    hold: bool = False  # P/D disaggregation: a normal finish keeps its pages and state slot for export (transfer.py)
    # prefix caching: the chained hashes of its full blocks so far, the tokens its last admission found cached, where
    # a stateful target's prefill ends chunks (block boundaries whose states are worth a snapshot), and the block of
    # the snapshot its decoding keeps (the latest boundary it crossed; the one before is dropped)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    split_at: tuple[int, ...] = ()
    decode_snapshot: bytes | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens that need target latents before decoding: all but the anchor (the last, not-yet-seen token)."""
        return self.num_tokens - 1 if self.output_ids else self.num_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
