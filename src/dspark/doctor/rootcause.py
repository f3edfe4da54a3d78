"""The root cause of a checkpoint that disagrees with its config.json: the one integer key that, set to a value the
weights imply, makes every tensor name and shape agree (``hidden_size`` 40 where the weights were made with 32).

The candidates come from the disagreement itself: for each dimension that differs (expected e, found g) and each
integer key in effect (value c), the value that key would need is g when e is c, c·g/e when e is a multiple of c
(heads × head_dim) and c + g − e when e is c plus other terms (kv_lora_rank + rope dim); a layer count comes from
the layer indices of the tensor names. The most frequent candidates are tried first, each by rebuilding the roster
on the meta device with that one key changed. ``check_roster`` and ``check_target_roster`` then report the key and
both values once, the per-tensor lines folded into a count and the first of them; when no single key explains the
shapes, each tensor keeps its own line."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.checkpoint.io import Problem
from dspark.checkpoint.roster import RosterReport, report_problems

MAX_TRIES = 16  # candidate (key, value) pairs tried, most likely first; each rebuilds a roster on the meta device
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# the roster comparison with one config key set to a value; None when the config is then invalid
Retry = Callable[[str, int], RosterReport | None]


@dataclass(frozen=True)
class RootCause:
    """config.json's ``key`` is ``value`` (``is_default``: the key is not set, so its default applies), while the
    weights were made with ``weights_value``."""

    key: str
    value: int
    weights_value: int
    is_default: bool


def config_ints(raw: Mapping[str, Any], parsed: Any, keys: Iterable[str]) -> dict[str, int]:
    """The integer values in effect of the config keys ``keys``: as config.json sets them, else the parsed config's
    attribute of that name (its default). Token ids are left out: they never size a tensor."""
    out = {}
    for key in keys:
        value = raw.get(key, getattr(parsed, key, None))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and not key.endswith("_token_id"):
            out[key] = value
    return out


def find_root_cause(
    values: Mapping[str, int], raw: Mapping[str, Any], report: RosterReport, found: Collection[str], retry: Retry
) -> RootCause | None:
    """The single key of ``values`` whose change makes the names and shapes of ``report`` agree, or None."""
    if not (report.missing or report.unexpected or report.wrong_shape):
        return None
    for key, value in _candidates(values, report, found)[:MAX_TRIES]:
        fixed = retry(key, value)
        if fixed is not None and not (fixed.missing or fixed.unexpected or fixed.wrong_shape):
            return RootCause(key, values[key], value, key not in raw)
    return None


def _candidates(values: Mapping[str, int], report: RosterReport, found: Collection[str]) -> list[tuple[str, int]]:
    """(key, value) pairs, those that explain the most differing dimensions first (a key equal to the expected
    dimension counts twice: the plainest explanation)."""
    score: Counter[tuple[str, int]] = Counter()
    for _, want, got in report.wrong_shape:
        for e, g in zip(want, got) if len(want) == len(got) else ():
            if e == g:
                continue
            for key, c in values.items():
                for v in _implied(c, e, g):
                    score[key, v] += 2 if c == e else 1
    layers = {int(m.group(1)) for n in found if (m := _LAYER.search(n))}
    if (report.missing or report.unexpected) and layers:
        score["num_hidden_layers", max(layers) + 1] += 1
    return [(k, v) for (k, v), _ in score.most_common() if k in values and v > 0 and v != values[k]]


def _implied(c: int, e: int, g: int) -> set[int]:
    """Values of a key now c that turn an expected dimension e into the found g."""
    out = {c + g - e} if c <= e else set()  # e = c + other terms (e = c: g itself)
    if e % c == 0 and g % (e // c) == 0:  # e = c × other factors
        out.add(g // (e // c))
    return out


def cause_problems(cause: RootCause, report: RosterReport, config_file: Path, source: str) -> list[Problem]:
    """One problem naming the key and both values, the tensors that disagree folded under it; wrong dtypes (which
    no key explains) keep their own lines."""
    n = len(report.missing) + len(report.unexpected) + len(report.wrong_shape)
    default = " (not set in config.json: its default)" if cause.is_default else ""
    message = (
        f"{config_file}: `{cause.key}` {cause.value}{default} does not match the weights ({cause.weights_value})\n"
        f"{n} tensor{'s' if n != 1 else ''} of {source} disagree{'' if n != 1 else 's'} with it, first: "
        f"{_first(report, cause)}"
    )
    fix = (
        f'set "{cause.key}": {cause.weights_value} in {config_file} (the value the weights were made with), '
        "or use the weights made for this config.json"
    )
    dtypes = RosterReport(wrong_dtype=report.wrong_dtype)
    return [Problem(message, fix), *report_problems(dtypes, source=source)]


def _first(report: RosterReport, cause: RootCause) -> str:
    """The plainest disagreeing tensor: one with the key's value itself as a dimension, else the first."""
    plain = [w for w in report.wrong_shape if (cause.value, cause.weights_value) in zip(w[1], w[2])]
    if plain or report.wrong_shape:
        name, want, got = (plain or report.wrong_shape)[0]
        return f"{name!r} expected {list(want)}, found {list(got)}"
    if report.missing:
        return f"{report.missing[0]!r} is missing"
    return f"{report.unexpected[0]!r} is not in the model"
