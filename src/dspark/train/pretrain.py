"""Pretrain a small K3-style MLA target (DeepSeek-V3 HF format: MLA + MoE with a shared expert) on CPU.

The MLA keeps K3's latent geometry — kv_lora_rank 512 + qk_rope_head_dim 64 = 576 cached values per token
per layer, qk_nope_head_dim 128, v_head_dim 128 — so its cache pages have the K3 layout; everything else is
deep and narrow so a 2–3 layer drafter pass stays a small fraction of a target forward.

Training: random windows of ``seq_len + 1`` tokens from the uint16 train array (a seeded numpy PCG64 whose
state is checkpointed), fp32 parameters with bf16 autocast, AdamW, linear warmup then cosine decay, gradient
clipping, the DeepSeek aux-loss-free router-bias nudge, validation perplexity, atomic checkpoints
(``out_dir/checkpoint/last.pt``) that resume bit-exactly, and a final export (``out_dir/export``: config.json,
model.safetensors, tokenizer files, training_log.json).

When ``max_steps`` is None the cosine horizon comes from ``max_minutes``: first after ``probe_steps`` timed
steps (still inside the warmup, so the schedule already run does not depend on it), then re-estimated every
``horizon_interval`` steps from the recent step time, so the decay ends on time on a machine whose speed
changes. The horizon is part of the checkpoint, so a resume continues the same schedule. ``max_minutes``
also stops training (checkpoint + export) when the wall clock runs out. With ``max_steps`` set the
schedule is fixed and a resumed run is bit-identical to an uninterrupted one.

The loop (stop rules, the horizon, evaluation/checkpoint intervals, export) is ``dspark.train.loop.TrainLoop``,
shared with the drafter trainer; ``TargetTrainer`` implements its hooks. The run's settings and the model recipes
are in ``pretrain_config.py``, the token windows in ``pretrain_data.py``, checkpoint I/O in ``checkpoint.py``.

Usage: ``dspark train-target --data-dir runs/data/bpe8k --out-dir runs/target --max-minutes 55 [--resume]``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from dspark.config import POSITION_KEYS
from dspark.models.families import family_of
from dspark.models.k3 import K3MoE
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.target import MLATarget, MoE, MoEGate
from dspark.train.checkpoint import (
    EXPORT_DIR,
    TRAINING_LOG,
    check_same_settings,
    fresh_or_resume,
    read_checkpoint,
    write_checkpoint,
)
from dspark.train.loop import TrainLoop, bf16_autocast, torch_threads
from dspark.train.pretrain_config import SHAPE_FIELDS, PretrainConfig
from dspark.train.pretrain_data import TokenWindows, load_split, resolve_vocab_size, validation_windows

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------------------------------------
# model and optimiser
# --------------------------------------------------------------------------------------------------------


def build_target(cfg: PretrainConfig, vocab_size: int) -> MLATarget | KimiLinearTarget:
    tcfg = cfg.target_config(vocab_size)
    return family_of(tcfg).build(tcfg)


def init_from_model_dir(model: nn.Module, source: str | Path, data_dir: str | Path) -> list[str]:
    """Copy a saved target's weights into ``model`` (continued pre-training). Every config key but the position
    keys must match, and so must the tokenizer when both directories ship one. Returns the position keys that
    changed ("rope_parameters: {...} -> {...}")."""
    from dspark.models.loading import load_target

    src = Path(source)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"--init-from {src}: no config.json; give an exported target directory")
    ours_tok, theirs_tok = Path(data_dir) / "tokenizer.json", src / "tokenizer.json"
    if ours_tok.is_file() and theirs_tok.is_file() and ours_tok.read_bytes() != theirs_tok.read_bytes():
        raise ValueError(
            f"--init-from {src}: its tokenizer.json differs from {ours_tok}; continue on data tokenized with the "
            "model's own tokenizer"
        )
    loaded = load_target(src, "float32")
    ours, theirs = model.config.to_hf_dict(), loaded.config.to_hf_dict()
    diffs = [k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)]
    shape = [f"{k}: {theirs.get(k)!r} there vs {ours.get(k)!r} here" for k in sorted(diffs) if k not in POSITION_KEYS]
    if shape:
        raise ValueError(f"--init-from {src}: a different model ({'; '.join(shape)}); use the same shape settings")
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()})
    return [f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in sorted(diffs)]


def init_weights(model: MLATarget | KimiLinearTarget, std: float, generator: torch.Generator) -> None:
    """N(0, std) for every matrix, std/sqrt(2L) for the residual-branch outputs (o_proj, down_proj), ones for
    norms, zero router bias. KDA: short convs start as the identity plus N(0, std) noise, A_log 0 and dt_bias
    spread over [−5, −1.5] so the K3 gate (−5·σ(·)) starts with per-channel decays between e^−0.03 and e^−0.9."""
    resid_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.uniform_(-5.0, -1.5, generator=generator)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, std, generator=generator)
                p[..., -1] += 1.0  # the last tap reads the current row
            elif p.ndim == 1:
                p.fill_(1.0)  # RMSNorm weights
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


def build_optimizer(model: nn.Module, cfg: PretrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights are exempt)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=True)


class RouterLoad:
    """Counts tokens per routed expert in every MoE gate during training forwards (for the bias nudge)."""

    def __init__(self, model: MLATarget) -> None:
        self.gates: list[MoEGate] = [m for m in model.modules() if isinstance(m, MoEGate)]
        self.counts = [torch.zeros(g.weight.shape[0], dtype=torch.int64) for g in self.gates]
        self.active = False
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if self.active:
                self.counts[i] += torch.bincount(output[0].flatten(), minlength=self.counts[i].numel())

        return hook

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def nudge(self, rate: float) -> float:
        """DeepSeek aux-loss-free balancing: bias_e += rate·sign(mean load − load_e); resets the counts.
        Returns the mean over layers of max load / mean load (1.0 = balanced)."""
        imbalance = []
        with torch.no_grad():
            for gate, counts in zip(self.gates, self.counts):
                c = counts.double()
                mean = c.mean()
                if mean > 0:
                    imbalance.append(float(c.max() / mean))
                bias = gate.e_score_correction_bias
                if rate > 0 and bias is not None:
                    bias += rate * torch.sign(mean - c).to(bias.dtype)
                counts.zero_()
        return float(np.mean(imbalance)) if imbalance else 1.0


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total parameters, parameters active per token: routed experts counted top-k of n)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for module in model.modules():
        if isinstance(module, MoE | K3MoE):
            n, k = len(module.experts), module.gate.cfg.num_experts_per_tok
            inactive += (n - k) * sum(p.numel() for p in module.experts[0].parameters())
    return total, total - inactive


# --------------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------------


@dataclass
class _RunState:
    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0  # wall clock spent training (all sessions)
    train_s: float = 0.0  # wall clock inside training steps only
    max_steps: int | None = None
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    router_imbalance: list[tuple[int, float]] = field(default_factory=list)
    horizons: list[tuple[int, int]] = field(default_factory=list)  # (step, max_steps) decisions


# --------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    wall_clock_s: float
    tokens_per_s: float
    final_train_loss: float
    val_loss: float | None
    val_ppl: float | None
    stopped_by: str  # "max_steps" | "time_budget" | "halt"
    max_steps: int
    num_params: int
    active_params: int
    checkpoint: str
    export_dir: str | None
    losses: tuple[float, ...]  # per-step training loss of this session


@torch.no_grad()
def evaluate(model: MLATarget, windows: torch.Tensor, cfg: PretrainConfig) -> tuple[float, torch.Tensor]:
    """Next-token cross-entropy over the windows [N, T+1] (same autocast as training) → (mean loss, mean loss at
    each of the T positions [T])."""
    was_training = model.training
    model.eval()
    per_position = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for i in range(0, windows.shape[0], cfg.batch_size):
        batch = windows[i : i + cfg.batch_size]
        with bf16_autocast(cfg.autocast_bf16):
            logits = model(batch[:, :-1], absorbed=False).logits
        loss = F.cross_entropy(logits.transpose(1, 2).float(), batch[:, 1:], reduction="none")  # [b, T]
        per_position += loss.double().sum(0)
    model.train(was_training)
    per_position /= windows.shape[0]
    return float(per_position.mean()), per_position


def position_buckets(length: int, first: int) -> list[tuple[int, int]]:
    """[start, end) position buckets over ``length`` positions: [0, first), then doubling ([first, 2·first), …)."""
    edges = [0]
    while edges[-1] < length:
        edges.append(min(length, first if edges[-1] == 0 else 2 * edges[-1]))
    return list(zip(edges[:-1], edges[1:]))


def bucketed_ppl(per_position: torch.Tensor, first: int) -> dict[str, float]:
    """Perplexity per position bucket ("0-511": ppl, …) of per-position mean losses."""
    return {
        f"{a}-{b - 1}": round(math.exp(float(per_position[a:b].mean())), 3)
        for a, b in position_buckets(per_position.numel(), first)
    }


def train_step(model: MLATarget, batch: torch.Tensor, cfg: PretrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward on batch [B, T+1]; returns (loss, grad norm before clipping)."""
    with bf16_autocast(cfg.autocast_bf16):
        logits = model(batch[:, :-1], absorbed=False).logits  # [B, T, V] fp32
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    return loss.detach(), grad_norm


