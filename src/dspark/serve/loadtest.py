"""A small closed-loop load generator for ``dspark serve`` (or any OpenAI-compatible server).

``run(url, concurrency, n, max_tokens) -> LoadTestResult``: ``n`` streaming /v1/completions requests, at most
``concurrency`` in flight; time to first token is measured at the first chunk carrying text, output tokens come
from the usage chunk, and the speculative counters are diffed from /metrics (as ``vllm bench serve`` does).
``dspark loadtest --url http://127.0.0.1:8000 --concurrency 1 16`` prints one JSON line per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import httpx

from dspark.cli_common import add_max_tokens_arg
from dspark.serve.config import DEFAULT_HOST, DEFAULT_PORT

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a land far away,",
    "The capital of France is",
    "import numpy as np\n\n",
    "Speculative decoding works by",
)

_SPEC = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@dataclass(frozen=True)
class LoadTestResult:
    concurrency: int
    num_requests: int
    num_errors: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    e2e_p50_s: float | None
    acceptance_length: float | None  # 1 + accepted / drafts over the run (None without speculation)


@dataclass(frozen=True)
class _One:
    ttft: float | None
    e2e: float
    tokens: int
    error: str | None = None


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def scrape_spec_counters(text: str) -> dict[str, float]:
    """Sum the vLLM speculative counters in a Prometheus text page (over all label sets)."""
    out = dict.fromkeys(_SPEC, 0.0)
    for name in _SPEC:
        for m in re.finditer(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE):
            out[name] += float(m.group(1))
    return out


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> _One:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return _One(None, time.perf_counter() - t0, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _One(ttft, time.perf_counter() - t0, tokens, str(chunk["error"]))
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as e:
        return _One(ttft, time.perf_counter() - t0, tokens, repr(e))
    return _One(ttft, time.perf_counter() - t0, tokens)


async def _run(
    url: str,
    concurrency: int,
    n: int,
    max_tokens: int,
    prompts: Sequence[str],
    api_key: str | None,
    temperature: float,
    ignore_eos: bool,
) -> LoadTestResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=limits) as client:
        before = scrape_spec_counters((await client.get(f"{url}/metrics")).text)
        sem = asyncio.Semaphore(concurrency)

        async def job(i: int) -> _One:
            async with sem:
                return await _one(client, url, _body(prompts[i % len(prompts)], max_tokens, temperature, ignore_eos))

        t0 = time.perf_counter()
        results = await asyncio.gather(*(job(i) for i in range(n)))
        wall = time.perf_counter() - t0
        after = scrape_spec_counters((await client.get(f"{url}/metrics")).text)
    return _summary(concurrency, results, wall, before, after)


def _body(prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _summary(
    concurrency: int, results: Sequence[_One], wall: float, before: dict[str, float], after: dict[str, float]
) -> LoadTestResult:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.tokens for r in ok)
    drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return LoadTestResult(
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        wall_s=wall,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        e2e_p50_s=statistics.median([r.e2e for r in ok]) if ok else None,
        acceptance_length=1.0 + accepted / drafts if drafts > 0 else None,
    )


def run(
    url: str,
    concurrency: int,
    n: int,
    max_tokens: int,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    api_key: str | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> LoadTestResult:
    """Send ``n`` streaming completions with at most ``concurrency`` in flight; ``url`` is the server root."""
    if concurrency < 1 or n < 1 or max_tokens < 1:
        raise ValueError(f"concurrency, n and max_tokens must be >= 1 (got {concurrency}, {n}, {max_tokens})")
    url = url.rstrip("/").removesuffix("/v1")
    return asyncio.run(_run(url, concurrency, n, max_tokens, prompts, api_key, temperature, ignore_eos))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loadtest",
        help="closed-loop load on a running server: TTFT, tokens/s and acceptance per concurrency level",
        description=__doc__,
    )
    p.add_argument("--url", default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", help="the server's base URL")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="levels, one JSON line each")
    p.add_argument("--num-requests", type=int, default=32)
    add_max_tokens_arg(p, 64)
    p.add_argument("--api-key", default=None)
    p.set_defaults(func=cmd_loadtest)


def cmd_loadtest(args: argparse.Namespace) -> int:
    for c in args.concurrency:
        print(json.dumps(asdict(run(args.url, c, args.num_requests, args.max_tokens, api_key=args.api_key))))
    return 0
