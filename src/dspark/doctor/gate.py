"""The doctor's load-time checks: ``generate``, ``serve``, ``bench``, ``LLM`` and ``build_engines`` refuse a model
pair that ``dspark check`` rejects, with its message, instead of serving it silently.

Before loading: every header/config check of ``dspark check`` (``LOAD_CHECKS``: YaRN / rope_theta identity, the
target's tokenizer.json, relabelled dtypes, missing tensors, LFS pointers, ...). After loading: one pass over the
weights already in memory for NaN / Inf (``check_finite``), instead of the doctor's second read from disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from dspark.config import ConfigError
from dspark.doctor.checks import LOAD_CHECKS, CheckProblem, run_checks


class LoadRefused(ConfigError):
    """The doctor refuses to load a model: the message lists every problem with its fix."""

    def __init__(self, what: str, problems: Sequence[CheckProblem]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - [{p.check}] {p.message}; fix: {p.fix}" for p in self.problems)
        super().__init__(f"refusing to load {what}: `dspark check` finds {len(self.problems)} problem(s):\n{lines}")


def check_before_load(target_dir: Path, draft_dirs: Iterable[Path | None]) -> None:
    """Run the doctor's load checks on the target alone and with every draft; raise LoadRefused on a problem.
    Inside the caller's ``one_read_per_model`` block the doctor and the loader read each model once."""
    if not target_dir.is_dir():
        return  # not a directory (e.g. a bare file): the loader names what it needs
    for draft in dict.fromkeys([None, *draft_dirs]):
        report = run_checks(draft, target_dir, only=LOAD_CHECKS)
        if not report.ok:
            what = f"target {target_dir}" + (f" with draft {draft}" if draft is not None else "")
            raise LoadRefused(what, report.problems)


def check_finite(module: nn.Module, where: str) -> None:
    """One pass over a loaded module's floating weights: NaN or Inf anywhere refuses the model."""
    bad = []
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{name} ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf)")
    if bad:
        raise LoadRefused(
            where,
            [
                CheckProblem(
                    "finite-weights",
                    f"{len(bad)} weight tensor(s) hold NaN/Inf values: {', '.join(bad[:5])}",
                    "the checkpoint is corrupt or training diverged: re-export it from a good training checkpoint",
                )
            ],
        )
