"""Each default has one home, its dataclass field: ``from_dict`` of a config.json that holds only the keys a config
cannot do without gives every other field the default the class declares, and the code that builds configs from
arguments (``build_engines``, the doctor's next-step command) reads the same fields."""

from __future__ import annotations

import dataclasses
import inspect
import json
from importlib import resources
from typing import Any

import pytest

from dspark.config import (
    CacheConfig,
    ConfigError,
    DraftConfig,
    EngineConfig,
    GQATargetConfig,
    KimiLinearConfig,
    RopeConfig,
    SpeculativeConfig,
    TargetConfig,
)

OFFICIAL = resources.files("dspark") / "assets" / "formats" / "kimi-k3-dspark.config.json"

MLA_DRAFT = {  # the keys a k3_dspark config.json cannot do without
    "architectures": ["K3DSparkModel"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "target_layer_ids": [0, 2],
    "target_num_hidden_layers": 4,
    "mask_token_id": 3,
}
MLA_TARGET = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def declared_defaults(cls: type) -> dict[str, Any]:
    """field name -> the default the dataclass declares (fields without one are left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def non_defaults(cfg: Any, *given: str) -> dict[str, tuple[Any, Any]]:
    """Fields (other than ``given``) whose value differs from the declared default: name -> (value, default)."""
    return {
        name: (getattr(cfg, name), default)
        for name, default in declared_defaults(type(cfg)).items()
        if name not in given and getattr(cfg, name) != default
    }


def test_from_dict_of_nothing_names_the_first_required_key():
    with pytest.raises(ConfigError, match="'qk_rope_head_dim' is missing"):
        TargetConfig.from_dict({})
    with pytest.raises(ConfigError, match="'num_attention_heads' is missing"):
        GQATargetConfig.from_dict({"model_type": "qwen3"})
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        DraftConfig.from_dict({"architectures": ["K3DSparkModel"]})
    with pytest.raises(ConfigError, match="'num_hidden_layers' is missing"):
        KimiLinearConfig.from_dict({"model_type": "kimi_linear"})


def test_draft_config_defaults_are_the_fields():
    cfg = DraftConfig.from_dict(MLA_DRAFT)
    assert non_defaults(cfg, "extra") == {}  # extra: the keys the class has no field for (here architectures)
    # the two that used to fall back to 0 / False when the key was missing: the official values are the defaults
    assert cfg.markov_rank == 256 and cfg.enable_confidence_head is True
    assert cfg.rope == RopeConfig(dim=DraftConfig.qk_rope_head_dim)


def test_the_official_draft_config_writes_the_defaults_of_its_heads():
    """Dropping the head keys from the official k3_dspark config.json changes nothing: missing means the same."""
    official = json.loads(OFFICIAL.read_text())
    heads = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
    without_heads = {k: v for k, v in official.items() if k not in heads}
    assert DraftConfig.from_dict(without_heads) == DraftConfig.from_dict(official)


def test_deepspec_draft_defaults_are_the_fields_and_its_targets():
    """A Qwen3DSparkModel config copies its Qwen3 target's: a missing rms_norm_eps is the GQA target's default."""
    d = MLA_DRAFT | {"architectures": ["Qwen3DSparkModel"], "num_key_value_heads": 2, "head_dim": 16}
    cfg = DraftConfig.from_dict(d)
    assert non_defaults(cfg, "extra", "num_key_value_heads", "head_dim", "rms_norm_eps") == {}
    assert cfg.rms_norm_eps == GQATargetConfig.rms_norm_eps


def test_target_config_defaults_are_the_fields():
    cfg = TargetConfig.from_dict(MLA_TARGET)
    assert non_defaults(cfg) == {}
    assert cfg.rope == RopeConfig(dim=8)


def test_a_deepseek_config_writing_zero_or_null_for_the_moe_keys_gets_the_defaults():
    cfg = TargetConfig.from_dict(MLA_TARGET | {"moe_intermediate_size": 0, "n_group": None, "topk_group": 0})
    assert non_defaults(cfg) == {}


def test_gqa_target_config_defaults_are_the_fields():
    cfg = GQATargetConfig.from_dict(
        {k: MLA_TARGET[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
        | {"model_type": "llama", "num_attention_heads": 4}
    )
    assert non_defaults(cfg) == {}
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)  # derived: all heads, hidden / heads


def test_rope_config_defaults_are_the_fields():
    assert RopeConfig.from_hf({}, dim=8, source="test") == RopeConfig(dim=8)
    yarn = {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}}
    want = RopeConfig(dim=8, rope_type="yarn", original_max_position_embeddings=64)
    assert RopeConfig.from_hf(yarn, 8, "test") == want


def test_kimi_linear_defaults_are_the_fields():
    experts = {"num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 16}
    d = MLA_TARGET | experts | {"model_type": "kimi_linear", "linear_attn_config": {"num_heads": 2, "head_dim": 8}}
    cfg = KimiLinearConfig.from_dict(d)
    assert non_defaults(cfg, "base", "kda", "layer_types", "mlp_layer_types") == {}
    assert non_defaults(cfg.kda, "hidden_size", "num_heads", "head_dim") == {}


def test_build_engines_reads_its_defaults_from_the_engine_and_cache_configs():
    """build_engines takes the two config objects (their defaults are the only ones); the flat vLLM-style keywords
    of LLM / build_engine fill exactly those configs' fields."""
    from dspark.llm import build_engines, engine_configs

    fields = declared_defaults(EngineConfig) | declared_defaults(CacheConfig)
    params = inspect.signature(build_engines).parameters
    assert len(params) <= 6 and not [name for name in params if name in fields]
    assert engine_configs() == (EngineConfig(), CacheConfig())
    assert len(fields) >= 10
    engine, cache = engine_configs(**fields)
    assert (engine, cache) == (EngineConfig(), CacheConfig())
    with pytest.raises(TypeError, match="max_num_sequences"):
        engine_configs(max_num_sequences=4)


def test_the_doctor_suggests_the_default_number_of_speculative_tokens():
    from dspark.doctor.checks import lossless_command
    from dspark.doctor.context import Context

    spec = lossless_command(Context(None, None)).split("--speculative-config '")[1].split("'")[0]
    assert json.loads(spec)["num_speculative_tokens"] == SpeculativeConfig().num_speculative_tokens
