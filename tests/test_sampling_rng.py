"""Counter-based RNG (dspark.speculative.rng) and logit processing / inverse-CDF sampling
(dspark.speculative.sampling)."""

import math

import numpy as np
import pytest
import torch

from dspark.speculative.rng import MAX_SLOTS, Stream, round_counters, uniforms
from dspark.speculative.sampling import GREEDY_EPS, greedy, process_logits, sample_inverse_cdf


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor, dof_lost: int = 1) -> float:
    """Pearson chi-square p-value over cells with expected > 0 (survival function via gammaincc)."""
    obs, exp = observed.double().flatten(), expected.double().flatten()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - dof_lost
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def ks_stat(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of samples u to U(0, 1)."""
    x = u.double().flatten().sort().values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - x, x - (i - 1) / n).max())


KS_CRIT_001 = 1.95  # D * sqrt(n) above this rejects uniformity at alpha = 0.001


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Large elementwise ops stall 10x with 2 intra-op threads on a shared 2-core box; use 1, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- rng


def _grid(num_seeds: int, num_pos: int, stream: Stream, seed0: int = 0) -> torch.Tensor:
    seeds = torch.arange(seed0, seed0 + num_seeds, dtype=torch.int64)
    pos = torch.arange(num_pos, dtype=torch.int64).expand(num_seeds, num_pos)
    return uniforms(seeds, pos, stream)


def test_uniforms_deterministic_and_batch_invariant():
    seeds = torch.tensor([7, 123456789, -5, 2**62 + 3], dtype=torch.int64)
    pos = torch.tensor([[0, 1, 2], [10, 11, 12], [5, 5, 6], [2**40, 3, 2**33 + 1]], dtype=torch.int64)
    a = uniforms(seeds, pos, Stream.ACCEPT)
    assert a.dtype == torch.float64 and a.shape == (4, 3)
    assert torch.equal(a, uniforms(seeds, pos, Stream.ACCEPT))
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(uniforms(seeds[perm], pos[perm], Stream.ACCEPT), a[perm])
    for b in range(4):  # one request alone, and one position alone, give the same numbers as inside the batch
        assert torch.equal(uniforms(seeds[b : b + 1], pos[b : b + 1], Stream.ACCEPT), a[b : b + 1])
        assert torch.equal(uniforms(seeds[b : b + 1], pos[b : b + 1, 1:2], Stream.ACCEPT), a[b : b + 1, 1:2])
    assert a[2, 0] == a[2, 1]  # same (seed, position, stream) -> same value


def test_uniforms_differ_across_stream_position_seed():
    vals = torch.stack([_grid(100, 100, s) for s in Stream]).flatten()
    assert vals.numel() == 30_000
    assert torch.unique(vals).numel() >= vals.numel() - 2  # 32-bit outputs: birthday collisions ~0.1 expected
    base = _grid(1, 1, Stream.DRAFT)
    assert base != _grid(1, 1, Stream.ACCEPT)
    assert base != _grid(1, 1, Stream.DRAFT, seed0=1)
    assert base != _grid(1, 2, Stream.DRAFT)[:, 1:]
    seeds = torch.tensor([1, 1 + 2**32], dtype=torch.int64)  # seeds that differ only in the high word
    v = uniforms(seeds, torch.zeros(2, 1, dtype=torch.int64), Stream.RESIDUAL)
    assert v[0] != v[1]


def test_uniforms_strictly_inside_unit_interval():
    extremes = torch.tensor([0, -1, 2**63 - 1, -(2**63), 2**32 - 1, 2**32], dtype=torch.int64)
    pos = extremes.expand(6, 6)
    for s in Stream:
        u = torch.cat([uniforms(extremes, pos, s).flatten(), _grid(50, 200, s).flatten()])
        assert bool((u > 0).all()) and bool((u < 1).all())
        assert float(u.min()) >= 2.0**-33 and float(u.max()) <= 1 - 2.0**-33


@pytest.mark.parametrize("stream", list(Stream))
def test_uniforms_are_uniform(stream):
    u = _grid(100, 1000, stream).flatten()  # 100k values: many seeds x consecutive positions
    assert ks_stat(u) * math.sqrt(u.numel()) < KS_CRIT_001
    counts = torch.histc(u.float(), bins=100, min=0.0, max=1.0)
    assert chi2_pvalue(counts, torch.full((100,), u.numel() / 100)) > 1e-3
    one_seed = uniforms(torch.tensor([42]), torch.arange(100_000)[None], stream).flatten()
    assert ks_stat(one_seed) * math.sqrt(one_seed.numel()) < KS_CRIT_001
    bits = (u * 2.0**32).floor().to(torch.int64)  # every one of the 32 bits is balanced
    means = torch.stack([((bits >> i) & 1).double().mean() for i in range(32)])
    assert float((means - 0.5).abs().max()) < 4.5 * 0.5 / math.sqrt(u.numel())


def test_uniformity_check_has_power():
    u = _grid(100, 1000, Stream.ACCEPT).flatten()
    assert ks_stat(u**1.02) * math.sqrt(u.numel()) > KS_CRIT_001


def test_streams_and_neighbouring_positions_are_independent():
    n_seeds, n_pos = 200, 500
    a, r, d = (_grid(n_seeds, n_pos, s).flatten() for s in (Stream.ACCEPT, Stream.RESIDUAL, Stream.DRAFT))
    n = a.numel()
    for x, y in ((a, r), (a, d), (r, d)):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 4.0 / math.sqrt(n)
        cells = (x * 10).long() * 10 + (y * 10).long()  # 10 x 10 joint histogram
        counts = torch.bincount(cells, minlength=100)
        assert chi2_pvalue(counts, torch.full((100,), n / 100)) > 1e-3
    g = _grid(n_seeds, n_pos, Stream.ACCEPT)
    x, y = g[:, :-1].flatten(), g[:, 1:].flatten()  # positions t and t+1 of the same request
    counts = torch.bincount((x * 10).long() * 10 + (y * 10).long(), minlength=100)
    assert chi2_pvalue(counts, torch.full((100,), x.numel() / 100)) > 1e-3


def test_round_counters_unique_per_round():
    anchors = torch.tensor([0, 1, 5, 6], dtype=torch.int64)
    c = round_counters(anchors, 8)
    assert c.shape == (4, 8)
    assert torch.equal(c[:, 0], anchors * MAX_SLOTS)
    assert torch.unique(c).numel() == c.numel()  # consecutive anchors never share a counter
    with pytest.raises(ValueError, match="num_slots"):
        round_counters(anchors, MAX_SLOTS + 1)
    with pytest.raises(ValueError, match="positions"):
        uniforms(anchors, anchors, Stream.ACCEPT)


# ---------------------------------------------------------------------------------------------- sampling


def reference_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Per-row numpy reference with vLLM semantics."""
    V = logits.shape[-1]
    if temperature <= GREEDY_EPS:
        out = np.zeros(V)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    if top_p < 1.0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        keep = np.zeros(V, dtype=bool)
        keep[order[mass_before < top_p]] = True
        keep[order[0]] = True
        x = np.where(keep, x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


ROW_SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (1.3, 0, 0.8),
    (0.5, 10, 0.5),
    (0.0, 3, 0.5),  # greedy wins over top-k/top-p
    (1.0, 0, 1e-4),  # keeps exactly one token
    (0.9, 50, 1.0),  # k >= V is off
    (2.0, 1, 1.0),
]


def _check_against_reference(settings, V=50, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(settings)
    logits = torch.randn(B, T, V, generator=g) * 3
    temp = torch.tensor([s[0] for s in settings])
    top_k = torch.tensor([s[1] for s in settings])
    top_p = torch.tensor([s[2] for s in settings])
    probs = process_logits(logits, temp, top_k, top_p)
    assert probs.dtype == torch.float32 and probs.shape == (B, T, V)
    for b, (t, k, p) in enumerate(settings):
        for i in range(T):
            ref = reference_process(logits[b, i].numpy(), t, k, p)
            np.testing.assert_allclose(probs[b, i].numpy(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, T))
    return logits, probs


def test_process_logits_matches_reference_full_sort():
    logits, probs = _check_against_reference(ROW_SETTINGS)
    assert torch.equal(probs[4].argmax(-1), greedy(logits[4]))
    assert int((probs[5] > 0).sum()) == 3  # top_p tiny: one token per position
    assert int((probs[7] > 0).sum()) == 3  # top_k = 1


def test_process_logits_matches_reference_topk_candidates():
    # every sampled row has a top-k, so only the top max(k) candidates are sorted
    _check_against_reference([(1.0, 7, 0.6), (0.8, 20, 0.9), (1.0, 3, 1.0), (0.0, 0, 1.0), (1.5, 40, 0.3)])


def test_process_logits_topk_only_and_plain_and_all_greedy():
    _check_against_reference([(1.0, 4, 1.0), (1.0, 0, 1.0), (0.0, 0, 1.0)])
    _check_against_reference([(1.0, 0, 1.0), (0.6, 0, 1.0)])
    logits, probs = _check_against_reference([(0.0, 0, 1.0), (1e-6, 4, 0.5)])
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_process_logits_reference_detects_a_wrong_rule():
    # power check for the reference comparison: top-p "mass including the token" < p drops one token too many
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1, 50, generator=g) * 3
    probs = process_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.8]))
    x = logits[0, 0].double().numpy()
    pr = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    order = np.argsort(-pr)
    wrong_keep = order[np.cumsum(pr[order]) < 0.8]
    assert int((probs > 0).sum()) != len(wrong_keep)


