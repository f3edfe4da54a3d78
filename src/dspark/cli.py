"""The ``dspark`` command line: argparse subcommands that parse, build a config and call the library."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.cli_common import (
    add_kv_offload_args,
    add_max_tokens_arg,
    add_model_arg,
    add_precision_args,
    add_prefix_caching_arg,
    add_seed_arg,
    add_speculative_config_arg,
    add_threads_arg,
    apply_threads,
    default_spec,
    kv_offload_kwargs,
    model_or_demo,
)
from dspark.config import ConfigError

if TYPE_CHECKING:
    from dspark.doctor import CheckProblem

# ---- roster ---------------------------------------------------------------------------------------------


def cmd_roster(args: argparse.Namespace) -> int:
    from dspark.checkpoint.roster import format_roster, roster_json
    from dspark.models.families import MLA
    from dspark.models.loading import read_config_any
    from dspark.models.model_spec import resolve_spec

    spec = resolve_spec(args.config, role="roster")
    roster = (spec.family or MLA).roster(read_config_any(spec), ())  # no family: DeepSeek-V3's config rejects it
    if args.json:
        print(json.dumps(roster_json(roster)))
    else:
        print(format_roster(roster))
    return 0


def add_roster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roster", help="expected tensor names, shapes and parameter count (meta device)")
    p.add_argument(
        "config",
        help="config.json of a target or a drafter, its dir, a bundled name (kimi-k3-mini, kimi-k3-mini-dspark, ...) "
        "or a hub id",
    )
    p.add_argument("--json", action="store_true", help='print {"tensors": {name: [dims]}, "num_params": int}')
    p.set_defaults(func=cmd_roster)


# ---- check ----------------------------------------------------------------------------------------------


def _resolve_for_check(ref: str | None, role: str, problems: list[CheckProblem]) -> Path | None:
    """A model reference's path; an unresolvable one becomes a problem of the report (so --json stays JSON)."""
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.doctor import CheckProblem

    if ref is None:
        return None
    try:
        return resolve_model_ref(ref, role=role)
    except ConfigError as e:  # nothing at that reference (ModelNotFoundError), or an alias whose package is absent
        fix = getattr(e, "fix", "") or "install what the message names, or pass a model directory"
        problems.append(CheckProblem("model-reference", str(e), fix))
        return None


def _bundled_target(draft: Path | None) -> Path | None:
    """A bundled drafter's own target (so the pairing checks run without --target); None for any other draft, or
    when that target is not installed here (then only the draft's own checks run, saying why)."""
    from dspark.checkpoint.resolve import bundled_model_at, resolve_model_ref

    entry = bundled_model_at(draft) if draft is not None else None
    if entry is None or not entry.is_drafter:
        return None
    try:
        target = resolve_model_ref(entry.target, role=f"{entry.name}'s target")
    except ConfigError as e:
        print(
            f"{entry.name} is a bundled drafter; its target is not available, so only its own checks run: {e}",
            file=sys.stderr,
        )
        return None
    print(
        f"{entry.name} is a bundled drafter: checking it with its target {entry.target} (--target overrides)",
        file=sys.stderr,
    )
    return target


def _shipped_drafter(model: Path | None, ref: str) -> Path | None:
    """The DSpark drafter shipped for a target given as DRAFT (a bundled target such as kimi-k3-mini, or an alias
    such as smollm2-135m-instruct), so ``dspark check TARGET`` checks the pair it serves; None for anything else."""
    from dspark.checkpoint.resolve import shipped_drafts

    shipped = shipped_drafts(model) if model is not None and model.is_dir() else None
    if shipped is None or not (shipped[0] / "config.json").is_file():
        return None
    print(
        f"{ref} is a target with a shipped drafter: checking {shipped[0].name} with it (pass a drafter as DRAFT and "
        f"--target {ref} to check another)",
        file=sys.stderr,
    )
    return shipped[0]


