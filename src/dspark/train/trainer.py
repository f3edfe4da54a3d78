"""DSpark (and DFlash) drafter training against a frozen MLA target (dspark-method.md §3.4–§3.5, §6).

One optimizer step:
1. the step's global batch is a pure function of the step (a per-epoch permutation of the dataset), and so
   are the anchors of every sample (a generator seeded by (seed, step, row)); resume needs no RNG state;
2. per sample: up to ``num_anchors`` random anchors a with loss_mask[a] and loss_mask[a+1]; blocks of K slots
   ``[x_a, MASK × (K−1)]`` at positions a..a+K−1; labels x_{a+1..a+K}; a contiguous-prefix eval mask;
3. target features (taps [S, m·D] and the final hidden [S, D]) online (a no-grad target forward) or from
   the offline cache; the drafter sees context rows strictly before its anchor plus its own block;
4. Markov teacher forcing with prev = [anchor, labels[:-1]]; confidence logits from [h_k ; W1[prev_k]];
5. loss 0.1·CE + 0.9·L1(p_draft, p_target) + 1.0·BCE(conf, 1 − ½‖p_d − p_t‖₁), weights exp(−k/4), normalised
   by the global (all-reduced over ranks and micro-steps) weight sum and multiplied by the world size, which
   cancels DDP's gradient averaging, so any rank/micro-batch split equals one big batch;
6. AdamW on fp32 parameters (bf16 autocast forward), linear warmup + cosine, gradient clipping.

The embedding and lm_head are the target's, frozen and never saved in the drafter's checkpoint. Checkpoints
(``out_dir/checkpoint/last.pt``) resume bit-exactly; the export (``out_dir/export``) is the official
``k3_dspark`` directory written by ``save_drafter`` (bf16) plus ``training_log.json``.

The run itself (stop rules, time-derived horizon, evaluation/checkpoint intervals, final export) is the loop
both trainers share, ``dspark.train.loop.TrainLoop``; ``DraftTrainer`` implements its hooks. Its parts, by role:
``draft_config.py`` (the run's settings and the drafter shape), ``draft_batches.py`` (step batches and anchors),
``draft_model.py`` (building and warm-starting the drafter, the block forward), ``draft_metrics.py``,
``distributed.py`` (torchrun) and ``checkpoint.py`` (checkpoint I/O, shared with ``pretrain.py``).

Runs single-process or under ``torchrun`` (gloo on CPU):
``torchrun --nproc_per_node 2 --no-python dspark train-draft --target DIR --data-dir DIR --out-dir DIR``.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dspark.device import resolve_device
from dspark.train.anchors import depth_summary, tau_by_depth
from dspark.train.checkpoint import (
    EXPORT_DIR,
    TRAINING_LOG,
    check_same_settings,
    fresh_or_resume,
    read_checkpoint,
    write_checkpoint,
)
from dspark.train.distributed import Dist, init_distributed, shutdown_distributed
from dspark.train.draft_batches import BlockBatch, make_block_batch, step_samples, step_tokens, steps_for_tokens
from dspark.train.draft_config import SHAPE_FIELDS, DraftTrainConfig
from dspark.train.draft_data import TRAIN_FILE, VALIDATION_FILE, DraftDataset
from dspark.train.draft_metrics import MetricSums
from dspark.train.draft_model import BlockForward, build_drafter, train_vocab_ids, warm_start_
from dspark.train.features import FeatureCache, Features, target_features, target_logits_at
from dspark.train.loop import TrainLoop, bf16_autocast, lr_at, torch_threads
from dspark.train.loss import DSparkLoss, dspark_loss, position_weights


@dataclass
class RunLog:
    elapsed_s: float = 0.0
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)


class DraftTrainer(TrainLoop[tuple[MetricSums, torch.Tensor]]):
    """Holds the frozen target, the drafter, its DDP wrapper, the optimizer and the data of one run; ``run()``
    (the shared loop, ``dspark.train.loop``) trains it with checkpoints, evaluation and export."""

    def __init__(
        self,
        cfg: DraftTrainConfig,
        target: nn.Module,
        train_data: DraftDataset,
        val_data: DraftDataset | None = None,
        dist_info: Dist | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist_info or Dist()
        self.device = resolve_device(cfg.device)
        self.target = target.eval().requires_grad_(False).to(self.device)
        self.train_data = train_data
        self.val_data = val_data
        self.drafter = build_drafter(cfg, self.target).to(self.device)
        self.draft_cfg = self.drafter.config
        self.K = cfg.block_size
        self.weights = cfg.loss_weights
        self.vocab_ids = train_vocab_ids(cfg, self.draft_cfg.vocab_size)
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(self.device)
        self.block_forward = BlockForward(self.drafter, cfg.absorbed, self.vocab_ids)
        self.module: nn.Module = self.block_forward
        if self.dist.enabled:
            self.module = nn.parallel.DistributedDataParallel(self.block_forward)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, weight_decay=cfg.weight_decay, fused=True
        )
        world = self.dist.world_size
        micro = cfg.micro_batch_size or max(1, cfg.batch_size // world)
        if cfg.batch_size % (world * micro):
            raise ValueError(
                f"batch_size={cfg.batch_size} must be a multiple of world_size×micro_batch_size={world}×{micro}"
            )
        self.micro = micro
        self.accum = cfg.batch_size // (world * micro)
        self.max_steps: int | None
        if cfg.max_steps is not None:
            self.max_steps = cfg.max_steps
        elif cfg.max_train_tokens is not None:
            self.max_steps = steps_for_tokens(cfg.max_train_tokens, cfg.batch_size, train_data, cfg.seed)
        elif cfg.time_mode:
            self.max_steps = None  # fixed by the run loop after cfg.probe_steps timed steps
        else:
            assert cfg.epochs is not None
            self.max_steps = max(1, math.ceil(cfg.epochs * len(train_data) / cfg.batch_size))
        self.step = 0
        self.tokens_seen = 0  # sample tokens of every step run so far (all ranks)
        self.master = self.dist.rank == 0
        self.log = RunLog()
        self.window = MetricSums(self.K)
        self.last_train: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.caches: dict[str, FeatureCache] = {}
        if cfg.features == "offline":
            taps = self.draft_cfg.target_layer_ids
            root = cfg.feature_root()
            self.caches["train"] = FeatureCache(root / "train", train_data, taps)
            if val_data is not None:
                self.caches["validation"] = FeatureCache(root / "validation", val_data, taps)

    # ---- features ----------------------------------------------------------------------------------
    def features(self, batch: BlockBatch, split: str) -> Features:
        if self.cfg.features == "offline":
            return self.caches[split].batch(batch.sample_ids, batch.input_ids.shape[1])
        return target_features(
            self.target,
            batch.input_ids,
            self.draft_cfg.target_layer_ids,
            self.cfg.feature_dtype,
            self.cfg.autocast_bf16,
            self.cfg.absorbed,
            self.cfg.feature_chunk,
            batch.lengths,
        )

    def target_logits(self, batch: BlockBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Target next-token logits fp32 [B, A, K, V] at rows anchor + j (slot j's prefix)."""
        B, A = batch.anchors.shape
        slots = torch.arange(self.K, device=batch.anchors.device)
        rows = (batch.anchors[..., None] + slots).clamp(max=hidden.shape[1] - 1)
        logits = target_logits_at(self.target.lm_head, hidden, rows.view(B, A * self.K), self.cfg.autocast_bf16)
        return logits.view(B, A, self.K, -1)

    # ---- one micro-batch ---------------------------------------------------------------------------
    def batch_loss(
        self, batch: BlockBatch, split: str, denominator: torch.Tensor | float, module: nn.Module | None = None
    ) -> DSparkLoss:
        feats = self.features(batch, split)
        target_logits = self.target_logits(batch, feats.hidden)
        with bf16_autocast(self.cfg.autocast_bf16, self.device):
            logits, conf = (module or self.module)(batch.block_ids, batch.anchors, batch.keep, batch.labels, feats.taps)
        return dspark_loss(
            logits,
            target_logits,
            conf,
            batch.labels,
            batch.eval_mask,
            self.weights,
            denominator=denominator,
            max_chunk_elements=self.cfg.loss_chunk_elements,
            vocab_ids=self.vocab_ids,
        )

    def _weight_sum(self, batch: BlockBatch) -> torch.Tensor:
        return (position_weights(self.K, self.weights.decay_gamma, batch.eval_mask.device) * batch.eval_mask).sum()

    def step_batches(self, step: int) -> list[BlockBatch]:
        """This rank's micro-batches of optimizer step ``step``."""
        cfg = self.cfg
        ids = step_samples(step, cfg.batch_size, len(self.train_data), cfg.seed)
        world, rank = self.dist.world_size, self.dist.rank
        out = []
        for j in range(self.accum):
            rows = [(j * world + rank) * self.micro + r for r in range(self.micro)]
            out.append(
                make_block_batch(
                    self.train_data,
                    [ids[r] for r in rows],
                    rows,
                    cfg.num_anchors,
                    self.K,
                    cfg.mask_token_id,
                    cfg.seed,
                    step,
                    pad_id=self.draft_cfg.pad_token_id or 0,
                    prompt_anchors=cfg.prompt_anchors,
                ).to(self.device)
            )
        return out

    # ---- one optimizer step ------------------------------------------------------------------------
    def train_step(self) -> tuple[MetricSums, torch.Tensor]:
        """Run optimizer step ``self.step``; returns (this rank's metric sums, grad norm), both still on the device:
        nothing here waits for an accelerator (``record`` reads them at its log interval)."""
        cfg = self.cfg
        self.apply_lr(self.optimizer)
        batches = self.step_batches(self.step)
        local = torch.stack([self._weight_sum(b) for b in batches]).sum().double()
        denom = self.dist.all_sum(local).float()
        sums = MetricSums(self.K)
        self.module.train()
        for j, batch in enumerate(batches):
            last = j == len(batches) - 1
            sync = nullcontext() if last or not self.dist.enabled else self.module.no_sync()  # type: ignore[operator]
            with sync:
                res = self.batch_loss(batch, "train", denom)
                (res.loss * self.dist.world_size).backward()
            sums.add(res, batch.eval_mask, self.weights, denom)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += step_tokens(self.step, cfg.batch_size, self.train_data, cfg.seed)
        self.step += 1
        return sums, grad_norm.detach()

    # ---- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Held-out metrics with all (up to eval_num_anchors) anchors per sample; ranks split the samples."""
        if self.val_data is None or len(self.val_data) == 0:
            return None
        cfg = self.cfg
        n = len(self.val_data) if cfg.eval_max_samples is None else min(cfg.eval_max_samples, len(self.val_data))
        mine = list(range(self.dist.rank, n, self.dist.world_size))
        sums = MetricSums(self.K)
        depth = torch.zeros(2, len(cfg.eval_depth_edges) + 1, dtype=torch.float64)
        was = self.module.training
        self.module.eval()
        for i in range(0, len(mine), self.micro):
            ids = mine[i : i + self.micro]
            batch = make_block_batch(
                self.val_data, ids, ids, cfg.eval_num_anchors, self.K, cfg.mask_token_id, cfg.seed, None
            ).to(self.device)
            denom = self._weight_sum(batch)
            res = self.batch_loss(batch, "validation", denom, self.block_forward)
            sums.add(res, batch.eval_mask, self.weights, denom)
            depth += tau_by_depth(res.accept_target, batch.eval_mask, batch.anchors, cfg.eval_depth_edges).cpu()
        self.module.train(was)
        sums.values = self.dist.all_sum(sums.values)
        by_depth = depth_summary(self.dist.all_sum(depth), cfg.eval_depth_edges)
        return sums.summary(self.weights) | {"tau_by_depth": by_depth}

    # ---- the shared loop's hooks ---------------------------------------------------------------------
    @property
    def elapsed_s(self) -> float:
        return self.log.elapsed_s

    @elapsed_s.setter
    def elapsed_s(self, value: float) -> None:
        self.log.elapsed_s = value

    def clock(self) -> float:
        """Wall-clock seconds of the whole run so far (all sessions), for the learning curve."""
        return round(self.elapsed() if hasattr(self, "_session_start") else self.elapsed_s, 1)

    def run_step(self) -> tuple[MetricSums, torch.Tensor]:
        return self.train_step()

    def record(self, out: tuple[MetricSums, torch.Tensor], dt: float) -> None:
        sums, norm = out
        if self.window.values.device != sums.values.device:
            self.window.values = self.window.values.to(sums.values.device)
        self.window.values += sums.values
        step = self.step
        if step % self.cfg.log_interval != 0 and step != self.max_steps:
            return
        self.window.values = self.dist.all_sum(self.window.values)
        grad_norm = float(norm)
        lr = lr_at(step - 1, self.cfg, self.max_steps)
        row = {"step": step, "tokens": self.tokens_seen, "train_s": self.clock(), "lr": lr}
        row |= {"grad_norm": round(grad_norm, 4)} | self.window.summary(self.weights)
        self.log.train.append(row)
        self.last_train = row
        self.window = MetricSums(self.K)
        self.say(
            f"step {step}/{self.max_steps}: loss {row['loss']:.4f} ce {row['ce']:.3f} l1 {row['l1']:.3f} "
            f"kl {row['kl']:.3f} conf {row['confidence']:.3f} tau {row['tau_probabilistic']:.3f} "
            f"acc@1 {row['accept_rate'][0]:.3f} gn {grad_norm:.2f} "
            f"({self.session_train_s / self.session_steps:.2f}s/step)"
        )

    def run_evaluation(self) -> None:
        ev = self.evaluate()
        if ev is not None:
            self.log.eval.append({"step": self.step, "tokens": self.tokens_seen, "train_s": self.clock()} | ev)
            self.last_eval = ev
            deep = " ".join(f"{k}:{v:.2f}" for k, v in ev["tau_by_depth"].items() if v is not None)
            self.say(
                f"step {self.step}: eval tau {ev['tau_probabilistic']:.3f} accept_rate {ev['accept_rate']} "
                f"tau by depth {deep}"
            )

    def last_eval_step(self) -> int | None:
        return self.log.eval[-1]["step"] if self.log.eval else None

    def any_rank(self, flag: bool) -> bool:
        return bool(self.dist.all_sum(torch.tensor([float(flag)]))[0] > 0)

    def agree(self, value: int) -> int:
        if not self.dist.enabled:
            return value
        t = torch.tensor([float(value)])
        dist.broadcast(t, src=0)
        return int(t[0])

    def barrier(self) -> None:
        if self.dist.enabled:
            dist.barrier()

    def save(self) -> None:
        entries = {
            "train_config": self.cfg.to_dict(),
            "draft_config": self.draft_cfg.to_dict(),
            "trainer": self.state_dict(),
            "run": asdict(self.log),
        }
        write_checkpoint(self.checkpoint, entries)

    def export(self, stopped_by: str) -> Path:
        from dspark.models.loading import save_drafter

        export = Path(self.cfg.out_dir) / EXPORT_DIR
        save_drafter(self.drafter, export, dtype=self.cfg.export_dtype)
        if self.vocab_ids is not None:  # the engine drafts from the ids it was trained on
            from dspark.speculative.draft_vocab import DRAFT_VOCAB_FILE

            src = Path(self.cfg.draft_vocab or "")
            src = src / DRAFT_VOCAB_FILE if src.is_dir() else src
            vocab = json.loads(src.read_text()) | {"default_size": int(self.vocab_ids.numel())}
            (export / DRAFT_VOCAB_FILE).write_text(json.dumps(vocab) + "\n")
        log = {
            "steps": self.step,
            "max_steps": self.max_steps,
            "stopped_by": stopped_by,
            "wall_clock_s": round(self.log.elapsed_s, 1),
            "num_trainable_params": self.num_trainable_params,
            "final_eval": self.last_eval,
            "train": self.log.train,
            "eval": self.log.eval,
            "train_config": self.cfg.to_dict(),
        }
        (export / TRAINING_LOG).write_text(json.dumps(log, indent=2) + "\n")
        self.say(f"train-draft: exported {'DFlash' if self.cfg.dflash else 'DSpark'} drafter to {export}")
        return export

    @property
    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "max_steps": self.max_steps,
            "tokens_seen": self.tokens_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.max_steps = None if state["max_steps"] is None else int(state["max_steps"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        if self.cfg.max_train_tokens is not None:  # a larger token budget extends the run (and its cosine)
            steps = steps_for_tokens(self.cfg.max_train_tokens, self.cfg.batch_size, self.train_data, self.cfg.seed)
            self.max_steps = max(steps, self.step)


# --------------------------------------------------------------------------------------------------------
# checkpoints and the run
# --------------------------------------------------------------------------------------------------------


def load_checkpoint(path: Path, cfg: DraftTrainConfig) -> dict[str, Any]:
    blob = read_checkpoint(path)
    saved = DraftTrainConfig.from_dict(blob["train_config"])
    check_same_settings(path, asdict(saved), cfg, SHAPE_FIELDS, "different settings")
    return blob


@dataclass(frozen=True)
class DraftTrainResult:
    steps: int
    max_steps: int | None
    stopped_by: str  # "max_steps" | "time_budget" | "halt"
    wall_clock_s: float
    sequences_per_s: float
    final_train: dict[str, Any] | None
    final_eval: dict[str, Any] | None
    num_trainable_params: int
    checkpoint: str
    export_dir: str | None


def load_datasets(data_dir: str | Path) -> tuple[DraftDataset, DraftDataset | None]:
    d = Path(data_dir)
    train = DraftDataset.load(d / TRAIN_FILE)
    val = DraftDataset.load(d / VALIDATION_FILE) if (d / VALIDATION_FILE).is_file() else None
    return train, val


def train_draft(
    cfg: DraftTrainConfig,
    resume: bool = False,
    target: nn.Module | None = None,
    train_data: DraftDataset | None = None,
    val_data: DraftDataset | None = None,
) -> DraftTrainResult:
    """Train (or resume) a drafter as configured. Loads the target/data from cfg unless given.

    Raises FileExistsError when out_dir already holds a checkpoint and ``resume`` is False."""
    owns_group = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    dist_info = init_distributed()
    threads = cfg.num_threads
    if threads is None and dist_info.world_size > 1:
        threads = max(1, (os.cpu_count() or 1) // dist_info.world_size)
    ok = False
    try:
        with torch_threads(threads):
            result = _run(cfg, resume, target, train_data, val_data, dist_info)
        ok = True
        return result
    finally:
        if owns_group:
            shutdown_distributed(synchronize=ok)


def _run(cfg, resume, target, train_data, val_data, dist_info: Dist) -> DraftTrainResult:
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.models.loading import load_target

    ckpt = fresh_or_resume(cfg.out_dir, resume)
    if target is None:
        target = load_target(resolve_model_ref(cfg.target_dir, role="train-draft --target"), "float32")
    if train_data is None:
        train_data, val_data = load_datasets(cfg.data_dir)
    trainer = DraftTrainer(cfg, target, train_data, val_data, dist_info)
    if resume:
        blob = load_checkpoint(ckpt, cfg)
        trainer.load_state_dict(blob["trainer"])
        trainer.log = RunLog(**blob["run"])
    elif cfg.init_from:
        warm_start_(trainer.drafter, cfg.init_from, target)
        trainer.run_evaluation()  # the starting weights on this validation split: the log's step 0
    world, dcfg = dist_info.world_size, trainer.draft_cfg
    trainer.say(
        f"train-draft: {'DFlash' if cfg.dflash else 'DSpark'} drafter, {trainer.num_trainable_params / 1e6:.2f}M "
        f"trainable params, {dcfg.num_hidden_layers} layers, taps {list(dcfg.target_layer_ids)}, "
        f"{len(train_data)} train samples, {cfg.features} features, world {world}, "
        f"batch {cfg.batch_size} = {world}×{trainer.micro}×{trainer.accum}, "
        f"{'resuming at step ' + str(trainer.step) if resume else 'fresh start'} of {trainer.max_steps}"
        + (f", weights from {cfg.init_from}" if cfg.init_from and not resume else "")
    )
    stopped_by = trainer.run()
    seqs = trainer.session_steps * cfg.batch_size
    return DraftTrainResult(
        steps=trainer.step,
        max_steps=trainer.max_steps,
        stopped_by=stopped_by,
        wall_clock_s=round(trainer.log.elapsed_s, 1),
        sequences_per_s=round(seqs / trainer.session_train_s, 3) if trainer.session_train_s else 0.0,
        final_train=trainer.last_train,
        final_eval=trainer.last_eval if stopped_by != "halt" else None,
        num_trainable_params=trainer.num_trainable_params,
        checkpoint=str(ckpt),
        export_dir=str(trainer.export_dir) if trainer.export_dir else None,
    )
