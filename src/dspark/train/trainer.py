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
both trainers share, ``dspark.train.loop.TrainLoop``; ``DraftTrainer`` implements its hooks.

Runs single-process or under ``torchrun`` (gloo on CPU):
``torchrun --nproc_per_node 2 --no-python dspark train-draft --target DIR --data-dir DIR --out-dir DIR``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dspark.config import POSITION_KEYS, DraftConfig, GQATargetConfig, KimiLinearConfig, TargetConfig
from dspark.models.drafter import DSparkDrafter
from dspark.train.anchors import (
    block_inputs,
    block_positions,
    block_targets,
    block_visibility,
    depth_summary,
    sample_anchors,
    tau_by_depth,
)
from dspark.train.features import FeatureCache, Features, target_features, target_logits_at
from dspark.train.loop import TrainLoop, atomic_torch_save, checkpoint_path, warmup_cosine
from dspark.train.loss import DSparkLoss, LossWeights, dspark_loss, position_weights
from dspark.train.regenerate import TRAIN_FILE, VALIDATION_FILE, DraftDataset

EXPORT_DIR = "export"
TRAINING_LOG = "training_log.json"
CHECKPOINT_VERSION = 1
MASK_ID = 3  # dspark.train.tokenizer: <|mask|>
TIME_MODE_WARMUP = 50  # warmup steps of a timed run (its horizon is unknown when the warmup starts)


# --------------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------------


