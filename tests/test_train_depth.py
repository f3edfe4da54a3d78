"""Drafter training for depth: target features computed chunk by chunk equal one pass (bounded memory for long
samples), anchors are drawn across the whole sample, and validation reports τ per anchor-depth bucket."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark.models.tiny import build_tiny_gqa_pair, build_tiny_hybrid_pair, build_tiny_pair, tiny_target_config
from dspark.train.anchors import depth_labels, depth_summary, sample_anchors, tau_by_depth
from dspark.train.draft_config import DraftTrainConfig
from dspark.train.draft_data import DraftDataset
from dspark.train.features import target_features
from dspark.train.trainer import DraftTrainer


def _long_target():
    tcfg = tiny_target_config()
    tcfg = replace(tcfg, rope=replace(tcfg.rope, factor=8.0, original_max_position_embeddings=64))
    return build_tiny_pair(0, tcfg)[0]


@pytest.mark.parametrize("family", ["mla", "llama", "hybrid"])
def test_chunked_target_features_equal_one_pass(family):
    """Taps and final hidden of two right-padded samples (150 and 97 tokens, past the 64-token original window)
    computed 32 tokens at a time over a latent cache (a hybrid target: and its KDA states carried from chunk to
    chunk) equal the one-pass features."""
    builds = {"mla": _long_target, "llama": lambda: build_tiny_gqa_pair(0)[0]}
    target = builds.get(family, lambda: build_tiny_hybrid_pair(0)[0])()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 96, (2, 150), generator=g)
    ids[1, 97:] = 0  # padding: the causal target ignores it
    taps = (0, 2)
    one = target_features(target, ids, taps, "float32", autocast=False)
    chunked = target_features(target, ids, taps, "float32", autocast=False, chunk=32)
    torch.testing.assert_close(chunked.taps, one.taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.hidden, one.hidden, rtol=1e-5, atol=1e-5)
    short = target_features(target, ids[:, :20], taps, "float32", autocast=False, chunk=32)  # ≤ chunk: one pass
    torch.testing.assert_close(short.hidden, one.hidden[:, :20], rtol=1e-5, atol=1e-5)


def test_anchors_are_drawn_across_the_whole_sample():
    """With few anchors per sample over a 4,000-token response, every depth bucket gets anchors (uniform over
    valid positions, not the first ones)."""
    S = 4000
    mask = torch.zeros(1, S, dtype=torch.bool)
    mask[0, 10:] = True
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(50):
        a, keep = sample_anchors(mask, 8, g)
        assert keep.all() and (a >= 10).all() and (a < S - 1).all()
        counts += torch.bincount(torch.bucketize(a[0], torch.tensor([1000, 2000, 3000]), right=True), minlength=4)
    assert (counts > 60).all(), counts  # 400 anchors, ~100 per quarter


def test_tau_by_depth_by_hand():
    edges = (256, 1024)
    assert depth_labels(edges) == ["0-255", "256-1023", "1024+"]
    anchors = torch.tensor([[3, 255, 256, 5000]])
    accept = torch.tensor([[[1.0, 0.5], [0.5, 0.5], [0.2, 1.0], [0.0, 0.0]]])
    mask = torch.tensor([[[True, True], [True, False], [True, True], [False, False]]])
    accept = accept * mask
    sums = tau_by_depth(accept, mask, anchors, edges)
    # τ = 1 + c1 + c1·c2: 2.5 and 1.5 at depth < 256; 1.4 at 256; the last block is unsupervised
    torch.testing.assert_close(sums, torch.tensor([[4.0, 1.4, 0.0], [2.0, 1.0, 0.0]], dtype=torch.float64))
    assert depth_summary(sums, edges) == {"0-255": 2.0, "256-1023": 1.4, "1024+": None}


def test_validation_reports_tau_by_depth_and_chunked_features_train_the_same():
    """The evaluation reports τ per anchor-depth bucket, and a trainer with feature_chunk computes the same loss
    as one without."""
    target = _long_target()
    rng = np.random.default_rng(0)
    samples = []
    for length in (40, 130, 200):
        ids = rng.integers(4, 96, length).tolist()
        samples.append((ids, [0] * 5 + [1] * (length - 5)))
    data = DraftDataset.from_samples(samples)
    cfg = DraftTrainConfig(
        max_steps=1,
        batch_size=3,
        num_anchors=12,
        markov_rank=8,
        autocast_bf16=False,
        feature_dtype="float32",
        progress=False,
        num_threads=1,
        eval_num_anchors=64,
        eval_depth_edges=(64, 128),
    )
    trainer = DraftTrainer(cfg, target, data, data)
    ev = trainer.evaluate()
    assert ev is not None and list(ev["tau_by_depth"]) == ["0-63", "64-127", "128+"]
    assert all(v is not None and 1.0 <= v <= 8.0 for v in ev["tau_by_depth"].values())
    chunked = DraftTrainer(replace(cfg, feature_chunk=48), target, data, data)
    chunked.drafter.load_state_dict(trainer.drafter.state_dict())
    b = trainer.step_batches(0)[0]
    ref = trainer.batch_loss(b, "train", trainer._weight_sum(b))
    got = chunked.batch_loss(b, "train", chunked._weight_sum(b))
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="eval_depth_edges"):
        replace(cfg, eval_depth_edges=(128, 64))
    with pytest.raises(ValueError, match="feature_chunk"):
        replace(cfg, feature_chunk=0)


def test_long_context_prompts_run_back_into_preceding_documents():
    """With max_context, about long_fraction of the prompts are long (log-uniform lengths up to max_context) and
    run back over earlier documents; the short ones keep their [min, max] lengths."""
    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.regenerate import corpus_prompts

    docs = [f"# file {d}\n" + "".join(f"def f{d}_{i}(x):\n    return x + {i}\n\n" for i in range(40)) for d in range(6)]

    def encode(text: str) -> list[int]:
        return [4 + (b % 90) for b in text.encode()]

    prompts = corpus_prompts(docs, encode, 80, min_tokens=10, max_tokens=30, seed=1, max_context=4000)
    long = [p for p in prompts if len(p) > 30]
    assert all(10 <= len(p) <= 4000 for p in prompts)
    assert 8 <= len(long) <= 40 and max(len(p) for p in long) > 1500  # ~25 % of 80, log-uniform up to 4000
    marker = encode("\n\n# file ")  # a file boundary of the concatenation
    crossing = [any(p[i : i + len(marker)] == marker for i in range(len(p))) for p in long if len(p) > len(docs[0])]
    assert crossing and all(crossing)  # longer than a whole file: runs back over the file before
    assert corpus_prompts(docs, encode, 20, 10, 30, seed=1) == corpus_prompts(docs, encode, 20, 10, 30, seed=1)
    with pytest.raises(ValueError, match="max_context"):
        corpus_prompts(docs, encode, 5, 10, 30, max_context=20)
    with pytest.raises(ValueError, match="max_context"):
        DraftDataConfig(max_prompt_tokens=128, max_context=64)


def test_min_context_raises_the_floor_of_long_prompts():
    """min_context: long prompts are log-uniform in [min_context, max_context]; short ones are unchanged; a floor
    outside [max_tokens, max_context] (or without max_context) is refused naming the key."""
    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.regenerate import corpus_prompts

    docs = [f"# file {d}\n" + "".join(f"def f{d}_{i}(x):\n    return x + {i}\n\n" for i in range(40)) for d in range(6)]

    def encode(text: str) -> list[int]:
        return [4 + (b % 90) for b in text.encode()]

    kw = dict(min_tokens=10, max_tokens=30, seed=2, max_context=4000, long_fraction=0.5)
    prompts = corpus_prompts(docs, encode, 60, min_context=2000, **kw)
    long = [p for p in prompts if len(p) > 30]
    assert len(long) >= 15 and all(2000 <= len(p) <= 4000 for p in long)
    assert all(10 <= len(p) <= 30 for p in prompts if len(p) <= 30)
    with pytest.raises(ValueError, match="min_context"):
        corpus_prompts(docs, encode, 5, min_context=5000, **kw)
    with pytest.raises(ValueError, match="min_context"):
        DraftDataConfig(max_prompt_tokens=128, min_context=1000)  # no max_context
    with pytest.raises(ValueError, match="min_context"):
        DraftDataConfig(max_prompt_tokens=128, max_context=4096, min_context=64)


def test_draft_data_shards_merge_in_order(tmp_path):
    """`draft-data --merge N` joins shard-0..N-1 sample by sample (train and validation); a missing shard is an
    error naming it, and nothing is written."""
    from dspark.cli import main
    from dspark.train.features import merge_draft_data

    a = DraftDataset.from_samples([([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1])])
    b = DraftDataset.from_samples([([10, 11, 12, 13], [0, 0, 1, 1])])
    a.save(tmp_path / "shard-0" / "train.npz")
    a.save(tmp_path / "shard-0" / "validation.npz")
    with pytest.raises(FileNotFoundError, match="shard-1"):
        merge_draft_data(tmp_path, 2)
    assert not (tmp_path / "train.npz").exists()
    b.save(tmp_path / "shard-1" / "train.npz")
    assert main(["draft-data", "--out-dir", str(tmp_path), "--merge", "2"]) == 0
    train = DraftDataset.load(tmp_path / "train.npz")
    assert len(train) == 3 and train.num_loss_tokens == 5
    assert [train[i][0].tolist() for i in range(3)] == [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    assert len(DraftDataset.load(tmp_path / "validation.npz")) == 2  # shard-1 has no validation split


def test_prompt_anchors_add_distilled_blocks_over_the_prompt():
    """prompt_anchors=n keeps a sample's response anchors (same draws) and adds up to n distinct anchors before its
    first response token, whose labels (the prompt text, then the response) are supervised; kept anchors come
    first."""
    from dspark.train.draft_batches import make_block_batch

    rng = np.random.default_rng(0)
    samples = []
    for n_prompt, n_resp in ((300, 20), (5, 40), (0, 30), (40, 0)):
        ids = rng.integers(4, 90, n_prompt + n_resp).tolist()
        samples.append((ids, [0] * n_prompt + [1] * n_resp))
    data = DraftDataset.from_samples(samples)
    ids, rows = [0, 1, 2, 3], [0, 1, 2, 3]
    base = make_block_batch(data, ids, rows, 8, 4, 3, seed=1, step=5)
    more = make_block_batch(data, ids, rows, 8, 4, 3, seed=1, step=5, prompt_anchors=16)
    for r, (x, m) in enumerate(samples):
        first = m.index(1) if 1 in m else len(m)
        old = set(base.anchors[r][base.keep[r]].tolist())
        new = more.anchors[r][more.keep[r]].tolist()
        assert old <= set(new) and len(set(new)) == len(new)
        extra = [a for a in new if a not in old]
        assert all(a < first for a in extra) and len(extra) == min(16, first)
        k = int(more.keep[r].sum())
        assert more.keep[r, :k].all() and not more.keep[r, k:].any()  # kept anchors first
        for j, a in enumerate(more.anchors[r, :k].tolist()):
            n = int(more.eval_mask[r, j].sum())
            assert n == min(4, len(x) - 1 - a) and n > 0  # every label up to the sample's end is supervised
            assert more.labels[r, j, :n].tolist() == x[a + 1 : a + 1 + n]
    with pytest.raises(ValueError, match="prompt_anchors"):
        DraftTrainConfig(prompt_anchors=-1)
