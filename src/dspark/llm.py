"""Public entry points: ``LLM(model=..., speculative_config=...).generate(prompts, SamplingParams)`` (raw prompts),
``.chat(messages, SamplingParams)`` (the chat template) and ``build_engine`` (used by the CLI, the server and the
bench)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from dspark.checkpoint.resolve import (
    BUNDLED_DFLASH,
    BUNDLED_DRAFT,
    BUNDLED_PAIRS,
    BUNDLED_TARGET,
    DEFAULT_PAIR,
    MLA_DRAFT,
    MLA_TARGET,
    OFFICIAL_DRAFT_CONFIG,
    bundled_available,
    resolve_draft,
    resolve_model,
    shipped_drafts,
)
from dspark.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from dspark.config.backends import BackendSubstitutionWarning
from dspark.doctor.gate import check_before_load, check_finite
from dspark.engine.engine import Engine, RequestOutput, load_adaptive, merge_samples
from dspark.engine.metrics import EngineMetrics
from dspark.engine.request import Request
from dspark.models.loading import choose_draft_quantization, load_drafter, load_target, resolve_precision
from dspark.models.model_spec import model_spec, one_read_per_model
from dspark.sampling_params import SamplingParams
from dspark.speculative.guard import SpeculationGuard
from dspark.threads import model_key as thread_model_key
from dspark.tokenizer import load_tokenizer

__all__ = [  # the bundled-model names live in dspark.checkpoint.resolve; importable from here as before
    "BUNDLED_DFLASH",
    "BUNDLED_DRAFT",
    "BUNDLED_PAIRS",
    "BUNDLED_TARGET",
    "DEFAULT_PAIR",
    "LLM",
    "MLA_DRAFT",
    "MLA_TARGET",
    "OFFICIAL_DRAFT_CONFIG",
    "build_engine",
    "build_engines",
    "engine_configs",
    "bundled_available",
    "resolve_draft",
    "resolve_model",
    "shipped_drafts",
]


def _parse_spec(spec: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    if isinstance(spec, SpeculativeConfig) or spec is None:
        return spec
    return SpeculativeConfig.parse(spec)


def engine_configs(**kwargs: Any) -> tuple[EngineConfig, CacheConfig]:
    """vLLM-style flat keywords (``LLM(dtype=..., max_num_seqs=..., page_size=...)``) as the two configs they fill;
    a keyword neither config has is a TypeError naming it."""
    engine_keys = {f.name for f in fields(EngineConfig)}
    cache_keys = {f.name for f in fields(CacheConfig)}
    unknown = sorted(kwargs.keys() - engine_keys - cache_keys)
    if unknown:
        raise TypeError(f"unexpected engine keyword(s) {unknown}; EngineConfig and CacheConfig name the valid ones")
    return (
        EngineConfig(**{k: v for k, v in kwargs.items() if k in engine_keys}),
        CacheConfig(**{k: v for k, v in kwargs.items() if k in cache_keys}),
    )


@one_read_per_model()  # the resolver, the doctor, the loaders and the tokenizer share one read of each model
def build_engines(
    model: str | Path | None,
    speculative_configs: Sequence[str | Mapping[str, Any] | SpeculativeConfig | None],
    engine: EngineConfig | None = None,
    cache: CacheConfig | None = None,
) -> list[Engine]:
    """One engine per speculative config, all sharing one loaded target (and drafters per directory).

    ``engine.dtype`` and ``engine.quantization`` ("auto" by default) are resolved for this machine and model first
    (``resolve_precision``); each engine's ``precision`` says what was chosen and why, its ``cfg`` holds the result.
    Flat vLLM-style keywords: ``build_engines(model, specs, *engine_configs(dtype=..., ...))``."""
    engine, cache = engine or EngineConfig(), cache or CacheConfig()
    target_dir = resolve_model(model)
    specs = [_parse_spec(s) for s in speculative_configs]
    target_spec = model_spec(target_dir)
    precision = resolve_precision(target_spec, engine.dtype, engine.quantization)
    dtype = precision.dtype
    with warnings.catch_warnings():  # the caller's config said it once, at construction
        warnings.simplefilter("ignore", BackendSubstitutionWarning)
        ecfg = replace(engine, dtype=dtype, quantization=precision.quantization)
    draft_dirs = [resolve_draft(spec, target_dir) if spec is not None else None for spec in specs]
    check_before_load(target_dir, draft_dirs)  # the doctor refuses what `dspark check` rejects
    target = load_target(target_spec, dtype, precision.quantization)  # only the target is quantized
    check_finite(target, f"target {target_dir}")
    _set_target_backend(target, ecfg.target_attention_backend)
    tcfg = target.config
    tok = load_tokenizer(target_spec, tcfg.vocab_size, tcfg.eos_token_ids, tcfg.bos_token_id)
    drafters: dict[tuple[Path, str | None, str], Any] = {}  # one per (directory, attention backend, weights)
    engines = []
    for spec, draft_dir in zip(specs, draft_dirs):
        drafter = None
        if spec is not None and draft_dir is not None:
            backend = spec.draft_attention_backend or ecfg.target_attention_backend  # the target's by default
            draft_quant = choose_draft_quantization(spec.quantization, precision.quantization)[0]
            key = (draft_dir, backend, draft_quant)
            if key not in drafters:
                drafters[key] = load_drafter(draft_dir, target, dtype, draft_quant)
                check_finite(drafters[key], f"draft {draft_dir}")  # its own weights (embedding/lm_head borrowed)
                drafters[key].set_attention_backend(backend)
            drafter = drafters[key]
        _check_pair(spec, drafter, draft_dir)
        adaptive = load_adaptive(spec, draft_dir, target_dir) if spec and spec.enable_adaptive_verification else None
        ref = str(model) if model is not None else None
        engines.append(Engine(target, drafter, spec, ecfg, cache, tok, adaptive, target_dir, draft_dir, ref))
        engines[-1].precision = precision
    _default_threads(engines[0], thread_model_key(target_dir.name, dtype, sum(p.numel() for p in target.parameters())))
    return engines


def _default_threads(engine: Engine, model_key: str) -> None:
    """Measured intra-op thread default for this machine and model (dspark.threads), unless chosen explicitly."""
    from dspark.threads import choose_threads, is_explicit

    if is_explicit():
        return
    calls = iter(range(1 << 30))
    choose_threads(model_key, lambda: _private_request(engine, f"dspark-thread-calibration-{next(calls)}"))
    if next(calls):  # it ran: the calibration requests must not show in the engine's counters (nor the guard's)
        _forget_private(engine)


def warm_up(engine: Engine) -> None:
    """Run the shapes a server's first requests take (a short prefill, a few decode steps or speculative rounds)
    before serving, then forget them: the first client does not pay one-time costs, and neither the counters nor
    the speculation guard see them."""
    _private_request(engine, "dspark-warm-up")
    _forget_private(engine)


def _private_request(engine: Engine, request_id: str) -> None:
    """Prefill + 4 decode steps (or rounds) of one greedy request under its own id, run to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (engine.K + 1), ignore_eos=True)
    engine.add_request([min(4, engine.target.config.vocab_size - 1)] * 16, params, request_id=request_id)
    while engine.has_unfinished:
        engine.step()


