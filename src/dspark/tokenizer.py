"""Text ↔ token ids: an HF ``tokenizers`` tokenizer.json, or a byte fallback for tiny random models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

DEFAULT_CHAT_TEMPLATE = "<|user|>{content}<|assistant|>"  # documented default: one turn per message


class TextTokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer`` (tokenizer.json) + tokenizer_config.json (special tokens, chat template)."""

    def __init__(self, directory: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer

        directory = Path(directory)
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        cfg_path = directory / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str = self.config.get("dspark_chat_template") or DEFAULT_CHAT_TEMPLATE
        eos = self.config.get("eos_token")
        ids = list(eos_token_ids)
        if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
            ids.append(self.tok.token_to_id(eos))
        self.eos_token_ids = tuple(dict.fromkeys(ids))
        bos = self.config.get("bos_token")
        self.bos_token_id = self.tok.token_to_id(bos) if isinstance(bos, str) else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(_render_turn(self.chat_template, m) for m in messages) if messages else ""


def _render_turn(template: str, message: dict) -> str:
    role, content = message.get("role", "user"), str(message.get("content", ""))
    if role == "assistant":
        return content
    return template.format(content=content)


class ByteTokenizer:
    """Fallback for models without tokenizer.json: UTF-8 bytes shifted past the first ``offset`` ids."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (), offset: int = 4) -> None:
        self.vocab_size = vocab_size
        self.offset = offset
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = None
        self.chat_template = DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - self.offset
        return [self.offset + (b % span) for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes((i - self.offset) % 256 for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(_render_turn(self.chat_template, m) for m in messages)


def load_tokenizer(
    directory: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> HFTokenizer | ByteTokenizer:
    if (Path(directory) / "tokenizer.json").exists():
        return HFTokenizer(directory, eos_token_ids)
    return ByteTokenizer(vocab_size, eos_token_ids)
