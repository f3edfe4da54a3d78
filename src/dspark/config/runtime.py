"""What a run is configured with besides the models: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` keys),
``CacheConfig`` (the paged KV cache) and ``EngineConfig`` (batching, dtype, seed, attention backend)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any

from dspark.config.backends import attention_backend, warn_substitute
from dspark.config.common import ConfigError, ConfigKeys, fail, positive

# --------------------------------------------------------------------------------------------------------
# Speculative decoding (vLLM --speculative-config keys)
# --------------------------------------------------------------------------------------------------------

SPEC_METHODS = ("dspark", "dflash", "ngram")
DRAFT_QUANTIZATIONS = ("auto", "q8_0", "none")  # SpeculativeConfig.quantization: the drafter's linears
# SpeculativeConfig.draft_window's default: the drafters' block rows read this many context rows at most (the
# bundled pairs' τ held with it at every measured depth, and a drafter reading 32K rows costs more than it saves)
DEFAULT_DRAFT_WINDOW = 2048


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    model: str | None = None
    num_speculative_tokens: int = 7
    draft_sample_method: str = "probabilistic"
    rejection_sample_method: str = "block"
    enable_adaptive_verification: bool = False
    dspark_draft_topk: int | None = None
    attention_backend: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    calibration_path: str | None = None
    cost_table_path: str | None = None
    min_verify_len: int = 0
    # the drafter attends to the last W context tokens (the target to all of them): lossless whatever W, and it
    # bounds the drafter's cost at depth; null: DEFAULT_DRAFT_WINDOW; 0: the whole context
    draft_window: int | None = None
    # drafts only from the N most frequent tokens of the drafter's draft_vocab.json (EAGLE-3's reduced draft vocab);
    # None: the file's default_size (full vocabulary without the file); 0: full vocabulary
    draft_vocab_size: int | None = None
    # drafts only while speculative rounds emit more tokens per second than plain steps, measured per batch size
    # (spec/guard.py), so speculation is never much slower than plain decoding; greedy output is unchanged, and a
    # step with a seeded sampled request always drafts (its output stays reproducible); false: always draft
    speculation_guard: bool = True
    disable_by_batch_size: int | None = None  # vLLM's key: a decode step over more requests than this never drafts
    # vLLM's key for the draft model's weights: 'q8_0' (its linears as Q8_0 blocks in llama.cpp's int8 arithmetic,
    # native kernels), 'none' (dense) or null/'auto' ('q8_0' when the target is served in that arithmetic, else
    # 'none'); the drafts change a little, the output never (verification keeps the target's distribution)
    quantization: str | None = None

    def __post_init__(self) -> None:
        src = "speculative config"
        if self.method not in SPEC_METHODS:
            raise fail(src, "method", self.method, f"use one of {list(SPEC_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 32:
            raise fail(src, "num_speculative_tokens", self.num_speculative_tokens, "must be an integer in [1, 32]")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise fail(src, "draft_sample_method", self.draft_sample_method, "use 'greedy' or 'probabilistic'")
        if self.rejection_sample_method not in ("standard", "block"):
            raise fail(src, "rejection_sample_method", self.rejection_sample_method, "use 'standard' or 'block'")
        if self.dspark_draft_topk is not None and (
            not isinstance(self.dspark_draft_topk, int) or self.dspark_draft_topk < 1
        ):
            raise fail(src, "dspark_draft_topk", self.dspark_draft_topk, "must be null or a positive integer")
        attention_backend(self.attention_backend, src)  # validates; the substitute is announced once below
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise fail(src, "prompt_lookup_min", self.prompt_lookup_min, "need 1 <= min <= prompt_lookup_max")
        if not isinstance(self.speculation_guard, bool):
            raise fail(src, "speculation_guard", self.speculation_guard, "must be true or false")
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int)
            or isinstance(self.disable_by_batch_size, bool)
            or self.disable_by_batch_size < 1
        ):
            raise fail(src, "disable_by_batch_size", self.disable_by_batch_size, "must be null or a positive integer")
        if not 0 <= self.min_verify_len <= self.num_speculative_tokens:
            raise fail(src, "min_verify_len", self.min_verify_len, "must be in [0, num_speculative_tokens]")
        self._check_drafter_keys(src)
        if self.quantization not in (None, *DRAFT_QUANTIZATIONS):
            raise fail(src, "quantization", self.quantization, f"use null or one of {list(DRAFT_QUANTIZATIONS)}")
        if self.enable_adaptive_verification and self.method == "ngram":
            raise fail(src, "enable_adaptive_verification", True, "needs a drafter with a confidence head")
        warn_substitute(self.attention_backend, src)

    def _check_drafter_keys(self, src: str) -> None:
        """draft_window and draft_vocab_size: null or integers in range, and only for methods with a drafter."""
        for key, low, fix in (
            ("draft_window", 0, "must be null, 0 (the whole context) or a positive number of context tokens"),
            ("draft_vocab_size", 0, "must be null, 0 (the full vocabulary) or a positive number of draft tokens"),
        ):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise fail(src, key, value, fix)
            if value and self.method == "ngram":
                raise fail(src, key, value, "applies to a drafter; n-gram has none")

    @property
    def draft_window_rows(self) -> int | None:
        """The context rows the drafter reads at most (None: all of them)."""
        window = DEFAULT_DRAFT_WINDOW if self.draft_window is None else self.draft_window
        return window or None

    @property
    def draft_attention_backend(self) -> str | None:
        """What runs the drafter's attention here: 'torch', 'sdpa' or None (the drafter's default)."""
        return attention_backend(self.attention_backend, "speculative config")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        ConfigKeys(frozenset(f.name for f in fields(cls))).refuse_unknown(d, "speculative config")
        return cls(**dict(d))

    @classmethod
    def parse(cls, text: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """Parse a JSON string, ``@file.json`` or a dict; None/'' means no speculation."""
        if text is None or text == "":
            return None
        if isinstance(text, Mapping):
            return cls.from_dict(text)
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative config: not valid JSON ({e}): {text!r}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"speculative config: expected a JSON object, got {text!r}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------------
# Cache and engine
# --------------------------------------------------------------------------------------------------------


DTYPES = ("bfloat16", "float16", "float32")  # --dtype / EngineConfig.dtype: weights, activations and KV pages
AUTO = "auto"  # dtype / quantization chosen for this machine and model (dspark.precision)
DTYPE_CHOICES = (AUTO, *DTYPES)
QUANTIZATIONS = (AUTO, "gguf", "gguf-exact", "none")  # the target's weights: GGUF blocks as stored (int8 or fp32
# activations), or dense


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: derived from max_num_seqs * max_model_len
    swap_space: float | None = None  # vLLM's CPU swap (GiB): only 0/None, preempted requests are recomputed
    # vLLM's automatic prefix caching: full pages named by a chained hash of their tokens are shared by requests with
    # the same prefix, and kept after use until the pool needs them (off by default, as in vLLM v0: nothing changes
    # unless asked for)
    enable_prefix_caching: bool = False
    # prefix caching on a target with recurrent state (KDA): states kept at cached block boundaries, since pages
    # cannot rebuild them; a hit reaches only as far as a snapshot. None: one per state slot (max_num_seqs), at most
    # doubling the state memory; 0: none (such a target then never hits)
    max_state_snapshots: int | None = None
    # KV offload (needs prefix caching): a cached block the pool evicts is kept in a second tier instead of being
    # lost, first CPU memory (this many bytes, least recently used dropped or moved to disk first; 0: no CPU tier),
    # then files under kv_offload_dir (None: no disk tier) up to kv_offload_disk_bytes; a later hit loads it back
    kv_offload_cpu_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 16 * 2**30

    def __post_init__(self) -> None:
        positive("cache config", page_size=self.page_size, num_pages=self.num_pages)
        if not isinstance(self.enable_prefix_caching, bool):
            raise fail("cache config", "enable_prefix_caching", self.enable_prefix_caching, "must be true or false")
        n = self.max_state_snapshots
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise fail("cache config", "max_state_snapshots", n, "must be null or an integer >= 0 (0: no snapshots)")
        self._check_offload()
        if self.swap_space not in (None, 0):
            raise fail(
                "cache config",
                "swap_space",
                self.swap_space,
                "swapping KV pages is not supported: this engine keeps its pages in host memory and recomputes "
                "preempted requests; pass 0 or omit it",
            )

    @property
    def kv_offload(self) -> bool:
        """Whether evicted cached blocks go to a second tier (a CPU budget or a directory)."""
        return self.kv_offload_cpu_bytes > 0 or self.kv_offload_dir is not None

    def _check_offload(self) -> None:
        src = "cache config"
        for key in ("kv_offload_cpu_bytes", "kv_offload_disk_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise fail(src, key, value, "must be an integer number of bytes >= 0 (0: no such tier)")
        d = self.kv_offload_dir
        if d is not None and (not isinstance(d, str | PathLike) or not str(d).strip()):
            raise fail(src, "kv_offload_dir", d, "must be null (no disk tier) or a directory path")
        if self.kv_offload and not self.enable_prefix_caching:
            key = "kv_offload_cpu_bytes" if self.kv_offload_cpu_bytes else "kv_offload_dir"
            raise fail(
                src,
                key,
                getattr(self, key),
                "KV offload keeps the blocks the prefix cache evicts; set enable_prefix_caching=True "
                "(--enable-prefix-caching) or turn offload off (kv_offload_cpu_bytes 0, kv_offload_dir null)",
            )


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the target's max_position_embeddings (capped at 32768)
    dtype: str = AUTO  # bf16 where the CPU multiplies it natively, else fp32; fp32 for a quantized target
    quantization: str = AUTO  # the target's weight format: "gguf" for a .gguf model when the native kernels run
    seed: int = 0
    log_stats_interval_s: float = 10.0
    max_waiting: int = 256
    attention_backend: str | None = None  # target (and default draft) attention: vLLM's --attention-backend
    prepack_weights: bool = True  # bf16 on CPU: oneDNN-packed copies of the linear weights (faster; 2× weight memory)
    # a step's batch is split into context-length groups when the padded attention work saved exceeds one extra
    # forward, costed as this many (row, key) pairs (see dspark.engine.grouping); 0: never split. 65,536 = 8 verify
    # rows over 8k keys: a batch of decodes whose contexts differ by a few hundred tokens stays whole (on k3-mini two
    # forwards of 8 requests cost more than one of 16), one 16k request among short ones does not
    split_batch_keys: int = 65536

    def __post_init__(self) -> None:
        src = "engine config"
        attention_backend(self.attention_backend, src)
        warn_substitute(self.attention_backend, src)
        positive(
            src,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=self.max_waiting,
        )
        if self.dtype not in DTYPE_CHOICES:
            raise fail(src, "dtype", self.dtype, f"use one of {list(DTYPE_CHOICES)}")
        if self.quantization not in QUANTIZATIONS:
            raise fail(src, "quantization", self.quantization, f"use one of {list(QUANTIZATIONS)}")
        if not isinstance(self.split_batch_keys, int) or self.split_batch_keys < 0:
            raise fail(src, "split_batch_keys", self.split_batch_keys, "use an integer >= 0 (0 disables splitting)")

    @property
    def target_attention_backend(self) -> str | None:
        """What runs the target's attention here: 'torch', 'sdpa' or None (each model's default)."""
        return attention_backend(self.attention_backend, "engine config")