def cmd_check(args: argparse.Namespace) -> int:
    from dspark.doctor import CheckReport, format_report, report_json, run_checks
    from dspark.models.model_spec import one_read_per_model

    problems: list[CheckProblem] = []
    draft = _resolve_for_check(args.draft_dir, "check DRAFT", problems)
    drafter = _shipped_drafter(draft, args.draft_dir) if args.target is None else None
    if drafter is not None:
        draft, target = drafter, draft
    elif args.target is not None:
        target = _resolve_for_check(args.target, "check --target", problems)
    else:
        target = _bundled_target(draft)
    with one_read_per_model():  # the checks and the precision line read each model once
        report = CheckReport(tuple(problems), (), ()) if problems else run_checks(draft, target)
        precision = None if problems else _serving_precision(target)
    if args.json:
        print(json.dumps(report_json(report) | ({"precision": precision.to_json()} if precision else {})))
    else:
        if precision is not None:
            what = "the target would be served in" if target is not None else "a dense target would be served in"
            print(f"on this machine {what}: {precision.describe()}")
        encoding = getattr(sys.stdout, "encoding", None) or "ascii"
        try:
            "✔✖–".encode(encoding)
            ascii_only = False
        except (UnicodeEncodeError, LookupError):
            ascii_only = True
        print(format_report(report, ascii_only=ascii_only))
    return 0 if report.ok else 1


def _serving_precision(target: Path | None):
    """The dtype and quantization generate/serve would choose by default for this target on this machine (a dense
    target's without one); None when the target's config cannot be read (a check reports that)."""
    from dspark.models.loading import resolve_precision
    from dspark.precision import Precision, choose_dtype, cpu_capability

    if target is None:
        dtype, why = choose_dtype("auto", "none")
        return Precision(dtype, "none", cpu_capability(), why, "no target given")
    try:
        return resolve_precision(target)
    except (ConfigError, OSError):
        return None


def add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="deployment doctor: check a draft (and its target) before serving",
        description="Prints each check (✔ passed, ✖ problem with its fix, – skipped and why) in the six deployment "
        "steps; exits 1 when any check found a problem (or a model reference names nothing), else 0.",
    )
    p.add_argument(
        "draft_dir",
        metavar="DRAFT",
        help="draft model dir, bundled drafter name (e.g. kimi-k3-mini-dspark) or hub id org/name[@rev] (local "
        "caches); a target with a shipped drafter (kimi-k3-mini, k3-mini, smollm2-135m-instruct) checks that pair",
    )
    p.add_argument(
        "--target",
        metavar="MODEL",
        default=None,
        help="target dir, bundled/alias name or hub id (enables pairing checks; a bundled drafter's own target by "
        "default)",
    )
    p.add_argument("--json", action="store_true", help='print {"ok": bool, "problems": [{"check", "message", "fix"}]}')
    p.set_defaults(func=cmd_check)


# ---- generate / verify-lossless -------------------------------------------------------------------------


def _sampling(args: argparse.Namespace, max_tokens: int):
    from dspark.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=max_tokens,
        seed=args.seed,
    )


def _timed_generate(engine, prompt: str | list[int], params) -> tuple[object, float]:
    import time

    from dspark.llm import LLM

    llm = LLM.from_engine(engine)
    # warm-up: the shapes a run will use (prefill, a few plain steps or rounds), so both timed runs are warm; the
    # guard then starts afresh, deciding on the timed run's warm steps
    llm.generate(prompt, _replace_max_tokens(params, max(2, min(params.max_tokens, 4 * (engine.K + 1)))))
    if engine.guard is not None:
        engine.guard = type(engine.guard)()
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    if out.error is not None:
        from dspark.engine.engine import EngineError

        raise EngineError(f"generation failed: {out.error}")
    return out, time.perf_counter() - t0


def _replace_max_tokens(params, n: int):
    from dataclasses import replace

    return replace(params, max_tokens=n)