def _forget_private(engine: Engine) -> None:
    engine.metrics = EngineMetrics(log_interval_s=engine.cfg.log_stats_interval_s)
    if engine.guard is not None:
        engine.guard = SpeculationGuard()


def _set_target_backend(target: Any, backend: str | None) -> None:
    """'torch' / 'sdpa' for every attention layer of the target: our MLA layers directly, an HF model through
    transformers' attn_implementation ('eager' / 'sdpa')."""
    from dspark.models.hf_target import HFTarget
    from dspark.models.mla import MLAttention

    if backend is None:
        return
    if isinstance(target, HFTarget):
        target.model.set_attn_implementation("eager" if backend == "torch" else "sdpa")
        return
    for module in target.modules():
        if isinstance(module, MLAttention):
            module.backend = backend


def _check_pair(spec: SpeculativeConfig | None, drafter: Any, draft_dir: Path | None) -> None:
    if spec is None or drafter is None:
        return
    if spec.method == "dspark" and drafter.markov_head is None:
        raise ConfigError(f"speculative config: method 'dspark' but {draft_dir} has markov_rank 0; use 'dflash'")
    block = drafter.config.block_size
    if block is not None and spec.num_speculative_tokens > block:
        raise ConfigError(
            f"speculative config: num_speculative_tokens={spec.num_speculative_tokens} exceeds the drafter's "
            f"trained block_size={block}; proposing beyond it collapses acceptance"
        )


