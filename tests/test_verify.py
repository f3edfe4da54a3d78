"""Acceptance rules (dspark.speculative.verify): greedy match, token-wise rejection sampling, block verification.

Losslessness is checked statistically on Markov-chain target and draft models: the first emitted token,
and the first two jointly, must follow the target chain exactly. Each rule runs on a large vectorised
batch. The same test must also reject deliberately wrong rules, which shows it has power. An exact
enumeration over all drafts checks block verification without sampling noise.
"""

from collections.abc import Callable

import pytest
import torch

from dspark.speculative.rng import Stream, round_counters, uniforms
from dspark.speculative.sampling import process_logits, sample_inverse_cdf
from dspark.speculative.verify import (
    VerifyResult,
    block_thresholds,
    residual_sample,
    verify_block,
    verify_greedy,
    verify_standard,
)

V, K = 5, 3
N = 100_000
PASS_P, FAIL_P = 1e-3, 1e-6  # fixed seeds: correct rules pass above PASS_P, wrong ones fall below FAIL_P

Rule = Callable[..., VerifyResult]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Large elementwise ops stall 10x with 2 intra-op threads on a shared 2-core box; use 1, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor, dof_lost: int) -> float:
    """Pearson chi-square p-value over cells with expected > 0."""
    obs, exp = observed.double().flatten(), expected.double().flatten()
    keep = exp > 0
    assert int(obs[~keep].sum()) == 0, "a token with zero target probability was emitted"
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - dof_lost
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def markov(seed: int, sharpness: float, zero: tuple[int, int] | None = None) -> torch.Tensor:
    """Random transition matrix [V, V]; row x = distribution of the next token after x."""
    g = torch.Generator().manual_seed(seed)
    m = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * sharpness, dim=-1)
    if zero is not None:
        m[zero] = 0.0
        m = m / m.sum(-1, keepdim=True)
    return m


P_CHAIN = markov(10, 1.2, zero=(0, 3))  # the target
Q_CHAIN = markov(11, 1.5, zero=(1, 2))  # the draft: a different chain


# --------------------------------------------------------------------------------------- simulation


def draft(x_last: torch.Tensor, greedy_draft: bool, g: torch.Generator, Q: torch.Tensor = Q_CHAIN):
    """Draft K tokens from the chain Q after x_last [N]. Returns d [N, K] and q [N, K, V] (None if greedy)."""
    rows, tokens, prev = [], [], x_last
    for _ in range(K):
        q_row = Q[prev]
        if greedy_draft:
            tok = q_row.argmax(-1)
        else:
            tok = sample_inverse_cdf(q_row, torch.rand(prev.shape[0], generator=g, dtype=torch.float64))
        rows.append(q_row)
        tokens.append(tok)
        prev = tok
    d = torch.stack(tokens, 1)
    return d, (None if greedy_draft else torch.stack(rows, 1).float())


def target_rows(x_last: torch.Tensor, d: torch.Tensor, P: torch.Tensor = P_CHAIN) -> torch.Tensor:
    """p [N, K+1, V]: row i is the target distribution after prefix + d_<=i."""
    return P[torch.cat([x_last[:, None], d], 1)].float()


def one_round(rule: Rule, x_last: torch.Tensor, L_mode: str, greedy_draft: bool, g: torch.Generator):
    d, q = draft(x_last, greedy_draft, g)
    n = x_last.shape[0]
    if L_mode == "random":
        L = torch.randint(0, K + 1, (n,), generator=g)
    elif L_mode == "stop":  # a stopping rule: verify d_{k+1} only if d_k != 2 (depends on d_<=k only)
        hit = torch.cat([d[:, :-1] == 2, torch.ones(n, 1, dtype=torch.bool)], 1)
        L = hit.long().argmax(1) + 1
    else:
        L = torch.full((n,), K)
    u_acc = torch.rand(n, K + 1, generator=g, dtype=torch.float64)
    u_res = torch.rand(n, generator=g, dtype=torch.float64)
    res = rule(d, L, target_rows(x_last, d), q, u_acc, u_res)
    assert bool((res.num_accepted <= L).all()) and bool((res.num_accepted >= 0).all())
    return d, res


