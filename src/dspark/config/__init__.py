"""Frozen configuration dataclasses: target, drafter, speculative decoding, cache and engine.

Every default lives here once, on its dataclass field; the CLI and the engine read them from these classes, and
each ``from_dict`` leaves a missing key to the field's default. Builders take the HF-style ``config.json`` dicts (or
vLLM-style ``--speculative-config`` JSON) and raise ``ConfigError`` naming the offending key, its value and the fix.

One module per topic; import the names from ``dspark.config``:
- common.py    ConfigError, read_json and the helpers every ``from_dict`` uses
- rope.py      RopeConfig (default / linear / llama3 / YaRN) and YaRN's scalars
- target.py    MLAConfig (attention geometry), TargetConfig (DeepSeek-V3 / Kimi-K2), GQATargetConfig (Llama / Qwen)
- kimi.py      KDAConfig and KimiLinearConfig (the Kimi Linear / K3 hybrid target)
- draft.py     DraftConfig (k3_dspark and DeepSpec Qwen3DSparkModel drafters)
- backends.py  attention backend names: ours and vLLM's
- runtime.py   SpeculativeConfig, CacheConfig, EngineConfig
"""

from dspark.config.backends import (
    ATTENTION_BACKENDS,
    VLLM_ATTENTION_BACKENDS,
    BackendSubstitutionWarning,
    attention_backend,
)
from dspark.config.common import RANDOM_WEIGHTS_KEY, REDUCED_VOCAB_FIX, ConfigError, read_json
from dspark.config.draft import DRAFT_ARCHITECTURES, MARKOV_HEAD_TYPES, TAP_STREAMS, DraftConfig
from dspark.config.kimi import KIMI_LAYER_TYPES, KIMI_MLP_TYPES, KDAConfig, KimiLinearConfig
from dspark.config.rope import POSITION_KEYS, ROPE_TYPES, RopeConfig, attention_scale, yarn_get_mscale
from dspark.config.runtime import (
    AUTO,
    DRAFT_QUANTIZATIONS,
    DTYPE_CHOICES,
    DTYPES,
    QUANTIZATIONS,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    SpeculativeConfig,
)
from dspark.config.target import (
    GGUF_ARCHS,
    GQA_MODEL_TYPES,
    MLA_MODEL_TYPES,
    GQATargetConfig,
    MLAConfig,
    TargetConfig,
    gqa_header,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO",
    "DTYPE_CHOICES",
    "DRAFT_ARCHITECTURES",
    "DTYPES",
    "GGUF_ARCHS",
    "GQA_MODEL_TYPES",
    "KIMI_LAYER_TYPES",
    "KIMI_MLP_TYPES",
    "MARKOV_HEAD_TYPES",
    "MLA_MODEL_TYPES",
    "POSITION_KEYS",
    "DRAFT_QUANTIZATIONS",
    "QUANTIZATIONS",
    "RANDOM_WEIGHTS_KEY",
    "REDUCED_VOCAB_FIX",
    "ROPE_TYPES",
    "SPEC_METHODS",
    "TAP_STREAMS",
    "VLLM_ATTENTION_BACKENDS",
    "BackendSubstitutionWarning",
    "CacheConfig",
    "ConfigError",
    "DraftConfig",
    "EngineConfig",
    "GQATargetConfig",
    "KDAConfig",
    "KimiLinearConfig",
    "MLAConfig",
    "RopeConfig",
    "SpeculativeConfig",
    "TargetConfig",
    "attention_backend",
    "attention_scale",
    "gqa_header",
    "read_json",
    "yarn_get_mscale",
]
