"""The ``dspark`` command line: argparse subcommands that parse, build a config and call the library."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from dspark.config import ConfigError


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(f"dspark {name}: not yet available in this version", file=sys.stderr)
        return 2

    return run


# ---- roster ---------------------------------------------------------------------------------------------


def cmd_roster(args: argparse.Namespace) -> int:
    from dspark.checkpoint.roster import format_roster, roster_json
    from dspark.config import DraftConfig
    from dspark.models.loading import draft_roster, read_config_any, target_roster

    cfg = read_config_any(args.config)
    roster = draft_roster(cfg) if isinstance(cfg, DraftConfig) else target_roster(cfg)
    if args.json:
        print(json.dumps(roster_json(roster)))
    else:
        print(format_roster(roster))
    return 0


def add_roster(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roster", help="expected tensor names, shapes and parameter count (meta device)")
    p.add_argument("config", help="config.json of a target (deepseek_v3) or a drafter (k3_dspark), or its dir")
    p.add_argument("--json", action="store_true", help='print {"tensors": {name: [dims]}, "num_params": int}')
    p.set_defaults(func=cmd_roster)


# ---- registry -------------------------------------------------------------------------------------------

PLANNED = ("generate", "serve", "bench", "verify-lossless", "check", "train-target", "train-draft", "calibrate", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding for MLA models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_roster(sub)
    registered = set(sub.choices)
    for name in PLANNED:
        if name not in registered:
            sub.add_parser(name, help="(not yet available)").set_defaults(func=_not_yet(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"dspark {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

