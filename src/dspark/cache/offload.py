"""KV offload: a second storage tier for the cached blocks the page pool evicts (CPU memory, then files on disk).

A block's payload is its rows in every layer of every pool (the target's layers and the drafter's, in one pool or
two: ``page_size`` rows × width per layer, in the pool's dtype) and, for a stateful target (KDA), the state snapshot
after it when one is kept. It is serialized into one self-checking record: a magic line, a JSON header (the block
hash, a digest of the cache salt, each tensor's name, dtype and shape, the payload's length and its sha256), then the
payload. The CPU tier keeps records in memory up to a byte budget, the least recently used moving out first (to the
disk tier when there is one, else dropped); the disk tier keeps one file per block under a directory of its own,
written atomically (a temporary file, then ``os.replace``), up to its byte budget, the least recently used deleted
first. Reading a record back checks all of it: a wrong checksum, a short record, or a layout or salt other than this
engine's drops the block (its file removed, one log line), so its tokens are recomputed, never served from a damaged
copy. A tier that cannot write (a full disk, no permission, a budget smaller than a block) logs once and stops taking
blocks; the engine carries on without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("dspark.kv_offload")

MAGIC = b"DSPARK-KV-BLOCK 1\n"
SUFFIX = ".kvb"
DIR_PREFIX = "dspark-kv-"  # each disk tier's own directory under kv_offload_dir: dspark-kv-<pid>-<random>
TIERS = ("cpu", "disk")


class CorruptBlock(ValueError):
    """A stored block record does not read back as this engine wrote it (the message says how)."""


def _per_tier() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


@dataclass
class OffloadStats:
    """KV offload counters: blocks per tier (``cpu``, ``disk``), and tokens for the admission lookups."""

    stores: dict[str, int] = field(default_factory=_per_tier)  # blocks written into a tier
    loads: dict[str, int] = field(default_factory=_per_tier)  # blocks loaded back from a tier into the pool
    corrupt_drops: dict[str, int] = field(default_factory=_per_tier)  # bad checksum / short / wrong layout: dropped
    evictions: dict[str, int] = field(default_factory=_per_tier)  # pushed out of a full tier (CPU: to disk if any)
    write_errors: int = 0  # writes a tier could not make (it then stops taking blocks)
    queries: int = 0  # prompt tokens of admissions that could look up the tiers (vllm:external_prefix_cache_queries)
    hits: int = 0  # prompt tokens a hit took from blocks loaded back (vllm:external_prefix_cache_hits)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def header(self) -> list[Any]:
        return [self.name, str(self.dtype).removeprefix("torch."), list(self.shape)]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class BlockCodec:
    """Block payload ↔ record. ``rows``: the pool tensors every record holds; ``state``: the optional snapshot."""

    def __init__(self, salt: bytes, rows: Sequence[TensorSpec], state: TensorSpec | None = None) -> None:
        self.salt = hashlib.sha256(salt).hexdigest()
        self.rows = list(rows)
        self.state = state

    def layout(self, has_state: bool) -> list[TensorSpec]:
        return self.rows + ([self.state] if has_state and self.state is not None else [])

    def encode(self, block: bytes, tensors: Mapping[str, torch.Tensor]) -> bytes:
        specs = self.layout("state" in tensors)
        for spec in specs:
            t = tensors[spec.name]
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(f"{spec.name}: {t.dtype} {tuple(t.shape)}, the layout says {spec.dtype} {spec.shape}")
        payload = b"".join(_tensor_bytes(tensors[s.name]) for s in specs)
        header = {
            "block": block.hex(),
            "salt": self.salt,
            "tensors": [s.header() for s in specs],
            "nbytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        return MAGIC + len(head).to_bytes(4, "little") + head + payload

    def decode(self, block: bytes, record: bytes) -> dict[str, torch.Tensor]:
        """The tensors of ``record``, which must name ``block``; raises CorruptBlock saying what is wrong."""
        if not record.startswith(MAGIC):
            raise CorruptBlock("not a block record (bad magic)" if len(record) >= len(MAGIC) else "truncated record")
        start = len(MAGIC) + 4
        if len(record) < start:
            raise CorruptBlock("truncated header")
        end = start + int.from_bytes(record[len(MAGIC) : start], "little")
        if len(record) < end:
            raise CorruptBlock("truncated header")
        try:
            header = json.loads(record[start:end])
            names, nbytes, digest = header["tensors"], int(header["nbytes"]), header["sha256"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptBlock(f"unreadable header ({e})") from None
        if header.get("block") != block.hex():
            raise CorruptBlock(f"the record names block {str(header.get('block'))[:12]}…")
        if header.get("salt") != self.salt:
            raise CorruptBlock("written for another model, page format or dtype (salt differs)")
        specs = next((s for s in (self.layout(False), self.layout(True)) if [x.header() for x in s] == names), None)
        if specs is None:
            want = [s.header() for s in self.layout(True)]
            raise CorruptBlock(f"tensors {names} are not this engine's layout {want}")
        payload = record[end:]
        if len(payload) != nbytes or nbytes != sum(s.nbytes for s in specs):
            raise CorruptBlock(f"truncated: {len(payload)} of {nbytes} payload bytes")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise CorruptBlock("checksum mismatch (sha256 of the payload)")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out, at = {}, 0
        for s in specs:
            part = raw[at : at + s.nbytes]
            part = part if at % s.dtype.itemsize == 0 else part.clone()  # a view needs an aligned start
            out[s.name] = part.view(s.dtype).reshape(s.shape)
            at += s.nbytes
        return out


class _Tier:
    """Records by block hash, least recently used first, within a byte budget (an empty tier is still truthy)."""

    name = ""

    def __init__(self, budget: int, stats: OffloadStats) -> None:
        self.budget = budget
        self.stats = stats
        self.index: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()  # block → (record bytes, has state)
        self.bytes = 0
        self._too_big_logged = False

    def __contains__(self, block: bytes) -> bool:
        return block in self.index

    def __len__(self) -> int:
        return len(self.index)

    def __bool__(self) -> bool:
        return True

    def holds(self, block: bytes, has_state: bool) -> bool:
        """Whether the tier holds ``block`` with at least this payload (a state when ``has_state``)."""
        entry = self.index.get(block)
        return entry is not None and (entry[1] or not has_state)

    def touch(self, block: bytes) -> None:
        self.index.move_to_end(block)

    def fits(self, size: int, key: str) -> bool:
        if size <= self.budget:
            return True
        if not self._too_big_logged:
            self._too_big_logged = True
            logger.warning(
                "kv offload: a block of %d bytes does not fit the %s tier's budget (%d bytes) and skips it; raise %s "
                "to at least that",
                size,
                self.name,
                self.budget,
                key,
            )
        return False

    def _account(self, block: bytes, size: int, has_state: bool) -> None:
        old = self.index.pop(block, None)
        self.bytes += size - (old[0] if old else 0)
        self.index[block] = (size, has_state)

    def _forget(self, block: bytes) -> None:
        old = self.index.pop(block, None)
        if old is not None:
            self.bytes -= old[0]


class CpuTier(_Tier):
    name = "cpu"

    def __init__(self, budget: int, stats: OffloadStats) -> None:
        super().__init__(budget, stats)
        self.records: dict[bytes, bytes] = {}

    def put(self, block: bytes, record: bytes, has_state: bool) -> list[tuple[bytes, bytes, bool]]:
        """Keep ``record``; returns what moves out (least recently used first), the record itself if it never fits."""
        if not self.fits(len(record), "kv_offload_cpu_bytes"):
            return [(block, record, has_state)]
        self.drop(block)
        out = []
        while self.bytes + len(record) > self.budget:
            old, (_, old_state) = next(iter(self.index.items()))
            out.append((old, self.records[old], old_state))
            self.drop(old)
            self.stats.evictions[self.name] += 1
        self._account(block, len(record), has_state)
        self.records[block] = record
        self.stats.stores[self.name] += 1
        return out

    def get(self, block: bytes) -> bytes | None:
        record = self.records.get(block)
        if record is not None:
            self.touch(block)
        return record

    def drop(self, block: bytes) -> None:
        self._forget(block)
        self.records.pop(block, None)


class DiskTier(_Tier):
    """One file per block in a directory of its own under ``root`` (removed when the tier is collected or the
    process exits; directories of processes that are gone are removed when a tier starts)."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, budget: int, stats: OffloadStats) -> None:
        super().__init__(budget, stats)
        self.root = Path(root)
        self.dir: Path | None = None
        self.writable = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_orphans(self.root)
            self.dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=self.root))
        except OSError as e:
            self._disable(f"cannot create a directory under {self.root} ({e})")
            return
        self.writable = True
        self._remove = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def close(self) -> None:
        """Remove the tier's directory now (what a clean shutdown does; the finalizer covers a plain exit)."""
        self.writable = False
        self.index.clear()
        self.bytes = 0
        if self.dir is not None:
            self._remove()

    def _disable(self, why: str) -> None:
        self.stats.write_errors += 1
        logger.warning("kv offload: %s; the disk tier stops taking blocks (evicted blocks beyond it are lost)", why)
        self.writable = False

    def path(self, block: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{block.hex()}{SUFFIX}"

    def put(self, block: bytes, record: bytes, has_state: bool) -> bool:
        """Write ``record`` atomically, then delete least recently used files until the tier is within its budget
        again; False if it cannot write (nothing it held is lost then)."""
        if not self.writable or not self.fits(len(record), "kv_offload_disk_bytes"):
            return False
        final = self.path(block)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._disable(f"cannot write {final} ({e})")
            return False
        self._account(block, len(record), has_state)
        self.stats.stores[self.name] += 1
        while self.bytes > self.budget:
            self.drop(next(iter(self.index)))
            self.stats.evictions[self.name] += 1
        return True

    def get(self, block: bytes) -> bytes | None:
        if self.dir is None:
            return None
        try:
            record = self.path(block).read_bytes()
        except OSError as e:
            logger.warning("kv offload: cannot read %s (%s); the block is dropped", self.path(block), e)
            self._forget(block)
            return None
        self.touch(block)
        return record

    def drop(self, block: bytes) -> None:
        self._forget(block)
        if self.dir is not None:
            with contextlib.suppress(OSError):
                self.path(block).unlink(missing_ok=True)


def _remove_orphans(root: Path) -> None:
    """Delete the tier directories of processes that no longer run (a crash leaves its files behind)."""
    for d in root.glob(f"{DIR_PREFIX}*-*"):
        try:
            pid = int(d.name[len(DIR_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class OffloadStore:
    """The CPU tier, then the disk tier (either may be absent). ``store`` takes an evicted block, ``load`` finds one."""

    def __init__(
        self,
        codec: BlockCodec,
        cpu_bytes: int,
        disk_dir: str | os.PathLike | None,
        disk_bytes: int,
        stats: OffloadStats | None = None,
    ) -> None:
        self.codec = codec
        self.stats = stats or OffloadStats()
        self.cpu = CpuTier(cpu_bytes, self.stats) if cpu_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, self.stats) if disk_dir is not None else None

    def close(self) -> None:
        """Give up the tiers: the disk tier's directory is removed (the engine is shutting down)."""
        if self.disk is not None:
            self.disk.close()

    @property
    def tiers(self) -> list[CpuTier | DiskTier]:
        return [t for t in (self.cpu, self.disk) if t is not None]

    @property
    def writable(self) -> bool:
        return self.cpu is not None or (self.disk is not None and self.disk.writable)

    def __contains__(self, block: bytes) -> bool:
        return any(block in t for t in self.tiers)

    def has_state(self, block: bytes) -> bool:
        return any(t.holds(block, True) for t in self.tiers)

    def store(self, block: bytes, payload: Callable[[], Mapping[str, torch.Tensor]], has_state: bool) -> None:
        """Keep an evicted block; ``payload`` (its tensors) is called only when no tier holds it already."""
        first = self.cpu if self.cpu is not None else self.disk
        if first is None or not self.writable:
            return
        if first.holds(block, has_state):  # stored before (a block loaded back and evicted again)
            first.touch(block)
            return
        record = self.codec.encode(block, payload())
        moved = self.cpu.put(block, record, has_state) if self.cpu is not None else [(block, record, has_state)]
        for old, old_record, old_state in moved:
            self._to_disk(old, old_record, old_state)

    def _to_disk(self, block: bytes, record: bytes, has_state: bool) -> None:
        if self.disk is None:
            return
        if self.disk.holds(block, has_state):
            self.disk.touch(block)
        else:
            self.disk.put(block, record, has_state)

    def load(self, block: bytes) -> tuple[dict[str, torch.Tensor], str] | None:
        """(the block's tensors, the tier they came from), checked; a corrupt copy is dropped, logged and counted,
        and the next tier tried. None: no tier holds an intact copy."""
        for tier in self.tiers:
            if block not in tier:
                continue
            record = tier.get(block)
            if record is None:
                continue
            try:
                return self.codec.decode(block, record), tier.name
            except CorruptBlock as e:
                where = f" ({tier.path(block)})" if isinstance(tier, DiskTier) else ""
                logger.warning(
                    "kv offload: block %s in the %s tier%s is corrupt: %s; dropped, its tokens are recomputed",
                    block.hex()[:16],
                    tier.name,
                    where,
                    e,
                )
                tier.drop(block)
                self.stats.corrupt_drops[tier.name] += 1
        return None

    def report(self) -> dict[str, int | str | bool]:
        s = self.stats
        rep: dict[str, int | str | bool] = {"kv_offload": True}
        for tier, key in ((self.cpu, "cpu"), (self.disk, "disk")):
            rep[f"kv_offload_{key}_blocks"] = len(tier) if tier is not None else 0
            rep[f"kv_offload_{key}_bytes"] = tier.bytes if tier is not None else 0
            rep[f"kv_offload_{key}_budget"] = tier.budget if tier is not None else 0
            rep[f"kv_offload_stores_{key}"] = s.stores[key]
            rep[f"kv_offload_loads_{key}"] = s.loads[key]
            rep[f"kv_offload_evictions_{key}"] = s.evictions[key]
        rep["kv_offload_disk_dir"] = str(self.disk.dir) if self.disk is not None and self.disk.dir is not None else ""
        rep["kv_offload_disk_writable"] = self.disk is not None and self.disk.writable
        rep["kv_offload_corrupt_drops"] = sum(s.corrupt_drops.values())
        rep["kv_offload_write_errors"] = s.write_errors
        rep["kv_offload_hit_tokens"] = s.hits
        return rep


def per_head_width(model: Any) -> int:
    """Values per token per layer if ``model`` cached K and V per head: MLA heads expanded to K (nope + rope dims)
    and V; GQA pages already hold [k | v] per KV head (the same layout), and token pages hold ids."""
    fmt = model.page_format
    if fmt.kind != "mla":
        return fmt.width
    width = getattr(model, "separate_cache_width", None)  # a drafter says it itself
    if width is not None:
        return width
    mla = model.config.mla
    return mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)


def layout_bytes(target: Any, drafter: Any | None, dtype: torch.dtype) -> dict[str, int | str]:
    """Bytes per token an offloaded block moves (the pages' layout: MLA latents, or GQA per-head K/V) against a
    per-head K/V layout of the same models, and the state bytes a stateful target's block adds."""
    latent = per_head = 0
    for model in (target, drafter) if drafter is not None else (target,):
        fmt = model.page_format
        elem = (fmt.dtype or dtype).itemsize
        latent += fmt.num_layers * fmt.width * elem
        per_head += fmt.num_layers * per_head_width(model) * elem
    spec = target.state_spec
    state = spec.num_layers * math.prod(spec.shape) * (spec.dtype or torch.float32).itemsize if spec else 0
    return {
        "kv_offload_layout": target.page_format.kind,
        "kv_offload_bytes_per_token": latent,
        "kv_offload_per_head_bytes_per_token": per_head,
        "kv_offload_state_bytes_per_block": state,
    }
