"""The DSpark training loss: position-weighted CE + L1 (TV) + confidence BCE, and acceptance metrics.

Shapes: B batch, A anchors (blocks) per sequence, K slots per block, V vocab.

With w_k = exp(-k / decay_gamma) (k 0-based) times eval_mask and W = sum of w (or ``denominator``):

    L_ce   = sum w * CE(draft, label) / W
    L_l1   = sum w * ||softmax(draft) - softmax(target)||_1 / W          (plain L1, no 1/2)
    c*     = clamp(1 - 1/2 ||p_d - p_t||_1, 0, 1), detached               (analytic T=1 acceptance)
    L_conf = sum w * BCEWithLogits(conf_logit, c*) / W
    L_kl   = sum w * KL(p_target || p_draft) / W                        (forward KL: gradient p_d − p_t on the
                                                                         logits, so under-rated tokens move too)
    L      = ce * L_ce + l1 * L_l1 + confidence * L_conf + kl * L_kl

Reduced draft vocabulary (``vocab_ids`` [N], what the engine drafts from): the draft logits cover those N ids
only; the target's full distribution is folded onto them plus one "other" bucket holding its mass outside them,
which the drafter can never propose. Then ||p_d − p_t||_1 = Σ_S |p_d − p_t| + p_t(other), so c* is the exact
acceptance of a draft restricted to S; the KL term uses p_t renormalised over S, and CE counts only labels in S.

The [.., V] work runs in fp32 (fp64 if the logits are fp64) over chunks of blocks. When the logits
are large and need gradients, each chunk is recomputed in backward (activation checkpointing), so
only one chunk's softmax temporaries are alive at a time instead of several full [B, A, K, V] tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Above this many logits per input, chunk over blocks and recompute chunks in backward.
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 22  # 4M values = 16 MiB per fp32 temporary
_EPS = 1e-12


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay_gamma: float = 4.0
    kl: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ce", "l1", "confidence", "kl"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossWeights.{name}={getattr(self, name)} must be >= 0")
        if self.decay_gamma <= 0:
            raise ValueError(f"LossWeights.decay_gamma={self.decay_gamma} must be > 0")


@dataclass(frozen=True)
class DSparkLoss:
    loss: Tensor  # scalar, the weighted total (differentiable)
    ce: Tensor  # scalar L_ce
    l1: Tensor  # scalar L_l1
    confidence: Tensor  # scalar L_conf (0 when skipped)
    kl: Tensor  # scalar L_kl
    accept_rate: Tensor  # [K] mean c*_k over supervised slots (0 where none), detached
    tau_probabilistic: Tensor  # scalar: mean of 1 + sum_k prod_{i<=k} c*_i over supervised blocks
    num_supervised: Tensor  # scalar long: number of supervised slots
    accept_target: Tensor  # [B, A, K] c*, detached, 0 where not supervised


def position_weights(K: int, decay_gamma: float, device: torch.device | None = None) -> Tensor:
    """[K] fp32: w_k = exp(-k / decay_gamma) for k = 0..K-1."""
    return torch.exp(-torch.arange(K, dtype=torch.float32, device=device) / decay_gamma)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32, or fp64 when the input already is (for exact references)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _slot_terms(
    draft: Tensor, target: Tensor, labels: Tensor, vocab_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """draft [N, K, V'] (V' = V, or the reduced vocabulary's size), target [N, K, V], labels [N, K] (indices
    into the draft's V') -> (CE, ||p_d - p_t||_1, KL(p_t || p_d)), each [N, K], fp32/fp64."""
    dtype = _compute_dtype(draft)
    logp_d = torch.log_softmax(draft.to(dtype), dim=-1)
    ce = -torch.gather(logp_d, -1, labels.unsqueeze(-1)).squeeze(-1)
    logp_t = torch.log_softmax(target.to(dtype), dim=-1)
    if vocab_ids is None:
        p_t = logp_t.exp()
        l1 = (logp_d.exp() - p_t).abs().sum(dim=-1)
    else:
        logp_s = logp_t.index_select(-1, vocab_ids)  # the target's mass on the draft ids ...
        p_s = logp_s.exp()
        mass = p_s.sum(-1, keepdim=True)
        other = (1.0 - mass).clamp_min(0.0).squeeze(-1)  # ... and outside them, which no draft can take
        l1 = (logp_d.exp() - p_s).abs().sum(dim=-1) + other
        logp_t = logp_s - mass.clamp_min(_EPS).log()  # renormalised over the draft ids, for the KL term
        p_t = logp_t.exp()
    kl = (p_t * (logp_t - logp_d)).sum(dim=-1)
    return ce, l1, kl


def _all_slot_terms(
    draft: Tensor, target: Tensor, labels: Tensor, max_chunk_elements: int, vocab_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Flattened [N, K, V] inputs -> (CE, L1, KL), each [N, K]; chunked + checkpointed when large."""
    N, K, V = target.shape
    if target.numel() <= max_chunk_elements:
        return _slot_terms(draft, target, labels, vocab_ids)
    rows = max(1, max_chunk_elements // (K * V))
    recompute = torch.is_grad_enabled() and (draft.requires_grad or target.requires_grad)
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    # split (not slicing) so that backward concatenates the chunk gradients once.
    for d, t, y in zip(draft.split(rows), target.split(rows), labels.split(rows)):
        if recompute:
            parts.append(checkpoint(_slot_terms, d, t, y, vocab_ids, use_reentrant=False))
        else:
            parts.append(_slot_terms(d, t, y, vocab_ids))
    ce, l1, kl = (torch.cat(x) for x in zip(*parts))
    return ce, l1, kl


def _check_shapes(
    draft_logits: Tensor,
    target_logits: Tensor,
    conf_logits: Tensor | None,
    labels: Tensor,
    eval_mask: Tensor,
    vocab_ids: Tensor | None = None,
) -> None:
    if draft_logits.dim() != 4:
        raise ValueError(f"draft_logits must be [B, A, K, V], got shape {tuple(draft_logits.shape)}")
    want = draft_logits.shape if vocab_ids is None else (*draft_logits.shape[:-1], target_logits.shape[-1])
    bad_ids = vocab_ids is not None and (
        vocab_ids.shape != draft_logits.shape[-1:] or int(vocab_ids.max()) >= target_logits.shape[-1]
    )
    if target_logits.shape != want or bad_ids:
        raise ValueError(
            f"target_logits shape {tuple(target_logits.shape)} must equal draft_logits shape "
            f"{tuple(draft_logits.shape)} (with a reduced vocabulary: [B, A, K, V] over vocab_ids [N], draft N)"
        )
    slots = draft_logits.shape[:-1]
    named = {"labels": labels, "eval_mask": eval_mask}
    if conf_logits is not None:
        named["conf_logits"] = conf_logits
    for name, tensor in named.items():
        if tensor.shape != slots:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} must be [B, A, K] = {tuple(slots)}")


