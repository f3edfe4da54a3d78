"""Logprobs, prompt logprobs and logits processing (logit_bias, min_tokens, penalties), exact under speculation."""

import pytest
import torch

import dspark.speculative.processing as processing
from dspark.config import CacheConfig, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config
from dspark.sampling_params import SamplingParams, SamplingParamsError
from test_engine import _chi_square, _oracle_proposer, prompts_for

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)
K = 3
SPECS = {
    "dspark": SpeculativeConfig(method="dspark", num_speculative_tokens=K),
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=K),
}
PROCESSED = [  # every processor, alone and together
    SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=2.0),
    SamplingParams(temperature=0, max_tokens=16, presence_penalty=-1.0),
    SamplingParams(
        temperature=0,
        max_tokens=16,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={5: 1.0, 9: -2.0},
        min_tokens=4,
        logprobs=2,
    ),
]


@pytest.fixture(scope="module")
def pair():
    return build_tiny_pair(0)


def run(pair, spec, prompts, params, oracle=False):
    """Outputs of ``prompts``; ``oracle``: drafts are the target's own greedy continuations (most get accepted)."""
    eng = Engine(*pair, spec, FP32)
    if oracle:
        eng.runner.propose_draft = _oracle_proposer(pair[0], K)
    return LLM.from_engine(eng).generate(prompts, params), eng


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("method,oracle", [("dspark", True), ("dspark", False), ("ngram", False)])
def test_processed_greedy_speculative_equals_plain(pair, method, oracle):
    prompts = prompts_for(3, len(PROCESSED))
    ref, _ = run(pair, None, prompts, PROCESSED)
    got, eng = run(pair, SPECS[method], prompts, PROCESSED, oracle)
    assert _tokens(got) == _tokens(ref)
    assert method == "ngram" or eng.metrics.spec.num_draft_tokens > 0
    if oracle:
        assert eng.metrics.spec.num_accepted_tokens > eng.metrics.spec.num_drafts  # blocks with several accepted


def test_penalty_counts_that_skip_accepted_drafts_are_detected(pair, monkeypatch):
    """The equality above has power: counting only the tokens generated before the round breaks it."""
    prompts = prompts_for(3, len(PROCESSED))
    ref, _ = run(pair, None, prompts, PROCESSED)
    real = processing.round_counts
    monkeypatch.setattr(processing, "round_counts", lambda counts, drafts, n: real(counts, None, n))
    got, _ = run(pair, SPECS["dspark"], prompts, PROCESSED, oracle=True)
    assert _tokens(got) != _tokens(ref)


def _full_logprobs(target, ids):
    with torch.no_grad():
        return target(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("oracle", [True, False])
def test_logprobs_are_the_targets_raw_distribution_with_and_without_speculation(pair, oracle):
    """Each emitted token's logprob and top-k equal a full forward's log-softmax over prompt + output (fp32: the
    verification forward's GEMM shapes differ from a one-row decode's, so values agree to rounding, ranks exactly),
    speculation on or off; the prompt's logprobs too (the first token has none)."""
    prompts = prompts_for(5, 3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain, _ = run(pair, None, prompts, params)
    spec, eng = run(pair, SPECS["dspark"], prompts, params, oracle)
    assert oracle is False or eng.metrics.spec.num_accepted_tokens > 0
    for a, b, prompt in zip(plain, spec, prompts):
        assert a.token_ids == b.token_ids
        full = _full_logprobs(pair[0], prompt + a.token_ids[:-1])
        for out in (a, b):
            lps = out.outputs[0].logprobs
            assert [lp.token_id for lp in lps] == out.token_ids and all(lp.rank == 1 for lp in lps)  # greedy
            rows = full[len(prompt) - 1 :]
            want = rows.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-5, rtol=0)
            assert [[t for t, _ in lp.top] for lp in lps] == rows.topk(3).indices.tolist()
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
            want = full[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
            assert torch.allclose(got, want, atol=1e-5, rtol=0)
            assert all(len(lp.top) == 2 for lp in out.prompt_logprobs[1:])


def test_prompt_logprobs_alone_is_one_prefill_without_decoding(pair):
    eng = Engine(*pair, SPECS["dspark"], FP32, CacheConfig(enable_prefix_caching=True, page_size=4))
    prompt = prompts_for(6, 1)[0] * 3
    llm = LLM.from_engine(eng)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # cached: the next one must not use it
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.token_ids == [] and out.finish_reason == "length" and out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) and all(lp.top == () for lp in out.prompt_logprobs[1:])
    want = _full_logprobs(pair[0], prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]]), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", [None, "dspark"])
