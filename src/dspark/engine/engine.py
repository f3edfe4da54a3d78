"""The speculative engine: schedule → prefill | propose → choose verify lengths → verify → accept → commit."""

from __future__ import annotations

import itertools
import logging
import math
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import dspark.tuning as tuning
from dspark.cache.allocator import BlockManager, PageAllocator
from dspark.cache.pool import CachePools
from dspark.cache.prefix import PrefixCache
from dspark.cache.state import StatePool
from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.engine.caching import PrefixCaching
from dspark.engine.grouping import length_groups
from dspark.engine.metrics import EngineMetrics, SpecDecodingMetrics
from dspark.engine.request import Request, Status
from dspark.engine.runner import ModelRunner
from dspark.engine.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from dspark.models.drafter import DSparkDrafter
from dspark.models.families import model_type
from dspark.models.layers import DecoderTarget
from dspark.models.packing import pack_for_inference
from dspark.models.protocol import Target
from dspark.profiling import scope
from dspark.sampling_params import SamplingParams
from dspark.speculative.accept import accept, sample_next
from dspark.speculative.draft_vocab import DraftVocab, read_draft_vocab
from dspark.speculative.grammar import GrammarCompiler, GrammarError, GrammarMatcher, grammar_masks
from dspark.speculative.guard import SpeculationGuard
from dspark.speculative.logprobs import TokenLogprobs, token_logprobs
from dspark.speculative.processing import process
from dspark.speculative.propose import Proposal, SamplingTensors
from dspark.speculative.schedule import SpsTable, choose_verify_lengths, default_cost_model, load_sts
from dspark.tokenizer import ByteTokenizer, HFTokenizer

if TYPE_CHECKING:
    from dspark.precision import Precision

logger = logging.getLogger("dspark.engine")


class EngineError(ValueError):
    """A request cannot be served as given (the message says why and what to change)."""


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request, in vLLM's names (``error`` is dspark's: what raised while it was processed, set when
    ``finish_reason == "error"``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids (SamplingParams.logprobs set)


@dataclass(frozen=True)
class RequestOutput:
    """One request, vLLM's shape: ``outputs`` holds its samples (one per engine request; ``LLM.generate`` gathers
    ``SamplingParams.n`` of them). ``text``, ``token_ids``, ``finish_reason``, ``stop_reason`` and ``error`` are
    aliases of ``outputs[0]``'s. ``spec_metrics``, the timings and the counts cover all samples."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_metrics: dict = field(default_factory=dict)
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit supplied (vLLM's RequestOutput field)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, the first None (prompt_logprobs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


def merge_samples(outs: Sequence[RequestOutput]) -> RequestOutput:
    """The samples of one prompt (finished engine requests, sample 0 first) as one ``RequestOutput``: their
    ``outputs`` in order, sample 0's id and prompt, counters summed over the samples, the earliest start and the
    latest finish. One sample is returned as it is."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    starts = [o.first_token_time for o in outs if o.first_token_time is not None]
    ends = [o.finish_time for o in outs if o.finish_time is not None]
    return RequestOutput(
        first.request_id,
        first.prompt_token_ids,
        [replace(o.outputs[0], index=i) for i, o in enumerate(outs)],
        all(o.finished for o in outs),
        SpecDecodingMetrics.summed([o.spec_metrics for o in outs]).request_report(),
        sum(o.num_preemptions for o in outs),
        min(o.arrival_time for o in outs),
        min(starts, default=None),
        max(ends) if len(ends) == len(outs) else None,
        sum(o.num_cached_tokens for o in outs),
        first.prompt_logprobs,
    )


