"""Per-request sampling parameters (vLLM-compatible names), range-checked at construction so a bad value is
refused where it enters (HTTP 400, ``ValueError`` from ``LLM.generate``, a CLI error), never inside the engine.
``n`` samples of a prompt run as ``n`` engine requests (``SamplingParams.samples``).

Logits processing (``logit_bias``, ``min_tokens``, then the repetition / frequency / presence penalties, vLLM's
names and order) changes the distribution that is sampled and that verification accepts against; ``logprobs`` and
``prompt_logprobs`` report the model's raw distribution (log-softmax of the logits, before any processing).
``structured`` constrains the output to a JSON schema, a regex, a choice or a grammar (a mask on the same
distribution; ``speculative/grammar.py``)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace

# Seeds and top_k go into int64 tensors (spec/rng.py hashes the two 32-bit words of each int64 seed).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
MAX_LOGPROBS = 20  # top alternatives per position (vLLM's default max_logprobs)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and the valid range."""


def _bad(name: str, value: object, rule: str) -> SamplingParamsError:
    return SamplingParamsError(f"sampling parameter {name}={value!r} is invalid: {rule}")


def _is_int(v: object, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_real(v: object, lo: float, hi: float) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def _as_tuple(name: str, value: object) -> tuple:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple):
        raise _bad(name, value, "must be a list")
    return tuple(value)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a JSON schema, as
    a dict or its JSON text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (Lark, or GBNF / EBNF with ``::=`` rules). ``json`` is kept as JSON text (property order kept: it
    is the order the output follows)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad("structured", given, f"give exactly one of {', '.join(STRUCTURED_KINDS)}")
        self._check_values()

    def _check_values(self) -> None:
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(f"structured.{name}", value, "must be a non-empty string")
        if self.json is not None and not isinstance(_json_object(self.json), dict):
            raise _bad("structured.json", self.json, "must be a JSON schema: an object, or its JSON text")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise _bad("structured.choice", self.choice, "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _json_object(text: object) -> object:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # per generated token: its logprob and the top-k alternatives' (0: its own only)
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none); no prefix-cache hit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict, hash=False)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    structured: StructuredOutput | None = None  # the output matches this schema / regex / choice / grammar
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        self._check_numbers()
        self._check_lists()
        self._check_processing()
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def _check_numbers(self) -> None:
        if not _is_real(self.temperature, 0.0, MAX_TEMPERATURE):
            raise _bad("temperature", self.temperature, f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        if not _is_real(self.top_p, 0.0, 1.0) or self.top_p == 0:
            raise _bad("top_p", self.top_p, "must be a number in (0, 1]")
        if not _is_int(self.top_k, -1):
            raise _bad("top_k", self.top_k, f"must be -1, 0 (off) or a positive integer <= {INT64_MAX}")
        if not _is_int(self.max_tokens, 0):
            raise _bad("max_tokens", self.max_tokens, f"must be an integer in [0, {INT64_MAX}] (0: the prompt only)")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, f"must be null or an integer in [{INT64_MIN}, {INT64_MAX}] (int64)")
        if not _is_int(self.n, 1):
            raise _bad("n", self.n, f"must be an integer in [1, {INT64_MAX}] (samples per prompt)")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "must be true or false")

    def _check_lists(self) -> None:
        bad_stop = [s for s in self.stop if not isinstance(s, str)]
        if bad_stop:
            raise _bad("stop", self.stop, f"every stop sequence must be a string (got {bad_stop[0]!r})")
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t, 0)]
        if bad_ids:
            raise _bad("stop_token_ids", bad_ids[0], f"token ids must be integers in [0, {INT64_MAX}]")

    def _check_processing(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, 0, MAX_LOGPROBS):
                raise _bad(name, value, f"must be null or an integer in [0, {MAX_LOGPROBS}] (top alternatives)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_real(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                raise _bad(name, getattr(self, name), f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        r = self.repetition_penalty
        if not _is_real(r, 0.0, MAX_REPETITION_PENALTY) or r == 0:
            raise _bad("repetition_penalty", r, f"must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        if not _is_int(self.min_tokens, 0):  # above max_tokens: EOS is held back for every token
            raise _bad("min_tokens", self.min_tokens, f"must be an integer in [0, {INT64_MAX}]")
        if not isinstance(self.logit_bias, dict):
            raise _bad("logit_bias", self.logit_bias, "must be a dict {token_id: bias}")
        bad = [(t, b) for t, b in self.logit_bias.items() if not _is_int(t, 0) or not _is_real(b, -100, 100)]
        if bad:
            raise _bad(
                "logit_bias",
                dict(bad[:1]),
                f"keys must be token ids >= 0, values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        if isinstance(self.structured, dict):  # asdict() of one (a P/D payload's header)
            object.__setattr__(self, "structured", StructuredOutput(**self.structured))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise _bad("structured", self.structured, "must be a StructuredOutput")

    @property
    def processes_logits(self) -> bool:
        """Whether the sampled distribution differs from the temperature / top-k / top-p one."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or any(self.logit_bias.values())
            or self.structured is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    def samples(self) -> list[SamplingParams]:
        """The ``n`` independent samples of a request, each as one engine request (n=1): sample i draws from its
        own seed stream, ``sample_seed(seed, i)``; without a seed each sample gets the engine's per-request seed.
        With n=1: these very params."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=sample_seed(self.seed, i)) for i in range(self.n)]


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request seeded with ``seed``: sample 0 keeps it (n=1 is unchanged), the
    others get an int64 derived from (seed, index), so a seeded request with n > 1 reproduces sample by sample."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
