"""Batch invariance in the reduced-precision dtypes: a row's logits depend only on its own inputs, never on how
many other rows share the forward or what they hold, for each native family (MLA, hybrid KDA + MLA, GQA). Greedy
speculation is lossless only if a verification (many rows per step) computes each row as a decode step (one row)
does; in bf16 a different summation order flips near-tied argmaxes."""

from __future__ import annotations

import logging

import pytest
import torch

import dspark.native as native
from dspark.config import EngineConfig, SpeculativeConfig
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


def test_the_engine_says_at_start_up_what_is_not_invariant(caplog) -> None:
    caplog.set_level(logging.INFO, logger="dspark.engine")
    target, _ = reduced("mla", torch.bfloat16)
    Engine(target, engine_config=EngineConfig(dtype="bfloat16"))
    assert "bfloat16: each row's logits are independent of the batch" in caplog.text
    assert "prefilled in other chunks" in caplog.text
    caplog.clear()
    Engine(build_tiny_pair(0)[0], engine_config=EngineConfig(dtype="float32"))
    assert "independent of the batch" not in caplog.text
