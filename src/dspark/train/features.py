"""Target features for drafter training: online (a target forward inside the loop) or an offline cache.

Per sample the drafter needs the target's taps [S, m·D] (outputs of decoder layers ``target_layer_ids``,
concatenated) and its final post-norm hidden state [S, D]; target logits are rebuilt from the latter with
the frozen lm_head inside the loss (dspark-method.md §6.1–6.2). Both paths round the features to the same
``feature_dtype``, so online and offline training see identical inputs.

Offline cache layout (written once by :func:`prepare_features`, read memory-mapped by :class:`FeatureCache`)::

    manifest.json              tap_layers, widths, dtype, sample count, dataset fingerprint, shard names
    index.npy                  int64 [N, 3]: shard, first row, length of every sample
    taps-00000.bin ...         [rows, m·D] raw little-endian rows (bf16 stored as uint16, or fp32)
    hidden-00000.bin ...       [rows, D]

Usage: ``dspark prepare-features --target runs/target/export --data-dir runs/draft_data --taps 1,4,7,10``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dspark.train.draft_data import MANIFEST_FILE, TRAIN_FILE, VALIDATION_FILE, DraftDataset, write_manifest
from dspark.train.loop import bf16_autocast

MANIFEST = "manifest.json"
INDEX = "index.npy"
CACHE_VERSION = 1
# feature dtype name -> (numpy storage dtype, torch dtype)
FEATURE_DTYPES: dict[str, tuple[type, torch.dtype]] = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float32": (np.float32, torch.float32),
}


def _dtypes(name: str) -> tuple[type, torch.dtype]:
    if name not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {name!r} is not supported; use one of {sorted(FEATURE_DTYPES)}")
    return FEATURE_DTYPES[name]


@dataclass(frozen=True)
class Features:
    taps: torch.Tensor  # [B, S, m·D] in the feature dtype
    hidden: torch.Tensor  # [B, S, D] target final post-norm hidden, in the feature dtype


@torch.no_grad()
def target_features(
    target: nn.Module,
    input_ids: torch.Tensor,
    tap_layers: Sequence[int],
    feature_dtype: str = "bfloat16",
    autocast: bool = True,
    absorbed: bool = True,
    chunk: int | None = None,
    lengths: torch.Tensor | None = None,
) -> Features:
    """Online features: input_ids [B, S] (right-padded; the causal target ignores the padding) → Features.

    absorbed MLA is several times faster on CPU for training-length sequences (hundreds of tokens). ``chunk``:
    run sequences longer than that many tokens chunk by chunk over a latent cache (bounded memory). ``lengths``
    [B]: the unpadded lengths; rows of unequal length then run one by one at their own length (the padding costs
    nothing; rows past a length are zero), which is what a batch of mixed-length conversations needs."""
    if input_ids.device.type != "cpu" and lengths is not None:
        return _padded_features(target, input_ids, tap_layers, feature_dtype, autocast, absorbed, chunk, lengths)
    if lengths is not None and input_ids.shape[0] > 1 and bool((lengths != lengths[0]).any()):
        rows = [
            target_features(target, input_ids[b : b + 1, :n], tap_layers, feature_dtype, autocast, absorbed, chunk)
            for b, n in enumerate(lengths.tolist())
        ]
        S = input_ids.shape[1]
        pad = [(0, 0, 0, S - f.hidden.shape[1]) for f in rows]
        return Features(
            taps=torch.cat([torch.nn.functional.pad(f.taps, p) for f, p in zip(rows, pad)]),
            hidden=torch.cat([torch.nn.functional.pad(f.hidden, p) for f, p in zip(rows, pad)]),
        )
    _, tdtype = _dtypes(feature_dtype)
    with bf16_autocast(autocast, input_ids.device):
        if chunk is not None and input_ids.shape[1] > chunk:
            taps, hidden = _chunked_forward(target, input_ids, tuple(tap_layers), chunk, absorbed)
        else:
            out = target(input_ids, tap_layers=tuple(tap_layers), absorbed=absorbed, compute_logits=False)
            assert out.taps is not None
            taps, hidden = out.taps, out.hidden
    return Features(taps=taps.to(tdtype), hidden=hidden.to(tdtype))


def _padded_features(
    target: nn.Module,
    input_ids: torch.Tensor,
    tap_layers: Sequence[int],
    feature_dtype: str,
    autocast: bool,
    absorbed: bool,
    chunk: int | None,
    lengths: torch.Tensor,
) -> Features:
    """An accelerator's form of mixed lengths: the whole right-padded batch in one forward (the causal target never
    lets a row see the padding after it), then every row past its length set to zero as the CPU form leaves it.
    No host sync: ``lengths`` may live on the device."""
    feats = target_features(target, input_ids, tap_layers, feature_dtype, autocast, absorbed, chunk)
    S = input_ids.shape[1]
    valid = (torch.arange(S, device=input_ids.device)[None, :] < lengths.to(input_ids.device)[:, None])[..., None]
    zero = torch.zeros((), dtype=feats.taps.dtype, device=input_ids.device)
    return Features(taps=torch.where(valid, feats.taps, zero), hidden=torch.where(valid, feats.hidden, zero))


def _chunked_forward(
    target: nn.Module, input_ids: torch.Tensor, tap_layers: tuple[int, ...], chunk: int, absorbed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over ``chunk`` rows at a time, each chunk attending to the cached keys/latents of the rows
    before it (one page per sequence): attention and MLP temporaries scale with chunk·S, not S², so long
    training samples fit in bounded memory; a hybrid target's KDA states go from chunk to chunk.
    → (taps [B, S, m·D], hidden [B, S, D]) as one pass gives them."""
    from dspark.cache.pool import PagedPool
    from dspark.models.kda import KDACache

    # a hybrid target's recurrent layers carry their state from one chunk to the next
    extra = {"states": KDACache()} if getattr(target, "state_spec", None) is not None else {}
    B, S = input_ids.shape
    fmt = target.page_format
    dtype = fmt.dtype or next(target.parameters()).dtype
    pool = PagedPool(fmt.num_layers, B, S, fmt.width, dtype, input_ids.device)  # page b = sequence b: slot b·S + p
    base = torch.arange(B, device=input_ids.device)[:, None] * S
    taps, hidden = [], []
    for s in range(0, S, chunk):
        e = min(S, s + chunk)
        pos = torch.arange(s, e, device=input_ids.device).expand(B, e - s)  # [B, T]
        store = pool.view(base + pos, base + torch.arange(e, device=input_ids.device))  # reads positions 0..e-1
        mask = torch.arange(e, device=input_ids.device)[None, None, :] <= pos[:, :, None]  # [B, T, e] causal
        out = target(input_ids[:, s:e], pos, mask, store, tap_layers, absorbed=absorbed, compute_logits=False, **extra)
        assert out.taps is not None
        taps.append(out.taps)
        hidden.append(out.hidden)
    return torch.cat(taps, 1), torch.cat(hidden, 1)