def first_two(rule: Rule, L_mode: str, greedy_draft: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """Run rounds from random x0 [N]; return x0 and the first two emitted tokens."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(0, V, (N,), generator=g)
    d, r = one_round(rule, x0, L_mode, greedy_draft, g)
    n = r.num_accepted
    d2, r2 = one_round(rule, r.next_token, L_mode, greedy_draft, g)  # needed only where n == 0
    r2_first = torch.where(r2.num_accepted > 0, d2[:, 0], r2.next_token)
    t1 = torch.where(n >= 1, d[:, 0], r.next_token)
    t2 = torch.where(n >= 2, d[:, 1], torch.where(n == 1, r.next_token, r2_first))
    return x0, t1, t2


def lossless_pvalues(rule: Rule, L_mode: str, greedy_draft: bool, seed: int = 0) -> tuple[float, float]:
    x0, t1, t2 = first_two(rule, L_mode, greedy_draft, seed)
    n_x0 = torch.bincount(x0, minlength=V).double()
    c1 = torch.bincount(x0 * V + t1, minlength=V * V)
    e1 = n_x0[:, None] * P_CHAIN
    c2 = torch.bincount((x0 * V + t1) * V + t2, minlength=V**3)
    e2 = n_x0[:, None, None] * P_CHAIN[:, :, None] * P_CHAIN[None]
    return chi2_pvalue(c1, e1, dof_lost=V), chi2_pvalue(c2, e2, dof_lost=V)


# ------------------------------------------------------------------------------- deliberately wrong rules


def standard_residual_is_p(d, L, p, q, u_acc, u_res) -> VerifyResult:
    """Bug: after a rejection, sample from p instead of max(p - q, 0)."""
    r = verify_standard(d, L, p, q, u_acc, u_res)
    p_row = p[torch.arange(d.shape[0]), r.num_accepted]
    return VerifyResult(r.num_accepted, sample_inverse_cdf(p_row, u_res))


def block_first_failure(d, L, p, q, u_acc, u_res) -> VerifyResult:
    """Bug (vllm-ascend #7807): tau = the prefix before the FIRST failing threshold, not the LAST pass."""
    b, h = block_thresholds(d, L, p, q)
    idx = torch.arange(K + 1)
    fail = (u_acc > h) & (idx >= 1) & (idx <= L[:, None])
    tau = torch.where(fail.any(1), fail.long().argmax(1) - 1, L)
    bonus = tau == L
    rows = torch.arange(d.shape[0])
    if q is None:
        q_row = torch.zeros(d.shape[0], V, dtype=torch.float64)
        q_row[rows, d[rows, tau.clamp(max=K - 1)]] = 1.0
    else:
        q_row = q[rows, tau.clamp(max=K - 1)].double()
    q_row = q_row * (~bonus)[:, None]
    weight = torch.where(bonus, 1.0, b[rows, tau])
    return VerifyResult(tau, residual_sample(p[rows, tau], q_row, weight, u_res))


# ------------------------------------------------------------------------------------------- tests


def test_verify_greedy_hand_cases():
    best = torch.tensor([1, 2, 3, 0])  # target argmax per row
    logits = torch.nn.functional.one_hot(best, 4).float()[None].expand(6, -1, -1) * 5.0
    d = torch.tensor([[1, 2, 0], [1, 2, 3], [1, 2, 3], [1, 2, 3], [0, 2, 3], [-1, -1, -1]])
    L = torch.tensor([3, 3, 1, 0, 3, 0])
    r = verify_greedy(d, L, logits)
    assert r.num_accepted.tolist() == [2, 3, 1, 0, 0, 0]
    assert r.next_token.tolist() == [3, 0, 2, 1, 1, 1]


def reference_greedy(d: list[int], L: int, best: list[int]) -> tuple[int, int]:
    n = 0
    while n < L and d[n] == best[n]:
        n += 1
    return n, best[n]


def test_verify_greedy_random_vs_reference():
    g = torch.Generator().manual_seed(0)
    B, Kr, Vr = 256, 5, 7
    logits = torch.randn(B, Kr + 1, Vr, generator=g)
    best = logits.argmax(-1)
    d = torch.where(torch.rand(B, Kr, generator=g) < 0.7, best[:, :Kr], torch.randint(0, Vr, (B, Kr), generator=g))
    L = torch.randint(0, Kr + 1, (B,), generator=g)
    r = verify_greedy(d, L, logits)
    for b in range(B):
        assert (int(r.num_accepted[b]), int(r.next_token[b])) == reference_greedy(
            d[b].tolist(), int(L[b]), best[b].tolist()
        )
    assert len(set(r.num_accepted.tolist())) == Kr + 1  # every accepted count occurs


@pytest.mark.parametrize("rule", [verify_standard, verify_block], ids=["standard", "block"])
def test_temperature_zero_reduces_to_greedy(rule):
    g = torch.Generator().manual_seed(1)
    B, Kr, Vr = 512, 4, 6
    logits = torch.randn(B, Kr + 1, Vr, generator=g)
    best = logits.argmax(-1)
    d = torch.where(torch.rand(B, Kr, generator=g) < 0.6, best[:, :Kr], torch.randint(0, Vr, (B, Kr), generator=g))
    L = torch.randint(0, Kr + 1, (B,), generator=g)
    zeros = torch.zeros(B)
    p = process_logits(logits, zeros, zeros.long(), torch.ones(B))
    q_logits = torch.randn(B, Kr, Vr, generator=g)
    q = torch.softmax(q_logits, -1)
    expected = verify_greedy(d, L, logits)
    for q_arg in (None, q):
        u_acc = torch.rand(B, Kr + 1, generator=g, dtype=torch.float64)
        r = rule(d, L, p, q_arg, u_acc, torch.rand(B, generator=g, dtype=torch.float64))
        assert torch.equal(r.num_accepted, expected.num_accepted)
        assert torch.equal(r.next_token, expected.next_token)


LOSSLESS_CASES = [
    (verify_standard, "random", False),
    (verify_standard, "random", True),
    (verify_block, "random", False),
    (verify_block, "random", True),
    (verify_standard, "stop", False),
    (verify_block, "stop", False),
    (verify_block, "full", False),
]


@pytest.mark.parametrize(
    ("rule", "L_mode", "greedy_draft"),
    LOSSLESS_CASES,
    ids=[f"{r.__name__}-{m}-{'greedy' if gd else 'prob'}" for r, m, gd in LOSSLESS_CASES],
)
def test_lossless_first_two_tokens(rule, L_mode, greedy_draft):
    p1, p2 = lossless_pvalues(rule, L_mode, greedy_draft)
    assert p1 > PASS_P and p2 > PASS_P, (p1, p2)


@pytest.mark.parametrize(
    ("rule", "greedy_draft"),
    [(standard_residual_is_p, False), (standard_residual_is_p, True), (block_first_failure, False)],
    ids=["standard-residual-p-prob", "standard-residual-p-greedy", "block-first-failure-prob"],
)
def test_lossless_check_detects_wrong_rules(rule, greedy_draft):
    p1, p2 = lossless_pvalues(rule, "random", greedy_draft)
    assert min(p1, p2) < FAIL_P, (p1, p2)


def exact_block_first_two(L: int, weighted_residual: bool = True) -> torch.Tensor:
    """Exact P(t1, t2 | x0) [V, V, V] under block verification, enumerating all V^K draft sequences.

    The u's are integrated out: P(tau = i | d) = h_i * prod_{j > i} (1 - h_j). After tau = 0 the second token
    comes from the next round, whose first token follows the target (which the t1 marginal checks).
    """
    grid = torch.cartesian_prod(*[torch.arange(V)] * (K + 1))  # [V^(K+1), K+1]: x0, d_1..d_K
    x0, d = grid[:, 0], grid[:, 1:]
    ctx = torch.cat([x0[:, None], d[:, :-1]], 1)
    q = Q_CHAIN[ctx]  # [R, K, V] float64
    weight = q.gather(-1, d[..., None]).squeeze(-1).prod(1)  # probability of drafting d
    p = P_CHAIN[torch.cat([x0[:, None], d], 1)]  # [R, K+1, V]
    Ls = torch.full((grid.shape[0],), L)
    b, h = block_thresholds(d, Ls, p, q)
    tail = torch.flip(torch.cumprod(torch.flip(1.0 - h, [1]), 1), [1])  # prod_{j >= i} (1 - h_j)
    p_tau = h * torch.cat([tail[:, 1:], torch.ones(grid.shape[0], 1, dtype=torch.float64)], 1)

    def residual(i: int) -> torch.Tensor:
        if i == L:
            return p[:, i]
        w = b[:, i : i + 1] if weighted_residual else 1.0
        r = (w * p[:, i] - q[:, i]).clamp(min=0.0)
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p[:, i])
        return r / r.sum(-1, keepdim=True)

    one_hot = torch.nn.functional.one_hot(d, V).double()  # [R, K, V]
    joint = p_tau[:, 0, None, None] * residual(0)[:, :, None] * P_CHAIN[None]
    if L >= 1:
        joint = joint + p_tau[:, 1, None, None] * one_hot[:, 0, :, None] * residual(1)[:, None, :]
    if L >= 2:
        both = one_hot[:, 0, :, None] * one_hot[:, 1, None, :]
        joint = joint + p_tau[:, 2:].sum(1)[:, None, None] * both
    out = torch.zeros(V, V, V, dtype=torch.float64)
    return out.index_add_(0, x0, weight[:, None, None] * joint)


@pytest.mark.parametrize("L", [0, 1, 2, K])
def test_block_exact_enumeration_is_lossless(L):
    want = P_CHAIN[:, :, None] * P_CHAIN[None]  # P(t1 = a, t2 = b | x0) = P[x0, a] P[a, b]
    torch.testing.assert_close(exact_block_first_two(L), want, atol=1e-12, rtol=0)
    if L >= 2:  # power check: the residual without the b_tau weight (vllm-ascend #7807) is wrong
        assert float((exact_block_first_two(L, weighted_residual=False) - want).abs().max()) > 1e-3


def test_block_paper_example_expected_accepted_length():
    # vocab {a, b}; p = (1/3, 2/3), q = (2/3, 1/3) at every position; K = 2:
    # E[tau] = 11/9 for block vs 10/9 for token-wise verification (Sun et al. 2024, section 2)
    p_ab = torch.tensor([1 / 3, 2 / 3])
    q_ab = torch.tensor([2 / 3, 1 / 3])
    d4 = torch.tensor([[0, 1], [0, 0], [1, 0], [1, 1]])
    b, h = block_thresholds(d4, torch.full((4,), 2), p_ab.expand(4, 3, 2), q_ab.expand(4, 2, 2))
    want_b = torch.tensor([[1, 0.5, 1], [1, 0.5, 0.25], [1, 1, 0.5], [1, 1, 1]], dtype=torch.float64)
    want_h = torch.tensor([[1, 0, 1], [1, 0, 0.25], [1, 1, 0.5], [1, 1, 1]], dtype=torch.float64)
    torch.testing.assert_close(b, want_b)
    torch.testing.assert_close(h, want_h)

    g = torch.Generator().manual_seed(5)
    n = 100_000
    d = sample_inverse_cdf(q_ab.expand(n, 2, 2), torch.rand(n, 2, generator=g, dtype=torch.float64))
    L = torch.full((n,), 2)
    args = (d, L, p_ab.expand(n, 3, 2), q_ab.expand(n, 2, 2))
    u_acc = torch.rand(n, 3, generator=g, dtype=torch.float64)
    u_res = torch.rand(n, generator=g, dtype=torch.float64)
    block = verify_block(*args, u_acc, u_res).num_accepted.double().mean().item()
    token = verify_standard(*args, u_acc, u_res).num_accepted.double().mean().item()
    assert abs(block - 11 / 9) < 0.01, block
    assert abs(token - 10 / 9) < 0.01, token


def test_residual_distributions_on_a_grid():
    # hand instance: d_1 = 0 gives b_1 = 0.4; u forces tau = 1 < L = 2; u_residual sweeps a fine grid
    n = 10_000
    p = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]).expand(n, 3, 4)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.05, 0.05, 0.05, 0.85]]).expand(n, 2, 4)
    d = torch.tensor([[0, 3]]).expand(n, 2)
    L = torch.full((n,), 2)
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n

    def freqs(res: VerifyResult) -> torch.Tensor:
        return torch.bincount(res.next_token, minlength=4).double() / n

    b, h = block_thresholds(d[:1], L[:1], p[:1], q[:1])
    torch.testing.assert_close(b[0, 1].item(), 0.4)
    torch.testing.assert_close(h[0, 1].item(), 1 / 7)
    u_acc = torch.tensor([[0.5, 0.01, 0.999]], dtype=torch.float64).expand(n, 3)
    r = verify_block(d, L, p, q, u_acc, grid)
    assert bool((r.num_accepted == 1).all())
    # normalize(max(0.4 p_1 - q_1, 0)) = (0, 0.3, 0.7, 0); unweighted max(p_1 - q_1, 0) gives (1, 3, 5, 0)/9
    torch.testing.assert_close(freqs(r), torch.tensor([0.0, 0.3, 0.7, 0.0], dtype=torch.float64), atol=2e-4, rtol=0)

    u_rej = torch.tensor([[0.99, 0.5, 0.5]], dtype=torch.float64).expand(n, 3)  # standard: reject d_1 at row 0
    r = verify_standard(d, L, p, q, u_rej, grid)
    assert bool((r.num_accepted == 0).all())
    torch.testing.assert_close(freqs(r), torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), atol=2e-4, rtol=0)
    r = verify_standard(d, L, p, None, u_rej, grid)  # greedy drafts: residual = p_0 with d_1 removed
    torch.testing.assert_close(freqs(r), torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), atol=2e-4, rtol=0)
    all_ok = torch.full((n, 3), 1e-9, dtype=torch.float64)  # both drafts accepted: bonus ~ p_2
    r = verify_standard(d, L, p, q, all_ok, grid)
    assert bool((r.num_accepted == 2).all())
    torch.testing.assert_close(freqs(r), torch.full((4,), 0.25, dtype=torch.float64), atol=2e-4, rtol=0)


