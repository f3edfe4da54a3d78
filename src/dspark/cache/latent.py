"""Latent KV storage: one paged pool of (kv_lora_rank + rope dim)-wide rows shared by target and drafter.

The pool is ``[num_layers, num_slots, W]`` where layers 0..L_t-1 are the target's MLA layers and
L_t..L_t+L_d-1 the drafter's. A request owns pages (via the pure-Python allocator); slot
``page * page_size + offset`` holds position ``page_index * page_size + offset`` for every layer, so target
and drafter share one block table per request. The last page is a scratch page that absorbs the writes of
padding rows. Rollback is setting a request's length: stale rows are overwritten later and masked until then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchStore:
    """A per-forward view of the pool: where to write the new rows and which rows to read (a LatentStore)."""

    pool: torch.Tensor  # [L, N_slots, W]
    write_slots: torch.Tensor  # [B, T] flat slot per new row (padding rows → scratch slots)
    read_slots: torch.Tensor  # [B, S] flat slot per visible key position (padding → any slot, masked)
    layer_offset: int = 0

    def write(self, layer: int, latent: torch.Tensor) -> None:
        """Store latent [B, T, W] at the write slots of ``layer``."""
        cache = self.pool[self.layer_offset + layer]
        cache.index_copy_(0, self.write_slots.reshape(-1), latent.reshape(-1, latent.shape[-1]).to(cache.dtype))

    def read(self, layer: int) -> torch.Tensor:
        """The rows at the read slots of ``layer``: [B, S, W]."""
        return self.pool[self.layer_offset + layer][self.read_slots]

    def update(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """latent [B, T, W] → keys [B, S, W] after writing the new rows."""
        self.write(layer, latent)
        return self.read(layer)


class PagedLatentPool:
    """The tensor side of the paged cache (the allocator/block tables are in ``allocator.py``)."""

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, width: int, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages  # usable pages; one extra scratch page follows them
        self.page_size = page_size
        self.width = width
        self.dtype = dtype
        self.pool = torch.zeros(num_layers, (num_pages + 1) * page_size, width, dtype=dtype)

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        n = self.num_layers if num_layers is None else num_layers
        return n * self.width * self.pool.element_size()

    def view(self, write_slots: torch.Tensor, read_slots: torch.Tensor, layer_offset: int = 0) -> BatchStore:
        return BatchStore(self.pool, write_slots, read_slots, layer_offset)


def slots_tensor(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Ragged per-request slot lists → [B, max_len] LongTensor padded with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out
