"""The speculative engine: losslessness (greedy and sampled), paged cache, rollback, preemption, metrics."""

import pytest
import torch

from dspark.cache.allocator import BlockManager, PageAllocator
from dspark.cache.pool import CachePools
from dspark.config import CacheConfig, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config
from dspark.sampling_params import SamplingParams
from dspark.speculative.propose import Proposal
from dspark.speculative.sampling import process_logits

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)


def generate(target, drafter, spec, prompts, params, cache=None, ecfg=FP32):
    eng = Engine(target, drafter, spec, ecfg, cache)
    outs = LLM.from_engine(eng).generate(prompts, params)
    return [o.token_ids for o in outs], eng


def prompts_for(seed, n):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [torch.randint(4, 96, (ln,), generator=g).tolist() for ln in lengths]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculative_equals_target_only(seed, k):
    tcfg = tiny_target_config(moe=seed != 1, q_lora_rank=None if seed == 2 else 24)
    dcfg = tiny_draft_config(tcfg, head_type=["vanilla", "gated", "rnn"][seed])
    target, drafter = build_tiny_pair(seed, tcfg, dcfg)
    n = [1, 5, 8][seed]
    prompts = prompts_for(seed, n)
    # different stop points: max_tokens and a stop token per request
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 4), stop_token_ids=(7 + i,)) for i in range(n)]
    ref, _ = generate(target, drafter, None, prompts, params)
    combos = [
        ("dspark", "block", "probabilistic"),
        ("dspark", "standard", "greedy"),
        ("dflash", "block", "greedy"),
        ("dflash", "standard", "probabilistic"),
        ("ngram", ["standard", "block"][seed % 2], "greedy"),
    ]
    for method, rule, draw in combos:
        spec = SpeculativeConfig(
            method=method, num_speculative_tokens=k, rejection_sample_method=rule, draft_sample_method=draw
        )
        got, eng = generate(target, drafter, spec, prompts, params)
        assert got == ref, (method, rule, draw)
        if method != "ngram":
            assert eng.metrics.spec.num_drafts > 0


def _oracle_proposer(target, K):
    """A drafter that equals the target: d_k ~ q_k = the target's own (processed) distribution given the prefix
    and d_<k, from a separate full recompute; greedy requests get the target's argmax (q one-hot)."""
    g = torch.Generator().manual_seed(0)

    def propose(reqs, sampling, probabilistic, use_markov, topk):
        tokens, qs = torch.zeros(len(reqs), K, dtype=torch.long), []
        for i, r in enumerate(reqs):
            seq, rows = list(r.all_ids[: r.num_computed + 1]), []
            for k in range(K):
                with torch.no_grad():
                    logits = target(torch.tensor([seq])).logits[:, -1:].float()
                pick = slice(i, i + 1)
                q = process_logits(logits, sampling.temperature[pick], sampling.top_k[pick], sampling.top_p[pick])[0, 0]
                tokens[i, k] = torch.multinomial(q, 1, generator=g) if probabilistic else q.argmax()
                seq.append(int(tokens[i, k]))
                rows.append(q)
            qs.append(torch.stack(rows))
        q = torch.stack(qs) if probabilistic else None
        return Proposal(tokens, torch.full((len(reqs),), K, dtype=torch.long), q, None)

    return propose


@pytest.mark.parametrize(
    "rule,draw,temperature",
    [("standard", "greedy", 0.0), ("standard", "probabilistic", 0.9), ("block", "probabilistic", 0.9)],
)
def test_a_drafter_equal_to_the_target_gets_every_draft_accepted(rule, draw, temperature):
    target, drafter = build_tiny_pair(0)
    K = 3
    spec = SpeculativeConfig(
        method="dspark", num_speculative_tokens=K, rejection_sample_method=rule, draft_sample_method=draw
    )
    eng = Engine(target, drafter, spec, FP32)
    eng.runner.propose_draft = _oracle_proposer(target, K)
    params = SamplingParams(temperature=temperature, max_tokens=1 + 4 * (K + 1), ignore_eos=True, seed=3)
    outs = LLM.from_engine(eng).generate(prompts_for(7, 3), params)
    s = eng.metrics.spec
    assert s.num_drafts == 3 * 4 and s.num_draft_tokens == 3 * 4 * K
    assert s.num_accepted_tokens == s.num_draft_tokens and s.acceptance_length == K + 1
    assert all(len(o.token_ids) == params.max_tokens for o in outs)


