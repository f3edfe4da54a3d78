"""Per-request sampling parameters (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and the valid range."""


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
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> SamplingParamsError:
            return SamplingParamsError(f"sampling parameter {name}={value!r} is invalid: {rule}")

        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "must be in [0, 100] (0 = greedy)")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be -1, 0 (off) or a positive integer")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be a positive integer")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or null")
        if self.n != 1:
            raise bad("n", self.n, "only n=1 is supported; send several requests instead")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5