def exact_expected_accepted(d, L, p, q) -> tuple[torch.Tensor, torch.Tensor]:
    """E[accepted | drafts] [B] for token-wise and block verification, from the acceptance formulas."""
    B, Kr = d.shape
    p_d = p[:, :Kr].gather(-1, d[..., None]).squeeze(-1).double()
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, d[..., None]).squeeze(-1).double()
    valid = torch.arange(Kr) < L[:, None]
    accept = torch.where(valid, (p_d / q_d).clamp(max=1.0), 0.0)
    token = accept.cumprod(1).sum(1)  # sum_k P(first k accepted)
    _, h = block_thresholds(d, L, p, q)
    # tau = last i with u_i <= h_i, so P(tau >= i) = 1 - prod_{j >= i} (1 - h_j)
    miss = torch.flip(torch.cumprod(torch.flip(1.0 - h, [1]), 1), [1])
    block = (1.0 - miss[:, 1:]).sum(1)
    return token, block


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["prob", "greedy"])
def test_block_at_least_standard_and_matches_formula(greedy_draft):
    g = torch.Generator().manual_seed(7)
    n = 50_000
    token_means, block_means = [], []
    for inst in range(3):  # random instances: fresh chains, draft sharper or flatter than the target
        P, Q = markov(100 + inst, 0.8 + 0.5 * inst), markov(200 + inst, 2.0 - 0.4 * inst)
        x0 = torch.randint(0, V, (n,), generator=g)
        d, q = draft(x0, greedy_draft, g, Q)
        p = target_rows(x0, d, P)
        L = torch.randint(0, K + 1, (n,), generator=g)
        token, block = exact_expected_accepted(d, L, p, q)
        if greedy_draft:  # one-hot q: b_i = prod p(d_j) never recovers, so block gains nothing per draft
            torch.testing.assert_close(block, token)
        token_means.append(token.mean().item())
        block_means.append(block.mean().item())
        u_acc = torch.rand(n, K + 1, generator=g, dtype=torch.float64)
        u_res = torch.rand(n, generator=g, dtype=torch.float64)
        sim_block = verify_block(d, L, p, q, u_acc, u_res).num_accepted.double().mean().item()
        sim_token = verify_standard(d, L, p, q, u_acc, u_res).num_accepted.double().mean().item()
        assert abs(sim_block - block_means[-1]) < 0.02, (inst, sim_block, block_means[-1])
        assert abs(sim_token - token_means[-1]) < 0.02, (inst, sim_token, token_means[-1])
        assert block_means[-1] >= token_means[-1] - 0.005, (inst, block_means[-1], token_means[-1])
    if not greedy_draft:
        assert sum(block_means) > sum(token_means) + 0.01  # block verification gains with real draft probs