def build_engine(
    model: str | Path | None = None,
    speculative_config: str | Mapping[str, Any] | SpeculativeConfig | None = None,
    **kwargs: Any,
) -> Engine:
    return build_engines(model, [speculative_config], *engine_configs(**kwargs))[0]


Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """Offline batch generation, vLLM style: ``generate`` sends prompts as given (raw text or token ids), ``chat``
    renders conversations with the model's chat template first."""

    def __init__(self, model: str | Path | None = None, speculative_config=None, **kwargs: Any) -> None:
        self.engine = build_engine(model, speculative_config, **kwargs)

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        obj = cls.__new__(cls)
        obj.engine = engine
        return obj

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order; the ``SamplingParams.n`` samples of a prompt are its
        ``outputs[0..n-1]``. The samples are n independent engine requests (``SamplingParams.samples``: seeds derived
        from the request's seed). With prefix caching they share the prompt's pages: samples 1..n-1 are admitted once
        sample 0's prompt is computed, and find it cached; without it, each sample computes the prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = _params_per_prompt(sampling_params, len(prompts))
        jobs: list[_Sample] = []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            first = len(jobs)
            jobs += [_Sample(i, prompt, s, first if k else None) for k, s in enumerate(sp.samples())]
        grouped: list[list[RequestOutput]] = [[] for _ in prompts]
        for job, out in zip(jobs, self._run(jobs)):
            grouped[job.prompt_index].append(out)
        return [merge_samples(g) for g in grouped]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them. Each is
        rendered with the model's chat template (``apply_chat_template(..., add_generation_prompt=True)``, as
        ``dspark generate --chat`` and the server's chat route do) and generated; one ``RequestOutput`` per
        conversation, in order."""
        conversations = _as_conversations(messages)
        return self.generate([self._render_chat(c, i) for i, c in enumerate(conversations)], sampling_params)

    def _render_chat(self, conversation: Sequence[Message], index: int) -> list[int]:
        tok = self.engine.tokenizer
        name = self.engine.model_ref or self.engine.model_dir or "this model"
        if not getattr(tok, "has_chat_template", False):
            raise ConfigError(
                f"LLM.chat: {name} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja), so it cannot render messages; send the raw text with LLM.generate"
            )
        try:
            return list(tok.encode_chat(conversation))
        except TemplateError as e:
            raise ValueError(f"LLM.chat: conversation {index}: the chat template of {name} refuses it ({e})") from e

    def _run(self, jobs: Sequence[_Sample]) -> list[RequestOutput]:
        """Each sample as one engine request, added as the waiting queue allows; the finals in ``jobs`` order."""
        reqs: list[Request | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))
        final: dict[str, RequestOutput] = {}
        while pending or self.engine.has_unfinished:
            pending = self._admit(jobs, reqs, pending)
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs if r is not None]

    def _admit(self, jobs: Sequence[_Sample], reqs: list[Request | None], pending: list[int]) -> list[int]:
        """Add pending samples in order while the waiting queue has room; with prefix caching a sample waits for its
        sample 0 to have computed the prompt (so it is cached). Returns the samples still pending."""
        left = []
        for n, i in enumerate(pending):
            if len(self.engine.scheduler.waiting) >= self.engine.cfg.max_waiting:
                return left + pending[n:]
            if self.engine.prefix is not None and not _prompt_cached(jobs[i], reqs):
                left.append(i)
                continue
            reqs[i] = self.engine.add_request(jobs[i].prompt, jobs[i].params)
        return left


@dataclass(frozen=True)
class _Sample:
    """One sample of one prompt of a ``generate`` call; ``first``: the job index of that prompt's sample 0."""

    prompt_index: int
    prompt: Prompt
    params: SamplingParams
    first: int | None


def _prompt_cached(job: _Sample, reqs: Sequence[Request | None]) -> bool:
    """Whether the prompt's sample 0 (if ``job`` is another sample) has computed the prompt: it sampled its first
    token (prefix caching has cached the prompt's full blocks by then) or finished."""
    if job.first is None:
        return True
    first = reqs[job.first]
    return first is not None and (bool(first.output_ids) or first.finished)


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: the one given for all (default ``SamplingParams()``), or one each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    plist = list(sampling_params)
    if len(plist) != num_prompts:
        raise ValueError(f"{len(plist)} SamplingParams for {num_prompts} prompts: give one, or one per prompt")
    return plist


def _as_conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[Sequence[Message]]:
    """A list of conversations from one conversation (its first item a message dict) or a list of them."""
    if not messages:
        raise ValueError("LLM.chat: messages is empty; give a conversation ([{'role': 'user', 'content': ...}])")
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for i, conv in enumerate(conversations):
        if isinstance(conv, str | Mapping) or not all(isinstance(m, Mapping) and "role" in m for m in conv):
            raise ValueError(
                f"LLM.chat: conversation {i} must be a list of {{'role': ..., 'content': ...}} dicts; "
                "for raw text prompts use LLM.generate"
            )
    return conversations  # type: ignore[return-value]
