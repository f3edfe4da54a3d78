"""`dspark profile --breakdown`: where one decode step and one speculative round spend their time.

The engine runs real requests (held-out prompts, greedy, no EOS stop) until every request decodes; then each
method's steps are timed without the profiler (the wall figure) and again under ``torch.profiler`` with the
library's named scopes on (``dspark.profiling``). A scope's time is exclusive: the time of the scopes nested in
it is reported on their own rows. Generic scopes (``attn.core``, ``cache``, ``mlp``, ...) are reported under their
nearest phase scope (``target.forward``, ``draft.backbone``), so the drafter's attention is not the target's.
The profiler's own per-op cost inflates the profiled total; the shares, not the absolute figures, are the result.

Across scopes the table also splits the step by kernel kind (``kernel_times``): matrix products (GEMM/GEMV, the
weight-streaming floor at decode), attention kernels, and everything else (the small ops and their dispatch, which
is what fused native kernels would remove).
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
# the ops whose own time is matrix-product arithmetic (their callers, aten::linear / aten::matmul, only dispatch)
GEMM_OPS = frozenset(
    ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv")
)
ATTENTION_PREFIX = "aten::_scaled_dot_product"  # the flash / math kernels under scaled_dot_product_attention


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
    cpu_ms: float  # median process CPU time of an unprofiled step (robust to a busy machine)
    tokens_per_step: float
    profiled_ms: float  # mean profiled step
    scopes: dict[str, float]  # label -> exclusive ms per step
    ops: dict[str, float]  # label -> torch ops per step
    kernels: dict[str, float]  # "gemm" / "attention" -> self ms per step over all scopes (``kernel_times``)


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


def _scope_label(ev) -> str:
    ancestors, p = [], ev.cpu_parent
    while p is not None:
        if p.name.startswith(PREFIX):
            ancestors.append(p.name[len(PREFIX) :])
        p = p.cpu_parent
    return _label(ev.name[len(PREFIX) :], ancestors[::-1])


def exclusive_scope_times(events) -> dict[str, float]:
    """Profiler events → {label: exclusive µs} summed over all occurrences."""
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        if ev.name.startswith(PREFIX):
            inner = sum(c.cpu_time_total for c in _nearest_scoped(ev))
            totals[_scope_label(ev)] += ev.cpu_time_total - inner
    return dict(totals)


def scope_op_counts(events) -> dict[str, int]:
    """Profiler events → {label: torch ops dispatched directly in the scope (not inside another op)}: the host
    overhead in a number that does not depend on how busy the machine is."""
    counts: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.name.startswith(PREFIX):
            counts[_scope_label(ev)] += sum(1 for c in ev.cpu_children if not c.name.startswith(PREFIX))
    return dict(counts)


def kernel_times(events) -> dict[str, float]:
    """Self time (µs) of the matrix-product ops (``GEMM_OPS``) and of the attention kernels, over every scope."""
    out = {"gemm": 0.0, "attention": 0.0}
    for ev in events:
        if ev.name in GEMM_OPS:
            out["gemm"] += ev.self_cpu_time_total
        elif ev.name.startswith(ATTENTION_PREFIX):
            out["attention"] += ev.self_cpu_time_total
    return out


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
        walls, cpus = [], []
        for _ in range(cfg.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        per_step = (engine.metrics.generation_tokens - tokens0) / cfg.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof, recording():
            for _ in range(cfg.steps):
                with record_function(PREFIX + "step"):
                    engine.step()
    for rid in ids:
        engine.abort(rid)
    engine.step()  # drain the aborted outputs
    events = prof.events()
    scopes = {k: v / 1e3 / cfg.steps for k, v in exclusive_scope_times(events).items()}
    ops = {k: v / cfg.steps for k, v in scope_op_counts(events).items()}
    kernels = {k: v / 1e3 / cfg.steps for k, v in kernel_times(events).items()}
    return Breakdown(
        name,
        statistics.median(walls) * 1e3,
        (min(walls) * 1e3, max(walls) * 1e3),
        statistics.median(cpus) * 1e3,
        per_step,
        sum(scopes.values()),
        scopes,
        ops,
        kernels,
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
    """One table: a row per scope (exclusive ms per step, share of the profiled step, torch ops per step), one
    column triple per method; then the unprofiled wall and CPU time per step and per token."""
    labels = sorted({k for r in results for k in r.scopes}, key=_sort_key)
    head = "| scope (exclusive) | " + " | ".join(f"{r.name} ms | % | ops" for r in results) + " |"
    lines = [head, "|---" * (1 + 3 * len(results)) + "|"]
    for label in labels:
        shown = label if label != "step" else "step (unscoped Python)"
        cells = []
        for r in results:
            v, n = r.scopes.get(label, 0.0), r.ops.get(label, 0.0)
            cells.append(f"{v:.3f} | {100 * v / r.profiled_ms:.1f} | {n:.0f}" if r.profiled_ms > 0 else "– | – | –")
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")

    def share(r: Breakdown, ms: float) -> str:
        return f"{ms:.2f} | {100 * ms / r.profiled_ms:.1f} | " if r.profiled_ms > 0 else "– | – | "

    summary = (
        ("profiled step", lambda r: f"{r.profiled_ms:.2f} | 100 | {sum(r.ops.values()):.0f}"),
        ("matrix-product kernels (all scopes)", lambda r: share(r, r.kernels["gemm"])),
        ("attention kernels (all scopes)", lambda r: share(r, r.kernels["attention"])),
        ("everything else", lambda r: share(r, r.profiled_ms - r.kernels["gemm"] - r.kernels["attention"])),
        ("wall step, unprofiled (median)", lambda r: f"{r.wall_ms:.2f} | | "),
        ("wall step, min–max", lambda r: f"{r.wall_spread_ms[0]:.1f}–{r.wall_spread_ms[1]:.1f} | | "),
        ("CPU step, unprofiled (median)", lambda r: f"{r.cpu_ms:.2f} | | "),
        ("tokens per step", lambda r: f"{r.tokens_per_step:.2f} | | "),
        ("CPU ms per token", lambda r: f"{r.cpu_ms / max(r.tokens_per_step, 1e-9):.2f} | | "),
    )
    for title, cell in summary:
        lines.append(f"| **{title}** | " + " | ".join(cell(r) for r in results) + " |")
    return "\n".join(lines)


def cmd_breakdown(args, target_dir: Path, draft_dir: Path | None) -> int:
    """Entry of `dspark profile --breakdown` (args from bench/profile.py's parser, which resolves the dirs)."""
    from dspark.bench.datasets import HELDOUT, read_bench_prompts
    from dspark.llm import build_engines, engine_configs
    from dspark.threads import describe_threads

    cfg = BreakdownConfig(steps=args.steps, warmup=args.warmup, concurrency=args.concurrency)
    specs: list[dict | None] = [None]
    if draft_dir is not None:
        k = args.num_speculative_tokens
        specs.append(
            {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": k, "speculation_guard": False}
        )
    engines = build_engines(
        target_dir,
        specs,
        *engine_configs(dtype=args.dtype, quantization=args.quantization, max_num_seqs=cfg.concurrency),
    )
    tok = engines[0].tokenizer
    prompts = [tok.encode(p.text) for p in read_bench_prompts(str(HELDOUT), max(cfg.concurrency, 4), None)]
    names = ["ar"] + (["dspark"] if draft_dir is not None else [])
    print(
        f"breakdown: target {target_dir}"
        + (f" + drafter {draft_dir}" if draft_dir else "")
        + f", {engines[0].precision.describe()}, concurrency {cfg.concurrency}, {cfg.steps} steps, "
        f"{describe_threads()}"
    )
    results = [breakdown(n, e, prompts, cfg) for n, e in zip(names, engines)]
    print(format_breakdowns(results))
    return 0