def test_logit_bias_and_min_tokens(pair, spec):
    prompts = prompts_for(8, 3)
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=3, logit_bias={17: 100.0}, ignore_eos=True)
    outs, _ = run(pair, SPECS.get(spec), prompts, forced)
    assert all(o.token_ids == [17, 17, 17] for o in outs)  # +100 makes the token certain, every position
    eos = 2
    held = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5, stop_token_ids=(eos,))
    outs, _ = run(pair, SPECS.get(spec), prompts, held)
    for o in outs:  # EOS is held back for 5 tokens, then it is certain
        assert len(o.token_ids) == 6 and eos not in o.token_ids[:5] and o.token_ids[5] == eos


def test_processing_params_are_range_checked():
    for bad in (
        {"presence_penalty": 3},
        {"frequency_penalty": -2.5},
        {"repetition_penalty": 0},
        {"logprobs": 21},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {3: 101}},
        {"min_tokens": -1},
    ):
        with pytest.raises(SamplingParamsError, match=next(iter(bad))):
            SamplingParams(**bad)


def _processed_logits(logits, prompt, generated, p):
    """The processing rules written out for one position (the oracle of spec/processing.py)."""
    x = logits.clone()
    for t, b in p["logit_bias"].items():
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p["repetition_penalty"] if x[t] > 0 else x[t] * p["repetition_penalty"]
    for t in set(generated):
        x[t] -= p["frequency_penalty"] * generated.count(t) + p["presence_penalty"]
    return x


def _exact_three_token_distribution(target, prompt, V, p):
    out = torch.zeros(V, V, V)
    with torch.no_grad():
        l1 = target(torch.tensor([prompt])).logits[0, -1].float()
        p1 = _processed_logits(l1, prompt, [], p).softmax(-1)
        l2 = target(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1].float()
        l3 = target(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])).logits[:, -1].float()
    for a in range(V):
        p2 = _processed_logits(l2[a], prompt, [a], p).softmax(-1)
        for b in range(V):
            p3 = _processed_logits(l3[a * V + b], prompt, [a, b], p).softmax(-1)
            out[a, b] = p1[a] * p2[b] * p3
    return out


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_penalized_sampling_matches_the_processed_target_distribution(rule, biased=False):
    """Three sampled tokens per request (the last two verified in one round when the first draft is accepted)
    are distributed as sequential sampling from the processed target: chi-square over the V^3 cells."""
    V = 8
    tcfg = tiny_target_config(vocab_size=V, moe=False)
    target, drafter = build_tiny_pair(5, tcfg, tiny_draft_config(tcfg, markov_rank=4))
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    prompt = [0, 5, 6, 1]
    p = {"logit_bias": {1: 1.0, 3: -0.5}, "repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.4}
    exact = _exact_three_token_distribution(target, prompt, V, p)
    n = 4000
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3, rejection_sample_method=rule)
    eng = Engine(
        target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=64), CacheConfig(num_pages=1024, page_size=4)
    )
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True, **p) for s in range(n)]
    counts = torch.zeros(V, V, V)
    for o in LLM.from_engine(eng).generate([prompt] * n, params):
        counts[tuple(o.token_ids)] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    assert eng.metrics.spec.num_accepted_tokens > 0
    assert (stat < dof + 4 * (2 * dof) ** 0.5) != biased, (stat, dof)  # ~4 sigma


def test_penalized_statistical_test_has_power(monkeypatch):
    """Verifying row j against counts without d_1..d_j must be detected."""
    real = processing.round_counts
    monkeypatch.setattr(processing, "round_counts", lambda counts, drafts, n: real(counts, None, n))
    test_penalized_sampling_matches_the_processed_target_distribution("standard", biased=True)
