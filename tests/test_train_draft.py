"""Drafter training: data regeneration, feature cache, the DSpark/DFlash training step, DDP and resume."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from dspark.models.loading import draft_roster, load_drafter
from dspark.models.tiny import build_tiny_pair, write_tiny_pair
from dspark.train.distributed import Dist, shutdown_distributed
from dspark.train.draft_batches import step_samples
from dspark.train.draft_config import DraftTrainConfig, draft_config_for, spread_taps
from dspark.train.draft_data import DraftDataset
from dspark.train.draft_model import BlockForward, warm_start_
from dspark.train.features import FeatureCache, prepare_features, target_features
from dspark.train.pretrain_config import default_target_config
from dspark.train.regenerate import corpus_prompts, cut_points
from dspark.train.trainer import DraftTrainer, train_draft

V = 96  # tiny vocab


def tiny_dataset(n: int = 8, seed: int = 0, gap: bool = True) -> DraftDataset:
    """Random token samples: a prompt (mask 0), a response (mask 1), optionally a masked gap mid-response."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(18, 34))
        prompt = int(rng.integers(3, 8))
        ids = rng.integers(4, V, length).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        if gap and i % 2:
            mask[prompt + 5 : prompt + 7] = [0, 0]  # e.g. a second user turn
        samples.append((ids, mask))
    return DraftDataset.from_samples(samples)


def tiny_cfg(**kw) -> DraftTrainConfig:
    base = DraftTrainConfig(
        max_steps=4,
        batch_size=4,
        num_anchors=6,
        markov_rank=8,
        lr=3e-3,
        warmup_steps=1,
        autocast_bf16=False,
        feature_dtype="float32",
        progress=False,
        eval_interval=1000,
        ckpt_interval=2,
        log_interval=1,
        num_threads=1,
    )
    return replace(base, **kw)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    t, _ = build_tiny_pair(0)
    return t


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- config ------------------------------------------------------------------------------------------------


def test_draft_config_for_the_bundled_target_shares_the_latent_format() -> None:
    tcfg = default_target_config(8192)
    d = draft_config_for(tcfg)
    assert d.hidden_size == tcfg.hidden_size and d.num_hidden_layers == 2
    assert d.mla.latent_dim == tcfg.mla.latent_dim == 576
    assert (d.kv_lora_rank, d.qk_rope_head_dim) == (512, 64)
    assert d.rope == tcfg.rope and d.max_position_embeddings == tcfg.max_position_embeddings
    assert d.target_layer_ids == (1, 4, 7, 10) and tcfg.num_hidden_layers - 1 not in d.target_layer_ids
    assert d.mask_token_id == 3 and d.block_size == 7 and d.markov_head_type == "vanilla"
    assert d.to_dict()["model_type"] == "k3_dspark" and d.to_dict()["block_size"] == 7
    assert spread_taps(4, 2) == (1, 2)
    with pytest.raises(ValueError, match="last layer"):
        draft_config_for(tcfg, taps=(3, 11))
    flash = DraftTrainConfig(dflash=True, max_steps=1)
    assert flash.draft_config(tcfg).markov_rank == 0 and not flash.draft_config(tcfg).enable_confidence_head
    assert (flash.loss_weights.ce, flash.loss_weights.l1, flash.loss_weights.confidence) == (1.0, 0.0, 0.0)


# ---- batches -----------------------------------------------------------------------------------------------