def pretrained_base_model(model_dir: Path | None) -> bool:
    """A target exported by ``dspark train-target`` (its training_log.json has the pretraining config): trained on
    raw text only. Its tokenizer carries the pipeline's chat template (for the server's chat route) all the same."""
    log = model_dir / "training_log.json" if model_dir is not None else None
    if log is None or not log.is_file():
        return False
    try:
        return "pretrain_config" in json.loads(log.read_text())
    except (OSError, ValueError):
        return False


def prompt_format(engine, chat: bool | None) -> tuple[bool, str]:
    """Whether ``generate`` renders its prompt with the target's chat template, and why (for stderr and --json).
    ``chat``: --chat (True), --no-chat-template / --raw (False) or unset (None: the template when the tokenizer has
    one, unless the target is a base model pretrained on raw text by ``dspark train-target``, as the bundled
    kimi-k3-mini and k3-mini are)."""
    has = bool(getattr(engine.tokenizer, "has_chat_template", False))
    if chat is not None:
        if chat and not has:
            raise ConfigError(
                f"--chat: the tokenizer of {engine.model_dir} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); drop --chat to send the prompt as raw text"
            )
        return chat, "--chat" if chat else "--no-chat-template"
    if not has:
        return False, "the model's tokenizer has no chat template"
    if pretrained_base_model(engine.model_dir):
        name = engine.model_ref or engine.model_dir.name
        return False, f"{name} is a base model pretrained on raw text; --chat applies its chat template"
    return True, "the model's chat template; --no-chat-template sends the raw text"


def _prompt(engine, text: str, chat: bool) -> str | list[int]:
    """The prompt as the engine takes it: raw text, or the ids of one user turn through the chat template."""
    return list(engine.tokenizer.encode_chat([{"role": "user", "content": text}])) if chat else text


def cmd_generate(args: argparse.Namespace) -> int:
    from dspark.llm import build_engines, engine_configs

    params = _sampling(args, args.max_tokens)  # refuse bad sampling values before loading anything
    apply_threads(args)
    model, demo = model_or_demo(args.model)
    spec = default_spec(args, model if demo else None)
    compare = (args.compare or args.json) and spec is not None
    configs = [spec, None] if compare else [spec]
    engines = build_engines(
        model,
        configs,
        *engine_configs(
            dtype=args.dtype,
            quantization=args.quantization,
            seed=args.seed or 0,
            attention_backend=args.attention_backend,
            enable_prefix_caching=args.enable_prefix_caching,
            **kv_offload_kwargs(args),
        ),
    )
    chat, why = prompt_format(engines[0], args.chat)
    prompt = _prompt(engines[0], args.prompt, chat)
    out, wall = _timed_generate(engines[0], prompt, params)
    tps = len(out.token_ids) / wall if wall > 0 else 0.0
    speedup = None
    if compare:
        ar, ar_wall = _timed_generate(engines[1], prompt, params)
        speedup = tps / (len(ar.token_ids) / ar_wall) if ar_wall > 0 and ar.token_ids else None
    tau = out.spec_metrics.get("acceptance_length")
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "num_output_tokens": len(out.token_ids),
                    "chat_template": chat,
                    "prompt_format": why,
                    "acceptance_length": tau,
                    "tokens_per_s": tps,
                    "speedup_vs_ar": speedup,
                    "precision": engines[0].precision.to_json(),
                    "speculation_guard": engines[0].guard.report() if engines[0].guard is not None else None,
                }
            )
        )
        return 0
    print(out.text if chat else args.prompt + out.text)
    print("---", file=sys.stderr)
    print(f"prompt: {'chat template' if chat else 'raw text'} ({why})", file=sys.stderr)
    print(f"precision: {engines[0].precision.describe()}", file=sys.stderr)
    spec_cfg = engines[0].spec
    method = spec_cfg.method if spec_cfg is not None else "none (autoregressive)"
    tau_s = f"{tau:.2f}" if tau is not None else "n/a"
    line = f"speculation: {method}  τ (mean acceptance length): {tau_s}  tokens/s: {tps:.1f}"
    if speedup is not None:
        line += f"  speed-up vs no speculation: {speedup:.2f}x"
    print(line + ("  (whole request, prefill included)" if speedup is not None else ""), file=sys.stderr)
    for guard_line in guard_lines(engines[0]):  # its rates are decode steps' only, warm-up included
        print(guard_line + " [decode steps, warm-up included]", file=sys.stderr)
    engine = engines[0]
    report_tokens = min(REPORT_TOKENS, engine.max_model_len)  # a request the model can hold
    print("\n".join(cache_report_lines(engine.cache_report(report_tokens))), file=sys.stderr)
    window = engine.target.config.max_position_embeddings
    if window > report_tokens:  # and one of the model's whole window, however long the engine was started for
        serve = f"; serve it with --max-model-len {window}" if window > engine.max_model_len else ""
        print(f"{_request_line(engine.cache_report(window))} (the model's whole window{serve})", file=sys.stderr)
    return 0


