"""dspark.train.pretrain on a tiny MoE model and a synthetic token array: learning, exact resume, export."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM, KimiLinearForCausalLM

from dspark.cli import main
from dspark.config import KimiLinearConfig, TargetConfig
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.loading import load_target
from dspark.models.target import MLATarget
from dspark.train.checkpoint import checkpoint_path
from dspark.train.loop import lr_at
from dspark.train.pretrain import RouterLoad, evaluate, init_from_model_dir, position_buckets, train_target
from dspark.train.pretrain_config import (
    PretrainConfig,
    default_target_config,
    kimi_k3_mini_config,
    tiny_pretrain_config,
)
from dspark.train.pretrain_data import TokenWindows

VOCAB = 48


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A learnable stream: shifted copies of one random 40-token motif, EOS (1) after each copy."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    motif = rng.integers(6, VOCAB, size=40)
    rows = [np.append(np.roll(motif, k), 1) for k in range(120)]
    tokens = np.concatenate(rows).astype(np.uint16)
    np.save(d / "train.npy", tokens)
    np.save(d / "validation.npy", tokens[: 41 * 12])
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "model_max_length": 4096}))
    (d / "data_manifest.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return d


def tiny(data_dir, out_dir, **kw) -> PretrainConfig:
    base = dict(vocab_size=VOCAB, max_steps=12, warmup_steps=3, eval_interval=6, ckpt_interval=4, progress=False)
    return tiny_pretrain_config(str(data_dir), str(out_dir), **(base | kw))


def test_default_config_keeps_k3_latent_geometry():
    cfg = default_target_config(8192, original_max_position_embeddings=512)
    assert cfg.mla.latent_dim == 576 and cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim) == (128, 128)
    assert cfg.max_position_embeddings == 2048 and cfg.rope.is_yarn and cfg.rope.factor == 4.0
    assert cfg.is_moe and not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and cfg.n_shared_experts == 1
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2) and not cfg.tie_word_embeddings
    # the HF dict round-trips through our loader
    assert TargetConfig.from_dict(cfg.to_hf_dict()) == cfg


def test_schedule_warmup_then_cosine():
    cfg = PretrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5) and lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_windows_resume_from_state():
    tokens = np.arange(1000, dtype=np.uint16)
    a = TokenWindows(tokens, 16, 3, seed=5)
    a.next_batch()
    state = a.state_dict()
    expected = a.next_batch()
    b = TokenWindows(tokens, 16, 3, seed=99)
    b.load_state_dict(state)
    torch.testing.assert_close(b.next_batch(), expected, rtol=0, atol=0)
    assert expected.shape == (3, 17) and torch.equal(expected[:, 1:] - expected[:, :-1], torch.ones(3, 16).long())


def test_loss_decreases_and_export_matches_transformers(data_dir, tmp_path):
    torch.manual_seed(0)
    result = train_target(tiny(data_dir, tmp_path / "run", max_steps=30, ckpt_interval=10, eval_interval=15))
    assert result.stopped_by == "max_steps" and result.steps == 30 and result.tokens == 30 * 4 * 32
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
    assert first > math.log(VOCAB) - 0.5 and last < first - 1.0
    assert result.val_ppl is not None and result.val_ppl < math.exp(first)

    export = tmp_path / "run" / "export"
    log = json.loads((export / "training_log.json").read_text())
    assert log["steps"] == 30 and log["tokens"] == result.tokens and log["val"][-1]["step"] == 30
    assert (export / "tokenizer_config.json").is_file()

    ours = load_target(export, "float32")
    hf = DeepseekV3ForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(6, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        torch.testing.assert_close(ours(ids, absorbed=False).logits, ref, rtol=0, atol=1e-4)
        torch.testing.assert_close(ours(ids, absorbed=True).logits, ref, rtol=0, atol=1e-4)


def test_resume_is_bit_identical(data_dir, tmp_path):
    full = train_target(tiny(data_dir, tmp_path / "full"))
    halted = train_target(tiny(data_dir, tmp_path / "split", halt_at_step=5))
    assert halted.stopped_by == "halt" and halted.steps == 5 and halted.export_dir is None
    with pytest.raises(FileExistsError, match="--resume"):
        train_target(tiny(data_dir, tmp_path / "split"))
    resumed = train_target(tiny(data_dir, tmp_path / "split"), resume=True)
    assert resumed.steps == full.steps == 12
    assert halted.losses + resumed.losses == full.losses

    a = torch.load(checkpoint_path(tmp_path / "full"), weights_only=True)
    b = torch.load(checkpoint_path(tmp_path / "split"), weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    assert any("e_score_correction_bias" in k and t.abs().sum() > 0 for k, t in a["model"].items())
    assert a["loader"] == b["loader"] and a["run"]["train_loss"] == b["run"]["train_loss"]


def test_resume_refuses_a_different_shape(data_dir, tmp_path):
    train_target(tiny(data_dir, tmp_path / "r", halt_at_step=2))
    with pytest.raises(ValueError, match="hidden_size"):
        train_target(tiny(data_dir, tmp_path / "r", hidden_size=32), resume=True)


def test_continued_pretraining_starts_from_the_saved_weights_with_new_yarn(data_dir, tmp_path):
    """--init-from: step 0 of the new run is the old model (same loss at the old positions), the YaRN factor and
    window may change, anything else may not."""
    base = train_target(tiny(data_dir, tmp_path / "short", max_steps=8))
    old = load_target(base.export_dir, "float32")
    longer = tiny(data_dir, tmp_path / "long", init_from=base.export_dir, yarn_factor=32.0)
    longer = longer.__class__(**{**longer.to_dict(), "original_max_position_embeddings": 32, "max_steps": 4})
    halted = train_target(longer.__class__(**{**longer.to_dict(), "halt_at_step": 0}))
    assert halted.steps == 0
    blob = torch.load(checkpoint_path(tmp_path / "long"), weights_only=True)
    for name, t in old.state_dict().items():
        assert torch.equal(blob["model"][name], t), name
    assert blob["target_config"]["rope_parameters"]["factor"] == 32.0
    assert blob["target_config"]["max_position_embeddings"] == 32 * 32

    resumed = train_target(longer, resume=True)  # the resume keeps the trained weights, not the init source
    assert resumed.steps == 4 and resumed.export_dir is not None
    log = json.loads((tmp_path / "long" / "export" / "training_log.json").read_text())
    assert log["pretrain_config"]["init_from"] == base.export_dir
    tok_cfg = json.loads((tmp_path / "long" / "export" / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == 32 * 32  # the tokenizer's limit follows the extended window

    wider = tiny(data_dir, tmp_path / "wide", init_from=base.export_dir, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size"):
        train_target(wider)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "model_tok").mkdir()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "model_tok" / f).write_bytes((tmp_path / "short" / "export" / f).read_bytes())
    (tmp_path / "model_tok" / "tokenizer.json").write_text('{"other": 1}')
    with pytest.raises(ValueError, match="tokenizer"):
        init_from_model_dir(MLATarget(longer.target_config(VOCAB)), tmp_path / "model_tok", tmp_path / "tok")
    with pytest.raises(FileNotFoundError, match="config.json"):
        init_from_model_dir(MLATarget(longer.target_config(VOCAB)), tmp_path / "tok", tmp_path / "tok")


def test_validation_reports_perplexity_by_position_bucket(data_dir, tmp_path):
    assert position_buckets(4096, 512) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    assert position_buckets(48, 32) == [(0, 32), (32, 48)]
    cfg = tiny(data_dir, tmp_path / "b", max_steps=2, eval_interval=1, seq_len=32, eval_seq_len=64, autocast_bf16=False)
    model = MLATarget(cfg.target_config(VOCAB))
    windows = torch.randint(6, VOCAB, (3, 65), generator=torch.Generator().manual_seed(0))
    mean, per_position = evaluate(model, windows, cfg)
    assert per_position.shape == (64,) and mean == pytest.approx(float(per_position.mean()))
    with torch.no_grad():
        logits = model(windows[:, :-1], absorbed=False).logits
    ref = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(0)
    torch.testing.assert_close(per_position.float(), ref, rtol=1e-4, atol=1e-4)

    train_target(cfg)
    log = json.loads((tmp_path / "b" / "export" / "training_log.json").read_text())
    assert set(log["val"][-1]["ppl_by_position"]) == {"0-31", "32-63"}


def test_router_bias_nudges_toward_balance():
    torch.manual_seed(0)
    cfg = tiny_pretrain_config("unused", "unused", vocab_size=VOCAB)
    model = MLATarget(cfg.target_config(VOCAB))
    load = RouterLoad(model)
    ids = torch.randint(6, VOCAB, (2, 16))
    model(ids, absorbed=False)  # not recording: counts stay zero
    assert all(int(c.sum()) == 0 for c in load.counts)
    with load.recording():
        model(ids, absorbed=False)
    k = cfg.num_experts_per_tok
    assert all(int(c.sum()) == 2 * 16 * k for c in load.counts)
    counts = [c.clone().double() for c in load.counts]
    load.nudge(0.01)
    for gate, c in zip(load.gates, counts):
        expected = 0.01 * torch.sign(c.mean() - c)
        torch.testing.assert_close(gate.e_score_correction_bias.double(), expected)
    assert all(int(c.sum()) == 0 for c in load.counts)


def test_cli_tiny_run(data_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(
        ["train-target", "--data-dir", str(data_dir), "--out-dir", str(out), "--tiny"]
        + ["--max-steps", "6", "--quiet", "--json"]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] == 6 and result["stopped_by"] == "max_steps"
    assert (out / "export" / "model.safetensors").is_file() and checkpoint_path(out).is_file()
    assert main(["train-target", "--data-dir", str(data_dir), "--out-dir", str(out), "--tiny"]) == 1


def test_time_budget_derives_and_records_a_horizon(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path / "t", max_steps=None, max_minutes=0.04, horizon_interval=3, ckpt_interval=50)
    result = train_target(cfg)
    assert result.stopped_by in ("max_steps", "time_budget") and result.export_dir is not None
    log = json.loads((tmp_path / "t" / "export" / "training_log.json").read_text())
    assert log["horizons"] and log["horizons"][0][0] == cfg.probe_steps
    assert all(h > cfg.warmup_steps and h > s for s, h in log["horizons"])
    blob = torch.load(checkpoint_path(tmp_path / "t"), weights_only=True)
    assert blob["run"]["max_steps"] == log["horizons"][-1][1] == result.max_steps


# ---- the K3-shaped hybrid (kimi_linear) ---------------------------------------------------------------


def test_hybrid_layout_is_k3s_three_to_one():
    cfg = kimi_k3_mini_config().target_config(8192)
    assert isinstance(cfg, KimiLinearConfig)
    assert cfg.mla_layers == (3, 7, 11) and len(cfg.kda_layers) == 9  # 1-based 4, 8, 12: every 4th + the last
    assert cfg.mla.latent_dim == 576 and cfg.base.mla_use_nope and cfg.base.mla_use_output_gate
    assert (cfg.hidden_act, cfg.moe_latent_size, cfg.attn_res_block_size) == ("situ", 128, 4)
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.tap_streams[0] == "prefix"
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    assert KimiLinearConfig.from_dict(cfg.to_hf_dict()).layer_types == cfg.layer_types
    with pytest.raises(ValueError, match="architecture"):
        PretrainConfig(architecture="mamba")


@pytest.mark.parametrize("k3_extras", [True, False])
def test_hybrid_learns_and_exports_a_kimi_linear_checkpoint(data_dir, tmp_path, k3_extras):
    plain = {"hidden_act": "silu", "moe_latent_size": None, "attn_res_block_size": None}
    plain |= {"mla_use_output_gate": False, "kda_gate_lower_bound": None}
    extras = {} if k3_extras else plain
    cfg = tiny(data_dir, tmp_path / "h", architecture="kimi_linear", max_steps=30, export_dtype="float32", **extras)
    result = train_target(cfg)
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
    assert last < first - 1.0
    export = tmp_path / "h" / "export"
    ours = load_target(export, "float32")
    assert isinstance(ours, KimiLinearTarget) and ours.config.layer_types == ("linear_attention", "full_attention")
    ids = torch.randint(6, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    blob = torch.load(checkpoint_path(tmp_path / "h"), weights_only=True)
    trained = KimiLinearTarget(cfg.target_config(VOCAB))
    trained.load_state_dict(blob["model"])
    with torch.no_grad():
        want = trained.eval()(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, rtol=0, atol=1e-5)
        if not k3_extras:  # plain Kimi Linear: transformers reads the export unchanged
            hf = KimiLinearForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
            torch.testing.assert_close(ours(ids).logits, hf(ids).logits.float(), rtol=0, atol=1e-4)


def test_hybrid_resume_is_bit_identical(data_dir, tmp_path):
    kw = {"architecture": "kimi_linear"}
    full = train_target(tiny(data_dir, tmp_path / "full", **kw))
    train_target(tiny(data_dir, tmp_path / "split", halt_at_step=5, **kw))
    resumed = train_target(tiny(data_dir, tmp_path / "split", **kw), resume=True)
    assert resumed.losses == full.losses[5:]
