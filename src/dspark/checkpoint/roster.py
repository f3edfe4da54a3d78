"""Tensor rosters (expected names, shapes, dtypes) and strict, all-or-nothing checkpoint loading.

A roster is read off a module, typically one built on the meta device so that even a multi-billion-parameter
architecture costs no memory. Comparing it with a checkpoint's headers reports every missing, unexpected,
wrong-shape and wrong-dtype tensor together, before a single weight is copied: nothing is ever half-loaded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

import torch
from torch import nn

from dspark.checkpoint.io import (
    CheckpointError,
    Problem,
    TensorInfo,
    _read_tensors,
    list_checkpoint_tensors,
    safetensors_dtype,
)

__all__ = [
    "FLOAT_DTYPES",
    "RosterReport",
    "TensorSpec",
    "compare_roster",
    "format_roster",
    "load_module_strict",
    "module_roster",
    "num_params",
    "raise_for_report",
    "report_problems",
    "roster_json",
]

FLOAT_DTYPES: tuple[str, ...] = ("F32", "F16", "BF16")  # accepted for a spec with dtype=None

Rename = Callable[[str], str | None]


@dataclass(frozen=True)
class TensorSpec:
    """Expected tensor: its shape, and its dtype (None = any of bf16/fp16/fp32; cast on load)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


def _module_tensors(module: nn.Module, rename: Rename | None) -> dict[str, tuple[str, torch.Tensor]]:
    """file name -> (module name, tensor) for parameters and persistent buffers (shared ones once)."""
    seen: set[int] = set()
    pairs: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters():
        seen.add(id(p))
        pairs.append((name, p))
    for mod_name, mod in module.named_modules():
        for buf_name, b in mod._buffers.items():
            if b is None or buf_name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            pairs.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, b))
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, t in pairs:
        file_name = rename(name) if rename is not None else name
        if file_name is None:
            continue
        if file_name in out:
            raise ValueError(
                f"rename maps both {out[file_name][0]!r} and {name!r} to {file_name!r}; "
                "each checkpoint name must belong to one module tensor"
            )
        out[file_name] = (name, t)
    return out


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(shape=tuple(t.shape), dtype=None if t.is_floating_point() else t.dtype)


def module_roster(module: nn.Module, *, rename: Rename | None = None) -> dict[str, TensorSpec]:
    """Expected checkpoint tensors of ``module``: parameters + persistent buffers, keyed by checkpoint name.

    ``rename`` maps a module name to its checkpoint name (None drops the tensor). Floating tensors get
    ``dtype=None`` (any float dtype loads, cast to the module's); other tensors must match exactly. Only reads
    shapes, so a module built under ``with torch.device("meta"):`` allocates nothing.
    """
    return {name: _spec(t) for name, (_, t) in _module_tensors(module, rename).items()}


def num_params(roster: Mapping[str, TensorSpec]) -> int:
    """Total number of elements over the roster."""
    return sum(math.prod(s.shape) for s in roster.values())


def roster_json(roster: Mapping[str, TensorSpec]) -> dict[str, object]:
    """``{"tensors": {name: [dims]}, "num_params": int}`` (the ``dspark roster --json`` schema)."""
    return {"tensors": {name: list(s.shape) for name, s in roster.items()}, "num_params": num_params(roster)}


def _dtype_label(dtype: torch.dtype | None) -> str:
    return "float" if dtype is None else str(dtype).removeprefix("torch.")


