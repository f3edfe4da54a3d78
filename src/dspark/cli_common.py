"""Helpers every ``dspark`` subcommand shares: comma-list argparse types, the model dir (or a tiny demo pair) and
the default speculative config. A leaf module: subcommand modules import it, never ``dspark.cli`` itself."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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


def model_or_demo(model: str | None) -> tuple[str | None, bool]:
    """The model dir; without one and without the bundled pair, a tiny random pair built on the fly (demo)."""
    from dspark.llm import bundled_available

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


def default_spec(args: argparse.Namespace, demo_dir: str | None) -> str | None:
    """--speculative-config as given; else DSpark with the bundled, shipped (or demo) drafter; None for --no-spec
    or a user model without a config."""
    if getattr(args, "no_spec", False):
        return None
    if args.speculative_config:
        return args.speculative_config
    if demo_dir is not None:
        return json.dumps({"method": "dspark", "model": str(Path(demo_dir).parent / "draft")})
    if args.model is None or _has_shipped_drafter(args.model):
        return json.dumps({"method": "dspark"})
    return None


def _has_shipped_drafter(model: str) -> bool:
    """A target with drafters shipped in the package (e.g. the ``smollm2-135m-instruct`` alias)."""
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.config import ConfigError
    from dspark.llm import shipped_drafts

    try:
        return shipped_drafts(resolve_model_ref(model, role="model")) is not None
    except ConfigError:
        return False  # the command's own loading reports a bad reference
