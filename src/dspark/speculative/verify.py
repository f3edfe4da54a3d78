"""Acceptance rules for one speculative round: greedy match, token-wise rejection sampling, block
verification.

Shared conventions, for a batch of B requests with K draft slots:
- d [B, K] holds the draft tokens d_1..d_K. L [B] (0..K) is how many of them each request verifies. Slots >= L
  are ignored and may hold anything, including -1 padding.
- p [B, K+1, V] holds the target distributions. Row i is the distribution after prefix + d_<=i, so row 0
  decides d_1 and row L decides the bonus.
- q [B, K, V] holds the draft distributions: row i is the one d_{i+1} was sampled from. q=None means greedy
  drafting, which treats q as one-hot at d.
- u_accept [B, K+1] and u_residual [B] are uniforms in (0, 1) from two different RNG streams (see rng.py).
- Whether slot k is verified (k <= L) may depend on d_<k but not on d_k or later. Otherwise the rules are no
  longer lossless.
The result is the number of accepted drafts and the one token emitted after them (correction or bonus).
"""

from dataclasses import dataclass

import torch

from dspark.speculative.sampling import sample_inverse_cdf

Q_MIN = 1e-20  # clamp on draft probabilities in ratios, so zero-probability tokens give no NaN/inf


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64 in 0..L: drafts d_1..d_n are kept
    next_token: torch.Tensor  # [B] int64: the correction token, or the bonus when all L were accepted


def _check_shapes(d: torch.Tensor, L: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, *u: torch.Tensor) -> None:
    B, K = d.shape
    problems = []
    if L.shape != (B,):
        problems.append(f"L {tuple(L.shape)} != [B]={B}")
    if p.dim() != 3 or p.shape[:2] != (B, K + 1):
        problems.append(f"p/target_logits {tuple(p.shape)} != [B, K+1, V]=[{B}, {K + 1}, V]")
    if q is not None and q.shape != (B, K, p.shape[-1]):
        problems.append(f"q {tuple(q.shape)} != [B, K, V]=[{B}, {K}, {p.shape[-1]}]")
    if u and u[0].shape != (B, K + 1):
        problems.append(f"u_accept {tuple(u[0].shape)} != [B, K+1]=[{B}, {K + 1}]")
    if len(u) > 1 and u[1].shape != (B,):
        problems.append(f"u_residual {tuple(u[1].shape)} != [B]={B}")
    if problems:
        raise ValueError(f"verify: shape mismatch with d [B, K]={tuple(d.shape)}: " + "; ".join(problems))


def _row(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, N, V], index [B] -> x[b, index[b]] as [B, V]."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)


