"""Moving a training run to a lent accelerator and its results back, inside the device tool's limits.

A call to the device carries at most ``CALL_LIMIT`` bytes (the working tree plus the carried paths) and brings back
at most ``MAX_RESULT_FILES`` files of at most ``RESULT_PART`` bytes each. SmolLM2's GGUF (98 MB) and its drafter
(30 MB) do not fit one call, so:

- ``pack`` (here): the payload files (the target, the warm-start drafter, wheels the device lacks) go into one tar,
  compressed with xz, cut into chunks of at most ``--first-call`` and ``--call`` bytes under ``OUT/1``, ``OUT/2``...
  (one folder per call), with ``manifest.json`` (every chunk's and every file's sha256, each file's role);
- ``stash`` (there, one call per folder): copies a folder to ``/tmp/dspark-devpack`` on the warm machine (it stays
  warm 30 s after a call, so the calls follow each other at once);
- ``unpack`` (there, in the last call): joins the chunks, checks every checksum, extracts, and prints the roles;
- ``split_results`` (there): files of a run as a tar cut into parts for ``$OUT``, its index kept in the run's
  summary; ``join`` (here) reassembles and checks them.

A missing or damaged chunk is an error naming the chunk and the fix (carry it again). Only the standard library is
used, so the device runs this before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

MiB = 2**20
CALL_LIMIT = 64 * MiB  # what one call may carry: the working tree + carried paths
RESULT_PART = 16 * MiB  # the largest file a call brings back
MAX_RESULT_FILES = 8  # files a call brings back
MANIFEST = "manifest.json"
STASH = Path(os.environ.get("DSPARK_DEVPACK", "/tmp/dspark-devpack"))
ROLES = ("target", "drafter", "wheel", "data")


class PackError(RuntimeError):
    pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _joined(src: Path, pieces: Sequence[dict], whole: str, fixes: dict[str, str], bad_join: str) -> bytes:
    """The files ``pieces`` name (each {"file", "sha256"}) read from ``src``, checked one by one and joined, the
    join checked against ``whole``; a missing or damaged piece is named with its fix."""
    data = []
    for p in pieces:
        path = src / p["file"]
        if not path.is_file():
            raise PackError(f"{path}: missing ({fixes[p['file']]})")
        piece = path.read_bytes()
        if _sha256(piece) != p["sha256"]:
            raise PackError(f"{path}: checksum mismatch ({fixes[p['file']]})")
        data.append(piece)
    blob = b"".join(data)
    if _sha256(blob) != whole:
        raise PackError(f"{src}: {bad_join}")
    return blob


def pack(
    items: Sequence[tuple[str, Path]], out: Path, first_call: int, call: int, preset: int = 6
) -> dict[str, object]:
    """items: (role, file or directory). Writes OUT/1, OUT/2, ... (chunk files; OUT/1 holds the manifest too) →
    the manifest. ``first_call`` / ``call``: the bytes of payload the first / every later call may carry."""
    if first_call <= 0 or call <= 0:
        raise PackError(f"pack: no room left in a call (first {first_call}, later {call} bytes); carry less")
    files = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for role, path in items:
            if role not in ROLES:
                raise PackError(f"pack: role {role!r} is not one of {', '.join(ROLES)}")
            path = Path(path)
            if not path.exists():
                raise PackError(f"pack: {path} ({role}) does not exist")
            members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for p in members:
                name = f"{role}/{path.name}" + ("" if p == path else "/" + p.relative_to(path).as_posix())
                tar.add(p, arcname=name)
                files.append({"name": name, "role": role, "bytes": p.stat().st_size, "sha256": _file_sha256(p)})
    blob = lzma.compress(buf.getvalue(), preset=preset)
    if out.exists():
        shutil.rmtree(out)
    chunks, start, k = [], 0, 1
    while start < len(blob) or not chunks:
        size = first_call if k == 1 else call
        piece = blob[start : start + size]
        folder = out / str(k)
        folder.mkdir(parents=True)
        name = f"chunk-{k:02d}.xz"
        (folder / name).write_bytes(piece)
        chunks.append({"file": name, "call": k, "bytes": len(piece), "sha256": _sha256(piece)})
        start, k = start + len(piece), k + 1
    manifest = {"chunks": chunks, "files": files, "sha256": _sha256(blob), "bytes": len(blob)}
    (out / "1" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stash(folder: Path, dest: Path = STASH) -> list[str]:
    """Copy one call's folder into ``dest`` on the device machine → the names now there."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(folder).iterdir()):
        shutil.copy2(p, dest / p.name)
    return sorted(p.name for p in dest.iterdir())


