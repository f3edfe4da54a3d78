"""Run ``dspark`` as a user does: ``python -m dspark.cli`` in a fresh process, in its own directory, with its own
caches (``DSPARK_CACHE``, an empty Hugging Face / ModelScope cache) and one CPU thread unless a test says otherwise
(``DSPARK_NUM_THREADS``: no per-machine thread calibration)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run(tmp_path: Path, *argv: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``dspark ARGV`` with cwd tmp_path; ``env`` adds variables (None removes one)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "MODELSCOPE_"))}
    full |= {
        "DSPARK_CACHE": str(tmp_path / "dspark-cache"),
        "HF_HOME": str(tmp_path / "hf"),
        "MODELSCOPE_CACHE": str(tmp_path / "modelscope"),
        "DSPARK_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run(
        [sys.executable, "-m", "dspark.cli", *argv],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