@torch.no_grad()
def target_logits_at(lm_head: nn.Module, hidden: torch.Tensor, rows: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Target next-token logits fp32 [B, N, V] at row indices rows [B, N] of hidden [B, S, D]."""
    picked = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
    with bf16_autocast(autocast, hidden.device):
        w = lm_head.weight
        return lm_head(picked.to(w.dtype)).float()


# --------------------------------------------------------------------------------------------------------
# offline cache
# --------------------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class PrepareResult:
    out_dir: str
    num_samples: int
    num_tokens: int
    bytes_written: int
    wall_clock_s: float


class FeatureWriter:
    """Writes a feature cache sample by sample into a temporary directory; :meth:`commit` adds the index and
    manifest and renames it into place (a crash leaves no half-written cache behind)."""

    def __init__(self, out_dir: str | Path, feature_dtype: str, max_shard_bytes: int = 1 << 30) -> None:
        self.np_dtype, _ = _dtypes(feature_dtype)
        self.feature_dtype = feature_dtype
        self.out = Path(out_dir)
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.index: dict[int, tuple[int, int, int]] = {}  # sample → (shard, first row, length)
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[str] = []
        self.files: tuple | None = None
        self.rows_in_shard = 0
        self.bytes_written = 0
        self.widths: tuple[int, int] | None = None

    def write(self, i: int, taps: torch.Tensor, hidden: torch.Tensor) -> None:
        """Sample i's features: taps [L, m·D], hidden [L, D] (any float dtype; stored in the cache dtype)."""
        _, tdtype = _dtypes(self.feature_dtype)
        taps_np, hidden_np = _to_numpy(taps.to(tdtype), self.np_dtype), _to_numpy(hidden.to(tdtype), self.np_dtype)
        self.widths = (taps_np.shape[-1], hidden_np.shape[-1])
        L = taps_np.shape[0]
        row_bytes = sum(self.widths) * np.dtype(self.np_dtype).itemsize
        if self.files is None or (self.rows_in_shard + L) * row_bytes > self.max_shard_bytes and self.rows_in_shard:
            self._next_shard()
        assert self.files is not None
        self.files[0].write(np.ascontiguousarray(taps_np).tobytes())
        self.files[1].write(np.ascontiguousarray(hidden_np).tobytes())
        self.index[i] = (len(self.shards) - 1, self.rows_in_shard, L)
        self.rows_in_shard += L
        self.bytes_written += L * row_bytes

    def _next_shard(self) -> None:
        self._close()
        name = f"{len(self.shards):05d}"
        self.shards.append(name)
        self.files = (open(self.tmp / f"taps-{name}.bin", "wb"), open(self.tmp / f"hidden-{name}.bin", "wb"))
        self.rows_in_shard = 0

    def _close(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            self.files = None

    def commit(self, dataset: DraftDataset, tap_layers: Sequence[int], autocast: bool) -> None:
        self._close()
        rows = [self.index.get(i, (0, 0, -1)) for i in range(len(dataset))]
        index = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        if not np.array_equal(index[:, 2], dataset.lengths()):
            raise ValueError(f"{self.out}: written feature rows do not match the dataset's sample lengths")
        np.save(self.tmp / INDEX, index)
        taps_width, hidden_width = self.widths or (None, None)
        manifest = {
            "version": CACHE_VERSION,
            "num_samples": len(dataset),
            "num_tokens": int(dataset.lengths().sum()),
            "tap_layers": list(tap_layers),
            "taps_width": taps_width,
            "hidden_width": hidden_width,
            "dtype": self.feature_dtype,
            "autocast_bf16": autocast,
            "dataset_fingerprint": dataset.fingerprint(),
            "shards": self.shards,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _fsync_dir(self.tmp)
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)

    def abort(self) -> None:
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _length_batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Sample indices grouped by similar length, at most batch_tokens padded tokens per group."""
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in np.argsort(lengths, kind="stable").tolist():
        if cur and (len(cur) + 1) * int(lengths[i]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


def prepare_features(
    target: nn.Module,
    dataset: DraftDataset,
    out_dir: str | Path,
    tap_layers: Sequence[int],
    feature_dtype: str = "bfloat16",
    autocast: bool = True,
    batch_tokens: int = 4096,
    max_shard_bytes: int = 1 << 30,
    progress: bool = False,
    chunk: int | None = None,
) -> PrepareResult:
    """Run the frozen target once over every sample and write the sharded cache (atomically: a temporary
    directory renamed into place, manifest last). Samples are batched by similar length."""
    t0 = time.perf_counter()
    lengths = dataset.lengths()
    batches = _length_batches(lengths, batch_tokens)
    writer = FeatureWriter(out_dir, feature_dtype, max_shard_bytes)
    device = next(target.parameters()).device  # the ids go where the target is; the cache is written from the host
    try:
        for bi, batch in enumerate(batches):
            ids = torch.zeros(len(batch), int(lengths[batch].max()), dtype=torch.long)
            for r, i in enumerate(batch):
                x, _ = dataset[i]
                ids[r, : x.size] = torch.from_numpy(x)
            feats = target_features(target, ids.to(device), tap_layers, feature_dtype, autocast, chunk=chunk)
            feats = Features(taps=feats.taps.cpu(), hidden=feats.hidden.cpu())
            for r, i in enumerate(batch):
                L = int(lengths[i])
                writer.write(i, feats.taps[r, :L], feats.hidden[r, :L])
            if progress and (bi + 1) % 20 == 0:
                print(f"prepare-features: {bi + 1}/{len(batches)} batches", file=sys.stderr, flush=True)
        writer.commit(dataset, tap_layers, autocast)
    finally:
        writer.abort()
    n_tok = int(lengths.sum())
    return PrepareResult(str(out_dir), len(dataset), n_tok, writer.bytes_written, round(time.perf_counter() - t0, 1))


def _to_numpy(x: torch.Tensor, np_dtype: type) -> np.ndarray:
    if np_dtype is np.uint16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.float().numpy()


class FeatureCache:
    """Memory-mapped reader of a cache written by :func:`prepare_features`."""

    def __init__(self, directory: str | Path, dataset: DraftDataset | None = None, tap_layers=None) -> None:
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(
                f"{mpath} not found; write the feature cache first with `dspark prepare-features` "
                "(or train with --features online)"
            )
        self.manifest = json.loads(mpath.read_text())
        if self.manifest.get("version") != CACHE_VERSION:
            raise ValueError(f"{mpath}: cache version {self.manifest.get('version')} != {CACHE_VERSION}; rebuild it")
        self.feature_dtype: str = self.manifest["dtype"]
        self.np_dtype, self.torch_dtype = _dtypes(self.feature_dtype)
        self.index = np.load(self.dir / INDEX)
        if dataset is not None:
            if self.manifest["dataset_fingerprint"] != dataset.fingerprint():
                raise ValueError(
                    f"{self.dir}: the cache was computed from a different dataset; rerun `dspark prepare-features`"
                )
            if not np.array_equal(self.index[:, 2], dataset.lengths()):
                raise ValueError(f"{self.dir}: sample lengths do not match the dataset; rerun prepare-features")
        if tap_layers is not None and list(tap_layers) != self.manifest["tap_layers"]:
            raise ValueError(
                f"{self.dir}: cached taps are layers {self.manifest['tap_layers']} but the drafter wants "
                f"{list(tap_layers)}; rerun `dspark prepare-features --taps {','.join(map(str, tap_layers))}`"
            )
        self._maps: dict[tuple[str, int], np.memmap] = {}

    def __len__(self) -> int:
        return int(self.index.shape[0])

    def _map(self, kind: str, shard: int) -> np.memmap:
        key = (kind, shard)
        if key not in self._maps:
            width = self.manifest["taps_width" if kind == "taps" else "hidden_width"]
            path = self.dir / f"{kind}-{self.manifest['shards'][shard]}.bin"
            self._maps[key] = np.memmap(path, dtype=self.np_dtype, mode="r").reshape(-1, width)
        return self._maps[key]

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (taps [S, m·D], hidden [S, D]) in the cache dtype (copies, safe to modify)."""
        shard, start, length = (int(v) for v in self.index[i])
        out = []
        for kind in ("taps", "hidden"):
            rows = np.array(self._map(kind, shard)[start : start + length])
            t = torch.from_numpy(rows)
            out.append(t.view(torch.bfloat16) if self.np_dtype is np.uint16 else t)
        return out[0], out[1]

    def batch(self, indices: Sequence[int], seq_len: int) -> Features:
        """Right-padded (zeros) features of the samples → Features with [B, seq_len, ..]."""
        taps = torch.zeros(len(indices), seq_len, self.manifest["taps_width"], dtype=self.torch_dtype)
        hidden = torch.zeros(len(indices), seq_len, self.manifest["hidden_width"], dtype=self.torch_dtype)
        for r, i in enumerate(indices):
            t, h = self.get(i)
            taps[r, : t.shape[0]] = t
            hidden[r, : h.shape[0]] = h
        return Features(taps=taps, hidden=hidden)


def link_or_copy(src: Path, dst: Path) -> None:
    """dst as a hard link to src (no bytes copied; src stays valid), or a copy across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def merge_feature_dirs(sources: Sequence[Path], dest: Path, dataset: DraftDataset) -> None:
    """Join feature caches of consecutive dataset shards into ``dest`` for their concatenation ``dataset``. The
    shard files are hard-linked (a copy where the filesystem cannot link): no extra disk, and every shard stays a
    complete cache, so shards can be merged again (with more shards added later). dest is replaced only once the
    merged cache is complete."""
    tmp = dest.with_name(f".{dest.name}.merge")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifests = [json.loads((s / MANIFEST).read_text()) for s in sources]
    shards, index = [], []
    for k, (src, m) in enumerate(zip(sources, manifests)):
        idx = np.load(src / INDEX)
        idx[:, 0] += len(shards)
        index.append(idx)
        for name in m["shards"]:
            for kind in ("taps", "hidden"):
                link_or_copy(src / f"{kind}-{name}.bin", tmp / f"{kind}-{k}-{name}.bin")
            shards.append(f"{k}-{name}")
    np.save(tmp / INDEX, np.concatenate(index))
    manifest = manifests[0] | {
        "num_samples": len(dataset),
        "num_tokens": int(dataset.lengths().sum()),
        "dataset_fingerprint": dataset.fingerprint(),
        "shards": shards,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def merge_draft_data(out_dir: str | Path, num_shards: int, require_features: bool = False) -> dict[str, Any]:
    """Join ``out_dir/shard-0..N-1`` (each a `dspark draft-data --out-dir` of its own, e.g. runs on several cores
    with different seeds, or the ``--shard K/N`` processes of ``--source instructions-hf``) into
    out_dir/{train,validation}.npz and one manifest; the feature caches (shard-K/features/<split>) are merged too
    (files linked): always with ``require_features``, else when every shard of a split has one. A missing shard is
    an error: a half-merged dataset would silently train on less data than asked."""
    out = Path(out_dir)
    shards = [out / f"shard-{k}" for k in range(num_shards)]
    missing = [str(d / TRAIN_FILE) for d in shards if not (d / TRAIN_FILE).is_file()]
    if num_shards < 1 or missing:
        raise FileNotFoundError(
            f"draft-data --merge {num_shards}: missing {missing or 'shards'}; run `dspark draft-data --out-dir "
            f"{out}/shard-K --seed S` for every K in 0..{max(num_shards, 1) - 1} first"
        )
    result: dict[str, Any] = {"out_dir": str(out), "shards": num_shards}
    result |= join_shard_splits(out, shards, require_features=require_features)
    manifests = [json.loads((d / MANIFEST_FILE).read_text()) for d in shards if (d / MANIFEST_FILE).is_file()]
    generated = [m["generated_tokens"] for m in manifests if "generated_tokens" in m]
    if generated:  # shards that generated with transformers count their tokens and time
        result["generated_tokens"] = sum(generated)
        result["wall_clock_s"] = max(m.get("wall_clock_s", 0.0) for m in manifests)
    result["manifests"] = manifests
    write_manifest(out / MANIFEST_FILE, result)
    return result


def join_shard_splits(out: Path, shards: Sequence[Path], require_features: bool) -> dict[str, dict[str, int]]:
    """Each split's non-empty shard datasets (shard/{train,validation}.npz) concatenated into out/, with their
    feature caches (shard/features/<split>) merged into out/features/<split>: always when ``require_features``,
    else only when every contributing shard has one. → per split: samples, tokens, loss_tokens."""
    stats: dict[str, dict[str, int]] = {}
    for split, name in (("validation", VALIDATION_FILE), ("train", TRAIN_FILE)):
        found = [(d, DraftDataset.load(d / name)) for d in shards if (d / name).is_file()]
        found = [(d, ds) for d, ds in found if len(ds)]
        if not found:
            continue
        parts = [ds for _, ds in found]
        merged = DraftDataset.concat(parts, parts[0].meta | {"split": split, "merged_shards": len(shards)})
        merged.save(out / name)
        feature_dirs = [d / "features" / split for d, _ in found]
        if require_features or all(f.is_dir() for f in feature_dirs):
            merge_feature_dirs(feature_dirs, out / "features" / split, merged)
        stats[split] = {
            "samples": len(merged),
            "tokens": int(merged.tokens.size),
            "loss_tokens": merged.num_loss_tokens,
        }
    return stats
