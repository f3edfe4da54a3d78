"""The model runner: everything that touches tensors (batch building, target/drafter forwards, sampling inputs).

Host/device conversion happens here only; the scheduler and allocator stay pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.cache.allocator import BlockManager
from dspark.cache.pool import CachePools
from dspark.cache.state import SlotStates, StatePool
from dspark.config import ConfigError
from dspark.engine.request import Request
from dspark.models.drafter import DSparkDrafter
from dspark.models.protocol import Target
from dspark.profiling import scope
from dspark.speculative.draft_vocab import DraftVocab
from dspark.speculative.processing import ProcessingTensors
from dspark.speculative.propose import Proposal, SamplingTensors, draft_block, ngram_propose
from dspark.speculative.rng import round_counters

KEY_BUCKET = 64  # key counts of a forward are rounded up to a multiple of this (see padded_keys)
DEFER_ROWS = 64  # deferred drafter-context rows a request may hold before every deferred row is injected


def padded_keys(n: int) -> int:
    """The number of key rows a forward reads for ``n`` visible positions: n rounded up to ``KEY_BUCKET``. The
    extra rows read the scratch slot and are masked. CPU bf16 GEMMs (oneDNN) build and JIT-compile a kernel for
    every new shape (~1.7 ms each here, against ~0.1 ms for the product itself), and decoding grows the key count
    by one per step, so unpadded absorbed-MLA attention paid a fresh compile in every step; padded, a shape
    repeats for ``KEY_BUCKET`` steps."""
    return -(-n // KEY_BUCKET) * KEY_BUCKET


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    write_slots: torch.Tensor  # [B, T]
    read_slots: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, T, S]
    lengths: torch.Tensor  # [B] valid rows per request
    visible: int  # key positions the longest request sees (S before padding to KEY_BUCKET)


class ModelRunner:
    def __init__(
        self,
        target: Target,
        drafter: DSparkDrafter | None,
        blocks: BlockManager,
        pools: CachePools,
        states: StatePool | None = None,
        draft_window: int | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.blocks = blocks
        self.pool = pools.target  # every pool has the same pages: slots computed here index all of them
        self.draft_pool = pools.draft
        self.draft_layer_offset = pools.draft_layer_offset
        self.taps = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
        self.draft_window = draft_window  # the drafter reads the last W context rows (None: all)
        stream = drafter.config.aux_hidden_stream if drafter is not None else None
        if stream is not None and stream not in target.tap_streams:
            raise ConfigError(
                f"draft config: key 'aux_hidden_stream' = {stream!r} is invalid: this target's taps can read "
                f"{list(target.tap_streams)}; drop the key or use one of them"
            )
        # the drafter's stream, passed only when it is not the target's default (K3: "prefix")
        self.tap_args = {"tap_stream": stream} if stream is not None and stream != target.tap_streams[0] else {}
        self.states = states  # per-request recurrent state slots (targets with a state_spec)
        self.draft_vocab: DraftVocab | None = None  # a reduced draft vocabulary (Engine.restrict_draft_vocab)
        self._pending: SlotStates | None = None  # the last forward's new states, installed by commit_states
        # drafter context of steps that did not draft, per request: (first position, taps [T, m·Dt], positions [T],
        # slots [T])
        self._deferred: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    # ---- batch building ------------------------------------------------------------------------------
    def _page_table(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Block tables [B, P] padded with the scratch page (one tensor built from one nested list)."""
        tables = [self.blocks.table(r.request_id).pages for r in reqs]
        width = max(len(p) for p in tables)
        pad = [self.pool.num_pages]
        return torch.tensor([p + pad * (width - len(p)) for p in tables], dtype=torch.long)

    def build(self, reqs: Sequence[Request], starts: Sequence[int], tokens: Sequence[Sequence[int]]) -> Batch:
        """Rows of new tokens at positions start..start+len-1 per request, causal over each request's prefix.

        Built once per step for every layer, with a fixed number of tensor ops whatever the batch size: the
        Python side only flattens the token lists and block tables."""
        lens = [len(t) for t in tokens]
        T, visible = max(lens), max(s + n for s, n in zip(starts, lens))
        S = padded_keys(visible)
        scratch = self.pool.scratch_slot
        lengths = torch.tensor(lens, dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)
        positions = start[:, None] + torch.arange(T)  # [B, T] (padding rows continue past the end)
        valid = torch.arange(T) < lengths[:, None]
        ids = torch.zeros(len(reqs), T, dtype=torch.long)
        ids[valid] = torch.tensor([tok for t in tokens for tok in t], dtype=torch.long)
        keys = torch.arange(S)
        read = self.context_slots(reqs, [s + n for s, n in zip(starts, lens)])  # [B, S]
        write = torch.where(valid, read.gather(1, positions.clamp(max=S - 1)), scratch)  # [B, T]
        positions = torch.where(valid, positions, 0)  # padding rows: position 0, see key 0 only
        mask = keys[None, None, :] <= positions[:, :, None]
        return Batch(ids, positions, write, read, mask, lengths, visible)

    # ---- recurrent state slots --------------------------------------------------------------------------
    def _state_args(self, reqs: Sequence[Request], starts: Sequence[int], batch: Batch, per_row: bool) -> dict:
        """The extra forward arguments of a stateful target: its states' view and each row's valid length.
        A request whose rows start at 0 (new, or recomputed after preemption) starts from a zeroed slot."""
        if self.states is None:
            return {}
        for req, start in zip(reqs, starts):
            if start == 0:
                self.states.acquire(req.request_id)
        self._pending = self.states.view(self.states.slots([r.request_id for r in reqs]), keep_per_row=per_row)
        return {"states": self._pending, "lengths": batch.lengths}

    def commit_states(self, rows: Sequence[int] | None = None, only: int | None = None) -> None:
        """Install the last forward's states: after each request's last row, or after row ``rows[b]`` (a
        verification's accepted prefix: 0 = the anchor alone); ``only``: for batch row ``only`` alone."""
        if self._pending is not None:
            self._pending.commit(None if rows is None else torch.tensor(list(rows), dtype=torch.long), only)

    def state_after(self, b: int, row: int | None = None) -> torch.Tensor:
        """The last forward's new state of batch row ``b`` after its row ``row`` (None: its last valid row)."""
        assert self._pending is not None, "no forward of a stateful target has run"
        return self._pending.after_row(b, row)

    def release_state(self, request_id: str) -> None:
        """A request gives its pages back (finished or preempted): its state slot and deferred context go."""
        self.drop_context(request_id)
        if self.states is not None:
            self.states.release(request_id)

    # ---- forwards --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def target_forward(
        self,
        reqs: Sequence[Request],
        starts: Sequence[int],
        tokens: Sequence[Sequence[int]],
        last_only: bool,
        per_row_states: bool = False,
        defer_context: bool = False,
    ) -> torch.Tensor:
        """Run the target on new tokens, write its latents, inject drafter context; return fp32 logits
        [B, 1, V] at each request's last new row (last_only) or [B, T, V] at every row. A stateful target's new
        states wait for ``commit_states`` (per_row_states: keep the state after every row, for verification).
        ``defer_context``: keep the drafter's context rows (the taps) for ``flush_context`` instead of injecting
        them now (a step that does not draft; see ``flush_context``)."""
        with scope("step.metadata"):
            batch = self.build(reqs, starts, tokens)
        store = self.pool.view(batch.write_slots, batch.read_slots, valid=batch.visible)
        rows = (batch.lengths - 1)[:, None] if last_only else None
        extra = self._state_args(reqs, starts, batch, per_row_states)
        extra |= self.tap_args
        with scope("target.forward"):
            out = self.target(batch.ids, batch.positions, batch.mask, store, self.taps, logits_rows=rows, **extra)
        if self.drafter is not None and out.taps is not None and defer_context:
            self._defer(reqs, starts, out.taps, batch)
        elif self.drafter is not None and out.taps is not None:
            assert self.draft_pool is not None
            draft_store = self.draft_pool.view(
                batch.write_slots, batch.read_slots, self.draft_layer_offset, batch.visible
            )
            with scope("draft.context"):
                self.drafter.inject_context(out.taps, batch.positions, draft_store)
        assert out.logits is not None
        return out.logits

    # ---- deferred drafter context -------------------------------------------------------------------------
    def _defer(self, reqs: Sequence[Request], starts: Sequence[int], taps: torch.Tensor, batch: Batch) -> None:
        """Keep each request's new context rows for a later batched injection. A rerun of the same positions (a
        step retried after an error) replaces the rows it had kept from there on."""
        for b, (req, start, n) in enumerate(zip(reqs, starts, batch.lengths.tolist())):
            rows = self._deferred.setdefault(req.request_id, [])
            while rows and rows[-1][0] >= start:
                rows.pop()
            rows.append((start, taps[b, :n], batch.positions[b, :n], batch.write_slots[b, :n]))
            if len(rows) >= DEFER_ROWS:
                self.flush_context()

    def flush_context(self, request_ids: Sequence[str] | None = None) -> None:
        """Inject the deferred drafter context of ``request_ids`` (None: of every request) in one drafter pass.

        A step that does not draft (the speculation guard or ``disable_by_batch_size`` turned drafting off) still
        taps the target, but the drafter's per-layer context projection, a pass of small products per step, waits
        here: it runs over all kept rows at once before the next draft reads them, before a cached block holding
        them is registered or exported, or once a request has kept ``DEFER_ROWS`` rows. The rows written are the
        ones an immediate injection writes (row by row the same products; only the accumulation order of a batched
        product may differ in the last bit)."""
        ids = list(self._deferred) if request_ids is None else [r for r in request_ids if r in self._deferred]
        rows = [row for rid in ids for row in self._deferred.pop(rid)]
        if not rows:
            return
        assert self.drafter is not None and self.draft_pool is not None
        _, *parts = zip(*rows)
        taps, positions, slots = (torch.cat(part)[None] for part in parts)
        store = self.draft_pool.view(slots, slots[:, :0], self.draft_layer_offset)
        with torch.inference_mode(), scope("draft.context"):
            self.drafter.inject_context(taps, positions, store)

    def drop_context(self, request_id: str) -> None:
        self._deferred.pop(request_id, None)

    @torch.inference_mode()
    def propose_draft(
        self,
        reqs: Sequence[Request],
        sampling: SamplingTensors,
        probabilistic: bool,
        use_markov: bool,
        topk: int | None,
    ) -> Proposal:
        """One drafter block per request; with a draft window the drafter reads only its last ``draft_window``
        context rows (the target still attends to all of them)."""
        assert self.drafter is not None
        self.flush_context()
        with scope("step.metadata"):
            starts = [r.num_computed for r in reqs]
            anchors = torch.tensor([r.all_ids[s] for r, s in zip(reqs, starts)], dtype=torch.long)
            positions = torch.tensor(starts, dtype=torch.long)
            if self.draft_window is None or max(starts, default=0) <= self.draft_window:
                read, rows = self.context_slots(reqs, starts), positions  # (a window that holds it all)
            else:
                read, rows = self.window_slots(reqs, positions, self.draft_window)
            assert self.draft_pool is not None
            valid = int(rows.max()) if len(reqs) else 0  # a window's rows start mid-page: consecutive all the same
            context = self.draft_pool.view(read[:, :0], read, self.draft_layer_offset, valid)  # read only
        return draft_block(
            self.drafter,
            anchors,
            positions,
            context,
            sampling,
            probabilistic,
            use_markov,
            topk,
            context_rows=rows,
            vocab=self.draft_vocab,
        )

    def context_slots(self, reqs: Sequence[Request], ends: Sequence[int]) -> torch.Tensor:
        """[B, padded_keys(max(ends))] flat slots of positions 0..end-1 per request (scratch slot after its end)."""
        page, S = self.pool.page_size, padded_keys(max(ends))
        table = self._page_table(reqs)  # [B, P]
        keys = torch.arange(S)
        read = _slots(table, keys.expand(len(reqs), S).clamp(max=table.shape[1] * page - 1), page)
        return torch.where(keys < torch.tensor(ends, dtype=torch.long)[:, None], read, self.pool.scratch_slot)

    def window_slots(
        self, reqs: Sequence[Request], ends: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``window`` positions before each end: (slots [B, S] left-aligned, scratch after the valid rows;
        valid rows [B] = min(end, window)), with S = max rows. A fixed number of tensor ops for any batch size."""
        page = self.pool.page_size
        rows = ends.clamp(max=window)  # [B]
        keys = torch.arange(padded_keys(int(rows.max())) if len(reqs) else 0)
        valid = keys[None, :] < rows[:, None]  # [B, S]
        pos = torch.where(valid, (ends - rows)[:, None] + keys, 0)  # absolute positions end-rows..end-1
        slots = _slots(self._page_table(reqs), pos, page)
        return torch.where(valid, slots, self.pool.scratch_slot), rows

    @staticmethod
    def propose_ngram(reqs: Sequence[Request], k: int, min_n: int, max_n: int) -> Proposal:
        return ngram_propose([r.all_ids[: r.num_computed + 1] for r in reqs], k, min_n, max_n)

    @staticmethod
    def sampling_tensors(reqs: Sequence[Request], num_slots: int, anchor_offset: int = 0) -> SamplingTensors:
        """Sampling inputs; counters key every uniform by (seed, round anchor, slot, stream). A round anchored
        at position P decides tokens from P+1 on (the first token after a prompt of n: anchor n-1)."""
        anchor_pos = torch.tensor([r.num_computed + anchor_offset for r in reqs], dtype=torch.long)
        return SamplingTensors(
            temperature=torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32),
            top_k=torch.tensor([r.params.top_k for r in reqs], dtype=torch.long),
            top_p=torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32),
            seeds=torch.tensor([r.seed for r in reqs], dtype=torch.long),
            counters=round_counters(anchor_pos, num_slots),
        )

    @staticmethod
    def processing_tensors(
        reqs: Sequence[Request], vocab: int, eos_ids: set[int], allowed: torch.Tensor | None = None
    ) -> ProcessingTensors | None:
        """Logits-processing inputs (spec/processing.py) of a round; ``allowed`` [B, T, V]: the grammar masks
        (spec/grammar.py). None when no request processes its logits."""
        if not any(r.params.processes_logits for r in reqs):
            return None
        B = len(reqs)
        counts, bias = torch.zeros(B, vocab), torch.zeros(B, vocab)
        prompt_seen, min_mask = torch.zeros(B, vocab, dtype=torch.bool), torch.zeros(B, vocab, dtype=torch.bool)
        for i, r in enumerate(reqs):
            p = r.params
            if r.output_ids:
                counts[i] = torch.bincount(torch.tensor(r.output_ids), minlength=vocab)[:vocab].float()
            if p.repetition_penalty != 1.0:
                prompt_seen[i, torch.tensor(r.prompt_ids, dtype=torch.long)] = True
            if p.logit_bias:
                bias[i, torch.tensor(list(p.logit_bias), dtype=torch.long)] = torch.tensor(list(p.logit_bias.values()))
            if p.min_tokens:
                held = sorted({t for t in (*eos_ids, *p.stop_token_ids) if t < vocab})
                min_mask[i, torch.tensor(held, dtype=torch.long)] = True
        return ProcessingTensors(
            counts=counts,
            prompt_seen=prompt_seen,
            presence=torch.tensor([r.params.presence_penalty for r in reqs], dtype=torch.float32),
            frequency=torch.tensor([r.params.frequency_penalty for r in reqs], dtype=torch.float32),
            repetition=torch.tensor([r.params.repetition_penalty for r in reqs], dtype=torch.float32),
            bias=bias,
            min_left=torch.tensor([max(0, r.params.min_tokens - len(r.output_ids)) for r in reqs]),
            min_mask=min_mask,
            allowed=allowed,
        )


def _slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """Flat pool slots of positions [B, N] through block tables [B, P]."""
    return table.gather(1, positions // page) * page + positions % page
