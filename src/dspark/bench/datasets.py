"""Bench prompts: the committed held-out set (built from the corpus test split) and context-depth padding.

``src/dspark/assets/prompts/heldout.jsonl`` holds ``{"prompt", "path", "line"}`` lines: the first 10–30 lines of a
function or class from CPython stdlib files that the corpus kept out of training (its ``test`` split).
``heldout_sources.jsonl`` holds those files' full text (``{"path", "text"}``, encoding tables left out); it is the
"real preceding code" used to pad prompts to a context depth.

Regenerate (deterministic; needs the corpus built by ``python -m dspark.train.corpus runs/data/corpus``)::

    python -m dspark.bench.datasets --corpus runs/data/corpus/test.jsonl --out src/dspark/assets/prompts
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dspark.data import DatasetError, load_prompts

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"
HELDOUT = PROMPTS_DIR / "heldout.jsonl"
HELDOUT_SOURCES = PROMPTS_DIR / "heldout_sources.jsonl"
# generated lookup tables (encodings/*) are code in name only; they are kept out of prompts and padding
EXCLUDED_PREFIXES = ("stdlib/encodings/",)


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    path: str | None = None  # source file (corpus-relative) the prompt was cut from, when known
    line: int | None = None  # 1-based line of the prompt's first line in that file
    is_chat: bool = False  # text is a rendered chat template (encoded without adding special tokens)


@dataclass(frozen=True)
class HeldoutSummary:
    num_prompts: int
    num_files: int
    prompts_path: Path
    sources_path: Path


# ---- building the held-out set ---------------------------------------------------------------------------


def _stable_key(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()


def _candidates(path: str, text: str, min_def_lines: int) -> list[tuple[int, int]]:
    """(first line, number of lines) of every function/class of at least min_def_lines lines, decorators excluded."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if n >= min_def_lines:
                out.append((node.lineno, n))
    return sorted(out)


def build_heldout(
    corpus_test: str | Path,
    out_dir: str | Path = PROMPTS_DIR,
    num_prompts: int = 64,
    min_lines: int = 10,
    max_lines: int = 30,
    min_continuation: int = 4,
) -> HeldoutSummary:
    """Cut ``num_prompts`` prompts (the first ``min_lines``..``max_lines`` lines of a def/class that has at least
    ``min_continuation`` more lines) from a corpus split, chosen and sized by a stable hash; write
    ``heldout.jsonl`` (hash order, so any prefix is spread over files) and ``heldout_sources.jsonl``."""
    corpus_test = Path(corpus_test)
    if not corpus_test.exists():
        raise DatasetError(
            f"corpus split {corpus_test} not found; build it with `python -m dspark.train.corpus runs/data/corpus`"
        )
    files: dict[str, str] = {}
    for line in corpus_test.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if not str(row["path"]).startswith(EXCLUDED_PREFIXES):
                files[str(row["path"])] = str(row["text"])
    picks = []
    for path in sorted(files):
        for lineno, n in _candidates(path, files[path], min_lines + min_continuation):
            picks.append((_stable_key(path, lineno), path, lineno, n))
    picks.sort()
    if len(picks) < num_prompts:
        raise DatasetError(f"{corpus_test} has only {len(picks)} functions/classes long enough; lower num_prompts")
    rows = []
    for key, path, lineno, n in picks[:num_prompts]:
        span = max_lines - min_lines + 1
        take = min(min_lines + int(key[:8], 16) % span, n - min_continuation)
        lines = files[path].splitlines(keepends=True)[lineno - 1 : lineno - 1 + take]
        rows.append({"prompt": "".join(lines), "path": path, "line": lineno})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts_path, sources_path = out_dir / "heldout.jsonl", out_dir / "heldout_sources.jsonl"
    prompts_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources_path.write_text("".join(json.dumps({"path": p, "text": files[p]}) + "\n" for p in sorted(files)))
    return HeldoutSummary(len(rows), len(files), prompts_path, sources_path)


# ---- reading -------------------------------------------------------------------------------------------------


