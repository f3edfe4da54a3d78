"""Tiny random target + drafter pairs built from the real config classes (tests, demos, bench smoke runs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from dspark.config import (
    RANDOM_WEIGHTS_KEY,
    DraftConfig,
    GQATargetConfig,
    KimiLinearConfig,
    RopeConfig,
    TargetConfig,
    gqa_header,
)
from dspark.models.drafter import DSparkDrafter
from dspark.models.families import GQA_DRAFTER, KIMI_LINEAR, config_header
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.llama import LlamaTarget
from dspark.models.target import MLATarget

T = TypeVar("T", MLATarget, LlamaTarget, KimiLinearTarget)


def tiny_target_config(
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 4,
    moe: bool = True,
    q_lora_rank: int | None = 24,
    yarn: bool = True,
) -> TargetConfig:
    rope = RopeConfig(
        dim=8,
        theta=10000.0,
        rope_type="yarn" if yarn else "default",
        factor=4.0 if yarn else 1.0,
        original_max_position_embeddings=64 if yarn else None,
        mscale_all_dim=1.0 if yarn else 0.0,
    )
    return TargetConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=512,
        rope=rope,
        moe_intermediate_size=16 if moe else 0,
        n_routed_experts=4 if moe else None,
        n_shared_experts=1 if moe else None,
        num_experts_per_tok=2 if moe else None,
        first_k_dense_replace=1,
        n_group=2 if moe else 1,
        topk_group=1,
        routed_scaling_factor=1.5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def tiny_draft_config(
    target: TargetConfig,
    num_layers: int = 2,
    markov_rank: int = 8,
    head_type: str = "vanilla",
    taps: tuple[int, ...] | None = None,
    confidence: bool = True,
    block_size: int | None = None,
) -> DraftConfig:
    taps = taps or tuple(sorted({0, max(target.num_hidden_layers - 2, 0)}))
    return DraftConfig(
        architecture="K3DSparkModel",
        hidden_size=target.hidden_size,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        vocab_size=target.vocab_size,
        target_layer_ids=taps,
        target_hidden_size=target.hidden_size,
        target_num_hidden_layers=target.num_hidden_layers,
        mask_token_id=3,
        rope=replace(target.rope),
        max_position_embeddings=target.max_position_embeddings,
        q_lora_rank=16,
        kv_lora_rank=target.kv_lora_rank,
        qk_nope_head_dim=8,
        qk_rope_head_dim=target.qk_rope_head_dim,
        v_head_dim=8,
        markov_rank=markov_rank,
        markov_head_type=head_type,
        enable_confidence_head=confidence,
        confidence_head_with_markov=True,
        block_size=block_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Deterministic random weights (norm weights near 1) so tiny models have peaked, varied outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def build_tiny_pair(
    seed: int = 0, target_cfg: TargetConfig | None = None, draft_cfg: DraftConfig | None = None
) -> tuple[MLATarget, DSparkDrafter]:
    tcfg = target_cfg or tiny_target_config()
    dcfg = draft_cfg or tiny_draft_config(tcfg)
    return _randomized_pair(MLATarget(tcfg), dcfg, seed)


def _randomized_pair(target: T, draft_cfg: DraftConfig, seed: int) -> tuple[T, DSparkDrafter]:
    """Random weights for a target and a drafter built for it (which borrows its embedding and lm_head)."""
    randomize_(target, seed)
    # a sharper lm_head gives the tiny target low-entropy, drafter-friendly distributions
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    drafter = DSparkDrafter(draft_cfg)
    randomize_(drafter, seed + 1)
    drafter.attach(target.embed_tokens, target.lm_head)
    return target.eval(), drafter.eval()


def write_tiny_pair(directory: str | Path, seed: int = 0, **kw) -> tuple[Path, Path]:
    """Save a tiny random pair as HF-style directories ``<dir>/target`` and ``<dir>/draft``."""
    from dspark.models.loading import save_target

    return _save_pair(Path(directory), *build_tiny_pair(seed, **kw), save_target)


def _save_pair(directory: Path, target: Any, drafter: DSparkDrafter, save_target: Callable) -> tuple[Path, Path]:
    """``<dir>/target`` (marked as random test weights) and ``<dir>/draft`` (float32)."""
    from dspark.models.loading import save_drafter

    save_target(target, directory / "target")
    save_drafter(drafter, directory / "draft", dtype="float32")
    mark_random_weights(directory / "target")
    return directory / "target", directory / "draft"


def mark_random_weights(model_dir: str | Path) -> None:
    """Mark a saved model as explicitly random test weights: only such a model may run without a tokenizer
    file (a byte tokenizer stands in; the doctor refuses any other target without tokenizer.json)."""
    p = Path(model_dir) / "config.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | {RANDOM_WEIGHTS_KEY: True}, indent=2))


# ---- GQA (Llama / Qwen2 / Qwen3) pairs with DeepSpec-style Qwen3DSpark drafters --------------------------------


def tiny_gqa_config(model_type: str = "llama", vocab_size: int = 96, num_layers: int = 4) -> GQATargetConfig:
    """4 query heads over 2 KV heads of 8: pages of 2·2·8 = 32 values per token per layer."""
    return GQATargetConfig.from_dict(tiny_gqa_raw(model_type, vocab_size, num_layers))


def tiny_gqa_raw(model_type: str = "llama", vocab_size: int = 96, num_layers: int = 4) -> dict[str, Any]:
    """The config.json of ``tiny_gqa_config``."""
    return config_header(model_type) | {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": model_type == "llama",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def tiny_gqa_draft_config(
    target: GQATargetConfig, share_pages: bool = True, markov_rank: int = 8, block_size: int | None = None
) -> DraftConfig:
    """A Qwen3DSparkModel drafter; with ``share_pages`` it has the target's KV geometry (one shared pool)."""
    return DraftConfig.from_dict(
        config_header("qwen3", GQA_DRAFTER)
        | {
            "hidden_size": target.hidden_size,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": target.num_key_value_heads if share_pages else 1,
            "head_dim": target.head_dim,
            "vocab_size": target.vocab_size,
            "rope_theta": target.rope.theta,
            "max_position_embeddings": target.max_position_embeddings,
            "num_target_layers": target.num_hidden_layers,
            "target_layer_ids": sorted({0, max(target.num_hidden_layers - 2, 0)}),
            "block_size": block_size,
            "mask_token_id": 3,
            "markov_rank": markov_rank,
            "enable_confidence_head": True,
            "torch_dtype": "float32",
        }
    )


