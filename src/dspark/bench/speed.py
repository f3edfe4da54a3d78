"""Interleaved speed + acceptance benchmark: every method runs in the same process, batch by batch, round-robin.

For each cell (dataset, temperature, concurrency) the prompts are cut into batches of ``concurrency``; batch b is
run by every method in turn, the starting method rotated by b, so slow drifts of a shared machine hit all methods
alike. Each measurement records its wall time and the deltas of the engine's counters (generated tokens and the
speculative-decoding counters); rows sum them. Speed-up = tokens/s of the method / tokens/s of ``ar`` in the same
cell.

vLLM (``--vllm-python``) runs afterwards, in phases of its own: our engines and the transformers model are freed
first, then each vLLM method (plain, n-gram) starts, runs every cell alone and stops before the next one starts; it
is fed exactly our prompt token ids. Its speed-up is against ``ar`` of the same cell, measured in the first phase.
llama.cpp (``--llama-cpp-bin``) runs the same way, on the GGUF file the target was exported from
(``dspark.bench.llama_cpp``).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dspark.bench.acceptance import sum_counters
from dspark.bench.baselines import HFGenerate, VLLMError, VLLMMethod
from dspark.bench.llama_cpp import LlamaCppError, LlamaCppMethod
from dspark.bench.methods import EngineMethod, Measurement, Method
from dspark.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SpeculativeConfig,
    TargetConfig,
)
from dspark.engine.metrics import DecodeTimes, PrefillTimes, tau_bound
from dspark.models.families import family_of
from dspark.models.loading import read_draft_config
from dspark.models.model_spec import one_read_per_model
from dspark.sampling_params import SamplingParams, StructuredOutput

AR = "ar"
ENGINE_METHODS = (
    "ar",
    "dspark",
    "dflash",
    "ngram",
    "dspark-adaptive",
    "dspark-guard",
    "dspark-window",
    "dspark-vocab",
)
HF_METHODS = ("hf-generate", "hf-prompt-lookup")
VLLM_METHODS = ("vllm", "vllm-ngram")
LLAMA_CPP = "llama-cpp"
PEER_METHODS = (*VLLM_METHODS, LLAMA_CPP)  # each runs alone, after our methods
ALL_METHODS = ENGINE_METHODS + HF_METHODS + PEER_METHODS
ALWAYS_MEASURED = (AR, "dspark")  # --baselines lists the methods to compare against these
# rows of a cell, in this order: ours, then vLLM's n-gram next to our n-gram, then the other peers
DISPLAY_ORDER = (
    "ar",
    "dspark",
    "dspark-window",
    "dspark-vocab",
    "dspark-adaptive",
    "dspark-guard",
    "dflash",
    "ngram",
    "vllm-ngram",
    "hf-generate",
    "hf-prompt-lookup",
    "vllm",
    "llama-cpp",
)
RESULT_KEYS = (
    "name",
    "dataset",
    "temperature",
    "concurrency",
    "num_prompts",
    "output_tokens",
    "wall_s",
    "tokens_per_s",
    "speedup_vs_ar",
    "acceptance_length",
    "per_position_acceptance",
    "verify_rate",
    "tau_bound",
    "decode_speedup_vs_ar",
    "grammar_ms_per_step",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
)


# ---- rows ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRow:
    name: str
    dataset: str
    temperature: float
    concurrency: int
    num_prompts: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup_vs_ar: float
    acceptance_length: float | None
    per_position_acceptance: list[float] | None
    verify_rate: float | None
    tau_bound: float | None = None  # τ · t_AR_step / (t_draft + t_verify) from this cell's measured costs
    # measured decode-phase speed-up (prefill excluded): decode tokens per decode second over AR's; our engine only
    decode_speedup_vs_ar: float | None = None
    # --json-object: the grammar masks' share of a decode step (every verified row masked), our engine only
    grammar_ms_per_step: float | None = None
    # per phase (our engine and llama.cpp, from their own counters): prompt tokens computed per prefill second, and
    # output tokens after each request's first per decode second (llama.cpp's pp and tg)
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in RESULT_KEYS}


@dataclass(frozen=True)
class Cell:
    dataset: str
    temperature: float
    concurrency: int
    prompts: tuple[tuple[int, ...], ...]  # token ids (BOS included), shared by every method
    engine_only: bool = False  # context-depth cells: our engine's methods only


def _batches(prompts: Sequence[Sequence[int]], size: int) -> list[list[Sequence[int]]]:
    return [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]


def measure_parts(
    methods: Sequence[Method],
    cell: Cell,
    params: SamplingParams,
    on_measure: Callable[[str], None] | None = None,
) -> dict[str, list[Measurement]]:
    """The cell's batches, each run by every method in turn (start rotated per batch) → measurements per method."""
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ConfigError(f"bench: method names must be unique, got {names}")
    parts: dict[str, list[Measurement]] = {m.name: [] for m in methods}
    params = replace(params, temperature=cell.temperature)
    for b, batch in enumerate(_batches(cell.prompts, cell.concurrency)):
        r = b % len(methods)
        for method in [*methods[r:], *methods[:r]]:
            parts[method.name].append(method.run(batch, params))
            if on_measure is not None:
                on_measure(method.name)
    return parts