def guard_lines(engine) -> list[str]:
    """What the speculation guard decided (drafting on or switched off, and why), one line per batch size."""
    if engine.spec is None:
        return []
    if engine.guard is None:
        return ["speculation guard: off (speculation_guard false): every step drafts"]
    return [f"speculation guard: {line}" for line in engine.guard.describe()]


REPORT_TOKENS = 16384  # the request size whose cache bytes `generate` reports (the model's max_model_len if less)
ROWS_WORD = {"mla": "latents", "gqa": "K/V rows", "tokens": "token ids"}  # what a page row holds, by page kind


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _request_line(c: dict) -> str:
    """One request's cache bytes in the family's terms; the comparison with a separate per-head draft cache only
    where it differs from what the drafter holds."""
    t, d, sep = c["request_target_bytes"], c["request_draft_bytes"], c["request_separate_draft_bytes"]
    line = f"a {c['request_tokens']}-token request: target {ROWS_WORD.get(c['target_page_kind'], 'rows')} {_mib(t)}"
    if not c["draft_page_kind"]:
        return line
    where = "same pages" if c["shared_pool"] else "pages of its own"
    line += f", drafter {ROWS_WORD.get(c['draft_page_kind'], 'rows')} {_mib(d)} ({where})"
    if sep == d:
        return line
    saved = 1 - (t + d) / (t + sep) if t + sep else 0.0
    return line + (
        f"; a separate per-head draft cache would take {_mib(sep)}: {_mib(t + d)} vs {_mib(t + sep)} in all "
        f"({saved:.0%} less)"
    )


def cache_report_lines(c: dict) -> list[str]:
    """Page formats, bytes per token, and (when the report has them) the bytes of one long request: target
    latents, drafter latents on the same pages, and a separate conventional draft cache for comparison."""
    pages = f"{c['target_page_kind']} {c['target_width']}-wide"
    if c["shared_pool"]:
        pages += " (target and draft layers share them)"
    elif c["draft_page_kind"]:
        pages += f" + draft {c['draft_page_kind']} {c['draft_width']}-wide"
    lines = [
        f"KV cache: {pages} pages of {c['page_size']} tokens; "
        f"bytes/token: target {c['target_bytes_per_token']}, draft {c['draft_bytes_per_token']}"
    ]
    if "request_tokens" in c:
        lines.append(_request_line(c))
    if c.get("state_bytes_per_request"):
        lines.append(
            f"recurrent state (KDA layers): {_mib(c['state_bytes_per_request'])} per request, whatever its length "
            f"({c['state_slots']} slots)"
        )
    if c.get("prefix_caching"):
        lines.append(
            f"prefix cache: {c['prefix_cached_blocks']} blocks cached ({c['prefix_idle_cached_blocks']} unused, "
            f"evicted when the pool needs them); hit rate {c['prefix_cache_hit_rate']:.0%} "
            f"({c['prefix_cache_hits']} of {c['prefix_cache_queries']} prompt tokens)"
        )
    if "state_snapshots" in c:
        lines.append(
            f"state snapshots: {c['state_snapshots']} of at most {c['max_state_snapshots']} "
            f"({_mib(c['state_snapshot_bytes'])}): a hit on a stateful target reaches as far as a snapshot"
        )
    return lines + (offload_report_lines(c) if c.get("kv_offload") else [])


