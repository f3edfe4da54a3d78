"""A reduced draft vocabulary (EAGLE-3's draft_vocab_size): drafts stay target ids, output stays the target's."""

import json

import numpy as np
import pytest
import torch

from dspark.cli import main
from dspark.config import ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config, write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.speculative.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab, rank_tokens, read_draft_vocab

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 96, (int(m),), generator=g).tolist() for m in torch.randint(2, 20, (n,), generator=g)]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculation_with_a_reduced_draft_vocab_equals_target_only(k):
    tcfg = tiny_target_config(moe=k != 3)
    target, drafter = build_tiny_pair(k, tcfg, tiny_draft_config(tcfg))
    prompts = _prompts(k, 5)
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i) for i in range(5)]
    ref = [o.token_ids for o in LLM.from_engine(Engine(target, None, None, FP32)).generate(prompts, params)]
    ids = torch.randperm(tcfg.vocab_size, generator=torch.Generator().manual_seed(k))[: tcfg.vocab_size // 3]
    for method, draw in (("dspark", "probabilistic"), ("dspark", "greedy"), ("dflash", "greedy")):
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, draft_sample_method=draw)
        eng = Engine(target, drafter, spec, FP32)
        eng.restrict_draft_vocab(ids)
        assert eng.runner.draft_vocab is not None and eng.runner.draft_vocab.size == tcfg.vocab_size // 3
        drafts: list[torch.Tensor] = []
        eng.runner.propose_draft = _recording(eng.runner.propose_draft, drafts)
        got = [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)]
        assert got == ref, (method, draw)
        assert drafts and all(bool(torch.isin(d, ids).all()) for d in drafts)  # only draft-vocab ids proposed


def _recording(propose, drafts):
    def spy(*a, **kw):
        p = propose(*a, **kw)
        drafts.append(p.tokens)
        return p

    return spy


def test_restricted_logits_are_rows_of_the_full_ones():
    tcfg = tiny_target_config(moe=False)
    _, drafter = build_tiny_pair(0, tcfg, tiny_draft_config(tcfg))
    ids = torch.tensor([5, 1, 40, 7])
    keys = set(drafter.state_dict())
    vocab = DraftVocab.for_drafter(drafter, ids)
    assert set(drafter.state_dict()) == keys  # nothing added to the drafter (never saved, never trained)
    h = torch.randn(2, 3, tcfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(vocab.lm_head(h), drafter.lm_head(h)[..., ids])
        w2 = drafter.markov_head.markov_w2
        e = torch.randn(2, w2.weight.shape[1])
        torch.testing.assert_close(vocab.markov_w2(e), w2(e)[..., ids])
    q = torch.rand(2, 4)
    full = vocab.expand(q, tcfg.vocab_size)
    assert full.shape == (2, tcfg.vocab_size) and torch.equal(full[:, ids], q)
    torch.testing.assert_close(full.sum(), q.sum())


def test_a_quantized_lm_head_keeps_its_draft_rows_quantized():
    from types import SimpleNamespace

    from dspark.models.quantized import QuantLinear, QuantWeight

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (50, 2, 34), dtype=torch.uint8, generator=g)  # Q8_0 rows of width 64
    blocks[..., :2] = (torch.rand(50, 2, 1, generator=g) * 0.01 + 1e-3).half().view(torch.uint8)
    head = QuantLinear(QuantWeight("Q8_0", blocks.view(50, -1).contiguous()))
    ids = torch.tensor([49, 3, 20])
    vocab = DraftVocab.for_drafter(SimpleNamespace(lm_head=head, markov_head=None), ids)
    assert isinstance(vocab.lm_head, QuantLinear) and vocab.markov_w2 is None  # blocks kept, not dense fp32 rows
    assert vocab.lm_head.qweight.nbytes == 3 * 68
    h = torch.randn(2, 7, 64)
    with torch.inference_mode():
        torch.testing.assert_close(vocab.lm_head(h), head(h)[..., ids])


def test_engines_sharing_one_loaded_drafter_keep_their_own_draft_vocab(tmp_path):
    from dspark.llm import build_engines, engine_configs

    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair", 0)
    (draft_dir / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": list(range(40, 0, -1)), "default_size": 24}))
    specs = [
        {"method": "dspark", "model": str(draft_dir)},
        {"method": "dspark", "model": str(draft_dir), "draft_vocab_size": 0},
        {"method": "dspark", "model": str(draft_dir), "draft_vocab_size": 8},
    ]
    engines = build_engines(target_dir, specs, *engine_configs(dtype="float32"))
    assert engines[0].drafter is engines[1].drafter is engines[2].drafter  # one loaded drafter
    sizes = [None if e.runner.draft_vocab is None else e.runner.draft_vocab.size for e in engines]
    assert sizes == [24, None, 8]
    outs = [LLM.from_engine(e).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0] for e in engines]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def _dataset(path, tokens, mask):
    path.mkdir(parents=True, exist_ok=True)
    np.savez(
        path / "train.npz",
        tokens=np.array(tokens, np.int32),
        loss_mask=np.array(mask, np.uint8),
        offsets=np.array([0, len(tokens)], np.int64),
        meta=json.dumps({}),
    )


def test_the_tool_ranks_response_tokens_and_the_engine_reads_its_file(tmp_path):
    _dataset(tmp_path / "d", [9, 9, 4, 4, 4, 7, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1])  # prompt tokens (9) rank after
    ids, counts, total = rank_tokens([tmp_path / "d"])
    assert (ids, counts, total) == ([4, 2, 7, 9], [3, 2, 1, 0], 6)
    assert rank_tokens([tmp_path / "d"], vocab_size=11)[0] == [4, 2, 7, 9, 0, 1, 3, 5, 6, 8, 10]  # then unseen ids
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    assert (
        main(
            [
                "draft-vocab",
                "--data-dir",
                str(tmp_path / "d"),
                "--out",
                str(draft_dir / DRAFT_VOCAB_FILE),
                "--default-size",
                "2",
            ]
        )
        == 0
    )
    assert read_draft_vocab(draft_dir, None, 100).tolist() == [4, 2]  # the file's default
    assert read_draft_vocab(draft_dir, 3, 100).tolist() == [4, 2, 7]
    assert read_draft_vocab(draft_dir, 0, 100) is None  # 0: the full vocabulary
    assert read_draft_vocab(draft_dir, 4, 4) is None  # N >= the vocabulary: no restriction
    assert read_draft_vocab(tmp_path, None, 100) is None  # no file, no key: the full vocabulary
    with pytest.raises(ConfigError, match="ranks 4 token ids"):
        read_draft_vocab(draft_dir, 5, 100)
    with pytest.raises(ConfigError, match="draft_vocab.json.*does not exist"):
        read_draft_vocab(tmp_path, 8, 100)
    (draft_dir / DRAFT_VOCAB_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="not a draft vocabulary"):
        read_draft_vocab(draft_dir, None, 100)


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        SpeculativeConfig(draft_vocab_size=-1)
    with pytest.raises(ConfigError, match="n-gram has none"):
        SpeculativeConfig(method="ngram", draft_vocab_size=8)
    target, drafter = build_tiny_pair(0)
    with pytest.raises(ConfigError, match="given in memory"):
        Engine(target, drafter, SpeculativeConfig(draft_vocab_size=8), FP32)
