"""Checkpoint I/O (safetensors read/write, validation) and roster / strict loading."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import dspark.checkpoint.io as ckio
from dspark.checkpoint.io import (
    CheckpointError,
    TensorInfo,
    check_safetensors_file,
    is_lfs_pointer,
    list_checkpoint_tensors,
    load_state_dict,
    save_state_dict,
)
from dspark.checkpoint.roster import (
    RosterReport,
    TensorSpec,
    compare_roster,
    format_roster,
    load_module_strict,
    module_roster,
    num_params,
    raise_for_report,
    roster_json,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ST_NAME = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class Tiny(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, d)
        self.proj = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, d, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))  # persistent
        self.register_buffer("cache", torch.zeros(3), persistent=False)  # not in checkpoints


def _state(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(8, 16, generator=g).to(dtype),
        "b.weight": torch.randn(32, 4, generator=g).to(dtype),
        "c.bias": torch.randn(7, generator=g).to(dtype),
        "d.ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "e.scalar": torch.tensor(3.5).to(dtype),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _no_temp_files(d: Path) -> bool:
    return not [p for p in d.iterdir() if ".tmp" in p.name]


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_single_file(tmp_path: Path, dtype: torch.dtype) -> None:
    state = _state(dtype)
    written = save_state_dict(state, tmp_path, metadata={"note": "x"})
    assert written == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    _assert_same(load_state_dict(tmp_path), state)
    _assert_same(load_state_dict(tmp_path / "model.safetensors"), state)
    infos = list_checkpoint_tensors(tmp_path)
    assert infos["a.weight"] == TensorInfo(ST_NAME[dtype], (8, 16), str(tmp_path / "model.safetensors"))
    assert infos["d.ids"].dtype == "I64"
    assert infos["e.scalar"].shape == ()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_sharded(tmp_path: Path, dtype: torch.dtype) -> None:
    state = _state(dtype)
    itemsize = torch.finfo(dtype).bits // 8
    limit = 128 * itemsize  # a.weight alone is 128 elements, b.weight 128 -> several shards
    written = save_state_dict(state, tmp_path, max_shard_bytes=limit)
    index_path = tmp_path / "model.safetensors.index.json"
    assert written[-1] == index_path
    shards = written[:-1]
    n = len(shards)
    assert n >= 3
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads(index_path.read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    for shard in shards:  # every shard respects the limit unless it holds one oversized tensor
        tensors = check_safetensors_file(shard)
        size = sum(ckio._ITEMSIZE[i.dtype] * torch.Size(i.shape).numel() for i in tensors.values())
        assert size <= limit or len(tensors) == 1
    _assert_same(load_state_dict(tmp_path), state)
    infos = list_checkpoint_tensors(tmp_path)
    assert {k: Path(v.file).name for k, v in infos.items()} == index["weight_map"]


def test_sharded_then_single_save_removes_stale_files(tmp_path: Path) -> None:
    state = _state(torch.float32)
    save_state_dict(state, tmp_path, max_shard_bytes=600)
    assert (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "config.json").write_text("{}")
    small = {"x": torch.ones(2)}
    save_state_dict(small, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same(load_state_dict(tmp_path), small)


def test_save_casts_and_load_casts(tmp_path: Path) -> None:
    state = _state(torch.float32)
    save_state_dict(state, tmp_path, dtype=torch.bfloat16)
    infos = list_checkpoint_tensors(tmp_path)
    assert infos["a.weight"].dtype == "BF16" and infos["d.ids"].dtype == "I64"
    loaded = load_state_dict(tmp_path, names=["a.weight", "d.ids"], dtype=torch.float16)
    assert set(loaded) == {"a.weight", "d.ids"}
    assert loaded["a.weight"].dtype == torch.float16
    assert torch.equal(loaded["a.weight"], state["a.weight"].to(torch.bfloat16).to(torch.float16))
    assert torch.equal(loaded["d.ids"], state["d.ids"])  # integers are never cast
    with pytest.raises(CheckpointError, match="'nope'"):
        load_state_dict(tmp_path, names=["nope"])


def test_tied_and_view_tensors_are_saved(tmp_path: Path) -> None:
    shared = torch.randn(4, 3)
    fused = torch.randn(6, 3)
    state = {
        "embed.weight": shared,
        "lm_head.weight": shared,
        "q": fused[:2],
        "kv": fused[2:],
        "t": fused.t(),
    }
    save_state_dict(state, tmp_path)
    loaded = load_state_dict(tmp_path)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert shared.data_ptr() != 0  # inputs untouched


# ---------------------------------------------------------------------------------------- validation

LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
    "size 7124633450\n"
)


def test_lfs_pointer_error(tmp_path: Path) -> None:
    assert len(LFS_POINTER.encode()) == 135
    pointer = tmp_path / "model.safetensors"
    pointer.write_text(LFS_POINTER)
    assert is_lfs_pointer(pointer)
    for target in (pointer, tmp_path):
        with pytest.raises(CheckpointError) as e:
            list_checkpoint_tensors(target)
        msg = str(e.value)
        assert str(pointer) in msg and "135 bytes" in msg and "git lfs pull" in msg
        assert "7124633450" in msg  # the real size, read from the pointer
    with pytest.raises(CheckpointError, match="git lfs pull"):
        load_state_dict(tmp_path)


def test_is_lfs_pointer_false_for_real_and_missing_files(tmp_path: Path) -> None:
    save_state_dict({"x": torch.ones(2)}, tmp_path)
    assert not is_lfs_pointer(tmp_path / "model.safetensors")
    assert not is_lfs_pointer(tmp_path / "absent")
    big = tmp_path / "big.txt"
    big.write_bytes(LFS_POINTER.encode() + b"x" * 2000)  # too big to be a pointer
    assert not is_lfs_pointer(big)


def test_truncated_file_error(tmp_path: Path) -> None:
    save_state_dict(_state(torch.float32), tmp_path)
    f = tmp_path / "model.safetensors"
    full = f.stat().st_size
    data = f.read_bytes()
    f.write_bytes(data[: full - 100])
    with pytest.raises(CheckpointError) as e:
        check_safetensors_file(f)
    msg = str(e.value)
    assert str(f) in msg and "truncated" in msg
    assert f"expected {full} bytes" in msg and f"found {full - 100} bytes" in msg
    assert "re-download" in msg
    f.write_bytes(data + b"junk")
    with pytest.raises(CheckpointError, match=f"expected {full} bytes, found {full + 4} bytes"):
        check_safetensors_file(f)


def _raw_file(header: bytes, data_bytes: int) -> bytes:
    return struct.pack("<Q", len(header)) + header + b"\0" * data_bytes


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"\x01\x02\x03", "3 bytes, too short"),
        (struct.pack("<Q", 10_000) + b"{}", "header length field says 10000 bytes"),
        (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (_raw_file(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', 4), "needs 8 bytes"),
        (_raw_file(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8), "contiguous"),
        (_raw_file(b'{"w": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}', 4), "malformed"),
    ],
)
def test_corrupt_headers(tmp_path: Path, content: bytes, pattern: str) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        check_safetensors_file(f)
    assert pattern in str(e.value) and str(f) in str(e.value)


def test_metadata_is_skipped(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "x.safetensors", metadata={"format": "pt"})
    assert set(check_safetensors_file(tmp_path / "x.safetensors")) == {"w"}


def test_directory_without_weights_lists_contents(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError) as e:
        list_checkpoint_tensors(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "config.json" in msg and "pytorch_model.bin" in msg
    with pytest.raises(CheckpointError, match="does not exist"):
        list_checkpoint_tensors(tmp_path / "nowhere")


def test_sharded_problems_all_reported(tmp_path: Path) -> None:
    state = _state(torch.float32)
    save_state_dict(state, tmp_path, max_shard_bytes=600)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    (tmp_path / shards[0]).unlink()  # a missing shard
    index["weight_map"]["ghost.weight"] = shards[1]  # a tensor its shard does not hold
    index_path.write_text(json.dumps(index))
    last = tmp_path / shards[-1]
    last.write_bytes(last.read_bytes()[:-4])  # and a truncated shard
    with pytest.raises(CheckpointError) as e:
        list_checkpoint_tensors(tmp_path)
    msg = str(e.value)
    assert len(e.value.problems) == 3
    assert shards[0] in msg and "does not exist" in msg
    assert "'ghost.weight'" in msg and shards[1] in msg
    assert shards[-1] in msg and "truncated" in msg
    assert len(msg.splitlines()) == 3


# ---------------------------------------------------------------------------------------- atomicity


def test_atomic_save_leaves_no_temp_files(tmp_path: Path) -> None:
    save_state_dict(_state(torch.float32), tmp_path)
    save_state_dict(_state(torch.float32, seed=1), tmp_path, max_shard_bytes=600)
    assert _no_temp_files(tmp_path)
    _assert_same(load_state_dict(tmp_path), _state(torch.float32, seed=1))


def test_failed_save_keeps_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _state(torch.float32)
    save_state_dict(old, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    real_save = ckio.save_file

    def crash(tensors: dict, path: os.PathLike, metadata: dict | None = None) -> None:
        real_save(tensors, path, metadata=metadata)
        Path(path).write_bytes(Path(path).read_bytes()[:50])  # half-written, then the "crash"
        raise OSError("disk full")

    monkeypatch.setattr(ckio, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_state_dict(_state(torch.float32, seed=1), tmp_path)
    with pytest.raises(OSError, match="disk full"):
        save_state_dict(_state(torch.float32, seed=1), tmp_path, max_shard_bytes=600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == before
    _assert_same(load_state_dict(tmp_path), old)


def test_save_rejects_meta_tensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'w'.*meta device"):
        save_state_dict({"w": torch.empty(3, device="meta")}, tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------- roster


def test_roster_on_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        # ~4e12 bytes if it were materialized: allocating it would fail on this machine
        m = nn.Sequential(nn.Linear(1_000_000, 1_000_000), nn.LayerNorm(1_000_000))
    assert all(p.is_meta for p in m.parameters())
    roster = module_roster(m)
    assert roster == {
        "0.weight": TensorSpec((1_000_000, 1_000_000)),
        "0.bias": TensorSpec((1_000_000,)),
        "1.weight": TensorSpec((1_000_000,)),
        "1.bias": TensorSpec((1_000_000,)),
    }
    assert num_params(roster) == 10**12 + 3 * 10**6
    assert num_params(roster) == sum(p.numel() for p in m.parameters())


def test_roster_buffers_rename_and_tied() -> None:
    torch.manual_seed(0)
    m = Tiny()
    roster = module_roster(m)
    assert set(roster) == {"embed.weight", "proj.weight", "proj.bias", "out.weight", "norm_weight", "step"}
    assert roster["step"] == TensorSpec((), torch.int64)
    assert roster["proj.weight"] == TensorSpec((6, 4), None)
    renamed = module_roster(m, rename=lambda n: None if n.startswith("embed") else "model." + n)
    assert set(renamed) == {
        "model.proj.weight",
        "model.proj.bias",
        "model.out.weight",
        "model.norm_weight",
        "model.step",
    }
    m.out.weight = m.proj.weight  # tied parameters appear once
    assert "out.weight" not in module_roster(m) and "proj.weight" in module_roster(m)
    with pytest.raises(ValueError, match="rename maps both"):
        module_roster(Tiny(), rename=lambda n: "same")


def test_roster_json_schema() -> None:
    with torch.device("meta"):
        m = Tiny()
    data = roster_json(module_roster(m))
    assert set(data) == {"tensors", "num_params"}
    assert data["tensors"]["proj.weight"] == [6, 4] and data["tensors"]["step"] == []
    assert all(isinstance(v, list) and all(isinstance(d, int) for d in v) for v in data["tensors"].values())
    assert data["num_params"] == 5 * 4 + 6 * 4 + 6 + 4 * 6 + 4 + 1
    assert json.loads(json.dumps(data)) == data


def test_format_roster_table() -> None:
    roster = {"a.weight": TensorSpec((1000, 2000)), "long.name.bias": TensorSpec((3,), torch.int64)}
    text = format_roster(roster)
    lines = text.splitlines()
    assert lines[-1] == "total: 2,000,003 parameters in 2 tensors"
    table = lines[:-1]
    assert table[0].split() == ["name", "shape", "dtype"]
    shape_col = {line.index("[") for line in table[1:]}
    assert len(shape_col) == 1  # shapes aligned
    assert "[1000, 2000]" in text and "int64" in text and "float" in text


def test_compare_roster_dtype_rules() -> None:
    expected = {
        "w": TensorSpec((2,)),
        "x": TensorSpec((2,)),
        "y": TensorSpec((2,)),
        "z": TensorSpec((2,)),
        "ids": TensorSpec((2,), torch.int64),
        "ids2": TensorSpec((2,), torch.int64),
    }
    found = {
        k: TensorInfo(d, (2,), "f")
        for k, d in [
            ("w", "BF16"),
            ("x", "I64"),
            ("y", "F8_E4M3"),
            ("z", "BOOL"),
            ("ids", "I64"),
            ("ids2", "I32"),
        ]
    }
    r = compare_roster(expected, found)
    assert r.wrong_dtype == (("ids2", "I32"), ("x", "I64"), ("y", "F8_E4M3"), ("z", "BOOL"))
    assert not r.missing and not r.unexpected and not r.wrong_shape and not r.ok
    for d in ("F32", "F16", "BF16"):
        assert compare_roster({"w": TensorSpec((2,))}, {"w": TensorInfo(d, (2,), "f")}).ok


def test_compare_roster_ignore_globs() -> None:
    expected = {"a": TensorSpec((1,))}
    found = {
        "a": TensorInfo("F32", (1,), "f"),
        "lm_head.weight": TensorInfo("F32", (3,), "f"),
        "mtp.0.w": TensorInfo("F32", (1,), "f"),
    }
    assert compare_roster(expected, found).unexpected == ("lm_head.weight", "mtp.0.w")
    assert compare_roster(expected, found, ignore_unexpected=["lm_head.*", "mtp.*"]).ok
    raise_for_report(RosterReport(), source="x")  # ok report: no raise


# ---------------------------------------------------------------------------------------- strict load


@pytest.mark.parametrize("module_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("file_dtype", DTYPES)
def test_load_module_strict_round_trip(tmp_path: Path, module_dtype: torch.dtype, file_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    src = Tiny()
    src.step.fill_(7)
    save_state_dict(src.state_dict(), tmp_path, dtype=file_dtype)
    dst = Tiny().to(module_dtype)
    load_module_strict(dst, tmp_path)
    for name, p in dst.state_dict().items():
        want = src.state_dict()[name]
        if want.is_floating_point():
            assert p.dtype == module_dtype
            want = want.to(file_dtype).to(module_dtype)
        assert torch.equal(p, want), name
    assert dst.step.item() == 7 and dst.step.dtype == torch.int64
    assert all(p.requires_grad for p in dst.parameters())


def test_load_module_strict_rename_ignore_extra_ok(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = Tiny()
    state = {"model." + k: v for k, v in src.state_dict().items() if not k.startswith("embed")}
    state["lm_head.weight"] = torch.randn(3, 3)
    save_state_dict(state, tmp_path, max_shard_bytes=64)
    dst = Tiny()
    embed_before = dst.embed.weight.detach().clone()
    with pytest.raises(CheckpointError) as e:
        load_module_strict(dst, tmp_path, rename=lambda n: "model." + n)
    assert "'model.embed.weight'" in str(e.value) and "'lm_head.weight'" in str(e.value)
    load_module_strict(
        dst,
        tmp_path,
        rename=lambda n: "model." + n,
        ignore_unexpected=["lm_head.*"],
        extra_ok=["model.embed.*"],
    )
    assert torch.equal(dst.embed.weight, embed_before)  # allowed-missing tensor untouched
    assert torch.equal(dst.proj.weight, src.proj.weight) and torch.equal(dst.out.weight, src.out.weight)


def test_load_module_strict_reports_everything_and_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = Tiny().state_dict()
    del state["proj.bias"]  # missing
    state["extra.weight"] = torch.randn(2)  # unexpected
    state["out.weight"] = torch.randn(4, 7)  # wrong shape (expected [4, 6])
    state["norm_weight"] = torch.arange(4, dtype=torch.int64)  # wrong dtype
    state["step"] = torch.zeros((), dtype=torch.int32)  # wrong dtype (int64 buffer)
    save_state_dict(state, tmp_path)
    dst = Tiny()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_module_strict(dst, tmp_path)
    msg = str(e.value)
    assert "1 missing, 1 unexpected, 1 wrong shape, 2 wrong dtype" in msg
    assert re.search(r"missing tensor 'proj\.bias'.*fix:", msg)
    assert re.search(r"unexpected tensor 'extra\.weight'.*fix:", msg)
    assert re.search(r"wrong shape for 'out\.weight'.*expected \[4, 6\], found \[4, 7\].*fix:", msg)
    assert re.search(r"wrong dtype for 'norm_weight'.*found I64.*fix:", msg)
    assert re.search(r"wrong dtype for 'step'.*found I32.*fix:", msg)
    assert len(e.value.problems) == 5
    after = dst.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k  # nothing half-loaded


def test_load_module_strict_bad_file_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_state_dict(Tiny().state_dict(), tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    dst = Tiny()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError, match="truncated"):
        load_module_strict(dst, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_load_module_strict_rejects_meta_module(tmp_path: Path) -> None:
    save_state_dict(Tiny().state_dict(), tmp_path)
    with torch.device("meta"):
        m = Tiny()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        load_module_strict(m, tmp_path)
