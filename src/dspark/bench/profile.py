"""`dspark profile`: measure SPS(B), engine verify steps per second versus the tokens in the verify batch.

Each measured step is the real engine path on a pre-filled paged cache: the drafter's block proposal (when a drafter
is profiled; its cost does not depend on B but shifts the trade-off Algorithm 1 makes) and one paged target forward
over `[anchor, d_1..d_{L-1}]` rows, for `bs` requests of `L` tokens each (B = bs * L). The result is a 2-D SpsTable
(rows: batch sizes, columns: B) that `enable_adaptive_verification` reads as `sps_profile.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.cli_common import add_model_arg, add_precision_args, add_threads_arg
from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.request import Request
from dspark.models.drafter import DSparkDrafter
from dspark.models.protocol import Target
from dspark.sampling_params import SamplingParams
from dspark.speculative.schedule import SpsTable


@dataclass(frozen=True)
class ProfileConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens_per_request: int = 8  # anchor + K drafts
    context_len: int = 256  # pre-filled tokens per request before the verify rows
    repeats: int = 5  # timed steps per point (the median is kept)
    warmup: int = 2
    monotone: bool = True  # fit steps/s non-increasing in B (isotonic) to remove timing noise
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"profile: --batch-sizes must be positive integers, got {list(self.batch_sizes)}")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ConfigError(f"profile: --batch-sizes must be strictly increasing, got {list(self.batch_sizes)}")
        if self.max_tokens_per_request < 1 or self.context_len < 1 or self.repeats < 1 or self.warmup < 0:
            raise ConfigError(
                "profile: need --max-tokens-per-request >= 1, --context-len >= 1, --repeats >= 1, warmup >= 0; got "
                f"{self.max_tokens_per_request}, {self.context_len}, {self.repeats}, {self.warmup}"
            )


@dataclass(frozen=True)
class ProfileResult:
    table: SpsTable  # what the scheduler reads (monotone-fitted unless ProfileConfig.monotone is False)
    measured: dict[int, list[tuple[int, float]]]  # batch size -> [(B, median step seconds)]


def non_increasing_fit(values: Sequence[float]) -> list[float]:
    """Least-squares non-increasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _time_once(step: Callable[[], object]) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - t0


def _prefilled_engine(
    target: Target, drafter: DSparkDrafter | None, cfg: ProfileConfig
) -> tuple[Engine, list[Request]]:
    """An engine whose cache holds `context_len` random tokens for max(batch_sizes) requests."""
    n, ctx, L = max(cfg.batch_sizes), cfg.context_len, cfg.max_tokens_per_request
    page = 16
    k = max(1, L - 1)
    spec = SpeculativeConfig("dspark", num_speculative_tokens=k, speculation_guard=False) if drafter else None
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    ecfg = EngineConfig(max_num_seqs=n, dtype=dtype, max_model_len=ctx + L + 1)
    engine = Engine(
        target, drafter, spec, ecfg, CacheConfig(page_size=page, num_pages=n * math.ceil((ctx + L + 1) / page))
    )
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = target.config.vocab_size
    reqs = []
    for i in range(n):
        ids = torch.randint(min(4, vocab - 1), vocab, (ctx + L,), generator=g).tolist()
        req = Request(f"profile-{i}", ids, SamplingParams(temperature=0.0, max_tokens=1), i)
        engine.blocks.ensure_capacity(req.request_id, ctx + L)
        reqs.append(req)
    for i in range(n):  # one request at a time keeps the prefill batch small
        engine.runner.target_forward([reqs[i]], [0], [reqs[i].prompt_ids[:ctx]], last_only=True)
        engine.blocks.set_length(reqs[i].request_id, ctx)
        reqs[i].num_computed = ctx
    return engine, reqs


def _verify_step(engine: Engine, reqs: list[Request], tokens_per_request: int) -> Callable[[], object]:
    ctx = reqs[0].num_computed
    rows = [r.prompt_ids[ctx : ctx + tokens_per_request] for r in reqs]  # [anchor, drafts...]
    starts = [ctx] * len(reqs)
    K = engine.K

    def step() -> None:
        if engine.drafter is not None:
            sampling = engine.runner.sampling_tensors(reqs, K + 1)
            engine.runner.propose_draft(reqs, sampling, probabilistic=False, use_markov=True, topk=None)
        engine.runner.target_forward(reqs, starts, rows, last_only=False)

    return step


