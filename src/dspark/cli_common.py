"""Helpers every ``dspark`` subcommand shares: comma-list and JSON argparse types, the shared options (``--model``,
``--speculative-config``, ``--seed``, ``--max-tokens``, ``--threads``, ``--dtype``, ``--quantization``: each defined
only here), the model dir (or a tiny demo pair) and the default speculative config. A leaf module:
subcommand modules import it, never ``dspark.cli`` itself."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dspark.config import ConfigError

# the seconds-long smoke path from a clean checkout (docs/training.md): each --tiny command finds what the one before
# it wrote: train-target --tiny → draft-data --tiny → train-draft --tiny → check / generate
TINY_DATA_DIR = "runs/data/tiny"  # a small corpus (<split>.jsonl), its 512-token BPE and token arrays
TINY_TARGET_DIR = "runs/tiny-target"  # train-target --tiny (the model in <dir>/export)
TINY_DRAFT_DATA = "runs/tiny-draft-data"  # draft-data --tiny
TINY_DRAFT_DIR = "runs/tiny-draft"  # train-draft --tiny (the drafter in <dir>/export)


def tiny_data(data_dir: str = TINY_DATA_DIR) -> str:
    """The tiny data dir, built on first use (a sub-second stdlib sample, its 512-token BPE, the corpus splits)."""
    from dspark.train.tokenizer import build_tiny_data

    if not all((Path(data_dir) / f).is_file() for f in ("train.npy", "train.jsonl", "validation.jsonl")):
        print(f"--tiny: building a small corpus and tokenizer in {data_dir} (once)", file=sys.stderr)
        build_tiny_data(data_dir)
    return data_dir


def require_tiny(path: str, command: str) -> str:
    """``path`` when the previous step of the tiny path wrote it, else an error naming that step."""
    if not Path(path).exists():
        raise ConfigError(f"{path} does not exist yet; run `dspark {command}` first (the --tiny smoke path)")
    return path


def int_list(text: str) -> tuple[int, ...]:
    """argparse type for comma-separated integers, e.g. '1,4,16'."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16; got {text!r}") from e


def float_list(text: str) -> tuple[float, ...]:
    """argparse type for comma-separated numbers, e.g. '0,1'."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0,0.7,1; got {text!r}") from e


def json_object(text: str) -> dict[str, Any]:
    """argparse type for a JSON-valued option (``--speculative-config``): inline JSON, or ``@path`` to read the
    JSON from a file (``@-``: standard input). Parsed once here, so everything after sees a dict."""
    source = "the value"
    if text.startswith("@"):
        name = text[1:]
        source = "standard input" if name == "-" else name
        try:
            text = sys.stdin.read() if name == "-" else Path(name).expanduser().read_text()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{text}: cannot read {name} ({e.strerror or e})") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        where = "" if source == "the value" else f" in {source}"
        raise argparse.ArgumentTypeError(
            f'not valid JSON{where} ({e}): {text[:200]!r}; give a JSON object like \'{{"method": "dspark"}}\' '
            "or @file.json"
        ) from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text[:200]!r}")
    return value


# ---- the options several subcommands share: each defined here once ----------------------------------------------

MODEL_HELP = (
    "target dir, .gguf, bundled name (kimi-k3-mini, k3-mini), alias (smollm2-135m-instruct) or hub id (default: the "
    "bundled kimi-k3-mini pair)"
)
SPEC_HELP = (
    'vLLM-style JSON, or @FILE to read it from a file, e.g. \'{"method": "dspark"}\'; "model" takes a drafter dir, '
    "a bundled drafter name (kimi-k3-mini-dspark, ...) or a hub id"
)
THREADS_HELP = (
    "CPU threads for torch (default: DSPARK_NUM_THREADS, else measured once per machine and model and cached under "
    "$DSPARK_CACHE)"
)
SHARED_OPTIONS = ("--model", "--speculative-config", "--seed", "--max-tokens", "--threads", "--num-threads")


def add_model_arg(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """``--model``: the target (a reference ``dspark.checkpoint.resolve`` resolves); None: the command's default."""
    p.add_argument("--model", default=None, help=help)


def add_speculative_config_arg(p: argparse.ArgumentParser, help: str = SPEC_HELP) -> None:
    """``--speculative-config``: a JSON object (inline or ``@file``), parsed once by the ``json_object`` type."""
    p.add_argument("--speculative-config", type=json_object, default=None, help=help)


def add_seed_arg(p: argparse.ArgumentParser, default: int | None = None, help: str | None = None) -> None:
    """``--seed``: the command's random seed; ``default`` is the seed of the config the command builds."""
    p.add_argument("--seed", type=int, default=default, help=help)


def add_max_tokens_arg(p: argparse.ArgumentParser, default: int | None, help: str | None = None) -> None:
    """``--max-tokens``: new tokens per request; ``default`` comes from the config the command builds."""
    p.add_argument("--max-tokens", type=int, default=default, help=help)


def add_threads_arg(
    p: argparse.ArgumentParser, dest: str = "threads", default: int | None = None, help: str = THREADS_HELP
) -> None:
    """``--threads N`` (also spelled ``--num-threads``): torch's intra-op threads, a positive count; None: the
    measured per-machine default (dspark.threads) or what the command's config says."""
    flags = ("--threads", "--num-threads") if dest == "threads" else ("--num-threads", "--threads")
    p.add_argument(*flags, dest=dest, type=positive_int, default=default, metavar="N", help=help)


