"""Prompt datasets: JSONL lines ``{"prompt": str}``, ``{"turns": [str, ...]}`` or ``{"messages": [...]}``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark.tokenizer import ByteTokenizer, HFTokenizer


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    text: str  # the rendered prompt (chat template applied for turns/messages)
    is_chat: bool

    def token_ids(self, tokenizer: HFTokenizer | ByteTokenizer) -> list[int]:
        """Ids as transformers and vLLM build them: a rendered chat template already holds its special tokens."""
        return tokenizer.encode(self.text, add_special_tokens=not self.is_chat)


def load_prompts(path: str | Path, num_prompts: int | None = None, chat_template=None) -> list[Prompt]:
    """Read prompts; ``chat_template(messages) -> str`` renders chat lines (first user turn for ``turns``)."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f'dataset {path} not found; give a JSONL file with one {{"prompt": ...}} per line')
    prompts: list[Prompt] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{lineno}: expected a JSON object")
        if isinstance(row.get("prompt"), str):
            prompts.append(Prompt(row["prompt"], False))
        elif isinstance(row.get("turns"), list) and row["turns"]:
            msgs = [{"role": "user", "content": str(row["turns"][0])}]
            prompts.append(Prompt(chat_template(msgs) if chat_template else str(row["turns"][0]), True))
        elif isinstance(row.get("messages"), list) and row["messages"]:
            msgs = [m for m in row["messages"] if isinstance(m, dict)]
            if msgs and msgs[-1].get("role") == "assistant":
                msgs = msgs[:-1]
            prompts.append(Prompt(chat_template(msgs) if chat_template else str(msgs[-1].get("content", "")), True))
        else:
            raise DatasetError(f"{path}:{lineno}: needs a 'prompt' string, a 'turns' list or a 'messages' list")
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
    if not prompts:
        raise DatasetError(f"dataset {path} has no prompts")
    return prompts
