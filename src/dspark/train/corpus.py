"""A reproducible, offline code corpus built from Python sources already on the machine.

The default source is the running interpreter's standard library (test suites, IDLE and
machine-specific files excluded). Each file lands in exactly one split, chosen by a stable hash
of its relative name, so adding or removing files never moves the others between splits.

Output layout of :func:`build_corpus`::

    out_dir/train.jsonl        one {"path": rel, "text": ...} per line, sorted by path
    out_dir/validation.jsonl
    out_dir/test.jsonl
    out_dir/manifest.json      counts, bytes, python version, sha256 of each split file

Sources (``CorpusConfig.sources``):

- ``"stdlib"``: ``sysconfig.get_paths()["stdlib"]``; relative names ``stdlib/<rel>``.
- ``"site-packages:NAME"``: the installed top-level package ``NAME``; names ``site-packages/NAME/<rel>``.
- ``"dir:PATH"``: every ``.py`` file under a directory; names ``<basename of PATH>/<rel>``.

Usage: ``python -m dspark.train.corpus OUT_DIR [--source stdlib ...]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

SPLITS: tuple[str, ...] = ("train", "validation", "test")

# Directory names whose contents are never part of the corpus (test suites, IDE, caches, installs).
EXCLUDED_DIR_NAMES: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)
# Top-level stdlib entries that are build-machine specific.
_EXCLUDED_STDLIB_PREFIXES: tuple[str, ...] = ("config-", "_sysconfigdata_")


@dataclass(frozen=True)
class CorpusConfig:
    sources: tuple[str, ...] = ("stdlib",)
    max_file_bytes: int = 200_000
    val_fraction: float = 0.02
    test_fraction: float = 0.02

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("CorpusConfig.sources is empty; use e.g. ('stdlib',)")
        for src in self.sources:
            _parse_source(src)  # raises with a clear message
        if self.max_file_bytes <= 0:
            raise ValueError(f"CorpusConfig.max_file_bytes={self.max_file_bytes} must be > 0")
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"CorpusConfig.{name}={value} must be in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                f"CorpusConfig val_fraction + test_fraction = {self.val_fraction + self.test_fraction} "
                "leaves no training data; keep their sum below 1"
            )


@dataclass(frozen=True)
class SplitStats:
    files: int
    bytes: int  # UTF-8 bytes of the document texts
    sha256: str  # of the split's .jsonl file


@dataclass(frozen=True)
class CorpusManifest:
    python_version: str
    config: CorpusConfig
    splits: dict[str, SplitStats] = field(default_factory=dict)

    @property
    def total_files(self) -> int:
        return sum(s.files for s in self.splits.values())

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.splits.values())

    def to_json(self) -> dict:
        return {
            "python_version": self.python_version,
            "config": {**asdict(self.config), "sources": list(self.config.sources)},
            "splits": {name: asdict(stats) for name, stats in self.splits.items()},
            "total_files": self.total_files,
            "total_bytes": self.total_bytes,
        }

    @staticmethod
    def from_json(data: dict) -> CorpusManifest:
        cfg = dict(data["config"])
        cfg["sources"] = tuple(cfg["sources"])
        return CorpusManifest(
            python_version=data["python_version"],
            config=CorpusConfig(**cfg),
            splits={name: SplitStats(**stats) for name, stats in data["splits"].items()},
        )


# ----------------------------------------------------------------------------- sources


def _parse_source(src: str) -> tuple[str, str]:
    if src == "stdlib":
        return "stdlib", ""
    kind, sep, arg = src.partition(":")
    if sep and arg and kind in ("site-packages", "dir"):
        return kind, arg
    raise ValueError(f"unknown corpus source {src!r}; use 'stdlib', 'site-packages:NAME' or 'dir:PATH'")


def _source_root(src: str) -> tuple[Path, str]:
    """(directory to scan, relative-name prefix) for one source string."""
    kind, arg = _parse_source(src)
    if kind == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"]), "stdlib"
    if kind == "dir":
        root = Path(arg).expanduser().resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"corpus source {src!r}: {root} is not a directory")
        return root, root.name
    spec = importlib.util.find_spec(arg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"corpus source {src!r}: no installed package named {arg!r} (pip install it, or drop the source)"
        )
    return Path(next(iter(spec.submodule_search_locations))), f"site-packages/{arg}"


def _excluded(rel: Path, is_stdlib: bool) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIR_NAMES for p in parts[:-1]):
        return True
    return is_stdlib and parts[0].startswith(_EXCLUDED_STDLIB_PREFIXES)


def _read_utf8(path: Path, max_bytes: int) -> str | None:
    try:
        if path.stat().st_size > max_bytes:
            return None
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def source_files(cfg: CorpusConfig) -> list[tuple[str, Path]]:
    """(relative name, path) of every corpus file, sorted by relative name."""
    found: dict[str, Path] = {}
    for src in cfg.sources:
        root, prefix = _source_root(src)
        is_stdlib = src == "stdlib"
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if _excluded(rel, is_stdlib) or not path.is_file():
                continue
            if _read_utf8(path, cfg.max_file_bytes) is None:
                continue
            name = f"{prefix}/{rel.as_posix()}"
            if name in found and found[name] != path:
                raise ValueError(f"corpus file name {name!r} comes from two sources; rename one source dir")
            found[name] = path
    return sorted(found.items())


def split_of(relpath: str, cfg: CorpusConfig) -> str:
    """'train' | 'validation' | 'test', from a stable hash of the relative name (not Python's hash)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < cfg.test_fraction:
        return "test"
    if u < cfg.test_fraction + cfg.val_fraction:
        return "validation"
    return "train"


# ----------------------------------------------------------------------------- writing


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temp file beside path for binary writing; on success fsync and rename it over path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def build_corpus(out_dir: str | Path, cfg: CorpusConfig | None = None) -> CorpusManifest:
    """Write train/validation/test .jsonl files and manifest.json into out_dir (atomically, manifest last)."""
    cfg = cfg or CorpusConfig()
    out = Path(out_dir)
    lines: dict[str, list[bytes]] = {name: [] for name in SPLITS}
    nbytes = dict.fromkeys(SPLITS, 0)
    for rel, path in source_files(cfg):
        text = _read_utf8(path, cfg.max_file_bytes)
        if text is None:  # changed under us since the scan
            continue
        split = split_of(rel, cfg)
        record = json.dumps({"path": rel, "text": text}, ensure_ascii=False)
        lines[split].append(record.encode("utf-8") + b"\n")
        nbytes[split] += len(text.encode("utf-8"))
    splits: dict[str, SplitStats] = {}
    for name in SPLITS:
        data = b"".join(lines[name])
        atomic_write_bytes(out / f"{name}.jsonl", data)
        splits[name] = SplitStats(files=len(lines[name]), bytes=nbytes[name], sha256=hashlib.sha256(data).hexdigest())
    manifest = CorpusManifest(python_version=platform.python_version(), config=cfg, splits=splits)
    atomic_write_bytes(out / "manifest.json", (json.dumps(manifest.to_json(), indent=2) + "\n").encode())
    return manifest


# ----------------------------------------------------------------------------- reading


def load_manifest(corpus_dir: str | Path) -> CorpusManifest:
    path = Path(corpus_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; build the corpus first (python -m dspark.train.corpus DIR)")
    return CorpusManifest.from_json(json.loads(path.read_text()))


def iter_documents(jsonl_path: str | Path) -> Iterator[dict]:
    """Yield the {"path", "text"} records of one split file."""
    path = Path(jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; build the corpus first (python -m dspark.train.corpus DIR)")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc}); rebuild the corpus") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected a {{'path', 'text'}} record; rebuild the corpus")
            yield record


def iter_texts(jsonl_path: str | Path) -> Iterator[str]:
    for record in iter_documents(jsonl_path):
        yield record["text"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the offline code corpus (train/validation/test jsonl).")
    parser.add_argument("out_dir")
    parser.add_argument("--source", action="append", dest="sources", help="stdlib | site-packages:NAME | dir:PATH")
    parser.add_argument("--max-file-bytes", type=int, default=CorpusConfig.max_file_bytes)
    parser.add_argument("--val-fraction", type=float, default=CorpusConfig.val_fraction)
    parser.add_argument("--test-fraction", type=float, default=CorpusConfig.test_fraction)
    args = parser.parse_args(argv)
    cfg = CorpusConfig(
        sources=tuple(args.sources or CorpusConfig.sources),
        max_file_bytes=args.max_file_bytes,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
    )
    manifest = build_corpus(args.out_dir, cfg)
    json.dump(manifest.to_json(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
