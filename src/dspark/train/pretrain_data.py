"""Pretraining data: the uint16 token arrays ``train.npy`` / ``validation.npy`` that ``dspark.train.tokenizer``
writes, random training windows drawn by a checkpointable seeded PCG64, contiguous validation windows, and the
vocabulary size of the data's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.train.pretrain_config import PretrainConfig


def load_split(data_dir: Path, split: str) -> np.ndarray:
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
