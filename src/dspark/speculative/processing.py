"""Logits processing before temperature / top-k / top-p: ``logit_bias``, ``min_tokens``, and the repetition,
frequency and presence penalties (vLLM's semantics and order), batched over the rows of a verification round.

Row j of a round [anchor, d_1..d_K] decides the token after d_j, so its counts are the request's generated tokens
so far plus d_1..d_j: the penalties a plain decoder would apply after accepting those drafts. Verification then
accepts against exactly the distribution plain decoding samples from, which keeps speculation lossless.
- ``logit_bias``: added to the logits.
- ``min_tokens``: EOS and the stop token ids get -inf while fewer than ``min_tokens`` tokens are generated.
- repetition penalty r (prompt and generated tokens): a seen token's logit l becomes l / r if l > 0, else l * r.
- frequency f and presence p (generated tokens only): l - f * count - p * (count > 0).
- structured outputs: tokens the request's grammar refuses get -inf (row j: the grammar after d_1..d_j;
  ``speculative/grammar.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProcessingTensors:
    counts: torch.Tensor  # [B, V] float32: each token's count among the generated tokens before the round
    prompt_seen: torch.Tensor  # [B, V] bool: tokens of the prompt (repetition penalty)
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (1 = off)
    bias: torch.Tensor  # [B, V] float32
    min_left: torch.Tensor  # [B] int64: tokens to generate before EOS / stop ids may be (min_tokens - generated)
    min_mask: torch.Tensor  # [B, V] bool: the tokens min_tokens holds back (EOS and stop_token_ids)
    allowed: torch.Tensor | None = None  # [B, T, V] bool: what each row's grammar allows (None: no grammar)


def round_counts(counts: torch.Tensor, drafts: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """counts [B, V] before the round, drafts [B, >= T-1] (d_1..) -> [B, T, V]: row j adds d_1..d_j."""
    B, V = counts.shape
    rows = counts[:, None].expand(B, num_rows, V)
    if drafts is None or num_rows == 1:
        return rows
    d = drafts[:, : num_rows - 1].clamp(0, V - 1)  # slots past a request's length feed rows that are ignored
    hot = torch.zeros(B, num_rows, V, dtype=counts.dtype)
    hot[:, 1:].scatter_(-1, d[..., None], 1.0)
    return rows + hot.cumsum(dim=1)


def process(logits: torch.Tensor, pt: ProcessingTensors, drafts: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, T, V] of a round (row j after d_1..d_j; drafts [B, >= T-1]) -> processed fp32 logits [B, T, V]."""
    B, T, V = logits.shape
    x = logits.float() + pt.bias[:, None]
    held = torch.arange(T)[None, :] < pt.min_left[:, None]  # [B, T]: row j is generated token #generated + j
    x = x.masked_fill(held[:, :, None] & pt.min_mask[:, None], float("-inf"))
    counts = round_counts(pt.counts, drafts, T)
    generated = counts > 0
    rep = pt.repetition[:, None, None]
    seen = generated | pt.prompt_seen[:, None]
    x = torch.where(seen & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - pt.frequency[:, None, None] * counts - pt.presence[:, None, None] * generated
    return x if pt.allowed is None else x.masked_fill(~pt.allowed, float("-inf"))
