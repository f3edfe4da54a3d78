"""The fallback target: any ``transformers`` causal LM whose architecture has no native dspark family.

Its page format is ``tokens``: the paged pool keeps each request's token ids, and every forward recomputes the
visible prefix in one batched transformers pass (O(prefix) per step; the native families keep K/V pages). Tap i is
the raw output of decoder layer i (a forward hook), as on the native targets and in DeepSpec's training cache; HF's
last ``hidden_states`` entry is post-norm.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.config import ConfigError, read_json
from dspark.models.families import model_type
from dspark.models.protocol import CacheView, PageFormat, StateSpec, TargetOutput


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
    """A transformers causal LM behind the ``Target`` protocol (token-id pages, prefix recompute)."""

    tap_streams = ("residual",)  # what a tap can read: the output of its decoder layer

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
            model_type=model_type(c),
        )

    @classmethod
    def load(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, config: Mapping | None = None, hf_config: Any = None
    ) -> HFTarget:
        """``config``: the directory's config.json when the caller has read it already; ``hf_config``: the same as
        a transformers config (then transformers does not read the file again)."""
        from transformers import AutoModelForCausalLM

        config = read_json(path) if config is None else config
        if model_type(config) is None:
            raise ConfigError(f"{path}/config.json: key 'model_type' is missing; is this an HF model directory?")
        given = {} if hf_config is None else {"config": hf_config}
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **given)
        return cls(model.eval())

    @property
    def page_format(self) -> PageFormat:
        return PageFormat("tokens", 1, 1, torch.long)

    @property
    def state_spec(self) -> StateSpec | None:
        return None

    @property
    def invariance_note(self) -> str | None:
        """transformers' modules run every forward: their GEMMs and attention block their sums by the shape."""
        return (
            "transformers' kernels: the batch, the prefill chunks and a prefix-cache hit can change a row's rounding, "
            "and greedy text can then part where two logits tie"
        )

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def _tap_module(self, layer: int) -> nn.Module:
        """Tap ``layer`` reads this module's raw output: decoder layer i, or the embedding for -1."""
        return self.model.get_input_embeddings() if layer == -1 else self.model.get_decoder().layers[layer]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: CacheView | None,
        tap_layers: Sequence[int] = (),
        logits_rows: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Store the new ids, read back each request's visible prefix (key s = position s), recompute it."""
        prefix = input_ids if cache is None else cache.update(0, input_ids[..., None])[..., 0]  # [B, S]
        valid = mask.any(1)  # [B, S]: keys visible to some row = the request's positions 0..end-1
        with _capture_outputs([self._tap_module(i) for i in tap_layers]) as captured:
            out = self.model(input_ids=prefix.long() * valid, attention_mask=valid.long(), output_hidden_states=True)
        at = positions[..., None]  # [B, T, 1]: the new rows in the recomputed sequence
        hidden = out.hidden_states[-1].gather(1, at.expand(-1, -1, out.hidden_states[-1].shape[-1]))
        logits = out.logits.float().gather(1, at.expand(-1, -1, out.logits.shape[-1]))
        if logits_rows is not None:
            logits = logits.gather(1, logits_rows[..., None].expand(-1, -1, logits.shape[-1]))
        taps = None
        if tap_layers:
            hs = torch.cat(captured, -1)
            taps = hs.gather(1, at.expand(-1, -1, hs.shape[-1]))
        return TargetOutput(logits=logits, taps=taps, hidden=hidden)


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