def spread_taps(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """num_taps target layer ids spread evenly over [1, L−2] (never the last layer); fewer if L is small."""
    if num_layers < 2:
        return (0,) if num_layers == 1 and num_taps > 0 else ()
    hi = max(num_layers - 2, 0)
    lo = min(1, hi)
    ids = np.unique(np.round(np.linspace(lo, hi, num_taps)).astype(int))
    return tuple(int(i) for i in ids)


def draft_config_for(
    target: TargetConfig | GQATargetConfig | KimiLinearConfig,
    num_layers: int = 2,
    markov_rank: int = 96,
    markov_head_type: str = "vanilla",
    confidence: bool = True,
    taps: Sequence[int] | None = None,
    num_taps: int = 4,
    block_size: int = 7,
    mask_token_id: int = MASK_ID,
    intermediate_size: int | None = None,
) -> DraftConfig:
    """A drafter for ``target`` that shares its page format: k3_dspark (MLA widths) for an MLA target, DeepSpec's
    Qwen3DSparkModel (the target's KV heads and head_dim) for a GQA target; its hidden size, RoPE and special ids;
    ``num_layers`` layers; taps spread over the target depth. A hybrid (kimi_linear) target gets the MLA drafter
    of its MLA layers' widths with RoPE (K3's drafter rotates, its target does not) and no output gate, reading
    the target's default tap stream (K3: "prefix")."""
    if isinstance(target, KimiLinearConfig):
        target = replace(target.base, mla_use_nope=False, mla_use_output_gate=False)
    tap_ids = tuple(taps) if taps is not None else spread_taps(target.num_hidden_layers, num_taps)
    if tap_ids and tap_ids[-1] >= target.num_hidden_layers - 1 and target.num_hidden_layers > 1:
        raise ValueError(
            f"target_layer_ids {list(tap_ids)} include the target's last layer {target.num_hidden_layers - 1}; "
            "its output is the pre-norm final state the drafter must not see — pick earlier layers"
        )
    if isinstance(target, GQATargetConfig):
        geometry: dict[str, Any] = {
            "architecture": "Qwen3DSparkModel",
            "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim,
        }
    else:
        geometry = {
            "architecture": "K3DSparkModel",
            "q_lora_rank": target.q_lora_rank,
            "kv_lora_rank": target.kv_lora_rank,
            "qk_nope_head_dim": target.qk_nope_head_dim,
            "qk_rope_head_dim": target.qk_rope_head_dim,
            "v_head_dim": target.v_head_dim,
            "mla_use_nope": target.mla_use_nope,
            "mla_use_output_gate": target.mla_use_output_gate,
        }
    return DraftConfig(
        **geometry,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        vocab_size=target.vocab_size,
        target_layer_ids=tap_ids,
        target_hidden_size=target.hidden_size,
        target_num_hidden_layers=target.num_hidden_layers,
        mask_token_id=mask_token_id,
        rope=target.rope,
        max_position_embeddings=target.max_position_embeddings,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=confidence,
        confidence_head_with_markov=True,
        block_size=block_size,
        rms_norm_eps=target.rms_norm_eps,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
        torch_dtype="bfloat16",
    )


@dataclass(frozen=True)
class DraftTrainConfig:
    """Everything a drafter training run depends on; stored in every checkpoint."""

    target_dir: str = "runs/target/export"
    data_dir: str = "runs/draft_data"  # train.npz (+ validation.npz) from `dspark draft-data`
    out_dir: str = "runs/draft"
    features: str = "online"  # "online" | "offline"
    feature_dir: str | None = None  # offline cache root (train/, validation/); None: <data_dir>/features
    feature_dtype: str = "bfloat16"
    # drafter shape
    dflash: bool = False  # markov_rank 0, no confidence head, CE-only loss (DeepSpec's DFlash baseline)
    num_layers: int = 2
    markov_rank: int = 96
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    target_layer_ids: tuple[int, ...] | None = None  # None: spread_taps(target depth, num_taps)
    num_taps: int = 4
    block_size: int = 7
    mask_token_id: int = MASK_ID
    intermediate_size: int | None = None  # None: the target's
    init_std: float = 0.02
    # train over a reduced draft vocabulary (what the engine drafts from): a draft_vocab.json, or a drafter dir with
    # one; its default_size ids unless draft_vocab_size is given. None: the full vocabulary
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None
    # loss
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    kl_weight: float = 0.0  # forward KL(p_target || p_draft) on top of the paper's CE + TV mix
    decay_gamma: float = 4.0
    # optimisation
    num_anchors: int = 64
    # more anchors per training sample drawn in its prompt (the corpus text before the response): their labels are
    # the text, distilled against the target's logits there, so long prompts teach the drafter to read the target's
    # hidden states at every depth the data has (the responses sit only at the end). 0: responses only.
    prompt_anchors: int = 0
    batch_size: int = 8  # global sequences per optimizer step (over all ranks and micro-steps)
    micro_batch_size: int | None = None  # sequences per rank per forward; None: batch_size // world_size
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None  # None: warmup_ratio · max_steps (TIME_MODE_WARMUP when timed)
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    max_steps: int | None = None
    # the horizon in training tokens (sample tokens of the step batches): the steps follow from the data, so a run
    # resumed with a larger budget extends its cosine schedule; used when max_steps is None
    max_train_tokens: int | None = None
    epochs: float | None = None  # sets max_steps from the dataset size when max_steps and max_train_tokens are None
    max_minutes: float | None = None  # wall-clock stop (checkpoint + export) across resumes
    probe_steps: int = 8  # time mode (only max_minutes given): steps timed before the horizon is first derived
    horizon_interval: int = 50  # time mode: re-derive the horizon every N steps (median of the last N)
    autocast_bf16: bool = True
    absorbed: bool = True  # absorbed MLA (latent-space attention) for the drafter and online target features
    feature_chunk: int | None = None  # online features of longer samples: the target runs this many tokens at a time
    loss_chunk_elements: int = 1 << 28  # logits per loss chunk (larger: more memory, no recompute in backward)
    seed: int = 42
    num_threads: int | None = None
    # bookkeeping
    eval_interval: int = 200
    eval_max_samples: int | None = None
    eval_num_anchors: int = 512
    eval_depth_edges: tuple[int, ...] = (256, 1024, 4096, 16384)  # validation τ per anchor-depth bucket
    ckpt_interval: int = 200
    log_interval: int = 10
    export_dtype: str = "bfloat16"
    halt_at_step: int | None = None  # stop (checkpoint, no export) after this step, as if interrupted
    init_from: str | None = None  # warm start: the weights of an earlier run (out_dir, last.pt or export dir)
    # a fresh drafter's layer i starts as target layer ids[i] (every tensor whose name and shape agree)
    init_layers_from_target: tuple[int, ...] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.features not in ("online", "offline"):
            raise ValueError(f"DraftTrainConfig.features = {self.features!r}: use 'online' or 'offline'")
        positive = ("batch_size", "num_anchors", "block_size", "eval_interval", "ckpt_interval", "log_interval")
        if self.prompt_anchors < 0:
            raise ValueError(f"DraftTrainConfig.prompt_anchors = {self.prompt_anchors}: must be >= 0")
        for name in positive + ("horizon_interval",):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"DraftTrainConfig.{name} = {v!r}: must be a positive integer")
        if self.feature_chunk is not None and (not isinstance(self.feature_chunk, int) or self.feature_chunk <= 0):
            raise ValueError(f"DraftTrainConfig.feature_chunk = {self.feature_chunk!r}: must be null or positive")
        edges = list(self.eval_depth_edges)
        if not edges or edges[0] <= 0 or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(f"DraftTrainConfig.eval_depth_edges = {edges}: must be increasing positive positions")
        if self.max_steps is None and self.epochs is None and self.max_minutes is None and not self.max_train_tokens:
            raise ValueError("DraftTrainConfig: set max_steps, max_train_tokens, epochs or max_minutes")
        if self.max_train_tokens is not None and self.max_train_tokens <= 0:
            raise ValueError(f"DraftTrainConfig.max_train_tokens = {self.max_train_tokens}: must be positive")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"DraftTrainConfig: lr ({self.lr}) and grad_clip ({self.grad_clip}) must be positive")
        if self.time_mode and not 2 <= self.probe_steps < self.warmup_for(None):
            raise ValueError(
                f"DraftTrainConfig.probe_steps = {self.probe_steps}: must be in [2, warmup steps = "
                f"{self.warmup_for(None)}) so the derived cosine horizon does not change the schedule already run"
            )

    @property
    def time_mode(self) -> bool:
        """The horizon (max_steps) is derived from max_minutes and the measured step time."""
        return self.max_steps is None and self.epochs is None and self.max_train_tokens is None

    def warmup_for(self, max_steps: int | None) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.time_mode or max_steps is None:
            return TIME_MODE_WARMUP
        return max(1, round(self.warmup_ratio * max_steps))

    @property
    def loss_weights(self) -> LossWeights:
        if self.dflash:
            return LossWeights(ce=1.0, l1=0.0, confidence=0.0, decay_gamma=self.decay_gamma)
        conf = self.confidence_weight if self.confidence_head else 0.0
        return LossWeights(
            ce=self.ce_weight, l1=self.l1_weight, confidence=conf, decay_gamma=self.decay_gamma, kl=self.kl_weight
        )

    def draft_config(self, target: TargetConfig | GQATargetConfig) -> DraftConfig:
        return draft_config_for(
            target,
            num_layers=self.num_layers,
            markov_rank=0 if self.dflash else self.markov_rank,
            markov_head_type=self.markov_head_type,
            confidence=False if self.dflash else self.confidence_head,
            taps=self.target_layer_ids,
            num_taps=self.num_taps,
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            intermediate_size=self.intermediate_size,
        )

    def feature_root(self) -> Path:
        return Path(self.feature_dir) if self.feature_dir else Path(self.data_dir) / "features"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.init_layers_from_target is not None:
            d["init_layers_from_target"] = list(self.init_layers_from_target)
        if self.target_layer_ids is not None:
            d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftTrainConfig:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if d.get("target_layer_ids") is not None:
            d["target_layer_ids"] = tuple(d["target_layer_ids"])
        if d.get("init_layers_from_target") is not None:
            d["init_layers_from_target"] = tuple(d["init_layers_from_target"])
        if d.get("eval_depth_edges") is not None:
            d["eval_depth_edges"] = tuple(d["eval_depth_edges"])
        return cls(**d)


