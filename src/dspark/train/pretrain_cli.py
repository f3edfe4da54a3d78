"""``dspark train-target``: pretrain the small K3-style target (k3-mini, or the kimi-k3-mini hybrid) on the
tokenized corpus; its defaults live in ``dspark.train.pretrain_config``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.cli_common import TINY_TARGET_DIR, add_seed_arg, add_threads_arg, tiny_data
from dspark.config import ConfigError


def cmd_train_target(args: argparse.Namespace) -> int:
    import os

    # OpenMP threads that sleep instead of spinning: on a shared 2-core machine spinning threads stall
    # each other (set before torch is imported to take effect)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dataclasses import replace

    from dspark.train.pretrain import train_target
    from dspark.train.pretrain_config import PretrainConfig, kimi_k3_mini_config, tiny_pretrain_config

    default = kimi_k3_mini_config() if args.kimi_k3_mini else PretrainConfig()
    data_dir, out_dir = args.data_dir or default.data_dir, args.out_dir or default.out_dir
    if args.tiny:
        data_dir = args.data_dir or tiny_data()
        out_dir = args.out_dir or ("runs/tiny-kimi-target" if args.kimi_k3_mini else TINY_TARGET_DIR)
        arch = {"architecture": default.architecture} if args.kimi_k3_mini else {}
        cfg = tiny_pretrain_config(data_dir, out_dir, **arch)
    else:
        _require_pretrain_data(data_dir)
        cfg = replace(default, data_dir=data_dir, out_dir=out_dir)
    overrides = {
        k: getattr(args, k)
        for k in ("max_minutes", "max_steps", "seq_len", "batch_size", "lr", "warmup_steps", "seed")
        + ("eval_interval", "ckpt_interval", "num_threads", "init_from", "yarn_factor")
        + ("original_max_position_embeddings", "eval_seq_len", "eval_max_windows")
        if getattr(args, k) is not None
    }
    if args.no_time_limit:
        overrides["max_minutes"] = None
    if args.tiny and "max_minutes" in overrides and "max_steps" not in overrides:
        overrides["max_steps"] = None
    cfg = replace(cfg, **overrides, progress=not args.quiet)
    try:
        result = train_target(cfg, resume=args.resume)
    except FileExistsError as e:
        print(f"dspark train-target: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: v for k, v in vars(result).items() if k != "losses"}))
    return 0


PRETRAIN_DATA_FILES = ("train.npy", "validation.npy")  # what dspark.train.tokenizer writes and train-target reads


def _require_pretrain_data(data_dir: str) -> None:
    """Refuse, before anything loads, a data dir the tokenizer step has not written (a fresh clone has no runs/),
    naming the two commands that build it and the seconds-long --tiny run that needs none."""
    missing = [f for f in PRETRAIN_DATA_FILES if not (Path(data_dir) / f).is_file()]
    if not missing:
        return
    corpus = "runs/data/corpus"
    raise ConfigError(
        f"{data_dir} has no {' / '.join(missing)} (the tokenized corpus); build it with "
        f"`python -m dspark.train.corpus {corpus}` then `python -m dspark.train.tokenizer {corpus} {data_dir} "
        "--vocab-size 8192` (docs/training.md, steps 1-2), pass --data-dir DIR, or try `dspark train-target --tiny`, "
        "a seconds-long run that builds its own small data"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    # defaults live in dspark.train.pretrain_config.PretrainConfig (imported only when the command runs)
    p = sub.add_parser(
        "train-target",
        help="pretrain the small K3-style MLA target (DeepSeek-V3 format) on the tokenized corpus",
        description="Checkpoints to OUT_DIR/checkpoint/last.pt; exports OUT_DIR/export "
        "(config.json, model.safetensors, tokenizer, training_log.json). Unset options take the "
        "defaults of dspark.train.pretrain_config.PretrainConfig (or tiny_pretrain_config with --tiny).",
    )
    p.add_argument(
        "--data-dir",
        help="train/validation .npy + tokenizer.json (default runs/data/bpe8k; with --tiny runs/data/tiny, built "
        "on first use)",
    )
    p.add_argument(
        "--out-dir",
        help="checkpoint and export directory (default runs/target, runs/kimi-target with --kimi-k3-mini; "
        "runs/tiny-target / runs/tiny-kimi-target with --tiny)",
    )
    p.add_argument("--max-minutes", type=float, help="wall-clock budget across resumes (default 55)")
    p.add_argument("--no-time-limit", action="store_true", help="no wall-clock budget (needs --max-steps)")
    p.add_argument("--max-steps", type=int, help="cosine horizon (default: derived from --max-minutes)")
    p.add_argument("--seq-len", type=int, help="training window in tokens (default 512)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 4)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 100)")
    p.add_argument("--eval-interval", type=int, help="steps between validation passes (default 250)")
    p.add_argument("--ckpt-interval", type=int, help="steps between checkpoints (default 250)")
    add_seed_arg(p, help="init and data-order seed (default 0)")
    add_threads_arg(p, dest="num_threads", help="torch threads (default min(2, cpus))")
    p.add_argument("--resume", action="store_true", help="continue exactly from OUT_DIR/checkpoint/last.pt")
    p.add_argument(
        "--init-from",
        metavar="MODEL_DIR",
        help="continued pre-training: start from this exported target (same shapes; YaRN may differ)",
    )
    p.add_argument("--yarn-factor", type=float, help="YaRN factor: max positions = original window x factor (4)")
    p.add_argument("--original-max-position-embeddings", type=int, help="YaRN's original window (default: --seq-len)")
    p.add_argument("--eval-seq-len", type=int, help="validation window (default: --seq-len)")
    p.add_argument("--eval-max-windows", type=int, help="validation windows at most (default: all)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run with a tiny model; needs no prepared data (builds runs/data/tiny itself)",
    )
    p.add_argument(
        "--kimi-k3-mini",
        action="store_true",
        help="the K3-shaped hybrid (kimi_linear: KDA + MLA-NoPE 3:1, SiTU, latent MoE, AttnRes; "
        "default out-dir runs/kimi-target) instead of the DeepSeek-V3-shaped k3-mini",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    p.add_argument("--json", action="store_true", help="print the TrainResult (without losses) as JSON")
    p.set_defaults(func=cmd_train_target)
