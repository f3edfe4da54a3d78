"""The shared training loop (dspark.train.loop): stop rules, evaluation/checkpoint intervals, the final
evaluation + checkpoint + export, and the time-derived horizon, on a stand-in trainer with a fake clock; both real
trainers run on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import dspark.train.loop as loop
from dspark.train.loop import TrainLoop, warmup_cosine


@dataclass(frozen=True)
class Cfg:
    out_dir: str = "unused"
    max_steps: int | None = 10
    max_minutes: float | None = None
    probe_steps: int = 3
    horizon_interval: int = 4
    eval_interval: int = 4
    ckpt_interval: int = 3
    halt_at_step: int | None = None
    progress: bool = False

    @property
    def time_mode(self) -> bool:
        return self.max_steps is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Toy(TrainLoop[int]):
    """Each step costs step_s seconds of the fake clock, an evaluation eval_s, a checkpoint ckpt_s."""

    def __init__(self, cfg: Cfg, clock: Clock, step_s: float = 1.0, eval_s: float = 0.0, ckpt_s: float = 0.0):
        self.cfg, self.clock = cfg, clock
        self.step, self.max_steps, self.elapsed_s = 0, cfg.max_steps, 0.0
        self.costs = (step_s, eval_s, ckpt_s)
        self.events: list[tuple[str, int]] = []
        self.horizons: list[tuple[int, int | None]] = []

    def run_step(self) -> int:
        self.clock.now += self.costs[0]
        self.step += 1
        return self.step

    def record(self, out: int, dt: float) -> None:
        assert out == self.step and dt == self.costs[0]

    def run_evaluation(self) -> None:
        self.clock.now += self.costs[1]
        self.events.append(("eval", self.step))

    def last_eval_step(self) -> int | None:
        evals = [s for e, s in self.events if e == "eval"]
        return evals[-1] if evals else None

    def save(self) -> None:
        self.clock.now += self.costs[2]
        self.events.append(("save", self.step))

    def export(self, stopped_by: str) -> Path:
        self.events.append(("export", self.step))
        return Path("export")

    def warmup_steps(self) -> int:
        return 5

    def on_horizon(self, step_s: float, old: int | None) -> None:
        self.horizons.append((self.step, self.max_steps))


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(loop.time, "perf_counter", c.perf_counter)
    return c


def test_intervals_then_final_eval_checkpoint_and_export(clock):
    toy = Toy(Cfg(), clock)
    assert toy.run() == "max_steps" and toy.step == 10
    # evaluation every 4 steps (none inside the loop at the last step), checkpoints every 3, then the final
    # evaluation, checkpoint and export
    assert toy.events == [
        ("save", 3), ("eval", 4), ("save", 6), ("eval", 8), ("save", 9), ("eval", 10), ("save", 10), ("export", 10)
    ]  # fmt: skip
    assert toy.elapsed_s == 10.0 and toy.export_dir == Path("export")


def test_halt_saves_without_final_eval_or_export_and_resume_continues(clock):
    toy = Toy(Cfg(halt_at_step=5), clock)
    assert toy.run() == "halt" and toy.step == 5
    assert toy.events[-1] == ("save", 5) and ("export", 5) not in toy.events and toy.export_dir is None
    resumed = Toy(Cfg(), clock)
    resumed.step, resumed.elapsed_s = 5, toy.elapsed_s
    assert resumed.run() == "max_steps" and resumed.step == 10 and resumed.elapsed_s == 10.0


def test_time_budget_stops_and_the_horizon_is_derived_then_re_derived(clock):
    cfg = Cfg(max_steps=None, max_minutes=1.0)  # 60 s budget, 1 s per step
    toy = Toy(cfg, clock, step_s=1.0, eval_s=2.0, ckpt_s=0.5)
    stopped = toy.run()
    # first horizon after probe_steps (3) timed steps, before any evaluation or checkpoint: 3 + 0.97 · (60 − 3) / 1
    assert toy.horizons[0] == (3, 3 + int(0.97 * 57))
    # re-derived every 4 steps with the costs seen so far amortised and the final eval + checkpoint reserved;
    # at step 4: 4 s of steps + the checkpoint at 3 (0.5 s) spent, no evaluation yet
    assert toy.horizons[1] == (4, 4 + int(0.97 * (60 - 4.5 - 2 * 0.5) / (1 + 0.5 / 3)))
    # at step 8: 8 s of steps + the evaluation at 4 (2 s) + checkpoints at 3 and 6 spent
    assert toy.horizons[2] == (8, 8 + int(0.97 * (60 - 11.0 - (2.0 + 2 * 0.5)) / (1 + 2.0 / 4 + 0.5 / 3)))
    assert all(s % cfg.horizon_interval == 0 for s, _ in toy.horizons[1:]) and len(toy.horizons) > 3
    assert stopped in ("max_steps", "time_budget") and toy.elapsed_s <= 60.0 + 1.0 + 2.0 + 0.5
    assert toy.events[-1][0] == "export"


def test_warmup_cosine_schedule():
    lrs = [warmup_cosine(s, 1.0, 10, 110, 0.1) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5) and lrs[110] == pytest.approx(0.1)
    assert warmup_cosine(50, 1.0, 10, None, 0.1) == 1.0  # horizon unknown: the peak


def test_both_trainers_run_on_the_shared_loop():
    from dspark.train.pretrain import TargetTrainer
    from dspark.train.trainer import DraftTrainer

    assert issubclass(TargetTrainer, TrainLoop) and issubclass(DraftTrainer, TrainLoop)
    for cls in (TargetTrainer, DraftTrainer):
        assert "_train" not in vars(cls) and "_finish" not in vars(cls)  # the loop itself is not overridden
