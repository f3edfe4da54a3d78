"""Target-regenerated ShareGPT data: prompts are the kept conversations' user turns rendered by the chat template,
responses come from our engine (greedy ones equal the engine's own greedy output), shards are uint16 and resume
without changing what was written, held-out conversations never reach the training split, and a damaged shard
is named with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark.llm import LLM
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.train.draft_data import DraftDataConfig, DraftDataset
from dspark.train.regenerate import regenerate_responses
from dspark.train.sharegpt import ShareGPTError, is_heldout, normalize, to_conversation
from dspark.train.sharegpt_regen import encode_prompt, load_shard, prompts_of, regenerate


def conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        turns = [("human", f"question {i} about topic {i % 7}"), ("gpt", f"answer {i}")]
        if i % 2:
            turns += [("human", f"follow-up {i}"), ("gpt", f"more {i}")]
        out.append({"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    target, _ = write_tiny_pair(root / "pair", seed=0)
    src = root / "sharegpt.json"
    src.write_text(json.dumps(conversations(40))[:-40])  # cut off, as the package's file is
    cfg = DraftDataConfig(
        source="sharegpt",
        target=str(target),
        sharegpt_file=str(src),
        out_dir=str(root / "out"),
        num_val_prompts=4,
        later_turn_fraction=0.5,
        max_prompt_tokens=96,
        max_new_tokens=12,
        greedy_fraction=0.5,
        min_response_tokens=1,
        shard_size=8,
        max_num_seqs=4,
        dtype="float32",
        quantization="none",
        heldout_percent=20.0,
    )
    return cfg, regenerate(cfg, say=lambda m: None)


def test_shards_hold_uint16_prompts_and_responses_with_a_manifest(setup) -> None:
    cfg, manifest = setup
    out = Path(cfg.out_dir)
    shards = sorted(out.glob("shard-*.npz"))
    assert len(shards) == manifest["train"]["shards"] >= 3
    with np.load(shards[0]) as z:
        assert z["tokens"].dtype == np.uint16 and z["offsets"][-1] == z["tokens"].size
    run = manifest["runs"][-1]
    assert run["generated_tokens"] > 0 and run["cpu_capability"] and "commit" in run
    ds = DraftDataset.load(out / "train.npz")
    assert len(ds) == manifest["train"]["samples"] and ds.num_loss_tokens == manifest["train"]["response_tokens"]
    rows, meta = load_shard(shards[0])
    ids, plen = rows[0]
    tokens, mask = ds[0]
    assert tokens.tolist() == ids.tolist() and mask.tolist() == [0] * plen + [1] * (len(ids) - plen)
    assert {s["temperature"] for s in meta["samples"]} <= {0.0, cfg.temperature}


def test_prompts_are_chat_renderings_and_responses_are_the_engines(setup) -> None:
    """Prompts re-rendered from the conversations match; the same engine settings reproduce every stored response
    (greedy and seeded samples: the sampling settings and seeds in the shard are the ones used)."""
    cfg, _ = setup
    rows, meta = load_shard(Path(cfg.out_dir) / "shard-00000.npz")
    engine = LLM(cfg.target, dtype="float32", quantization="none", max_num_seqs=cfg.max_num_seqs, seed=cfg.seed).engine
    by_id = {c["id"]: to_conversation(c) for c in conversations(40)}
    for (ids, plen), item in zip(rows, meta["samples"]):
        messages = by_id[item["conversation"]].messages[: 2 * item["turn"] + 1]
        assert ids[:plen].tolist() == engine.tokenizer.encode_chat(messages)
    params = [
        SamplingParams(max_tokens=cfg.max_new_tokens, temperature=s["temperature"], top_p=s["top_p"], seed=s["seed"])
        for s in meta["samples"]
    ]
    again = regenerate_responses(engine, [ids[:plen].tolist() for ids, plen in rows], params)
    assert again == [ids[plen:].tolist() for ids, plen in rows]
    assert {s["temperature"] for s in meta["samples"]} == {0.0, cfg.temperature}
    assert any(item["turn"] > 0 for item in meta["samples"])


def test_heldout_conversations_never_reach_training(setup) -> None:
    cfg, _ = setup
    out = Path(cfg.out_dir)
    train_ids = {s["conversation"] for p in out.glob("shard-*.npz") for s in load_shard(p)[1]["samples"]}
    val_ids = {s["conversation"] for p in out.glob("validation-*.npz") for s in load_shard(p)[1]["samples"]}
    assert val_ids and train_ids and not train_ids & val_ids
    texts = {c["id"]: c["conversations"][0]["value"] for c in conversations(40)}
    assert all(is_heldout(normalize(texts[i]), cfg.heldout_percent) for i in val_ids)


def test_a_resumed_run_keeps_written_shards_and_rewrites_a_missing_one_identically(setup) -> None:
    cfg, _ = setup
    out = Path(cfg.out_dir)
    first, second = out / "shard-00000.npz", out / "shard-00001.npz"
    kept_mtime, removed = first.stat().st_mtime_ns, load_shard(second)
    second.unlink()
    manifest = regenerate(cfg, say=lambda m: None)
    assert first.stat().st_mtime_ns == kept_mtime
    again = load_shard(second)
    assert [r[0].tolist() for r in again[0]] == [r[0].tolist() for r in removed[0]] and again[1] == removed[1]
    assert len(manifest["runs"]) == 2 and len(manifest["runs"][-1]["shards_written"]) == 1


def test_a_damaged_shard_is_named_with_its_fix(setup, tmp_path) -> None:
    bad = tmp_path / "shard-00000.npz"
    bad.write_bytes(b"not an npz")
    with pytest.raises(ShareGPTError, match="shard-00000.npz.*delete it and rerun"):
        load_shard(bad)


def test_later_turn_prompts_drop_the_oldest_turns_to_fit() -> None:
    cfg = DraftDataConfig(source="sharegpt", later_turn_fraction=1.0)
    convs = [to_conversation(c) for c in conversations(4)]
    prompts = prompts_of(convs, cfg)
    assert [p.turn for p in prompts] == [0, 1, 0, 1]

    class Tok:
        def encode_chat(self, msgs):
            return [1] * sum(len(m["content"]) for m in msgs)

    long = prompts[1]
    full = len(Tok().encode_chat(long.messages))
    assert encode_prompt(Tok(), long, full) == [1] * full
    assert encode_prompt(Tok(), long, full - 1) == [1] * len(long.messages[-1]["content"])
    assert encode_prompt(Tok(), long, 3) is None