def read_bench_prompts(
    path: str | Path, num_prompts: int | None = None, chat_template: Callable | None = None
) -> list[BenchPrompt]:
    """The dataset's prompts (any format ``dspark.data.load_prompts`` reads) with their optional path/line keys."""
    texts = load_prompts(path, num_prompts, chat_template)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][: len(texts)]
    out = []
    for prompt, row in zip(texts, rows):
        src, line = row.get("path"), row.get("line")
        ok = isinstance(src, str) and isinstance(line, int)
        out.append(BenchPrompt(prompt.text, src if ok else None, line if ok else None, prompt.is_chat))
    return out


def read_sources(path: str | Path = HELDOUT_SOURCES) -> dict[str, str]:
    """``{"path", "text"}`` JSONL (corpus format) → {path: text}, in file order."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"context source {path} not found; give a corpus-format JSONL ({{'path','text'}} lines)")
    out: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DatasetError(f"{path}:{lineno}: expected an object with a 'text' string")
        out[str(row.get("path", f"line{lineno}"))] = row["text"]
    if not out:
        raise DatasetError(f"context source {path} is empty")
    return out


# ---- context-depth padding -----------------------------------------------------------------------------------


def preceding_lines(prompt: BenchPrompt, sources: dict[str, str], rotate: int) -> list[str]:
    """Real code that may precede the prompt: the other source files (order rotated per prompt), then the prompt's
    own file up to the prompt's first line. Never includes the prompt's own continuation."""
    names = [p for p in sources if p != prompt.path]
    if names:
        r = rotate % len(names)
        names = names[r:] + names[:r]
    lines: list[str] = []
    for name in names:
        lines += sources[name].splitlines(keepends=True)
        lines.append("\n\n")
    if prompt.path in sources and prompt.line is not None:
        lines += sources[prompt.path].splitlines(keepends=True)[: prompt.line - 1]
    return lines


def pad_to_depth(
    prompt: BenchPrompt, depth: int, count_tokens: Callable[[str], int], sources: dict[str, str], rotate: int = 0
) -> str:
    """The prompt preceded by the longest suffix of real preceding code such that the whole text has at most
    ``depth`` tokens (binary search over whole lines). A prompt already at least ``depth`` long is returned as is."""
    lines = preceding_lines(prompt, sources, rotate)
    if count_tokens(prompt.text) >= depth or not lines:
        return prompt.text

    def text(k: int) -> str:
        return "".join(lines[len(lines) - k :]) + prompt.text if k else prompt.text

    lo, hi = 0, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(text(mid)) <= depth:
            lo = mid
        else:
            hi = mid - 1
    return text(lo)


def pad_prompts(
    prompts: Sequence[BenchPrompt], depth: int, count_tokens: Callable[[str], int], sources: dict[str, str]
) -> list[str]:
    return [pad_to_depth(p, depth, count_tokens, sources, rotate=i) for i, p in enumerate(prompts)]


class Encoder(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def encode_prompt(tok: Encoder, text: str, is_chat: bool, limit: int) -> tuple[int, ...]:
    """Token ids as AutoTokenizer builds them (chat text holds its template's special tokens), keeping a leading
    BOS and the last tokens if longer than ``limit``."""
    ids = tok.encode(text, add_special_tokens=not is_chat)
    head = ids[:1] if ids[:1] == [tok.bos_token_id] else []
    return tuple(head + ids[len(head) - limit :]) if len(ids) > limit else tuple(ids)


def depth_prompts(
    prompts: Sequence[BenchPrompt], depth: int, tok: Encoder, sources: dict[str, str]
) -> tuple[tuple[int, ...], ...]:
    """Each prompt preceded by real code up to ``depth`` tokens (its BOS included), as token ids."""
    texts = pad_prompts(prompts, depth - 1, lambda s: len(tok.encode(s)), sources)  # -1: room for BOS
    return tuple(encode_prompt(tok, t, p.is_chat, depth) for t, p in zip(texts, prompts))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="regenerate the held-out bench prompts from the corpus test split")
    p.add_argument("--corpus", default="runs/data/corpus/test.jsonl", help="corpus split JSONL ({path, text} lines)")
    p.add_argument("--out", default=str(PROMPTS_DIR), help="output directory")
    p.add_argument("--num-prompts", type=int, default=64)
    args = p.parse_args(argv)
    s = build_heldout(args.corpus, args.out, args.num_prompts)
    print(f"wrote {s.num_prompts} prompts to {s.prompts_path} and {s.num_files} source files to {s.sources_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
