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
shared with the drafter trainer; ``TargetTrainer`` implements its hooks.

Usage: ``dspark train-target --data-dir runs/data/bpe8k --out-dir runs/target --max-minutes 55 [--resume]``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from dspark.config import POSITION_KEYS, KimiLinearConfig, RopeConfig, TargetConfig
from dspark.models.k3 import K3MoE
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.loading import save_kimi_linear, save_target
from dspark.models.target import MLATarget, MoE, MoEGate
from dspark.train.loop import TrainLoop, atomic_torch_save, checkpoint_path, warmup_cosine

EXPORT_DIR = "export"
TRAINING_LOG = "training_log.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHECKPOINT_VERSION = 1
# ids fixed by dspark.train.tokenizer; the drafter uses MASK_ID, so the target never needs it
BOS_ID, EOS_ID, PAD_ID, MASK_ID = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PretrainConfig:
    """Everything a pretraining run depends on; stored in every checkpoint."""

    data_dir: str = "runs/data/bpe8k"
    out_dir: str = "runs/target"
    # optimisation
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    max_steps: int | None = None  # None: derived from max_minutes after probe_steps
    max_minutes: float | None = 55.0  # wall-clock budget for the whole run (across resumes)
    probe_steps: int = 12
    horizon_interval: int = 50  # re-estimate a time-derived horizon every N steps (median of the last N)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    init_std: float = 0.02
    router_bias_update: float = 1e-3  # DeepSeek aux-loss-free bias step γ; 0 disables
    autocast_bf16: bool = True
    seed: int = 0
    num_threads: int | None = None  # None: min(2, cpu count)
    # bookkeeping
    eval_interval: int = 250
    eval_max_windows: int | None = None  # None: the whole validation split
    ckpt_interval: int = 250
    log_interval: int = 10
    export_dtype: str = "bfloat16"
    halt_at_step: int | None = None  # stop (checkpoint, no export) after this step, as if interrupted
    progress: bool = True
    # model shape (K3 MLA latent geometry; deep and narrow elsewhere)
    vocab_size: int | None = None  # None: from the tokenizer / data_manifest.json in data_dir
    hidden_size: int = 256
    num_hidden_layers: int = 12
    num_attention_heads: int = 2
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    rope_theta: float = 10000.0
    yarn_factor: float = 4.0
    original_max_position_embeddings: int | None = None  # None: seq_len
    # continued pre-training: start from this model directory's weights (same shapes; the positions — YaRN factor,
    # original window, θ — may differ: that is context extension) with a fresh optimizer and schedule
    init_from: str | None = None
    eval_seq_len: int | None = None  # validation window (None: seq_len); may exceed seq_len to test extrapolation
    # "deepseek_v3": MLA in every layer; "kimi_linear": K3's hybrid (KDA layers, MLA-NoPE with output gate every
    # ``full_attention_interval``-th layer and the last, SiTU, latent MoE, AttnRes); the MLA fields above apply to
    # both, the ones below only to kimi_linear
    architecture: str = "deepseek_v3"
    full_attention_interval: int = 4
    kda_num_heads: int = 2
    kda_head_dim: int = 128
    kda_gate_lower_bound: float | None = -5.0  # K3's bounded gate; None: Kimi Linear's −e^A·softplus
    kda_chunk_size: int = 16  # rows per chunk of the chunkwise KDA in training (the result does not depend on it)
    hidden_act: str = "situ"
    moe_latent_size: int | None = 128
    attn_res_block_size: int | None = 4
    mla_use_output_gate: bool = True

    def __post_init__(self) -> None:
        for name in (
            "seq_len",
            "batch_size",
            "warmup_steps",
            "eval_interval",
            "ckpt_interval",
            "log_interval",
            "horizon_interval",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PretrainConfig.{name} = {v!r}: must be a positive integer")
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("PretrainConfig: set max_steps or max_minutes (or both)")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"PretrainConfig.max_steps = {self.max_steps}: must be positive")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"PretrainConfig.max_minutes = {self.max_minutes}: must be positive")
        if self.max_steps is None and not 2 <= self.probe_steps <= self.warmup_steps:
            raise ValueError(
                f"PretrainConfig.probe_steps = {self.probe_steps}: must be in [2, warmup_steps="
                f"{self.warmup_steps}] so the derived cosine horizon does not change the schedule already run"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"PretrainConfig.min_lr_ratio = {self.min_lr_ratio}: must be in [0, 1]")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError(f"PretrainConfig: lr ({self.lr}) and grad_clip ({self.grad_clip}) must be positive")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"PretrainConfig.architecture = {self.architecture!r}: use one of {list(ARCHITECTURES)}")

    @property
    def time_mode(self) -> bool:
        """The cosine horizon is derived from max_minutes and the measured step time."""
        return self.max_steps is None

    @property
    def original_context(self) -> int:
        return self.original_max_position_embeddings or self.seq_len

    def target_config(self, vocab_size: int) -> TargetConfig | KimiLinearConfig:
        mla = self.mla_config(vocab_size)
        return mla if self.architecture == "deepseek_v3" else hybrid_target_config(mla, self)

    def mla_config(self, vocab_size: int) -> TargetConfig:
        return default_target_config(
            vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=self.n_shared_experts,
            first_k_dense_replace=self.first_k_dense_replace,
            rope_theta=self.rope_theta,
            yarn_factor=self.yarn_factor,
            original_max_position_embeddings=self.original_context,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PretrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


ARCHITECTURES = ("deepseek_v3", "kimi_linear")

# model-shape fields: a resumed run must use the same ones as the checkpoint
SHAPE_FIELDS: tuple[str, ...] = (
    "architecture",
    "full_attention_interval",
    "kda_num_heads",
    "kda_head_dim",
    "kda_gate_lower_bound",
    "hidden_act",
    "moe_latent_size",
    "attn_res_block_size",
    "mla_use_output_gate",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "rope_theta",
    "yarn_factor",
    "original_max_position_embeddings",
)


def position_buckets(length: int, first: int) -> list[tuple[int, int]]:
    """[start, end) position buckets over ``length`` positions: [0, first), then doubling ([first, 2·first), …)."""
    edges = [0]
    while edges[-1] < length:
        edges.append(min(length, first if edges[-1] == 0 else 2 * edges[-1]))
    return list(zip(edges[:-1], edges[1:]))


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


def tiny_pretrain_config(data_dir: str, out_dir: str, **overrides: Any) -> PretrainConfig:
    """A seconds-long smoke run: a 2-layer MoE model with small latent dims (not the K3 geometry)."""
    base = PretrainConfig(
        data_dir=data_dir,
        out_dir=out_dir,
        seq_len=32,
        batch_size=4,
        lr=3e-3,
        warmup_steps=5,
        max_steps=30,
        max_minutes=None,
        probe_steps=2,
        eval_interval=10,
        eval_max_windows=8,
        ckpt_interval=10,
        log_interval=5,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_threads=1,
        kda_head_dim=16,
        moe_latent_size=16,
        attn_res_block_size=1,
    )
    return replace(base, **overrides)


def default_target_config(
    vocab_size: int,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 2,
    q_lora_rank: int | None = None,
    kv_lora_rank: int = 512,
    qk_nope_head_dim: int = 128,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 128,
    intermediate_size: int = 768,
    moe_intermediate_size: int = 256,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    rope_theta: float = 10000.0,
    yarn_factor: float = 4.0,
    original_max_position_embeddings: int = 512,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
    pad_token_id: int = PAD_ID,
) -> TargetConfig:
    """The K3-mini target: DeepSeek-V3 MLA with K3's 576-wide latent, dense first layer, then MoE layers with
    sigmoid routing + e_score_correction_bias (noaux_tc, one group) and one shared expert; YaRN (factor 4,
    beta 32/1, mscale 1/1) over ``original_max_position_embeddings`` with 4× that as the maximum length."""
    rope = RopeConfig(
        dim=qk_rope_head_dim,
        theta=rope_theta,
        rope_type="yarn",
        factor=yarn_factor,
        original_max_position_embeddings=original_max_position_embeddings,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        interleave=True,
    )
    return TargetConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        max_position_embeddings=int(original_max_position_embeddings * yarn_factor),
        rope=rope,
        moe_intermediate_size=moe_intermediate_size,
        n_routed_experts=n_routed_experts,
        n_shared_experts=n_shared_experts,
        num_experts_per_tok=num_experts_per_tok,
        first_k_dense_replace=first_k_dense_replace,
        routed_scaling_factor=1.0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def kimi_k3_mini_config(**overrides: Any) -> PretrainConfig:
    """The bundled K3-shaped hybrid (``kimi-k3-mini``): k3-mini's widths with K3's layout — KDA:MLA 3:1 (MLA at
    1-based 4, 8, 12), MLA-NoPE with the sigmoid output gate, SiTU, latent MoE (256 → 128), AttnRes blocks of 4."""
    return replace(PretrainConfig(architecture="kimi_linear", out_dir="runs/kimi-target"), **overrides)


def hybrid_target_config(mla: TargetConfig, cfg: PretrainConfig) -> KimiLinearConfig:
    """A ``kimi_linear`` config over the MLA/MoE widths of ``mla``: MLA (NoPE, output gate) at 1-based layers
    ``full_attention_interval``, 2·interval, … and the last; KDA everywhere else; K3's additions per ``cfg``.
    The YaRN RoPE of ``mla`` stays in the config for the drafter (the target's MLA never rotates)."""
    n = cfg.num_hidden_layers
    full = sorted({*range(cfg.full_attention_interval, n + 1, cfg.full_attention_interval), n})
    d = mla.to_hf_dict() | {
        "model_type": "kimi_linear",
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_use_output_gate,
        "hidden_act": cfg.hidden_act,
        "routed_scaling_factor": mla.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "mlp_layer_types": ["dense" if i < cfg.first_k_dense_replace else "sparse" for i in range(n)],
        "linear_attn_config": {
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": 4,
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, n + 1) if i not in full],
        },
    }
    for key in ("moe_latent_size", "attn_res_block_size"):
        if getattr(cfg, key) is not None:
            d[key] = getattr(cfg, key)
    if cfg.kda_gate_lower_bound is not None:
        d["linear_attn_config"]["gate_lower_bound"] = cfg.kda_gate_lower_bound
    hybrid = KimiLinearConfig.from_dict(d, source="PretrainConfig (kimi_linear)")
    return replace(hybrid, kda=replace(hybrid.kda, chunk_size=cfg.kda_chunk_size))