def _at_drafts(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [B, >=K, V], d [B, K] (already clamped to 0..V-1) -> x[b, i, d[b, i]] as [B, K] float64."""
    K = d.shape[1]
    return x[:, :K].gather(-1, d[..., None]).squeeze(-1).to(torch.float64)


def _clamped(d: torch.Tensor, V: int) -> torch.Tensor:
    return d.clamp(0, V - 1)


def _draft_row(d: torch.Tensor, q: torch.Tensor | None, row: torch.Tensor, use: torch.Tensor, V: int) -> torch.Tensor:
    """The draft distribution q_row [B, V] float64 at `row` [B], zeroed where `use` [B] is False."""
    B, K = d.shape
    if K == 0:
        return torch.zeros(B, V, dtype=torch.float64, device=d.device)
    r = row.clamp(max=K - 1)
    if q is None:
        out = torch.zeros(B, V, dtype=torch.float64, device=d.device)
        out.scatter_(1, d.gather(1, r[:, None]), 1.0)
    else:
        out = _row(q, r).to(torch.float64)
    return out * use[:, None]


def residual_sample(
    p_row: torch.Tensor,  # [B, V] target distribution
    q_row: torch.Tensor,  # [B, V] draft distribution (zeros for a bonus token)
    weight: torch.Tensor,  # [B] b_tau for block verification, 1 for token-wise
    u: torch.Tensor,  # [B] uniforms in (0, 1)
) -> torch.Tensor:
    """Sample from normalize(max(weight * p - q, 0)), falling back to p where that residual is empty."""
    p64 = p_row.to(torch.float64)
    res = (weight.to(torch.float64)[:, None] * p64 - q_row.to(torch.float64)).clamp_(min=0.0)
    empty = res.sum(dim=-1, keepdim=True) <= 0.0
    return sample_inverse_cdf(torch.where(empty, p64, res), u)


def verify_greedy(
    d: torch.Tensor,  # [B, K] draft tokens
    L: torch.Tensor,  # [B] verify lengths 0..K
    target_logits: torch.Tensor,  # [B, K+1, V]
) -> VerifyResult:
    """Exact match against the target argmax; the next token is the target argmax after the kept prefix."""
    _check_shapes(d, L, target_logits, None)
    B, K = d.shape
    best = target_logits.argmax(dim=-1)  # [B, K+1]
    valid = torch.arange(K, device=d.device) < L[:, None]
    match = (d == best[:, :K]) & valid
    n = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return VerifyResult(num_accepted=n, next_token=best.gather(1, n[:, None]).squeeze(1))


def verify_standard(
    d: torch.Tensor,  # [B, K] draft tokens
    L: torch.Tensor,  # [B] verify lengths 0..K
    p: torch.Tensor,  # [B, K+1, V] target probabilities
    q: torch.Tensor | None,  # [B, K, V] draft probabilities, or None for greedy (one-hot) drafts
    u_accept: torch.Tensor,  # [B, K+1] (column K unused)
    u_residual: torch.Tensor,  # [B]
) -> VerifyResult:
    """Token-wise rejection sampling (Leviathan et al. 2023): accept d_i while u_i * q(d_i) < p(d_i)."""
    _check_shapes(d, L, p, q, u_accept, u_residual)
    B, K = d.shape
    V = p.shape[-1]
    dc = _clamped(d, V)
    p_d = _at_drafts(p, dc)
    q_d = torch.ones_like(p_d) if q is None else _at_drafts(q, dc).clamp(min=Q_MIN)
    valid = torch.arange(K, device=d.device) < L[:, None]
    accept = (u_accept[:, :K].to(torch.float64) * q_d < p_d) & valid
    n = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    rejected = n < L
    q_row = _draft_row(dc, q, n, rejected, V)
    next_token = residual_sample(_row(p, n), q_row, torch.ones(B, dtype=torch.float64, device=d.device), u_residual)
    return VerifyResult(num_accepted=n, next_token=next_token)


def block_thresholds(
    d: torch.Tensor,  # [B, K] draft tokens
    L: torch.Tensor,  # [B] verify lengths 0..K
    p: torch.Tensor,  # [B, K+1, V] target probabilities
    q: torch.Tensor | None,  # [B, K, V] draft probabilities, or None for one-hot drafts
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. 2024 block-verification weights b [B, K+1] and thresholds h [B, K+1], both float64.

    b_0 = 1 and b_i = min(1, b_{i-1} p_{i-1}(d_i) / q_{i-1}(d_i)). This is computed in closed form as
    exp(S_i - max_{j<=i} S_j) with S_i the cumulative log ratio. For i < L, h_i = r_i / (r_i + 1 - b_i) with
    r_i = sum_v max(b_i p_i(v) - q_i(v), 0), and h_i = 1 when the denominator is 0. h_L = b_L. h is 0 after L,
    and h_0 = 1. Entries of b after L come from ignored slots and mean nothing.
    """
    B, K = d.shape
    V = p.shape[-1]
    dc = _clamped(d, V)
    p_d = _at_drafts(p, dc)
    q_d = torch.ones_like(p_d) if q is None else _at_drafts(q, dc).clamp(min=Q_MIN)
    zero = torch.zeros(B, 1, dtype=torch.float64, device=d.device)
    S = torch.cat([zero, torch.log(p_d / q_d).cumsum(dim=1)], dim=1)  # [B, K+1]; -inf after a zero ratio
    b = torch.exp(S - S.cummax(dim=1).values)
    b_k = b[:, :K]
    if q is None:
        r = b_k * (1.0 - p_d)  # one-hot q: only the drafted token's term can be capped
    else:
        r = (b_k.to(p.dtype)[..., None] * p[:, :K] - q).clamp_(min=0.0).sum(dim=-1).to(torch.float64)
    denom = r + (1.0 - b_k)
    h = torch.where(denom > 0.0, r / denom.clamp(min=1e-300), 1.0)
    h = torch.cat([h, zero], dim=1)
    idx = torch.arange(K + 1, device=d.device)
    h = torch.where(idx == L[:, None], b, h)
    h = torch.where(idx <= L[:, None], h, 0.0)
    h[:, 0] = 1.0
    return b, h


def verify_block(
    d: torch.Tensor,  # [B, K] draft tokens
    L: torch.Tensor,  # [B] verify lengths 0..K
    p: torch.Tensor,  # [B, K+1, V] target probabilities
    q: torch.Tensor | None,  # [B, K, V] draft probabilities, or None for greedy (one-hot) drafts
    u_accept: torch.Tensor,  # [B, K+1] (column 0 unused: h_0 = 1)
    u_residual: torch.Tensor,  # [B]
) -> VerifyResult:
    """Block verification (Sun et al. 2024, Alg. 2). tau is the LAST i in 0..L with u_i <= h_i.

    d_1..d_tau are kept. If tau == L the bonus comes from p_L, otherwise the next token comes from
    normalize(max(b_tau p_tau - q_tau, 0)).
    """
    _check_shapes(d, L, p, q, u_accept, u_residual)
    K = d.shape[1]
    V = p.shape[-1]
    b, h = block_thresholds(d, L, p, q)
    idx = torch.arange(K + 1, device=d.device)
    passed = (u_accept.to(torch.float64) <= h) & (idx <= L[:, None])
    passed[:, 0] = True  # h_0 = 1
    tau = (passed * idx).amax(dim=1)
    bonus = tau == L
    q_row = _draft_row(_clamped(d, V), q, tau, ~bonus, V)
    weight = torch.where(bonus, 1.0, b.gather(1, tau[:, None]).squeeze(1))
    next_token = residual_sample(_row(p, tau), q_row, weight, u_residual)
    return VerifyResult(num_accepted=tau, next_token=next_token)