def build_tiny_gqa_pair(
    seed: int = 0, target_cfg: GQATargetConfig | None = None, draft_cfg: DraftConfig | None = None
) -> tuple[LlamaTarget, DSparkDrafter]:
    tcfg = target_cfg or tiny_gqa_config()
    return _randomized_pair(LlamaTarget(tcfg), draft_cfg or tiny_gqa_draft_config(tcfg), seed)


def write_tiny_gqa_pair(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random Llama target (HF layout: config.json + model.safetensors, tied embeddings) and its Qwen3DSpark
    drafter as ``<dir>/target`` and ``<dir>/draft``."""
    from dspark.checkpoint.io import save_state_dict

    raw = tiny_gqa_raw()
    target, drafter = build_tiny_gqa_pair(seed, target_cfg=GQATargetConfig.from_dict(raw))

    def save(model: Any, path: Path) -> None:
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.") and k != "lm_head.weight"}
        save_state_dict(state, path)
        (path / "config.json").write_text(json.dumps(raw | gqa_header("llama"), indent=2))

    return _save_pair(Path(directory), target, drafter, save)


# ---- hybrid KDA + MLA (Kimi Linear / K3-shaped) targets with the MLA drafter ----------------------------------


def tiny_hybrid_config(k3: bool = True, vocab_size: int = 96, num_layers: int = 6) -> KimiLinearConfig:
    """KDA and MLA layers 3:1-ish (MLA at 1-based 4 and the last); ``k3`` adds AttnRes (block 2), latent MoE, SiTU,
    the KDA gate lower bound and the MLA output gate."""
    full = sorted({4, num_layers})
    lac = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "full_attn_layers": full}
    lac["kda_layers"] = [i for i in range(1, num_layers + 1) if i not in full]
    d = {
        **config_header(KIMI_LINEAR.model_types[0]),
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "mla_use_nope": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 512,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "linear_attn_config": lac,
    }
    if k3:
        d |= {"hidden_act": "situ", "moe_latent_size": 12, "attn_res_block_size": 2, "mla_use_output_gate": True}
        lac["gate_lower_bound"] = -5.0
    return KimiLinearConfig.from_dict(d)


def build_tiny_hybrid_pair(
    seed: int = 0, target_cfg: KimiLinearConfig | None = None, draft_cfg: DraftConfig | None = None
) -> tuple[KimiLinearTarget, DSparkDrafter]:
    tcfg = target_cfg or tiny_hybrid_config()
    dcfg = draft_cfg or tiny_draft_config(tcfg.base)
    return _randomized_pair(KimiLinearTarget(tcfg), dcfg, seed)


def write_tiny_hybrid_pair(directory: str | Path, seed: int = 0, **kw) -> tuple[Path, Path]:
    """Save a tiny random hybrid pair as ``<dir>/target`` (kimi_linear) and ``<dir>/draft``."""
    from dspark.models.loading import save_kimi_linear

    return _save_pair(Path(directory), *build_tiny_hybrid_pair(seed, **kw), save_kimi_linear)
