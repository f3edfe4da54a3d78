"""What a target pretraining run is: ``PretrainConfig`` (stored in every checkpoint; ``SHAPE_FIELDS`` must not
change on resume) and the recipes built on it: the K3-mini MLA target (``default_target_config``), its K3-shaped
hybrid (``kimi_k3_mini_config``, ``hybrid_target_config``) and a seconds-long smoke run (``tiny_pretrain_config``).
Imports no torch model code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dspark.config import KimiLinearConfig, RopeConfig, TargetConfig

# ids fixed by dspark.train.tokenizer; the drafter's mask id (3) is draft_config.MASK_ID, the target never needs it
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
ARCHITECTURES = ("deepseek_v3", "kimi_linear")


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

    def warmup_for(self, max_steps: int | None) -> int:
        """Warmup steps of the schedule (fixed, whatever the horizon)."""
        return self.warmup_steps

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
    from dspark.models.families import KIMI_LINEAR, config_header

    n = cfg.num_hidden_layers
    full = sorted({*range(cfg.full_attention_interval, n + 1, cfg.full_attention_interval), n})
    d = mla.to_hf_dict() | config_header(KIMI_LINEAR.model_types[0])
    d |= {
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