def test_step_samples_cover_each_epoch_once() -> None:
    seen = [i for s in range(5) for i in step_samples(s, 4, 10, seed=1)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert step_samples(3, 4, 10, 1) == step_samples(3, 4, 10, 1)


def test_training_batch_supervises_only_a_contiguous_prefix_inside_each_sample(target) -> None:
    data = tiny_dataset(8)
    trainer = DraftTrainer(tiny_cfg(batch_size=8, micro_batch_size=4, num_anchors=40), target, data)
    batches = trainer.step_batches(0)
    assert len(batches) == 2
    for batch in batches:
        em = batch.eval_mask
        K = em.shape[-1]
        # contiguous prefix: once a slot is unsupervised, every later slot is too
        assert not (em[..., 1:] & ~em[..., :-1]).any()
        assert em.any()
        for b, a, j in em.nonzero().tolist():
            anchor = int(batch.anchors[b, a])
            length = int(batch.lengths[b])
            assert batch.keep[b, a]
            assert batch.loss_mask[b, anchor] and batch.loss_mask[b, anchor + 1]
            assert anchor + j + 1 < length  # never past the sample's end (nor into padding)
            assert batch.loss_mask[b, anchor + j + 1]
            assert batch.labels[b, a, j] == batch.input_ids[b, anchor + j + 1]
        # a slot is unsupervised only for a reason: end of sample, a masked label, or a dropped block
        for b, a in batch.keep.nonzero().tolist():
            anchor = int(batch.anchors[b, a])
            n = int(em[b, a].sum())
            if n < K:
                nxt = anchor + n + 1
                assert nxt >= int(batch.lengths[b]) or not batch.loss_mask[b, nxt]
        assert not em[~batch.keep].any()
        assert (batch.block_ids[..., 1:] == 3).all()
        assert (batch.block_ids[..., 0] == batch.input_ids.gather(1, batch.anchors)).all()


def test_block_output_never_depends_on_context_at_or_after_its_anchor(target) -> None:
    data = tiny_dataset(4, gap=False)
    trainer = DraftTrainer(tiny_cfg(num_anchors=4), target, data)
    batch = trainer.step_batches(0)[0]
    feats = trainer.features(batch, "train")
    fwd = BlockForward(trainer.drafter).eval()
    with torch.no_grad():
        base, conf = fwd(batch.block_ids, batch.anchors, batch.keep, batch.labels, feats.taps.float())
        b, a = batch.keep.nonzero()[0].tolist()
        anchor = int(batch.anchors[b, a])
        taps = feats.taps.float().clone()
        taps[b, anchor:] += 5.0 * torch.randn_like(taps[b, anchor:])
        moved, conf2 = fwd(batch.block_ids, batch.anchors, batch.keep, batch.labels, taps)
        torch.testing.assert_close(moved[b, a], base[b, a], rtol=0, atol=1e-5)
        taps = feats.taps.float().clone()
        taps[b, anchor - 1] += 5.0  # the token just before the anchor is visible
        moved, _ = fwd(batch.block_ids, batch.anchors, batch.keep, batch.labels, taps)
        assert (moved[b, a] - base[b, a]).abs().max() > 1e-3


# ---- optimisation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_anchors", [0, 3])
def test_one_optimisation_step_lowers_the_loss(target, prompt_anchors: int) -> None:
    data = tiny_dataset(4)
    trainer = DraftTrainer(tiny_cfg(lr=3e-3, warmup_steps=1, prompt_anchors=prompt_anchors), target, data)
    batches = trainer.step_batches(0)

    def loss() -> float:
        with torch.no_grad():
            return sum(float(trainer.batch_loss(b, "train", trainer._weight_sum(b)).loss) for b in batches)

    before = loss()
    trainer.train_step()
    after = loss()
    assert after < before - 1e-3
    # embedding and lm_head stay the target's frozen modules (not drafter parameters)
    names = dict(trainer.drafter.named_parameters())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert trainer.drafter.embed_tokens is target.embed_tokens and trainer.drafter.lm_head is target.lm_head


def test_online_and_offline_features_give_the_same_loss(target, tmp_path: Path) -> None:
    data = tiny_dataset(6)
    cfg = tiny_cfg(batch_size=3, num_anchors=6)
    online = DraftTrainer(cfg, target, data)
    taps = online.draft_cfg.target_layer_ids
    prepare_features(target, data, tmp_path / "features" / "train", taps, "float32", autocast=False, batch_tokens=64)
    offline = DraftTrainer(replace(cfg, features="offline", feature_dir=str(tmp_path / "features")), target, data)
    offline.drafter.load_state_dict(online.drafter.state_dict())
    cache = FeatureCache(tmp_path / "features" / "train", data, taps)
    x, _ = data[2]
    ref = target_features(target, torch.from_numpy(x)[None], taps, "float32", autocast=False)
    t, h = cache.get(2)
    torch.testing.assert_close(t, ref.taps[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, ref.hidden[0], rtol=1e-5, atol=1e-5)
    for step in range(2):
        b_on, b_off = online.step_batches(step)[0], offline.step_batches(step)[0]
        assert torch.equal(b_on.anchors, b_off.anchors)
        l_on = online.batch_loss(b_on, "train", online._weight_sum(b_on))
        l_off = offline.batch_loss(b_off, "train", offline._weight_sum(b_off))
        torch.testing.assert_close(l_on.loss, l_off.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(l_on.accept_rate, l_off.accept_rate, rtol=1e-5, atol=1e-6)
        online.train_step()
        offline.train_step()
    for k, v in _params(online.drafter).items():
        torch.testing.assert_close(_params(offline.drafter)[k], v, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="different dataset"):
        FeatureCache(tmp_path / "features" / "train", tiny_dataset(6, seed=1))
    with pytest.raises(ValueError, match="prepare-features --taps"):
        FeatureCache(tmp_path / "features" / "train", data, (0, 1))


def test_feature_cache_split_over_many_shards_reads_back_every_sample(target, tmp_path: Path) -> None:
    data = tiny_dataset(6, seed=2)
    taps = spread_taps(target.config.num_hidden_layers, 2)
    res = prepare_features(
        target, data, tmp_path / "f", taps, "float32", autocast=False, batch_tokens=80, max_shard_bytes=20_000
    )
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2 and res.num_samples == 6 and res.num_tokens == int(data.lengths().sum())
    width = manifest["taps_width"] + manifest["hidden_width"]
    assert res.bytes_written == res.num_tokens * width * 4
    cache = FeatureCache(tmp_path / "f", data, taps)
    for i in range(len(data)):
        x, _ = data[i]
        ref = target_features(target, torch.from_numpy(x)[None], taps, "float32", autocast=False)
        t, h = cache.get(i)
        torch.testing.assert_close(t, ref.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, ref.hidden[0], rtol=1e-5, atol=1e-5)


# a small lr: Adam's first step is lr·g/(|g|+eps), so near-zero gradients turn fp32 summation-order noise
# (one batch of 4 vs two ranks of 2) into lr-sized parameter noise
DDP_CFG = tiny_cfg(batch_size=4, lr=2e-4)


def _ddp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        tgt, _ = build_tiny_pair(0)
        trainer = DraftTrainer(DDP_CFG, tgt, tiny_dataset(8), dist_info=Dist(rank, world))
        sums, _ = trainer.train_step()
        if rank == 0:
            torch.save({"params": _params(trainer.drafter), "sums": sums.values}, out)
        del trainer  # its DDP reducer holds gloo work: drop it before the group goes
        shutdown_distributed()
    except BaseException:
        shutdown_distributed(synchronize=False)
        raise


def test_two_rank_gloo_ddp_equals_single_process(target, tmp_path: Path) -> None:
    single = DraftTrainer(DDP_CFG, target, tiny_dataset(8))
    init = _params(single.drafter)
    single_sums, _ = single.train_step()
    ref = _params(single.drafter)
    out = tmp_path / "rank0.pt"
    # spawn, not fork: forking a parent whose OpenMP/torch threads are live can deadlock the children
    mp.start_processes(_ddp_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, start_method="spawn")
    blob = torch.load(out, weights_only=True)
    got = blob["params"]
    assert got.keys() == ref.keys()
    for k in ref:
        assert float((ref[k] - init[k]).abs().max()) > 1e-5, f"{k} did not move"
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6, msg=k)
    # rank 0 saw half the sequences: its metric sums are a part of the single-process ones
    assert 0 < float(blob["sums"][0]) < float(single_sums.values[0])


def test_resume_continues_bit_identically_and_exports_the_official_format(target, tmp_path: Path) -> None:
    data, val = tiny_dataset(8), tiny_dataset(3, seed=5)
    cfg = tiny_cfg(max_steps=4, out_dir=str(tmp_path / "a"))
    full = train_draft(cfg, target=target, train_data=data, val_data=val)
    assert full.steps == 4 and full.stopped_by == "max_steps" and full.export_dir
    halted = train_draft(replace(cfg, out_dir=str(tmp_path / "b"), halt_at_step=2), target=target, train_data=data)
    assert halted.steps == 2 and halted.stopped_by == "halt" and halted.export_dir is None
    with pytest.raises(FileExistsError, match="--resume"):
        train_draft(replace(cfg, out_dir=str(tmp_path / "b")), target=target, train_data=data)
    resumed = train_draft(
        replace(cfg, out_dir=str(tmp_path / "b")), resume=True, target=target, train_data=data, val_data=val
    )
    assert resumed.steps == 4
    a = torch.load(tmp_path / "a" / "checkpoint" / "last.pt", weights_only=True)["trainer"]["model"]
    b = torch.load(tmp_path / "b" / "checkpoint" / "last.pt", weights_only=True)["trainer"]["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(ValueError, match="different settings"):
        train_draft(
            replace(cfg, out_dir=str(tmp_path / "b"), num_anchors=3), resume=True, target=target, train_data=data
        )
    # export: k3_dspark config + official roster, bf16, loads against the target
    export = Path(full.export_dir)
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "k3_dspark" and config["block_size"] == 7 and config["torch_dtype"] == "bfloat16"
    loaded = load_drafter(export, target)
    roster = draft_roster(loaded.config, include_embedding=False)
    assert set(roster) == set(loaded.file_name(k) for k in loaded.state_dict() if not k.startswith("rotary."))
    log = json.loads((export / "training_log.json").read_text())
    ev = log["final_eval"]
    assert len(ev["accept_rate"]) == 7 and 1.0 <= ev["tau_probabilistic"] <= 8.0


def test_dflash_trains_with_ce_only(target, tmp_path: Path) -> None:
    cfg = tiny_cfg(dflash=True, max_steps=2, out_dir=str(tmp_path / "f"))
    res = train_draft(cfg, target=target, train_data=tiny_dataset(4), val_data=tiny_dataset(2, seed=3))
    config = json.loads((Path(res.export_dir) / "config.json").read_text())
    assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
    assert res.final_train is not None and res.final_train["confidence"] == 0.0
    assert abs(res.final_train["loss"] - res.final_train["ce"]) < 1e-4


# ---- data --------------------------------------------------------------------------------------------------


def test_dataset_round_trip_and_validation(tmp_path: Path) -> None:
    ds = tiny_dataset(5)
    ds.save(tmp_path / "d.npz")
    back = DraftDataset.load(tmp_path / "d.npz")
    assert len(back) == 5 and back.fingerprint() == ds.fingerprint()
    x, m = back[3]
    assert x.dtype == np.int64 and m.dtype == bool and x.shape == m.shape
    with pytest.raises(ValueError, match="loss-mask"):
        DraftDataset.from_samples([([1, 2, 3], [0, 1])])
    with pytest.raises(FileNotFoundError, match="draft-data"):
        DraftDataset.load(tmp_path / "missing.npz")


def test_corpus_prompts_end_at_header_lines_and_respect_lengths() -> None:
    doc = "import os\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(30))
    assert all(doc[c - 1] == "\n" for c in cut_points(doc))

    def encode(text: str) -> list[int]:
        return [4 + (b % 90) for b in text.encode()]

    prompts = corpus_prompts([doc, doc.replace("def", "class")], encode, 20, min_tokens=10, max_tokens=30, seed=0)
    assert len(prompts) == 20 and len({tuple(p) for p in prompts}) == 20
    assert all(10 <= len(p) <= 30 for p in prompts)
    colon_newline = encode(":\n")
    assert sum(p[-2:] == colon_newline for p in prompts) >= 18  # header cuts (plus maybe the file-start cut)


def test_regenerated_responses_are_the_targets_and_masked(tmp_path: Path) -> None:
    from dspark.llm import build_engine
    from dspark.models.loading import load_target
    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.regenerate import _make_samples, regenerate_responses, sampling_params_for

    target_dir, _ = write_tiny_pair(tmp_path / "pair", seed=0)
    engine = build_engine(target_dir, None, dtype="float32", max_num_seqs=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21, 22]]
    cfg = DraftDataConfig(max_new_tokens=6, temperatures=(0.0,), min_response_tokens=2)
    responses = regenerate_responses(engine, prompts, [sampling_params_for(cfg, i, 0) for i in range(3)])
    tgt = load_target(target_dir, "float32")
    for p, r in zip(prompts, responses):
        seq = list(p)
        with torch.no_grad():
            for _ in range(len(r)):
                seq.append(int(tgt(torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(p) :] == r
    # submitted shortest first: sampled responses are still each prompt's own (per-request seeds)
    from dspark.llm import LLM

    hot = DraftDataConfig(max_new_tokens=6, temperatures=(1.0,), min_response_tokens=2)
    params = [sampling_params_for(hot, i, 0) for i in range(3)]
    alone = [list(LLM.from_engine(engine).generate([p], [q])[0].token_ids) for p, q in zip(prompts, params)]
    assert regenerate_responses(engine, prompts, params) == alone
    samples, dropped = _make_samples(prompts, responses, cfg.min_response_tokens)
    ds = DraftDataset.from_samples(samples)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        x, m = ds[i]
        assert x.tolist() == p + r and m.tolist() == [False] * len(p) + [True] * len(r)


def test_timed_run_derives_its_horizon_and_exports(target, tmp_path: Path) -> None:
    cfg = tiny_cfg(max_steps=None, max_minutes=0.02, probe_steps=2, warmup_steps=3, out_dir=str(tmp_path / "t"))
    assert cfg.time_mode
    res = train_draft(cfg, target=target, train_data=tiny_dataset(4))
    assert res.max_steps is not None and res.max_steps >= 4 and res.export_dir is not None
    assert res.stopped_by in ("max_steps", "time_budget")
    with pytest.raises(ValueError, match="probe_steps"):
        tiny_cfg(max_steps=None, max_minutes=1.0, probe_steps=5, warmup_steps=3)


def test_cli_pipeline_draft_data_features_and_training(tmp_path: Path) -> None:
    from dspark.cli import main

    target_dir, _ = write_tiny_pair(tmp_path / "pair", seed=0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    doc = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(40))
    for split in ("train", "validation"):
        line = json.dumps({"path": f"{split}.py", "text": doc})
        (corpus / f"{split}.jsonl").write_text(line + "\n")
    data = tmp_path / "data"
    common = ["--target", str(target_dir)]
    assert (
        main(
            ["draft-data", *common, "--corpus-dir", str(corpus), "--out-dir", str(data), "--num-prompts", "6"]
            + ["--num-val-prompts", "2", "--max-new-tokens", "12", "--dtype", "float32", "--quiet"]
        )
        == 0
    )
    train = DraftDataset.load(data / "train.npz")
    manifest = json.loads((data / "manifest.json").read_text())
    assert len(train) == manifest["train_samples"] and 1 <= len(train) <= 6  # short responses are dropped
    assert 0 < train.num_loss_tokens <= 6 * 12
    assert main(["prepare-features", *common, "--data-dir", str(data), "--quiet"]) == 0
    train_args = ["train-draft", *common, "--data-dir", str(data), "--features", "offline", "--max-steps", "2"]
    train_args += ["--batch-size", "2", "--num-anchors", "4", "--markov-rank", "8", "--quiet"]
    assert main([*train_args, "--out-dir", str(tmp_path / "draft")]) == 0
    assert main([*train_args, "--out-dir", str(tmp_path / "dflash"), "--dflash"]) == 0
    assert main([*train_args, "--out-dir", str(tmp_path / "draft")]) == 1  # exists: needs --resume
    for name, rank in (("draft", 8), ("dflash", 0)):
        config = json.loads((tmp_path / name / "export" / "config.json").read_text())
        assert config["markov_rank"] == rank and config["target_layer_ids"] == [1, 2]


def test_init_from_warm_starts_a_fresh_run_from_a_checkpoint_or_an_export(target, tmp_path: Path) -> None:
    data = tiny_dataset(8)
    first = train_draft(tiny_cfg(max_steps=2, out_dir=str(tmp_path / "a")), target=target, train_data=data)
    trained = torch.load(tmp_path / "a" / "checkpoint" / "last.pt", weights_only=True)["trainer"]["model"]
    for source in (tmp_path / "a", tmp_path / "a" / "checkpoint" / "last.pt"):
        fresh = DraftTrainer(tiny_cfg(seed=7), target, data)
        assert any(not torch.equal(fresh.drafter.state_dict()[k], v) for k, v in trained.items())
        warm_start_(fresh.drafter, str(source), target)
        for k, v in trained.items():
            torch.testing.assert_close(fresh.drafter.state_dict()[k], v, rtol=0, atol=0, msg=k)
    fresh = DraftTrainer(tiny_cfg(seed=7), target, data)
    warm_start_(fresh.drafter, first.export_dir, target)  # bf16 export: equal up to bf16 rounding
    for k, v in trained.items():
        torch.testing.assert_close(fresh.drafter.state_dict()[k], v.bfloat16().float(), rtol=0, atol=0, msg=k)
    # through train_draft: a warm-started run halted before its first step checkpoints the source's weights
    cfg = tiny_cfg(out_dir=str(tmp_path / "b"), init_from=str(tmp_path / "a"), halt_at_step=0)
    assert train_draft(cfg, target=target, train_data=data).steps == 0
    halted = torch.load(tmp_path / "b" / "checkpoint" / "last.pt", weights_only=True)["trainer"]
    assert halted["step"] == 0
    for k, v in trained.items():
        torch.testing.assert_close(halted["model"][k], v, rtol=0, atol=0, msg=k)
    # a warm start with a validation split evaluates its starting weights first (the log's step 0)
    val = tiny_dataset(3, seed=5)
    cfg = tiny_cfg(out_dir=str(tmp_path / "c"), init_from=str(tmp_path / "a"), max_steps=1)
    res = train_draft(cfg, target=target, train_data=data, val_data=val)
    log = json.loads((Path(res.export_dir) / "training_log.json").read_text())
    start = DraftTrainer(cfg, target, data, val)
    warm_start_(start.drafter, str(tmp_path / "a"), target)
    assert log["eval"][0]["step"] == 0
    assert log["eval"][0]["tau_probabilistic"] == pytest.approx(start.evaluate()["tau_probabilistic"], abs=1e-4)
    # a YaRN-extended target (same weights, new positions): the drafter starts from the short-context one
    rope = replace(target.config.rope, factor=4 * target.config.rope.factor)
    longer = type(target)(
        replace(target.config, rope=rope, max_position_embeddings=4 * target.config.max_position_embeddings)
    )
    longer.load_state_dict(target.state_dict())
    extended = DraftTrainer(tiny_cfg(seed=7), longer, data)
    assert extended.drafter.config.rope == rope
    warm_start_(extended.drafter, str(tmp_path / "a"), longer)
    for k, v in trained.items():
        torch.testing.assert_close(extended.drafter.state_dict()[k], v, rtol=0, atol=0, msg=k)
    other = DraftTrainer(tiny_cfg(num_layers=3, seed=7), target, data)
    with pytest.raises(ValueError, match="init-from .*num_hidden_layers"):
        warm_start_(other.drafter, str(tmp_path / "a"), target)
    with pytest.raises(FileNotFoundError, match="init-from"):
        warm_start_(other.drafter, str(tmp_path / "nowhere"), target)


def test_sharded_draft_data_with_features_merges_into_one_cache(target, tmp_path: Path) -> None:
    """Two draft-data shards, each with its own prepare-features cache, merge (`--merge 2`) into one dataset and
    one cache whose features for every merged sample equal a fresh target pass over it."""
    from dspark.train.features import merge_draft_data

    taps = (0, 1)
    parts = [tiny_dataset(3, seed=1), tiny_dataset(4, seed=2)]
    for k, ds in enumerate(parts):
        ds.save(tmp_path / f"shard-{k}" / "train.npz")
        prepare_features(target, ds, tmp_path / f"shard-{k}" / "features" / "train", taps, "float32", autocast=False)
    merge_draft_data(tmp_path, 2)
    merge_draft_data(tmp_path, 2)  # the shards stay complete caches: merging again (e.g. with more shards) works
    data = DraftDataset.load(tmp_path / "train.npz")
    assert len(data) == 7
    FeatureCache(tmp_path / "shard-1" / "features" / "train", parts[1], taps)  # a shard's own cache is intact
    cache = FeatureCache(tmp_path / "features" / "train", data, taps)  # checks the dataset fingerprint
    for i in (0, 2, 3, 6):
        x, _ = data[i]
        ref = target_features(target, torch.from_numpy(x)[None], taps, "float32", autocast=False)
        t, h = cache.get(i)
        torch.testing.assert_close(t, ref.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, ref.hidden[0], rtol=1e-5, atol=1e-5)