def display_rank(name: str) -> int:
    """Row order in a cell: DISPLAY_ORDER (vLLM's n-gram right after ours), unknown names last."""
    base = name.split(" (")[0]  # "dflash (head off)" -> "dflash"
    return DISPLAY_ORDER.index(base) if base in DISPLAY_ORDER else len(DISPLAY_ORDER)


def rows_from_measurements(parts: dict[str, list[Measurement]], cell: Cell) -> list[BenchRow]:
    def tps(ms: list[Measurement]) -> float:
        wall = sum(m.wall_s for m in ms)
        return sum(m.output_tokens for m in ms) / wall if wall > 0 else 0.0

    ref = tps(parts[AR])
    ar_decode = _decode_sum(parts[AR])
    ar_decode_rate = decode_rate(parts[AR])
    rows = []
    for name in sorted(parts, key=display_rank):
        ms = parts[name]
        counters = sum_counters([m.counters for m in ms])
        rate = tps(ms)
        decode, tau = _decode_sum(ms), counters.acceptance_length if counters else None
        bound = tau_bound(tau, ar_decode, decode) if tau is not None and decode and ar_decode else None
        rate_d = decode_rate(ms)
        rows.append(
            BenchRow(
                name=name,
                dataset=cell.dataset,
                temperature=float(cell.temperature),
                concurrency=int(cell.concurrency),
                num_prompts=len(cell.prompts),
                output_tokens=int(sum(m.output_tokens for m in ms)),
                wall_s=float(sum(m.wall_s for m in ms)),
                tokens_per_s=float(rate),
                speedup_vs_ar=float(rate / ref) if ref > 0 else 0.0,
                acceptance_length=counters.acceptance_length if counters else None,
                per_position_acceptance=counters.per_position_acceptance if counters else None,
                verify_rate=counters.verify_rate if counters else None,
                tau_bound=bound,
                decode_speedup_vs_ar=rate_d / ar_decode_rate if rate_d and ar_decode_rate else None,
                grammar_ms_per_step=1e3 * decode.grammar_s / decode.steps if decode and decode.grammar_s else None,
                prefill_tokens_per_s=prefill_rate(ms),
                decode_tokens_per_s=rate_d,
            )
        )
    return rows


def decode_rate(ms: list[Measurement]) -> float | None:
    """Tokens per second of the decode phase alone: every output token but each request's first (the prefill step
    samples it) over the decode steps' wall time. None for stacks that do not report phase times."""
    decode = _decode_sum(ms)
    if decode is None or decode.total_s <= 0:
        return None
    first_tokens = sum(m.requests for m in ms)
    return max(0, sum(m.output_tokens for m in ms) - first_tokens) / decode.total_s