def add_device_arg(p: argparse.ArgumentParser, dest: str = "device") -> None:
    """``--device auto|cpu|cuda``: where a training-side command runs its tensors (``dspark.device``)."""
    p.add_argument(
        "--device",
        dest=dest,
        default=None,
        metavar="auto|cpu|cuda",
        help="where the tensors live: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N; on CUDA "
        "the PyTorch path runs with bf16 autocast (the native kernels are CPU-only)",
    )


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--quantization``, defaults from ``EngineConfig`` ("auto": chosen for the machine and model,
    see dspark.precision)."""
    from dspark.config import DTYPE_CHOICES, QUANTIZATIONS, EngineConfig

    p.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=DTYPE_CHOICES,
        help="weights, activations and KV pages (default auto: float32 for a quantized target, else bfloat16 where "
        "the CPU multiplies it natively (AVX-512 BF16 / AMX), else float32)",
    )
    p.add_argument(
        "--quantization",
        default=EngineConfig.quantization,
        choices=QUANTIZATIONS,
        help="the target's weights (default auto: gguf for a model from a .gguf file when the native kernels "
        "run, else none); gguf serves the file's Q4_0/Q4_1/Q8_0 blocks as stored in llama.cpp's arithmetic (int8 "
        "activations), gguf-exact against exact fp32 activations (the reference)",
    )


def add_prefix_caching_arg(p: argparse.ArgumentParser) -> None:
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (vLLM's flags), default from ``CacheConfig``."""
    from dspark.config import CacheConfig

    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="share the KV pages of full blocks between requests with the same prefix (a system prompt, an earlier "
        "turn) and keep them after use until the pool needs them (vLLM's automatic prefix caching; default: "
        f"{'on' if CacheConfig.enable_prefix_caching else 'off'})",
    )


GIB = 2**30


def add_kv_offload_args(p: argparse.ArgumentParser) -> None:
    """``--kv-offload-cpu-gib``, ``--kv-offload-dir``, ``--kv-offload-disk-gib`` (defaults from ``CacheConfig``)."""
    from dspark.config import CacheConfig

    p.add_argument(
        "--kv-offload-cpu-gib",
        type=float,
        default=CacheConfig.kv_offload_cpu_bytes / GIB,
        help="with --enable-prefix-caching: keep the cached blocks the KV pool evicts in this much CPU memory, least "
        "recently used out first, and load them back on a later hit (default: 0, off)",
    )
    p.add_argument(
        "--kv-offload-dir",
        default=CacheConfig.kv_offload_dir,
        help="with --enable-prefix-caching: a directory for blocks beyond the CPU tier (or all evicted blocks "
        "without one), one checksummed file per block in a subdirectory removed at exit (default: no disk tier)",
    )
    p.add_argument(
        "--kv-offload-disk-gib",
        type=float,
        default=CacheConfig.kv_offload_disk_bytes / GIB,
        help=f"bytes the --kv-offload-dir tier may hold, least recently used deleted first (default: "
        f"{CacheConfig.kv_offload_disk_bytes / GIB:g})",
    )


def kv_offload_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``build_engines`` keywords of the ``--kv-offload-*`` flags (GiB → bytes)."""
    out: dict[str, Any] = {"kv_offload_dir": args.kv_offload_dir}
    for flag, key in (("cpu", "kv_offload_cpu_bytes"), ("disk", "kv_offload_disk_bytes")):
        gib = getattr(args, f"kv_offload_{flag}_gib")
        if not gib >= 0:
            raise ConfigError(f"--kv-offload-{flag}-gib {gib} is invalid: give a size in GiB >= 0 (0: no such tier)")
        out[key] = round(gib * GIB)
    return out


def apply_threads(args: argparse.Namespace) -> None:
    """Set the ``--threads`` choice, when given, before any model loads."""
    if getattr(args, "threads", None) is not None:
        from dspark.threads import set_threads

        set_threads(args.threads, "--threads")


def positive_int(text: str) -> int:
    """argparse type for a count >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def model_or_demo(model: str | None) -> tuple[str | None, bool]:
    """The model dir; without one and without the bundled pair, a tiny random pair built on the fly (demo)."""
    from dspark.checkpoint.resolve import bundled_available

    if model is not None or bundled_available():
        return model, False
    import tempfile

    from dspark.models.tiny import write_tiny_pair

    d = Path(tempfile.mkdtemp(prefix="dspark-demo-"))
    target_dir, draft_dir = write_tiny_pair(d)
    print(
        "[demo] the bundled model pair is not installed: using a TINY RANDOM target+drafter built on the fly "
        f"in {d} (the text is gibberish; speed and τ are not meaningful)",
        file=sys.stderr,
    )
    return str(target_dir), True


def default_spec(args: argparse.Namespace, demo_dir: str | None) -> dict[str, Any] | None:
    """The speculative config as a dict: --speculative-config (already parsed by the ``json_object`` type of
    ``add_speculative_config_arg``); else DSpark with the bundled, shipped (or demo) drafter; None for --no-spec or a
    user model without a config."""
    if getattr(args, "no_spec", False):
        return None
    if args.speculative_config:
        return dict(args.speculative_config)
    if demo_dir is not None:
        return {"method": "dspark", "model": str(Path(demo_dir).parent / "draft")}
    if args.model is None or _has_shipped_drafter(args.model):
        return {"method": "dspark"}
    return None


def _has_shipped_drafter(model: str) -> bool:
    """A target with drafters shipped in the package (e.g. the ``smollm2-135m-instruct`` alias)."""
    from dspark.checkpoint.resolve import resolve_model_ref, shipped_drafts

    try:
        return shipped_drafts(resolve_model_ref(model, role="model")) is not None
    except ConfigError:
        return False  # the command's own loading reports a bad reference
