"""Where dspark keeps what it writes outside a model directory: ``$DSPARK_CACHE``, default ``~/.cache/dspark``.

Each user names its own subfolder under this root: ``gguf/`` (GGUF exports), ``native/`` (built kernels),
``tuning/`` (calibration and cost tables), ``runs/`` (resumable training runs), ``bench/`` (public prompt sets),
``threads.json`` and ``dtype.json`` (measured per-machine defaults).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")