def unpack(src: Path = STASH, dest: Path | None = None) -> dict[str, list[str]]:
    """Join the chunks in ``src``, verify, extract into ``dest`` (default SRC/unpacked) → {role: [paths]}."""
    src = Path(src)
    dest = Path(dest) if dest is not None else src / "unpacked"
    mpath = src / MANIFEST
    if not mpath.is_file():
        raise PackError(f"{mpath}: no manifest; carry the first call's folder (it holds {MANIFEST}) and stash it")
    manifest = json.loads(mpath.read_text())
    fixes = {c["file"]: f"call {c['call']}: carry that folder again and stash it" for c in manifest["chunks"]}
    blob = _joined(src, manifest["chunks"], manifest["sha256"], fixes, "the chunks do not join; rebuild the pack")
    raw = lzma.decompress(blob)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r") as tar:
        tar.extractall(dest, filter="data")
    roles: dict[str, list[str]] = {}
    for f in manifest["files"]:
        p = dest / f["name"]
        if _file_sha256(p) != f["sha256"]:
            raise PackError(f"{p}: checksum mismatch after extraction; rebuild the pack")
        top = dest / "/".join(f["name"].split("/")[:2])
        if str(top) not in roles.setdefault(f["role"], []):
            roles[f["role"]].append(str(top))
    return roles


# ---- results ------------------------------------------------------------------------------------------------


def split_results(
    items: Sequence[tuple[str, Path]], out: Path, stem: str, part: int = RESULT_PART
) -> dict[str, object]:
    """Files or directories as one tar ``OUT/STEM.tar.NN`` cut into parts of at most ``part`` bytes → its index
    (each part's sha256, the whole tar's, the members), which the caller keeps in its summary for ``join``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, path in items:
            tar.add(path, arcname=name)
    blob = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, start in enumerate(range(0, max(len(blob), 1), part)):
        piece = blob[start : start + part]
        p = out / f"{stem}.tar.{k:02d}"
        p.write_bytes(piece)
        parts.append({"file": p.name, "sha256": _sha256(piece)})
    return {"parts": parts, "sha256": _sha256(blob), "members": [n for n, _ in items]}


def check_result_files(out: Path) -> None:
    """What a call brings back: at most MAX_RESULT_FILES files of at most RESULT_PART bytes, two folders deep."""
    files = [p for p in Path(out).rglob("*") if p.is_file()]
    if len(files) > MAX_RESULT_FILES:
        raise PackError(f"{out}: {len(files)} files; a call brings back at most {MAX_RESULT_FILES}")
    big = [p for p in files if p.stat().st_size > RESULT_PART]
    if big:
        raise PackError(f"{big[0]}: {big[0].stat().st_size} bytes; a call brings back files of at most {RESULT_PART}")


def join(src: Path, meta: dict, dest: Path) -> list[str]:
    """Reassemble the parts ``meta`` (a ``split_results`` index) names from ``src``, check them, extract into
    ``dest`` → the members."""
    fixes = {p["file"]: "fetch the device run's results again" for p in meta["parts"]}
    blob = _joined(Path(src), meta["parts"], meta["sha256"], fixes, f"the parts do not join into {meta['members']}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(dest, filter="data")
    return list(meta["members"])


# ---- command line ----------------------------------------------------------------------------------------------


def _item(text: str) -> tuple[str, Path]:
    role, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError(f"expected ROLE=PATH (roles: {', '.join(ROLES)}), got {text!r}")
    return role, Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.train.device_pack", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="payload files → chunks, one folder per device call")
    a.add_argument("items", nargs="+", type=_item, metavar="ROLE=PATH")
    a.add_argument("--out", type=Path, default=Path(".devpack"))
    a.add_argument("--tree-bytes", type=int, default=0, help="what the working tree itself carries in every call")
    a.add_argument("--first-call", type=int, default=None, help="payload bytes of call 1 (default: the rest)")
    s = sub.add_parser("stash", help="(device) copy a call's folder to the stash")
    s.add_argument("folder", type=Path)
    u = sub.add_parser("unpack", help="(device) join, verify and extract the stash")
    u.add_argument("--src", type=Path, default=STASH)
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            room = CALL_LIMIT - args.tree_bytes - 64 * 1024  # the manifest and a margin
            m = pack(args.items, args.out, args.first_call or room, room)
            print(json.dumps({"chunks": m["chunks"], "bytes": m["bytes"]}, indent=1))
        elif args.cmd == "stash":
            print(" ".join(stash(args.folder)))
        else:
            print(json.dumps(unpack(args.src)))
    except PackError as e:
        print(f"device_pack: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
