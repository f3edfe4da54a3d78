"""Where a pair's measured tuning files live: the STS calibration (``dspark calibrate``) and the SPS cost table
(``dspark profile``) that adaptive verification reads.

They belong to a target + drafter pair on a machine, not to the installed package: ``calibrate`` and ``profile``
write them under ``$DSPARK_CACHE/tuning/<machine>/<pair>/``, and the engine looks there first, then next to the
drafter and the target (where the shipped models carry theirs). The machine key is the CPU model, the torch build
and its CPU capability (the cost table is a timing); the pair key hashes each model's resolved path and the size and
modification time of its config.json and weights (a stat, no read), so a retrained drafter gets files of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from dspark.paths import cache_root
from dspark.threads import cpu_model

STS_FILE = "sts_calibration.json"
SPS_FILE = "sps_profile.json"


def machine_key() -> str:
    return f"{cpu_model()}|torch {torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"


def _model_key(path: Path | None) -> str:
    if path is None:
        return "none"
    p = Path(path).resolve()
    files = (p / "config.json", p / "model.safetensors")
    return f"{p}|{[(f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]}"


def tuning_dir(draft_dir: Path | None, target_dir: Path | None) -> Path:
    """$DSPARK_CACHE/tuning/<machine>/<pair>/ (not created)."""
    machine = hashlib.sha256(machine_key().encode()).hexdigest()[:12]
    pair = hashlib.sha256(f"{_model_key(target_dir)}||{_model_key(draft_dir)}".encode()).hexdigest()[:12]
    name = f"{Path(target_dir).name if target_dir else 'none'}+{Path(draft_dir).name if draft_dir else 'none'}"
    return cache_root() / "tuning" / machine / f"{name}-{pair}"


def output_path(given: str | None, name: str, draft_dir: Path | None, target_dir: Path | None) -> Path:
    """Where ``calibrate`` / ``profile`` write: ``given``, else the pair's tuning dir on this machine (created)."""
    if given is not None:
        return Path(given)
    d = tuning_dir(draft_dir, target_dir)
    d.mkdir(parents=True, exist_ok=True)
    return d / name


def usage_line(given: str | None, key: str, path: Path) -> str:
    """What to do with a written file: nothing when it is where the engine looks, else the speculative config key."""
    if given is None:
        return "adaptive verification uses it for this pair on this machine from now on"
    return f'to use it: \'{{"enable_adaptive_verification": true, "{key}": "{path}"}}\''


def find(name: str, draft_dir: Path | None, target_dir: Path | None, beside: Sequence[Path | None]) -> Path | None:
    """``name`` in the pair's tuning dir on this machine, else in the first of ``beside`` holding it."""
    cached = tuning_dir(draft_dir, target_dir) / name
    if cached.is_file():
        return cached
    return next((Path(d) / name for d in beside if d is not None and (Path(d) / name).is_file()), None)
