"""Proposers: the DSpark/DFlash drafter block (one backbone pass + batched Markov loop) and n-gram prompt lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.models.drafter import DSparkDrafter, block_mask
from dspark.models.mla import LatentStore
from dspark.profiling import scope
from dspark.spec.rng import Stream, uniforms
from dspark.spec.sampling import process_logits, sample_inverse_cdf


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


def draft_block(
    drafter: DSparkDrafter,
    anchors: torch.Tensor,
    anchor_positions: torch.Tensor,
    num_keys: int,
    store: LatentStore,
    sampling: SamplingTensors,
    probabilistic: bool,
    use_markov: bool = True,
    topk: int | None = None,
) -> Proposal:
    """One drafter pass over [anchor, mask × (K−1)] for every request, then the Markov loop batched across
    requests. anchors/anchor_positions [B]; the store already holds each request's context < anchor."""
    K = sampling.counters.shape[1] - 1
    B = anchors.shape[0]
    block = torch.full((B, K), drafter.config.mask_token_id, dtype=torch.long)
    block[:, 0] = anchors
    positions = anchor_positions[:, None] + torch.arange(K)
    with scope("draft.backbone"):
        out = drafter(block, positions, block_mask(anchor_positions, K, num_keys), store=store)
    base = out.base_logits
    assert base is not None
    u = (
        uniforms(sampling.seeds, sampling.counters[:, :K], Stream.DRAFT).float().clamp(1e-7, 1 - 1e-7)
        if probabilistic
        else None
    )
    qs: list[torch.Tensor] = []

    def pick(corrected: torch.Tensor, k: int) -> torch.Tensor:
        if u is None:
            return corrected.argmax(-1)
        q = process_logits(corrected[:, None], sampling.temperature, sampling.top_k, sampling.top_p)[:, 0]
        qs.append(q)
        return sample_inverse_cdf(q, u[:, k])

    head = drafter.markov_head if use_markov else None
    with scope("draft.markov"):
        if head is not None:
            tokens = head.sample(base, out.hidden, anchors, pick, topk).tokens
        else:  # DFlash: base logits only
            tokens = torch.stack([pick(base[:, k], k) for k in range(K)], 1)
    with scope("draft.confidence"):
        prev_embeds = None
        if drafter.markov_head is not None:
            prev_embeds = drafter.markov_head.markov_w1(torch.cat((anchors[:, None], tokens[:, :-1]), 1))
        confidence = drafter.confidence(out.hidden, prev_embeds)
    q = torch.stack(qs, 1) if probabilistic else None
    return Proposal(tokens, torch.full((B,), K, dtype=torch.long), q, confidence)


def ngram_lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the K tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = list(tokens[n_tok - n :])
        for start in range(n_tok - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


def ngram_propose(token_lists: Sequence[Sequence[int]], k: int, min_n: int, max_n: int) -> Proposal:
    drafts = [ngram_lookup(t, k, min_n, max_n) for t in token_lists]
    tokens = torch.zeros(len(drafts), k, dtype=torch.long)
    for i, d in enumerate(drafts):
        if d:
            tokens[i, : len(d)] = torch.tensor(d)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    return Proposal(tokens, lengths, None, None)