@pytest.mark.parametrize("rule", [verify_standard, verify_block], ids=["standard", "block"])
@pytest.mark.parametrize("greedy_draft", [False, True], ids=["prob", "greedy"])
def test_slots_after_L_are_ignored(rule, greedy_draft):
    g = torch.Generator().manual_seed(2)
    B, Kr, Vr = 400, 6, 9
    L = torch.arange(B) % (Kr + 1)  # every verify length 0..K in one batch
    p = torch.softmax(torch.randn(B, Kr + 1, Vr, generator=g), -1)
    q = torch.softmax(torch.randn(B, Kr, Vr, generator=g), -1)
    d = sample_inverse_cdf(q, torch.rand(B, Kr, generator=g, dtype=torch.float64))
    u_acc = torch.rand(B, Kr + 1, generator=g, dtype=torch.float64)
    u_res = torch.rand(B, generator=g, dtype=torch.float64)
    q_arg = None if greedy_draft else q
    base = rule(d, L, p, q_arg, u_acc, u_res)
    after = torch.arange(Kr)[None] >= L[:, None]  # ignored draft slots and draft rows
    d2 = torch.where(after, -1, d)
    q2 = torch.where(after[..., None], torch.softmax(torch.randn(B, Kr, Vr, generator=g), -1), q)
    p_after = torch.arange(Kr + 1)[None] > L[:, None]  # target rows after the bonus row
    p2 = torch.where(p_after[..., None], torch.softmax(torch.randn(B, Kr + 1, Vr, generator=g), -1), p)
    u2 = torch.where(torch.arange(Kr + 1)[None] > L[:, None], torch.rand(B, Kr + 1, generator=g).double(), u_acc)
    other = rule(d2, L, p2, None if greedy_draft else q2, u2, u_res)
    assert torch.equal(base.num_accepted, other.num_accepted)
    assert torch.equal(base.next_token, other.next_token)
    assert bool((base.num_accepted <= L).all())
    assert bool((base.num_accepted[L == 0] == 0).all())
    assert bool((base.num_accepted == L).any()) and bool((base.num_accepted < L).any())


