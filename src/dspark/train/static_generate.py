"""Batched generation in static shapes over the ``Target`` protocol: how regeneration runs on an accelerator.

The engine is built for serving on a CPU: requests that come and go, a paged cache they share, the native kernels.
Regenerating drafter data wants something simpler: hundreds of prompts answered at once on whatever device holds
the target. ``StaticGenerator`` does that with the target's own forward and nothing else:

- prompts are sorted by length and cut into batches of ``batch_size``; a batch gets one contiguous cache page per
  row, ``longest prompt + max new tokens`` positions long (slot ``b·S + p`` holds row b's position p);
- prefill runs the right-padded prompts (``prefill_tokens`` padded tokens per forward at most); a padding row
  writes past its prompt, and the decode step that reaches that position overwrites it before any query sees it;
- every decode step feeds all rows one token at the same shapes ([B, 1] inputs, keys read up to the deepest
  position rounded up to ``READ_ALIGN``, so a batch sees few distinct shapes); finished rows keep computing and
  are ignored; the host checks for the end every ``SYNC_EVERY`` steps only.

Sampling is the engine's plain sampling (``spec.accept.sample_next``): temperature, top-k and top-p processed as
vLLM does, uniforms keyed by (seed, position) on the residual stream, the token after position P drawn as a round
anchored at P. So in fp32 a response equals the engine's for the same prompt and parameters, greedy or seeded
(tested on CPU, where this same code runs), and a row's tokens never depend on the other rows of its batch.
EOS ends a row (the EOS is kept, as the engine keeps it), as do ``stop_token_ids``, ``max_tokens`` and the target's
``max_model_len``. Stop strings need a detokenizer per row and are refused.

Targets with recurrent state (KDA) need the engine's state slots; they are refused with the fix (``--device cpu``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from dspark.cache.pool import PagedPool
from dspark.device import synchronize
from dspark.models.layers import causal_mask
from dspark.sampling_params import SamplingParams
from dspark.speculative.accept import sample_next
from dspark.speculative.propose import SamplingTensors
from dspark.speculative.rng import round_counters

READ_ALIGN = 64  # decode steps read keys up to the deepest position, rounded up to this (few distinct shapes)
SYNC_EVERY = 16  # decode steps between host checks for "every row has finished"


@dataclass(frozen=True)
class StaticStats:
    """What one ``generate`` call did: prompts, generated tokens and the seconds it took (device work included)."""

    prompts: int
    generated_tokens: int
    seconds: float
    batches: int


class StaticGenerator:
    """Generates responses for many prompts at once with ``target`` on its device (see the module docstring)."""

    def __init__(
        self,
        target: Any,
        eos_ids: Sequence[int],
        max_model_len: int,
        batch_size: int = 256,
        prefill_tokens: int = 65536,
        seed: int = 0,
    ) -> None:
        if getattr(target, "state_spec", None) is not None:
            raise ValueError(
                f"static generation needs an attention-only target; {type(target).__name__} keeps recurrent state "
                "per request (KDA): regenerate it with the engine (--device cpu)"
            )
        if batch_size <= 0 or prefill_tokens <= 0:
            raise ValueError(f"batch_size ({batch_size}) and prefill_tokens ({prefill_tokens}) must be positive")
        self.target = target
        self.eos_ids = tuple(sorted(set(int(i) for i in eos_ids)))
        self.max_model_len = max_model_len
        self.batch_size = batch_size
        self.prefill_tokens = prefill_tokens
        self.seed = seed
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.last_stats: StaticStats | None = None

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
        """Responses (token ids, a final EOS included when generated) in the prompts' order."""
        if len(prompts) != len(params):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} sampling parameters")
        for i, (ids, p) in enumerate(zip(prompts, params)):
            if not ids:
                raise ValueError(f"generate: prompt {i} is empty")
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"generate: prompt {i} has {len(ids)} tokens; the target's max_model_len is {self.max_model_len}"
                )
            if p.stop:
                raise ValueError(f"generate: prompt {i} sets stop strings {p.stop!r}; static generation stops on ids")
        t0 = time.perf_counter()
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        batches = 0
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            seeds = [self._seed(i, params[i]) for i in rows]
            for i, resp in zip(rows, self._batch([prompts[i] for i in rows], [params[i] for i in rows], seeds)):
                out[i] = resp
            batches += 1
        synchronize(self.device)  # the seconds include the device's queued work
        self.last_stats = StaticStats(len(prompts), sum(map(len, out)), time.perf_counter() - t0, batches)
        return out

    def _seed(self, index: int, p: SamplingParams) -> int:
        return p.seed if p.seed is not None else zlib.crc32(f"{self.seed}:static-{index}".encode())

    # ---- one batch ---------------------------------------------------------------------------------------------
    def _batch(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], seeds: Sequence[int]
    ) -> list[list[int]]:
        dev = self.device
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        budget = torch.tensor(
            [min(p.max_tokens, self.max_model_len - len(ids)) for ids, p in zip(prompts, params)], dtype=torch.long
        )
        S = int((lens + budget).max())
        fmt = self.target.page_format
        pool = PagedPool(fmt.num_layers, B, S, fmt.width, fmt.dtype or self.dtype, dev)
        base = torch.arange(B, device=dev)[:, None] * S  # row b's slot of position p: b·S + p
        sampling = SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            seeds=torch.tensor(seeds, dtype=torch.long, device=dev),
            counters=torch.zeros(B, 1, dtype=torch.long, device=dev),
        )
        stops = self._stop_table(params)
        lens, budget = lens.to(dev), budget.to(dev)
        last = self._prefill(prompts, pool, base, lens)  # logits [B, V] at each prompt's last position
        tokens = torch.zeros(B, int(budget.max()), dtype=torch.long, device=dev)
        n_out = torch.zeros(B, dtype=torch.long, device=dev)  # tokens each row has kept so far
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        pos = lens - 1  # each row's last committed position (the round anchor of its next token)
        deepest = max(len(p) for p in prompts) - 1  # pos.max(), known on the host (every row advances together)
        for t in range(tokens.shape[1]):
            nxt = sample_next(last, _with_counters(sampling, pos))
            keep = ~done
            tokens[:, t] = torch.where(keep, nxt, 0)
            n_out += keep.long()
            done = done | (keep & stops.gather(1, nxt[:, None]).squeeze(1).bool()) | (n_out >= budget)
            if t + 1 == tokens.shape[1] or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
                break
            pos, deepest = pos + 1, deepest + 1
            reach = min(S, -(-(deepest + 1) // READ_ALIGN) * READ_ALIGN)
            last = self._decode(nxt, pos, reach, pool, base)
        counts = n_out.tolist()
        rows = tokens.tolist()
        return [row[:n] for row, n in zip(rows, counts)]

    def _stop_table(self, params: Sequence[SamplingParams]) -> torch.Tensor:
        """[B, V] 1 where a token ends that row: EOS (unless the row sets ignore_eos) and its stop_token_ids."""
        V = int(self.target.config.vocab_size)
        table = torch.zeros(len(params), V, dtype=torch.uint8)
        for b, p in enumerate(params):
            for t in (*(() if p.ignore_eos else self.eos_ids), *p.stop_token_ids):
                if 0 <= t < V:
                    table[b, t] = 1
        return table.to(self.device)

    def _prefill(
        self, prompts: Sequence[Sequence[int]], pool: PagedPool, base: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """Every prompt through the target (groups of rows of at most ``prefill_tokens`` padded tokens) → fp32
        logits [B, V] at each prompt's last position."""
        dev = self.device
        P = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        ids = ids.to(dev)
        group = max(1, self.prefill_tokens // P)
        positions = torch.arange(P, device=dev)[None, :]
        out = []
        for s in range(0, len(prompts), group):
            e = min(len(prompts), s + group)
            pos = positions.expand(e - s, P)
            store = pool.view(base[s:e] + pos, base[s:e] + pos)
            rows = (lens[s:e] - 1)[:, None]
            res = self.target(ids[s:e], pos, causal_mask(pos, pos), store, logits_rows=rows)
            out.append(res.logits[:, 0].float())
        return torch.cat(out)

    def _decode(
        self, tokens: torch.Tensor, pos: torch.Tensor, reach: int, pool: PagedPool, base: torch.Tensor
    ) -> torch.Tensor:
        """One token per row at positions ``pos`` [B], keys 0..reach-1 visible up to each row's position → fp32
        logits [B, V]."""
        keys = torch.arange(reach, device=self.device)[None, :]
        store = pool.view(base + pos[:, None], base + keys)
        mask = keys[:, None, :] <= pos[:, None, None]  # [B, 1, reach]
        res = self.target(tokens[:, None], pos[:, None], mask, store)
        return res.logits[:, -1].float()


def _with_counters(sampling: SamplingTensors, anchor: torch.Tensor) -> SamplingTensors:
    return replace(sampling, counters=round_counters(anchor, 1))


def load_static_generator(
    model: str, device: torch.device, dtype: str = "auto", batch_size: int = 256, seed: int = 0
) -> tuple[StaticGenerator, Any]:
    """(a StaticGenerator over ``model``'s target on ``device``, its tokenizer). Weights are dense (a GGUF file is
    dequantized: the packed blocks are the CPU kernels' format); dtype "auto" is bf16 on an accelerator and the
    CPU's own choice (``dspark.precision``) here."""
    from dspark.checkpoint.resolve import resolve_model
    from dspark.models.loading import load_target, resolve_precision
    from dspark.models.model_spec import model_spec
    from dspark.tokenizer import load_tokenizer

    spec = model_spec(resolve_model(model))
    if dtype == "auto":
        dtype = "bfloat16" if device.type != "cpu" else resolve_precision(spec, "auto", "none").dtype
    target = load_target(spec, dtype, "none").eval().to(device)
    cfg = target.config
    tok = load_tokenizer(spec, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)
    eos = set(cfg.eos_token_ids) | set(getattr(tok, "eos_token_ids", ()))
    gen = StaticGenerator(target, sorted(eos), cfg.max_position_embeddings, batch_size=batch_size, seed=seed)
    return gen, tok