def _write_training_log(path: Path, cfg: PretrainConfig, model: MLATarget, state: _RunState, extra: dict) -> None:
    total, active = count_params(model)
    log = {
        "steps": state.step,
        "max_steps": state.max_steps,
        "tokens": state.tokens,
        "wall_clock_s": round(state.elapsed_s, 1),
        "train_s": round(state.train_s, 1),
        "tokens_per_s": round(state.tokens / state.train_s, 1) if state.train_s else None,
        "num_params": total,
        "active_params": active,
        "train_loss": [[s, round(v, 5)] for s, v in state.train_loss],
        "val": state.val,
        "router_imbalance": [[s, round(v, 4)] for s, v in state.router_imbalance],
        "horizons": [list(x) for x in state.horizons],
        "pretrain_config": cfg.to_dict(),
        "target_config": model.config.to_hf_dict(),
    } | extra
    path.write_text(json.dumps(log, indent=2) + "\n")


def export_model(model: MLATarget, cfg: PretrainConfig, state: _RunState, extra: dict) -> Path:
    """out_dir/export: config.json, model.safetensors (export_dtype), tokenizer files, training_log.json."""
    out = Path(cfg.out_dir) / EXPORT_DIR
    family_of(model.config).save(model, out, dtype=cfg.export_dtype)
    for name in TOKENIZER_FILES:
        src = Path(cfg.data_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    tok_cfg = out / "tokenizer_config.json"
    if tok_cfg.is_file():  # the tokenizer's length limit follows the model's (a YaRN extension raises it)
        d = json.loads(tok_cfg.read_text())
        if "model_max_length" in d:
            d["model_max_length"] = model.config.max_position_embeddings
            tok_cfg.write_text(json.dumps(d, indent=2) + "\n")
    _write_training_log(out / TRAINING_LOG, cfg, model, state, extra)
    return out


def train_target(cfg: PretrainConfig, resume: bool = False) -> TrainResult:
    """Train (or resume) a target as configured; returns what happened. See the module docstring.

    Raises FileExistsError when out_dir already holds a checkpoint and ``resume`` is False."""
    with torch_threads(cfg.num_threads):
        trainer = TargetTrainer(cfg, resume)
        stopped_by = trainer.run()
        return trainer.result(stopped_by)


class _StepOut(NamedTuple):
    loss: float
    grad_norm: float
    lr: float
    imbalance: float


class TargetTrainer(TrainLoop[_StepOut]):
    """Pretraining on the shared loop: random windows, AdamW, the router-bias nudge, validation perplexity."""

    eval_at_start = True

    def __init__(self, cfg: PretrainConfig, resume: bool) -> None:
        ckpt = fresh_or_resume(cfg.out_dir, resume)
        data_dir = Path(cfg.data_dir)
        self.cfg = cfg = replace(cfg, vocab_size=resolve_vocab_size(cfg))
        assert cfg.vocab_size is not None
        train_tokens = load_split(data_dir, "train")
        self.val = validation_windows(
            load_split(data_dir, "validation"), cfg.eval_seq_len or cfg.seq_len, cfg.eval_max_windows
        )
        if int(train_tokens.max()) >= cfg.vocab_size:
            raise ValueError(
                f"{data_dir}/train.npy has token id {int(train_tokens.max())} >= vocab_size={cfg.vocab_size}"
            )
        torch.manual_seed(cfg.seed)
        self.model = build_target(cfg, cfg.vocab_size)
        init_weights(self.model, cfg.init_std, torch.Generator().manual_seed(cfg.seed))
        if cfg.init_from is not None and not resume:
            changed = init_from_model_dir(self.model, cfg.init_from, data_dir)
            self.say(f"train-target: weights from {cfg.init_from}" + "".join(f"; {c}" for c in changed))
        self.model.train()
        self.opt = build_optimizer(self.model, cfg)
        self.loader = TokenWindows(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
        self.state = _RunState(max_steps=cfg.max_steps)
        if resume:
            self._resume(ckpt)
        self.router = RouterLoad(self.model)
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.losses: list[float] = []
        self.window: list[float] = []
        self.total_params, self.active_params = count_params(self.model)
        self.say(
            f"train-target: {self.total_params / 1e6:.2f}M params ({self.active_params / 1e6:.2f}M active), "
            f"{cfg.num_hidden_layers} layers, d={cfg.hidden_size}, {len(train_tokens):,} train tokens, "
            f"{'resuming at step ' + str(self.step) if resume else 'fresh start'}"
        )

    def _resume(self, ckpt: Path) -> None:
        blob = read_checkpoint(ckpt)
        shape = SHAPE_FIELDS + ("seq_len", "vocab_size")  # the model and the data must be the same
        check_same_settings(ckpt, blob["pretrain_config"], self.cfg, shape, "a different model/data shape")
        self.model.load_state_dict(blob["model"])
        self.opt.load_state_dict(blob["optimizer"])
        self.loader.load_state_dict(blob["loader"])
        torch.set_rng_state(blob["torch_rng"])
        run = blob["run"]
        self.state = _RunState(
            step=run["step"],
            tokens=run["tokens"],
            elapsed_s=run["elapsed_s"],
            train_s=run["train_s"],
            max_steps=run["max_steps"] if self.cfg.max_steps is None else self.cfg.max_steps,
            train_loss=[tuple(x) for x in run["train_loss"]],
            val=list(run["val"]),
            router_imbalance=[tuple(x) for x in run["router_imbalance"]],
            horizons=[tuple(x) for x in run.get("horizons", [])],
        )

    # step, horizon and wall clock live in the checkpointed run state
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def max_steps(self) -> int | None:
        return self.state.max_steps

    @max_steps.setter
    def max_steps(self, value: int | None) -> None:
        self.state.max_steps = value

    @property
    def elapsed_s(self) -> float:
        return self.state.elapsed_s

    @elapsed_s.setter
    def elapsed_s(self, value: float) -> None:
        self.state.elapsed_s = value

    # ---- the loop's hooks ----------------------------------------------------------------------------------------
    def run(self) -> str:
        interactive = sys.stderr.isatty()
        self.bar = tqdm(
            total=self.max_steps,
            initial=self.step,
            disable=not self.cfg.progress,
            mininterval=1.0 if interactive else 30.0,
            dynamic_ncols=True,
            unit="step",
            file=sys.stderr,
        )
        try:
            return super().run()
        finally:
            self.bar.close()

    def run_step(self) -> _StepOut:
        lr = self.apply_lr(self.opt)
        batch = self.loader.next_batch()
        with self.router.recording():
            loss, grad_norm = train_step(self.model, batch, self.cfg)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        imbalance = self.router.nudge(self.cfg.router_bias_update)
        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        return _StepOut(float(loss), float(grad_norm), lr, imbalance)

    def record(self, out: _StepOut, dt: float) -> None:
        self.state.train_s += dt
        self.losses.append(out.loss)
        self.window.append(out.loss)
        if self.step % self.cfg.log_interval == 0:
            self.state.train_loss.append((self.step, float(np.mean(self.window))))
            self.state.router_imbalance.append((self.step, out.imbalance))
            self.window = []
        self.bar.update(1)
        tok_s = self.session_steps * self.tokens_per_step / self.session_train_s
        postfix = {
            "loss": f"{out.loss:.3f}",
            "lr": f"{out.lr:.2e}",
            "gn": f"{out.grad_norm:.2f}",
            "tok_s": f"{tok_s:.0f}",
        }
        self.bar.set_postfix(postfix, refresh=False)

    def on_horizon(self, step_s: float, old: int | None) -> None:
        assert self.max_steps is not None
        self.state.horizons.append((self.step, self.max_steps))
        self.bar.total = self.max_steps
        super().on_horizon(step_s, old)

    def run_evaluation(self) -> None:
        t0 = time.perf_counter()
        loss, per_position = evaluate(self.model, self.val, self.cfg)
        buckets = bucketed_ppl(per_position, self.cfg.original_context)
        self.state.val.append(
            {"step": self.step, "loss": round(loss, 5), "ppl": round(math.exp(loss), 3), "ppl_by_position": buckets}
        )
        dt = time.perf_counter() - t0
        by_pos = " ".join(f"{k}:{v:.1f}" for k, v in buckets.items())
        self.say(f"step {self.step}: val loss {loss:.4f} ppl {math.exp(loss):.2f} [{by_pos}] ({dt:.1f}s)")

    def last_eval_step(self) -> int | None:
        return self.state.val[-1]["step"] if self.state.val else None

    def finish_logs(self) -> None:
        if self.window:
            self.state.train_loss.append((self.step, float(np.mean(self.window))))

    def save(self) -> None:
        """One file, written to a temporary name and moved into place."""
        cfg, state = self.cfg, self.state
        entries = {
            "pretrain_config": cfg.to_dict(),
            "target_config": self.model.config.to_hf_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": {"step": state.step, "max_steps": state.max_steps, "warmup_steps": cfg.warmup_steps},
            "loader": self.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "run": asdict(state),
        }
        write_checkpoint(self.checkpoint, entries)

    def export(self, stopped_by: str) -> Path:
        return export_model(self.model, self.cfg, self.state, {"stopped_by": stopped_by})

    # ---- the outcome ---------------------------------------------------------------------------------------------
    def result(self, stopped_by: str) -> TrainResult:
        state, last_val = self.state, self.state.val[-1] if self.state.val else None
        tok_s = self.session_steps * self.tokens_per_step / self.session_train_s if self.session_train_s else 0.0
        self.say(
            f"train-target: stopped by {stopped_by} at step {state.step}/{state.max_steps}, {state.tokens:,} tokens, "
            f"{state.elapsed_s / 60:.1f} min, {tok_s:.0f} tok/s"
            + (f", val ppl {last_val['ppl']:.2f}" if last_val else "")
            + (f"; exported to {self.export_dir}" if self.export_dir else "")
        )
        return TrainResult(
            steps=state.step,
            tokens=state.tokens,
            wall_clock_s=state.elapsed_s,
            tokens_per_s=tok_s,
            final_train_loss=self.losses[-1] if self.losses else float("nan"),
            val_loss=last_val["loss"] if last_val else None,
            val_ppl=last_val["ppl"] if last_val else None,
            stopped_by=stopped_by,
            max_steps=state.max_steps or state.step,
            num_params=self.total_params,
            active_params=self.active_params,
            checkpoint=str(self.checkpoint),
            export_dir=str(self.export_dir) if self.export_dir else None,
            losses=tuple(self.losses),
        )
