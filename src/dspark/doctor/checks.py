"""The deployment doctor behind ``dspark check DRAFT [--target MODEL] [--json]`` and the load-time gate.

Runs the deployment checklist for a DSpark draft (and, with ``--target``, its pairing with the target) and
reports every problem found, each with its fix. One small function per check; each returns the problems it
found (``Problem(message, fix)``) or raises ``Skip`` when its inputs are absent or already reported broken.
Nothing here raises on broken input: configs are read as raw JSON first, checkpoints through their
headers only, and weights one tensor (chunk) at a time with safetensors ``safe_open`` — never into a model.

The checks follow the six deployment steps of the Kimi-K3-DSpark card (``STEPS``): 1 weights (incl. the separate
lm_head and Git LFS pointers), 2 layer mapping, 3 KV cache and YaRN identity with the target, 4 confidence and
Markov heads, 5 the lossless-acceptance run to do next, 6 the metrics to monitor. Without a draft (``draft_dir``
None) only the target's checks run: that is what ``generate``/``serve``/``LLM`` run before an n-gram or plain
target (dspark.doctor.gate).

The checks live by topic: context.py (the inputs), weights.py, keys.py and tokens.py (step 1), pairing.py (steps 2
to 4), rootcause.py (the one config key a checkpoint's shapes contradict); this module holds the table of checks,
runs it and formats the report.

Dependency direction: this package reads checkpoints (dspark.checkpoint) and builds meta-device rosters from the
model classes (dspark.models); neither of those imports the doctor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.checkpoint.io import Problem
from dspark.checkpoint.resolve import BUNDLED_DIR
from dspark.config import SpeculativeConfig
from dspark.doctor.context import Context, Skip
from dspark.doctor.keys import ignored_keys_notes
from dspark.doctor.pairing import (
    check_confidence_head,
    check_hidden_size,
    check_kv_cache,
    check_markov_head,
    check_target_layer_ids,
    check_yarn,
    kv_note,
)
from dspark.doctor.tokens import check_special_tokens, check_tokenizer
from dspark.doctor.weights import (
    check_bf16,
    check_draft_config,
    check_dtype,
    check_embedding,
    check_lfs_pointers,
    check_lm_head,
    check_roster,
    check_safetensors,
    check_target_config,
    check_target_roster,
    check_vocab,
)
from dspark.models.model_spec import one_read_per_model

# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class CheckProblem:
    """One problem: the check that found it, what is wrong (naming the file/key/value) and how to fix it."""

    check: str
    message: str
    fix: str


@dataclass(frozen=True)
class CheckReport:
    """Every problem found, and which checks passed or were skipped (with why, in ``skip_reasons``)."""

    problems: tuple[CheckProblem, ...]
    passed: tuple[str, ...]
    skipped: tuple[str, ...]
    skip_reasons: Mapping[str, str] = field(default_factory=dict, compare=False)
    notes: Mapping[int, tuple[str, ...]] = field(default_factory=dict, compare=False)  # step -> facts/advice
    draft_dir: Path | None = None
    target_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], list[Problem]]
    title: str
    step: int  # the deployment step (STEPS) it belongs to


# The six deployment steps of the Kimi-K3-DSpark card, in order; steps 5 and 6 are what to do next.
STEPS: tuple[tuple[int, str], ...] = (
    (1, "load the draft weights: model.safetensors + lm_head.safetensors, shapes and vocabulary"),
    (2, "layer mapping: target_layer_ids into the target's layers"),
    (3, "KV cache and YaRN: shared latent pages, rotary parameters identical to the target's"),
    (4, "confidence head + Markov head enabled"),
    (5, "lossless acceptance: target-only and speculative output must be identical token by token"),
    (6, "monitoring: acceptance rate, throughput (Prometheus at /metrics)"),
)

CHECKS: tuple[Check, ...] = (
    Check("draft-config", check_draft_config, "draft config.json parses as a DSpark draft config", 1),
    Check("target-config", check_target_config, "target config.json is readable", 1),
    Check("lfs-pointers", check_lfs_pointers, "no Git LFS pointer files in place of real files", 1),
    Check("safetensors", check_safetensors, "safetensors files match their headers", 1),
    Check("roster", check_roster, "draft tensor names, shapes and dtypes match config.json", 1),
    Check("target-roster", check_target_roster, "every tensor of the target's config is in its checkpoint", 1),
    Check("dtype", check_dtype, "half-precision tensors all of the torch_dtype config.json declares", 1),
    Check("bf16", check_bf16, "weights finite and representable in bf16", 1),
    Check("vocab", check_vocab, "vocab_size matches embedding/lm_head rows and the target", 1),
    Check("lm-head", check_lm_head, "an lm_head [vocab, hidden] is available (own file or the target's)", 1),
    Check("embedding", check_embedding, "the target's embedding is [vocab, draft hidden]", 1),
    Check("tokenizer", check_tokenizer, "the target's tokenizer.json found, loadable and within the vocabulary", 1),
    Check("special-tokens", check_special_tokens, "mask/bos/eos/pad ids agree with each other and the vocab", 1),
    Check("target-layer-ids", check_target_layer_ids, "target_layer_ids increasing, inside the target, not last", 2),
    Check("hidden-size", check_hidden_size, "target hidden_size == draft target_hidden_size", 2),
    Check("kv-cache", check_kv_cache, "draft cache rows as wide as the target's latent pages", 3),
    Check("yarn", check_yarn, "draft rotary/YaRN parameters equal the target's", 3),
    Check("confidence-head", check_confidence_head, "confidence head tensors match enable_confidence_head", 4),
    Check("markov-head", check_markov_head, "Markov head tensors present iff markov_rank > 0", 4),
)
# What generate/serve/LLM run before loading (headers and configs only; the finiteness scan runs over the loaded
# weights instead of bf16's second read from disk).
LOAD_CHECKS: tuple[str, ...] = tuple(c.name for c in CHECKS if c.name != "bf16")

# Step 6: what to watch in production (dspark serve exports vLLM's names).
METRICS: tuple[tuple[str, str], ...] = (
    ("vllm:spec_decode_num_drafts_total", "speculative rounds"),
    ("vllm:spec_decode_num_draft_tokens_total", "drafted tokens"),
    ("vllm:spec_decode_num_accepted_tokens_total", "accepted drafts; acceptance rate = accepted / draft tokens"),
    (
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "accepted per draft position {position}: a drop after position 0 points at layer mapping or precision",
    ),
    ("dspark:spec_decode_mean_acceptance_length", "τ = 1 + accepted / drafts"),
    ("vllm:generation_tokens_total", "end-to-end throughput (rate of this counter)"),
    ("vllm:kv_cache_usage_perc", "latent page usage"),
)


def _notes(ctx: Context) -> dict[int, tuple[str, ...]]:
    """Facts and next steps per deployment step (never problems)."""
    notes: dict[int, list[str]] = {1: ignored_keys_notes(ctx)}
    kv = kv_note(ctx) if ctx.has_draft else None
    if kv:
        notes.setdefault(3, []).append(kv)
    cfg = ctx.draft_cfg_parse[0] if ctx.has_draft and ctx.draft_config_read[0] is not None else None
    if cfg is not None:
        if cfg.enable_confidence_head:
            notes.setdefault(4, []).append(
                'serve with "enable_adaptive_verification": true so the confidence head sets the verify length'
            )
        else:
            notes.setdefault(4, []).append("no confidence head: adaptive verification is unavailable with this draft")
        if cfg.markov_rank == 0:
            notes.setdefault(4, []).append('markov_rank 0: run it as "method": "dflash"')
    notes[5] = (lossless_command(ctx),)
    notes[6] = tuple(f"{name}  ({what})" for name, what in METRICS)
    return {k: tuple(v) for k, v in notes.items() if v}


def lossless_command(ctx: Context) -> str:
    target = str(ctx.target_dir) if ctx.target_dir is not None else "<target>"
    draft = str(ctx.draft_path) if ctx.draft_path is not None else "<draft>"
    k = SpeculativeConfig.num_speculative_tokens  # the default K: what generate and serve run
    spec = json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": k})
    prompts = BUNDLED_DIR / "prompts" / "heldout.jsonl"  # held-out prompts shipped with the package
    return f"dspark verify-lossless --model {target} --speculative-config '{spec}' --dataset {prompts}"


def run_checks(
    draft_dir: str | Path | None,
    target_dir: str | Path | None = None,
    *,
    only: tuple[str, ...] | None = None,
) -> CheckReport:
    """Run the checks (``only``: these names) on a draft and/or its target; never raises on broken input. Each
    model is read once (``one_read_per_model``: shared with the caller's command, e.g. the loader after the gate)."""
    with one_read_per_model():
        return _run_checks(draft_dir, target_dir, only)


def _run_checks(
    draft_dir: Path | str | None, target_dir: Path | str | None, only: tuple[str, ...] | None
) -> CheckReport:
    draft = Path(draft_dir) if draft_dir is not None else None
    ctx = Context(draft, Path(target_dir) if target_dir is not None else None)
    problems: list[CheckProblem] = []
    passed: list[str] = []
    skipped: list[str] = []
    reasons: dict[str, str] = {}
    for check in CHECKS:
        if only is not None and check.name not in only:
            continue
        try:
            found = check.run(ctx)
        except Skip as s:
            skipped.append(check.name)
            reasons[check.name] = s.reason
            continue
        except Exception as e:  # a check must never take the doctor down; report it as a problem instead
            found = [
                Problem(
                    f"the check could not complete: {type(e).__name__}: {e}",
                    "fix the problems reported above and re-run; if it persists, report this as a dspark bug",
                )
            ]
        if found:
            problems += [CheckProblem(check.name, p.message, p.fix) for p in found]
        else:
            passed.append(check.name)
    return CheckReport(tuple(problems), tuple(passed), tuple(skipped), reasons, _notes(ctx), draft, ctx.target_dir)


def report_json(report: CheckReport) -> dict[str, Any]:
    """The ``check --json`` schema: ``{"ok": bool, "problems": [{"check", "message", "fix"}]}`` (all str), plus
    ``steps``: the six deployment steps in order, each with its checks' status and notes."""
    return {
        "ok": report.ok,
        "problems": [{"check": p.check, "message": p.message, "fix": p.fix} for p in report.problems],
        "steps": [
            {
                "step": n,
                "title": title,
                "checks": {c.name: _status(report, c.name) for c in CHECKS if c.step == n and _status(report, c.name)},
                "notes": list(report.notes.get(n, ())),
            }
            for n, title in STEPS
        ],
    }


def _status(report: CheckReport, name: str) -> str:
    if any(p.check == name for p in report.problems):
        return "problem"
    return "passed" if name in report.passed else "skipped" if name in report.skipped else ""


def _problem_line(p: CheckProblem, bad_mark: str, dash: str) -> str:
    """``  ✖ check: message – fix: fix``; a multi-line message keeps its lines indented under it, the fix last."""
    if "\n" not in p.message:
        return f"  {bad_mark} {p.check}: {p.message} {dash} fix: {p.fix}"
    message = p.message.replace("\n", "\n      ")
    return f"  {bad_mark} {p.check}: {message}\n    {dash} fix: {p.fix}"


def format_report(report: CheckReport, *, ascii_only: bool = False) -> str:
    """Human output in the six deployment steps: ✔ per passed check, ✖ + fix per problem, – per skipped check
    (and why), then each step's notes (step 5: the command to run next; step 6: the metrics to watch).

    Every problem is printed: one found before the checks could run (a model reference that names nothing, check
    ``model-reference``, or any check outside the table) comes first; when nothing else ran, the steps are left
    out (they would list checks that never looked at anything)."""
    ok_mark, bad_mark, dash = ("OK", "X", "-") if ascii_only else ("✔", "✖", "–")
    names = {c.name for c in CHECKS}
    by_check: dict[str, list[CheckProblem]] = {}
    for p in report.problems:
        by_check.setdefault(p.check, []).append(p)
    lines = [_problem_line(p, bad_mark, dash) for p in report.problems if p.check not in names]
    ran = bool(report.passed or report.skipped or any(p.check in names for p in report.problems))
    for n, title in STEPS if ran else ():
        lines.append(f"[{n}/6] {title}")
        for check in (c for c in CHECKS if c.step == n):
            if check.name in report.passed:
                lines.append(f"  {ok_mark} {check.name}: {check.title}")
            lines += [_problem_line(p, bad_mark, dash) for p in by_check.get(check.name, [])]
            if check.name in report.skipped:
                lines.append(f"  {dash} {check.name}: skipped ({report.skip_reasons.get(check.name, 'not run')})")
        lines += [f"    {note}" for note in report.notes.get(n, ())]
    n_checks = len(report.passed) + len(by_check)
    skipped = f", {len(report.skipped)} skipped" if report.skipped else ""
    if report.ok:
        lines.append(f"{ok_mark} all {n_checks} checks passed{skipped}")
    else:
        n = len(report.problems)
        lines.append(
            f"{bad_mark} {n} problem{'s' if n != 1 else ''} in {len(by_check)} of {n_checks} checks{skipped}"
            + ("" if ran else ": nothing else could be checked")
        )
    return "\n".join(lines)
