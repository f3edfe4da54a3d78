"""CPU thread defaults chosen by measurement, cached per machine and model shape.

Decode on CPU is a chain of small ops; whether a second intra-op thread helps depends on the machine (cores,
how busy they are) and on the model's matrix sizes: on a 2-core shared machine one thread beats two by 25-40 %
for the bundled pair, while a 7B model wants every core. So the default is measured, not a constant:

1. a ``--threads N`` flag (``set_threads``), else ``DSPARK_NUM_THREADS`` (an integer), wins;
2. else a cached choice for (CPU model, usable cores, torch version, model shape and dtype) from
   ``$DSPARK_CACHE/threads.json`` (``~/.cache/dspark`` by default, the cache GGUF exports use);
3. else a calibration (seconds on an idle machine, a few minutes on a busy one; one line on stderr says what it is
   doing and how to skip it): a few real engine decode steps on the loaded model (see
   ``dspark.llm.build_engines``), timed round-robin at each candidate count (1, 2, 4, ... up to the usable
   cores), 7 times each. The best time of each count is compared (the machine's capability; medians on a busy
   machine measure the neighbours), and a larger count must win by MARGIN: under contention every extra
   OpenMP thread is a barrier partner that may be descheduled (measured here under load: 1 thread 58-1275 ms,
   2 threads 918-15703 ms for the same steps). The choice is cached.

``set_threads`` (``--threads`` / ``--num-threads`` flags) overrides all of this.

Inter-op threads stay at torch's default (eager inference runs no inter-op work). The OpenMP wait policy is
PASSIVE (set by ``import dspark`` before torch loads): spinning waiters stall each other on a shared machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ENV = "DSPARK_NUM_THREADS"
MARGIN = 0.10  # a larger thread count must be at least 10 % faster than the best smaller one
_source = "torch default"
_explicit = False  # set_threads was called (a CLI flag): calibration leaves the choice alone


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown-cpu"


def candidates(cores: int) -> list[int]:
    """1, 2, 4, ... below the usable cores, and the cores themselves."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return [*out, cores]


def calibrate(workload: Callable[[], object], counts: list[int], repeats: int = 7) -> dict[int, float]:
    """Best seconds of `workload` per thread count over `repeats` round-robin timings (bursts hit every count
    alike; the minimum is what the machine can do, the rest is other processes)."""
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        for n in counts:  # warm-up: first-call costs off the clock
            torch.set_num_threads(n)
            workload()
        for _ in range(repeats):
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                workload()
                times[n].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {n: min(ts) for n, ts in times.items()}


def pick(best: dict[int, float], margin: float = MARGIN) -> int:
    """The smallest count unless a larger one is faster than every smaller one by `margin`."""
    chosen = min(best)
    for n in sorted(best):
        if best[n] < best[chosen] * (1.0 - margin):
            chosen = n
    return chosen


def _cache_path() -> Path:
    from dspark.paths import cache_root  # $DSPARK_CACHE, default ~/.cache/dspark

    return cache_root() / "threads.json"


def env_threads() -> int | None:
    """``DSPARK_NUM_THREADS`` as a thread count; None when unset; a clear error when it is not a positive integer."""
    env = os.environ.get(ENV, "").strip()
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={env!r}: expected a positive integer thread count, or unset it")
    return n


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, cache: dict) -> bool:
    """Replace a per-machine cache file atomically; False (and nothing written) where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def model_key(name: str, dtype: str, num_params: int) -> str:
    """The model part of a thread choice's key (every command that runs a model computes it the same way)."""
    return f"{name}|{dtype}|{num_params} params"


def known_threads(model_key: str) -> tuple[int, str] | None:
    """(threads, where the choice came from) without measuring: the environment, a single core, or an earlier
    calibration for this machine and model; None when only a calibration would tell."""
    env = env_threads()
    if env is not None:
        return env, f"${ENV}"
    cores = usable_cores()
    if cores == 1:  # nothing to choose between
        return 1, "the one usable core"
    path = _cache_path()
    entry = read_cache(path).get(_key(cores, model_key))
    return (int(entry["threads"]), f"calibrated earlier ({path})") if entry else None


def apply_known_threads(model_key: str) -> None:
    """Use the choice ``known_threads`` finds, unless one was made explicitly (a command that runs no engine steps,
    such as ``profile``, reports the same count ``generate`` and ``bench`` run with)."""
    global _source
    known = None if _explicit else known_threads(model_key)
    if known is not None:
        torch.set_num_threads(known[0])
        _source = known[1]


def _key(cores: int, model_key: str) -> str:
    return f"{cpu_model()}|{cores} cores|torch {torch.__version__}|{model_key}"


def choose_threads(model_key: str, workload: Callable[[], object]) -> int:
    """Set and return torch's intra-op thread count for this machine and model (see the module docstring)."""
    global _source
    known = known_threads(model_key)
    if known is not None:
        torch.set_num_threads(known[0])
        _source = known[1]
        return known[0]
    cores = usable_cores()
    key = _key(cores, model_key)
    path = _cache_path()
    cache = read_cache(path)
    print(
        f"dspark: timing decode steps at {', '.join(map(str, candidates(cores)))} CPU threads to pick the "
        f"fastest for this machine and model (once; kept in {path}); skip it with --threads N or {ENV}=N",
        file=sys.stderr,
        flush=True,
    )
    best = calibrate(workload, candidates(cores))
    n = pick(best)
    cache[key] = {"threads": n, "best_ms": {str(c): round(s * 1e3, 3) for c, s in best.items()}}
    write_cache(path, cache)  # a read-only home: calibrate again next time
    _source = "calibrated now (best of 7: " + ", ".join(f"{c}: {s * 1e3:.1f} ms" for c, s in best.items()) + ")"
    torch.set_num_threads(n)
    return n


def describe_threads() -> str:
    """One line for bench/profile headers."""
    return (
        f"threads: intra-op {torch.get_num_threads()} ({_source}), inter-op {torch.get_num_interop_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, usable cores {usable_cores()}"
    )


def set_threads(n: int, source: str) -> None:
    """An explicit choice (a CLI flag): set it and say where it came from in `describe_threads`."""
    global _source, _explicit
    torch.set_num_threads(n)
    _source, _explicit = source, True


def is_explicit() -> bool:
    return _explicit
