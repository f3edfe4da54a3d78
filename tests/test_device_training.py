"""The training pipeline's device side, exercised on the CPU: ``--device`` resolution, the static-shape generator
an accelerator regenerates with (its responses equal the engine's, greedy and seeded, whatever the batch), the
padded feature form an accelerator uses (equal to the CPU's per-row form), and the device-resident metric sums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.device import resolve_device
from dspark.llm import LLM
from dspark.models.tiny import write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.train.regenerate import regenerate_responses
from dspark.train.static_generate import StaticGenerator, load_static_generator


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    target, _ = write_tiny_pair(root / "pair", seed=0)
    return target


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g)
    return [torch.randint(5, vocab, (int(k),), generator=g).tolist() for k in lengths]


def test_resolve_device_names_the_value_and_the_fix() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use --device cpu"):
            resolve_device("cuda")


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_static_generation_equals_the_engine(pair, batch_size: int) -> None:
    """Greedy and seeded sampled responses, mixed prompt lengths, a stop id: token for token the engine's, for any
    static batch size (a row never depends on the rest of its batch)."""
    engine = LLM(str(pair), dtype="float32", quantization="none", max_num_seqs=4, seed=0).engine
    vocab = engine.target.config.vocab_size
    prompts = _prompts(13, vocab)
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 else 0.8, top_p=1.0 if i % 3 else 0.9, top_k=0 if i % 2 else 20,
            max_tokens=8 + i, seed=1000 + i,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    ref = regenerate_responses(engine, prompts, params)
    # a stop id that some response actually meets: both must end there, the stop token kept
    stop = ref[2][3]
    params[2] = SamplingParams(temperature=0.0, max_tokens=20, seed=7, stop_token_ids=(stop,))
    ref[2] = regenerate_responses(engine, [prompts[2]], [params[2]])[0]
    gen, tok = load_static_generator(str(pair), resolve_device("cpu"), "float32", batch_size=batch_size)
    out = gen.generate(prompts, params)
    assert out == ref
    assert out[2][-1] == stop and len(out[2]) <= 4
    assert gen.last_stats.generated_tokens == sum(map(len, ref))
    assert tok is not None


def test_static_generation_refuses_what_it_cannot_honour(pair) -> None:
    gen, _ = load_static_generator(str(pair), resolve_device("cpu"), "float32", batch_size=2)
    with pytest.raises(ValueError, match="stop strings"):
        gen.generate([[5, 6]], [SamplingParams(stop=("x",))])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        gen.generate([[]], [SamplingParams()])
    with pytest.raises(ValueError, match="2 prompts but 1"):
        gen.generate([[5], [6]], [SamplingParams()])

    class Stateful(torch.nn.Module):
        state_spec = object()

    with pytest.raises(ValueError, match="--device cpu"):
        StaticGenerator(Stateful(), [2], 64)


def test_padded_features_equal_the_per_row_form(pair) -> None:
    """An accelerator runs a mixed-length batch as one padded forward; the CPU runs each row at its length. Both give
    the same taps and hidden states, rows past a length zero."""
    from dspark.models.loading import load_target
    from dspark.train.features import _padded_features, target_features

    target = load_target(str(pair), "float32")
    vocab = target.config.vocab_size
    rows = _prompts(3, vocab, seed=3)
    S = max(map(len, rows))
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    taps = (0, 1)
    per_row = target_features(target, ids, taps, "float32", False, lengths=lengths)
    padded = _padded_features(target, ids, taps, "float32", False, True, None, lengths)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(padded.taps[b, :n], per_row.taps[b, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded.hidden[b, :n], per_row.hidden[b, :n], rtol=1e-5, atol=1e-5)
        assert not padded.taps[b, n:].any() and not padded.hidden[b, n:].any()


# ---- the device recipe: payload transport, prompts as ids, the dry run ---------------------------------------------

BLOCKER = """
import importlib.abc, sys
BLOCKED = {"fastapi", "uvicorn", "pydantic", "prometheus_client", "httpx", "schemathesis", "gguf", "openai"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is not on the device machine")
sys.meta_path.insert(0, Block())
"""


def test_pack_travels_in_chunks_and_unpacks_verified(tmp_path) -> None:
    from dspark.train import device_pack

    g = torch.Generator().manual_seed(0)
    big = tmp_path / "model.gguf"
    big.write_bytes(torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g).numpy().tobytes())
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"a": 1}')
    (drafter / "model.safetensors").write_bytes(b"\0" * 50_000)
    manifest = device_pack.pack([("target", big), ("drafter", drafter)], tmp_path / "pack", 120_000, 100_000)
    assert len(manifest["chunks"]) >= 3 and all(c["bytes"] <= 120_000 for c in manifest["chunks"])
    stash = tmp_path / "stash"
    for c in manifest["chunks"]:  # one call per folder
        device_pack.stash(tmp_path / "pack" / str(c["call"]), stash)
    roles = device_pack.unpack(stash)
    assert (Path(roles["target"][0])).read_bytes() == big.read_bytes()
    assert (Path(roles["drafter"][0]) / "config.json").read_text() == '{"a": 1}'
    last = stash / manifest["chunks"][-1]["file"]
    last.write_bytes(last.read_bytes()[:-1] + b"x")
    with pytest.raises(device_pack.PackError, match="checksum mismatch .*carry that folder again"):
        device_pack.unpack(stash)
    last.unlink()
    with pytest.raises(device_pack.PackError, match=f"call {manifest['chunks'][-1]['call']}"):
        device_pack.unpack(stash)


def test_prompts_as_ids_regenerate_the_same_shards(tmp_path) -> None:
    """A device without the ShareGPT file regenerates from exported ids: the shards equal those made from the file
    (same indices, seeds and sampling settings)."""
    import json

    import numpy as np

    from dspark.train.draft_data import DraftDataConfig
    from dspark.train.sharegpt_regen import export_prompts, regenerate

    target, _ = write_tiny_pair(tmp_path / "pair", seed=0)
    convs = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"q {i} {i % 5}"}, {"from": "gpt", "value": "a"}]}
        for i in range(30)
    ]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    cfg = DraftDataConfig(
        source="sharegpt", target=str(target), sharegpt_file=str(src), out_dir=str(tmp_path / "a"), num_prompts=16,
        num_val_prompts=2,
        max_prompt_tokens=64, max_new_tokens=6, greedy_fraction=0.5, min_response_tokens=1, shard_size=4,
        max_num_seqs=4, dtype="float32", quantization="none", heldout_percent=10.0, device="cpu",
    )  # fmt: skip
    regenerate(cfg, say=lambda m: None)
    info = export_prompts(cfg, tmp_path / "prompts.npz", start=8, count=8)
    assert info["prompts"] == 8
    b = tmp_path / "b"
    b.mkdir()
    for name in ("shard-00000.npz", "shard-00001.npz"):  # the shards before the file's start are there already
        (b / name).write_bytes((tmp_path / "a" / name).read_bytes())
    from dataclasses import replace

    regenerate(replace(cfg, out_dir=str(b), prompts_file=str(tmp_path / "prompts.npz")), say=lambda m: None)
    for name in ("shard-00002.npz", "shard-00003.npz"):
        with np.load(tmp_path / "a" / name) as x, np.load(b / name) as y:
            assert x["tokens"].tolist() == y["tokens"].tolist()
            assert x["prompt_lens"].tolist() == y["prompt_lens"].tolist()
    with pytest.raises(Exception, match="exported with other settings"):
        regenerate(replace(cfg, out_dir=str(b), max_prompt_tokens=32, prompts_file=str(tmp_path / "prompts.npz")))


def test_device_script_dry_run_without_the_servers_packages(tmp_path) -> None:
    """scripts/device-train.sh -- --tiny: regeneration with the static generator, DSpark warm-started and the DFlash
    twin, the held-out curve, results in parts the device tool brings back, joined here by collect; with the
    packages the device machine lacks made unimportable."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dspark.models.loading import load_drafter
    from dspark.train import device_pack, device_recipe

    repo = Path(__file__).resolve().parent.parent
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out, work = tmp_path / "out", tmp_path / "work"
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": str(site)}
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "device-train.sh"), "--", "--tiny", "--work-dir", str(work)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["regen"]["generator"] == "static" and summary["new_shards"]
    assert summary["dspark"]["tau_start"] is not None and len(summary["dspark"]["curve"]) >= 2
    assert summary["dflash"]["steps"] == 4
    device_pack.check_result_files(out)
    data = tmp_path / "data"
    data.mkdir()
    assert device_recipe.main(["collect", str(out), "--dest", str(tmp_path / "got"), "--data-dir", str(data)]) == 0
    assert sorted(p.name for p in data.glob("shard-*.npz")) == summary["new_shards"]
    for name in summary["new_shards"]:
        assert (data / name).read_bytes() == (work / "data" / name).read_bytes()
    target = work / "tiny" / "pair" / "target"
    from dspark.models.loading import load_target

    drafter = load_drafter(tmp_path / "got" / "dspark", load_target(target, "float32"))
    assert drafter.config.markov_rank == 8
