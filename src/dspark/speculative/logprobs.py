"""Log-probabilities of the tokens a request emits (and of its prompt tokens): the model's raw distribution, the
log-softmax of the target's fp32 logits before any processing (vLLM's default ``logprobs_mode``, raw_logprobs). An
accepted draft's value comes from the verification forward's row that accepted it, which is the row plain decoding
computes for that position."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 + the tokens strictly more likely (vLLM's rank)
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """logits [N, V] (row i: the distribution ``tokens[i]`` was drawn from) -> one TokenLogprobs per token."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long)
    own = lp.gather(1, ids[:, None])  # [N, 1]
    ranks = (lp > own).sum(dim=1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
    own_l, rank_l, tv, ti = own[:, 0].tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(t, own_l[i], rank_l[i], tuple(zip(ti[i], tv[i]))) for i, t in enumerate(tokens)]
