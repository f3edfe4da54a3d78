"""What the engine needs from a target model, whatever its family.

Every family (DeepSeek-V3/Kimi-K2 MLA, Llama/Qwen2/Qwen3 GQA, the transformers fallback, later KimiLinear) gives:
- ``config``: the few hyper-parameters the engine reads (``TargetInfo``);
- ``page_format``: what one paged cache row holds per token per layer (``PageFormat``), and ``state_spec``: the
  per-request recurrent state it needs besides pages (``StateSpec``; None for pure-attention models);
- ``forward(input_ids, positions, mask, cache, tap_layers, logits_rows)`` → ``TargetOutput``: fp32 logits at the
  requested rows and the raw outputs of the tapped decoder layers (layer i's output = HF ``hidden_states[i+1]``).
The engine, scheduler and verification never branch on the family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

PageKind = Literal["mla", "gqa", "tokens"]


@dataclass(frozen=True)
class PageFormat:
    """One paged cache row per token per layer.

    kind: "mla" — the latent [kv_a_layernorm(c_kv) | rope(k_pe)] (576 wide for K3); "gqa" — [rope(k) | v] of every
    KV head (2·n_kv·head_dim); "tokens" — the token id itself (the recompute fallback keeps only ids).
    Two models share one pool (and its layer stack) when their formats are ``compatible``.
    """

    kind: PageKind
    width: int  # values per token per layer
    num_layers: int  # paged layers
    dtype: torch.dtype | None = None  # None: the model's parameter dtype

    def __post_init__(self) -> None:
        if self.width <= 0 or self.num_layers < 0:
            raise ValueError(f"page format: width {self.width} and num_layers {self.num_layers} must be positive")

    def compatible(self, other: PageFormat) -> bool:
        """Same row layout, width and storage dtype: rows of both can live in one pool."""
        return (self.kind, self.width, self.dtype) == (other.kind, other.width, other.dtype)


@dataclass(frozen=True)
class StateSpec:
    """Per-request recurrent state (e.g. KDA): ``num_layers`` tensors of ``shape`` per request slot."""

    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class CacheView(Protocol):
    """A per-forward view of a paged pool: where this batch's new rows go and which rows it reads."""

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """Store rows [B, T, W] for the batch's new tokens."""
        ...

    def read(self, layer: int) -> torch.Tensor:
        """Every visible row [B, S, W] (the mask says which are valid)."""
        ...

    def update(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """write, then read."""
        ...


class TargetInfo(Protocol):
    """The hyper-parameters the engine, tokenizer and doctor read from any target's config."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    model_type: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor | None  # [B, N, V] fp32 at the requested rows
    taps: torch.Tensor | None  # [B, T, m·D] concatenated raw outputs of the tapped layers
    hidden: torch.Tensor  # [B, T, D] final post-norm hidden state


def head_output(
    hidden: torch.Tensor,
    taps: list[torch.Tensor],
    logits_rows: torch.Tensor | None,
    project: Callable[[torch.Tensor], torch.Tensor] | None,
) -> TargetOutput:
    """The end of every decoder's forward: post-norm hidden [B, T, D] and the tapped streams (each [B, T, D]) →
    TargetOutput with ``project``'s fp32 logits at logits_rows [B, N] (all rows when None; none without project)."""
    logits = None
    if project is not None:
        D = hidden.shape[-1]
        rows = hidden if logits_rows is None else hidden.gather(1, logits_rows[..., None].expand(-1, -1, D))
        logits = project(rows)
    return TargetOutput(logits=logits, taps=torch.cat(taps, -1) if taps else None, hidden=hidden)


class Target(Protocol):
    """A target model as the engine drives it (implemented by MLATarget, LlamaTarget, HFTarget and the hybrid
    KimiLinearTarget). A target with a ``state_spec`` is also called with ``states`` (a view of its per-request
    state slots, models/kda.py ``StateStore``) and ``lengths`` [B] (valid rows per request: padding rows must
    leave the state untouched)."""

    config: TargetInfo

    @property
    def page_format(self) -> PageFormat: ...

    @property
    def state_spec(self) -> StateSpec | None: ...

    @property
    def invariance_note(self) -> str | None:
        """What besides a row's own tokens can change the rounding of its logits (the engine says it once at
        start-up), or None when nothing can: not the batch, the prefill chunks nor a cached prefix."""
        ...

    @property
    def tap_streams(self) -> tuple[str, ...]:
        """Streams a tap can read, the default first ("residual"; AttnRes targets: "prefix", "residual"). A
        target with more than one is also called with ``tap_stream``."""
        ...

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def lm_head(self) -> nn.Module: ...

    def parameters(self, recurse: bool = True): ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: CacheView | None,
        tap_layers: Sequence[int] = (),
        logits_rows: torch.Tensor | None = None,
    ) -> TargetOutput:
        """input_ids/positions [B, T] new tokens; mask [B, T, S] bool over the keys ``cache`` reads (S = T without
        a cache); logits_rows [B, N] row indices into T (None: every row)."""
        ...