@pytest.mark.parametrize("rule", [verify_standard, verify_block], ids=["standard", "block"])
def test_zero_probabilities_no_nan_and_valid_tokens(rule):
    g = torch.Generator().manual_seed(4)
    B, Kr, Vr = 2000, 4, 6
    p = torch.softmax(torch.randn(B, Kr + 1, Vr, generator=g) * 2, -1)
    p = torch.where(torch.rand(B, Kr + 1, Vr, generator=g) < 0.4, 0.0, p)
    p[..., 0] += 1e-3  # keep every row nonempty
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(B, Kr, Vr, generator=g) * 2, -1)
    q = torch.where(torch.rand(B, Kr, Vr, generator=g) < 0.4, 0.0, q)
    q[..., 1] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    d = torch.randint(0, Vr, (B, Kr), generator=g)  # not sampled from q: q(d) and p(d) are often exactly 0
    L = torch.randint(0, Kr + 1, (B,), generator=g)
    for q_arg in (q, None):
        u_acc = torch.rand(B, Kr + 1, generator=g, dtype=torch.float64)
        r = rule(d, L, p, q_arg, u_acc, torch.rand(B, generator=g, dtype=torch.float64))
        rows = torch.arange(B)
        assert bool((p[rows, r.num_accepted, r.next_token] > 0).all())  # emitted tokens are possible
        for i in range(Kr):
            kept = r.num_accepted > i
            assert bool((p[rows, i, d[:, i]][kept] > 0).all())
    b, h = block_thresholds(d, L, p, q)
    assert bool(torch.isfinite(b).all()) and bool(torch.isfinite(h).all())
    assert bool(((h >= 0) & (h <= 1)).all())