def profile_sps(
    target: Target,
    drafter: DSparkDrafter | None = None,
    cfg: ProfileConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> ProfileResult:
    """Median engine step time for every (batch size bs, tokens per request L), L = 1..max_tokens_per_request,
    after `warmup` untimed passes; the points are timed round-robin `repeats` times."""
    cfg = cfg or ProfileConfig()
    with torch.inference_mode():
        engine, reqs = _prefilled_engine(target, drafter, cfg)
        shapes = [(bs, L) for bs in cfg.batch_sizes for L in range(1, cfg.max_tokens_per_request + 1)]
        steps = {shape: _verify_step(engine, reqs[: shape[0]], shape[1]) for shape in shapes}
        for _ in range(cfg.warmup):  # first-call costs (allocator growth, kernel selection) off the clock
            for step in steps.values():
                step()
        times: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
        for _ in range(cfg.repeats):  # round-robin, so a burst of load on a shared machine hits every point alike
            for shape, step in steps.items():
                times[shape].append(_time_once(step))
        measured: dict[int, list[tuple[int, float]]] = {}
        for (bs, L), ts in times.items():
            sec = statistics.median(ts)
            measured.setdefault(bs, []).append((bs * L, sec))
            if progress is not None:
                progress(f"batch {bs:>4}  tokens/request {L:>3}  B {bs * L:>5}  step {sec * 1e3:8.2f} ms")
    return ProfileResult(table=table_from_measurements(measured, cfg.monotone), measured=measured)


def table_from_measurements(measured: dict[int, list[tuple[int, float]]], monotone: bool = True) -> SpsTable:
    """2-D SpsTable on the union of measured B values; each row interpolates linearly between its own points
    (flat outside its measured range) and, with `monotone`, is fitted non-increasing in B."""
    grid = sorted({b for points in measured.values() for b, _ in points})
    rows = []
    for bs in sorted(measured):
        xs = tuple(float(b) for b, _ in measured[bs])
        ys = [1.0 / sec for _, sec in measured[bs]]
        if monotone:
            ys = non_increasing_fit(ys)
        own = SpsTable(num_tokens=xs, steps_per_s=(tuple(ys),))
        rows.append(tuple(own.sps(b) for b in grid))
    return SpsTable(num_tokens=tuple(grid), steps_per_s=tuple(rows), batch_sizes=tuple(sorted(measured)))


def save_profile(path: str | Path, result: ProfileResult, meta: dict) -> None:
    """The SpsTable JSON (what SpsTable.load reads) plus the raw medians and how they were taken."""
    data = result.table.to_dict()
    data["measured_step_seconds"] = {str(bs): [[b, s] for b, s in pts] for bs, pts in result.measured.items()}
    data["meta"] = meta
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


# ---- CLI ------------------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16; got {text!r}") from e


def _resolve(args: argparse.Namespace) -> tuple[Path, Path | None]:
    from dspark.checkpoint.resolve import resolve_model, resolve_model_ref, shipped_drafts

    target_dir = resolve_model(args.model)
    if args.no_draft:
        return target_dir, None
    if args.draft is not None:
        return target_dir, resolve_model_ref(args.draft, role="--draft")
    shipped = shipped_drafts(target_dir)
    if shipped is not None and (shipped[0] / "config.json").exists():
        return target_dir, shipped[0]
    return target_dir, None


def cmd_profile(args: argparse.Namespace) -> int:
    from dspark.models.loading import choose_draft_quantization, load_drafter, load_target, resolve_precision
    from dspark.threads import apply_known_threads, model_key
    from dspark.tuning import SPS_FILE, output_path, usage_line

    if args.num_threads:
        from dspark.threads import set_threads

        set_threads(args.num_threads, "--num-threads")
    if args.breakdown:
        from dspark.bench.breakdown import cmd_breakdown

        return cmd_breakdown(args, *_resolve(args))

    cfg = ProfileConfig(
        batch_sizes=args.batch_sizes,
        max_tokens_per_request=args.max_tokens_per_request,
        context_len=args.context_len,
        repeats=args.repeats,
        warmup=args.warmup,
        monotone=not args.raw,
    )
    target_dir, draft_dir = _resolve(args)
    precision = resolve_precision(target_dir, args.dtype, args.quantization)  # what build_engines would serve
    target = load_target(target_dir, precision.dtype, precision.quantization)
    draft_quant = choose_draft_quantization(None, precision.quantization)[0]  # what a default spec config loads
    drafter = load_drafter(draft_dir, target, precision.dtype, draft_quant) if draft_dir is not None else None
    # the thread count generate / bench run this model with (their calibration), unless --num-threads says
    apply_known_threads(model_key(Path(target_dir).name, precision.dtype, sum(p.numel() for p in target.parameters())))
    what = f"target {target_dir}" + (f" + drafter {draft_dir} ({draft_quant})" if drafter else " (target only)")
    print(
        f"profiling {what}, {precision.describe()}, context {cfg.context_len}, {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    result = profile_sps(target, drafter, cfg, progress=None if args.quiet else lambda s: print(s, file=sys.stderr))
    meta = {
        "target": str(target_dir),
        "draft": str(draft_dir) if draft_dir is not None else None,
        "dtype": precision.dtype,
        "quantization": precision.quantization,
        "cpu_capability": precision.cpu_capability,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "num_threads": torch.get_num_threads(),
        "context_len": cfg.context_len,
        "repeats": cfg.repeats,
        "monotone_fit": cfg.monotone,
    }
    output = output_path(args.output, SPS_FILE, draft_dir, target_dir)  # default: where the engine looks first
    save_profile(output, result, meta)
    t = result.table
    span = f"B = {int(t.num_tokens[0])}..{int(t.num_tokens[-1])}"
    print(f"wrote {output}: SPS over {span}, batch sizes {list(cfg.batch_sizes)}")
    for bs, row in zip(cfg.batch_sizes, t.steps_per_s):
        print(f"  batch {bs:>4}: {row[0]:8.1f} .. {row[-1]:8.1f} steps/s")
    print(usage_line(args.output, "cost_table_path", output))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure verify steps/s versus verify-batch tokens (cost table for adaptive verification)",
        description="Times one engine step (drafter proposal + paged target verify) on this machine for every "
        "batch size and tokens per request, and writes the SPS(B) table that enable_adaptive_verification reads.",
    )
    add_model_arg(p)
    p.add_argument("--draft", default=None, help="draft dir to include in the step (default: bundled draft if any)")
    p.add_argument("--no-draft", action="store_true", help="time the target verify forward only")
    p.add_argument(
        "--output",
        default=None,
        help="output JSON (default: $DSPARK_CACHE/tuning/<machine>/<pair>/, where the engine finds it)",
    )
    p.add_argument("--batch-sizes", type=_int_list, default=(1, 4, 16), help="comma-separated (default 1,4,16)")
    p.add_argument("--max-tokens-per-request", type=int, default=8, help="anchor + drafts, 1..N (default 8)")
    p.add_argument("--context-len", type=int, default=256, help="pre-filled context per request (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point; the median is kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per point (default 2)")
    p.add_argument("--raw", action="store_true", help="keep raw medians (no non-increasing fit over B)")
    add_precision_args(p)
    add_threads_arg(p, dest="num_threads")
    p.add_argument("--quiet", action="store_true", help="no per-point lines")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead of the SPS table: torch.profiler breakdown of one AR decode step and one DSpark round",
    )
    p.add_argument("--steps", type=int, default=16, help="--breakdown: profiled steps per method (default 16)")
    p.add_argument("--concurrency", type=int, default=1, help="--breakdown: concurrent requests (default 1)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=SpeculativeConfig.num_speculative_tokens,
        help=f"--breakdown: K (default {SpeculativeConfig.num_speculative_tokens})",
    )
    p.set_defaults(func=cmd_profile)
