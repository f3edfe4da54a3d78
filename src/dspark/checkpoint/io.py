"""Safetensors checkpoint I/O: validated reads, atomic (optionally sharded) writes.

Every read parses the safetensors header itself first (8-byte little-endian header length + JSON), so that
the common ways a checkpoint goes wrong give an error that names the file and the fix instead of a Rust
panic: a Git LFS pointer in place of the weights, a truncated download, a corrupt header. Directories follow
the Hugging Face layout: ``model.safetensors``, or ``model.safetensors.index.json`` + ``model-0000i-of-0000N``
shards.

Writes go to a temporary name in the destination directory and are moved into place with ``os.replace``, so a
crash never leaves a half-written file under a real checkpoint name.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "INDEX_SUFFIX",
    "LFS_POINTER_PREFIX",
    "SINGLE_FILE",
    "CheckpointError",
    "Problem",
    "TensorInfo",
    "check_safetensors_file",
    "dtype_from_safetensors",
    "is_lfs_pointer",
    "list_checkpoint_tensors",
    "load_state_dict",
    "safetensors_dtype",
    "save_state_dict",
]

SINGLE_FILE = "model.safetensors"
INDEX_SUFFIX = ".index.json"
LFS_POINTER_PREFIX = b"version https://git-lfs.github.com/spec/v1"
_LFS_POINTER_MAX_BYTES = 1024
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header

# safetensors dtype name -> bytes per element (byte-aligned dtypes only; others are not size-checked)
_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

_TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float64: "F64",
    torch.complex64: "C64",
}
_ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_ST.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> "BF16")."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors name") from None


def dtype_from_safetensors(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name ("BF16" -> torch.bfloat16)."""
    try:
        return _ST_TO_TORCH[name]
    except KeyError:
        raise ValueError(f"safetensors dtype {name!r} has no torch dtype here") from None


# ---------------------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: what (naming the file/tensor) and how to fix it."""

    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}; fix: {self.fix}" if self.fix else self.message


