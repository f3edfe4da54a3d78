"""config.json keys the config class does not know (``ConfigKeys``, the speculative config's rule too).

The rule: a key that is neither read by the model's config class, nor one of its family's official config.json
keys, nor one transformers writes into every config, is
- a problem when it is close to a key the class reads that config.json does not set: a misspelling, whose value is
  ignored while the key it meant silently takes its default (``kv_lora_rnk`` for ``kv_lora_rank``);
- a note otherwise: a key nobody reads (a newer format's, or a comment), listed as ignored."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.checkpoint.io import Problem
from dspark.config import DraftConfig
from dspark.config.common import ConfigKeys, did_you_mean
from dspark.doctor.context import Context


def misspelled_keys(keys: ConfigKeys, raw: Mapping[str, Any], parsed: Any, config_file: Path) -> list[Problem]:
    """One problem per unknown key of ``raw`` that is close to a key ``keys`` reads and ``raw`` does not set."""
    problems = []
    for key, matches in keys.unknown(raw).items():
        if not matches:
            continue
        meant = matches[0]
        value = getattr(parsed, meant, None) if parsed is not None else None
        default = f" ({value!r})" if isinstance(value, int | float | str | bool) else ""
        problems.append(
            Problem(
                f"{config_file}: unknown key '{key}'{did_you_mean(matches)}: dspark does not read it, "
                f"so '{meant}' takes its default{default}",
                f"rename '{key}' to '{meant}' in {config_file}",
            )
        )
    return problems


def ignored_keys_note(keys: ConfigKeys, raw: Mapping[str, Any], config_file: Path) -> str | None:
    """The unknown keys that misspell nothing, as a note: dspark ignores them."""
    ignored = [k for k, matches in keys.unknown(raw).items() if not matches]
    if not ignored:
        return None
    return f"{config_file}: keys dspark does not read (ignored): {', '.join(ignored)}"


def ignored_keys_notes(ctx: Context) -> list[str]:
    """Step 1's notes: the keys of the draft's and the (natively served) target's config.json nobody reads."""
    notes = []
    raw = ctx.draft_config_read[0] if ctx.has_draft else None
    if raw is not None and not ctx.draft_target_architectures:
        notes.append(ignored_keys_note(DraftConfig.KEYS, raw, ctx.draft_dir / "config.json"))
    spec = ctx.target_spec.spec
    if spec is not None and spec.family is not None and spec.family.is_target:
        notes.append(ignored_keys_note(spec.family.config.KEYS, spec.raw, spec.config_file))
    return [n for n in notes if n is not None]