def format_roster(roster: Mapping[str, TensorSpec]) -> str:
    """An aligned name/shape/dtype table with a final total line (thousands separators)."""
    rows = [("name", "shape", "dtype")]
    rows += [(name, str(list(s.shape)), _dtype_label(s.dtype)) for name, s in roster.items()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    n = len(roster)
    lines.append(f"total: {num_params(roster):,} parameters in {n:,} tensor{'s' if n != 1 else ''}")
    return "\n".join(lines)


@dataclass(frozen=True)
class RosterReport:
    """Differences between an expected roster and a checkpoint's tensors (names sorted)."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    wrong_shape: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()  # (name, expected, found)
    wrong_dtype: tuple[tuple[str, str], ...] = ()  # (name, found safetensors dtype)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape or self.wrong_dtype)


def _dtype_ok(spec: TensorSpec, found: str) -> bool:
    if spec.dtype is None:
        return found in FLOAT_DTYPES
    try:
        return found == safetensors_dtype(spec.dtype)
    except ValueError:
        return False


def compare_roster(
    expected: Mapping[str, TensorSpec],
    found: Mapping[str, TensorInfo],
    *,
    ignore_unexpected: Iterable[str] = (),
) -> RosterReport:
    """Compare expected specs with a checkpoint's tensors. ``ignore_unexpected`` holds fnmatch globs of extra
    checkpoint tensors that are fine to leave unused (e.g. ``"lm_head.*"``)."""
    globs = tuple(ignore_unexpected)
    missing = tuple(sorted(n for n in expected if n not in found))
    unexpected = tuple(sorted(n for n in found if n not in expected and not any(fnmatchcase(n, g) for g in globs)))
    wrong_shape = []
    wrong_dtype = []
    for name in sorted(n for n in expected if n in found):
        spec, info = expected[name], found[name]
        if tuple(spec.shape) != tuple(info.shape):
            wrong_shape.append((name, tuple(spec.shape), tuple(info.shape)))
        if not _dtype_ok(spec, info.dtype):
            wrong_dtype.append((name, info.dtype))
    return RosterReport(missing, unexpected, tuple(wrong_shape), tuple(wrong_dtype))


def report_problems(report: RosterReport, *, source: str) -> list[Problem]:
    """The report as a list of problems (message + fix), in the order missing, unexpected, shape, dtype."""
    problems = [
        Problem(
            f"missing tensor {n!r}: the model needs it but {source} does not have it",
            "use the checkpoint made for this model/config, or map names with `rename` if it is stored "
            "under another name",
        )
        for n in report.missing
    ]
    problems += [
        Problem(
            f"unexpected tensor {n!r} in {source}: no tensor of the model has this name",
            "use the checkpoint made for this model/config, map names with `rename`, or pass it in "
            "ignore_unexpected if it is meant to be unused",
        )
        for n in report.unexpected
    ]
    problems += [
        Problem(
            f"wrong shape for {n!r} in {source}: expected {list(exp)}, found {list(got)}",
            "the checkpoint was made for a different config; use the config.json that matches the weights",
        )
        for n, exp, got in report.wrong_shape
    ]
    problems += [
        Problem(
            f"wrong dtype for {n!r} in {source}: found {got}",
            f"store floating weights as {', '.join(FLOAT_DTYPES)} (non-float buffers in their own dtype); "
            "dequantize/convert the checkpoint",
        )
        for n, got in report.wrong_dtype
    ]
    return problems


def raise_for_report(report: RosterReport, *, source: str) -> None:
    """Raise one CheckpointError listing every problem in ``report`` (no-op when ``report.ok``)."""
    if report.ok:
        return
    problems = report_problems(report, source=source)
    counts = [
        f"{len(report.missing)} missing",
        f"{len(report.unexpected)} unexpected",
        f"{len(report.wrong_shape)} wrong shape",
        f"{len(report.wrong_dtype)} wrong dtype",
    ]
    raise CheckpointError(problems, header=f"checkpoint {source} does not match the model ({', '.join(counts)}):")


def load_module_strict(
    module: nn.Module,
    path: str | os.PathLike[str],
    *,
    rename: Rename | None = None,
    ignore_unexpected: Iterable[str] = (),
    extra_ok: Iterable[str] = (),
    found: Mapping[str, TensorInfo] | None = None,
) -> None:
    """Load a checkpoint into ``module`` all-or-nothing.

    Builds the module's roster, validates the checkpoint files, compares, and raises one CheckpointError
    listing every problem before touching the module. Then reads all tensors and copies them in under
    ``torch.no_grad()``, cast to each tensor's dtype and device. ``ignore_unexpected``: fnmatch globs of
    checkpoint tensors the module does not use. ``extra_ok``: fnmatch globs (checkpoint names) of module
    tensors that may be absent from the checkpoint; they keep their current values (e.g. an embedding
    borrowed from the target). ``found``: the checkpoint's tensor table when the caller has read it already
    (``ModelSpec.weights``); otherwise the headers are read here.
    """
    entries = _module_tensors(module, rename)
    meta = [mod_name for mod_name, t in entries.values() if t.is_meta]
    if meta:
        raise ValueError(
            f"module tensors are on the meta device (e.g. {meta[0]!r}); materialize the module first, "
            "e.g. module.to_empty(device='cpu')"
        )
    expected = {name: _spec(t) for name, (_, t) in entries.items()}
    found = list_checkpoint_tensors(path) if found is None else found
    report = compare_roster(expected, found, ignore_unexpected=ignore_unexpected)
    ok_globs = tuple(extra_ok)
    report = replace(report, missing=tuple(n for n in report.missing if not any(fnmatchcase(n, g) for g in ok_globs)))
    raise_for_report(report, source=str(path))

    names = [n for n in expected if n in found]
    tensors = _read_tensors(found, names, dtype=None)
    with torch.no_grad():
        for name in names:
            _, target = entries[name]
            target.copy_(tensors[name].to(device=target.device, dtype=target.dtype))
