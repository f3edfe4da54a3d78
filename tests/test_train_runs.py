"""A drafter run that accumulates: ``--run NAME`` state under $DSPARK_CACHE/runs, a token-count horizon that can be
extended, and a run killed mid-step (SIGKILL) that resumes to exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.models.tiny import write_tiny_pair
from dspark.train.draft_batches import step_samples, step_tokens, steps_for_tokens
from dspark.train.draft_cli import run_state
from dspark.train.draft_data import DraftDataset

V = 96


def write_dataset(out: Path, n: int = 12, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(20, 40))
        prompt = int(rng.integers(3, 8))
        samples.append((rng.integers(4, V, length).tolist(), [0] * prompt + [1] * (length - prompt)))
    out.mkdir(parents=True, exist_ok=True)
    DraftDataset.from_samples(samples).save(out / "train.npz")
    return out


def test_token_horizon_counts_the_step_batches_tokens(tmp_path: Path) -> None:
    data = DraftDataset.load(write_dataset(tmp_path / "d") / "train.npz")
    sizes = np.diff(data.offsets)
    assert step_tokens(3, 4, data, 42) == int(sizes[step_samples(3, 4, len(data), 42)].sum())
    budget = sum(step_tokens(s, 4, data, 42) for s in range(7)) - 1  # needs 7 steps, not 6
    assert steps_for_tokens(budget, 4, data, 42) == 7
    assert steps_for_tokens(budget + 1, 4, data, 42) == 7
    assert steps_for_tokens(budget + 2, 4, data, 42) == 8
    assert steps_for_tokens(1, 4, data, 42) == 1


def test_run_name_resumes_or_warm_starts_from_the_shipped_drafter(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    fresh = {"target_dir": "smollm2-135m-instruct"}
    assert run_state("sg", fresh) is False
    shipped = json.loads((Path(fresh["init_from"]) / "config.json").read_text())
    assert fresh["out_dir"] == str(tmp_path / "cache" / "runs" / "sg")
    assert fresh["markov_rank"] == shipped["markov_rank"]
    assert list(fresh["target_layer_ids"]) == shipped["target_layer_ids"]
    mine = {"target_dir": "smollm2-135m-instruct", "markov_rank": 8}
    run_state("sg2", mine)
    assert mine["markov_rank"] == 8  # a shape flag given by the user wins
    ckpt = tmp_path / "cache" / "runs" / "sg" / "checkpoint" / "last.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")
    again = {"target_dir": "smollm2-135m-instruct"}
    assert run_state("sg", again) is True and "init_from" not in again
    with pytest.raises(ValueError, match="--out-dir"):
        run_state("sg", {"out_dir": "x"})
    with pytest.raises(ValueError, match="plain path component"):
        run_state("../x", {})


def _train_cmd(target: Path, data: Path, *extra: str) -> list[str]:
    args = ["train-draft", "--target", str(target), "--data-dir", str(data), "--batch-size", "4"]
    args += ["--num-anchors", "6", "--markov-rank", "8", "--lr", "3e-3", "--warmup-steps", "1", "--no-autocast"]
    args += ["--ckpt-interval", "1", "--log-interval", "1", "--num-threads", "1", "--quiet", *extra]
    return [sys.executable, "-c", "import sys; from dspark.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoint" / "last.pt", weights_only=True)["trainer"]["model"]


def test_a_run_killed_mid_step_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    target, _ = write_tiny_pair(tmp_path / "pair", seed=0)
    data = write_dataset(tmp_path / "data", n=16)
    env = os.environ | {"DSPARK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    budget = ["--max-train-tokens", "1500"]
    straight = subprocess.run(_train_cmd(target, data, "--run", "a", *budget), env=env, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr
    run_b = tmp_path / "cache" / "runs" / "b"
    proc = subprocess.Popen(_train_cmd(target, data, "--run", "b", *budget), env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    ckpt = run_b / "checkpoint" / "last.pt"
    while time.monotonic() < deadline and proc.poll() is None:  # kill once the second checkpoint exists
        if ckpt.is_file() and torch.load(ckpt, weights_only=True)["trainer"]["step"] >= 2:
            break
        time.sleep(0.01)
    killed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed, "the run finished before it could be killed; give it more steps"
    stopped_at = torch.load(ckpt, weights_only=True)["trainer"]["step"]
    resumed = subprocess.run(_train_cmd(target, data, "--run", "b", *budget), env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    a, b = _weights(tmp_path / "cache" / "runs" / "a"), _weights(run_b)
    state = torch.load(ckpt, weights_only=True)["trainer"]
    assert state["step"] > stopped_at and state["tokens_seen"] >= 1500
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    # a larger token budget extends the finished run from where it stopped
    more = subprocess.run(
        _train_cmd(target, data, "--run", "b", "--max-train-tokens", "2500"), env=env, capture_output=True, text=True
    )
    assert more.returncode == 0, more.stderr
    extended = torch.load(ckpt, weights_only=True)["trainer"]
    assert extended["step"] > state["step"] and extended["tokens_seen"] >= 2500


def test_training_over_a_reduced_vocabulary_touches_only_its_rows_and_exports_it(tmp_path: Path) -> None:
    from dataclasses import replace

    from dspark.models.tiny import build_tiny_pair
    from dspark.train.draft_config import DraftTrainConfig
    from dspark.train.trainer import train_draft

    torch.manual_seed(0)
    target, _ = build_tiny_pair(0)
    data = DraftDataset.load(write_dataset(tmp_path / "d", n=8) / "train.npz")
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40]
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": ids.tolist(), "default_size": 30}))
    cfg = DraftTrainConfig(
        max_steps=2, batch_size=4, num_anchors=6, markov_rank=8, lr=3e-3, warmup_steps=1, autocast_bf16=False,
        feature_dtype="float32", progress=False, ckpt_interval=1, num_threads=1, out_dir=str(tmp_path / "full"),
    )  # fmt: skip
    train_draft(replace(cfg, max_steps=0, halt_at_step=0), target=target, train_data=data)
    before = _weights(tmp_path / "full")
    res = train_draft(
        replace(cfg, out_dir=str(tmp_path / "small"), draft_vocab=str(tmp_path / "draft_vocab.json")),
        target=target,
        train_data=data,
    )
    after = _weights(tmp_path / "small")
    w2 = next(k for k in after if k.endswith("markov_w2.weight"))
    chosen = torch.zeros(V, dtype=torch.bool)
    chosen[ids[:30]] = True
    assert torch.equal(after[w2][~chosen], before[w2][~chosen])  # rows outside the draft vocabulary never move
    assert not torch.equal(after[w2][chosen], before[w2][chosen])
    exported = json.loads((Path(res.export_dir) / "draft_vocab.json").read_text())
    assert exported["token_ids"] == ids.tolist() and exported["default_size"] == 30


def test_drafter_layers_can_start_from_target_layers() -> None:
    from dspark.models.tiny import build_tiny_pair
    from dspark.train.draft_config import DraftTrainConfig
    from dspark.train.draft_model import build_drafter

    torch.manual_seed(0)
    target, _ = build_tiny_pair(0)
    L = target.config.num_hidden_layers
    cfg = DraftTrainConfig(max_steps=1, num_layers=2, markov_rank=8, init_layers_from_target=(L - 2, L - 1))
    drafter = build_drafter(cfg, target)
    same = 0
    for i, j in enumerate((L - 2, L - 1)):
        theirs = dict(target.model.layers[j].named_parameters())
        for name, p in drafter.layers[i].named_parameters():
            if name in theirs and theirs[name].shape == p.shape:
                assert torch.equal(p, theirs[name].float()), name
                same += 1
    assert same >= 8  # attention projections, MLP, norms
    with pytest.raises(ValueError, match="one target layer id"):
        build_drafter(DraftTrainConfig(max_steps=1, num_layers=2, init_layers_from_target=(0,)), target)