def phase_notes(rows: Sequence[BenchRow]) -> list[str]:
    """Per cell with a llama.cpp row: each of our methods' prefill and decode rates over llama.cpp's (its pp and tg
    from its own counters, the same prompts), phase by phase: a whole-request ratio never stands in for either."""
    notes = []
    for peer in (r for r in rows if r.name == LLAMA_CPP):
        ours = [r for r in rows if (r.dataset, r.temperature, r.concurrency) == (peer.dataset, peer.temperature,
                                                                                 peer.concurrency)]  # fmt: skip
        parts = []
        for r in (r for r in ours if r.name not in PEER_METHODS and r.decode_tokens_per_s is not None):
            pre = _ratio(r.prefill_tokens_per_s, peer.prefill_tokens_per_s)
            dec = _ratio(r.decode_tokens_per_s, peer.decode_tokens_per_s)
            whole = _ratio(r.tokens_per_s, peer.tokens_per_s)
            parts.append(f"{r.name} prefill {pre}, decode {dec}, whole request {whole}")
        if parts:
            cell = f"{peer.dataset} T={peer.temperature:g}"
            notes.append(f"per phase against {LLAMA_CPP} ({cell}, ours / theirs): " + "; ".join(parts))
    return notes


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def prefill_rate(ms: list[Measurement]) -> float | None:
    """Prompt tokens computed per second of the prefill phase; None for stacks that do not report it."""
    parts = [m.prefill for m in ms if m.prefill is not None]
    return sum(parts, PrefillTimes()).tokens_per_s if parts else None


def _decode_sum(ms: list[Measurement]) -> DecodeTimes | None:
    """Summed decode-phase times of our engine's measurements (None for other stacks)."""
    parts = [m.decode for m in ms if m.decode is not None]
    return sum(parts, DecodeTimes()) if parts else None