def build_target(cfg: PretrainConfig, vocab_size: int) -> MLATarget | KimiLinearTarget:
    tcfg = cfg.target_config(vocab_size)
    return KimiLinearTarget(tcfg) if isinstance(tcfg, KimiLinearConfig) else MLATarget(tcfg)


# --------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------


def _load_split(data_dir: Path, split: str) -> np.ndarray:
    path = data_dir / f"{split}.npy"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; build the data with `python -m dspark.train.corpus runs/data/corpus` and "
            f"`python -m dspark.train.tokenizer runs/data/corpus {data_dir} --vocab-size 8192`"
        )
    return np.load(path, mmap_mode="r", allow_pickle=False)


def resolve_vocab_size(cfg: PretrainConfig) -> int:
    """cfg.vocab_size, else tokenizer.json's vocab, else data_manifest.json's vocab_size."""
    if cfg.vocab_size is not None:
        return cfg.vocab_size
    d = Path(cfg.data_dir)
    if (d / "tokenizer.json").is_file():
        from dspark.tokenizer import load_tokenizer

        return load_tokenizer(d).vocab_size
    manifest = d / "data_manifest.json"
    if manifest.is_file():
        return int(json.loads(manifest.read_text())["vocab_size"])
    raise FileNotFoundError(f"{d}: no tokenizer.json or data_manifest.json to read the vocab size; set vocab_size")


