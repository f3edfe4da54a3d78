"""SPS tables, Algorithm 1 (incl. the Appendix-A losslessness counterexample), calibration metrics and STS."""

import ast
import itertools
import json
import math
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.speculative.schedule import (
    SpsTable,
    auroc,
    brier,
    calibrate,
    calibration_report,
    choose_verify_lengths,
    default_cost_model,
    expected_calibration_error,
    fit_sts,
    load_sts,
    save_sts,
    survival,
)


def test_module_imports_only_the_standard_library():
    import dspark.speculative.schedule as mod

    tree = ast.parse(open(mod.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


# ----------------------------------------------------------------------------------------------- SPS tables


def test_sps_1d_interpolates_linearly_and_clamps():
    table = SpsTable.from_dict({"num_tokens": [1, 3, 7], "steps_per_s": [10, 6, 2]})
    assert table.sps(1) == 10 and table.sps(3) == 6 and table.sps(7) == 2
    assert table.sps(2) == pytest.approx(8.0)  # a floor lookup would give 10
    assert table.sps(5) == pytest.approx(4.0)
    assert table.sps(1.5) == pytest.approx(9.0)
    assert table.sps(0) == 10 and table.sps(100) == 2


def test_sps_2d_is_bilinear_and_needs_batch_size():
    table = SpsTable.from_dict({"batch_sizes": [1, 3], "num_tokens": [2, 4], "steps_per_s": [[10, 6], [4, 2]]})
    assert table.sps(2, batch_size=1) == 10 and table.sps(4, batch_size=3) == 2
    assert table.sps(3, batch_size=1) == pytest.approx(8.0)
    assert table.sps(3, batch_size=3) == pytest.approx(3.0)
    assert table.sps(3, batch_size=2) == pytest.approx(5.5)
    assert table.sps(2, batch_size=2) == pytest.approx(7.0)
    assert table.sps(10, batch_size=10) == 2 and table.sps(3, batch_size=0) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="batch_size"):
        table.sps(3)


def test_sps_json_round_trip(tmp_path):
    for data in (
        {"num_tokens": [1, 3, 7], "steps_per_s": [10.0, 6.0, 2.0]},
        {"batch_sizes": [1, 3], "num_tokens": [2, 4], "steps_per_s": [[10.0, 6.0], [4.0, 2.0]]},
    ):
        table = SpsTable.from_dict(data)
        assert json.loads(table.to_json()) == data
        path = tmp_path / "sps.json"
        table.save(path)
        assert SpsTable.load(path) == table


@pytest.mark.parametrize(
    "data, key",
    [
        ({"num_tokens": [1, 2]}, "steps_per_s"),
        ({"steps_per_s": [1, 2]}, "num_tokens"),
        ({"num_tokens": [1, 1], "steps_per_s": [1, 2]}, "num_tokens"),
        ({"num_tokens": [1, 2], "steps_per_s": [1, -2]}, "steps_per_s"),
        ({"num_tokens": [1, 2], "steps_per_s": [1]}, "steps_per_s"),
        ({"num_tokens": [1, 2], "steps_per_s": [[1, 2], [1, 2]]}, "batch_sizes"),
        ({"batch_sizes": [1, 2], "num_tokens": [1, 2], "steps_per_s": [[1, 2]]}, "batch_sizes"),
        ({"batch_sizes": [2, 1], "num_tokens": [1, 2], "steps_per_s": [[1, 2], [1, 2]]}, "batch_sizes"),
    ],
)
def test_sps_validation_names_the_key(data, key):
    with pytest.raises(ValueError, match=key):
        SpsTable.from_dict(data)


def test_sps_load_error_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"num_tokens": [1]}')
    with pytest.raises(ValueError, match="bad.json.*steps_per_s"):
        SpsTable.load(path)


def test_default_cost_model_is_linear_step_time():
    table = default_cost_model(base_ms=20.0, per_token_ms=0.5, max_tokens=64)
    step_ms = [1000.0 / table.sps(b) for b in range(1, 65)]
    assert step_ms[0] == pytest.approx(20.5)
    assert all(b - a == pytest.approx(0.5) for a, b in zip(step_ms, step_ms[1:]))
    table2 = default_cost_model(per_request_ms=1.0, batch_sizes=[1, 4], max_tokens=16)
    assert table2.is_2d and table2.sps(8, batch_size=1) > table2.sps(8, batch_size=4)


