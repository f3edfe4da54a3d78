"""Text ↔ token ids for a model directory: ``transformers.AutoTokenizer`` itself, or bytes for random test models.

Token ids are exactly what ``AutoTokenizer.from_pretrained(model_dir)`` produces (and vLLM feeds its engine): plain
prompts with the tokenizer's own special-token rules (tokenizer.json post-processor, ``add_bos_token``), chat
prompts as ``apply_chat_template(messages, add_generation_prompt=True)`` with the Jinja ``chat_template`` of
tokenizer_config.json (rendered, then encoded without adding special tokens: the template places them).
Streaming text comes from :class:`IncrementalDetokenizer` (only text later tokens cannot change is emitted).

The byte tokenizer stands in only for models built as random test weights (``dspark.models.tiny``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.config import RANDOM_WEIGHTS_KEY, ConfigError

if TYPE_CHECKING:
    from dspark.models.model_spec import ModelSpec

# vocabulary files any one of which makes a directory a tokenizer directory for AutoTokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class IncrementalDetokenizer:
    """Text of a growing token list, emitted piece by piece: a window [prefix, read) of already emitted tokens
    is decoded with the new ones, and the difference is emitted once it does not end in an incomplete
    character (U+FFFD). The emitted pieces concatenate to the full text (what vLLM streams and returns)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0
        self._read = 0

    def step(self, token_ids: Sequence[int]) -> str:
        """Append token_ids; return the newly final text ('' while a character is incomplete)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        return self._emit(after[len(before) :])

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        return self._emit(after[len(before) :]) if len(after) > len(before) else ""

    def _emit(self, piece: str) -> str:
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


class HFTokenizer:
    """The thin adapter over ``transformers.AutoTokenizer`` the engine and the server use."""

    def __init__(self, directory: str | Path | ModelSpec, eos_token_ids: Sequence[int] = ()) -> None:
        from dspark.models.model_spec import model_directory

        self.directory = model_directory(directory)
        try:
            self.tok = _auto_tokenizer(directory)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(
                f"{self.directory}: transformers.AutoTokenizer cannot load this tokenizer ({e}); re-download "
                "tokenizer.json and tokenizer_config.json"
            ) from e
        own = self.tok.eos_token_id
        self.eos_token_ids = tuple(dict.fromkeys([*eos_token_ids, *([own] if own is not None else [])]))
        self.bos_token_id: int | None = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template (tokenizer_config.json ``chat_template`` or
        chat_template.jinja), as transformers loads it."""
        return bool(self.tok.chat_template)

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (batch encoding of training corpora)."""
        return self.tok.backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text, special tokens included (the tokens of a logprobs response)."""
        return list(self.tok.batch_decode([[i] for i in ids], skip_special_tokens=False))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat prompt text, ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``."""
        if not self.tok.chat_template:
            raise ConfigError(
                f"{self.directory}/tokenizer_config.json has no 'chat_template': this model cannot render chat "
                "messages; send a plain prompt or add the model's Jinja chat template"
            )
        return self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat prompt ids, as ``apply_chat_template(messages, add_generation_prompt=True)`` returns them."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class ByteTokenizer:
    """For random test models only: UTF-8 bytes shifted past the first ``offset`` ids, BOS first (if given).
    Chat: ``<|user|>{content}`` per user turn, ``<|assistant|>{content}`` per assistant turn, then
    ``<|assistant|>`` (the bundled model's format, without its special tokens)."""

    def __init__(
        self, vocab_size: int, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None, offset: int = 4
    ) -> None:
        self.vocab_size = vocab_size
        self.offset = offset
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        span = self.vocab_size - self.offset
        head = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return head + [self.offset + (b % span) for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes((i - self.offset) % 256 for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text; a special token (below the byte offset) shows as ``<id>``."""
        return [self.decode([i]) if i >= self.offset else f"<{i}>" for i in ids]

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode)

    has_chat_template = False  # the format below stands in for a model's template; it is not one

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        turns = [f"<|{m.get('role', 'user')}|>{m.get('content', '')}" for m in messages]
        return "".join(turns) + "<|assistant|>"

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


def _auto_tokenizer(model: str | Path | ModelSpec) -> Any:
    """AutoTokenizer for a model directory: its spec's (config.json already read, the tokenizer loaded once per
    command), or transformers' own reading when the directory has no usable config.json (a tokenizer-only one)."""
    from dspark.models.model_spec import ConfigFileError, model_spec

    try:
        spec = model_spec(model)
    except ConfigFileError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return spec.tokenizer_backend


def has_tokenizer(directory: str | Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(
    directory: str | Path | ModelSpec,
    vocab_size: int | None = None,
    eos_token_ids: Sequence[int] = (),
    bos_token_id: int | None = None,
) -> HFTokenizer | ByteTokenizer:
    """The model directory's tokenizer (AutoTokenizer). Without tokenizer files only a model marked as explicitly
    random test weights (config.json key ``dspark_random_weights``) gets bytes; anything else is an error."""
    from dspark.models.model_spec import model_directory, model_spec

    model, directory = directory, model_directory(directory)
    if has_tokenizer(directory):
        return HFTokenizer(model, eos_token_ids)
    config = model_spec(model).raw if (directory / "config.json").is_file() else {}
    if config.get(RANDOM_WEIGHTS_KEY) is True:
        return ByteTokenizer(vocab_size or int(config["vocab_size"]), eos_token_ids, bos_token_id)
    raise FileNotFoundError(
        f"{directory} has no tokenizer (tokenizer.json + tokenizer_config.json); copy the model's tokenizer files "
        f"there, or train one with `python -m dspark.train.tokenizer CORPUS_DIR {directory}`"
    )
