"""Chat-target drafter data (HF generate with features captured in the same pass), instruction prompt sets,
and GQA drafter training against a transformers Llama target."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.models.loading import load_drafter, load_target
from dspark.train.chat_data import Sample, generate_batch, write_split
from dspark.train.draft_data import DraftDataConfig, DraftDataset
from dspark.train.features import FeatureCache, merge_draft_data, prepare_features, target_features
from dspark.train.instructions import HELDOUT, check_disjoint, training_prompts
from dspark.train.trainer import DraftTrainer, train_draft
from test_train_draft import tiny_cfg, tiny_dataset

V = 96
TAPS = (0, 2)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=10000.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def native(llama, tmp_path_factory):
    """Our own GQA target on the same weights (loaded from the saved HF directory)."""
    path = tmp_path_factory.mktemp("llama")
    llama.save_pretrained(path)
    return load_target(path, "float32"), path


def test_generate_batch_matches_unbatched_greedy_and_a_full_forward(llama, native) -> None:
    prompts = [[5, 9, 11], [7, 8, 20, 30, 40, 50], [60, 61]]
    cfg = DraftDataConfig(source="instructions-hf", tap_layers=TAPS, max_new_tokens=6, min_response_tokens=1)
    samples = generate_batch(llama, prompts, cfg, temperature=0.0, eos_ids=set(), seed=0)
    target, _ = native
    for prompt, s in zip(prompts, samples):
        assert s.tokens[: s.num_prompt] == prompt and len(s.tokens) == len(prompt) + 6
        ref = llama.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0].tolist()
        assert s.tokens == ref  # left padding does not change the continuation
        feats = target_features(target, torch.tensor([s.tokens]), TAPS, "float32", autocast=False)
        torch.testing.assert_close(s.taps[:-1], feats.taps[0, :-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s.hidden[:-1], feats.hidden[0, :-1], rtol=1e-4, atol=1e-4)
        assert not s.taps[-1].any() and not s.hidden[-1].any()  # never fed back; never read by training


def test_generate_batch_cuts_at_eos_and_drops_short_responses(llama) -> None:
    prompts = [[5, 9, 11], [7, 8, 20]]
    cfg = DraftDataConfig(source="instructions-hf", tap_layers=TAPS, max_new_tokens=8, min_response_tokens=1)
    full = generate_batch(llama, prompts, cfg, temperature=0.0, eos_ids=set(), seed=0)
    eos = full[0].tokens[len(prompts[0]) + 2]  # make the third response token of prompt 0 an EOS
    cut = generate_batch(llama, prompts, cfg, temperature=0.0, eos_ids={eos}, seed=0)
    first = cut[0].tokens[len(prompts[0]) :]
    assert first[-1] == eos and eos not in first[:-1] and len(first) <= 3
    strict = generate_batch(llama, prompts, replace(cfg, min_response_tokens=4), 0.0, {eos}, 0)
    assert all(len(s.tokens) - s.num_prompt >= 4 for s in strict)


def _sample(rng: np.random.Generator, n: int) -> Sample:
    return Sample(rng.integers(3, V, n).tolist(), 2, torch.randn(n, 6), torch.randn(n, 3))


def test_merged_shards_read_back_sample_by_sample(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    shards = [[_sample(rng, n) for n in (5, 9, 4)], [_sample(rng, n) for n in (7, 3)]]
    for k, samples in enumerate(shards):
        cfg = DraftDataConfig(
            source="instructions-hf",
            out_dir=str(tmp_path),
            tap_layers=(0, 1),
            shard=k,
            num_shards=2,
            feature_dtype="float32",
        )
        write_split(cfg, "train", "train.npz", samples)
        (cfg.shard_dir / "manifest.json").write_text(json.dumps({"generated_tokens": 1, "wall_clock_s": 1.0}))
    result = merge_draft_data(tmp_path, 2, require_features=True)
    assert result["train"]["samples"] == 5
    data = DraftDataset.load(tmp_path / "train.npz")
    cache = FeatureCache(tmp_path / "features" / "train", data, (0, 1))
    for i, s in enumerate(shards[0] + shards[1]):
        x, m = data[i]
        assert x.tolist() == s.tokens and m.tolist() == [False] * 2 + [True] * (len(s.tokens) - 2)
        taps, hidden = cache.get(i)
        assert torch.equal(taps, s.taps) and torch.equal(hidden, s.hidden)


def test_gqa_drafter_trains_on_a_llama_target(native, tmp_path: Path) -> None:
    target, path = native
    data, val = tiny_dataset(6), tiny_dataset(2, seed=4)
    cfg = tiny_cfg(target_dir=str(path), target_layer_ids=TAPS, batch_size=3, max_steps=2)
    online = DraftTrainer(cfg, target, data)
    dc = online.draft_cfg
    assert dc.is_gqa and (dc.hidden_size, dc.num_key_value_heads, dc.head_dim) == (32, 2, 8)
    assert dc.target_num_hidden_layers == 4 and not dc.rope.interleave  # HF rotate-half, as the target
    prepare_features(target, data, tmp_path / "features" / "train", TAPS, "float32", autocast=False)
    offline = DraftTrainer(replace(cfg, features="offline", feature_dir=str(tmp_path / "features")), target, data)
    offline.drafter.load_state_dict(online.drafter.state_dict())
    b_on, b_off = online.step_batches(0)[0], offline.step_batches(0)[0]
    l_on = online.batch_loss(b_on, "train", online._weight_sum(b_on))
    l_off = offline.batch_loss(b_off, "train", offline._weight_sum(b_off))
    torch.testing.assert_close(l_on.loss, l_off.loss, rtol=1e-5, atol=1e-6)
    res = train_draft(replace(cfg, out_dir=str(tmp_path / "d")), target=target, train_data=data, val_data=val)
    export = Path(res.export_dir)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    loaded = load_drafter(export, target)
    assert loaded.config.to_dict() == dc.to_dict()


def test_instruction_prompts_are_deterministic_and_disjoint_from_the_heldout_sets() -> None:
    rows = training_prompts(seed=0)
    assert rows == training_prompts(seed=0)
    assert {r["domain"] for r in rows} == {"code", "math", "chat"} and len(rows) > 3000
    check_disjoint(rows)
    with pytest.raises(ValueError, match="held-out code"):
        check_disjoint(rows + [{"messages": [{"role": "user", "content": HELDOUT["code"][0]}]}])


def test_drafter_final_norm_starts_from_the_targets(native) -> None:
    target, path = native
    norm = target.model.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm.uniform_(0.1, 0.3)  # a trained target's scale, far from RMSNorm's ones
    trainer = DraftTrainer(tiny_cfg(target_dir=str(path), target_layer_ids=TAPS), target, tiny_dataset(4))
    assert torch.equal(trainer.drafter.final_norm.weight, norm)
    with torch.no_grad():
        norm.copy_(saved)


def test_a_packaged_alias_target_pairs_with_its_shipped_drafters(tmp_path: Path, monkeypatch) -> None:
    import dspark.checkpoint.resolve as resolve
    import dspark.llm as llm
    from dspark.checkpoint.gguf import export_dir_for
    from dspark.config import SpeculativeConfig

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve, "alias_path", lambda name: gguf)
    pair = (tmp_path / "dspark", tmp_path / "dflash")
    for d in pair:
        d.mkdir()
        (d / "config.json").write_text("{}")
    monkeypatch.setattr(resolve, "ALIAS_DRAFTS", {"smollm2-135m-instruct": pair})
    target = export_dir_for(gguf)
    assert llm.shipped_drafts(target) == pair and llm.shipped_drafts(tmp_path) is None
    assert llm.resolve_draft(SpeculativeConfig(method="dflash"), target) == pair[1]
    assert llm.resolve_draft(SpeculativeConfig(method="dspark"), target) == pair[0]
    assert llm.shipped_drafts(llm.BUNDLED_TARGET) == (llm.BUNDLED_DRAFT, llm.BUNDLED_DFLASH)


def test_generate_defaults_to_dspark_for_a_target_with_shipped_drafters(tmp_path: Path, monkeypatch) -> None:
    import argparse

    import dspark.checkpoint.resolve as resolve
    from dspark.cli_common import default_spec

    monkeypatch.setattr(resolve, "shipped_drafts", lambda d: (d, d) if Path(d).name == "shipped" else None)
    (tmp_path / "shipped").mkdir()
    (tmp_path / "plain").mkdir()
    args = argparse.Namespace(no_spec=False, speculative_config=None, model=str(tmp_path / "shipped"))
    assert default_spec(args, None)["method"] == "dspark"
    assert (
        default_spec(argparse.Namespace(no_spec=False, speculative_config=None, model=str(tmp_path / "plain")), None)
        is None
    )
