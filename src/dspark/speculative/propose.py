"""Proposers: the DSpark/DFlash drafter block (one backbone pass + batched Markov loop) and n-gram prompt lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.cache.pool import BatchStore
from dspark.models.drafter import DSparkDrafter
from dspark.profiling import scope
from dspark.speculative.draft_vocab import DraftVocab
from dspark.speculative.rng import Stream, uniforms
from dspark.speculative.sampling import all_greedy, process_logits, sample_inverse_cdf


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, K] drafted tokens d_1..d_K
    lengths: torch.Tensor  # [B] drafts available per request (K for a drafter, ≤ K for n-gram)
    q: torch.Tensor | None  # [B, K, V] draft distributions (None: greedy drafts, q one-hot at d)
    confidence: torch.Tensor | None  # [B, K] confidence logits (conditional acceptance)


@dataclass(frozen=True)
class SamplingTensors:
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B, K+1] int64 round counters (see rng.round_counters)


class BlockKeys:
    """The keys of one drafter block pass (a LatentStore): each request's committed context rows read from the
    pool, then the block's own rows, kept in memory: a draft block is never written to the cache."""

    def __init__(self, context: BatchStore) -> None:
        self.context = context

    def update(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """latent [B, Kb, W] block rows → keys [B, S + Kb, W] (context slots first)."""
        ctx = self.context.read(layer)
        return torch.cat((ctx, latent.to(ctx.dtype)), 1)


def block_keys_mask(context_rows: torch.Tensor, num_context: int, block_size: int) -> torch.Tensor:
    """Visibility over BlockKeys: every block row sees its request's first ``context_rows`` context keys (all of
    the context < its anchor, or the last W of them under a draft window) and the whole block (non-causal).
    context_rows [B] → bool [B, Kb, S + Kb]."""
    ctx = torch.arange(num_context)[None, :] < context_rows[:, None]  # [B, S]
    keys = torch.cat((ctx, ctx.new_ones(ctx.shape[0], block_size)), 1)
    return keys[:, None, :].expand(-1, block_size, -1)


def draft_block(
    drafter: DSparkDrafter,
    anchors: torch.Tensor,
    anchor_positions: torch.Tensor,
    context: BatchStore,
    sampling: SamplingTensors,
    probabilistic: bool,
    use_markov: bool = True,
    topk: int | None = None,
    context_rows: torch.Tensor | None = None,
    vocab: DraftVocab | None = None,
) -> Proposal:
    """One drafter pass over the trained block [anchor, mask × (Kb−1)] (Kb = the draft config's block_size) for
    every request, then the Markov loop over its first K slots, batched across requests. The block is
    non-causal, so it always has its trained width: K < Kb proposes the first K drafts of the full block.
    anchors/anchor_positions [B]; context reads each request's drafter context rows (positions < anchor), the
    first ``context_rows`` [B] of them valid (default: anchor_positions, the whole context). ``vocab``: a reduced
    draft vocabulary (logits over its N ids only; drafts and q are mapped back to the target's vocabulary)."""
    K = sampling.counters.shape[1] - 1
    B = anchors.shape[0]
    Kb = max(K, drafter.config.block_size or K)
    block = torch.full((B, Kb), drafter.config.mask_token_id, dtype=torch.long)
    block[:, 0] = anchors
    positions = anchor_positions[:, None] + torch.arange(Kb)
    rows = anchor_positions if context_rows is None else context_rows
    mask = block_keys_mask(rows, context.read_slots.shape[1], Kb)
    with scope("draft.backbone"):
        out = drafter(block, positions, mask, store=BlockKeys(context), compute_logits=False)
        hidden = out.hidden[:, :K]  # [B, K, D]
        base = (drafter.lm_head if vocab is None else vocab.lm_head)(hidden).float()  # [B, K, V or N]
    u = None
    probabilistic = probabilistic and not all_greedy(sampling.temperature)  # all greedy: q is one-hot at d (None)
    if probabilistic:  # greedy drafting draws no uniforms
        u = uniforms(sampling.seeds, sampling.counters[:, :K], Stream.DRAFT).float().clamp(1e-7, 1 - 1e-7)
    qs: list[torch.Tensor] = []

    def pick(corrected: torch.Tensor, k: int) -> torch.Tensor:
        if u is None:
            index = corrected.argmax(-1)
        else:
            q = process_logits(corrected[:, None], sampling.temperature, sampling.top_k, sampling.top_p)[:, 0]
            qs.append(q if vocab is None else vocab.expand(q, drafter.config.vocab_size))  # q over the target vocab
            index = sample_inverse_cdf(q, u[:, k])
        return index if vocab is None else vocab.to_target(index)

    head = drafter.markov_head if use_markov else None
    with scope("draft.markov"):
        if head is not None:
            w2 = None if vocab is None else vocab.markov_w2
            greedy = u is None and (topk is None or topk >= base.shape[-1])  # argmax picks, no top-k restriction
            tokens = head.greedy_tokens(base, anchors, w2, None if vocab is None else vocab.ids) if greedy else None
            if tokens is None:
                tokens = head.sample(base, hidden, anchors, pick, topk, w2).tokens
        else:  # DFlash: base logits only
            tokens = torch.stack([pick(base[:, k], k) for k in range(K)], 1)
    with scope("draft.confidence"):
        prev_embeds = None
        if drafter.markov_head is not None:
            prev_embeds = drafter.markov_head.markov_w1(torch.cat((anchors[:, None], tokens[:, :-1]), 1))
        confidence = drafter.confidence(hidden, prev_embeds)
    q = torch.stack(qs, 1) if probabilistic else None
    return Proposal(tokens, torch.full((B,), K, dtype=torch.long), q, confidence)


def ngram_lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's prompt lookup over prompt + generated tokens: the longest suffix n-gram (min_n ≤ n ≤ max_n) that
    also occurs earlier, taken at its earliest occurrence (the one with the longest continuation); up to k of the
    tokens that followed it. Overlapping occurrences count; the suffix itself does not."""
    seq = np.asarray(tokens, dtype=np.int64)
    L = seq.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == seq[L - n :]).all(1))
        if hits.size:
            start = int(hits[0]) + n
            return seq[start : start + k].tolist()
    return []


def ngram_propose(token_lists: Sequence[Sequence[int]], k: int, min_n: int, max_n: int) -> Proposal:
    drafts = [ngram_lookup(t, k, min_n, max_n) for t in token_lists]
    tokens = torch.zeros(len(drafts), k, dtype=torch.long)
    for i, d in enumerate(drafts):
        if d:
            tokens[i, : len(d)] = torch.tensor(d)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    return Proposal(tokens, lengths, None, None)
