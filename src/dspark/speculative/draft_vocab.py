"""A reduced draft vocabulary (EAGLE-3's ``draft_vocab_size``, vLLM's d2t map): the drafter scores only the N most
frequent tokens of the target's own responses, so its lm_head and Markov W2 products shrink from V to N rows.

Lossless by construction: a draft is still a target token id, the draft distribution q is zero outside the N ids,
and verification (standard or block) accepts or rejects against the target's distribution over all V tokens; only
the acceptance rate can change (a token outside the N is never proposed).

File ``draft_vocab.json`` in the drafter's directory, written by
``dspark draft-vocab --data-dir DATASET --out DRAFT_DIR/draft_vocab.json`` (:func:`write_draft_vocab`):
``token_ids`` (most frequent response tokens first, then prompt tokens, then unseen ids), ``counts``,
``default_size`` (what an engine uses when the speculative config leaves ``draft_vocab_size`` unset), ``coverage``
(share of response tokens inside the first N, for a few N) and ``source``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dspark.config import ConfigError
from dspark.models.packing import Linear
from dspark.models.quantized import QuantLinear

DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclass(frozen=True)
class DraftVocab:
    """The N draft ids and the row-sliced products that score them."""

    ids: torch.Tensor  # [N] long: draft index i is target token ids[i]
    lm_head: nn.Module  # [N, D]: rows ids of the lm_head the drafter reads (a Linear, or a QuantLinear)
    markov_w2: Linear | None  # [N, r]: rows ids of the Markov head's W2

    @classmethod
    def for_drafter(cls, drafter: Any, ids: torch.Tensor) -> DraftVocab:
        """Row slices of a drafter's (borrowed) lm_head and Markov W2 for ids [N]. Built per engine, not stored in
        the drafter: engines that share one loaded drafter may draft from different vocabularies. A quantized
        lm_head (a GGUF target's ``QuantLinear``) keeps its rows' blocks: the draft head then reads ~4x fewer bytes
        than dense fp32 rows and runs the same native kernel as the target's head."""
        w2 = drafter.markov_head.markov_w2.weight if drafter.markov_head is not None else None
        head = drafter.lm_head
        if isinstance(head, QuantLinear):
            with torch.inference_mode(False), torch.no_grad():
                ids = ids.to(torch.long).clone()
                return cls(ids, head.rows(ids), None if w2 is None else _rows(w2, ids))
        return cls.build(ids, head.weight, w2)

    @classmethod
    def build(cls, ids: torch.Tensor, lm_head: torch.Tensor, markov_w2: torch.Tensor | None) -> DraftVocab:
        """ids [N]; the full lm_head weight [V, D] and W2 weight [V, r] (or None) whose rows are sliced."""
        with torch.inference_mode(False), torch.no_grad():
            ids = ids.to(torch.long).clone()
            head = _rows(lm_head, ids)
            w2 = None if markov_w2 is None else _rows(markov_w2, ids)
        return cls(ids, head, w2)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Draft indices → target token ids."""
        return self.ids[index]

    def expand(self, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """q [B, N] over the draft ids → [B, V] over the target vocabulary (zero outside the N ids)."""
        return q.new_zeros(q.shape[0], vocab_size).index_copy_(1, self.ids, q)


def _rows(weight: torch.Tensor, ids: torch.Tensor) -> Linear:
    lin = Linear(weight.shape[1], ids.shape[0], bias=False, dtype=weight.dtype)
    lin.weight = torch.nn.Parameter(weight.detach().index_select(0, ids).contiguous(), requires_grad=False)
    return lin


def read_draft_vocab(draft_dir: Path | None, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """The draft ids an engine uses: ``size`` = the speculative config's ``draft_vocab_size`` (None: the file's
    default_size, or the full vocabulary without a file; 0: the full vocabulary). None means no restriction."""
    if size == 0:
        return None
    path = None if draft_dir is None else Path(draft_dir) / DRAFT_VOCAB_FILE
    if path is None or not path.is_file():
        if size is None:
            return None
        where = "the drafter was given in memory" if path is None else f"{path} does not exist"
        raise ConfigError(
            f"speculative config: key 'draft_vocab_size' = {size} needs the drafter's {DRAFT_VOCAB_FILE}, but {where}; "
            "write it with `dspark draft-vocab --data-dir DATASET "
            f"--out {path or DRAFT_VOCAB_FILE}` or drop the key"
        )
    try:
        data = json.loads(path.read_text())
        ids, default = data["token_ids"], data.get("default_size")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a draft vocabulary ({e}); rewrite it with `dspark draft-vocab`") from e
    n = default if size is None else size
    if n is None or n >= vocab_size:
        return None
    if not isinstance(n, int) or n < 1 or n > len(ids):
        raise ConfigError(
            f"{path}: draft_vocab_size {n!r} is invalid: the file ranks {len(ids)} token ids; use 1..{len(ids)} "
            "(or 0 for the full vocabulary)"
        )
    chosen = torch.tensor(ids[:n], dtype=torch.long)
    if int(chosen.min()) < 0 or int(chosen.max()) >= vocab_size or chosen.unique().numel() != n:
        raise ConfigError(f"{path}: token_ids must be distinct ids in [0, {vocab_size}); rewrite the file")
    return chosen


def rank_tokens(data_dirs: list[Path], vocab_size: int | None = None) -> tuple[list[int], list[int], int]:
    """Rank token ids for drafting from the train/validation .npz datasets in ``data_dirs``: by count among the
    supervised (response) tokens, then by count among prompt tokens, then (with ``vocab_size``, so that ids the
    data never showed are ranked too) by id, since BPE gives low ids to early, frequent merges. Returns the ids,
    their response counts and the number of response tokens."""
    resp, prompt = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for d in data_dirs:
        files = [f for f in (d / "train.npz", d / "validation.npz") if f.is_file()]
        if not files:
            raise ConfigError(f"{d}: no train.npz or validation.npz (a `dspark draft-data` output dir)")
        for f in files:
            with np.load(f) as z:
                tokens, mask = z["tokens"].astype(np.int64), z["loss_mask"].astype(bool)
            resp, prompt = _add(resp, np.bincount(tokens[mask])), _add(prompt, np.bincount(tokens[~mask]))
    n = max(len(resp), len(prompt), vocab_size or 0)
    resp, prompt = _add(resp, np.zeros(n, np.int64)), _add(prompt, np.zeros(n, np.int64))
    seen = resp + prompt > 0
    candidates = range(n) if vocab_size is not None else np.flatnonzero(seen).tolist()
    order = sorted(candidates, key=lambda t: (-int(resp[t]), -int(prompt[t]), t))
    return order, [int(resp[t]) for t in order], int(resp.sum())


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n = max(len(a), len(b))
    return np.pad(a, (0, n - len(a))) + np.pad(b, (0, n - len(b)))


def write_draft_vocab(
    data_dirs: list[Path], out: Path, default_size: int | None, vocab_size: int | None, max_size: int
) -> dict[str, Any]:
    """Rank the response tokens of ``data_dirs`` (:func:`rank_tokens`), keep the first ``max_size`` and write them
    to ``out`` (never half-written) → what was written."""
    ids, counts, total = rank_tokens(data_dirs, vocab_size)
    ids, counts = ids[:max_size], counts[:max_size]
    if default_size is not None and not 1 <= default_size <= len(ids):
        raise ConfigError(
            f"--default-size {default_size}: the data ranks {len(ids)} distinct tokens; use 1..{len(ids)}"
        )
    cum = np.cumsum(counts)
    marks = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n < len(ids)] + [len(ids)]
    coverage = {str(n): round(float(cum[n - 1] / total), 5) for n in marks}
    result = {
        "token_ids": ids,
        "counts": counts,
        "default_size": default_size,
        "coverage": coverage,
        "source": {"data_dirs": [str(d) for d in data_dirs], "response_tokens": total},
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(out)
    return result