# ------------------------------------------------------------------------------------------- Algorithm 1


def test_survival_is_cumulative_product():
    assert survival([0.5, 0.5, 0.2]) == pytest.approx([0.5, 0.25, 0.05])
    assert survival([]) == []


SMOOTH = SpsTable.from_dict({"num_tokens": [2, 3, 4, 5, 6, 7], "steps_per_s": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]})
CONF = [[0.9, 0.9, 0.5], [0.6, 0.5]]  # survivals (0.9, 0.81, 0.405), (0.6, 0.3)


@pytest.mark.parametrize("early_stop", [True, False])
def test_algorithm1_smooth_table_known_answer(early_stop):
    # Theta by B: 2 -> 2.0, 3 -> 2.9*0.9, 4 -> 3.71*0.8, 5 -> 4.31*0.7 = 3.017 (best), 6 -> 4.715*0.6
    sched = choose_verify_lengths(CONF, SMOOTH, early_stop=early_stop)
    assert sched.lengths == [2, 1]
    assert sched.num_tokens == 5
    assert sched.expected_tokens == pytest.approx(4.31)
    assert sched.throughput == pytest.approx(4.31 * 0.7)


def test_algorithm1_interpolates_sparse_tables():
    # Same line as SMOOTH but only its end points: linear interpolation must give the same answer.
    sparse = SpsTable.from_dict({"num_tokens": [2, 7], "steps_per_s": [1.0, 0.5]})
    assert choose_verify_lengths(CONF, sparse).lengths == [2, 1]


def test_algorithm1_jagged_table_early_stop_halts_at_local_optimum():
    jagged = SpsTable.from_dict({"num_tokens": [2, 3, 4, 5, 6], "steps_per_s": [1.0, 0.6, 0.58, 0.56, 0.55]})
    conf = [[0.9, 0.9], [0.9, 0.9]]  # survivals 0.9, 0.81 each
    early = choose_verify_lengths(conf, jagged, early_stop=True)
    assert early.lengths == [0, 0] and early.throughput == pytest.approx(2.0)  # B=3 gives 2.9*0.6 = 1.74
    full = choose_verify_lengths(conf, jagged, early_stop=False)
    assert full.lengths == [2, 2]
    assert full.throughput == pytest.approx(5.42 * 0.55)


def test_algorithm1_breaks_survival_ties_by_position_then_request():
    # All survivals are 1; the best batch admits exactly two drafts (B=4: 4 * 0.8).
    table = SpsTable.from_dict({"num_tokens": [2, 3, 4, 5], "steps_per_s": [1.0, 0.9, 0.8, 0.5]})
    sched = choose_verify_lengths([[1.0, 1.0], [1.0, 1.0]], table)
    assert sched.lengths == [1, 1]
    assert sched.throughput == pytest.approx(3.2)


def test_algorithm1_min_len_and_max_len():
    table = SpsTable.from_dict({"num_tokens": [1, 2, 3], "steps_per_s": [1.0, 0.5, 0.45]})
    low = [[0.1, 0.1]]
    assert choose_verify_lengths(low, table).lengths == [0]
    forced = choose_verify_lengths(low, table, min_len=1)
    assert forced.lengths == [1]
    assert forced.expected_tokens == pytest.approx(1.1) and forced.throughput == pytest.approx(0.55)
    clamped = choose_verify_lengths(low, table, min_len=5)
    assert clamped.lengths == [2] and clamped.num_tokens == 3
    assert choose_verify_lengths(CONF, SMOOTH, max_len=1).lengths == [1, 1]
    assert choose_verify_lengths(CONF, SMOOTH, max_len=0).lengths == [0, 0]


def test_algorithm1_uses_batch_size_for_2d_tables():
    table = default_cost_model(per_request_ms=5.0, batch_sizes=[1, 2, 4], max_tokens=32)
    sched = choose_verify_lengths(CONF, table)
    assert sched.throughput == pytest.approx(sched.expected_tokens * table.sps(sched.num_tokens, batch_size=2))