class CheckpointError(ValueError):
    """A checkpoint that cannot be used. The message lists every problem found, one per line, each with a fix.

    ``problems`` keeps them structured (message + fix) for tools such as ``dspark check --json``.
    """

    def __init__(self, problems: str | Problem | Sequence[Problem], *, header: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [Problem(problems, "")]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.header = header
        lines = [header] if header else []
        lines += [f"  - {p}" if header else str(p) for p in self.problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header."""

    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # path of the .safetensors file holding it


# ---------------------------------------------------------------------------------------- reading


def is_lfs_pointer(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a Git LFS pointer file (small text file) rather than the real content."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size >= _LFS_POINTER_MAX_BYTES:
            return False
        with p.open("rb") as f:
            return f.read(len(LFS_POINTER_PREFIX)) == LFS_POINTER_PREFIX
    except OSError:
        return False


def _lfs_problem(p: Path, size: int) -> Problem:
    real = ""
    try:
        m = re.search(rb"^size (\d+)\s*$", p.read_bytes(), re.MULTILINE)
        if m:
            real = f" (the real file is {int(m.group(1))} bytes)"
    except OSError:
        pass
    return Problem(
        f"{p} is a Git LFS pointer file ({size} bytes), not the weights{real}",
        "run `git lfs pull` in the repository (install git-lfs first: `git lfs install`), "
        "or download the real weights, e.g. `huggingface-cli download <repo> --local-dir <dir>`",
    )


def _check_header(p: Path, header: object, header_len: int, size: int) -> tuple[dict[str, TensorInfo], list[Problem]]:
    problems: list[Problem] = []
    redownload = "re-download the file (the download or copy was interrupted or corrupted)"
    if not isinstance(header, dict):
        return {}, [Problem(f"{p}: safetensors header is a JSON {type(header).__name__}, not an object", redownload)]
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{p}: tensor {name!r}"
        if not isinstance(entry, dict):
            problems.append(Problem(f"{where} has a malformed header entry {entry!r}", redownload))
            continue
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        ok_shape = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
        ok_offsets = (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        )
        if not isinstance(dtype, str) or not ok_shape or not ok_offsets:
            problems.append(
                Problem(
                    f"{where} has a malformed header entry (dtype={dtype!r}, shape={shape!r}, "
                    f"data_offsets={offsets!r})",
                    redownload,
                )
            )
            continue
        begin, end = offsets
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            problems.append(
                Problem(
                    f"{where}: {dtype} {list(shape)} needs {math.prod(shape) * itemsize} bytes but its "
                    f"data_offsets span {end - begin}",
                    redownload,
                )
            )
        infos[name] = TensorInfo(dtype=dtype, shape=tuple(shape), file=str(p))
        spans.append((begin, end, name))
    if problems:
        return infos, problems
    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin != cursor:
            problems.append(
                Problem(
                    f"{p}: tensor {name!r} data starts at offset {begin}, expected {cursor} "
                    "(tensor data must be contiguous without gaps or overlaps)",
                    redownload,
                )
            )
            return infos, problems
        cursor = end
    expected = 8 + header_len + cursor
    if size < expected:
        problems.append(
            Problem(
                f"{p} is truncated: its header describes {len(infos)} tensors ending at byte {expected}, "
                f"so expected {expected} bytes, found {size} bytes",
                redownload,
            )
        )
    elif size > expected:
        problems.append(
            Problem(
                f"{p} is larger than its header describes: expected {expected} bytes, found {size} bytes "
                f"({size - expected} trailing bytes)",
                redownload,
            )
        )
    return infos, problems


def _scan_file(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], list[Problem]]:
    """Parse and check one .safetensors file; returns its tensors and every problem found (no raise)."""
    p = Path(path)
    if not p.exists():
        return {}, [Problem(f"{p} does not exist", "check the path, or download the checkpoint file")]
    if not p.is_file():
        return {}, [Problem(f"{p} is not a regular file", "pass a .safetensors file or a checkpoint directory")]
    size = p.stat().st_size
    if is_lfs_pointer(p):
        return {}, [_lfs_problem(p, size)]
    redownload = "re-download the file (the download or copy was interrupted or corrupted)"
    if size < 8:
        return {}, [
            Problem(
                f"{p} is {size} bytes, too short for a safetensors file (needs an 8-byte header length)",
                redownload,
            )
        ]
    with p.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            return {}, [
                Problem(
                    f"{p}: header length field says {header_len} bytes but the file has only {size - 8} "
                    f"bytes after it (file is {size} bytes); truncated or not a safetensors file",
                    redownload,
                )
            ]
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, [
            Problem(
                f"{p}: safetensors header is not valid JSON ({e}); corrupt or not a safetensors file",
                redownload,
            )
        ]
    return _check_header(p, header, header_len, size)


def check_safetensors_file(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Validate one .safetensors file from its header and size; return its tensors (``__metadata__`` skipped).

    Raises CheckpointError for a Git LFS pointer, a file too short for a header, a header length beyond the
    file size, an invalid JSON header, malformed entries, and truncation or trailing bytes.
    """
    infos, problems = _scan_file(path)
    if problems:
        raise CheckpointError(problems)
    return infos


def _dir_listing(d: Path) -> str:
    try:
        names = sorted(c.name + ("/" if c.is_dir() else "") for c in d.iterdir())
    except OSError:
        return "(unreadable)"
    if not names:
        return "(empty)"
    shown = ", ".join(names[:30])
    return shown + (f", ... ({len(names) - 30} more)" if len(names) > 30 else "")


def _scan_index(index: Path) -> tuple[dict[str, TensorInfo], list[Problem]]:
    redownload = f"re-download {index.name} or re-save the checkpoint"
    if is_lfs_pointer(index):
        return {}, [_lfs_problem(index, index.stat().st_size)]
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, [Problem(f"{index} is not valid JSON ({e})", redownload)]
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return {}, [Problem(f"{index} has no 'weight_map' object mapping tensor names to shard files", redownload)]
    problems: list[Problem] = []
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    infos: dict[str, TensorInfo] = {}
    for shard, names in by_shard.items():
        shard_path = index.parent / shard
        if not shard_path.is_file():
            problems.append(
                Problem(
                    f"{shard_path} is listed in {index.name} for {len(names)} tensors (e.g. {names[0]!r}) "
                    f"but does not exist; {index.parent} has: {_dir_listing(index.parent)}",
                    "download the missing shard (or re-save the checkpoint)",
                )
            )
            continue
        shard_infos, shard_problems = _scan_file(shard_path)
        problems += shard_problems
        if shard_problems:
            continue
        for name in names:
            if name in shard_infos:
                infos[name] = shard_infos[name]
            else:
                problems.append(
                    Problem(
                        f"tensor {name!r} is mapped to {shard_path} by {index.name} but that shard has no such tensor",
                        f"fix {index.name}'s weight_map or re-download the shard",
                    )
                )
    return infos, problems


def _scan_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], list[Problem]]:
    p = Path(path)
    if p.is_dir():
        index = p / (SINGLE_FILE + INDEX_SUFFIX)
        if index.is_file():
            return _scan_index(index)
        single = p / SINGLE_FILE
        if single.is_file():
            return _scan_file(single)
        return {}, [
            Problem(
                f"{p} has neither {SINGLE_FILE} nor {SINGLE_FILE + INDEX_SUFFIX}; it has: {_dir_listing(p)}",
                "point at the checkpoint directory, or download/convert the weights to safetensors",
            )
        ]
    if p.is_file():
        if p.suffix != ".safetensors" and not is_lfs_pointer(p):
            return {}, [
                Problem(
                    f"{p} is not a .safetensors file",
                    "pass a checkpoint directory or a .safetensors file (convert .bin/.pt weights)",
                )
            ]
        return _scan_file(p)
    return {}, [Problem(f"{p} does not exist", "check the path, or download the checkpoint")]


