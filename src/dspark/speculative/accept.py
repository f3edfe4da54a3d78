"""Glue between a proposal, the target's verify logits and the acceptance rule (greedy / standard / block)."""

from __future__ import annotations

import torch

from dspark.speculative.propose import Proposal, SamplingTensors
from dspark.speculative.rng import Stream, uniforms
from dspark.speculative.sampling import all_greedy, greedy, process_logits, sample_inverse_cdf
from dspark.speculative.verify import VerifyResult, verify_block, verify_greedy, verify_standard


def accept(
    proposal: Proposal,
    lengths: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingTensors,
    rule: str,
) -> VerifyResult:
    """target_logits [B, K+1, V] over [anchor, d_1..d_K] (rows past each length are ignored); lengths [B].

    The target distribution p is the request's processed distribution (temperature/top-k/top-p; one-hot at
    temperature 0, where every rule reduces to exact greedy matching). Uniforms come from separate streams.
    """
    B, K1, _ = target_logits.shape
    K = K1 - 1
    if all_greedy(sampling.temperature):  # every rule reduces to exact argmax matching: skip distributions and uniforms
        return verify_greedy(proposal.tokens[:, :K], lengths, target_logits)
    p = process_logits(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)
    u_accept = uniforms(sampling.seeds, sampling.counters[:, : K + 1], Stream.ACCEPT)
    u_residual = uniforms(sampling.seeds, sampling.counters[:, :1], Stream.RESIDUAL)[:, 0]
    q = proposal.q[:, :K] if proposal.q is not None else None
    verify = verify_block if rule == "block" else verify_standard
    return verify(proposal.tokens[:, :K], lengths, p, q, u_accept, u_residual)


def sample_next(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Plain (non-speculative) sampling: logits [B, V] → tokens [B] on the residual stream."""
    if all_greedy(sampling.temperature):
        return greedy(logits)
    p = process_logits(logits[:, None], sampling.temperature, sampling.top_k, sampling.top_p)[:, 0]
    u = uniforms(sampling.seeds, sampling.counters[:, :1], Stream.RESIDUAL)[:, 0]
    return sample_inverse_cdf(p, u)