def offload_report_lines(c: dict) -> list[str]:
    """The KV offload tiers (``Engine.cache_report`` with offload on) and what a block moves per token."""
    tiers = []
    for key, label in (("cpu", "CPU"), ("disk", "disk")):
        if c[f"kv_offload_{key}_budget"] or c[f"kv_offload_{key}_blocks"]:
            broken = " (no longer writable)" if key == "disk" and not c["kv_offload_disk_writable"] else ""
            tiers.append(
                f"{label}{broken} {c[f'kv_offload_{key}_blocks']} blocks ({_mib(c[f'kv_offload_{key}_bytes'])} of "
                f"{_mib(c[f'kv_offload_{key}_budget'])}), stored {c[f'kv_offload_stores_{key}']}, loaded back "
                f"{c[f'kv_offload_loads_{key}']}, evicted {c[f'kv_offload_evictions_{key}']}"
            )
    where = f" in {c['kv_offload_disk_dir']}" if c["kv_offload_disk_dir"] else ""
    lines = [
        f"KV offload{where}: "
        + ("; ".join(tiers) or "no tier can store blocks (see the log)")
        + f"; {c['kv_offload_hit_tokens']} prompt tokens loaded back, {c['kv_offload_corrupt_drops']} corrupt "
        f"blocks dropped (recomputed), {c['kv_offload_write_errors']} write errors"
    ]
    moved, per_head = c["kv_offload_bytes_per_token"], c["kv_offload_per_head_bytes_per_token"]
    if c["kv_offload_layout"] == "mla":
        how = f"MLA latents; per-head K/V would be {per_head} ({1 - moved / per_head:.0%} less moved)"
    else:
        how = f"{c['kv_offload_layout']} pages hold per-head K/V already: the same layout"
    state = c["kv_offload_state_bytes_per_block"]
    extra = f", plus {_mib(state)} of recurrent state per block with a snapshot" if state else ""
    lines.append(f"offload moves {moved} bytes/token (target + drafter rows, {how}){extra}")
    return lines


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    add_model_arg(p)
    add_speculative_config_arg(p)
    add_max_tokens_arg(p, max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_seed_arg(p)
    add_precision_args(p)
    p.add_argument(
        "--attention-backend",
        default=None,
        help="target attention: torch | sdpa | a vLLM backend name (runs as sdpa here); default: each model's",
    )
    add_prefix_caching_arg(p)
    add_kv_offload_args(p)
    add_threads_arg(p)


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with (or without) speculative decoding")
    p.add_argument("prompt", nargs="?", default="def fibonacci(n):\n", help="prompt text")
    _add_sampling_args(p, 128, 0.0)
    p.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_const",
        const=True,
        default=None,
        help="send the prompt as one user turn through the model's chat template (the default when its tokenizer "
        "has one, except for base models pretrained by `dspark train-target`, such as the bundled kimi-k3-mini)",
    )
    chat.add_argument(
        "--no-chat-template",
        "--raw",
        dest="chat",
        action="store_const",
        const=False,
        help="send the prompt as raw text (no chat template)",
    )
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run without speculation and print the speed-up (default on; --no-compare skips the second run)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, chat_template: whether the template was applied, τ, tokens/s)",
    )
    p.set_defaults(func=cmd_generate)


