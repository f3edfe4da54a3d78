"""Invariance: a row's logits depend only on its own inputs, never on how many other rows share the forward or what
they hold, nor on the chunks its prompt was prefilled in or where a cached prefix ended, for each native family
(MLA, hybrid KDA + MLA, GQA) and dtype. Greedy
speculation is lossless only if a verification (many rows per step) computes each row as a decode step (one row)
does; in bf16 a different summation order flips near-tied argmaxes."""

from __future__ import annotations

import logging

import pytest
import torch

import dspark.native as native
from dspark.config import CacheConfig, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.packing import pack_for_inference
from dspark.models.tiny import build_tiny_gqa_pair, build_tiny_hybrid_pair, build_tiny_pair, tiny_hybrid_config
from dspark.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.ops() is None, reason="the native kernels are not built on this machine")

FAMILIES = {
    "mla": lambda: build_tiny_pair(0),
    "hybrid-k3": lambda: build_tiny_hybrid_pair(0, tiny_hybrid_config(k3=True)),
    "hybrid-kimi-linear": lambda: build_tiny_hybrid_pair(0, tiny_hybrid_config(k3=False)),
    "gqa": lambda: build_tiny_gqa_pair(0),
}


def reduced(family: str, dtype: torch.dtype):
    """The family's tiny pair in ``dtype``, fused and packed as the engine runs it."""
    target, drafter = FAMILIES[family]()
    target, drafter = target.to(dtype), drafter.to(dtype)
    target.fuse_for_inference()
    pack_for_inference(target)
    return target, drafter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("T", [1, 5, 12])
def test_a_rows_logits_do_not_depend_on_the_rest_of_the_batch(family: str, dtype: torch.dtype, T: int) -> None:
    target, _ = reduced(family, dtype)
    g = torch.Generator().manual_seed(T)
    batch = torch.randint(3, 96, (24, T), generator=g)
    with torch.inference_mode():
        alone = target(batch[:1]).logits
        shared = target(batch).logits
        other = target(torch.cat((batch[:1], batch[8:15]))).logits  # the same row among other companions
    assert torch.equal(alone[0], shared[0]) and torch.equal(alone[0], other[0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_greedy_equals_plain_greedy_with_many_prompts_batched_in_bf16(family: str) -> None:
    target, drafter = reduced(family, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(4, 20, (12,), generator=g)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def greedy(spec: SpeculativeConfig | None, seqs: int) -> list[list[int]]:
        engine = Engine(target, drafter if spec else None, spec, EngineConfig(dtype="bfloat16", max_num_seqs=seqs))
        return [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    alone = greedy(None, 1)
    together = greedy(None, 12)
    # 12 sequences × 8 verified rows: 96 rows per step, more than any per-call size switch
    speculative = greedy(SpeculativeConfig(method="dspark", num_speculative_tokens=7), 12)
    assert all(len(t) == 24 for t in alone)
    assert together == alone and speculative == alone


def test_the_engine_says_at_start_up_what_is_not_invariant(caplog, monkeypatch) -> None:
    caplog.set_level(logging.INFO, logger="dspark.engine")
    for family in FAMILIES:  # the native families: nothing to say, in any dtype
        for dtype in ("bfloat16", "float32"):
            Engine(reduced(family, DTYPES[dtype])[0], engine_config=EngineConfig(dtype=dtype))
    assert "can change a row's rounding" not in caplog.text
    monkeypatch.setenv(native.ENV, "0")  # without the native kernels every forward takes the modules
    Engine(reduced("mla", torch.bfloat16)[0], engine_config=EngineConfig(dtype="bfloat16"))
    assert "MLATarget, bfloat16: the native kernels are not built" in caplog.text


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_prompt_gives_the_same_bits_whatever_its_chunks_cached_prefix_or_company(family: str, dtype: str) -> None:
    """Greedy tokens and their logprobs, bit for bit, for prompts sharing a 40-token prefix: all prefilled together in
    one budget; in chunks of 1, 16 and 64 tokens; one, eight or all sequences at a time; with prefix caching (each
    later prompt hits the first one's blocks, split mid-prompt, then every prompt again hits up to its last full
    block); and speculatively."""
    target, drafter = reduced(family, DTYPES[dtype])
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 96, (40,), generator=g).tolist()
    lengths = torch.randint(3, 30, (12,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run(spec: SpeculativeConfig | None = None, cache: bool = False, **engine: int) -> list:
        engine.setdefault("max_num_seqs", 24)
        e = Engine(target, drafter if spec else None, spec, EngineConfig(dtype=dtype, **engine),
                   CacheConfig(enable_prefix_caching=cache))  # fmt: skip
        llm = LLM.from_engine(e)
        if cache:  # the first prompt alone, then the rest (hits mid-prompt), then all again (hits to the last block)
            llm.generate(prompts[:1], params)
            llm.generate(prompts[1:], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    ref = run(max_num_batched_tokens=2048)
    assert all(len(ids) == 6 for ids, _ in ref)
    for seqs in (1, 8):
        assert run(max_num_seqs=seqs) == ref, f"{seqs} sequences at a time"
    for budget in (1, 16, 64):
        assert run(max_num_batched_tokens=budget) == ref, f"chunks of {budget}"
    assert run(cache=True) == ref, "prefix-cache hits"
    greedy = run(SpeculativeConfig(method="dspark", num_speculative_tokens=3), max_num_batched_tokens=16)
    assert [ids for ids, _ in greedy] == [ids for ids, _ in ref], "speculative, chunks of 16"
