"""The run loop every trainer shares (DeepSpec's base trainer, as one class): stop rules, the learning-rate
schedule, the time-derived cosine horizon, evaluation and checkpoint intervals, the final evaluation, checkpoint
and export. ``TargetTrainer`` (``pretrain.py``) and ``DraftTrainer`` (``trainer.py``) implement only what differs:
one optimizer step and its bookkeeping, evaluation, saving and exporting. The helpers both use around a step live
here too: the schedule (``lr_at``), bf16 autocast and the training thread count; checkpoint I/O is in
``checkpoint.py``.

Stop rules, checked before every step: ``max_steps`` reached, the wall-clock budget ``max_minutes`` spent (across
resumes; under DDP every rank stops at the same step), or ``halt_at_step`` (checkpoint, no final evaluation or
export: an interruption for tests and for resuming elsewhere).

Time mode (no step horizon configured): the cosine horizon is derived after ``probe_steps`` timed steps, still
inside the warmup, so the schedule already run does not depend on it; then re-estimated every ``horizon_interval``
steps from the recent step time, evaluation and checkpoint costs amortised over their intervals, the final
evaluation + checkpoint reserved and a 3 % margin kept. Rank 0 decides for every rank. The horizon is saved with
the checkpoint, so a resume continues the same schedule.
"""

from __future__ import annotations

import math
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from dspark.device import autocast
from dspark.train.checkpoint import checkpoint_path

HORIZON_MARGIN = 0.97  # fraction of the remaining budget a derived horizon plans to use

StepOut = TypeVar("StepOut")