def _exact_two_token_distribution(target, prompt, V):
    """p(t1, t2 | prompt) computed directly from the target (temperature 1)."""
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        ids = torch.tensor([prompt + [t] for t in range(V)])
        p2 = target(ids).logits[:, -1].softmax(-1)
    return p1[:, None] * p2


def _chi_square(counts, expected):
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize(
    "rule,draw,draft_vocab",
    [
        ("standard", "probabilistic", None),
        ("block", "probabilistic", None),
        ("block", "greedy", None),
        ("standard", "probabilistic", [0, 2, 3, 5, 6, 9]),  # a reduced draft vocabulary: q = 0 on 1, 4, 7, 8
        ("block", "probabilistic", [9, 5, 1, 0, 7]),
    ],
)
def test_sampled_output_matches_target_distribution(rule, draw, draft_vocab, biased=False):
    V = 10
    tcfg = tiny_target_config(vocab_size=V, moe=False)
    target, drafter = build_tiny_pair(5, tcfg, tiny_draft_config(tcfg, markov_rank=4))
    with torch.no_grad():  # soften the target so many tokens have real mass
        target.lm_head.weight.mul_(0.25)
    prompt = [0, 5, 6]
    exact = _exact_two_token_distribution(target, prompt, V)
    n = 3000
    spec = SpeculativeConfig(
        method="dspark", num_speculative_tokens=3, rejection_sample_method=rule, draft_sample_method=draw
    )
    eng = Engine(
        target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=64), CacheConfig(num_pages=1024, page_size=4)
    )
    eng.restrict_draft_vocab(None if draft_vocab is None else torch.tensor(draft_vocab))
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True) for s in range(n)]
    outs = LLM.from_engine(eng).generate([prompt] * n, params)
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    assert eng.metrics.spec.num_draft_tokens > 0  # the second token really went through verification
    if biased:
        assert stat > dof + 4 * (2 * dof) ** 0.5, (stat, dof)
        return
    assert stat < dof + 4 * (2 * dof) ** 0.5, (stat, dof)  # ~4 sigma
    # reproducibility: the same seeds give the same outputs in a different batch composition
    other = Engine(
        target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=3), CacheConfig(page_size=4, num_pages=256)
    )
    other.restrict_draft_vocab(None if draft_vocab is None else torch.tensor(draft_vocab))
    again = LLM.from_engine(other).generate([prompt] * 5, params[:5])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:5]]


def _runner(target, num_pages=16, page=4):
    pools = CachePools.build(target.page_format, None, num_pages, page, torch.float32)
    blocks = BlockManager(PageAllocator(num_pages, page))
    return ModelRunner(target, None, blocks, pools), blocks


def test_paged_cache_equals_contiguous_forward():
    target, _ = build_tiny_pair(0)
    runner, blocks = _runner(target)
    ids = torch.randint(4, 96, (1, 13), generator=torch.Generator().manual_seed(3)).tolist()[0]
    req = Request("a", ids, SamplingParams(), 0)
    # scramble page order by allocating/freeing a decoy first
    blocks.ensure_capacity("decoy", 8)
    blocks.ensure_capacity("a", 13)
    blocks.release("decoy")
    logits = []
    for s, e in [(0, 5), (5, 6), (6, 13)]:
        logits.append(runner.target_forward([req], [s], [ids[s:e]], last_only=False)[0])
    paged = torch.cat(logits)
    with torch.no_grad():
        ref = target(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged, ref, rtol=1e-5, atol=1e-5)


