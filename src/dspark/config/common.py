"""What every config module shares: ``ConfigError``, reading ``config.json`` and reading its keys.

A config class's ``from_dict`` reads its required keys with ``required_ints`` and its optional ones with ``given``:
a key that is missing (or null) is left out of the constructor call, so the dataclass field's default applies.
Each default therefore lives in one place, the field.

Unknown keys are judged in one place, ``ConfigKeys``: each config class lists the keys its ``from_dict`` reads and
the keys of its family's official config.json it lets pass unread. The speculative config refuses any other key; the
doctor (``dspark check``) reports a model config.json's other keys (see ``ConfigKeys.unknown``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------- known and unknown keys

# How similar (difflib ratio) an unknown key must be to a known one to be taken for its misspelling: one letter
# dropped, doubled or swapped in a key of 8 or more letters (kv_lora_rnk -> kv_lora_rank: 0.96, hiden_size: 0.95).
MISSPELLING_CUTOFF = 0.8


def close_keys(key: str, known: Iterable[str]) -> list[str]:
    """The known keys ``key`` is probably a misspelling of, closest first (at most 3)."""
    return difflib.get_close_matches(key, sorted(known), n=3, cutoff=MISSPELLING_CUTOFF)


def did_you_mean(matches: Collection[str]) -> str:
    """`` (did you mean 'a' or 'b'?)``, or '' without a match."""
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""


# Keys any transformers config.json may carry whatever its family: PretrainedConfig's own attributes, the
# generation defaults older versions saved into it, and save metadata. Families add their official keys to these.
HF_CONFIG_KEYS = frozenset(
    {
        "_name_or_path", "_attn_implementation", "_attn_implementation_autoset", "_commit_hash", "add_cross_attention",
        "architectures", "auto_map", "bad_words_ids", "begin_suppress_tokens", "chunk_size_feed_forward",
        "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample", "dtype",
        "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task",
        "forced_bos_token_id", "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id",
        "length_penalty", "max_length", "min_length", "model_type", "no_repeat_ngram_size", "num_beam_groups",
        "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores",
        "prefix", "problem_type", "pruned_heads", "quantization_config", "remove_invalid_values",
        "repetition_penalty", "return_dict", "return_dict_in_generate", "sep_token_id", "suppress_tokens",
        "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k",
        "top_p", "torch_dtype", "torchscript", "transformers_version", "typical_p", "use_bfloat16", "use_cache",
        "initializer_range", "attention_dropout", "pretraining_tp", "output_router_logits", "router_aux_loss_coef",
        RANDOM_WEIGHTS_KEY,
    }
)  # fmt: skip


@dataclass(frozen=True)
class ConfigKeys:
    """The keys a config class accepts: ``read`` (what its ``from_dict`` reads) and ``passed`` (keys of its family's
    official config.json that it lets pass unread). With ``metadata``, keys starting with ``_`` are comments or save
    metadata (transformers' ``_name_or_path``) and pass too."""

    read: frozenset[str]
    passed: frozenset[str] = frozenset()
    metadata: bool = False

    def accepts(self, key: str) -> bool:
        return key in self.read or key in self.passed or (self.metadata and key.startswith("_"))

    def unknown(self, d: Mapping[str, Any]) -> dict[str, list[str]]:
        """Each key of ``d`` this class does not accept -> the read keys it probably misspells: those close to it
        that ``d`` does not set (so each silently takes its default). [] when none is close: a key nobody reads."""
        unset = [k for k in self.read if k not in d]
        return {k: close_keys(k, unset) for k in sorted(d) if not self.accepts(k)}

    def refuse_unknown(self, d: Mapping[str, Any], source: str) -> None:
        """Raise ``ConfigError`` naming every unknown key of ``d`` (with its likely spelling) and the valid keys."""
        unknown = self.unknown(d)
        if unknown:
            named = ", ".join(f"'{k}'{did_you_mean(m)}" for k, m in unknown.items())
            raise ConfigError(f"{source}: unknown key(s) {named}; valid keys are {sorted(self.read)}")


def hf_keys(read: Iterable[str], passed: Iterable[str] = ()) -> ConfigKeys:
    """The keys of a config class that reads a transformers-style config.json: ``read``, plus ``passed`` and every
    key transformers itself writes (``HF_CONFIG_KEYS``) let through unread."""
    return ConfigKeys(frozenset(read), HF_CONFIG_KEYS | frozenset(passed), metadata=True)
