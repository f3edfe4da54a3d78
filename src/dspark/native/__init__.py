"""dspark's native CPU kernels (every ``.cpp`` of this folder: ``kernels.cpp``, ``elementwise.cpp``,
``attention.cpp``, ``layer.cpp``, ...), compiled on first use for the running machine.

The source is built with the machine's C++ compiler through ``torch.utils.cpp_extension`` (``-O3 -march=native
-ffp-contract=off``, OpenMP through torch's own runtime, so ``torch.set_num_threads`` applies) into
``$DSPARK_CACHE/native/<key>/`` (default ``~/.cache/dspark``). The key hashes the source, the compile flags, the
CPU's model name and feature flags, torch's and Python's versions: a binary built for one CPU is never loaded on
another, and a later run loads the cached library without the compiler (a run with its own ``$DSPARK_CACHE``
also finds the default cache's build). A build takes ~25 s on one core; ``python -m dspark.native`` (run by
``scripts/setup.sh``) builds ahead of time.

``DSPARK_NATIVE=0`` turns the kernels off. When the compiler fails (none installed, no headers), one line is
logged and every caller uses its pure-PyTorch path, which stays the reference and the fallback.
``DSPARK_NATIVE_MARCH=haswell`` (or ``x86-64``) builds for a lesser CPU: the AVX2 (or scalar) paths, for tests.

    ops = native.ops()      # torch.ops.dspark_native (quant_linear, paged_attention, ...), or None
    native.status()         # "exact=avx512 int8=avx512-vnni+q8flip (<build dir>)", or why there are none
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ENV",
    "MARCH_ENV",
    "SOURCE",
    "SOURCES",
    "available",
    "build",
    "build_dir",
    "cpu_key",
    "disable",
    "enabled",
    "inference_ops",
    "ops",
    "reset",
    "status",
]

ENV = "DSPARK_NATIVE"  # "0" turns the native kernels off
MARCH_ENV = "DSPARK_NATIVE_MARCH"  # another -march (haswell: the AVX2 path, x86-64: scalar), to test the other paths
NAME = "dspark_native"  # the library name and the torch.ops namespace (TORCH_LIBRARY in kernels.cpp)
SOURCE = Path(__file__).resolve().parent / "kernels.cpp"
# one library: every .cpp of this folder (kernels.cpp defines the op namespace, the others add fragments to it)
SOURCES = (SOURCE, *sorted(p for p in SOURCE.parent.glob("*.cpp") if p != SOURCE))
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))  # hashed into the build key with the sources
LDFLAGS = ("-fopenmp",)


def cflags() -> tuple[str, ...]:
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    # no fused multiply-adds beyond the explicit ones: the exact path rounds as the reference dequantizer does
    return ("-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-DNDEBUG")


logger = logging.getLogger("dspark.native")
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops": the namespace once loaded; "error": why not; "dir": the build directory


def enabled() -> bool:
    """False when ``DSPARK_NATIVE=0`` or when this process runs its models off the CPU (``disable``)."""
    if "off" in _state:
        return False
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def disable(reason: str) -> None:
    """Turn the kernels off for the rest of this process (they are CPU-only: a process whose models live on an
    accelerator runs the PyTorch reference path); ``status()`` then says why."""
    _state["off"] = reason


def cpu_key() -> str:
    """The CPU model and its feature flags (what -march=native compiles for)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key == "model name" and not model.startswith("model:"):
                model = "model:" + line.split(":", 1)[1].strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def build_key() -> str:
    """Hash of the source, the flags, the CPU, torch's and Python's versions: one build per combination."""
    h = hashlib.sha256()
    code = (f.read_bytes() for f in (*SOURCES, *HEADERS))
    for part in (*code, " ".join(cflags() + LDFLAGS).encode(), cpu_key().encode()):
        h.update(part)
        h.update(b"\0")
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{sys.platform}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Where this source is built for this CPU, torch and Python (see the module doc)."""
    from dspark.paths import cache_root

    return cache_root() / "native" / build_key()


def _built_library() -> Path | None:
    """An existing build for this key: under $DSPARK_CACHE, else under the default cache (a run with a private
    $DSPARK_CACHE, such as a test's, reuses the machine's build instead of compiling again)."""
    key = build_key()
    for root in dict.fromkeys((build_dir().parent, Path.home() / ".cache" / "dspark" / "native")):
        lib = _library_file(root / key)
        if lib.is_file():
            return lib
    return None


def _library_file(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile (or find already compiled) the kernels for this machine; the shared library's path. Raises on a
    compiler failure."""
    from torch.utils import cpp_extension

    found = _built_library()
    if found is not None:
        return found
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    directory = build_dir()
    lib = _library_file(directory)
    directory.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its compiler-ABI notices: our one line says enough
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(cflags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        quiet.setLevel(level)
    if not lib.is_file():
        raise RuntimeError(f"the build finished without {lib}")
    return lib


def _load() -> Any:
    lib = build()
    if not hasattr(torch.ops, NAME) or not hasattr(getattr(torch.ops, NAME), "quant_linear"):
        torch.ops.load_library(str(lib))  # cpp_extension.load already loaded it in the process that built it
    _state["dir"] = lib.parent
    return getattr(torch.ops, NAME)


def ops() -> Any:
    """``torch.ops.dspark_native`` (quant_linear, rms_norm, silu_mul, paged_attention, build_info), built on first
    call; None when ``DSPARK_NATIVE=0`` or when the build failed (logged once)."""
    if not enabled():
        return None
    if "ops" in _state or "error" in _state:
        return _state.get("ops")
    with _lock:
        if "ops" not in _state and "error" not in _state:
            try:
                _state["ops"] = _load()
            except Exception as e:  # noqa: BLE001 - any compiler/loader failure means: use the PyTorch path
                first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                first = first if len(first) <= 200 else first[:200] + "..."
                _state["error"] = f"{type(e).__name__}: {first}"
                logger.warning("dspark native kernels unavailable (%s); using the PyTorch fallback", _state["error"])
    return _state.get("ops")


def inference_ops() -> Any:
    """``ops()`` for the native layers of inference: None in grad mode and under CPU autocast, whose per-op dtype
    choices only the modules follow (training, and evaluation inside the training loop, keep the modules)."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    return ops()


def available() -> bool:
    return ops() is not None


def status() -> str:
    """One line saying which kernels run: the compiled path and the build directory, or why there are none."""
    if "off" in _state:
        return f"native kernels off ({_state['off']})"
    if not enabled():
        return f"native kernels off ({ENV}=0)"
    o = ops()
    if o is None:
        return f"native kernels unavailable ({_state.get('error')})"
    return f"{o.build_info()} ({_state.get('dir')})"


def reset() -> None:
    """Forget a recorded build failure, so the next ``ops()`` tries again (tests; the library stays loaded)."""
    _state.pop("error", None)