@dataclass
class AdaptivePolicy:
    """Confidence-scheduled verification (Algorithm 1) with STS temperatures and a cost table."""

    temperatures: list[float] | None
    sps: SpsTable
    min_len: int

    def lengths(self, conf_logits: torch.Tensor, caps: list[int]) -> list[int]:
        """Drafts to verify per request from conf_logits [B, K] (raw confidence logits), each <= its cap."""
        z = conf_logits.float()
        if self.temperatures is not None:
            if len(self.temperatures) < z.shape[1]:
                raise ValueError(
                    f"{len(self.temperatures)} STS temperatures for {z.shape[1]} draft positions; rerun "
                    "`dspark calibrate` with this num_speculative_tokens"
                )
            z = z / torch.tensor(self.temperatures[: z.shape[1]], dtype=torch.float32)
        conf = torch.sigmoid(z).tolist()
        rows = [c[:cap] for c, cap in zip(conf, caps)]
        return choose_verify_lengths(rows, self.sps, min_len=self.min_len).lengths


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: DSparkDrafter | None = None,
        speculative_config: SpeculativeConfig | None = None,
        engine_config: EngineConfig | None = None,
        cache_config: CacheConfig | None = None,
        tokenizer: HFTokenizer | ByteTokenizer | None = None,
        adaptive: AdaptivePolicy | None = None,
        model_dir: Path | None = None,
        draft_dir: Path | None = None,
        model_ref: str | None = None,
    ) -> None:
        self.cfg = engine_config or EngineConfig()
        self.spec = speculative_config
        if self.spec is not None and self.spec.method in ("dspark", "dflash") and drafter is None:
            raise ConfigError(f"speculative config: method '{self.spec.method}' needs a drafter ('model' key)")
        self.target = target
        self.drafter = drafter if self.spec is not None and self.spec.method != "ngram" else None
        if isinstance(target, DecoderTarget):  # our native families (HF fallback models have their own layout)
            target.fuse_for_inference()
        if self.drafter is not None:
            self.drafter.fuse_for_inference()
        self.packed_weights = 0
        if self.cfg.prepack_weights:
            self.packed_weights = sum(pack_for_inference(m) for m in (target, self.drafter) if m is not None)
        tcfg = target.config
        self.max_model_len = self.cfg.max_model_len or min(tcfg.max_position_embeddings, 32768)
        self.tokenizer = tokenizer or ByteTokenizer(tcfg.vocab_size, tcfg.eos_token_ids, tcfg.bos_token_id)
        self.eos_ids = set(tcfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()))
        self.K = self.spec.num_speculative_tokens if self.spec else 0
        ccfg = cache_config or CacheConfig()
        # default: max_num_seqs requests of up to 4,096 tokens, and never less than one request of max_model_len
        default_tokens = max(self.cfg.max_num_seqs * min(self.max_model_len, 4096), self.max_model_len + self.K + 1)
        num_pages = ccfg.num_pages or math.ceil(default_tokens / ccfg.page_size)
        self.model_dir, self.draft_dir = model_dir, draft_dir  # where the models came from (None: in memory)
        self.model_ref = model_ref  # the model as the user named it (directory, .gguf, alias, hub id)
        dformat = self.drafter.page_format if self.drafter is not None else None
        dtype = next(target.parameters()).dtype
        if target.invariance_note:  # said once (docs/performance.md, "Invariance")
            logger.info("%s, %s: %s", type(target).__name__, str(dtype).removeprefix("torch."),
                        target.invariance_note)  # fmt: skip
        self.pools = CachePools.build(target.page_format, dformat, num_pages, ccfg.page_size, dtype)
        self.pool = self.pools.target
        self.blocks = BlockManager(PageAllocator(num_pages, ccfg.page_size))
        cache = PrefixCache(self.blocks.allocator, self._cache_salt(dtype)) if ccfg.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.blocks, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, self.K + 1, cache
        )
        spec = target.state_spec  # per-request recurrent state (KDA): one slot per running request
        self.states = StatePool(spec, self.cfg.max_num_seqs) if spec is not None else None
        window = self.spec.draft_window_rows if self.spec is not None else None
        self.runner = ModelRunner(target, self.drafter, self.blocks, self.pools, self.states, window)
        self.prefix = PrefixCaching(cache, self.blocks, self.runner, ccfg) if cache is not None else None
        if self.drafter is not None:
            assert self.spec is not None
            self.restrict_draft_vocab(read_draft_vocab(draft_dir, self.spec.draft_vocab_size, tcfg.vocab_size))
        self.metrics = EngineMetrics(log_interval_s=self.cfg.log_stats_interval_s)
        self.adaptive = adaptive
        self.guard = SpeculationGuard() if self.spec is not None and self.spec.speculation_guard else None
        self.precision: Precision | None = None  # dtype and weight format chosen by build_engines, and why
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request
        self._ids = itertools.count()
        self._updated: list[Request] = []

    # ---- request API ---------------------------------------------------------------------------------
    def cache_report(self, num_tokens: int | None = None) -> dict[str, int | float | str | bool]:
        """Page formats and bytes per token of the target's and drafter's pages (one shared pool when equal), and
        the per-request state bytes of a stateful target (KDA layers); with prefix caching, the cached blocks, the
        hit rate and (stateful targets) the state snapshots. With ``num_tokens``: the bytes one request of that many
        tokens holds (target latents, drafter latents, a separate conventional draft cache)."""
        rep = self.pools.report() | (self.states.report() if self.states is not None else {})
        rep |= self.prefix.report(self.metrics.prefix_cache) if self.prefix is not None else {"prefix_caching": False}
        if num_tokens is not None:
            width = self.drafter.separate_cache_width if self.drafter is not None else 0
            rep |= self.pools.request_bytes(num_tokens, width)
        return rep

    def _cache_salt(self, dtype: torch.dtype) -> str:
        """What a cached block's rows depend on besides its tokens: the models and the page formats."""
        fmt = (self.target.page_format, self.drafter.page_format if self.drafter is not None else None)
        where = (self.model_ref or self.model_dir, self.draft_dir)
        return f"{model_type(self.target.config)}|{fmt}|{dtype}|{where}"

    @property
    def num_pages_free(self) -> int:
        return self.blocks.allocator.num_free()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        params = params or SamplingParams()
        if params.n != 1:
            raise EngineError(
                f"SamplingParams.n={params.n}: an engine request is one sample; add one request per "
                "SamplingParams.samples() entry (LLM.generate does)"
            )
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)  # AutoTokenizer's ids
        if not ids:
            raise EngineError("prompt is empty; give at least one token")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        bad_bias = [t for t in params.logit_bias if t >= vocab]
        if bad_bias:
            raise EngineError(f"logit_bias: token id {bad_bias[0]} is not in the vocabulary [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
                f"length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        pages = self.blocks.allocator.pages_for(len(ids) + params.max_tokens + self.K + 1)
        if pages > self.pool.num_pages:
            raise EngineError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) alone needs {pages} KV pages but "
                f"the pool has {self.pool.num_pages}; raise CacheConfig.num_pages"
            )
        if len(self.scheduler.waiting) >= self.cfg.max_waiting:
            raise EngineError(f"the waiting queue is full ({self.cfg.max_waiting}); retry later")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise EngineError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else zlib.crc32(f"{self.cfg.seed}:{rid}".encode())
        req = Request(rid, ids, params, seed, detok=self.tokenizer.detokenizer(), grammar=self.grammar_matcher(params))
        self.requests[rid] = req
        self.scheduler.add(req)
        self.metrics.prompt_tokens += len(ids)
        return req

    def grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """The grammar state of a structured-output request (None without one); a schema, regex or grammar that
        does not compile is an EngineError naming it."""
        if params.structured is None:
            return None
        try:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.target.config.vocab_size, self.eos_ids)
            return self._grammars.matcher(params.structured)
        except (GrammarError, ValueError) as e:
            raise EngineError(str(e)) from None
        except ImportError as e:
            raise EngineError(f"structured outputs need llguidance ({e}); pip install 'llguidance==1.9.1'") from None

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        req.aborted = True
        self._finish(req, "abort")
        self.metrics.num_requests_aborted += 1

    def close(self) -> None:
        """Shutting down: release what outlives the requests (the KV offload's disk tier is removed now, whatever
        the process does next: a server re-raises the signal it stopped on, and then no exit handler runs)."""
        if self.prefix is not None:
            self.prefix.close()

    # ---- the loop --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with scope("step.schedule"):
            sched = self.scheduler.schedule()
        self._admit(sched)
        for chunks in self._groups(sched.prefills, [(c.end, c.end - c.start) for c in sched.prefills]):
            self._isolated(self._prefill, chunks, [c.request for c in chunks])
        decodes = [r for r in sched.decodes if not r.finished]
        for group in self._groups(decodes, [(r.num_computed + self.K + 1, self.K + 1) for r in decodes]):
            self._isolated(self._decode, group, group)
        self.metrics.maybe_log()
        return self._drain()

    def _admit(self, sched: SchedulerOutput) -> None:
        """Preempted requests give their state slots back (recomputed later, from scratch or a cached prefix);
        admitted ones are counted as prefix-cache lookups, and a hit of a stateful target restores its state."""
        self.metrics.num_preemptions += len(sched.preempted)
        for req in sched.preempted:
            self.runner.release_state(req.request_id)
        if self.prefix is not None:
            self.prefix.admitted(sched.admitted, self.metrics.prefix_cache)

    def _groups(self, items: list, sizes: list[tuple[int, int]]) -> list[list]:
        """``items`` as groups of similar context length, given each one's (keys attended, new rows): one group
        unless padding every row to the longest context costs more than another forward."""
        if not items:
            return []
        keys, rows = zip(*sizes)
        return [[items[i] for i in g] for g in length_groups(keys, rows, self.cfg.split_batch_keys)]

    def restrict_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only the target tokens ``ids`` (a reduced draft vocabulary, ``speculative/draft_vocab.py``; None: all).
        This engine's own row slices of the drafter's lm_head and W2 (packed like its other weights): engines that
        share one loaded drafter may draft from different vocabularies."""
        if ids is None or self.drafter is None:
            self.runner.draft_vocab = None
            return
        vocab = DraftVocab.for_drafter(self.drafter, ids)
        if self.cfg.prepack_weights:
            for m in (vocab.lm_head, vocab.markov_w2):
                if m is not None:
                    self.packed_weights += pack_for_inference(m)
        self.runner.draft_vocab = vocab

    def _isolated(self, phase: Callable[[list], None], items: list, reqs: list[Request]) -> None:
        """Run ``phase(items)``; if it raises, rerun each item alone and fail only the requests that raise alone.

        A rerun is safe: a phase commits a request only after every forward of the batch succeeded, rewrites the
        same cache slots, and draws counter-keyed (not stateful) randomness; a request committed before a later
        one raised simply takes one more step."""
        try:
            return phase(items)
        except Exception as e:  # noqa: BLE001 - isolated below; the engine itself must keep serving
            if len(items) == 1:
                return self._fail(reqs[0], e)
        for item, req in zip(items, reqs):
            if req.finished:
                continue
            try:
                phase([item])
            except Exception as e:  # noqa: BLE001 - this request alone raises: finish it with the error
                self._fail(req, e)

    def _fail(self, req: Request, error: Exception) -> None:
        logger.error("request %s failed and was finished with an error", req.request_id, exc_info=error)
        req.error = f"{type(error).__name__}: {error}"
        self._finish(req, "error")
        self.metrics.num_requests_failed += 1

    # ---- phases ------------------------------------------------------------------------------------------
    def _decode(self, decodes: list[Request]) -> None:
        t0, g0 = time.perf_counter(), self.metrics.grammar_s
        with scope("step.metadata"):
            sampling = self.runner.sampling_tensors(decodes, self.K + 1)
        allowed = self._may_draft(len(decodes))
        # the guard decides this step, unless a seeded sampled request is in it (its output must not depend on timing)
        guarded = allowed and self.guard is not None and not any(_seeded_sampling(r) for r in decodes)
        drafting = self.guard.drafting(len(decodes)) if guarded else allowed
        proposal = self._propose(decodes, sampling) if drafting else None  # drafter block, n-gram lookup, or none
        t1 = time.perf_counter()
        lengths = self._verify_lengths(decodes, proposal)  # fixed K or Algorithm 1
        logits = self._verify(decodes, proposal, lengths)  # one target forward over [anchor, d_1..d_L]
        t2 = time.perf_counter()
        emitted = self._accept_and_commit(decodes, proposal, lengths, logits, sampling)
        t3 = time.perf_counter()
        self.metrics.decode = self.metrics.decode.plus(t1 - t0, t2 - t1, t3 - t0, self.metrics.grammar_s - g0)
        if guarded:
            self.guard.observe(len(decodes), drafting, emitted, t3 - t0)

    def _prefill(self, chunks: list[PrefillChunk]) -> None:
        t0 = time.perf_counter()
        self._prefill_chunks(chunks)
        tokens = sum(c.end - c.start for c in chunks)
        self.metrics.prefill = self.metrics.prefill.plus(tokens, time.perf_counter() - t0)

    def _prefill_chunks(self, chunks: list[PrefillChunk]) -> None:
        reqs = [c.request for c in chunks]
        tokens = [c.request.all_ids[c.start : c.end] for c in chunks]
        every_row = any(r.params.prompt_logprobs is not None for r in reqs)
        logits = self.runner.target_forward(reqs, [c.start for c in chunks], tokens, last_only=not every_row)
        if every_row:  # prompt log-likelihoods: every row's logits, then each chunk's last row as usual
            self._record_prompt_logprobs(chunks, logits)
            logits = logits[torch.arange(len(chunks)), torch.tensor([len(t) - 1 for t in tokens])][:, None]
        first = [i for i, c in enumerate(chunks) if c.end == c.request.prefill_target and not c.request.output_ids]
        for c in chunks:
            c.request.num_computed = c.end
            self.blocks.set_length(c.request.request_id, c.end)
        if self.prefix is not None:  # before sampling: a request that finishes at its first token still caches
            self.prefix.prefilled(chunks)
        for i in [i for i in first if reqs[i].params.max_tokens == 0]:  # the prompt only: no token to sample
            self._finish(reqs[i], "length")
        first = [i for i in first if reqs[i].params.max_tokens > 0]
        if first:
            self._first_tokens([reqs[i] for i in first], logits[first])
        self.runner.commit_states()  # last: a phase that raises is rerun from the states it started with

    def _first_tokens(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample each request's first token from its prompt's last logits [B, 1, V]."""
        sampling = self.runner.sampling_tensors(reqs, 1, anchor_offset=-1)
        tokens = sample_next(self._processed(reqs, logits, None)[:, 0], sampling).tolist()
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            self._append(req, [tok], self._logprobs(req, logits[i], [tok]))

    @staticmethod
    def _record_prompt_logprobs(chunks: list[PrefillChunk], logits: torch.Tensor) -> None:
        """Prompt tokens' raw logprobs from a prefill's every-row logits [B, T, V]: row r of a chunk starting at s
        decided the token at position s + r + 1. The first prompt token has none (None); positions already
        recorded (a prefill recomputed after preemption) are kept."""
        for b, c in enumerate(chunks):
            req, k = c.request, c.request.params.prompt_logprobs
            if k is None:
                continue
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            positions = range(max(len(req.prompt_logprobs), c.start + 1), min(c.end, len(req.prompt_ids) - 1) + 1)
            if positions:
                rows = logits[b, positions.start - 1 - c.start : positions.stop - 1 - c.start]
                req.prompt_logprobs += token_logprobs(rows, [req.prompt_ids[p] for p in positions], k)

    def _may_draft(self, batch_size: int) -> bool:
        """Speculation is configured and a step over ``batch_size`` requests is within ``disable_by_batch_size``
        (when drafting is allowed, the speculation guard, if on, decides whether it pays)."""
        limit = self.spec.disable_by_batch_size if self.spec is not None else None
        return self.spec is not None and (limit is None or batch_size <= limit)

    def _propose(self, reqs: list[Request], sampling: SamplingTensors) -> Proposal | None:
        if self.spec is None:
            return None
        if self.spec.method == "ngram":
            return self.runner.propose_ngram(reqs, self.K, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        return self.runner.propose_draft(
            reqs,
            sampling,
            probabilistic=self.spec.draft_sample_method == "probabilistic",
            use_markov=self.spec.method == "dspark",
            topk=self.spec.dspark_draft_topk,
        )

    def _verify_lengths(self, reqs: list[Request], proposal: Proposal | None) -> list[int]:
        """Per request: drafts to verify, capped by what the request may still emit and the context length."""
        if proposal is None:
            return [0] * len(reqs)
        caps = [
            max(0, min(int(n), r.remaining_tokens, self.max_model_len - r.num_computed - 1))
            for r, n in zip(reqs, proposal.lengths.tolist())
        ]
        if self.adaptive is not None and proposal.confidence is not None:
            return [min(ell, cap) for ell, cap in zip(self.adaptive.lengths(proposal.confidence, caps), caps)]
        return caps

    def _verify(self, reqs: list[Request], proposal: Proposal | None, lengths: list[int]) -> torch.Tensor:
        rows = []
        for i, (r, ell) in enumerate(zip(reqs, lengths)):
            drafts = proposal.tokens[i, :ell].tolist() if proposal is not None else []
            rows.append([r.all_ids[r.num_computed], *drafts])
        starts = [r.num_computed for r in reqs]
        return self.runner.target_forward(
            reqs, starts, rows, last_only=False, per_row_states=True, defer_context=proposal is None
        )

    def _accept_and_commit(
        self,
        reqs: list[Request],
        proposal: Proposal | None,
        lengths: list[int],
        logits: torch.Tensor,
        sampling: SamplingTensors,
    ) -> int:
        """Accept, commit, and return the tokens the step emitted (accepted drafts + one per request)."""
        with scope("step.accept"):
            processed = self._processed(reqs, logits, proposal.tokens if proposal is not None else None, lengths)
            if proposal is None:
                accepted = [0] * len(reqs)
                nxt = sample_next(processed[:, 0], sampling).tolist()
            else:
                rule = self.spec.rejection_sample_method if self.spec else "standard"
                K = self.K
                padded = torch.nn.functional.pad(processed, (0, 0, 0, K + 1 - processed.shape[1]))
                res = accept(proposal, torch.tensor(lengths), padded, sampling, rule)
                accepted, nxt = res.num_accepted.tolist(), res.next_token.tolist()
        with scope("step.commit"):
            self._commit(reqs, proposal, lengths, accepted, nxt, logits)
        return sum(accepted) + len(reqs)

    def _processed(
        self, reqs: list[Request], logits: torch.Tensor, drafts: torch.Tensor | None, lengths: list[int] | None = None
    ) -> torch.Tensor:
        """The distributions sampling and verification use: logits [B, T, V] of a round after each request's
        logit_bias / min_tokens / penalties / grammar (spec/processing.py; row j counts d_1..d_j as generated, and
        its grammar state is the one after d_1..d_j; ``lengths``: the drafts verified per request)."""
        verified = None
        if drafts is not None and lengths is not None:
            verified = [drafts[i, :ell].tolist() for i, ell in enumerate(lengths)]
        t0 = time.perf_counter()
        allowed = grammar_masks(reqs, logits.shape[1], verified, logits.shape[-1])
        self.metrics.grammar_s += time.perf_counter() - t0 if allowed is not None else 0.0
        pt = self.runner.processing_tensors(reqs, logits.shape[-1], self.eos_ids, allowed)
        return logits if pt is None else process(logits, pt, drafts)

    @staticmethod
    def _logprobs(req: Request, rows: torch.Tensor, tokens: list[int]) -> list[TokenLogprobs] | None:
        """The raw logprobs of ``tokens`` (rows [N, V]: the target logits each was decided by), if requested."""
        k = req.params.logprobs
        return None if k is None else token_logprobs(rows[: len(tokens)], tokens, k)

    def _commit(
        self,
        reqs: list[Request],
        proposal: Proposal | None,
        lengths: list[int],
        accepted: list[int],
        nxt: list[int],
        logits: torch.Tensor,
    ) -> None:
        self.metrics.spec.num_steps += 1
        for i, req in enumerate(reqs):
            n = accepted[i]
            drafts = proposal.tokens[i, :n].tolist() if proposal is not None else []
            self.runner.commit_states(accepted, only=i)  # the state after [anchor, d_1..d_n]: rejected rows leave none
            req.num_computed += n + 1
            self.blocks.set_length(req.request_id, req.num_computed)
            if self.prefix is not None:
                self.prefix.committed(req, drafts, req.num_computed - n - 1, i)
            if proposal is not None:
                req.spec.record(lengths[i], n)
                self.metrics.spec.record(lengths[i], n)
            tokens = [*drafts, nxt[i]]
            self._append(req, tokens, self._logprobs(req, logits[i], tokens))

    # ---- commit helpers --------------------------------------------------------------------------------
    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        p = req.params
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if logprobs is not None:
                req.logprobs.append(logprobs[j])
            if req.detok is not None:
                req.detok.step((tok,))
            self.metrics.generation_tokens += 1
            if not p.ignore_eos and tok in self.eos_ids:
                return self._finish(req, "stop", tok)
            if tok in p.stop_token_ids:
                return self._finish(req, "stop", tok)
            if p.stop and req.detok is not None:
                hit = next((s for s in p.stop if s in req.detok.text), None)
                if hit is not None:
                    return self._finish(req, "stop", hit)
            if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                return self._finish(req, "length")
        self._updated.append(req)

    def _finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finish_time = time.monotonic()
        held = req.hold and reason not in ("abort", "error")  # P/D: kept for export_request (engine/transfer.py)
        self.scheduler.release(req, keep_pages=held)
        if not held:
            self.runner.release_state(req.request_id)
        if reason not in ("abort", "error"):
            self.metrics.num_requests_finished += 1
        self._updated.append(req)

    def output_of(self, req: Request) -> RequestOutput:
        if req.finished and req.detok is not None:
            req.detok.flush()  # a trailing incomplete character, as the full decode shows it
        text = req.detok.text if req.detok is not None else ""
        if isinstance(req.stop_reason, str) and req.stop_reason in text:
            text = text[: text.index(req.stop_reason)]
        logprobs = list(req.logprobs) if req.params.logprobs is not None else None
        sample = CompletionOutput(
            0, text, list(req.output_ids), req.finish_reason, req.stop_reason, req.error, logprobs
        )
        return RequestOutput(
            req.request_id,
            list(req.prompt_ids),
            [sample],
            req.finished,
            req.spec.request_report(),
            req.num_preemptions,
            req.arrival,
            req.first_token_time,
            req.finish_time,
            req.num_cached_tokens,
            list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
        )

    def _drain(self) -> list[RequestOutput]:
        seen: dict[str, Request] = {r.request_id: r for r in self._updated}
        self._updated.clear()
        outs = [self.output_of(r) for r in seen.values()]
        for r in seen.values():
            if r.finished:
                self.requests.pop(r.request_id, None)
        return outs


def _seeded_sampling(req: Request) -> bool:
    return req.params.seed is not None and not req.params.greedy


def _adaptive_file(
    key: str, given: str | None, name: str, pair: tuple[Path | None, Path | None], dirs: Sequence[Path | None]
) -> Path | None:
    """The file at the config path `key` (must exist when given), else the pair's measured one on this machine
    (dspark.tuning), else `name` in the first dir holding it."""
    if given:
        if not Path(given).is_file():
            raise ConfigError(
                f"speculative config: key '{key}' = {given!r}: file not found; fix the path or drop the key"
            )
        return Path(given)
    return tuning.find(name, *pair, beside=dirs)


def load_adaptive(spec: SpeculativeConfig, draft_dir: Path | None, target_dir: Path | None) -> AdaptivePolicy:
    """STS temperatures + SPS cost table for `enable_adaptive_verification`.

    Temperatures: `calibration_path`, else what `dspark calibrate` measured for this pair on this machine
    ($DSPARK_CACHE/tuning), else `sts_calibration.json` next to the draft, then the target. Cost table:
    `cost_table_path`, else what `dspark profile` measured, else `sps_profile.json` next to the target, then the
    draft. A missing file falls back to raw confidences / the default cost model with one warning.
    """
    pair = (draft_dir, target_dir)
    sts = _adaptive_file("calibration_path", spec.calibration_path, tuning.STS_FILE, pair, (draft_dir, target_dir))
    cost = _adaptive_file("cost_table_path", spec.cost_table_path, tuning.SPS_FILE, pair, (target_dir, draft_dir))
    temperatures = load_sts(sts) if sts is not None else None
    sps = SpsTable.load(cost) if cost is not None else default_cost_model()
    if temperatures is not None and len(temperatures) < spec.num_speculative_tokens:
        raise ConfigError(
            f"{sts}: {len(temperatures)} STS temperatures but num_speculative_tokens = "
            f"{spec.num_speculative_tokens}; rerun `dspark calibrate` with this speculative config"
        )
    if sts is None or cost is None:
        warnings.warn(
            "adaptive verification: "
            + ("no STS calibration file (run `dspark calibrate`); using raw confidences. " if sts is None else "")
            + ("no cost table (run `dspark profile`); using the default cost model." if cost is None else ""),
            stacklevel=2,
        )
    return AdaptivePolicy(temperatures=temperatures, sps=sps, min_len=spec.min_verify_len)
