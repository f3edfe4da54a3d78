"""dspark: DSpark speculative decoding for MLA models."""

__version__ = "0.1.0"
