"""dspark: DSpark speculative decoding for MLA models."""

import os

# OpenMP threads that sleep instead of spinning: on a small shared CPU, spinning threads slow torch by up to 10-30x.
# OpenMP reads this when torch loads, so it only takes effect when dspark is imported first (the CLI does).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from dspark.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dspark.sampling_params import SamplingParams

        return SamplingParams
    if name == "SpeculativeConfig":
        from dspark.config import SpeculativeConfig

        return SpeculativeConfig
    raise AttributeError(name)
