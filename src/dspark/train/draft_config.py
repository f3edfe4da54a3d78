"""What a drafter training run is: ``DraftTrainConfig`` (stored in every checkpoint; ``SHAPE_FIELDS`` must not
change on resume) and the drafter shape it implies for a target (``draft_config_for``, ``spread_taps``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from dspark.config import DraftConfig, GQATargetConfig, KimiLinearConfig, SpeculativeConfig, TargetConfig
from dspark.device import DEVICES
from dspark.models.families import family_of
from dspark.train.loss import LossWeights

MASK_ID = 3  # dspark.train.tokenizer: <|mask|>
TIME_MODE_WARMUP = 50  # warmup steps of a timed run (its horizon is unknown when the warmup starts)


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
    block_size: int = SpeculativeConfig.num_speculative_tokens,  # K: the drafter is trained for the engine's default
    mask_token_id: int = MASK_ID,
    intermediate_size: int | None = None,
) -> DraftConfig:
    """A drafter for ``target`` that shares its page format, shaped by the target's family
    (``dspark.models.families``, ``Family.drafter``): k3_dspark (MLA widths) for an MLA target, DeepSpec's
    Qwen3DSparkModel (the target's KV heads and head_dim) for a GQA target, the MLA drafter of its MLA layers'
    widths with RoPE and no output gate for a hybrid (kimi_linear) target; its hidden size, RoPE and special ids;
    ``num_layers`` layers; taps spread over the target depth (a hybrid's drafter reads the target's default tap
    stream, K3: "prefix")."""
    family = family_of(target)
    if family is None or family.drafter is None:
        raise ValueError(f"{type(target).__name__}: no drafter shape for this target (not a native target family)")
    tap_ids = tuple(taps) if taps is not None else spread_taps(target.num_hidden_layers, num_taps)
    if tap_ids and tap_ids[-1] >= target.num_hidden_layers - 1 and target.num_hidden_layers > 1:
        raise ValueError(
            f"target_layer_ids {list(tap_ids)} include the target's last layer {target.num_hidden_layers - 1}; "
            "its output is the pre-norm final state the drafter must not see — pick earlier layers"
        )
    shape = family.drafter(target)
    shape["intermediate_size"] = intermediate_size or shape["intermediate_size"]
    return DraftConfig(
        **shape,
        num_hidden_layers=num_layers,
        target_layer_ids=tap_ids,
        mask_token_id=mask_token_id,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=confidence,
        confidence_head_with_markov=True,
        block_size=block_size,
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
    block_size: int = SpeculativeConfig.num_speculative_tokens
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
    device: str = "auto"  # auto | cpu | cuda[:N] (dspark.device); not a shape field: a run may resume elsewhere
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
        if self.device.split(":", 1)[0] not in DEVICES:
            raise ValueError(f"DraftTrainConfig.device = {self.device!r}: use one of {', '.join(DEVICES)} (or cuda:N)")
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