def list_checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint (directory or .safetensors file), after validating every file.

    A directory uses ``model.safetensors.index.json`` (every shard must exist, be valid and hold the tensors
    the index maps to it) when present, else ``model.safetensors``. Raises CheckpointError listing every
    problem.
    """
    infos, problems = _scan_checkpoint(path)
    if problems:
        raise CheckpointError(problems)
    return infos


def _read_tensors(
    infos: Mapping[str, TensorInfo], names: Iterable[str], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Load already-validated tensors, grouped per file, casting floating tensors to ``dtype``."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(infos[name].file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in file_names:
                    t = f.get_tensor(name)
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    out[name] = t
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error type; name the file
            raise CheckpointError(
                Problem(
                    f"{file}: reading tensors failed ({e})",
                    "re-download the file (it may have changed or be corrupt)",
                )
            ) from e
    return out


def load_state_dict(
    path: str | os.PathLike[str],
    *,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Validate then load a checkpoint's tensors onto the CPU.

    ``names`` restricts the load to these tensors (an unknown name is an error); ``dtype`` casts floating
    tensors.
    """
    infos = list_checkpoint_tensors(path)
    wanted = list(infos) if names is None else list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in infos]
    if unknown:
        raise CheckpointError(
            [
                Problem(
                    f"tensor {n!r} is not in checkpoint {path}",
                    "check the tensor name (`list_checkpoint_tensors` lists the checkpoint's names)",
                )
                for n in unknown
            ]
        )
    return _read_tensors(infos, wanted, dtype)


# ---------------------------------------------------------------------------------------- writing


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_temp(final: Path, write: Callable[[Path], None]) -> Path:
    """Write via ``write(tmp)`` to a temporary sibling of ``final`` and fsync it; return the temp path."""
    tmp = _temp_path(final)
    try:
        write(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _prepare(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; tensors sharing storage with an earlier one are cloned."""
    problems: list[Problem] = []
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict key {name!r} is not a str")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict value for {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.is_meta:
            problems.append(
                Problem(
                    f"tensor {name!r} is on the meta device and has no data",
                    "materialize the module (to_empty + init, or load weights) before saving",
                )
            )
            continue
        if t.dtype not in _TORCH_TO_ST:
            problems.append(
                Problem(
                    f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store",
                    "cast it to a supported dtype (e.g. torch.bfloat16) before saving",
                )
            )
            continue
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or ptr == 0:
            t = t.clone()  # tied/shared weights: safetensors stores each name's own copy
        else:
            seen.add(ptr)
        out[name] = t
    if problems:
        raise CheckpointError(problems)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan_shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy in-order packing; a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _shard_pattern(stem: str) -> re.Pattern[str]:
    return re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")


def save_state_dict(
    state: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    filename: str = SINGLE_FILE,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write ``state`` as safetensors into ``directory``; return the files written (shards first, index last).

    Every file is written to a temporary name in ``directory`` and moved into place with ``os.replace``.
    When ``max_shard_bytes`` is set and the tensors are larger, writes HF-style shards
    ``{stem}-0000i-of-0000N.safetensors`` and ``{filename}.index.json`` =
    ``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``. Files of an earlier save under the
    same ``filename`` that the new save supersedes (stale shards/index, or the single file) are removed
    afterwards. ``dtype`` casts floating tensors; tied/shared tensors are cloned.
    """
    if not filename.endswith(".safetensors") or "/" in filename or os.sep in filename:
        raise ValueError(f"filename {filename!r} must be a plain file name ending in .safetensors")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    meta = {"format": "pt", **(metadata or {})}
    bad = [k for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"metadata keys and values must be str; bad entries: {bad}")
    tensors = _prepare(state, dtype)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stem = filename.removesuffix(".safetensors")
    index_name = filename + INDEX_SUFFIX
    total = sum(_nbytes(t) for t in tensors.values())

    if max_shard_bytes is None or total <= max_shard_bytes:
        plan = {filename: list(tensors)}
        index: dict[str, object] | None = None
    else:
        groups = _plan_shards(tensors, max_shard_bytes)
        n = len(groups)
        plan = {f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}
        weight_map = {name: shard for shard, g in plan.items() for name in g}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}

    # write every file under a temporary name first, then move them all into place (index last)
    staged: list[tuple[Path, Path]] = []
    try:
        for shard, names in plan.items():
            part = {k: tensors[k] for k in names}
            final = d / shard
            staged.append((_write_temp(final, lambda tmp, part=part: save_file(part, tmp, metadata=meta)), final))
        if index is not None:
            text = json.dumps(index, indent=2, sort_keys=False) + "\n"
            final = d / index_name
            staged.append((_write_temp(final, lambda tmp: tmp.write_text(text, encoding="utf-8")), final))
        for tmp, final in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    _fsync_dir(d)

    written = [final for _, final in staged]
    keep = {p.name for p in written}
    pattern = _shard_pattern(stem)
    for child in d.iterdir():
        stale = pattern.fullmatch(child.name) is not None or child.name in (filename, index_name)
        if stale and child.name not in keep and child.is_file():
            child.unlink()
    return written