def test_no_drafts_samples_the_target():
    g = torch.Generator().manual_seed(6)
    B, Vr = 50_000, 4
    p = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(B, 1, Vr)
    d = torch.zeros(B, 0, dtype=torch.long)
    L = torch.zeros(B, dtype=torch.long)
    u_res = torch.rand(B, generator=g, dtype=torch.float64)
    for rule in (verify_standard, verify_block):
        for q in (None, torch.zeros(B, 0, Vr)):
            r = rule(d, L, p, q, torch.rand(B, 1, generator=g, dtype=torch.float64), u_res)
            assert bool((r.num_accepted == 0).all())
            freq = torch.bincount(r.next_token, minlength=Vr).double() / B
            torch.testing.assert_close(freq, p[0, 0].double(), atol=0.01, rtol=0)
    assert bool((verify_greedy(d, L, p).next_token == 2).all())


def test_shape_errors_name_the_tensor():
    d = torch.zeros(2, 3, dtype=torch.long)
    L = torch.zeros(2, dtype=torch.long)
    p = torch.full((2, 4, 5), 0.2)
    with pytest.raises(ValueError, match="q"):
        verify_standard(d, L, p, torch.full((2, 4, 5), 0.2), torch.rand(2, 4), torch.rand(2))
    with pytest.raises(ValueError, match="u_accept"):
        verify_block(d, L, p, None, torch.rand(2, 3), torch.rand(2))
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(d, L, torch.zeros(2, 3, 5))


