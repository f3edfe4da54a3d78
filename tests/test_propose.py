"""Proposers: the drafter always runs its trained block; n-gram prompt lookup with vLLM's semantics."""

import pytest
import torch

from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config
from dspark.sampling_params import SamplingParams
from dspark.speculative.propose import ngram_lookup


def _prefilled_engine(block_size):
    tcfg = tiny_target_config()
    target, drafter = build_tiny_pair(4, tcfg, tiny_draft_config(tcfg, block_size=block_size))
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=block_size)
    eng = Engine(target, drafter, spec, EngineConfig(dtype="float32"))
    prompts = [[5, 9, 17, 33, 8], [40, 41, 42], list(range(10, 30))]
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(temperature=[0.0, 0.7, 1.3][i], top_k=[0, 0, 20][i], max_tokens=16))
    eng.step()  # prefill + first token: every request now has an anchor to draft from
    return eng, [eng.requests[f"req-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("draw", ["probabilistic", "greedy"])
@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_fewer_speculative_tokens_propose_the_first_k_of_the_trained_block(draw, method):
    eng, reqs = _prefilled_engine(block_size=7)
    props = {}
    for k in (4, 7):
        sampling = eng.runner.sampling_tensors(reqs, k + 1)
        props[k] = eng.runner.propose_draft(reqs, sampling, draw == "probabilistic", method == "dspark", None)
    short, full = props[4], props[7]
    assert torch.equal(short.tokens, full.tokens[:, :4])
    torch.testing.assert_close(short.confidence, full.confidence[:, :4], rtol=0, atol=0)
    if draw == "probabilistic":
        torch.testing.assert_close(short.q, full.q[:, :4], rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculative_equals_target_with_a_wider_trained_block(k):
    tcfg = tiny_target_config()
    target, drafter = build_tiny_pair(6, tcfg, tiny_draft_config(tcfg, block_size=7))
    prompts = [[5, 9, 17, 33, 8], [40, 41, 42], list(range(10, 30))]
    params = SamplingParams(temperature=0, max_tokens=20)

    def run(spec):
        eng = Engine(target, drafter, spec, EngineConfig(dtype="float32"))
        for p in prompts:
            eng.add_request(p, params)
        outs = {}
        while eng.has_unfinished:
            outs |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
        return [outs[f"req-{i}"] for i in range(len(prompts))], eng

    ref, _ = run(None)
    got, eng = run(SpeculativeConfig(method="dspark", num_speculative_tokens=k))
    assert got == ref
    assert eng.metrics.spec.num_drafts > 0


def test_ngram_takes_the_earliest_occurrence_with_a_full_continuation():
    # suffix (10, 11) occurs at 0 and at 7: the latest earlier match runs into the end after 3 tokens
    seq = [10, 11, 20, 21, 22, 23, 30, 10, 11, 40, 10, 11]
    assert ngram_lookup(seq, 4, 1, 2) == [20, 21, 22, 23]


def test_ngram_prefers_the_longest_n_gram_then_the_earliest_occurrence():
    # the 3-gram (7, 8, 9) occurs once (at 6); the 2-gram (8, 9) occurs earlier (at 0) with another continuation
    seq = [8, 9, 1, 2, 3, 4, 7, 8, 9, 5, 6, 0, 0, 7, 8, 9]
    assert ngram_lookup(seq, 3, 1, 3) == [5, 6, 0]
    assert ngram_lookup(seq, 3, 1, 2) == [1, 2, 3]  # max 2: the earliest (8, 9)
    assert ngram_lookup(seq, 3, 4, 4) == []  # no 4-gram repeats
    assert ngram_lookup(seq, 3, 3, 3) == [5, 6, 0]


def test_ngram_overlapping_occurrence_and_edges():
    assert ngram_lookup([4, 4, 4, 4], 5, 1, 3) == [4]  # (4, 4, 4) at 0 overlaps the suffix: one token follows
    assert ngram_lookup([3, 1, 2, 3], 2, 1, 4) == [1, 2]
    assert ngram_lookup([3], 2, 1, 4) == []
    assert ngram_lookup([], 2, 1, 4) == []
    assert ngram_lookup([1, 2, 3], 2, 1, 4) == []
