"""`dspark calibrate`: fit Sequential Temperature Scaling (STS) for the confidence head on held-out prompts.

Prompts are decoded with the full block verified (fixed K, adaptive verification off, so no label is clipped). Every
round records the K raw confidence logits and the realised accepted prefix length; STS then fits one temperature
per position against the survival labels 1[accepted >= k] (DSpark §3.2.1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dspark.cli_common import (
    add_max_tokens_arg,
    add_model_arg,
    add_precision_args,
    add_seed_arg,
    add_speculative_config_arg,
)
from dspark.engine.engine import Engine
from dspark.sampling_params import SamplingParams
from dspark.speculative.schedule import calibrate, calibration_report, fit_sts, save_sts, survival
from dspark.tuning import STS_FILE, output_path, usage_line


@dataclass(frozen=True)
class CalibrationData:
    logits: list[list[float]]  # rounds x K raw confidence logits
    accepted: list[int]  # accepted drafts per round, 0..K


class ConfidenceRecorder:
    """Collects (confidence logits, accepted drafts) for every fully verified round of an engine.

    Wraps the engine instance's accept/commit phase (the engine class is untouched); the accepted count is read
    back from the commit (num_computed advances by accepted + 1). Rounds verifying fewer than K drafts (a request
    near its max_tokens) are skipped: their labels are clipped. The speculation guard is set aside meanwhile: every
    step drafts.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.logits: list[list[float]] = []
        self.accepted: list[int] = []
        self._inner = engine._accept_and_commit
        self._guard = engine.guard

    def __enter__(self) -> ConfidenceRecorder:
        self.engine._accept_and_commit = self._record  # type: ignore[method-assign]
        self.engine.guard = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine._accept_and_commit = self._inner  # type: ignore[method-assign]
        self.engine.guard = self._guard

    def _record(self, reqs, proposal, lengths, logits, sampling) -> int:  # same signature as the engine's
        before = [r.num_computed for r in reqs]
        emitted = self._inner(reqs, proposal, lengths, logits, sampling)  # tokens emitted (the guard reads them)
        if proposal is None or proposal.confidence is None:
            return emitted
        conf = proposal.confidence.float().tolist()
        for i, req in enumerate(reqs):
            if lengths[i] == self.engine.K:
                self.logits.append(conf[i][: self.engine.K])
                self.accepted.append(req.num_computed - before[i] - 1)
        return emitted

    @property
    def data(self) -> CalibrationData:
        return CalibrationData(list(self.logits), list(self.accepted))


def collect(engine: Engine, prompts: Sequence[str | Sequence[int]], params: SamplingParams) -> CalibrationData:
    """Decode prompts on a fixed-K engine and return every fully verified round."""
    from dspark.llm import LLM

    if engine.spec is None or engine.drafter is None or engine.drafter.confidence_head is None:
        raise ValueError(
            "calibration needs a DSpark/DFlash drafter with a confidence head (enable_confidence_head: true)"
        )
    if engine.adaptive is not None:
        raise ValueError("calibrate on an engine with adaptive verification off: trimmed blocks clip the labels")
    with ConfidenceRecorder(engine) as rec:
        LLM.from_engine(engine).generate(list(prompts), params)
    if not rec.logits:
        raise ValueError("no fully verified rounds were recorded; use more prompts or a larger --max-tokens")
    return rec.data


def reliability_curve(probs: Sequence[float], labels: Sequence[float], n_bins: int) -> tuple[list[float], list[float]]:
    """(mean predicted, observed frequency) per non-empty equal-width bin."""
    psum, ysum, count = [0.0] * n_bins, [0.0] * n_bins, [0] * n_bins
    for p, y in zip(probs, labels):
        b = min(max(int(p * n_bins), 0), n_bins - 1)
        psum[b] += p
        ysum[b] += y
        count[b] += 1
    keep = [b for b in range(n_bins) if count[b]]
    return [psum[b] / count[b] for b in keep], [ysum[b] / count[b] for b in keep]