# ---- the whole bench ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    dataset: str
    model: str | None = None  # target dir (None: the bundled kimi-k3-mini)
    draft: str | None = None  # DSpark drafter dir (None: the bundled drafter)
    dflash_draft: str | None = None  # markov_rank-0 drafter (None: the shipped DFlash, else head-off DSpark)
    num_prompts: int | None = 16
    max_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0,)
    concurrency: tuple[int, ...] = (1,)
    baselines: tuple[str, ...] | None = None  # compared against ar + dspark (always run); None: every applicable
    num_speculative_tokens: int | None = None  # None: SpeculativeConfig's, capped by the drafter's block_size
    context_depths: tuple[int, ...] = ()
    context_prompts: int = 4
    context_source: str | None = None  # corpus-format JSONL (default: the committed held-out sources)
    # adds 'dspark-window': dspark with draft_window W (the last W context tokens; 0: all of them)
    draft_window: int | None = None
    draft_vocab_size: int | None = None  # adds 'dspark-vocab': dspark with draft_vocab_size N (0: the full vocabulary)
    dtype: str = EngineConfig.dtype  # "auto": resolved once for the target (dspark.precision); every method runs it
    quantization: str = EngineConfig.quantization  # our engines' target weights; the peers run dense
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching  # our engines (warm-up prompts then hit the cache)
    seed: int = 0
    ignore_eos: bool = False
    json_object: bool = False  # every output constrained to a JSON object (our engines only: the peers are skipped)
    warmup: bool = True
    vllm_python: str | None = None  # python of a vLLM environment: adds vllm, vllm-ngram (and our ngram)
    vllm_kv_space_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (None: the environment's, else 1 GiB)
    llama_cpp_bin: str | None = None  # folder with llama.cpp's llama-completion: adds llama-cpp (GGUF targets)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ConfigError(f"bench: --temperature values must be >= 0, got {list(self.temperatures)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ConfigError(f"bench: --concurrency values must be >= 1, got {list(self.concurrency)}")
        if any(d < 1 for d in self.context_depths):
            raise ConfigError(f"bench: --context-depths must be positive token counts, got {list(self.context_depths)}")
        if self.max_tokens < 1:
            raise ConfigError(f"bench: --max-tokens must be >= 1, got {self.max_tokens}")
        if self.draft_window is not None and self.draft_window < 0:
            raise ConfigError(
                "bench: --draft-window must be 0 (the whole context) or a positive token count, "
                f"got {self.draft_window}"
            )
        if "dspark-window" in (self.baselines or ()) and self.draft_window is None:
            raise ConfigError("bench: method 'dspark-window' needs --draft-window W")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ConfigError(f"bench: --draft-vocab-size must be >= 0 (0: all tokens), got {self.draft_vocab_size}")
        if "dspark-vocab" in (self.baselines or ()) and self.draft_vocab_size is None:
            raise ConfigError("bench: method 'dspark-vocab' needs --draft-vocab-size N")
        unknown = sorted(set(self.baselines or ()) - set(ALL_METHODS))
        if unknown:
            raise ConfigError(f"bench: unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
        if self.vllm_kv_space_gib is not None and self.vllm_kv_space_gib < 1:
            raise ConfigError(f"bench: --vllm-kv-space must be >= 1 GiB, got {self.vllm_kv_space_gib}")


@dataclass(frozen=True)
class BenchReport:
    config: dict[str, Any]
    results: list[BenchRow]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config | {"notes": self.notes}, "results": [r.to_json() for r in self.results]}


@dataclass(frozen=True)
class Resolved:
    target_dir: Path
    draft_dir: Path | None
    dflash_dir: Path | None
    dflash_head_off: bool
    demo: bool


def resolve_dirs(cfg: BenchConfig) -> Resolved:
    from dspark.checkpoint.resolve import bundled_available, resolve_model, resolve_model_ref, shipped_drafts

    if cfg.model is None and not bundled_available():
        import tempfile

        from dspark.models.tiny import write_tiny_pair

        d = Path(tempfile.mkdtemp(prefix="dspark-bench-demo-"))
        target_dir, draft_dir = write_tiny_pair(d)
        warnings.warn(
            f"the bundled model pair is not installed: benchmarking a TINY RANDOM pair built in {d} "
            "(numbers are not meaningful); pass --model/--draft",
            stacklevel=2,
        )
        demo, shipped = True, None
    else:
        target_dir, demo = resolve_model(cfg.model), False
        shipped = shipped_drafts(target_dir)  # the bundled pair's, or a packaged alias target's drafters
        draft_dir = resolve_model_ref(cfg.draft, role="--draft") if cfg.draft else None
        draft_dir = draft_dir or (shipped[0] if shipped else None)
    dflash_dir = resolve_model_ref(cfg.dflash_draft, role="--dflash-draft") if cfg.dflash_draft else None
    if dflash_dir is None and shipped is not None and (shipped[1] / "config.json").exists():
        dflash_dir = shipped[1]
    head_off = dflash_dir is None and draft_dir is not None
    return Resolved(target_dir, draft_dir, dflash_dir or draft_dir, head_off, demo)


def method_names(cfg: BenchConfig, res: Resolved, notes: list[str]) -> list[str]:
    """ar and dspark, then --baselines (default: every applicable one); with --vllm-python also vllm, vllm-ngram and
    our ngram, so that the two n-gram proposers sit side by side."""
    names = [AR]
    if res.draft_dir is not None:
        names += ["dspark"] + (["dspark-window"] if cfg.draft_window is not None else [])
        names += ["dspark-vocab"] if cfg.draft_vocab_size is not None else []
    else:
        notes.append("dspark: skipped (no drafter for this target; pass --draft DIR)")
    listed = list(cfg.baselines) if cfg.baselines is not None else _applicable(cfg, res, notes)
    if cfg.json_object:
        peers = [n for n in listed if n not in ENGINE_METHODS]
        notes += [f"{', '.join(peers)}: skipped (--json-object: structured outputs run on our engine only)"] * bool(
            peers
        )
        listed = [n for n in listed if n in ENGINE_METHODS]
    if cfg.vllm_python and not cfg.json_object:
        vllm = not _peer_cannot_run(res.target_dir, "vLLM's CPU build", notes, VLLM_METHODS)
        listed += ["ngram"] + ([*VLLM_METHODS] if vllm else [])
    if cfg.llama_cpp_bin and not cfg.json_object:
        from dspark.checkpoint.gguf import gguf_source

        if gguf_source(res.target_dir) is None:
            notes.append(f"{LLAMA_CPP}: skipped ({res.target_dir} was not exported from a GGUF file)")
        else:
            listed.append(LLAMA_CPP)
    for n in listed:
        if n not in names and not (n == "dspark" and res.draft_dir is None):
            names.append(n)
    return names


def _peer_cannot_run(target_dir: Path, peer: str, notes: list[str], methods: Sequence[str]) -> bool:
    """Whether ``peer`` cannot run the target (its family says what the peer lacks: ``Family.peer_gap``)."""
    from dspark.models.loading import read_target_config

    cfg = read_target_config(target_dir) if (target_dir / "config.json").is_file() else None
    family = family_of(cfg) if cfg is not None else None
    why = family.peer_gap(cfg, peer) if family is not None else None
    if why is None:
        return False
    notes.append(f"{', '.join(methods)}: skipped ({peer} has no {why} for this {family.name} target)")
    return True


def _applicable(cfg: BenchConfig, res: Resolved, notes: list[str]) -> list[str]:
    # dspark-guard: DSpark as serve runs it by default (the guard hands the lead to plain steps when drafting loses)
    names = ["dflash", "dspark-guard"] if res.draft_dir is not None else []
    names += ["ngram"] + ([] if _peer_cannot_run(res.target_dir, "transformers", notes, HF_METHODS) else [*HF_METHODS])
    if res.draft_dir is not None:
        if not read_draft_config(res.draft_dir).enable_confidence_head:
            notes.append(f"dspark-adaptive: skipped ({res.draft_dir} has no confidence head)")
        elif _calibration_file(res) is not None:
            names.append("dspark-adaptive")
        else:
            notes.append("dspark-adaptive: skipped (no sts_calibration.json next to the draft; run `dspark calibrate`)")
    return names


def _calibration_file(res: Resolved) -> Path | None:
    for d in (res.draft_dir, res.target_dir):
        if d is not None and (d / "sts_calibration.json").exists():
            return d / "sts_calibration.json"
    return None


def _spec_for(
    name: str, res: Resolved, k: int, window: int | None = None, vocab: int | None = None
) -> dict[str, Any] | None:
    if name == AR:
        return None
    # every method but dspark-guard drafts every step: the bench measures the method itself
    common = {"num_speculative_tokens": k, "speculation_guard": name == "dspark-guard"}
    if name == "ngram":
        return {"method": "ngram"} | common
    if res.draft_dir is None:
        raise ConfigError(f"bench: method '{name}' needs a drafter; pass --draft DIR")
    if name == "dflash":
        return {"method": "dflash", "model": str(res.dflash_dir)} | common
    spec: dict[str, Any] = {"method": "dspark", "model": str(res.draft_dir)} | common
    if name == "dspark-adaptive":
        spec["enable_adaptive_verification"] = True
    if name == "dspark-window":
        spec["draft_window"] = window
    if name == "dspark-vocab":
        spec["draft_vocab_size"] = vocab
    return spec


def method_label(name: str, res: Resolved) -> str:
    return "dflash (head off)" if name == "dflash" and res.dflash_head_off else name


def _pages_needed(lengths: Sequence[int], concurrency: int, extra: int, page: int) -> int:
    per = sorted((math.ceil((n + extra) / page) for n in lengths), reverse=True)
    return sum(per[:concurrency])


@one_read_per_model()  # each model's files are read once, shared by every method's engine and the doctor
def run_bench(cfg: BenchConfig) -> BenchReport:
    """Build every method on one loaded target, then run all cells interleaved; see the module docstring."""
    from dspark.bench.datasets import depth_prompts, encode_prompt, read_bench_prompts, read_sources
    from dspark.models.loading import read_target_config, resolve_precision
    from dspark.models.model_spec import model_spec
    from dspark.tokenizer import load_tokenizer

    notes: list[str] = []
    res = resolve_dirs(cfg)
    target = model_spec(res.target_dir)
    precision = resolve_precision(target, cfg.dtype, cfg.quantization)
    cfg = replace(cfg, dtype=precision.dtype, quantization=precision.quantization)  # every method: the same dtype
    tcfg = read_target_config(target)
    tok = load_tokenizer(target, tcfg.vocab_size, tcfg.eos_token_ids, tcfg.bos_token_id)
    block = read_draft_config(res.draft_dir).block_size if res.draft_dir is not None else None
    k = cfg.num_speculative_tokens or min(SpeculativeConfig().num_speculative_tokens, block or 32)
    max_len = min(tcfg.max_position_embeddings, 32768)
    budget = max_len - cfg.max_tokens - k - 1  # prompt tokens that leave room for the output and one draft block
    if budget < 2:
        raise ConfigError(f"bench: --max-tokens {cfg.max_tokens} leaves no room for a prompt in {max_len} positions")

    def encode(text: str, chat: bool, limit: int = budget) -> tuple[int, ...]:
        return encode_prompt(tok, text, chat, limit)

    cells: list[Cell] = []
    prompts: list = []
    for path in cfg.dataset.split(","):  # one set of cells per dataset (e.g. code, math, chat)
        got = read_bench_prompts(path, cfg.num_prompts, getattr(tok, "apply_chat_template", None))
        base = tuple(encode(p.text, p.is_chat) for p in got)
        cut = sum(len(encode(p.text, p.is_chat, 10**9)) > budget for p in got)
        if cut:
            notes.append(
                f"{Path(path).name}: {cut} prompt(s) longer than {budget} tokens were cut to their last {budget}"
            )
        cells += [Cell(Path(path).name, t, c, base) for t in cfg.temperatures for c in cfg.concurrency]
        prompts += got
    dataset = Path(cfg.dataset.split(",")[0]).name  # context-depth cells pad the first dataset's prompts
    depth_cells: list[Cell] = []
    if cfg.context_depths:
        sources = read_sources(cfg.context_source) if cfg.context_source else read_sources()
        few = prompts[: cfg.context_prompts]
        positions = tcfg.max_position_embeddings  # a depth cell may reach past max_len, up to the target's positions
        deep_budget = positions - cfg.max_tokens - k - 1
        for depth in cfg.context_depths:
            if depth > positions or deep_budget < 2:
                notes.append(f"context depth {depth}: skipped (with --max-tokens it exceeds {positions} positions)")
                continue
            if depth > deep_budget:
                notes.append(
                    f"context depth {depth}: prompts padded to {deep_budget} tokens, so that --max-tokens and a draft "
                    f"block fit in the target's {positions} positions"
                )
            padded = depth_prompts(few, min(depth, deep_budget), tok, sources)
            for t in cfg.temperatures:
                depth_cells.append(Cell(f"{dataset}@ctx{depth}", t, min(cfg.concurrency), padded, True))

    names = method_names(cfg, res, notes)
    all_cells = cells + depth_cells
    measured, labels = _measure_ours([n for n in names if n not in PEER_METHODS], all_cells, cfg, res, k, tcfg, notes)
    gc.collect()  # our engines and the transformers model are gone before a peer starts
    for n in (n for n in names if n in PEER_METHODS):
        labels += _measure_peer(n, all_cells, measured, cfg, res, k, max_len, notes)
    rows = [r for cell, parts in zip(all_cells, measured) for r in rows_from_measurements(parts, cell)]
    notes += phase_notes(rows)
    config = _report_config(cfg, res, k, len(prompts), labels) | {"precision": precision.to_json()}
    return BenchReport(config, rows, notes)


def _report_config(cfg: BenchConfig, res: Resolved, k: int, num_prompts: int, labels: list[str]) -> dict[str, Any]:
    return {
        "model": str(res.target_dir),
        "draft": str(res.draft_dir) if res.draft_dir else None,
        "dflash_draft": str(res.dflash_dir) if res.dflash_dir else None,
        "dflash_head_off": res.dflash_head_off,
        "demo_tiny_random_pair": res.demo,
        "dataset": str(cfg.dataset),
        "num_prompts": num_prompts,
        "max_tokens": cfg.max_tokens,
        "temperatures": list(cfg.temperatures),
        "concurrency": list(cfg.concurrency),
        "methods": labels,
        "num_speculative_tokens": k,
        "context_depths": list(cfg.context_depths),
        "context_prompts": cfg.context_prompts,
        "draft_window": cfg.draft_window,
        "draft_vocab_size": cfg.draft_vocab_size,
        "dtype": cfg.dtype,
        "quantization": cfg.quantization,
        "seed": cfg.seed,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "ignore_eos": cfg.ignore_eos,
        "json_object": cfg.json_object,
        "interleaving": "round-robin over batches, start method rotated per batch; each vLLM method afterwards, "
        "alone (our engines freed, one vLLM instance at a time)",
    }


Parts = dict[str, list[Measurement]]


def _measure_ours(
    names: list[str], cells: list[Cell], cfg: BenchConfig, res: Resolved, k: int, tcfg: TargetConfig, notes: list[str]
) -> tuple[list[Parts], list[str]]:
    """Phase 1: our engines and the transformers baselines, interleaved; all of them are closed on return."""
    from dspark.llm import build_engines, engine_configs

    engine_names = [n for n in names if n in ENGINE_METHODS]
    page = 16
    extra = cfg.max_tokens + k + 2
    num_pages = max([_pages_needed([len(p) for p in c.prompts], c.concurrency, extra, page) for c in cells])
    longest = max((len(p) for c in cells for p in c.prompts), default=0)  # a depth past 32K needs a longer context
    engines = build_engines(
        res.target_dir,
        [_spec_for(n, res, k, cfg.draft_window, cfg.draft_vocab_size) for n in engine_names],
        *engine_configs(dtype=cfg.dtype,
        quantization=cfg.quantization,
        max_num_seqs=max(cfg.concurrency),
        num_pages=num_pages + max(cfg.concurrency),
        page_size=page,
        seed=cfg.seed,
        max_model_len=min(tcfg.max_position_embeddings, max(32768, longest + extra)),
        enable_prefix_caching=cfg.enable_prefix_caching),
    )
    methods: list[Method] = [EngineMethod(method_label(n, res), e) for n, e in zip(engine_names, engines)]
    del engines
    methods += _hf_methods([n for n in names if n in HF_METHODS], cfg, res, k, tcfg, notes)
    try:
        return _run_phase(methods, cells, cfg, notes), [m.name for m in methods]
    finally:
        for m in methods:
            m.close()


def _hf_methods(
    names: list[str], cfg: BenchConfig, res: Resolved, k: int, tcfg: TargetConfig, notes: list[str]
) -> list[Method]:
    out: list[Method] = []
    model = None
    for n in names:
        try:
            m = HFGenerate(n, res.target_dir, cfg.dtype, tcfg, k if n == "hf-prompt-lookup" else None, cfg.seed, model)
        except Exception as e:  # transformers cannot load this target: report, keep benchmarking the rest
            notes.append(f"{n}: skipped (transformers could not load {res.target_dir}: {e})")
            continue
        model = m.model
        out.append(m)
    return out


def vllm_spec(name: str, k: int) -> dict[str, Any] | None:
    """vLLM's speculative_config for a vLLM method: prompt lookup over 1..4-grams (vLLM's defaults), K tokens."""
    if name == "vllm":
        return None
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _peer(name: str, cfg: BenchConfig, res: Resolved, k: int, max_len: int) -> Method:
    """The peer method ``name`` (raises VLLMError / LlamaCppError when it cannot start)."""
    if name == LLAMA_CPP:
        import torch

        from dspark.checkpoint.gguf import gguf_source

        gguf = gguf_source(res.target_dir)
        if gguf is None or cfg.llama_cpp_bin is None:
            why = "pass --llama-cpp-bin DIR" if gguf else f"{res.target_dir} was not exported from a GGUF file"
            raise LlamaCppError(f"{name}: cannot run ({why})")
        return LlamaCppMethod(name, cfg.llama_cpp_bin, gguf, res.target_dir, torch.get_num_threads(), cfg.seed)
    assert cfg.vllm_python is not None
    spec = vllm_spec(name, k)
    return VLLMMethod(
        name, cfg.vllm_python, res.target_dir, spec, cfg.dtype, cfg.seed, max_len, None, cfg.vllm_kv_space_gib
    )


def _measure_peer(
    name: str,
    cells: list[Cell],
    measured: list[Parts],
    cfg: BenchConfig,
    res: Resolved,
    k: int,
    max_len: int,
    notes: list[str],
) -> list[str]:
    """A peer phase (vLLM, llama.cpp): one instance, alone, over every cell that is not engine-only; adds its
    measurements to ``measured`` (speed-up stays relative to our ``ar`` of the same cell)."""
    if name in VLLM_METHODS and not cfg.vllm_python:
        notes.append(f"{name}: skipped (pass --vllm-python PYTHON with vLLM installed)")
        return []
    open_cells = [(c, parts) for c, parts in zip(cells, measured) if not c.engine_only]
    try:  # a peer's failure costs its rows, never the measurements already taken
        method = _peer(name, cfg, res, k, max_len)
    except (VLLMError, LlamaCppError) as e:
        notes.append(f"{name}: failed, no rows ({str(e).splitlines()[0]})")
        return []
    try:
        phase = _run_phase([method], [c for c, _ in open_cells], cfg, notes)
    except (VLLMError, LlamaCppError) as e:
        notes.append(f"{name}: failed, no rows ({str(e).splitlines()[0]})")
        return []
    finally:
        method.close()
    notes += method.notes() if isinstance(method, LlamaCppMethod) else []
    for (_, parts), got in zip(open_cells, phase):
        parts |= got
    return [name]


def _run_phase(methods: list[Method], cells: list[Cell], cfg: BenchConfig, notes: list[str]) -> list[Parts]:
    """Warm every method up, then measure each cell with the methods that apply to it (round-robin)."""
    from tqdm import tqdm

    plan = [(cell, _active(methods, cell, notes)) for cell in cells]
    total = sum(len(a) * math.ceil(len(c.prompts) / c.concurrency) for c, a in plan)
    structured = StructuredOutput(json_object=True) if cfg.json_object else None
    params = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos, structured=structured)
    out: list[Parts] = []
    with tqdm(total=total, unit="batch", disable=not cfg.progress, dynamic_ncols=True) as bar:
        if cfg.warmup and cells:
            warm = replace(params, max_tokens=min(4, cfg.max_tokens), temperature=cfg.temperatures[0])
            for m in methods:
                bar.set_description(f"warm-up {m.name}")
                m.run([cells[0].prompts[0]], warm)
        for cell, active in plan:
            label = f"{cell.dataset} T={cell.temperature:g} c={cell.concurrency}"

            def tick(name: str, label: str = label) -> None:
                bar.set_description(f"{label} {name}")
                bar.update(1)

            out.append(measure_parts(active, cell, params, tick) if active else {})
    return out