# --------------------------------------------------------------- multi-round generation with the counter RNG


def generate(seeds: torch.Tensor, x0: torch.Tensor, num_tokens: int, counters: str) -> torch.Tensor:
    """Speculative generation (probabilistic drafts + block verification), all randomness from rng.uniforms.

    counters: "round" = round_counters (the recommended keying); "shared" = the draft reuses the ACCEPT
    stream; "absolute" = counters are absolute token positions, so a round reuses uniforms the last one saw.
    Returns [N, num_tokens] generated tokens after x0.
    """
    n = x0.shape[0]
    buf = torch.zeros(n, 1 + num_tokens + K + 1, dtype=torch.long)
    buf[:, 0] = x0
    length = torch.ones(n, dtype=torch.long)
    rows = torch.arange(n)
    while bool((length < 1 + num_tokens).any()):
        anchor = length - 1
        c = round_counters(anchor, K + 1)
        if counters == "absolute":
            c = anchor[:, None] + torch.arange(K + 1)
        draft_stream = Stream.ACCEPT if counters == "shared" else Stream.DRAFT
        u_draft = uniforms(seeds, c, draft_stream)
        x_last = buf[rows, anchor]
        prev, toks, q_rows = x_last, [], []
        for k in range(K):
            q_row = Q_CHAIN[prev]
            prev = sample_inverse_cdf(q_row, u_draft[:, k + 1])
            toks.append(prev)
            q_rows.append(q_row)
        d, q = torch.stack(toks, 1), torch.stack(q_rows, 1).float()
        u_acc = uniforms(seeds, c, Stream.ACCEPT)
        u_res = uniforms(seeds, c[:, :1], Stream.RESIDUAL)[:, 0]
        r = verify_block(d, torch.full((n,), K), target_rows(x_last, d), q, u_acc, u_res)
        emitted = torch.cat([d, torch.zeros(n, 1, dtype=torch.long)], 1)
        emitted[rows, r.num_accepted] = r.next_token
        slots = torch.arange(K + 1)[None]
        write = (slots <= r.num_accepted[:, None]) & (length < 1 + num_tokens)[:, None]
        cols = (length[:, None] + slots).clamp(max=buf.shape[1] - 1)
        buf[rows[:, None].expand_as(cols)[write], cols[write]] = emitted[write]
        length = torch.where(length < 1 + num_tokens, length + r.num_accepted + 1, length)
    return buf[:, 1 : 1 + num_tokens]


@pytest.mark.parametrize("counters", ["round", "shared", "absolute"])
def test_multi_round_generation_with_counter_rng(counters):
    n = 50_000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    x0 = torch.arange(n) % V
    out = generate(seeds, x0, 3, counters)
    again = generate(seeds[:1000].flip(0), x0[:1000].flip(0), 3, counters)  # another batch, same requests
    assert torch.equal(again, out[:1000].flip(0))
    n_x0 = torch.bincount(x0, minlength=V).double()
    cells = ((x0 * V + out[:, 0]) * V + out[:, 1]) * V + out[:, 2]
    counts = torch.bincount(cells, minlength=V**4)
    exp = n_x0[:, None, None, None] * P_CHAIN[:, :, None, None] * P_CHAIN[None, :, :, None] * P_CHAIN[None, None]
    p = chi2_pvalue(counts, exp, dof_lost=V)
    if counters == "round":
        assert p > PASS_P, p
    else:  # drafting on the acceptance stream (vLLM PR#47386), or reusing position-keyed uniforms, biases
        assert p < FAIL_P, p