def test_algorithm1_rejects_bad_confidences():
    with pytest.raises(ValueError, match="request 1"):
        choose_verify_lengths([[0.5], [1.5]], SMOOTH)
    with pytest.raises(ValueError, match="outside"):
        choose_verify_lengths([[math.nan]], SMOOTH)


def _brute_force(conf, sps):
    surv = [survival(row) for row in conf]
    best = -math.inf
    for lengths in itertools.product(*(range(len(a) + 1) for a in surv)):
        b = sum(1 + n for n in lengths)
        tau = sum(1 + sum(a[:n]) for a, n in zip(surv, lengths))
        best = max(best, tau * sps(b))
    return best


CONFS = st.lists(st.lists(st.floats(0.05, 1.0), min_size=0, max_size=4), min_size=1, max_size=4)


@settings(max_examples=120, deadline=None)
@given(conf=CONFS, a=st.floats(0.1, 10.0), b=st.floats(0.01, 5.0))
def test_early_stop_is_optimal_for_smooth_costs(conf, a, b):
    def sps(n):
        return 1.0 / (a + b * n)

    best = _brute_force(conf, sps)
    for early in (True, False):
        sched = choose_verify_lengths(conf, sps, early_stop=early)
        assert sched.throughput == pytest.approx(best, rel=1e-9)
        assert sched.num_tokens == sum(1 + n for n in sched.lengths)


@settings(max_examples=120, deadline=None)
@given(conf=CONFS, values=st.lists(st.floats(0.1, 10.0), min_size=20, max_size=20))
def test_global_search_is_optimal_for_any_costs(conf, values):
    def sps(n):
        return values[n - 1]

    best = _brute_force(conf, sps)
    full = choose_verify_lengths(conf, sps, early_stop=False)
    early = choose_verify_lengths(conf, sps, early_stop=True)
    assert full.throughput == pytest.approx(best, rel=1e-9)
    assert early.throughput <= full.throughput + 1e-12
    for sched in (full, early):
        assert sched.throughput == pytest.approx(sched.expected_tokens * sps(sched.num_tokens))


def _first_token_distribution(early_stop: bool, trials: int, seed: int = 0) -> float:
    """Appendix A: fraction of trials whose first emitted token is token 0."""
    rng = random.Random(seed)
    p_t, p_d = (0.7, 0.3), (0.5, 0.5)
    table = SpsTable.from_dict({"num_tokens": [1, 2, 3], "steps_per_s": [1.0, 0.5, 0.45]})
    zeros = 0
    for _ in range(trials):
        x1 = 0 if rng.random() < p_d[0] else 1
        c2 = 0.99 if x1 == 0 else 0.01  # confidence of draft 2 sees the sampled x1
        (ell,) = choose_verify_lengths([[1.0, c2]], table, early_stop=early_stop).lengths
        if ell == 0:
            token = 0 if rng.random() < p_t[0] else 1
        elif rng.random() < min(1.0, p_t[x1] / p_d[x1]):
            token = x1
        else:
            residual = [max(t - d, 0.0) for t, d in zip(p_t, p_d)]
            token = 0 if rng.random() < residual[0] / sum(residual) else 1
        zeros += token == 0
    return zeros / trials


def test_appendix_a_early_stop_is_lossless_and_global_search_is_biased():
    trials = 200_000  # std error ~0.001
    assert _first_token_distribution(early_stop=True, trials=trials) == pytest.approx(0.7, abs=0.006)
    assert _first_token_distribution(early_stop=False, trials=trials) == pytest.approx(0.85, abs=0.006)


# ------------------------------------------------------------------------------------- calibration metrics


