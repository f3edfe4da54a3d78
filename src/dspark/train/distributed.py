"""Drafter training under ``torchrun``: the process group (gloo on CPU, NCCL with CUDA), all-reduced sums, and a
clean exit from the group."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x


def init_distributed() -> Dist:
    """Join the torchrun process group (gloo on CPU) when WORLD_SIZE > 1; otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size())


def shutdown_distributed(synchronize: bool = True) -> None:
    """Leave the process group cleanly. The DDP reducer and gloo work objects must be gone first (collected
    here), and every rank past its last collective (the barrier): destroying a gloo group that still has live
    work, or leaving it to interpreter teardown, can abort the process ("terminate called without an active
    exception")."""
    import gc

    gc.collect()
    if synchronize:
        dist.barrier()
    dist.destroy_process_group()
