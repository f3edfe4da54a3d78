"""Prometheus metrics for ``GET /metrics`` (vLLM names, so ``vllm bench serve`` and vLLM dashboards work).

Engine counters (tokens, preemptions, speculative decoding) are read from ``engine.metrics`` at scrape time by a
custom collector, so they always agree with the engine. Latency histograms and per-reason request counts are
recorded from the engine thread as outputs arrive (``ServerMetrics.record``).

Exported families (every one labelled ``model_name``):
  vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
  vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
      (only when the engine speculates), dspark:spec_decode_verify_len (histogram of verified drafts per step),
      dspark:spec_decode_verify_tokens_total, dspark:spec_decode_num_steps_total,
      dspark:spec_decode_mean_acceptance_length (gauge, 1 + accepted / drafts)
  vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
  vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens looked up / found cached in the pool at
      admission; 0 with prefix caching off),
  vllm:external_prefix_cache_queries_total, vllm:external_prefix_cache_hits_total (KV offload: tokens of admissions
      that could look up the offload tiers / tokens of blocks loaded back from them),
  dspark:kv_offload_stores_total{tier}, dspark:kv_offload_loads_total{tier}, dspark:kv_offload_corrupt_drops_total
      {tier}, dspark:kv_offload_evictions_total{tier} (blocks; tier "cpu" or "disk"; 0 with offload off),
  vllm:request_success_total{finished_reason="stop"|"length"|"abort"|"error"},
  vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (fraction 0..1),
  vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds,
  vllm:request_time_per_output_token_seconds, vllm:request_prompt_tokens, vllm:request_generation_tokens
  dspark:kv_transfer_bytes_total{direction="sent"|"received"}, dspark:kv_transfer_requests_total{direction="sent"|
      "imported"}, dspark:kv_transfer_failures_total, dspark:kv_transfer_fallbacks_total (P/D disaggregation: payload
      bytes pushed by a prefill instance / accepted by a decode instance, requests shipped and continued, failed
      exports, pushes or imports, and requests a decode instance prefilled itself for want of a usable payload)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from dspark.cache.offload import TIERS, OffloadStats
from dspark.engine.engine import Engine, RequestOutput
from dspark.engine.metrics import SpecDecodingMetrics
from dspark.engine.transfer import TransferMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 480.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    """One registry per app. ``record`` runs on the engine thread; ``render`` on any thread."""

    def __init__(self, engine: Engine, model_name: str, lock: threading.Lock | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.lock = lock
        self.registry = CollectorRegistry(auto_describe=True)
        self.finished_by_reason: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.transfer = TransferMetrics()  # P/D disaggregation (serve/disagg.py)
        self._first_seen: set[str] = set()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            h = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (engine arrival).", TTFT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS
        )
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.gen_len = hist("vllm:request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(self))

    def record(self, outs: Sequence[RequestOutput]) -> None:
        for out in outs:
            rid = out.request_id
            if out.first_token_time is not None and rid not in self._first_seen:
                self._first_seen.add(rid)
                self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            if not out.finished:
                continue
            self._first_seen.discard(rid)
            reason = out.finish_reason or "stop"
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            if reason in ("abort", "error") or out.finish_time is None:
                continue
            self.e2e.observe(max(0.0, out.finish_time - out.arrival_time))
            self.prompt_len.observe(len(out.prompt_token_ids))
            self.gen_len.observe(len(out.token_ids))
            if out.first_token_time is not None and len(out.token_ids) > 1:
                self.tpot.observe(max(0.0, out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []  # families depend on the engine (speculation on/off); don't pre-register names

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        with o.lock if o.lock is not None else contextlib.nullcontext():
            yield from self._families(o.engine, o.model_name, dict(o.finished_by_reason))
        yield from _transfer_families(o.transfer, o.model_name)

    @staticmethod
    def _families(engine: Engine, name: str, by_reason: dict[str, int]) -> Iterator[Metric]:
        m = engine.metrics
        yield _counter(name, "vllm:prompt_tokens", "Prefill tokens received.", m.prompt_tokens)
        yield _counter(name, "vllm:generation_tokens", "Tokens generated.", m.generation_tokens)
        yield _counter(name, "vllm:num_preemptions", "Requests preempted (recomputed later).", m.num_preemptions)
        pc = m.prefix_cache
        yield _counter(name, "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", pc.queries)
        yield _counter(name, "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", pc.hits)
        yield from _offload_families(engine.prefix.offload_stats if engine.prefix is not None else None, name)
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests by reason.", labels=["model_name", "finished_reason"]
        )
        for reason, n in sorted(by_reason.items()):
            success.add_metric([name, reason], n)
        yield success
        running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
        yield _gauge(name, "vllm:num_requests_running", "Requests in the running batch.", running)
        yield _gauge(name, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        used = 1.0 - engine.num_pages_free / engine.pool.num_pages
        yield _gauge(name, "vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use.", used)
        if engine.K > 0:
            yield from _spec_families(engine.metrics.spec, engine.K, name)


def _offload_families(stats: OffloadStats | None, name: str) -> Iterator[Metric]:
    s = stats or OffloadStats()
    yield _counter(name, "vllm:external_prefix_cache_queries", "KV offload lookups, in queried tokens.", s.queries)
    yield _counter(name, "vllm:external_prefix_cache_hits", "KV offload hits, in tokens loaded back.", s.hits)
    for metric, doc, counts in (
        ("stores", "Evicted cached blocks stored in an offload tier.", s.stores),
        ("loads", "Offloaded blocks loaded back into the KV pool.", s.loads),
        ("corrupt_drops", "Offloaded blocks found corrupt or truncated and dropped.", s.corrupt_drops),
        ("evictions", "Blocks pushed out of a full offload tier.", s.evictions),
    ):
        c = CounterMetricFamily(f"dspark:kv_offload_{metric}", doc, labels=["model_name", "tier"])
        for tier in TIERS:
            c.add_metric([name, tier], counts[tier])
        yield c


def _transfer_families(t: TransferMetrics, name: str) -> Iterator[Metric]:
    for metric, doc, by_direction in (
        (
            "dspark:kv_transfer_bytes",
            "KV transfer payload bytes.",
            {"sent": t.bytes_sent, "received": t.bytes_received},
        ),
        (
            "dspark:kv_transfer_requests",
            "Requests shipped / continued.",
            {"sent": t.requests_sent, "imported": t.requests_imported},
        ),
    ):
        family = CounterMetricFamily(metric, doc, labels=["model_name", "direction"])
        for direction, value in by_direction.items():
            family.add_metric([name, direction], value)
        yield family
    yield _counter(name, "dspark:kv_transfer_failures", "Failed KV exports, pushes or imports.", t.failures)
    yield _counter(
        name, "dspark:kv_transfer_fallbacks", "Requests prefilled locally for want of a payload.", t.fallbacks
    )


def _counter(name: str, metric: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(metric, doc, labels=["model_name"])
    c.add_metric([name], value)
    return c


def _gauge(name: str, metric: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(metric, doc, labels=["model_name"])
    g.add_metric([name], value)
    return g


def _spec_families(s: SpecDecodingMetrics, K: int, name: str) -> Iterator[Metric]:
    yield _counter(name, "vllm:spec_decode_num_drafts", "Speculative verification steps (drafts).", s.num_drafts)
    yield _counter(name, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", s.num_draft_tokens)
    yield _counter(name, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by position.",
        labels=["model_name", "position"],
    )
    counts = list(s.accepted_per_pos) + [0] * max(0, K - len(s.accepted_per_pos))
    for pos, n in enumerate(counts):
        per_pos.add_metric([name, str(pos)], n)
    yield per_pos
    yield _verify_len_histogram(s, K, name)
    yield _counter(name, "dspark:spec_decode_verify_tokens", "Target rows verified (anchor + drafts).", s.verify_tokens)
    yield _counter(name, "dspark:spec_decode_num_steps", "Engine decode steps with speculation.", s.num_steps)
    tau = s.acceptance_length
    yield _gauge(name, "dspark:spec_decode_mean_acceptance_length", "1 + accepted / drafts.", tau or 0.0)


def _verify_len_histogram(s: SpecDecodingMetrics, K: int, name: str) -> HistogramMetricFamily:
    hist = HistogramMetricFamily(
        "dspark:spec_decode_verify_len", "Drafts verified per request per step.", labels=["model_name"]
    )
    lens = dict(s.verify_len_hist)
    cumulative, buckets = 0, []
    for le in range(K + 1):
        cumulative += lens.get(le, 0)
        buckets.append((str(float(le)), cumulative))
    buckets.append(("+Inf", sum(lens.values())))
    hist.add_metric([name], buckets, sum_value=float(sum(k * v for k, v in lens.items())))
    return hist
