"""The drafter's training batches. The global batch of optimizer step s is a pure function of s (consecutive
slices of per-epoch seeded permutations) and so are the anchors of every sample (a generator seeded by (seed, s,
row)), so a resume needs no RNG state and any rank/micro-batch split sees the same blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import lru_cache

import numpy as np
import torch

from dspark.train.anchors import block_inputs, block_targets, sample_anchors
from dspark.train.draft_data import DraftDataset


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def step_samples(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step ``step``: consecutive slices of per-epoch seeded permutations."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(g, num_samples)
        out.append(int(_epoch_order(seed, epoch, num_samples)[pos]))
    return out


def step_tokens(step: int, batch_size: int, dataset: DraftDataset, seed: int) -> int:
    """Sample tokens of optimizer step ``step``'s global batch."""
    sizes = np.diff(dataset.offsets)
    return int(sizes[step_samples(step, batch_size, len(dataset), seed)].sum())


def steps_for_tokens(tokens: int, batch_size: int, dataset: DraftDataset, seed: int) -> int:
    """The first step count whose batches hold at least ``tokens`` sample tokens (the token horizon in steps)."""
    sizes = np.diff(dataset.offsets)
    n, seen, step = len(dataset), 0, 0
    while seen < tokens:
        epoch_steps = max(1, n // batch_size)
        for s in range(step, step + epoch_steps):
            seen += int(sizes[step_samples(s, batch_size, n, seed)].sum())
            step = s + 1
            if seen >= tokens:
                break
    return max(1, step)


def _anchor_generator(seed: int, step: int | None, row: int) -> torch.Generator:
    """Training step s draws from stream (seed, 0, s, row); evaluation (step None) from (seed, 1, row)."""
    key = [seed, 0, step, row] if step is not None else [seed, 1, row]
    state = np.random.SeedSequence(key).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass(frozen=True)
class BlockBatch:
    """A padded micro-batch of sequences and their packed blocks. S = longest sample, A anchors, K slots."""

    sample_ids: tuple[int, ...]
    input_ids: torch.Tensor  # [B, S] long (right-padded)
    loss_mask: torch.Tensor  # [B, S] bool (False on padding)
    lengths: torch.Tensor  # [B] long
    anchors: torch.Tensor  # [B, A] long (A ≤ num_anchors: columns that are padding in every row are cut)
    keep: torch.Tensor  # [B, A] bool
    block_ids: torch.Tensor  # [B, A, K] = [x_a, MASK × (K−1)]
    labels: torch.Tensor  # [B, A, K] x_{a+1..a+K} (0 past the end)
    eval_mask: torch.Tensor  # [B, A, K] bool, contiguous prefix per block

    def to(self, device: torch.device) -> BlockBatch:
        """The same batch with every tensor on ``device`` (built on the host, copied without waiting)."""
        if device.type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sample_ids"}
        return replace(self, **{k: v.pin_memory().to(device, non_blocking=True) for k, v in moved.items()})


def make_block_batch(
    dataset: DraftDataset,
    sample_ids: Sequence[int],
    rows: Sequence[int],
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    seed: int,
    step: int | None,
    pad_id: int = 0,
    prompt_anchors: int = 0,
) -> BlockBatch:
    """Blocks of the given samples; ``rows`` (their row in the global step batch) seed the anchor choice, so
    a sample gets the same anchors however the step's batch is split over ranks and micro-steps.
    ``step`` None selects the evaluation stream. ``prompt_anchors``: that many more anchors per sample drawn over
    its prompt (positions before its first response token), whose labels are then supervised too (see
    ``DraftTrainConfig.prompt_anchors``)."""
    samples = [dataset[i] for i in sample_ids]
    S = max(x.size for x, _ in samples)
    B = len(samples)
    A = num_anchors + prompt_anchors
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    anchors = torch.zeros(B, A, dtype=torch.long)
    keep = torch.zeros(B, A, dtype=torch.bool)
    for r, ((x, m), row) in enumerate(zip(samples, rows)):
        input_ids[r, : x.size] = torch.from_numpy(x)
        loss_mask[r, : m.size] = torch.from_numpy(m)
        gen = _anchor_generator(seed, step, row)
        a, k = sample_anchors(loss_mask[r : r + 1, : x.size], num_anchors, gen)
        if prompt_anchors:
            a, k = _with_prompt_anchors(loss_mask[r, : x.size], a[0], k[0], prompt_anchors, gen)
        anchors[r], keep[r] = a[0], k[0]
    # drop anchor columns that are padding in every row (dummy blocks cost compute and supervise nothing)
    used = max(1, int(keep.sum(1).max()))
    anchors, keep = anchors[:, :used].contiguous(), keep[:, :used].contiguous()
    labels, eval_mask = block_targets(input_ids, loss_mask, anchors, keep, block_size)
    return BlockBatch(
        sample_ids=tuple(int(i) for i in sample_ids),
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=torch.tensor([x.size for x, _ in samples], dtype=torch.long),
        anchors=anchors,
        keep=keep,
        block_ids=block_inputs(input_ids, anchors, block_size, mask_token_id),
        labels=labels,
        eval_mask=eval_mask,
    )


def _with_prompt_anchors(
    loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add up to n anchors in the prompt (positions 0..P-1 before the first supervised token P, labels up to P)
    to one sample's response anchors [A], and supervise the prompt (loss_mask modified in place). → anchors and
    keep [1, A + n], kept anchors first, each group sorted by position."""
    first = int(loss_mask.nonzero()[0]) if bool(loss_mask.any()) else loss_mask.numel()
    prompt = torch.zeros_like(loss_mask)
    prompt[: first + 1] = True  # anchors a < P whose next token a+1 <= P is a label
    pa, pk = sample_anchors(prompt[None], n, gen)
    loss_mask[:first] = True
    a, k = torch.cat((anchors, pa[0])), torch.cat((keep, pk[0]))
    order = torch.where(k, a, a + loss_mask.numel()).argsort()
    return a[order][None], k[order][None]