def test_metrics_against_hand_computed_values():
    probs, labels = [0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]
    assert auroc(probs, labels) == pytest.approx(0.75)
    assert brier(probs, labels) == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    # ties: positives {0.5, 0.9} vs negatives {0.5, 0.5}: (0.5 + 0.5 + 1 + 1) / 4
    assert auroc([0.5, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.75)
    assert auroc([0.2, 0.3], [1, 1]) != auroc([0.2, 0.3], [1, 1])  # NaN: one class only
    assert expected_calibration_error([0.1, 0.9], [0, 1], n_bins=10) == pytest.approx(0.1)
    assert expected_calibration_error([0.7] * 10, [1] * 7 + [0] * 3) == pytest.approx(0.0)
    # bins [0, 0.5) and [0.5, 1]: |0.3 - 0.5| * 2/4 + |0.8 - 1| * 2/4
    assert expected_calibration_error([0.2, 0.4, 0.7, 0.9], [1, 0, 1, 1], n_bins=2) == pytest.approx(0.2)
    assert expected_calibration_error([1.0], [0]) == pytest.approx(1.0)


def test_auroc_matches_pairwise_count():
    rng = random.Random(3)
    probs = [rng.choice([0.1, 0.2, 0.3, 0.5, 0.8]) for _ in range(60)]
    labels = [int(rng.random() < p) for p in probs]
    pos = [p for p, y in zip(probs, labels) if y]
    neg = [p for p, y in zip(probs, labels) if not y]
    pairs = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    assert auroc(probs, labels) == pytest.approx(pairs / (len(pos) * len(neg)))


# ---------------------------------------------------------------------------------------------------- STS


def _synthetic_blocks(n: int, k: int, seed: int, scale: float):
    """Rows of `scale` * true conditional logits; accepted prefixes simulated from the true probabilities."""
    rng = random.Random(seed)
    logits, accepted = [], []
    for _ in range(n):
        z = [rng.gauss(1.0, 1.2) for _ in range(k)]
        m = 0
        while m < k and rng.random() < 1.0 / (1.0 + math.exp(-z[m])):
            m += 1
        logits.append([scale * zi for zi in z])
        accepted.append(m)
    return logits, accepted


def test_sts_recovers_temperature_and_lowers_ece():
    fit_logits, fit_acc = _synthetic_blocks(2000, 4, seed=1, scale=3.0)
    temps = fit_sts(fit_logits, fit_acc)
    assert len(temps) == 4
    assert 2.0 < temps[0] < 4.5  # true temperature is 3
    held_logits, held_acc = _synthetic_blocks(2000, 4, seed=2, scale=3.0)
    report = calibration_report(held_logits, held_acc, temps)
    assert [r["position"] for r in report] == [1, 2, 3, 4]
    for r in report:
        assert r["temperature"] == temps[r["position"] - 1]
        assert r["ece_after"] < 0.4 * r["ece_before"], r
        assert r["ece_after"] < 0.06, r
        assert r["brier_after"] < r["brier_before"], r
    # temperature scaling is monotone per position, so position 1's ranking is unchanged
    assert report[0]["auroc_after"] == pytest.approx(report[0]["auroc_before"])


def test_sts_leaves_calibrated_data_near_one():
    logits, acc = _synthetic_blocks(2000, 2, seed=4, scale=1.0)
    temps = fit_sts(logits, acc, grid=[0.25, 0.5, 1.0, 2.0, 4.0])
    assert temps == [1.0, 1.0]


def test_calibrate_and_validation():
    assert calibrate([0.0, 2.0], [1.0, 2.0]) == pytest.approx([0.5, 1 / (1 + math.exp(-1.0))])
    assert calibrate([0.0], [1.0, 2.0]) == [0.5]
    with pytest.raises(ValueError, match="temperatures"):
        calibrate([0.0, 1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="accepted_prefix"):
        fit_sts([[0.0, 1.0]], [3])
    with pytest.raises(ValueError, match="row 1"):
        fit_sts([[0.0, 1.0], [0.0]], [1, 0])


def test_sts_file_round_trip(tmp_path):
    path = tmp_path / "sts.json"
    save_sts(path, [1.5, 2.0], extra={"n_rows": 10})
    data = json.loads(path.read_text())
    assert data == {"n_rows": 10, "sts_temperatures": [1.5, 2.0]}
    assert load_sts(path) == [1.5, 2.0]
    path.write_text(json.dumps({"temperatures": [0.5, 3]}))
    assert load_sts(path) == [0.5, 3.0]
    path.write_text(json.dumps({"temps": [1.0]}))
    with pytest.raises(ValueError, match="sts_temperatures"):
        load_sts(path)
    path.write_text(json.dumps({"sts_temperatures": [1.0, -2.0]}))
    with pytest.raises(ValueError, match="sts.json.*sts_temperatures"):
        load_sts(path)
