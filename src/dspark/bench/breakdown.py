"""`dspark profile --breakdown`: where one decode step and one speculative round spend their time.

The engine runs real requests (held-out prompts, greedy, no EOS stop) until every request decodes; then each
method's steps are timed without the profiler (the wall figure) and again under ``torch.profiler`` with the
library's named scopes on (``dspark.profiling``). A scope's time is exclusive: the time of the scopes nested in
it is reported on their own rows. Generic scopes (``attn.core``, ``cache``, ``mlp``, ...) are reported under their
nearest phase scope (``target.forward``, ``draft.backbone``), so the drafter's attention is not the target's.
The profiler's own per-op cost inflates the profiled total; the shares, not the absolute figures, are the result.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dspark.config import ConfigError
from dspark.engine.engine import Engine
from dspark.profiling import recording
from dspark.sampling_params import SamplingParams

PREFIX = "dspark::"
PHASES = ("step.", "target.", "draft.")


@dataclass(frozen=True)
class BreakdownConfig:
    steps: int = 16  # profiled (and separately timed) steps per method
    warmup: int = 3
    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0 or self.concurrency < 1:
            raise ConfigError(
                f"profile --breakdown: need --steps >= 1, --warmup >= 0, --concurrency >= 1; got {self.steps}, "
                f"{self.warmup}, {self.concurrency}"
            )


@dataclass(frozen=True)
class Breakdown:
    name: str
    wall_ms: float  # median unprofiled step
    wall_spread_ms: tuple[float, float]  # (min, max) unprofiled step
    tokens_per_step: float
    profiled_ms: float  # mean profiled step
    scopes: dict[str, float]  # label -> exclusive ms per step


def _label(name: str, ancestors: list[str]) -> str:
    if name.startswith(PHASES) or name == "step":
        return name
    phase = next((a for a in reversed(ancestors) if a.startswith(PHASES)), "step")
    return f"{phase}/{name}"


def _nearest_scoped(ev) -> list:
    """The dspark-scope events nested directly (possibly through unscoped ops) in ev."""
    out, stack = [], list(ev.cpu_children)
    while stack:
        child = stack.pop()
        if child.name.startswith(PREFIX):
            out.append(child)
        else:
            stack.extend(child.cpu_children)
    return out


def exclusive_scope_times(events) -> dict[str, float]:
    """Profiler events → {label: exclusive µs} summed over all occurrences."""
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        if not ev.name.startswith(PREFIX):
            continue
        ancestors, p = [], ev.cpu_parent
        while p is not None:
            if p.name.startswith(PREFIX):
                ancestors.append(p.name[len(PREFIX) :])
            p = p.cpu_parent
        ancestors.reverse()
        inner = sum(c.cpu_time_total for c in _nearest_scoped(ev))
        totals[_label(ev.name[len(PREFIX) :], ancestors)] += ev.cpu_time_total - inner
    return dict(totals)


def _start(engine: Engine, prompts: Sequence[Sequence[int]], cfg: BreakdownConfig) -> list[str]:
    """Admit `concurrency` requests and step until every one of them is decoding."""
    budget = (cfg.steps * 2 + cfg.warmup + 2) * (engine.K + 1) + 8
    params = SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True)
    reqs = [engine.add_request(list(prompts[i % len(prompts)]), params) for i in range(cfg.concurrency)]
    while any(r.in_prefill or not r.output_ids for r in reqs):
        engine.step()
    return [r.request_id for r in reqs]


def breakdown(name: str, engine: Engine, prompts: Sequence[Sequence[int]], cfg: BreakdownConfig) -> Breakdown:
    ids = _start(engine, prompts, cfg)
    with torch.inference_mode():
        for _ in range(cfg.warmup):
            engine.step()
        tokens0 = engine.metrics.generation_tokens
        walls = []
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        per_step = (engine.metrics.generation_tokens - tokens0) / cfg.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof, recording():
            for _ in range(cfg.steps):
                with record_function(PREFIX + "step"):
                    engine.step()
    for rid in ids:
        engine.abort(rid)
    engine.step()  # drain the aborted outputs
    scopes = {k: v / 1e3 / cfg.steps for k, v in exclusive_scope_times(prof.events()).items()}
    return Breakdown(
        name,
        statistics.median(walls) * 1e3,
        (min(walls) * 1e3, max(walls) * 1e3),
        per_step,
        sum(scopes.values()),
        scopes,
    )


ORDER = (
    "step.schedule",
    "step.metadata",
    "draft.context",
    "draft.backbone",
    "draft.markov",
    "draft.confidence",
    "target.forward",
    "step.accept",
    "step.commit",
    "step",
)


def _sort_key(label: str) -> tuple[int, str]:
    head = label.split("/")[0]
    return (ORDER.index(head) if head in ORDER else len(ORDER), label)


def format_breakdowns(results: Sequence[Breakdown]) -> str:
    """One table: a row per scope (exclusive ms per step and share of the profiled step), one column pair per method."""
    labels = sorted({k for r in results for k in r.scopes}, key=_sort_key)
    head = "| scope (exclusive) | " + " | ".join(f"{r.name} ms | {r.name} %" for r in results) + " |"
    lines = [head, "|---" * (1 + 2 * len(results)) + "|"]
    for label in labels:
        shown = label if label != "step" else "step (unscoped Python)"
        cells = []
        for r in results:
            v = r.scopes.get(label, 0.0)
            cells.append(f"{v:.3f} | {100 * v / r.profiled_ms:.1f}" if r.profiled_ms > 0 else "– | –")
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")
    lines.append("| **profiled step** | " + " | ".join(f"{r.profiled_ms:.2f} | 100" for r in results) + " |")
    lines.append(
        "| **wall step, unprofiled (median, min–max)** | "
        + " | ".join(f"{r.wall_ms:.2f} | {r.wall_spread_ms[0]:.1f}–{r.wall_spread_ms[1]:.1f}" for r in results)
        + " |"
    )
    lines.append("| tokens per step | " + " | ".join(f"{r.tokens_per_step:.2f} | " for r in results) + " |")
    lines.append(
        "| **wall ms per token** | "
        + " | ".join(f"{r.wall_ms / max(r.tokens_per_step, 1e-9):.2f} | " for r in results)
        + " |"
    )
    return "\n".join(lines)


def cmd_breakdown(args, target_dir: Path, draft_dir: Path | None) -> int:
    """Entry of `dspark profile --breakdown` (args from bench/profile.py's parser, which resolves the dirs)."""
    from dspark.bench.datasets import HELDOUT, read_bench_prompts
    from dspark.llm import build_engines
    from dspark.threads import describe_threads

    cfg = BreakdownConfig(steps=args.steps, warmup=args.warmup, concurrency=args.concurrency)
    specs: list[dict | None] = [None]
    if draft_dir is not None:
        k = args.num_speculative_tokens
        specs.append({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": k})
    engines = build_engines(target_dir, specs, dtype=args.dtype, max_num_seqs=cfg.concurrency)
    tok = engines[0].tokenizer
    prompts = [tok.encode(p.text) for p in read_bench_prompts(str(HELDOUT), max(cfg.concurrency, 4), None)]
    names = ["ar"] + (["dspark"] if draft_dir is not None else [])
    print(
        f"breakdown: target {target_dir}" + (f" + drafter {draft_dir}" if draft_dir else "") + f", {args.dtype}, "
        f"concurrency {cfg.concurrency}, {cfg.steps} steps, {describe_threads()}"
    )
    results = [breakdown(n, e, prompts, cfg) for n, e in zip(names, engines)]
    print(format_breakdowns(results))
    return 0
