"""DSpark training blocks: anchor sampling, block labels/masks, attention visibility and positions.

Shapes: B batch, S sequence length, A anchors per sequence, K block size (slots per block).

A block at anchor position a has K input slots ``[x_a, MASK, ..., MASK]`` at positions ``a .. a+K-1``;
slot j predicts the token at ``a + j + 1``. A valid anchor is a response token whose successor is also a
response token (``a < S-1``, ``loss_mask[a]`` and ``loss_mask[a+1]``). Many blocks are packed into one
drafter forward: queries are the ``A*K`` block slots, keys are the ``S`` context positions followed by the
``A*K`` block slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def valid_anchor_mask(loss_mask: Tensor) -> Tensor:
    """loss_mask [B, S] bool -> [B, S] bool: a < S-1 and loss_mask[a] and loss_mask[a+1]."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Choose up to num_anchors distinct valid anchors per row, uniformly at random, sorted by position.

    loss_mask [B, S] bool -> (anchors [B, A] long, keep [B, A] bool). Rows with fewer than A valid
    anchors are padded at the end with dummy anchors at position 0 and keep=False.
    The generator must live on loss_mask's device.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, S], got shape {tuple(loss_mask.shape)}")
    if num_anchors <= 0:
        raise ValueError(f"num_anchors={num_anchors} must be > 0")
    B, S = loss_mask.shape
    device = loss_mask.device
    valid = valid_anchor_mask(loss_mask)
    keys = torch.rand(B, S, generator=generator, device=device)  # in [0, 1)
    keys = keys.masked_fill(~valid, -1.0)
    take = min(num_anchors, S)
    top = keys.topk(take, dim=1)  # distinct indices, highest random keys first
    chosen_ok = top.values >= 0.0
    sentinel = torch.full_like(top.indices, S)
    positions, _ = torch.where(chosen_ok, top.indices, sentinel).sort(dim=1)
    keep = positions < S
    anchors = torch.where(keep, positions, torch.zeros_like(positions))
    if take < num_anchors:
        pad = num_anchors - take
        anchors = torch.cat([anchors, anchors.new_zeros(B, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    return anchors, keep


def block_targets(input_ids: Tensor, loss_mask: Tensor, anchors: Tensor, keep: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Labels and supervision mask of every block slot.

    input_ids [B, S] long, loss_mask [B, S] bool, anchors [B, A] long, keep [B, A] bool ->
    (labels [B, A, K] long, eval_mask [B, A, K] bool). labels[b, a, j] = input_ids[b, anchor + j + 1]
    (0 past the end). eval_mask is (anchor+j+1 < S) & loss_mask[anchor+j+1] & keep, cut at the first
    False so that the supervised slots of each block form a contiguous prefix.
    """
    B, S = input_ids.shape
    offsets = torch.arange(1, K + 1, device=anchors.device)
    idx = anchors.unsqueeze(-1) + offsets  # [B, A, K]
    in_range = idx < S
    safe = idx.clamp(max=S - 1).reshape(B, -1)
    labels = torch.gather(input_ids, 1, safe).reshape(idx.shape)
    labels = torch.where(in_range, labels, torch.zeros_like(labels))
    supervised = torch.gather(loss_mask.bool(), 1, safe).reshape(idx.shape)
    mask = in_range & supervised & keep.bool().unsqueeze(-1)
    eval_mask = torch.cumprod(mask.to(torch.int32), dim=-1).bool()
    return labels, eval_mask


def block_inputs(input_ids: Tensor, anchors: Tensor, K: int, mask_token_id: int) -> Tensor:
    """Drafter input ids of the blocks: input_ids [B, S], anchors [B, A] -> [B, A, K] = [x_a, MASK...]."""
    anchor_tokens = torch.gather(input_ids, 1, anchors)  # [B, A]
    out = torch.full((*anchors.shape, K), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    out[..., 0] = anchor_tokens
    return out


def block_positions(anchors: Tensor, K: int) -> Tensor:
    """Position ids of the block slots: anchors [B, A] -> [B, A*K] with slot j of anchor a at a + j."""
    offsets = torch.arange(K, device=anchors.device)
    return (anchors.unsqueeze(-1) + offsets).reshape(anchors.shape[0], -1)


def block_visibility(seq_len: int, anchors: Tensor, keep: Tensor, K: int) -> Tensor:
    """Attention visibility of the packed blocks (True = may attend).

    anchors [B, A], keep [B, A] -> [B, A*K, seq_len + A*K]. Keys are the seq_len context positions,
    then the A*K block slots. A row of block a sees context keys at positions < anchor_a and the K slots
    of its own block (bidirectional), nothing else. Rows of dropped blocks (keep=False) see nothing, so
    an attention kernel must zero (not softmax) such rows; their outputs are never supervised.
    """
    B, A = anchors.shape
    kept = keep.bool()
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    ctx = (ctx_pos.view(1, 1, seq_len) < anchors.unsqueeze(-1)) & kept.unsqueeze(-1)  # [B, A, S]
    ctx = ctx.repeat_interleave(K, dim=1)  # [B, A*K, S]
    block_id = torch.arange(A, device=anchors.device).repeat_interleave(K)  # [A*K]
    same = block_id.view(-1, 1) == block_id.view(1, -1)  # [A*K, A*K]
    row_kept = kept.repeat_interleave(K, dim=1)  # [B, A*K]
    own = same.unsqueeze(0) & row_kept.unsqueeze(-1)  # [B, A*K, A*K]
    return torch.cat([ctx, own], dim=-1)


def depth_labels(edges: Sequence[int]) -> list[str]:
    """Names of the anchor-depth buckets split at ``edges`` (e.g. 256, 1024): '0-255', '256-1023', '1024+'."""
    lows = [0, *edges]
    return [f"{lo}-{hi - 1}" for lo, hi in zip(lows, edges)] + [f"{lows[-1]}+"]


def tau_by_depth(accept: Tensor, eval_mask: Tensor, anchors: Tensor, edges: Sequence[int]) -> Tensor:
    """Per depth bucket (the anchor's position: context tokens before the block) the sum of the blocks'
    probabilistic τ = 1 + Σ_k Π_{i≤k} c_i and the number of supervised blocks.

    accept [B, A, K] c* (0 where not supervised), eval_mask [B, A, K], anchors [B, A] → float64 [2, len(edges)+1]."""
    blocks = eval_mask.bool()[..., 0]  # [B, A] blocks with at least their first slot supervised
    tau = 1 + torch.cumprod(accept.double(), -1).sum(-1)  # [B, A]
    bucket = torch.bucketize(anchors, torch.tensor(list(edges), dtype=anchors.dtype, device=anchors.device), right=True)
    out = torch.zeros(2, len(edges) + 1, dtype=torch.float64, device=accept.device)
    out[0].index_add_(0, bucket[blocks], tau[blocks])
    out[1].index_add_(0, bucket[blocks], torch.ones_like(tau[blocks]))
    return out


def depth_summary(sums: Tensor, edges: Sequence[int]) -> dict[str, float | None]:
    """{bucket label: mean τ (None: no supervised block at that depth)} from summed ``tau_by_depth`` tensors."""
    return {
        label: (round(float(t) / float(n), 4) if n > 0 else None)
        for label, t, n in zip(depth_labels(edges), sums[0], sums[1])
    }
