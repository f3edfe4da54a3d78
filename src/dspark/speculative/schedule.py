"""Confidence-scheduled verification (DSpark §3.2): SPS cost tables, Algorithm 1, and STS calibration.

Pure Python (no torch, no numpy): the engine converts confidence logits to host lists at one boundary and
gets back per-request verify lengths.

Terms: c_{r,j} is the conditional acceptance probability of draft j of request r given drafts 1..j-1 were
accepted; a_{r,j} = prod_{i<=j} c_{r,i} is its survival. Verifying l_r drafts costs 1 + l_r target tokens
(the anchor/bonus slot included) and yields 1 + sum_{j<=l_r} a_{r,j} tokens in expectation.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------------------
# SPS(B): profiled target forward steps per second versus the number of tokens in the verify batch.
# ---------------------------------------------------------------------------------------------------------


def _float_list(key: str, values: Any) -> list[float]:
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise ValueError(f"SPS table key '{key}' must be a non-empty list of numbers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"SPS table key '{key}' holds a non-finite or non-numeric value {v!r}")
        out.append(float(v))
    return out


def _increasing(key: str, values: Sequence[float]) -> None:
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"SPS table key '{key}' must be strictly increasing, got {list(values)}")


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation, flat outside [xs[0], xs[-1]]."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)  # xs[i-1] <= x < xs[i]
    x0, x1 = xs[i - 1], xs[i]
    w = (x - x0) / (x1 - x0)
    return ys[i - 1] * (1.0 - w) + ys[i] * w


@dataclass(frozen=True)
class SpsTable:
    """Steps/s over a grid of verify-batch token counts, optionally also over batch sizes (rows).

    1-D: `steps_per_s[0][j]` at `num_tokens[j]`, `batch_sizes` None.
    2-D: `steps_per_s[i][j]` at (`batch_sizes[i]`, `num_tokens[j]`).
    Lookups interpolate linearly (bilinearly in 2-D) and clamp flat outside the grid; never a floor lookup.
    """

    num_tokens: tuple[float, ...]
    steps_per_s: tuple[tuple[float, ...], ...]
    batch_sizes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        nt = _float_list("num_tokens", self.num_tokens)
        _increasing("num_tokens", nt)
        if any(n <= 0 for n in nt):
            raise ValueError(f"SPS table key 'num_tokens' must be positive, got {nt}")
        rows = [_float_list("steps_per_s", row) for row in self.steps_per_s]
        if self.batch_sizes is None:
            if len(rows) != 1:
                raise ValueError("SPS table key 'steps_per_s' must have exactly one row when 'batch_sizes' is absent")
            bs = None
        else:
            bs = _float_list("batch_sizes", self.batch_sizes)
            _increasing("batch_sizes", bs)
            if len(rows) != len(bs):
                raise ValueError(
                    f"SPS table key 'steps_per_s' has {len(rows)} rows, 'batch_sizes' has {len(bs)} entries"
                )
        for i, row in enumerate(rows):
            if len(row) != len(nt):
                raise ValueError(
                    f"SPS table key 'steps_per_s' row {i} has {len(row)} values, 'num_tokens' has {len(nt)}"
                )
            if any(v <= 0 for v in row):
                raise ValueError(f"SPS table key 'steps_per_s' row {i} must be positive, got {row}")
        object.__setattr__(self, "num_tokens", tuple(nt))
        object.__setattr__(self, "steps_per_s", tuple(tuple(r) for r in rows))
        object.__setattr__(self, "batch_sizes", None if bs is None else tuple(bs))

    @property
    def is_2d(self) -> bool:
        return self.batch_sizes is not None

    def sps(self, num_tokens: float, batch_size: int | None = None) -> float:
        """Interpolated steps/s at `num_tokens` verify tokens (and `batch_size` requests for a 2-D table)."""
        if self.batch_sizes is None:
            return _interp(self.num_tokens, self.steps_per_s[0], num_tokens)
        if batch_size is None:
            raise ValueError("this SPS table is 2-D (has 'batch_sizes'); pass batch_size to sps()")
        column = [_interp(self.num_tokens, row, num_tokens) for row in self.steps_per_s]
        return _interp(self.batch_sizes, column, batch_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpsTable:
        if not isinstance(data, Mapping):
            raise ValueError(f"SPS table must be a JSON object, got {type(data).__name__}")
        for key in ("num_tokens", "steps_per_s"):
            if key not in data:
                raise ValueError(f"SPS table is missing key '{key}' (have {sorted(data)})")
        sps = data["steps_per_s"]
        batch_sizes = data.get("batch_sizes")
        if batch_sizes is None:
            if isinstance(sps, Sequence) and sps and isinstance(sps[0], Sequence):
                raise ValueError("SPS table key 'steps_per_s' is 2-D but key 'batch_sizes' is missing")
            rows = (sps,)
        else:
            if not isinstance(sps, Sequence) or not all(isinstance(r, Sequence) for r in sps):
                raise ValueError("SPS table key 'steps_per_s' must be a list of rows when 'batch_sizes' is given")
            rows = tuple(sps)
        return cls(num_tokens=data["num_tokens"], steps_per_s=rows, batch_sizes=batch_sizes)

    @classmethod
    def from_json(cls, text: str) -> SpsTable:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> SpsTable:
        try:
            return cls.from_json(Path(path).read_text())
        except (ValueError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        if self.batch_sizes is None:
            return {"num_tokens": list(self.num_tokens), "steps_per_s": list(self.steps_per_s[0])}
        return {
            "batch_sizes": list(self.batch_sizes),
            "num_tokens": list(self.num_tokens),
            "steps_per_s": [list(r) for r in self.steps_per_s],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def default_cost_model(
    *,
    base_ms: float = 20.0,
    per_token_ms: float = 0.5,
    per_request_ms: float = 0.0,
    max_tokens: int = 256,
    batch_sizes: Sequence[int] | None = None,
) -> SpsTable:
    """SPS table from step time = base + per_token * B (+ per_request * batch) in ms, for B = 1..max_tokens.

    The defaults follow the bf16 CPU measurements (verifying 8 tokens ~1.2x the cost of decoding 1). Used when
    no profile exists; with `batch_sizes` the table is 2-D.
    """
    if base_ms <= 0 or per_token_ms < 0 or per_request_ms < 0 or max_tokens < 1:
        raise ValueError(
            "default_cost_model needs base_ms > 0, per_token_ms >= 0, per_request_ms >= 0, max_tokens >= 1; "
            f"got {base_ms}, {per_token_ms}, {per_request_ms}, {max_tokens}"
        )
    tokens = list(range(1, max_tokens + 1))

    def row(bs: float) -> tuple[float, ...]:
        return tuple(1000.0 / (base_ms + per_token_ms * b + per_request_ms * bs) for b in tokens)

    if batch_sizes is None:
        return SpsTable(num_tokens=tuple(tokens), steps_per_s=(row(0.0),))
    return SpsTable(
        num_tokens=tuple(tokens),
        steps_per_s=tuple(row(bs) for bs in batch_sizes),
        batch_sizes=tuple(batch_sizes),
    )


# ---------------------------------------------------------------------------------------------------------
# Algorithm 1: hardware-aware prefix scheduler.
# ---------------------------------------------------------------------------------------------------------


def survival(confidences: Sequence[float]) -> list[float]:
    """Cumulative products a_j = prod_{i<=j} c_i of conditional confidences."""
    out, acc = [], 1.0
    for c in confidences:
        acc *= c
        out.append(acc)
    return out


@dataclass(frozen=True)
class Schedule:
    lengths: list[int]  # verified drafts per request
    expected_tokens: float  # tau = sum_r (1 + sum_{j<=l_r} a_{r,j})
    num_tokens: int  # B = sum_r (1 + l_r)
    throughput: float  # Theta = tau * SPS(B), expected tokens/s


def _sps_fn(sps: Callable[[int], float] | SpsTable, num_requests: int) -> Callable[[int], float]:
    if isinstance(sps, SpsTable):
        if sps.is_2d:
            return lambda b: sps.sps(b, batch_size=num_requests)
        return sps.sps
    return sps


def choose_verify_lengths(
    confidences: Sequence[Sequence[float]],
    sps: Callable[[int], float] | SpsTable,
    *,
    min_len: int = 0,
    max_len: int | None = None,
    early_stop: bool = True,
) -> Schedule:
    """Choose how many drafts of each request to verify, maximising tau * SPS(B) (DSpark Algorithm 1).

    Every request verifies at least min(min_len, its drafts). Further drafts are admitted one at a time in
    descending survival order (ties: lower position, then lower request). With `early_stop` the scan stops at
    the first admission that does not strictly improve Theta: admission of draft j then depends only on
    information available before x_j was sampled, which keeps verification lossless. `early_stop=False` takes
    the best prefix of the whole order instead; that is biased when c_{j+1} depends on x_j (Appendix A).
    """
    if min_len < 0 or (max_len is not None and max_len < 0):
        raise ValueError(f"min_len and max_len must be >= 0, got min_len={min_len}, max_len={max_len}")
    sps_of = _sps_fn(sps, len(confidences))
    surv: list[list[float]] = []
    for r, row in enumerate(confidences):
        for c in row:
            if not 0.0 <= c <= 1.0:  # also rejects NaN
                raise ValueError(f"confidence {c!r} of request {r} is outside [0, 1]; pass sigmoid outputs")
        cap = len(row) if max_len is None else min(len(row), max_len)
        surv.append(survival(row[:cap]))

    lengths = [min(min_len, len(a)) for a in surv]
    num_tokens = sum(1 + n for n in lengths)
    tau = sum(1.0 + sum(a[:n]) for a, n in zip(surv, lengths))
    best = Schedule(list(lengths), tau, num_tokens, tau * sps_of(num_tokens))

    cands = [(-a[j - 1], j, r) for r, a in enumerate(surv) for j in range(lengths[r] + 1, len(a) + 1)]
    cands = [c for c in cands if c[0] < 0.0]  # survival > 0
    cands.sort()
    for neg_a, j, r in cands:
        lengths[r] = j
        num_tokens += 1
        tau -= neg_a
        theta = tau * sps_of(num_tokens)
        if theta > best.throughput:
            best = Schedule(list(lengths), tau, num_tokens, theta)
        elif early_stop:
            break
    return best


# ---------------------------------------------------------------------------------------------------------
# Calibration metrics and Sequential Temperature Scaling (STS).
# ---------------------------------------------------------------------------------------------------------


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _check_pairs(probs: Sequence[float], labels: Sequence[float]) -> None:
    if len(probs) != len(labels):
        raise ValueError(f"probs has {len(probs)} entries but labels has {len(labels)}")
    if not probs:
        raise ValueError("calibration metrics need at least one (prob, label) pair")


def expected_calibration_error(probs: Sequence[float], labels: Sequence[float], n_bins: int = 20) -> float:
    """ECE over `n_bins` equal-width bins on [0, 1]: sum_b (n_b / N) |mean p_b - mean y_b|."""
    _check_pairs(probs, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    psum = [0.0] * n_bins
    ysum = [0.0] * n_bins
    for p, y in zip(probs, labels):
        b = min(max(int(p * n_bins), 0), n_bins - 1)
        psum[b] += p
        ysum[b] += y
    # sum_b (n_b / N) |psum_b / n_b - ysum_b / n_b| = sum_b |psum_b - ysum_b| / N
    return sum(abs(ps - ys) for ps, ys in zip(psum, ysum)) / len(probs)


def auroc(probs: Sequence[float], labels: Sequence[float]) -> float:
    """Area under the ROC curve via the rank-sum statistic (tied scores get average ranks).

    Returns NaN when the labels hold only one class.
    """
    _check_pairs(probs, labels)
    order = sorted(range(len(probs)), key=lambda i: probs[i])
    ranks = [0.0] * len(probs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and probs[order[j + 1]] == probs[order[i]]:
            j += 1
        avg = (i + j) / 2.0 + 1.0
        for k in range(i, j + 1):
            ranks[order[k]] = avg
        i = j + 1
    n_pos = sum(1 for y in labels if y)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = sum(rk for rk, y in zip(ranks, labels) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def brier(probs: Sequence[float], labels: Sequence[float]) -> float:
    """Mean squared error between probabilities and 0/1 labels."""
    _check_pairs(probs, labels)
    return sum((p - y) ** 2 for p, y in zip(probs, labels)) / len(probs)


def default_sts_grid(lo: float = 0.05, hi: float = 20.0, n: int = 200) -> list[float]:
    """`n` log-spaced temperatures in [lo, hi]."""
    step = math.log(hi / lo) / (n - 1)
    return [lo * math.exp(i * step) for i in range(n)]


def _check_sts_data(logits: Sequence[Sequence[float]], accepted_prefix: Sequence[int]) -> int:
    if not logits:
        raise ValueError("STS needs at least one row of confidence logits")
    if len(logits) != len(accepted_prefix):
        raise ValueError(f"logits has {len(logits)} rows but accepted_prefix has {len(accepted_prefix)}")
    k = len(logits[0])
    for i, (row, n) in enumerate(zip(logits, accepted_prefix)):
        if len(row) != k:
            raise ValueError(f"logits row {i} has {len(row)} positions, row 0 has {k}; STS needs fully verified blocks")
        if not 0 <= n <= k:
            raise ValueError(f"accepted_prefix[{i}] = {n} is outside [0, {k}]")
    return k


def fit_sts(
    logits: Sequence[Sequence[float]],
    accepted_prefix: Sequence[int],
    *,
    grid: Sequence[float] | None = None,
    n_bins: int = 20,
) -> list[float]:
    """Sequential Temperature Scaling: one temperature per draft position.

    logits: N rows x K raw confidence logits from fully verified blocks; accepted_prefix: accepted drafts per
    row (0..K). For k = 1..K, with T_1..T_{k-1} fixed, T_k is the grid value minimising the ECE of
    a_k = prod_{i<=k} sigmoid(z_i / T_i) against 1[accepted_prefix >= k] (ties: the T closest to 1).
    """
    k_max = _check_sts_data(logits, accepted_prefix)
    temps_grid = list(default_sts_grid() if grid is None else grid)
    if not temps_grid or any(not (t > 0 and math.isfinite(t)) for t in temps_grid):
        raise ValueError(f"STS grid must be non-empty positive finite temperatures, got {temps_grid[:5]}...")
    prefix = [1.0] * len(logits)  # prod_{i<k} sigmoid(z_i / T_i)
    temps: list[float] = []
    for k in range(k_max):
        labels = [1.0 if n >= k + 1 else 0.0 for n in accepted_prefix]
        z = [row[k] for row in logits]
        best_key, best_t = (math.inf, math.inf), 1.0
        for t in temps_grid:
            probs = [p * _sigmoid(zi / t) for p, zi in zip(prefix, z)]
            key = (expected_calibration_error(probs, labels, n_bins), abs(math.log(t)))
            if key < best_key:
                best_key, best_t = key, t
        temps.append(best_t)
        prefix = [p * _sigmoid(zi / best_t) for p, zi in zip(prefix, z)]
    return temps


def calibrate(logits_row: Sequence[float], temperatures: Sequence[float]) -> list[float]:
    """Calibrated conditional confidences sigmoid(z_k / T_k) for one block (may be shorter than the temps)."""
    if len(logits_row) > len(temperatures):
        raise ValueError(
            f"{len(logits_row)} confidence logits but only {len(temperatures)} STS temperatures; refit STS "
            "for this block size"
        )
    return [_sigmoid(z / t) for z, t in zip(logits_row, temperatures)]


def calibration_report(
    logits: Sequence[Sequence[float]],
    accepted_prefix: Sequence[int],
    temperatures: Sequence[float],
    *,
    n_bins: int = 20,
) -> list[dict[str, float]]:
    """Per-position ECE / AUROC / Brier of the cumulative survival, raw (T=1) versus calibrated."""
    k_max = _check_sts_data(logits, accepted_prefix)
    if len(temperatures) < k_max:
        raise ValueError(f"{len(temperatures)} temperatures for {k_max} positions")
    raw = [survival([_sigmoid(z) for z in row]) for row in logits]
    cal = [survival(calibrate(row, temperatures)) for row in logits]
    report = []
    for k in range(k_max):
        labels = [1.0 if n >= k + 1 else 0.0 for n in accepted_prefix]
        before = [a[k] for a in raw]
        after = [a[k] for a in cal]
        report.append(
            {
                "position": k + 1,
                "temperature": float(temperatures[k]),
                "n": len(labels),
                "accept_rate": sum(labels) / len(labels),
                "ece_before": expected_calibration_error(before, labels, n_bins),
                "ece_after": expected_calibration_error(after, labels, n_bins),
                "auroc_before": auroc(before, labels),
                "auroc_after": auroc(after, labels),
                "brier_before": brier(before, labels),
                "brier_after": brier(after, labels),
            }
        )
    return report


def save_sts(path: str | Path, temperatures: Sequence[float], extra: Mapping[str, Any] | None = None) -> None:
    """Write `{"sts_temperatures": [...], **extra}` (the TRT-LLM key; load_sts also reads SGLang's key)."""
    data = dict(extra or {})
    data["sts_temperatures"] = [float(t) for t in temperatures]
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_sts(path: str | Path) -> list[float]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: STS file must hold a JSON object")
    key = "sts_temperatures" if "sts_temperatures" in data else "temperatures"
    if key not in data:
        raise ValueError(f"{path}: STS file needs key 'sts_temperatures' (or 'temperatures'); has {sorted(data)}")
    temps = data[key]
    if (
        not isinstance(temps, list)
        or not temps
        or any(isinstance(t, bool) or not isinstance(t, int | float) or not (t > 0 and math.isfinite(t)) for t in temps)
    ):
        raise ValueError(f"{path}: key '{key}' must be a non-empty list of positive finite floats, got {temps!r}")
    return [float(t) for t in temps]