def _draft_labels(labels: Tensor, mask: Tensor, vocab_ids: Tensor | None, V: int) -> tuple[Tensor, Tensor]:
    """→ (labels as indices into the draft logits, where CE applies). Unsupervised labels may be -100 or junk;
    with a reduced vocabulary a label outside it has no draft index and no CE term."""
    safe = torch.where(mask, labels.long(), 0)
    if vocab_ids is None:
        return safe, mask
    index_of = torch.full((V,), -1, dtype=torch.long, device=labels.device)
    index_of[vocab_ids] = torch.arange(vocab_ids.numel(), device=labels.device)
    safe = index_of[safe]
    return safe.clamp_min(0), mask & (safe >= 0)


@torch.no_grad()
def _acceptance(c_star: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """c* [B, A, K] (0 where unsupervised) → (mean c* per slot [K], mean τ over supervised blocks)."""
    accept_rate = c_star.sum(dim=(0, 1)) / mask.to(c_star.dtype).sum(dim=(0, 1)).clamp_min(1.0)
    blocks = mask[..., 0]  # [B, A]: at least one supervised slot (prefix mask)
    tau_block = 1.0 + torch.cumprod(c_star, dim=-1).sum(dim=-1)  # [B, A]
    return accept_rate, (tau_block * blocks).sum() / blocks.sum().clamp_min(1)


def dspark_loss(
    draft_logits: Tensor,
    target_logits: Tensor,
    conf_logits: Tensor | None,
    labels: Tensor,
    eval_mask: Tensor,
    weights: LossWeights | None = None,
    *,
    denominator: Tensor | float | None = None,
    max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
    vocab_ids: Tensor | None = None,
) -> DSparkLoss:
    """DSpark loss of teacher-forced block drafts.

    draft_logits [B, A, K, V] (Markov-corrected), target_logits [B, A, K, V] (target's next-token logits
    at the same prefixes), conf_logits [B, A, K] or None, labels [B, A, K] long, eval_mask [B, A, K] bool.
    ``denominator`` replaces sum(w) (e.g. the all-reduced global sum under DDP). ``vocab_ids`` [N]: the draft
    logits cover these target ids only (draft_logits [B, A, K, N]; labels stay target ids; see the module notes).
    """
    weights = weights or LossWeights()
    _check_shapes(draft_logits, target_logits, conf_logits, labels, eval_mask, vocab_ids)
    B, A, K, N = draft_logits.shape
    V = target_logits.shape[-1]
    device = draft_logits.device
    mask = eval_mask.bool()
    safe_labels, ce_mask = _draft_labels(labels, mask, vocab_ids, V)

    ce, l1, kl = _all_slot_terms(
        draft_logits.reshape(B * A, K, N),
        target_logits.reshape(B * A, K, V),
        safe_labels.reshape(B * A, K),
        max_chunk_elements,
        vocab_ids,
    )
    # where (not multiply) so that non-finite values in unsupervised slots cannot reach the sums.
    ce = torch.where(ce_mask, ce.view(B, A, K), 0.0)
    l1 = torch.where(mask, l1.view(B, A, K), 0.0)
    kl = torch.where(mask, kl.view(B, A, K), 0.0)

    dtype = ce.dtype
    mask_f = mask.to(dtype)
    w = position_weights(K, weights.decay_gamma, device).to(dtype) * mask_f  # [B, A, K]
    if denominator is None:
        denom = w.sum()
    else:
        denom = torch.as_tensor(denominator, device=device).to(dtype)
    denom = denom.clamp_min(_EPS)

    loss_ce = (w * ce).sum() / denom
    loss_l1 = (w * l1).sum() / denom
    loss_kl = (w * kl).sum() / denom
    c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0) * mask_f  # [B, A, K]
    if conf_logits is not None and weights.confidence != 0.0:
        bce = F.binary_cross_entropy_with_logits(conf_logits.to(dtype), c_star, reduction="none")
        bce = torch.where(mask, bce, 0.0)
        loss_conf = (w * bce).sum() / denom
    else:
        loss_conf = torch.zeros((), dtype=dtype, device=device)

    total = torch.zeros((), dtype=dtype, device=device)
    terms = ((weights.ce, loss_ce), (weights.l1, loss_l1), (weights.confidence, loss_conf), (weights.kl, loss_kl))
    for alpha, term in terms:
        if alpha != 0.0:
            total = total + alpha * term

    accept_rate, tau = _acceptance(c_star, mask)
    return DSparkLoss(
        loss=total,
        ce=loss_ce,
        l1=loss_l1,
        confidence=loss_conf,
        kl=loss_kl,
        accept_rate=accept_rate,
        tau_probabilistic=tau,
        num_supervised=mask.sum(),
        accept_target=c_star,
    )
