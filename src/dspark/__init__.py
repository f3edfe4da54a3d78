"""dspark: DSpark speculative decoding for MLA models."""

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