def cmd_verify_lossless(args: argparse.Namespace) -> int:
    from dspark.llm import build_engines, engine_configs

    depths = parse_depths(args.context_depths)
    apply_threads(args)
    model, demo = model_or_demo(args.model)
    spec = default_spec(args, model if demo else None) or {"method": "dspark"}
    spec.setdefault("speculation_guard", False)  # every step drafts: the rounds are what is verified
    spec_engine, ar_engine = build_engines(
        model,
        [spec, None],
        *engine_configs(
            max_model_len=_depth_model_len(model, depths, args.max_tokens + 16),
            dtype=args.dtype,
            quantization=args.quantization,
            attention_backend=args.attention_backend,
            enable_prefix_caching=args.enable_prefix_caching,
            **kv_offload_kwargs(args),
        ),
    )
    precision = spec_engine.precision
    print(
        f"verify-lossless: target {spec_engine.model_dir}, drafter {spec_engine.draft_dir}, greedy, "
        f"{args.max_tokens} new tokens per prompt, every step drafting (speculation guard off); "
        f"{precision.describe()} (what generate and serve run with the same --dtype and --quantization)"
    )
    sets = _lossless_prompt_sets(args, spec_engine, depths)
    if not sets:
        raise ValueError("every --context-depths value was skipped; nothing was verified")
    bad = sum(_compare_outputs(label, ids, ar_engine, spec_engine, args.max_tokens) for label, ids in sets)
    if args.invariance:
        bad += sum(_compare_alone(label, ids, ar_engine, spec_engine, args.max_tokens) for label, ids in sets)
    verdict = "identical" if not bad else f"{bad} prompt(s) differ"
    print(f"verify-lossless ({precision.dtype}, quantization {precision.quantization}): {verdict}")
    return 1 if bad else 0


def _depth_model_len(model: str | Path | None, depths: list[int], extra: int) -> int | None:
    """A context length that holds the deepest depth plus ``extra`` tokens, up to the target's positions; None where
    the engine's default (the target's positions, at most 32,768) already does."""
    if not depths or max(depths) + extra <= 32768:
        return None
    from dspark.llm import resolve_model
    from dspark.models.loading import read_target_config

    return min(max(depths) + extra, read_target_config(resolve_model(model)).max_position_embeddings)


def parse_depths(text: str | None) -> list[int]:
    """'1024,4096' → [1024, 4096]; '' or None → []."""
    if not text:
        return []
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--context-depths {text!r}: give comma-separated token counts, e.g. 1024,4096") from e
    if any(d < 2 for d in depths):
        raise ValueError(f"--context-depths {text!r}: every depth must be at least 2 tokens")
    return depths


def _lossless_prompt_sets(args: argparse.Namespace, engine, depths: list[int]) -> list[tuple[str, list[list[int]]]]:
    """(label, prompt ids) per set: the dataset's prompts as they are, or padded with real preceding code to each
    depth (as `dspark bench --context-depths` does); depths the target cannot hold are skipped, saying why."""
    from dspark.bench.datasets import depth_prompts, read_bench_prompts, read_sources

    tok = engine.tokenizer
    prompts = read_bench_prompts(args.dataset, args.num_prompts, getattr(tok, "apply_chat_template", None))
    if not depths:
        return [("", [list(tok.encode(p.text, add_special_tokens=not p.is_chat)) for p in prompts])]
    sources = read_sources(args.context_source) if args.context_source else read_sources()
    sets = []
    room = engine.max_model_len - args.max_tokens - engine.K - 1  # prompt tokens that leave room for the output
    for depth in depths:
        if depth > engine.max_model_len or room < 2:
            print(
                f"context depth {depth}: skipped: {depth} prompt tokens + --max-tokens {args.max_tokens} exceed "
                f"the target's max_model_len {engine.max_model_len}"
            )
            continue
        if depth > room:  # the target's whole window: the prompt leaves room for the new tokens
            print(f"context depth {depth}: prompts padded to {room} tokens, so that --max-tokens {args.max_tokens} "
                  f"and a draft block fit in max_model_len {engine.max_model_len}")  # fmt: skip
        sets.append((f"depth {depth}", [list(ids) for ids in depth_prompts(prompts, min(depth, room), tok, sources)]))
    return sets