def test_process_logits_shape_error():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(torch.zeros(2, 1, 5), torch.ones(3), torch.zeros(2, dtype=torch.long), torch.ones(2))


def test_sample_inverse_cdf_frequencies():
    g = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.0, 0.1, 0.25, 0.0, 0.05, 0.3, 0.2, 0.1, 0.0], dtype=torch.float32)
    n = 200_000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    tokens = sample_inverse_cdf(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert int(counts[probs == 0].sum()) == 0
    assert chi2_pvalue(counts, probs.double() * n) > 1e-3
    shifted = sample_inverse_cdf(probs.expand(n, -1), u**1.05)  # power check: a skewed sampler is rejected
    assert chi2_pvalue(torch.bincount(shifted, minlength=probs.numel()), probs.double() * n) < 1e-6


def test_sample_inverse_cdf_edges_and_shapes():
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.3, 0.0, 0.0, 0.0, 0.0]])
    lo = torch.full((2,), 2.0**-33, dtype=torch.float64)
    hi = torch.full((2,), 1 - 2.0**-33, dtype=torch.float64)
    assert sample_inverse_cdf(probs, lo).tolist() == [2, 1]
    assert sample_inverse_cdf(probs, hi).tolist() == [3, 1]  # never runs past the last nonzero token
    assert sample_inverse_cdf(probs, torch.ones(2, dtype=torch.float64)).tolist() == [3, 1]
    # fp rounding: many tiny probabilities whose float32 sum differs from 1, u at the top
    g = torch.Generator().manual_seed(0)
    big = torch.rand(4, 32000, generator=g)
    big[:, -100:] = 0.0
    big = big / big.sum(-1, keepdim=True)
    idx = sample_inverse_cdf(big, torch.full((4,), 1 - 2.0**-33, dtype=torch.float64))
    assert bool((idx < 32000 - 100).all())
    p3 = torch.softmax(torch.randn(2, 3, 7, generator=g), -1)
    out = sample_inverse_cdf(p3, torch.rand(2, 3, generator=g, dtype=torch.float64))
    assert out.shape == (2, 3) and out.dtype == torch.int64
    with pytest.raises(ValueError, match="u must have shape"):
        sample_inverse_cdf(p3, torch.rand(3, 2))
