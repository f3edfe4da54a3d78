"""Model references resolve offline: local paths, .gguf files, aliases, hub ids in a Hugging Face cache laid out
by the test (snapshots/<hash>/, refs/main, @revision) or a ModelScope cache; a missing id names the fetch
commands; and no socket is ever opened."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from dspark.checkpoint.resolve import ModelNotFoundError, locate_model, resolve_model_ref
from dspark.cli import main
from dspark.llm import OFFICIAL_DRAFT_CONFIG

MAIN = "a" * 40
OTHER = "b" * 40


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every connection attempt is recorded and refused: the test fails if any was made."""
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield attempts
    assert attempts == [], "a socket was opened"


@pytest.fixture
def caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    hf, ms = tmp_path / "hf" / "hub", tmp_path / "modelscope"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "MODELSCOPE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(ms))
    return hf, ms


def hf_snapshot(hub: Path, repo: str, commit: str, files: dict[str, str], ref: str | None = "main") -> Path:
    """Lay out <hub>/models--org--name/{blobs,snapshots/<commit>,refs/<ref>} as huggingface_hub does."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = root / "blobs" / f"{abs(hash((commit, name))):x}"
        blob.write_text(text)
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snap


def test_local_directory_and_gguf_file_are_returned_as_given(tmp_path: Path, caches):
    d = tmp_path / "model"
    d.mkdir()
    assert resolve_model_ref(d) == d and locate_model(d).source == "path"
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    ref = locate_model(str(g))
    assert ref.path == g and ref.is_gguf  # resolve_model_ref exports it (tests/test_gguf.py)


def test_hub_id_resolves_from_the_hf_cache_via_refs_main(caches):
    hf, _ = caches
    snap = hf_snapshot(hf, "Inferact/Kimi-K3-DSpark", MAIN, {"config.json": "{}"})
    ref = locate_model("Inferact/Kimi-K3-DSpark")
    assert ref.source == "huggingface-cache" and ref.path == snap
    assert resolve_model_ref("Inferact/Kimi-K3-DSpark") == snap and (snap / "config.json").read_text() == "{}"


def test_hub_id_at_revision_picks_that_snapshot(caches):
    hf, _ = caches
    hf_snapshot(hf, "org/name", MAIN, {"config.json": '{"v": 1}'})
    other = hf_snapshot(hf, "org/name", OTHER, {"config.json": '{"v": 2}'}, ref="v2")
    assert resolve_model_ref(f"org/name@{OTHER}") == other  # a commit hash
    assert resolve_model_ref("org/name@v2") == other  # a tag / branch under refs/
    with pytest.raises(ModelNotFoundError, match="revision 'v3'"):
        resolve_model_ref("org/name@v3")


def test_hf_hub_cache_variable_wins(tmp_path: Path, caches, monkeypatch: pytest.MonkeyPatch):
    elsewhere = tmp_path / "elsewhere"
    snap = hf_snapshot(elsewhere, "org/name", MAIN, {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    assert resolve_model_ref("org/name") == snap


def test_modelscope_cache_layouts(caches):
    _, ms = caches
    new = ms / "models" / "Eco-Tech" / "Kimi-K3-DSpark-MLA-NPU"
    new.mkdir(parents=True)
    (new / "config.json").write_text("{}")
    ref = locate_model("Eco-Tech/Kimi-K3-DSpark-MLA-NPU")
    assert ref.source == "modelscope-cache" and ref.path == new
    dotted = ms / "Qwen" / "Qwen2___5-0___5B"  # older layout, '.' stored as '___'
    dotted.mkdir(parents=True)
    (dotted / "config.json").write_text("{}")
    assert resolve_model_ref("Qwen/Qwen2.5-0.5B") == dotted


def test_missing_hub_id_names_it_and_the_fetch_commands(caches):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_ref("Inferact/Kimi-K3-DSpark", role="speculative config: model")
    msg = str(e.value)
    assert "'Inferact/Kimi-K3-DSpark'" in msg and "speculative config: model" in msg
    assert "huggingface-cli download Inferact/Kimi-K3-DSpark" in msg
    assert "git clone" in msg and "git lfs pull" in msg
    assert "modelscope download --model Inferact/Kimi-K3-DSpark" in msg


def test_non_hub_non_path_is_an_error(caches):
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model_ref("just-a-name")


def test_roster_and_check_accept_a_hub_id(caches, capsys: pytest.CaptureFixture[str], tmp_path: Path):
    hf, _ = caches
    config = OFFICIAL_DRAFT_CONFIG.read_text()
    hf_snapshot(hf, "Inferact/Kimi-K3-DSpark", MAIN, {"config.json": config})
    assert main(["roster", "Inferact/Kimi-K3-DSpark", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] > 3_000_000_000 and len(out["tensors"]) == 68
    assert main(["check", "Inferact/Does-Not-Exist", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)  # still the check --json schema
    assert report["ok"] is False and report["problems"][0]["check"] == "model-reference"
    assert "huggingface-cli download Inferact/Does-Not-Exist" in report["problems"][0]["message"]


def test_llm_and_spec_model_take_hub_ids(caches, tmp_path: Path):
    from dspark.llm import LLM
    from dspark.models.tiny import write_tiny_pair
    from dspark.sampling_params import SamplingParams

    hf, _ = caches
    target, draft = write_tiny_pair(tmp_path / "pair")
    t_snap = hf_snapshot(hf, "tiny/target", MAIN, {})
    d_snap = hf_snapshot(hf, "tiny/draft", MAIN, {})
    for src, snap in ((target, t_snap), (draft, d_snap)):
        for f in src.iterdir():
            shutil.copy(f, snap / f.name)
    llm = LLM("tiny/target", {"method": "dspark", "model": "tiny/draft", "num_speculative_tokens": 3}, dtype="float32")
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.token_ids) == 8 and out.spec_metrics["acceptance_length"] is not None


def test_bundled_pairs_are_model_names():
    from dspark.checkpoint.resolve import BUNDLED_NAMES, bundled_target, locate_model
    from dspark.llm import BUNDLED_PAIRS, DEFAULT_PAIR, shipped_drafts

    for name in BUNDLED_NAMES:
        if (bundled_target(name) / "config.json").is_file():
            found = locate_model(name)
            assert (found.source, found.path) == ("bundled", bundled_target(name))
            assert shipped_drafts(found.path) == BUNDLED_PAIRS[name][1:]
    assert DEFAULT_PAIR in BUNDLED_NAMES