# fields that must not change on resume
SHAPE_FIELDS = (
    "dflash",
    "num_layers",
    "markov_rank",
    "markov_head_type",
    "confidence_head",
    "target_layer_ids",
    "num_taps",
    "block_size",
    "intermediate_size",
    "batch_size",
    "num_anchors",
    "prompt_anchors",
    "seed",
)


# --------------------------------------------------------------------------------------------------------
# distributed helpers
# --------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def step_samples(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step ``step``: consecutive slices of per-epoch seeded permutations."""
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(g, num_samples)
        out.append(int(_epoch_order(seed, epoch, num_samples)[pos]))
    return out


def step_tokens(step: int, batch_size: int, dataset: DraftDataset, seed: int) -> int:
    """Sample tokens of optimizer step ``step``'s global batch."""
    sizes = np.diff(dataset.offsets)
    return int(sizes[step_samples(step, batch_size, len(dataset), seed)].sum())


def steps_for_tokens(tokens: int, batch_size: int, dataset: DraftDataset, seed: int) -> int:
    """The first step count whose batches hold at least ``tokens`` sample tokens (the token horizon in steps)."""
    sizes = np.diff(dataset.offsets)
    n, seen, step = len(dataset), 0, 0
    while seen < tokens:
        epoch_steps = max(1, n // batch_size)
        for s in range(step, step + epoch_steps):
            seen += int(sizes[step_samples(s, batch_size, n, seed)].sum())
            step = s + 1
            if seen >= tokens:
                break
    return max(1, step)


def _anchor_generator(seed: int, step: int | None, row: int) -> torch.Generator:
    """Training step s draws from stream (seed, 0, s, row); evaluation (step None) from (seed, 1, row)."""
    key = [seed, 0, step, row] if step is not None else [seed, 1, row]
    state = np.random.SeedSequence(key).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass(frozen=True)
class BlockBatch:
    """A padded micro-batch of sequences and their packed blocks. S = longest sample, A anchors, K slots."""

    sample_ids: tuple[int, ...]
    input_ids: torch.Tensor  # [B, S] long (right-padded)
    loss_mask: torch.Tensor  # [B, S] bool (False on padding)
    lengths: torch.Tensor  # [B] long
    anchors: torch.Tensor  # [B, A] long (A ≤ num_anchors: columns that are padding in every row are cut)
    keep: torch.Tensor  # [B, A] bool
    block_ids: torch.Tensor  # [B, A, K] = [x_a, MASK × (K−1)]
    labels: torch.Tensor  # [B, A, K] x_{a+1..a+K} (0 past the end)
    eval_mask: torch.Tensor  # [B, A, K] bool, contiguous prefix per block


def make_block_batch(
    dataset: DraftDataset,
    sample_ids: Sequence[int],
    rows: Sequence[int],
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    seed: int,
    step: int | None,
    pad_id: int = 0,
    prompt_anchors: int = 0,
) -> BlockBatch:
    """Blocks of the given samples; ``rows`` (their row in the global step batch) seed the anchor choice, so
    a sample gets the same anchors however the step's batch is split over ranks and micro-steps.
    ``step`` None selects the evaluation stream. ``prompt_anchors``: that many more anchors per sample drawn over
    its prompt (positions before its first response token), whose labels are then supervised too (see
    ``DraftTrainConfig.prompt_anchors``)."""
    samples = [dataset[i] for i in sample_ids]
    S = max(x.size for x, _ in samples)
    B = len(samples)
    A = num_anchors + prompt_anchors
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    anchors = torch.zeros(B, A, dtype=torch.long)
    keep = torch.zeros(B, A, dtype=torch.bool)
    for r, ((x, m), row) in enumerate(zip(samples, rows)):
        input_ids[r, : x.size] = torch.from_numpy(x)
        loss_mask[r, : m.size] = torch.from_numpy(m)
        gen = _anchor_generator(seed, step, row)
        a, k = sample_anchors(loss_mask[r : r + 1, : x.size], num_anchors, gen)
        if prompt_anchors:
            a, k = _with_prompt_anchors(loss_mask[r, : x.size], a[0], k[0], prompt_anchors, gen)
        anchors[r], keep[r] = a[0], k[0]
    # drop anchor columns that are padding in every row (dummy blocks cost compute and supervise nothing)
    used = max(1, int(keep.sum(1).max()))
    anchors, keep = anchors[:, :used].contiguous(), keep[:, :used].contiguous()
    labels, eval_mask = block_targets(input_ids, loss_mask, anchors, keep, block_size)
    return BlockBatch(
        sample_ids=tuple(int(i) for i in sample_ids),
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=torch.tensor([x.size for x, _ in samples], dtype=torch.long),
        anchors=anchors,
        keep=keep,
        block_ids=block_inputs(input_ids, anchors, block_size, mask_token_id),
        labels=labels,
        eval_mask=eval_mask,
    )


def _with_prompt_anchors(
    loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add up to n anchors in the prompt (positions 0..P-1 before the first supervised token P, labels up to P)
    to one sample's response anchors [A], and supervise the prompt (loss_mask modified in place). → anchors and
    keep [1, A + n], kept anchors first, each group sorted by position."""
    first = int(loss_mask.nonzero()[0]) if bool(loss_mask.any()) else loss_mask.numel()
    prompt = torch.zeros_like(loss_mask)
    prompt[: first + 1] = True  # anchors a < P whose next token a+1 <= P is a label
    pa, pk = sample_anchors(prompt[None], n, gen)
    loss_mask[:first] = True
    a, k = torch.cat((anchors, pa[0])), torch.cat((keep, pk[0]))
    order = torch.where(k, a, a + loss_mask.numel()).argsort()
    return a[order][None], k[order][None]


# --------------------------------------------------------------------------------------------------------
# model pieces
# --------------------------------------------------------------------------------------------------------


class BlockForward(nn.Module):
    """The drafter's training forward over packed blocks (the module DDP wraps)."""

    def __init__(self, drafter: DSparkDrafter, absorbed: bool = True, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.absorbed = absorbed
        self.vocab_ids = vocab_ids  # [N] a reduced draft vocabulary: logits over these target ids only
        self.head_rows = None  # the (frozen) lm_head's rows of those ids, sliced once
        if vocab_ids is not None:
            assert drafter.lm_head is not None
            self.head_rows = drafter.lm_head.weight.detach().index_select(0, vocab_ids)

    def forward(
        self,
        block_ids: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        labels: torch.Tensor,
        taps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """block_ids/labels [B, A, K], anchors/keep [B, A], taps [B, S, m·D] → (teacher-forced, Markov-corrected
        draft logits fp32 [B, A, K, V] (V: N with a reduced vocabulary), confidence logits [B, A, K] or None)."""
        B, A, K = block_ids.shape
        S = taps.shape[1]
        d = self.drafter
        ctx_positions = torch.arange(S, device=taps.device).expand(B, S)
        out = d(
            block_ids.reshape(B, A * K),
            block_positions(anchors, K),
            block_visibility(S, anchors, keep, K),
            ctx_taps=taps,
            ctx_positions=ctx_positions,
            absorbed=self.absorbed,
            compute_logits=self.head_rows is None,
        )
        base = out.base_logits if self.head_rows is None else F.linear(out.hidden, self.head_rows).float()
        assert base is not None
        logits = base.view(B, A, K, -1)
        hidden = out.hidden.view(B, A, K, -1)
        prev_embeds = None
        if d.markov_head is not None:
            prev = torch.cat((block_ids[..., :1], labels[..., :-1]), -1)  # [anchor, labels[:-1]]
            logits, prev_embeds = d.markov_head.teacher_forced(logits, hidden, prev, self.vocab_ids)
        return logits.float(), d.confidence(hidden, prev_embeds)


def train_vocab_ids(cfg: DraftTrainConfig, vocab_size: int) -> torch.Tensor | None:
    """The reduced draft vocabulary a run trains over (cfg.draft_vocab), or None for the full vocabulary."""
    from dspark.spec.draft_vocab import read_draft_vocab

    if cfg.draft_vocab is None:
        return None
    src = Path(cfg.draft_vocab)
    if not src.exists():
        raise FileNotFoundError(f"--draft-vocab {src}: no such draft_vocab.json or drafter directory")
    if not src.is_dir() and src.name != "draft_vocab.json":
        raise ValueError(f"--draft-vocab {src}: give a draft_vocab.json file or the directory that holds one")
    return read_draft_vocab(src if src.is_dir() else src.parent, cfg.draft_vocab_size, vocab_size)


def init_drafter_(drafter: DSparkDrafter, std: float, generator: torch.Generator) -> None:
    """N(0, std) matrices (std/sqrt(2L) for o_proj/down_proj), ones for norms, zero biases."""
    resid = std / math.sqrt(2 * max(1, drafter.config.num_hidden_layers))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.ndim == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def build_drafter(cfg: DraftTrainConfig, target: nn.Module) -> DSparkDrafter:
    drafter = DSparkDrafter(cfg.draft_config(target.config))
    init_drafter_(drafter, cfg.init_std, torch.Generator().manual_seed(cfg.seed))
    if cfg.init_layers_from_target is not None:
        copy_target_layers_(drafter, target, cfg.init_layers_from_target)
    norm = target_final_norm(target)
    if norm is not None and norm.shape == drafter.final_norm.weight.shape:
        with torch.no_grad():  # the borrowed lm_head then sees states at the target's scale from step 0
            drafter.final_norm.weight.copy_(norm)
    drafter.attach(target.embed_tokens, target.lm_head)
    return drafter.float().train()


def copy_target_layers_(drafter: DSparkDrafter, target: nn.Module, ids: Sequence[int]) -> int:
    """Start drafter layer i from target layer ids[i]: every tensor whose name and shape agree is copied (the
    drafter's extra tensors, e.g. q/k norms a Llama target lacks, keep their init). → tensors copied."""
    layers = getattr(getattr(target, "model", None), "layers", None)
    mine = drafter.layers
    if layers is None:
        raise ValueError("--init-layers-from-target: the target has no model.layers to copy from")
    if len(ids) != len(mine) or any(not 0 <= j < len(layers) for j in ids):
        raise ValueError(
            f"--init-layers-from-target {list(ids)}: give one target layer id in [0, {len(layers)}) per drafter "
            f"layer ({len(mine)})"
        )
    copied = 0
    with torch.no_grad():
        for layer, j in zip(mine, ids):
            theirs = dict(layers[j].named_parameters())
            for name, p in layer.named_parameters():
                src = theirs.get(name)
                if src is not None and src.shape == p.shape:
                    p.copy_(src.to(p.dtype))
                    copied += 1
    if copied == 0:
        raise ValueError("--init-layers-from-target: no tensor of the target's layers matches the drafter's layers")
    return copied


def target_final_norm(target: nn.Module) -> torch.Tensor | None:
    """The weight of the target's final RMSNorm (our MLA or GQA target), if it has one."""
    from dspark.models.layers import DecoderTarget

    if isinstance(target, DecoderTarget):
        return target.model.norm.weight.detach()
    return None


# --------------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------------


@dataclass
class MetricSums:
    """Additive sums (over micro-steps and ranks) from which step/eval metrics are derived."""

    K: int
    values: torch.Tensor = field(default=None)  # type: ignore[assignment]
    # layout: [w_sum, ce_num, l1_num, conf_num, blocks, tau_sum, kl_num, c_sum[K], count[K]]

    def __post_init__(self) -> None:
        if self.values is None:
            self.values = torch.zeros(7 + 2 * self.K, dtype=torch.float64)

    def add(self, res: DSparkLoss, eval_mask: torch.Tensor, weights: LossWeights, denom: float) -> None:
        K = self.K
        m = eval_mask.bool()
        w = (position_weights(K, weights.decay_gamma) * m).sum().double()
        c = res.accept_target.double()
        blocks = m[..., 0]
        tau = ((1 + torch.cumprod(c, -1).sum(-1)) * blocks).sum()
        v = self.values
        v[0] += w
        v[1] += float(res.ce.detach()) * denom
        v[2] += float(res.l1.detach()) * denom
        v[3] += float(res.confidence.detach()) * denom
        v[4] += float(blocks.sum())
        v[5] += float(tau)
        v[6] += float(res.kl.detach()) * denom
        v[7 : 7 + K] += c.sum((0, 1))
        v[7 + K :] += m.sum((0, 1)).double()

    def summary(self, weights: LossWeights) -> dict[str, Any]:
        K, v = self.K, self.values
        w = max(float(v[0]), 1e-12)
        ce, l1, conf, kl = float(v[1]) / w, float(v[2]) / w, float(v[3]) / w, float(v[6]) / w
        loss = weights.ce * ce + weights.l1 * l1 + weights.confidence * conf + weights.kl * kl
        counts = v[7 + K :].clamp_min(1)
        return {
            "loss": round(loss, 5),
            "ce": round(ce, 5),
            "l1": round(l1, 5),
            "confidence": round(conf, 5),
            "kl": round(kl, 5),
            "accept_rate": [round(float(x), 4) for x in v[7 : 7 + K] / counts],
            "tau_probabilistic": round(float(v[5]) / max(float(v[4]), 1.0), 4),
            "supervised_slots": int(v[7 + K :].sum()),
        }


# --------------------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------------------


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def lr_at(step: int, cfg: DraftTrainConfig, max_steps: int | None) -> float:
    """Linear warmup then cosine decay to lr·min_lr_ratio (0-based optimizer step). max_steps is None only
    while a timed run is still probing its speed (inside the warmup)."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_for(max_steps), max_steps, cfg.min_lr_ratio)


@dataclass
class RunLog:
    elapsed_s: float = 0.0
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)


class DraftTrainer(TrainLoop[tuple["MetricSums", float]]):
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
        self.target = target.eval().requires_grad_(False)
        self.train_data = train_data
        self.val_data = val_data
        self.drafter = build_drafter(cfg, target)
        self.draft_cfg = self.drafter.config
        self.K = cfg.block_size
        self.weights = cfg.loss_weights
        self.vocab_ids = train_vocab_ids(cfg, self.draft_cfg.vocab_size)
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
        rows = (batch.anchors[..., None] + torch.arange(self.K)).clamp(max=hidden.shape[1] - 1)
        logits = target_logits_at(self.target.lm_head, hidden, rows.view(B, A * self.K), self.cfg.autocast_bf16)
        return logits.view(B, A, self.K, -1)

    # ---- one micro-batch ---------------------------------------------------------------------------
    def batch_loss(
        self, batch: BlockBatch, split: str, denominator: torch.Tensor | float, module: nn.Module | None = None
    ) -> DSparkLoss:
        feats = self.features(batch, split)
        target_logits = self.target_logits(batch, feats.hidden)
        with _autocast(self.cfg.autocast_bf16):
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
        return (position_weights(self.K, self.weights.decay_gamma) * batch.eval_mask).sum()

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
                )
            )
        return out

    # ---- one optimizer step ------------------------------------------------------------------------
    def train_step(self) -> tuple[MetricSums, float]:
        """Run optimizer step ``self.step``; returns (this rank's metric sums, grad norm)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg, self.max_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
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
            sums.add(res, batch.eval_mask, self.weights, float(denom))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += step_tokens(self.step, cfg.batch_size, self.train_data, cfg.seed)
        self.step += 1
        return sums, float(grad_norm)

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
            )
            denom = self._weight_sum(batch)
            res = self.batch_loss(batch, "validation", denom, self.block_forward)
            sums.add(res, batch.eval_mask, self.weights, float(denom))
            depth += tau_by_depth(res.accept_target, batch.eval_mask, batch.anchors, cfg.eval_depth_edges)
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

    def warmup_steps(self) -> int:
        return self.cfg.warmup_for(self.max_steps)

    def clock(self) -> float:
        """Wall-clock seconds of the whole run so far (all sessions), for the learning curve."""
        return round(self.elapsed() if hasattr(self, "_session_start") else self.elapsed_s, 1)

    def run_step(self) -> tuple[MetricSums, float]:
        return self.train_step()

    def record(self, out: tuple[MetricSums, float], dt: float) -> None:
        sums, grad_norm = out
        self.window.values += sums.values
        step = self.step
        if step % self.cfg.log_interval != 0 and step != self.max_steps:
            return
        self.window.values = self.dist.all_sum(self.window.values)
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
        save_checkpoint(self.checkpoint, self, self.log)

    def export(self, stopped_by: str) -> Path:
        from dspark.models.loading import save_drafter

        export = Path(self.cfg.out_dir) / EXPORT_DIR
        save_drafter(self.drafter, export, dtype=self.cfg.export_dtype)
        if self.vocab_ids is not None:  # the engine drafts from the ids it was trained on
            from dspark.spec.draft_vocab import DRAFT_VOCAB_FILE

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
# checkpoints and the run loop
# --------------------------------------------------------------------------------------------------------


def save_checkpoint(path: Path, trainer: DraftTrainer, log: RunLog) -> None:
    blob = {
        "version": CHECKPOINT_VERSION,
        "train_config": trainer.cfg.to_dict(),
        "draft_config": trainer.draft_cfg.to_dict(),
        "trainer": trainer.state_dict(),
        "run": asdict(log),
    }
    atomic_torch_save(blob, path)


def warm_start_(drafter: DSparkDrafter, source: str | Path, target: nn.Module) -> None:
    """Copy the weights of an earlier run into a fresh drafter (new optimizer and schedule): ``source`` is that
    run's out_dir, its ``last.pt`` or an exported drafter dir. The drafter configs must be equal except for the
    position keys (a drafter for a YaRN-extended target starts from the short-context one)."""
    from dspark.models.loading import load_drafter

    src = Path(source)
    ckpt = checkpoint_path(src) if src.is_dir() and checkpoint_path(src).is_file() else src
    if ckpt.is_file():
        blob = torch.load(ckpt, map_location="cpu", weights_only=True)
        if "trainer" not in blob or "draft_config" not in blob:
            raise ValueError(f"--init-from {ckpt}: not a train-draft checkpoint (no trainer/draft_config entries)")
        theirs, state = blob["draft_config"], blob["trainer"]["model"]
    elif (src / "config.json").is_file():
        loaded = load_drafter(src, target)
        theirs, state = loaded.config.to_dict(), loaded.state_dict()
    else:
        raise FileNotFoundError(
            f"--init-from {src}: neither a run dir with checkpoint/last.pt, a .pt checkpoint, nor a drafter export "
            "dir with config.json"
        )
    ours = drafter.config.to_dict()
    diffs = [
        f"{k}: {theirs.get(k)!r} there vs {v!r} here"
        for k, v in ours.items()
        if theirs.get(k) != v and k not in POSITION_KEYS
    ]
    if diffs:
        raise ValueError(f"--init-from {src}: a different drafter ({'; '.join(diffs)}); use the same shape flags")
    with torch.no_grad():
        drafter.load_state_dict({k: v.float() for k, v in state.items()})


def load_checkpoint(path: Path, cfg: DraftTrainConfig) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to resume from; run without --resume to start fresh")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {blob.get('version')} != {CHECKPOINT_VERSION}")
    saved = DraftTrainConfig.from_dict(blob["train_config"])
    diffs = [
        f"{k}: checkpoint {getattr(saved, k)!r} vs now {getattr(cfg, k)!r}"
        for k in SHAPE_FIELDS
        if getattr(saved, k) != getattr(cfg, k)
    ]
    if diffs:
        raise ValueError(
            f"{path}: the checkpoint was trained with different settings ({'; '.join(diffs)}); resume with the "
            "same settings or start a new --out-dir"
        )
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


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n or max(1, min(2, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
        with _threads(threads):
            result = _run(cfg, resume, target, train_data, val_data, dist_info)
        ok = True
        return result
    finally:
        if owns_group:
            shutdown_distributed(synchronize=ok)


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


def _run(cfg, resume, target, train_data, val_data, dist_info: Dist) -> DraftTrainResult:
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.models.loading import load_target

    ckpt = checkpoint_path(cfg.out_dir)
    if not resume and ckpt.exists():
        raise FileExistsError(f"{ckpt} exists; pass --resume to continue it, or choose a new --out-dir")
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