def _active(methods: list[Method], cell: Cell, notes: list[str]) -> list[Method]:
    active = []
    for m in (m for m in methods if m.engine_backed or not cell.engine_only):
        why = m.skip_reason(cell.concurrency, cell.temperature)
        if why is None:
            active.append(m)
        else:
            notes.append(f"{m.name}: skipped at T={cell.temperature:g} concurrency={cell.concurrency} ({why})")
    return active


# ---- output ----------------------------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown_table(rows: Sequence[BenchRow], max_positions: int = 8) -> str:
    head = (
        "| method | dataset | T | conc | prompts | out tok | tok/s | speed-up | prefill tok/s | decode tok/s "
        "| decode speed-up | τ-bound | τ "
        "| verify rate "
        "| per-position acceptance |"
    )
    masked = any(r.grammar_ms_per_step is not None for r in rows)
    head += " grammar ms/step |" if masked else ""
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        pos = r.per_position_acceptance
        pos_s = "–" if pos is None else " ".join(f"{p:.2f}" for p in pos[:max_positions])
        lines.append(
            f"| {r.name} | {r.dataset} | {r.temperature:g} | {r.concurrency} | {r.num_prompts} | {r.output_tokens} "
            f"| {r.tokens_per_s:.1f} | {r.speedup_vs_ar:.2f}x "
            f"| {_fmt(r.prefill_tokens_per_s, '.1f')} | {_fmt(r.decode_tokens_per_s, '.1f')} "
            f"| {_fmt(r.decode_speedup_vs_ar, '.2f')}{'x' if r.decode_speedup_vs_ar else ''} "
            f"| {_fmt(r.tau_bound, '.2f')}{'x' if r.tau_bound else ''} "
            f"| {_fmt(r.acceptance_length, '.2f')} "
            f"| {_fmt(r.verify_rate, '.2f')} | {pos_s} |"
            + (f" {_fmt(r.grammar_ms_per_step, '.3f')} |" if masked else "")
        )
    return "\n".join(lines)
