"""DSpark heads: the low-rank Markov head (sequential stage) and the confidence head.

Reference: dspark-method.md §4 (Markov variants) and §5.1 (confidence). Shapes: B batch, K block slots,
V vocab, D hidden, r markov_rank. ``prev`` tokens follow one rule everywhere: slot 0 uses the anchor,
slot k > 0 uses the token at slot k-1 (ground truth in training, the drawn token in inference).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.models.packing import Linear

# pick(corrected_logits [B, V], slot k) -> tokens [B]
Picker = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class MarkovSample:
    tokens: torch.Tensor  # [B, K] drawn drafts
    logits: torch.Tensor  # [B, K, V] corrected logits that define q (−inf outside the top-k set if restricted)
    prev_embeds: torch.Tensor  # [B, K, r] W1[prev] for the confidence head


class MarkovHead(nn.Module):
    """B_k = W2(f(W1[x_{k-1}], h_k, s)) with f = identity (vanilla), a sigmoid gate (gated) or a GRU-like cell (rnn)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str = "vanilla") -> None:
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size, bias=False)
        self._w2: dict[int, tuple] = {}  # id(W2) -> (a weak reference to it, its pointer and version, served W2)
        if head_type == "gated":
            self.gate_proj = Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank)

    def _mix(
        self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """e [.., r] = W1[prev], h [.., D] → (pre-W2 features [.., r], next state)."""
        if self.head_type == "vanilla":
            return e, None
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat((h, e.to(h.dtype)), -1))) * e, None
        assert state is not None
        gate, cand, out = self.joint_proj(torch.cat((state, e.to(h.dtype), h), -1)).chunk(3, -1)
        g = torch.sigmoid(gate)
        return torch.tanh(out), g * state + (1 - g) * torch.tanh(cand)

    def teacher_forced(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        prev: torch.Tensor,
        vocab_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel path. base_logits [.., K, V], hidden [.., K, D], prev [.., K] → (corrected [.., K, V], W1[prev]).
        ``vocab_ids`` [N]: base_logits cover a reduced draft vocabulary; W2's rows of those ids correct them (their
        gradients reach those rows only)."""
        e = self.markov_w1(prev)
        w2 = self.markov_w2.weight if vocab_ids is None else self.markov_w2.weight.index_select(0, vocab_ids)
        if self.head_type != "rnn":
            feats, _ = self._mix(e, hidden, None)
            return base_logits + F.linear(feats, w2).to(base_logits.dtype), e
        state = hidden.new_zeros(*hidden.shape[:-2], self.rank)
        biases = []
        for k in range(prev.shape[-1]):
            feats, state = self._mix(e[..., k, :], hidden[..., k, :], state)
            biases.append(F.linear(feats, w2))
        return base_logits + torch.stack(biases, -2).to(base_logits.dtype), e

    def greedy_tokens(
        self,
        base_logits: torch.Tensor,
        anchor: torch.Tensor,
        w2: nn.Module | None = None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The serial greedy loop of ``sample`` (argmax at every slot, ``ids`` mapping a reduced vocabulary's index
        to the target id) as one native call (``markov_greedy``, dspark/native/markov.cpp): drafts [B, K], or None
        where it does not apply (another head type, grad mode, no native kernels, a W2 that is not a dense
        Linear); then ``sample`` runs."""
        w2 = self.markov_w2 if w2 is None else w2
        weight = w2.__dict__.get("_parameters", {}).get("weight") if isinstance(w2, nn.Linear) else None
        ops = native.inference_ops()
        if self.head_type != "vanilla" or weight is None or ops is None or not hasattr(ops, "markov_greedy"):
            return None
        w1 = self.markov_w1.weight
        if base_logits.device.type != "cpu" or w1.dtype != weight.dtype:
            return None
        base = base_logits.float().contiguous()
        return ops.markov_greedy(base, w1.contiguous(), self._served(weight), anchor.long().contiguous(), ids)

    def _served(self, weight: torch.Tensor) -> torch.Tensor:
        """W2 [N, r] as ``markov_greedy`` reads it: contiguous, made once per weight (and again only if the weight
        changes in place); in bf16 when an fp32 W2 holds only bf16 values (a bf16 checkpoint served in fp32): the same
        products from half the bytes, which is what each of the K serial slots reads."""
        key = (weight.data_ptr(), weight._version)
        cached = self._w2.get(id(weight))
        if cached is None or cached[0]() is not weight or cached[1] != key:
            w = weight.detach().contiguous()
            if w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w):
                w = w.to(torch.bfloat16)
            cached = (weakref.ref(weight), key, w)
            self._w2[id(weight)] = cached
        return cached[2]

    def sample(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        pick: Picker,
        topk: int | None = None,
        w2: nn.Module | None = None,
    ) -> MarkovSample:
        """Serial path. base_logits [B, K, V], hidden [B, K, D], anchor [B] → drafts and corrected logits.

        topk restricts the correction (and so q) to the top-k base candidates per slot. ``w2`` replaces W2 when the
        base logits cover a reduced draft vocabulary (its rows of W2); ``pick`` then maps a draft index to the
        target token id that feeds W1 next.
        """
        w2 = self.markov_w2 if w2 is None else w2
        B, K, V = base_logits.shape
        prev = anchor
        state = hidden.new_zeros(B, self.rank) if self.head_type == "rnn" else None
        tokens, logits, embeds = [], [], []
        cand = base_logits.topk(topk, dim=-1).indices if topk is not None and topk < V else None  # [B, K, k]
        for k in range(K):
            e = self.markov_w1(prev)  # [B, r]
            feats, state = self._mix(e, hidden[:, k], state)
            if cand is None:
                corrected = base_logits[:, k] + w2(feats).to(base_logits.dtype)
            else:
                rows = w2.weight[cand[:, k]]  # [B, k, r]
                bias = torch.einsum("bkr,br->bk", rows, feats.to(rows.dtype))
                corrected = torch.full_like(base_logits[:, k], float("-inf"))
                corrected.scatter_(1, cand[:, k], base_logits[:, k].gather(1, cand[:, k]) + bias.to(corrected.dtype))
            prev = pick(corrected, k)
            tokens.append(prev)
            logits.append(corrected)
            embeds.append(e)
        return MarkovSample(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(embeds, 1))


class ConfidenceHead(nn.Module):
    """c_k = σ(proj([h_k ; W1[x_{k-1}]]) + b): conditional acceptance of slot k given slots < k were accepted."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = Linear(in_features, 1)

    def forward(self, hidden: torch.Tensor, prev_embeds: torch.Tensor | None) -> torch.Tensor:
        """hidden [.., D], prev_embeds [.., r] or None → fp32 logits [..]."""
        x = hidden if prev_embeds is None else torch.cat((hidden, prev_embeds.to(hidden.dtype)), -1)
        return nn.functional.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)