class TokenWindows:
    """Random ``[B, T+1]`` windows of a token array, drawn by a seeded PCG64 whose state is checkpointable."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.ndim != 1 or tokens.size < seq_len + 2:
            raise ValueError(f"token array of shape {tokens.shape} is too short for seq_len={seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self) -> torch.Tensor:
        """→ int64 [B, T+1]."""
        starts = self.rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.batch_size)
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def validation_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Contiguous, non-overlapping windows → int64 [N, T+1] (the tail that does not fit is dropped)."""
    n = (tokens.size - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n <= 0:
        raise ValueError(f"validation split ({tokens.size} tokens) is shorter than seq_len+1={seq_len + 1}")
    rows = [np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in range(n)]
    return torch.from_numpy(np.stack(rows))


# --------------------------------------------------------------------------------------------------------
# model, optimiser, schedule
# --------------------------------------------------------------------------------------------------------


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


def lr_at(step: int, cfg: PretrainConfig, max_steps: int | None) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to lr·min_lr_ratio."""
    return warmup_cosine(step, cfg.lr, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)


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


def save_checkpoint(
    path: Path,
    cfg: PretrainConfig,
    model: MLATarget,
    opt: torch.optim.Optimizer,
    loader: TokenWindows,
    state: _RunState,
) -> None:
    """One file, written to a temporary name and moved into place."""
    blob = {
        "version": CHECKPOINT_VERSION,
        "pretrain_config": cfg.to_dict(),
        "target_config": model.config.to_hf_dict(),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "schedule": {"step": state.step, "max_steps": state.max_steps, "warmup_steps": cfg.warmup_steps},
        "loader": loader.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "run": asdict(state),
    }
    atomic_torch_save(blob, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to resume from; run without --resume to start fresh")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if blob.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint version {blob.get('version')} != {CHECKPOINT_VERSION}")
    return blob


def _check_resume_shape(saved: dict[str, Any], cfg: PretrainConfig, path: Path) -> None:
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(cfg, k)!r}"
        for k in SHAPE_FIELDS + ("seq_len", "vocab_size")
        if saved.get(k) != getattr(cfg, k)
    ]
    if diffs:
        raise ValueError(
            f"{path}: the checkpoint was trained with a different model/data shape ({'; '.join(diffs)}); "
            "resume with the same settings or start a new --out-dir"
        )


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


def _autocast(cfg: PretrainConfig):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16)


@torch.no_grad()
def evaluate(model: MLATarget, windows: torch.Tensor, cfg: PretrainConfig) -> tuple[float, torch.Tensor]:
    """Next-token cross-entropy over the windows [N, T+1] (same autocast as training) → (mean loss, mean loss at
    each of the T positions [T])."""
    was_training = model.training
    model.eval()
    per_position = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for i in range(0, windows.shape[0], cfg.batch_size):
        batch = windows[i : i + cfg.batch_size]
        with _autocast(cfg):
            logits = model(batch[:, :-1], absorbed=False).logits
        loss = F.cross_entropy(logits.transpose(1, 2).float(), batch[:, 1:], reduction="none")  # [b, T]
        per_position += loss.double().sum(0)
    model.train(was_training)
    per_position /= windows.shape[0]
    return float(per_position.mean()), per_position


def bucketed_ppl(per_position: torch.Tensor, first: int) -> dict[str, float]:
    """Perplexity per position bucket ("0-511": ppl, …) of per-position mean losses."""
    return {
        f"{a}-{b - 1}": round(math.exp(float(per_position[a:b].mean())), 3)
        for a, b in position_buckets(per_position.numel(), first)
    }


def train_step(model: MLATarget, batch: torch.Tensor, cfg: PretrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward on batch [B, T+1]; returns (loss, grad norm before clipping)."""
    with _autocast(cfg):
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
    save = save_kimi_linear if isinstance(model, KimiLinearTarget) else save_target
    save(model, out, dtype=cfg.export_dtype)
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
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads or max(1, min(2, os.cpu_count() or 1)))
    try:
        trainer = TargetTrainer(cfg, resume)
        stopped_by = trainer.run()
        return trainer.result(stopped_by)
    finally:
        torch.set_num_threads(threads)


