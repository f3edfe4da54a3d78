"""Recurrent-state slots beside the paged pool: one slot per running request holds a target's per-request state.

The pool is ``[num_layers, num_slots, *StateSpec.shape]`` (for KDA: every KDA layer's recurrent matrices and conv
tail, flat fp32). Nothing is written during a forward: a view collects the new states and ``commit`` installs them
once the step's outcome is known. Prefill commits the state after each request's last row. Verification of
``[anchor, d_1..d_L]`` keeps the state after every row (the chunkwise form yields them with no extra pass) and
``commit(rows)`` installs the state after the accepted prefix, so rejected drafts leave no trace and nothing is
recomputed. A preempted request gives its slot back and starts again from zeros when it is recomputed.

With prefix caching, pages alone cannot rebuild a recurrent state, so ``StateSnapshots`` keeps copies of states at
cached block boundaries (a bounded number, least recently used dropped first): a prefix hit restores the state at
its end into the request's slot, and a stateful target's hit reaches only as far as a snapshot does. The KV offload
tier stores a block's snapshot with its rows and saves it here again when it loads the block back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from dspark.models.protocol import StateSpec


class StatePool:
    def __init__(self, spec: StateSpec, num_slots: int) -> None:
        self.spec = spec
        self.states = torch.zeros(spec.num_layers, num_slots, *spec.shape, dtype=spec.dtype or torch.float32)
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner: dict[str, int] = {}

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_slots(self) -> int:
        return self.states.shape[1]

    @property
    def bytes_per_request(self) -> int:
        return self.states[:, 0].numel() * self.states.element_size()

    def acquire(self, request_id: str) -> int:
        """The request's slot, zeroed (a new request, or one recomputed after preemption)."""
        slot = self.owner.get(request_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"no free state slot for {request_id!r}: {self.num_slots} slots are all in use")
            slot = self.owner[request_id] = self.free.pop()
        self.states[:, slot] = 0
        return slot

    def restore(self, request_id: str, state: torch.Tensor) -> None:
        """The request's slot (acquired if needed) holding ``state`` [L, *shape] (a snapshot)."""
        self.states[:, self.acquire(request_id)] = state

    def release(self, request_id: str) -> None:
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def slots(self, request_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.owner[r] for r in request_ids], dtype=torch.long)

    def view(self, slots: torch.Tensor, keep_per_row: bool = False) -> SlotStates:
        return SlotStates(self, slots, keep_per_row)

    def report(self) -> dict[str, int]:
        return {"state_slots": self.num_slots, "state_bytes_per_request": self.bytes_per_request}


class SlotStates:
    """A batch's view of the pool (a ``StateStore``): reads the states of ``slots`` [B], collects new ones."""

    def __init__(self, pool: StatePool, slots: torch.Tensor, keep_per_row: bool) -> None:
        self.pool, self.slots, self.keep_per_row = pool, slots, keep_per_row
        self.final: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor] = {}

    def read(self, layer: int) -> torch.Tensor:
        return self.pool.states[layer, self.slots]

    def write(self, layer: int, final: torch.Tensor, per_row: torch.Tensor | None) -> None:
        self.final[layer] = final
        if self.keep_per_row:
            assert per_row is not None, "keep_per_row views need the state after every row"
            self.rows[layer] = per_row

    def after_row(self, b: int, row: int | None = None) -> torch.Tensor:
        """[L, *shape] a copy of batch row ``b``'s new state after its row ``row`` (None: its last valid row)."""
        layers = range(self.pool.num_layers)
        new = [self.final[layer][b] if row is None else self.rows[layer][b, row] for layer in layers]
        return torch.stack(new).to(self.pool.states.dtype).reshape(self.pool.states[:, 0].shape)

    def commit(self, rows: torch.Tensor | None = None, only: int | None = None) -> None:
        """Install per request b the state after its row ``rows[b]`` (0 = the first new row), or after its last
        valid row (rows None), in every layer; ``only``: just batch row ``only`` (the engine commits request by
        request, with each request's length)."""
        b = torch.arange(len(self.slots)) if only is None else torch.tensor([only])
        for layer, final in self.final.items():
            new = final[b] if rows is None else self.rows[layer][b, rows[b]]
            self.pool.states[layer, self.slots[b]] = new.to(self.pool.states.dtype)


class StateSnapshots:
    """Recurrent states at cached block boundaries, keyed by the block's hash: at most ``capacity`` of them, the
    least recently used (saved or restored) dropped first."""

    def __init__(self, pool: StatePool, capacity: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self._saved: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        # called with (block, state) when the capacity pushes a snapshot out while its block may still be cached:
        # the KV offload keeps the block with its state then, so a later hit can still end there
        self.on_capacity_drop: Callable[[bytes, torch.Tensor], None] | None = None

    def __contains__(self, block: bytes) -> bool:
        return block in self._saved

    def __len__(self) -> int:
        return len(self._saved)

    def save(self, block: bytes, state: torch.Tensor) -> bool:
        """Keep ``state`` [L, *shape] (a tensor of its own, e.g. ``SlotStates.after_row``: never a view of the pool)
        as the state after ``block``; False when one is kept already (or the capacity is 0)."""
        if self.capacity <= 0 or block in self._saved:
            return False
        while len(self._saved) >= self.capacity:
            old, old_state = self._saved.popitem(last=False)
            if self.on_capacity_drop is not None:
                self.on_capacity_drop(old, old_state)
        self._saved[block] = state
        return True

    def peek(self, block: bytes) -> torch.Tensor | None:
        """The state after ``block`` if one is kept (its recency unchanged: the offload tier copies it out)."""
        return self._saved.get(block)

    def restore(self, block: bytes, request_id: str) -> None:
        """Put the state after ``block`` in the request's slot."""
        self._saved.move_to_end(block)
        self.pool.restore(request_id, self._saved[block])

    def drop(self, block: bytes, page: int | None = None) -> None:
        """Forget the state after ``block`` (its page was evicted: a hit can no longer reach it)."""
        self._saved.pop(block, None)

    def report(self) -> dict[str, int]:
        return {
            "state_snapshots": len(self._saved),
            "max_state_snapshots": self.capacity,
            "state_snapshot_bytes": len(self._saved) * self.pool.bytes_per_request,
        }