def _compare_outputs(label: str, ids: list[list[int]], ar_engine, spec_engine, max_tokens: int) -> int:
    """Greedy target-only vs speculative output on these prompts, token by token; print and count mismatches."""
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ref = LLM.from_engine(ar_engine).generate(ids, params)
    got = LLM.from_engine(spec_engine).generate(ids, params)
    where = f"{label} " if label else ""  # a context depth, or nothing for the prompts as given
    bad = 0
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.token_ids != b.token_ids:
            bad += 1
            j = next(
                (k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                min(len(a.token_ids), len(b.token_ids)),
            )
            a_ids, b_ids = a.token_ids[j : j + 5], b.token_ids[j : j + 5]
            print(f"{where}prompt {i}: MISMATCH at output token {j}: target-only {a_ids} vs speculative {b_ids}")
        else:
            print(f"{where}prompt {i}: identical ({len(ids[i])} prompt tokens, {len(a.token_ids)} output tokens)")
    drafts = sum(o.spec_metrics.get("num_drafts", 0) for o in got)
    accepted = sum(o.spec_metrics.get("num_accepted_tokens", 0) for o in got)
    tau = 1 + accepted / drafts if drafts else 0.0
    head = f"{label}: " if label else ""
    print(f"{head}{len(ids) - bad}/{len(ids)} prompts identical token by token; τ = {tau:.2f}")
    return bad


def _compare_alone(label: str, ids: list[list[int]], ar_engine, spec_engine, max_tokens: int) -> int:
    """Invariance: each prompt run alone (concurrency 1), target-only and speculative, then all of them prefilled in
    16-token chunks, then all of them again after a first run left their blocks cached (each prompt hits up to its
    last full block), against the target-only output of all the prompts run together in one budget; print and count
    the prompts where any differs."""
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    together = [o.token_ids for o in LLM.from_engine(ar_engine).generate(ids, params)]
    differ: list[set[str]] = [set() for _ in ids]
    for i, prompt in enumerate(ids):
        for name, e in (("alone, target-only", ar_engine), ("alone, speculative", spec_engine)):
            if LLM.from_engine(e).generate([prompt], params)[0].token_ids != together[i]:
                differ[i].add(name)
    for name, engine, runs in _split_engines(ar_engine):
        llm = LLM.from_engine(engine)
        for _ in range(runs - 1):
            llm.generate(ids, params)
        for i, out in enumerate(llm.generate(ids, params)):
            if out.token_ids != together[i]:
                differ[i].add(name)
    head = f"{label} " if label else ""
    for i, names in enumerate(differ):
        print(f"{head}prompt {i}: " + (f"DIFFERS ({', '.join(sorted(names))})" if names else "identical however run"))
    bad = sum(bool(names) for names in differ)
    print(f"{label + ': ' if label else ''}{len(ids) - bad}/{len(ids)} prompts identical alone, in 16-token chunks "
          "and from the prefix cache as all together")  # fmt: skip
    return bad


def _split_engines(ar_engine) -> list[tuple[str, object, int]]:
    """Target-only engines over the same loaded target that split the same work otherwise: (name, engine, how many
    times to run the prompts; the last run is compared)."""
    from dataclasses import replace

    from dspark.config import CacheConfig
    from dspark.engine.engine import Engine

    def variant(cache: bool = False, **cfg: int) -> Engine:
        return Engine(ar_engine.target, engine_config=replace(ar_engine.cfg, **cfg),
                      cache_config=CacheConfig(enable_prefix_caching=cache), tokenizer=ar_engine.tokenizer)  # fmt: skip

    return [("in 16-token chunks", variant(max_num_batched_tokens=16), 1), ("prefix-cache hits", variant(True), 2)]


def add_verify_lossless(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify-lossless", help="speculative greedy == target-only greedy, token by token")
    p.add_argument("--dataset", required=True, help="JSONL prompts")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument(
        "--context-depths",
        default=None,
        help="pad prompts with real preceding code to N tokens and verify at each depth, e.g. 1024,4096,16384",
    )
    p.add_argument("--context-source", default=None, help="corpus-format JSONL of code used as padding")
    p.add_argument(
        "--invariance",
        action="store_true",
        help="also run each prompt alone (target-only and speculative), all of them in 16-token prefill chunks and "
        "from the prefix cache, and require the output of all of them run together: a row's result must not depend "
        "on what shares its forward, the chunks its prompt was prefilled in or where a cached prefix ends",
    )
    add_max_tokens_arg(p, 64)
    add_model_arg(p)
    add_speculative_config_arg(p)
    add_precision_args(p)  # the defaults generate and serve run with: what is verified is what runs
    p.add_argument(
        "--attention-backend",
        default=None,
        help="target attention: torch | sdpa | a vLLM backend name (runs as sdpa here); default: each model's",
    )
    add_prefix_caching_arg(p)
    add_kv_offload_args(p)
    add_threads_arg(p)
    p.set_defaults(func=cmd_verify_lossless, no_spec=False)


# ---- registry -------------------------------------------------------------------------------------------

# every subcommand: name -> the module whose ``add_parser(sub)`` registers it (tests/test_cli_options.py checks
# that the two agree)
SUBCOMMANDS = {
    "generate": "dspark.cli",
    "verify-lossless": "dspark.cli",
    "check": "dspark.cli",
    "roster": "dspark.cli",
    "train-target": "dspark.train.pretrain_cli",
    "serve": "dspark.serve.cli",
    "serve-proxy": "dspark.serve.cli",
    "loadtest": "dspark.serve.loadtest",
    "bench": "dspark.bench.cli",
    "profile": "dspark.bench.profile",
    "calibrate": "dspark.train.calibrate",
    "train-draft": "dspark.train.draft_cli",
    "draft-data": "dspark.train.draft_cli",
    "prepare-features": "dspark.train.draft_cli",
    "draft-vocab": "dspark.train.draft_cli",
}

# former subcommands, now sources of draft-data: a pointer to the new spelling, not a second implementation
RENAMED = {
    "chat-data": "draft-data --source instructions-hf",
    "sharegpt-data": "draft-data --source sharegpt-text (--source FILE is now --sharegpt-file FILE, "
    "--min-supervised --min-response-tokens, --max-conversations --num-prompts)",
    "sharegpt-regen": "draft-data --source sharegpt (--source FILE is now --sharegpt-file FILE)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_generate(sub)
    add_verify_lossless(sub)
    add_check(sub)
    add_roster(sub)


def version_text() -> str:
    """``dspark --version``: the package, torch and the CPU kernels torch dispatches to on this machine."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import dspark

    try:
        ours = version("dspark")
    except PackageNotFoundError:  # running from a source tree that is not installed
        ours = dspark.__version__
    import torch

    cpu = torch.backends.cpu.get_cpu_capability()
    return f"dspark {ours} (torch {torch.__version__}, CPU capability {cpu}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """Like argparse's "version" action, but the text (which imports torch) is built only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for MLA models")
    parser.add_argument(
        "--version", action=_VersionAction, help="print the dspark and torch versions and the CPU capability, and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(SUBCOMMANDS.values()):
        importlib.import_module(module).add_parser(sub)
    return parser


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in RENAMED:
        print(f"dspark {argv[0]}: error: it is now `dspark {RENAMED[argv[0]]}`", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # SIGTERM exits through the exit handlers
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"dspark {args.command}: error: {e}", file=sys.stderr)
        if getattr(e, "fix", ""):  # a ModelNotFoundError says what to do separately
            print(f"fix: {e.fix}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
