"""Paged KV storage: pools of per-token rows in one page format each, indexed by one block table per request.

A pool is ``[num_layers, num_slots, W]`` in one ``PageFormat`` (MLA: the (kv_lora_rank + rope dim)-wide latent;
GQA: [k | v] of every KV head; the recompute fallback: token ids). When the drafter's page format equals the
target's, its layers follow the target's in the same pool (layers 0..L_t-1 target, L_t.. drafter); otherwise it
gets a second pool with the same pages. Either way a request owns pages (via the pure-Python allocator) and slot
``page * page_size + offset`` holds position ``page_index * page_size + offset`` in every layer of every pool, so
target and drafter share one block table. The last page is a scratch page that absorbs the writes of padding rows.
Rollback is setting a request's length: stale rows are overwritten later and masked until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.models.layers import same_dtype
from dspark.models.protocol import PageFormat


@dataclass(frozen=True)
class BatchStore:
    """A per-forward view of a pool (a ``CacheView``): where to write the new rows and which rows to read."""

    pool: torch.Tensor  # [L, N_slots, W]
    write_slots: torch.Tensor  # [B, T] flat slot per new row (padding rows → scratch slots)
    read_slots: torch.Tensor  # [B, S] flat slot per visible key position (padding → any slot, masked)
    layer_offset: int = 0
    read_start: int | None = None  # one request whose S read slots are start..start+S-1: read in place
    _flat_writes: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_flat_writes", self.write_slots.reshape(-1))  # once per forward, not per layer

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """Store rows [B, T, W] at the write slots of ``layer``."""
        self._write(self.pool[self.layer_offset + layer], rows)

    def _write(self, plane: torch.Tensor, rows: torch.Tensor) -> None:
        flat = rows.reshape(-1, rows.shape[-1])
        plane.index_copy_(0, self._flat_writes, same_dtype(flat, plane.dtype))

    def read(self, layer: int) -> torch.Tensor:
        """The rows at the read slots of ``layer``: [B, S, W] (a view of the pool when ``read_start`` is set, else a
        gathered copy)."""
        return self._read(self.pool[self.layer_offset + layer])

    def _read(self, plane: torch.Tensor) -> torch.Tensor:
        if self.read_start is not None:
            return plane[None, self.read_start : self.read_start + self.read_slots.shape[1]]
        return plane[self.read_slots]

    def plane_and_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a native layer that writes and reads the pool itself: (the plane of ``layer`` [N_slots, W], the
        write slot of every new row [B·T], the read slots [B, S])."""
        return self.pool[self.layer_offset + layer], self._flat_writes, self.read_slots

    def pool_and_slots(self) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """For a native stack of layers that writes and reads the pool itself: (the pool [layers, N_slots, W], the
        pool layer of this view's layer 0, the write slot of every new row [B·T], the read slots [B, S])."""
        return self.pool, self.layer_offset, self._flat_writes, self.read_slots

    def paged_attention(
        self, layer: int, q: torch.Tensor, bias: torch.Tensor, n_kv: int, v_off: int, scale: float
    ) -> torch.Tensor | None:
        """Attention of q [B, H, T, d] over the keys and values of ``layer`` read in place from the pool by the
        native kernel (GQA rows: key heads at 0, value heads at ``v_off``), bias [B, 1, T, S] additive → [B, H, T, d];
        None where the kernel does not apply (no native kernels, or q and the pool differ in dtype)."""
        import dspark.native as native

        plane = self.pool[self.layer_offset + layer]
        ops = native.ops()
        if ops is None or plane.dtype != q.dtype:
            return None
        slots = self.read_slots
        if self.read_start is not None:
            slots = torch.arange(self.read_start, self.read_start + slots.shape[1]).expand(slots.shape[0], -1)
        bias = bias[:, 0].float().contiguous()
        return ops.paged_attention(q.contiguous(), plane, slots.contiguous(), bias, n_kv, 0, v_off, q.shape[-1], scale)

    def update(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [B, T, W] → keys [B, S, W] after writing the new rows (the layer's plane selected once)."""
        plane = self.pool[self.layer_offset + layer]
        self._write(plane, rows)
        return self._read(plane)


class PagedPool:
    """The tensor side of the paged cache (the allocator/block tables are in ``allocator.py``)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        width: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages  # usable pages; one extra scratch page follows them
        self.page_size = page_size
        self.width = width
        self.dtype = dtype
        self.pool = torch.zeros(num_layers, (num_pages + 1) * page_size, width, dtype=dtype, device=device)

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        n = self.num_layers if num_layers is None else num_layers
        return n * self.width * self.pool.element_size()

    def view(
        self, write_slots: torch.Tensor, read_slots: torch.Tensor, layer_offset: int = 0, valid: int | None = None
    ) -> BatchStore:
        """A forward's view. ``valid``: the number of leading read slots that matter (the rest are masked padding);
        when there is one request and those slots are consecutive, every layer reads its keys in place (see
        ``contiguous_start``) instead of gathering a copy of them."""
        start = None if valid is None else contiguous_start(read_slots, valid, self.pool.shape[1])
        return BatchStore(self.pool, write_slots, read_slots, layer_offset, start)


def contiguous_start(read_slots: torch.Tensor, valid: int, num_slots: int) -> int | None:
    """The first slot when read_slots [1, S] holds one request whose first ``valid`` slots are consecutive and the
    S slots from there stay inside the pool (the padding rows then read whatever follows, masked); else None.
    At depth this saves every layer a copy of the request's whole context (16k latent rows: 19 MB per layer)."""
    if read_slots.shape[0] != 1 or valid < 1:
        return None
    run = read_slots[0, :valid]
    start = int(run[0])
    if start + read_slots.shape[1] > num_slots or int(run[-1]) - start != valid - 1:
        return None
    return start if bool((run.diff() == 1).all()) else None


@dataclass(frozen=True)
class CachePools:
    """The target's pool and the drafter's (the same object when their page formats match)."""

    target: PagedPool
    draft: PagedPool | None
    draft_layer_offset: int  # first drafter layer in ``draft`` (L_t when shared, else 0)
    target_format: PageFormat
    draft_format: PageFormat | None

    @property
    def shared(self) -> bool:
        return self.draft is self.target

    @classmethod
    def build(
        cls,
        target: PageFormat,
        draft: PageFormat | None,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> CachePools:
        """One pool when ``draft`` is compatible with ``target`` (drafter layers after the target's), else two
        pools with the same pages. ``dtype`` applies to formats that leave it open."""
        shared = draft is not None and draft.compatible(target)
        n_target = target.num_layers + (draft.num_layers if shared and draft else 0)
        tpool = PagedPool(n_target, num_pages, page_size, target.width, target.dtype or dtype)
        if draft is None:
            return cls(tpool, None, 0, target, None)
        if shared:
            return cls(tpool, tpool, target.num_layers, target, draft)
        dpool = PagedPool(draft.num_layers, num_pages, page_size, draft.width, draft.dtype or dtype)
        return cls(tpool, dpool, 0, target, draft)

    def report(self) -> dict[str, int | str | bool]:
        """Bytes per token of each model's pages (the K3 pair shares 576-wide latent pages)."""
        n_draft = self.draft_format.num_layers if self.draft_format else 0
        draft_bpt = self.draft.bytes_per_token(n_draft) if self.draft is not None else 0
        pools = [self.target] if self.draft is None or self.shared else [self.target, self.draft]
        return {
            "target_page_kind": self.target_format.kind,
            "target_width": self.target.width,
            "draft_page_kind": self.draft_format.kind if self.draft_format else "",
            "draft_width": self.draft.width if self.draft is not None else 0,
            "shared_pool": self.shared,
            "page_size": self.target.page_size,
            "num_pages": self.target.num_pages,
            "target_bytes_per_token": self.target.bytes_per_token(self.target_format.num_layers),
            "draft_bytes_per_token": draft_bpt,
            "pool_bytes": sum(p.pool.numel() * p.pool.element_size() for p in pools),
        }

    def request_bytes(self, num_tokens: int, separate_draft_width: int) -> dict[str, int]:
        """Bytes one request of ``num_tokens`` tokens holds (whole pages): the target's latents, the drafter's latents
        (the same pages as the target's), and what the drafter would hold in a separate conventional cache of
        ``separate_draft_width`` values per token per layer (per-head K and V, no latent sharing)."""
        page = self.target.page_size
        slots = -(-num_tokens // page) * page  # the pages a request of num_tokens tokens owns, in token slots
        n_draft = self.draft_format.num_layers if self.draft_format else 0
        elem = self.draft.pool.element_size() if self.draft is not None else 0
        return {
            "request_tokens": num_tokens,
            "request_pages": slots // page,
            "request_target_bytes": slots * self.target.bytes_per_token(self.target_format.num_layers),
            "request_draft_bytes": slots * (self.draft.bytes_per_token(n_draft) if self.draft is not None else 0),
            "request_separate_draft_bytes": slots * n_draft * separate_draft_width * elem,
        }
