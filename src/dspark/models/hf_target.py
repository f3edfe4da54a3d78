"""Any ``transformers`` causal LM as a target (Llama / Qwen3 class), behind the MLA target's interface.

HF targets keep no pages in the unified latent pool (their KV layout is not the 576-wide MLA latent): every
forward recomputes the committed prefix in one batched pass (``paged = False``). Tap i is the raw output of
decoder layer i (a forward hook), as on the MLA target and in DeepSpec's training cache; HF's last
``hidden_states`` entry is post-norm. Correct and batched, but O(prefix) per step: use the MLA target for speed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.config import ConfigError, read_json


@dataclass(frozen=True)
class HFTargetInfo:
    """The subset of TargetConfig the engine reads."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str


class HFTarget(nn.Module):
    paged = False
    latent_dim = None

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        c = model.config
        eos = c.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        self.config = HFTargetInfo(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=c.num_hidden_layers,
            max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
            bos_token_id=c.bos_token_id,
            eos_token_ids=eos_ids,
            model_type=c.model_type,
        )

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> HFTarget:
        from transformers import AutoModelForCausalLM

        d = read_json(path)
        if "model_type" not in d:
            raise ConfigError(f"{path}/config.json: key 'model_type' is missing; is this an HF model directory?")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(model.eval())

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def _tap_module(self, layer: int) -> nn.Module:
        """Tap ``layer`` reads this module's raw output: decoder layer i, or the embedding for -1."""
        return self.model.get_input_embeddings() if layer == -1 else self.model.get_decoder().layers[layer]

    def forward_rows(
        self,
        sequences: Sequence[Sequence[int]],
        starts: Sequence[int],
        tap_layers: Sequence[int],
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Full sequences (right-padded into one batch) → fp32 logits [B, T, V] of the rows start..end-1 (or
        [B, 1, V] at the last row) and taps [B, T, m·D] of those rows (zeros in padding)."""
        B = len(sequences)
        S = max(len(s) for s in sequences)
        ids = torch.zeros(B, S, dtype=torch.long)
        attn = torch.zeros(B, S, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            attn[i, : len(s)] = 1
        with _capture_outputs([self._tap_module(i) for i in tap_layers]) as captured:
            out = self.model(input_ids=ids, attention_mask=attn)
        logits = out.logits.float()
        T = max(len(s) - st for s, st in zip(sequences, starts))
        rows = torch.zeros(B, T, dtype=torch.long)
        for i, (s, st) in enumerate(zip(sequences, starts)):
            n = len(s) - st
            rows[i, :n] = torch.arange(st, len(s))
            rows[i, n:] = len(s) - 1
        if last_only:
            last = torch.tensor([len(s) - 1 for s in sequences])
            picked = logits[torch.arange(B), last][:, None]
        else:
            picked = logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))
        taps = None
        if tap_layers:
            hs = torch.cat(captured, -1)
            taps = hs.gather(1, rows[..., None].expand(-1, -1, hs.shape[-1]))
        return picked, taps


@contextmanager
def _capture_outputs(modules: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """Collect each module's forward output (first element of a tuple) in the given order while inside."""
    slots: list[torch.Tensor | None] = [None] * len(modules)

    def hook(i: int):
        def save(_module: nn.Module, _args: object, output: object) -> None:
            slots[i] = output[0] if isinstance(output, tuple) else output  # type: ignore[assignment]

        return save

    captured: list[torch.Tensor] = []
    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
    captured.extend(t for t in slots if t is not None)