def test_rollback_then_continue_equals_never_drafted():
    target, _ = build_tiny_pair(1)
    runner, blocks = _runner(target)
    ids = list(range(10, 22))
    req = Request("a", ids, SamplingParams(), 0)
    blocks.ensure_capacity("a", 20)
    runner.target_forward([req], [0], [ids[:8]], last_only=False)
    runner.target_forward([req], [8], [[50, 51, 52, 53, 54]], last_only=False)  # rejected drafts
    blocks.set_length("a", 8)  # rollback: just the length
    cont = runner.target_forward([req], [8], [ids[8:12]], last_only=False)[0]
    with torch.no_grad():
        ref = target(torch.tensor([ids])).logits[0, 8:12]
    torch.testing.assert_close(cont, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", [None, "dspark"])
def test_small_pool_preempts_and_still_matches(method):
    target, drafter = build_tiny_pair(2)
    prompts = prompts_for(7, 6)
    params = SamplingParams(temperature=0, max_tokens=30)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3) if method else None
    ref, _ = generate(target, drafter, spec, prompts, params)
    got, eng = generate(target, drafter, spec, prompts, params, CacheConfig(num_pages=14, page_size=4))
    assert got == ref
    assert eng.metrics.num_preemptions > 0
    assert eng.num_pages_free == 14  # every page returned


def test_metrics_and_tau_definition():
    target, drafter = build_tiny_pair(0)
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3, speculation_guard=False)  # every step drafts
    outs = LLM.from_engine(Engine(target, drafter, spec, FP32)).generate(
        [[0, 4, 5]], SamplingParams(temperature=0, max_tokens=16)
    )
    m = outs[0].spec_metrics
    assert m["acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    # tokens emitted = accepted + one per round
    assert len(outs[0].token_ids) <= m["num_accepted_tokens"] + m["num_drafts"] + 1


def test_unknown_speculative_key_is_an_error():
    with pytest.raises(ValueError, match="unknown key.*'num_speculative_token' .did you mean 'num_speculative_tokens'"):
        SpeculativeConfig.parse('{"method": "dspark", "num_speculative_token": 7}')
    with pytest.raises(ValueError, match="rejection_sample_method"):
        SpeculativeConfig.parse('{"method": "dspark", "rejection_sample_method": "typical"}')


def test_statistical_test_has_power(monkeypatch):
    """Sampling the correction from p instead of normalize(max(p - q, 0)) must be detected."""
    from dspark.speculative import verify

    original = verify.residual_sample
    monkeypatch.setattr(
        verify, "residual_sample", lambda p, q, w, u: original(p, torch.zeros_like(q), torch.ones_like(w), u)
    )
    test_sampled_output_matches_target_distribution("standard", "probabilistic", None, biased=True)


def test_cache_report_bytes_per_token():
    target, drafter = build_tiny_pair(0)
    eng = Engine(target, drafter, SpeculativeConfig(method="dspark"), FP32)
    rep = eng.cache_report()
    width = target.config.kv_lora_rank + target.config.qk_rope_head_dim  # one latent row per token per layer
    assert rep["target_width"] == rep["draft_width"] == width and rep["shared_pool"]
    assert rep["target_page_kind"] == rep["draft_page_kind"] == "mla"
    assert rep["target_bytes_per_token"] == target.config.num_hidden_layers * width * 4
    assert rep["draft_bytes_per_token"] == len(drafter.layers) * width * 4


def test_spec_decoding_log_line():
    from dspark.engine.metrics import SpecDecodingMetrics

    m = SpecDecodingMetrics()
    m.record(3, 2)
    m.record(3, 0)
    line = m.log_line()
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.00")
    assert "Per-position acceptance rate: 0.500, 0.500, 0.000" in line


def test_verify_lossless_cli(tmp_path, capsys):
    import json

    from dspark.cli import main
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "def f(x):"}, {"turns": ["hello"]}, {"prompt": "ab"}]))
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["verify-lossless", "--dataset", str(data), "--model", str(target_dir), "--speculative-config", spec]
    assert main([*argv, "--max-tokens", "12"]) == 0
    assert "3/3 prompts identical" in capsys.readouterr().out
    # each prompt alone, all in 16-token chunks, all from the prefix cache == all of them together
    assert main([*argv, "--max-tokens", "12", "--invariance"]) == 0
    out = capsys.readouterr().out
    assert "3/3 prompts identical alone, in 16-token chunks and from the prefix cache" in out
    assert out.count("identical however run") == 3