def plot_reliability(
    path: str | Path, data: CalibrationData, temperatures: Sequence[float], report: list[dict], n_bins: int = 20
) -> None:
    """One reliability diagram per draft position: survival before (raw) and after STS against the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(data.logits[0])
    cols = min(K, 4)
    rows = (K + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    raw = [survival(calibrate(z, [1.0] * K)) for z in data.logits]
    cal = [survival(calibrate(z, temperatures)) for z in data.logits]
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= K:
            ax.axis("off")
            continue
        labels = [1.0 if n > k else 0.0 for n in data.accepted]
        ax.plot([0, 1], [0, 1], color="0.6", linestyle=":", linewidth=1)
        for surv, name, color in ((raw, "raw", "tab:red"), (cal, "STS", "tab:blue")):
            x, y = reliability_curve([a[k] for a in surv], labels, n_bins)
            ax.plot(x, y, marker="o", markersize=3, color=color, label=name)
        r = report[k]
        ax.set_title(f"pos {k + 1}: ECE {r['ece_before']:.3f}→{r['ece_after']:.3f}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        if k % cols == 0:
            ax.set_ylabel("accepted frequency")
        if k // cols == rows - 1:
            ax.set_xlabel("predicted survival")
        if k == 0:
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Confidence calibration (STS), {len(data.accepted)} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_report(report: list[dict]) -> str:
    lines = ["pos      T  accept  ECE before→after   AUROC before→after  Brier before→after"]
    for r in report:
        lines.append(
            f"{r['position']:>3} {r['temperature']:6.3f}  {r['accept_rate']:6.3f}  "
            f"{r['ece_before']:.4f}→{r['ece_after']:.4f}    {r['auroc_before']:.4f}→{r['auroc_after']:.4f}"
            f"     {r['brier_before']:.4f}→{r['brier_after']:.4f}"
        )
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------------------------


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dspark.cli_common import default_spec, model_or_demo
    from dspark.config import SpeculativeConfig
    from dspark.data import load_prompts
    from dspark.llm import build_engine

    model, demo = model_or_demo(args.model)
    spec = SpeculativeConfig.parse(default_spec(args, model if demo else None) or {"method": "dspark"})
    assert spec is not None
    # the full block is verified, every step drafts
    spec = replace(spec, enable_adaptive_verification=False, speculation_guard=False)
    engine = build_engine(
        model,
        spec,
        dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
    )
    prompts = load_prompts(args.dataset, args.num_prompts, getattr(engine.tokenizer, "apply_chat_template", None))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)  # per-request seeds
    print(
        f"decoding {len(prompts)} prompts (K = {engine.K}, full block verified, temperature {args.temperature})",
        file=sys.stderr,
    )
    data = collect(engine, [p.token_ids(engine.tokenizer) for p in prompts], params)
    temps = fit_sts(data.logits, data.accepted, n_bins=args.bins)
    report = calibration_report(data.logits, data.accepted, temps, n_bins=args.bins)
    extra = {
        "num_speculative_tokens": engine.K,
        "num_rounds": len(data.accepted),
        "num_prompts": len(prompts),
        "temperature": args.temperature,
        "n_bins": args.bins,
        "draft": str(engine.draft_dir),
        "per_position": [{k: (None if v != v else v) for k, v in r.items()} for r in report],  # NaN -> null
    }
    output = output_path(args.output, STS_FILE, engine.draft_dir, engine.model_dir)
    save_sts(output, temps, extra)
    print(format_report(report))
    _warn_if_small(data.accepted, engine.K)
    before, after = (sum(r[key] for r in report) / len(report) for key in ("ece_before", "ece_after"))
    print(f"mean ECE {before:.4f} → {after:.4f} over {len(data.accepted)} rounds")
    if args.plot:
        plot_reliability(args.plot, data, temps, report, args.bins)
        print(f"wrote {args.plot}")
    print(f"wrote {output}: sts_temperatures = [{', '.join(f'{t:.3f}' for t in temps)}]")
    print(usage_line(args.output, "calibration_path", output))
    return 0


MIN_ROUNDS_PER_POSITION = 100  # fewer reaching a position and its fitted temperature is noise


def _warn_if_small(accepted: list[int], K: int) -> None:
    """A warning, with how much more data to use, when a draft position was reached by too few rounds."""
    reached = [sum(1 for n in accepted if n >= k) for k in range(K)]  # rounds whose accepted prefix reached k
    thin = [k for k, n in enumerate(reached) if n < MIN_ROUNDS_PER_POSITION]
    if not thin:
        return
    scale = MIN_ROUNDS_PER_POSITION / max(min(reached[k] for k in thin), 1)
    print(
        f"warning: draft positions {thin} were reached by fewer than {MIN_ROUNDS_PER_POSITION} rounds "
        f"({', '.join(str(reached[k]) for k in thin)}), so their temperatures are noise; use about {scale:.0f}x "
        "the prompts (--num-prompts) or tokens (--max-tokens)",
        file=sys.stderr,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit STS temperatures for the confidence head (for adaptive verification)",
        description="Decodes held-out prompts with the full draft block verified, records per-position confidence "
        "logits and accepted prefix lengths, fits Sequential Temperature Scaling and reports ECE/AUROC/Brier.",
    )
    p.add_argument("--dataset", required=True, help="JSONL prompts (held out from draft training)")
    p.add_argument("--num-prompts", type=int, default=64)
    add_max_tokens_arg(p, 128)
    add_model_arg(p)
    add_speculative_config_arg(p)
    p.add_argument(
        "--output",
        default=None,
        help="where to write (default: $DSPARK_CACHE/tuning/<machine>/<pair>/, where the engine finds it)",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a reliability diagram")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; match serving (default 0)")
    p.add_argument("--bins", type=int, default=20, help="ECE bins (default 20)")
    add_seed_arg(p, 0)
    p.add_argument("--max-num-seqs", type=int, default=16, help="decode batch size")
    add_precision_args(p)
    p.set_defaults(func=cmd_calibrate, no_spec=False)