class _StepOut(NamedTuple):
    loss: float
    grad_norm: float
    lr: float
    imbalance: float


class TargetTrainer(TrainLoop[_StepOut]):
    """Pretraining on the shared loop: random windows, AdamW, the router-bias nudge, validation perplexity."""

    eval_at_start = True

    def __init__(self, cfg: PretrainConfig, resume: bool) -> None:
        ckpt = checkpoint_path(cfg.out_dir)
        if not resume and ckpt.exists():
            raise FileExistsError(f"{ckpt} exists; pass --resume to continue it, or choose a new --out-dir")
        data_dir = Path(cfg.data_dir)
        self.cfg = cfg = replace(cfg, vocab_size=resolve_vocab_size(cfg))
        assert cfg.vocab_size is not None
        train_tokens = _load_split(data_dir, "train")
        self.val = validation_windows(
            _load_split(data_dir, "validation"), cfg.eval_seq_len or cfg.seq_len, cfg.eval_max_windows
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
        blob = load_checkpoint(ckpt)
        _check_resume_shape(blob["pretrain_config"], self.cfg, ckpt)
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

    def warmup_steps(self) -> int:
        return self.cfg.warmup_steps

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
        lr = lr_at(self.step, self.cfg, self.max_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
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
        save_checkpoint(self.checkpoint, self.cfg, self.model, self.opt, self.loader, self.state)

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