def warmup_cosine(step: int, lr: float, warmup: int, max_steps: int | None, min_lr_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to lr·min_lr_ratio at
    ``max_steps``. ``max_steps`` None (a timed run still probing its speed, inside the warmup): the peak."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if max_steps is None:
        return lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ScheduleConfig(Protocol):
    """What the learning-rate schedule reads from a training config."""

    @property
    def lr(self) -> float: ...
    @property
    def min_lr_ratio(self) -> float: ...
    def warmup_for(self, max_steps: int | None) -> int: ...


def lr_at(step: int, cfg: ScheduleConfig, max_steps: int | None) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to lr·min_lr_ratio.
    ``max_steps`` is None only while a timed run is still probing its speed (inside the warmup)."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_for(max_steps), max_steps, cfg.min_lr_ratio)


def bf16_autocast(enabled: bool, device: torch.device | str = "cpu") -> torch.autocast:
    """The bf16 autocast region of training forwards on ``device`` (a no-op when not ``enabled``)."""
    return autocast(device, enabled)


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` (None: min(2, cpu count)) for the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or max(1, min(2, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LoopConfig(ScheduleConfig, Protocol):
    """The fields of a training config the shared loop reads (PretrainConfig and DraftTrainConfig have them)."""

    @property
    def out_dir(self) -> str: ...
    @property
    def time_mode(self) -> bool: ...  # the horizon is derived from max_minutes
    @property
    def max_minutes(self) -> float | None: ...
    @property
    def probe_steps(self) -> int: ...
    @property
    def horizon_interval(self) -> int: ...
    @property
    def eval_interval(self) -> int: ...
    @property
    def ckpt_interval(self) -> int: ...
    @property
    def halt_at_step(self) -> int | None: ...
    @property
    def progress(self) -> bool: ...


class TrainLoop(ABC, Generic[StepOut]):
    """One training run. Subclasses own ``step``, ``max_steps`` and ``elapsed_s`` (they live in the checkpoint)
    and implement the hooks below; ``run()`` drives them."""

    cfg: LoopConfig
    step: int
    max_steps: int | None
    elapsed_s: float  # wall clock of the whole run, all sessions
    master: bool = True  # rank 0: saves, exports and prints
    eval_at_start: bool = False  # evaluate once before the first step

    # ---- what a trainer implements -------------------------------------------------------------------------
    @abstractmethod
    def run_step(self) -> StepOut:
        """Optimizer step ``self.step`` (learning rate from the schedule); advances ``self.step``."""

    @abstractmethod
    def record(self, out: StepOut, dt: float) -> None:
        """Bookkeeping of a finished step that took ``dt`` seconds (logs, progress)."""

    @abstractmethod
    def run_evaluation(self) -> None:
        """Evaluate and record the result at ``self.step``."""

    @abstractmethod
    def last_eval_step(self) -> int | None: ...

    @abstractmethod
    def save(self) -> None:
        """Write the checkpoint (rank 0 only)."""

    @abstractmethod
    def export(self, stopped_by: str) -> Path:
        """Write the final model directory (rank 0 only)."""

    def warmup_steps(self) -> int:
        """Warmup steps of the schedule at the current horizon (the config's ``warmup_for``)."""
        return self.cfg.warmup_for(self.max_steps)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on any (DDP: an all-reduce)."""
        return flag

    def agree(self, value: int) -> int:
        """Rank 0's value on every rank (DDP: a broadcast)."""
        return value

    def on_horizon(self, step_s: float, old: int | None) -> None:
        """A (re-)derived horizon ``self.max_steps`` from ``step_s`` seconds per step: say so when it moved."""
        assert self.max_steps is not None
        if old is None or abs(self.max_steps - old) > 0.02 * old:
            self.say(f"step {self.step}: {step_s:.3f} s/step -> cosine horizon max_steps={self.max_steps}")

    def finish_logs(self) -> None:
        """Flush partial logging windows before the final evaluation."""

    def barrier(self) -> None: ...

    # ---- the loop ---------------------------------------------------------------------------------------------
    def apply_lr(self, optimizer: torch.optim.Optimizer) -> float:
        """Set the schedule's learning rate of step ``self.step`` on every parameter group; returns it."""
        lr = lr_at(self.step, self.cfg, self.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def say(self, msg: str) -> None:
        if self.cfg.progress and self.master:
            tqdm.write(msg, file=sys.stderr)

    @property
    def checkpoint(self) -> Path:
        return checkpoint_path(self.cfg.out_dir)

    def elapsed(self) -> float:
        return self._elapsed_before + time.perf_counter() - self._session_start

    def run(self) -> str:
        """Train until a stop rule fires; then the final evaluation, checkpoint and export. Returns what stopped
        it: "max_steps" | "time_budget" | "halt"."""
        self._session_start, self._elapsed_before = time.perf_counter(), self.elapsed_s
        self.eval_s = self.ckpt_s = self.session_train_s = 0.0
        self.session_steps = 0
        self.step_times: list[float] = []
        self.export_dir: Path | None = None
        if self.eval_at_start and self.step == 0:
            self._evaluate()
        stopped_by = self._train()
        self._finish(stopped_by)
        return stopped_by

    def _train(self) -> str:
        cfg = self.cfg
        while self.max_steps is None or self.step < self.max_steps:
            if self.any_rank(cfg.max_minutes is not None and self.elapsed() >= cfg.max_minutes * 60.0):
                return "time_budget"
            if cfg.halt_at_step is not None and self.step >= cfg.halt_at_step:
                return "halt"
            t0 = time.perf_counter()
            out = self.run_step()
            dt = time.perf_counter() - t0
            self.session_train_s += dt
            self.session_steps += 1
            self.step_times.append(dt)
            self._update_horizon()
            self.record(out, dt)
            done = self.max_steps is not None and self.step >= self.max_steps
            if self.step % cfg.eval_interval == 0 and not done:
                self._evaluate()
            if self.step % cfg.ckpt_interval == 0:
                self._save()
        return "max_steps"

    def _finish(self, stopped_by: str) -> None:
        self.finish_logs()
        if stopped_by != "halt" and self.last_eval_step() != self.step:
            self._evaluate()
        self.elapsed_s = self.elapsed()
        if self.master:
            self.save()
            if stopped_by != "halt":
                self.export_dir = self.export(stopped_by)
        self.barrier()

    def _evaluate(self) -> None:
        t0 = time.perf_counter()
        self.run_evaluation()
        self.eval_s = time.perf_counter() - t0

    def _save(self) -> None:
        t0 = time.perf_counter()
        self.elapsed_s = self.elapsed()
        if self.master:
            self.save()
        self.ckpt_s = time.perf_counter() - t0

    # ---- the time-derived horizon -------------------------------------------------------------------------------
    def _update_horizon(self) -> None:
        cfg = self.cfg
        if not cfg.time_mode:
            return
        n = len(self.step_times)
        first = self.max_steps is None and (n >= cfg.probe_steps or self.step >= self.warmup_steps())
        later = self.max_steps is not None and self.step % cfg.horizon_interval == 0 and n >= cfg.probe_steps
        if not (first or later):
            return
        recent = self.step_times[-cfg.horizon_interval :]
        step_s = float(np.median((recent[1:] if first else recent) or recent))  # the first step pays warm-up
        old = self.max_steps
        self.max_steps = self.agree(self.derive_max_steps(step_s))
        self.on_horizon(step_s, old)

    def derive_max_steps(self, step_s: float) -> int:
        """Steps that fit the remaining budget: evaluation and checkpoint time amortised over their intervals, the
        final evaluation + checkpoint + export reserved, and a margin."""
        cfg = self.cfg
        assert cfg.max_minutes is not None
        remaining = cfg.max_minutes * 60.0 - self.elapsed() - (self.eval_s + 2 * self.ckpt_s)
        per_step = step_s + self.eval_s / cfg.eval_interval + self.ckpt_s / cfg.ckpt_interval
        planned = self.step + int(HORIZON_MARGIN * max(0.0, remaining) / per_step)
        return max(self.warmup_steps() + 1, self.step + 1, planned)
