"""Recurrent-state slots beside the paged pool: one slot per running request holds every KDA layer's state.

A slot is ``[L_kda, K-1, 3·H·Dk]`` conv tails + ``[L_kda, H, Dk, Dv]`` fp32 recurrent matrices. Prefill and
plain decode write the state after each request's last row straight into its slot. Verification of
``[anchor, d_1..d_L]`` keeps the state after every row (the chunkwise form yields them with no extra pass) and
leaves the slots untouched; once acceptance is known, ``commit`` installs the state after the accepted prefix,
so rejected drafts leave no trace and nothing is recomputed. A preempted request gives its slot back and is
recomputed from zeros when it is scheduled again.
"""

from __future__ import annotations

import torch

from dspark.config import KDAConfig
from dspark.models.kda import KDAState


class StatePool:
    def __init__(self, kda: KDAConfig, num_layers: int, num_slots: int, dtype: torch.dtype) -> None:
        width = 3 * kda.num_heads * kda.head_dim
        self.num_layers = num_layers
        self.conv = torch.zeros(num_layers, num_slots, kda.conv_kernel_size - 1, width, dtype=dtype)
        self.recurrent = torch.zeros(num_layers, num_slots, kda.num_heads, kda.head_dim, kda.head_dim)
        self.free = list(range(num_slots - 1, -1, -1))
        self.owner: dict[str, int] = {}

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def bytes_per_request(self) -> int:
        """State bytes of one request over every KDA layer (recurrent matrices fp32 + conv tails)."""
        per_slot = self.conv[:, 0].numel() * self.conv.element_size()
        return per_slot + self.recurrent[:, 0].numel() * self.recurrent.element_size()

    def acquire(self, request_id: str) -> int:
        """The request's slot, zeroed (a new request, or one recomputed after preemption)."""
        slot = self.owner.get(request_id)
        if slot is None:
            if not self.free:
                raise RuntimeError(f"no free state slot for {request_id!r}: {self.num_slots} slots are all in use")
            slot = self.owner[request_id] = self.free.pop()
        self.conv[:, slot] = 0
        self.recurrent[:, slot] = 0
        return slot

    def release(self, request_id: str) -> None:
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)

    def slots(self, request_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.owner[r] for r in request_ids], dtype=torch.long)

    def view(self, slots: torch.Tensor, keep_per_row: bool = False) -> SlotStates:
        return SlotStates(self, slots, keep_per_row)


class SlotStates:
    """A batch's view of the pool (a ``StateStore``): reads/writes the states of ``slots`` [B]."""

    def __init__(self, pool: StatePool, slots: torch.Tensor, keep_per_row: bool) -> None:
        self.pool, self.slots, self.keep_per_row = pool, slots, keep_per_row
        self.rows: dict[int, KDAState] = {}

    def read(self, layer: int) -> KDAState:
        return KDAState(self.pool.conv[layer, self.slots], self.pool.recurrent[layer, self.slots])

    def write(self, layer: int, final: KDAState, per_row: KDAState | None) -> None:
        if self.keep_per_row:
            assert per_row is not None, "keep_per_row views need the state after every row"
            self.rows[layer] = per_row  # installed by commit() once acceptance is known
            return
        self._install(layer, final)

    def _install(self, layer: int, state: KDAState) -> None:
        self.pool.conv[layer, self.slots] = state.conv.to(self.pool.conv.dtype)
        self.pool.recurrent[layer, self.slots] = state.recurrent.float()

    def commit(self, rows: torch.Tensor) -> None:
        """Install, per request b, the state after its row ``rows[b]`` (0 = the anchor alone) in every layer."""
        b = torch.arange(len(self.slots))
        for layer, per_row in self.rows.items():
            self._install(layer, KDAState(per_row.conv[b, rows], per_row.recurrent[b, rows]))
        self.rows.clear()
