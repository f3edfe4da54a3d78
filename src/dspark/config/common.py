"""What every config module shares: ``ConfigError``, reading ``config.json`` and reading its keys.

A config class's ``from_dict`` reads its required keys with ``required_ints`` and its optional ones with ``given``:
a key that is missing (or null) is left out of the constructor call, so the dataclass field's default applies.
Each default therefore lives in one place, the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# config.json key that marks a model as explicitly random test weights (dspark.models.tiny): only such models
# may run without a tokenizer file (bytes stand in for text)
RANDOM_WEIGHTS_KEY = "dspark_random_weights"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the key and the fix."""


REDUCED_VOCAB_FIX = (
    "checkpoints with their own reduced lm_head (d2t maps) are not supported: set it to vocab_size and reduce at "
    "inference instead (draft_vocab.json, speculative config draft_vocab_size)"
)


def fail(source: str, key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"{source}: key '{key}' = {value!r} is invalid: {fix}")


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object from ``path`` (a file, or a directory holding ``config.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: file not found; pass a model directory containing config.json")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e}); fix the file or re-download it") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    return data


def read_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """(the JSON object, the file it came from): what a config class's ``load`` passes to its ``from_dict``."""
    p = Path(path)
    return read_json(p), str(p / "config.json" if p.is_dir() else p)


def missing(source: str, key: str) -> ConfigError:
    return ConfigError(f"{source}: required key '{key}' is missing; add it to config.json")


def require(d: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in d or d[key] is None:
        raise missing(source, key)
    return d[key]


def required_ints(d: Mapping[str, Any], source: str, *keys: str) -> dict[str, int]:
    """The integer keys a config cannot do without, checked in order (the first missing one is named)."""
    return {key: int(require(d, key, source)) for key in keys}


def as_is(value: Any) -> Any:
    return value


def token_ids(value: Any) -> Any:
    """A token id field as config.json writes it (an int or a list) in dataclass form (an int or a tuple)."""
    return tuple(int(e) for e in value) if isinstance(value, list) else value


def given(d: Mapping[str, Any], casts: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """Keyword arguments from the keys of ``casts`` that ``d`` holds (not null), each converted by its cast. A missing
    key is left out, so the dataclass field's default applies: the default has one home, the field."""
    return {key: cast(d[key]) for key, cast in casts.items() if d.get(key) is not None}


def positive(source: str, **values: int | float | None) -> None:
    for k, v in values.items():
        if v is not None and (not isinstance(v, int | float) or v <= 0):
            raise fail(source, k, v, "must be a positive number")
