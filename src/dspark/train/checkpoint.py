"""Checkpoint I/O both trainers share: where a run keeps its checkpoint, atomic writes, the version check on
load, and the error a resume with different settings raises. What goes into a checkpoint is each trainer's own
(``DraftTrainer.save``, ``TargetTrainer.save``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

EXPORT_DIR = "export"  # out_dir/export: the final model directory
TRAINING_LOG = "training_log.json"  # written into the export
CHECKPOINT_VERSION = 1


def checkpoint_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoint" / "last.pt"


def fresh_or_resume(out_dir: str | Path, resume: bool) -> Path:
    """The run's checkpoint path; FileExistsError when a fresh start would overwrite one."""
    ckpt = checkpoint_path(out_dir)
    if not resume and ckpt.exists():
        raise FileExistsError(f"{ckpt} exists; pass --resume to continue it, or choose a new --out-dir")
    return ckpt


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file in the same directory, fsync, then rename: never a half-written checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: Path, entries: dict[str, Any]) -> None:
    """One file holding the checkpoint version and ``entries``, written atomically."""
    atomic_torch_save({"version": CHECKPOINT_VERSION} | entries, path)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by ``write_checkpoint``; raises with the fix when it is missing or of another version."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to resume from; run without --resume to start fresh")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {blob.get('version')} != {CHECKPOINT_VERSION}")
    return blob


def check_same_settings(path: Path, saved: Mapping[str, Any], cfg: object, keys: Iterable[str], what: str) -> None:
    """Raise when a resumed run's config differs from the checkpoint's ``saved`` settings in any of ``keys``;
    ``what`` names the difference ("different settings")."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(cfg, k)!r}" for k in keys if saved.get(k) != getattr(cfg, k)
    ]
    if diffs:
        raise ValueError(
            f"{path}: the checkpoint was trained with {what} ({'; '.join(diffs)}); resume with the same settings "
            "or start a new --out-dir"
        )
