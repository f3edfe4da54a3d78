"""``dspark bench --multi-turn``: second turns reuse the first turn's pages with prefix caching (fewer tokens
prefilled, hits counted as /metrics counts them) and the answers are the same token for token either way; a file
without two user turns is refused with its line."""

from __future__ import annotations

import json

import pytest

from dspark.bench.multiturn import markdown, run_multiturn, two_turn_conversations
from dspark.models.tiny import write_tiny_hybrid_pair, write_tiny_pair


@pytest.mark.parametrize("writer", [write_tiny_pair, write_tiny_hybrid_pair], ids=["mla", "hybrid"])
def test_second_turns_prefill_less_with_caching_and_answer_the_same(tmp_path, writer) -> None:
    target, draft = writer(tmp_path / "pair")
    data = tmp_path / "turns.jsonl"
    lines = [{"turns": [f"first question number {i} " * 3, f"and a follow-up {i}"]} for i in range(3)]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    convs = two_turn_conversations(str(data), 3)
    spec = json.dumps({"method": "dspark", "model": str(draft)})
    report = run_multiturn(str(target), spec, convs, 12, dtype="float32", quantization="none", page_size=4)
    off, on = report["modes"]
    assert report["identical_outputs"]
    assert off["prefix_cache_hits"] == 0 and off["turn2_prefill_tokens"] == off["turn2_prompt_tokens"]
    assert on["turn2_prompt_tokens"] == off["turn2_prompt_tokens"]
    assert on["turn2_prefill_tokens"] < off["turn2_prefill_tokens"] and on["hit_rate"] > 0
    assert "fewer prompt tokens prefilled" in markdown(report)


def test_a_line_without_two_turns_is_named(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": ["only one"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*two user turns"):
        two_turn_conversations(str(bad), 4)
