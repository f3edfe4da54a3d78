"""The hybrid KDA + MLA target in the engine: MLA latents in the shared pages, KDA states in slots, lossless
speculative decoding with mixed accept lengths, preemption, and the sampled distribution."""

import pytest
import torch

from dspark.config import CacheConfig, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.tiny import build_tiny_hybrid_pair, tiny_draft_config, tiny_hybrid_config
from dspark.sampling_params import SamplingParams
from dspark.speculative.propose import Proposal
from test_engine import _chi_square, _exact_two_token_distribution, prompts_for

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)


def generate(target, drafter, spec, prompts, params, cache=None, ecfg=FP32):
    eng = Engine(target, drafter, spec, ecfg, cache)
    outs = LLM.from_engine(eng).generate(prompts, params)
    return [o.token_ids for o in outs], eng


def _target_only_greedy(target, prompt, n):
    """Greedy continuation by full recomputation (no cache, no state): the oracle."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def _noisy_oracle(target, K):
    """Drafts = the target's greedy continuation with one token spoiled at a varying position (or none), so rounds
    accept 0..K drafts: mixed accept lengths within each batch."""
    calls = iter(range(10**6))

    def propose(reqs, sampling, probabilistic, use_markov, topk):
        tokens = torch.zeros(len(reqs), K, dtype=torch.long)
        for i, r in enumerate(reqs):
            cont = _target_only_greedy(target, r.all_ids[: r.num_computed + 1], K)
            spoil = (next(calls) * 7 + i) % (K + 1)
            if spoil < K:
                cont[spoil] = (cont[spoil] + 1) % target.config.vocab_size
            tokens[i] = torch.tensor(cont)
        return Proposal(tokens, torch.full((len(reqs),), K, dtype=torch.long), None, None)

    return propose


@pytest.mark.parametrize("k3", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_target_only(k3, k):
    target, drafter = build_tiny_hybrid_pair(3, tiny_hybrid_config(k3=k3))
    prompts = prompts_for(3, 5)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * (i % 3), ignore_eos=True) for i in range(5)]
    ref, eng = generate(target, drafter, None, prompts, params)
    assert ref[0] == _target_only_greedy(target, prompts[0], len(ref[0]))  # the engine's own target-only run
    assert eng.states is not None and len(eng.states.free) == eng.states.num_slots  # every slot returned
    for method, rule, draw, oracle in [
        ("dspark", "block", "greedy", True),
        ("dspark", "standard", "greedy", True),
        ("dspark", "block", "probabilistic", False),  # the real drafter on the hybrid's taps
        ("dflash", "standard", "greedy", False),
    ]:
        spec = SpeculativeConfig(
            method=method, num_speculative_tokens=k, rejection_sample_method=rule, draft_sample_method=draw
        )
        eng = Engine(target, drafter, spec, FP32)
        if oracle:
            eng.runner.propose_draft = _noisy_oracle(target, k)
        got = [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)]
        assert got == ref, (method, rule, draw)
        hist = eng.metrics.spec.accepted_per_pos
        if oracle:  # some rounds accept everything, some stop early
            assert hist[0] > 0 and hist[-1] < eng.metrics.spec.num_drafts


def test_oracle_drafter_all_accepted_and_state_report():
    target, drafter = build_tiny_hybrid_pair(4)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref, _ = generate(target, drafter, None, prompts, params)
    got, eng = generate(target, drafter, spec, prompts, params)
    assert got == ref
    report = eng.cache_report()
    kda = target.config.kda
    assert report["state_bytes_per_request"] == len(target.config.kda_layers) * kda.state_numel * 4
    assert report["target_bytes_per_token"] == len(target.config.mla_layers) * target.config.mla.latent_dim * 4
    from dspark.cli import cache_report_lines

    mib = report["state_bytes_per_request"] / 2**20
    assert f"recurrent state (KDA layers): {mib:.2f} MiB per request" in "\n".join(cache_report_lines(report))


@pytest.mark.parametrize("method", [None, "dspark"])
def test_small_pool_preempts_and_still_matches(method):
    target, drafter = build_tiny_hybrid_pair(2)
    prompts = prompts_for(7, 6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3) if method else None
    ref, _ = generate(target, drafter, spec, prompts, params)
    got, eng = generate(target, drafter, spec, prompts, params, CacheConfig(num_pages=12, page_size=4))
    assert got == ref
    assert eng.metrics.num_preemptions > 0
    assert eng.num_pages_free == 12 and len(eng.states.free) == eng.states.num_slots


@pytest.mark.parametrize("rule,draw", [("standard", "probabilistic"), ("block", "probabilistic")])
def test_sampled_output_matches_target_distribution(rule, draw):
    V = 10
    tcfg = tiny_hybrid_config(vocab_size=V)
    target, drafter = build_tiny_hybrid_pair(5, tcfg, tiny_draft_config(tcfg.base, markov_rank=4))
    with torch.no_grad():  # soften the target so many tokens have real mass
        target.lm_head.weight.mul_(0.25)
    prompt = [0, 5, 6]
    exact = _exact_two_token_distribution(target, prompt, V)
    n = 2000
    spec = SpeculativeConfig(
        method="dspark", num_speculative_tokens=3, rejection_sample_method=rule, draft_sample_method=draw
    )
    eng = Engine(
        target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=64), CacheConfig(num_pages=512, page_size=4)
    )
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True) for s in range(n)]
    outs = LLM.from_engine(eng).generate([prompt] * n, params)
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    assert eng.metrics.spec.num_draft_tokens > 0
    assert stat < dof + 4 * (2 * dof) ** 0.5, (stat, dof)


def test_verify_lossless_cli_on_a_saved_hybrid_pair(tmp_path, capsys):
    """One loading route: a kimi_linear directory is picked by model_type and served with its drafter."""
    import json

    from dspark.cli import main
    from dspark.models.kimi_linear import KimiLinearTarget
    from dspark.models.loading import load_target
    from dspark.models.tiny import write_tiny_hybrid_pair

    target_dir, draft_dir = write_tiny_hybrid_pair(tmp_path)
    assert isinstance(load_target(target_dir), KimiLinearTarget)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "def f(x):"}, {"prompt": "ab"}]))
    spec = json.dumps({"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3})
    argv = ["verify-lossless", "--dataset", str(data), "--model", str(target_dir), "--speculative-config", spec]
    assert main([*argv, "--max-tokens", "10"]) == 0
    assert "2/2 prompts identical" in capsys.readouterr().out


def test_drafter_picks_the_tap_stream():
    from dataclasses import replace

    from dspark.config import ConfigError
    from dspark.models.tiny import build_tiny_pair

    tcfg = tiny_hybrid_config()
    target, drafter = build_tiny_hybrid_pair(
        6, tcfg, replace(tiny_draft_config(tcfg.base), aux_hidden_stream="residual")
    )
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    prompts, params = prompts_for(4, 2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got, eng = generate(target, drafter, spec, prompts, params)
    assert eng.runner.tap_args == {"tap_stream": "residual"}  # K3's default ("prefix") is not what it asked for
    assert got == generate(target, drafter, None, prompts, params)[0]
    mla_target, mla_drafter = build_tiny_pair(0)
    mla_drafter.config = replace(mla_drafter.config, aux_hidden_stream="prefix")
    with pytest.raises(ConfigError, match="aux_hidden_stream"):
        Engine(mla_target, mla_drafter, spec, FP32)


def test_greedy_adaptive_verification_equals_target_only(tmp_path):
    """Confidence-scheduled verify lengths (Algorithm 1) vary per request and round: each commits its own prefix."""
    import warnings

    from dspark.llm import build_engines, engine_configs
    from dspark.models.tiny import write_tiny_hybrid_pair
    from dspark.speculative.schedule import default_cost_model, save_sts

    k = 5
    target_dir, draft_dir = write_tiny_hybrid_pair(tmp_path, seed=2)
    save_sts(draft_dir / "sts_calibration.json", [0.4] * k)
    cost = default_cost_model(base_ms=50.0, per_token_ms=0.2, per_request_ms=0.05, max_tokens=512, batch_sizes=(1, 64))
    cost.save(target_dir / "sps_profile.json")
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": k}
    spec |= {"enable_adaptive_verification": True, "draft_sample_method": "probabilistic"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adaptive, plain = build_engines(target_dir, [spec, None], *engine_configs(dtype="float32", max_num_seqs=8))
    prompts = prompts_for(2, 5)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(5)]
    ref = [o.token_ids for o in LLM.from_engine(plain).generate(prompts, params)]
    assert [o.token_ids for o in LLM.from_engine(adaptive).generate(prompts, params)] == ref
    assert len(set(adaptive.metrics.spec.verify_len_hist)) >= 2  # lengths vary


@pytest.mark.parametrize("spec_on", [False, True])
def test_a_request_failing_mid_step_leaves_the_others_states_exact(spec_on):
    """A step that raises after the forward is rerun request by request; a request is only committed (state and
    length) together, so the survivors' KDA states never run ahead of their tokens."""
    target, drafter = build_tiny_hybrid_pair(8)
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3) if spec_on else None
    prompts = prompts_for(9, 4)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref, _ = generate(target, drafter, spec, prompts[1:], params)
    eng = Engine(target, drafter, spec, FP32)
    real = eng._append

    def faulty(req, tokens, *rest):
        if req.prompt_ids == prompts[0] and len(req.output_ids) >= 2:  # the first request of every batch
            raise RuntimeError("injected fault")
        return real(req, tokens, *rest)

    eng._append = faulty
    outs = LLM.from_engine(eng).generate(prompts, params)
    assert outs[0].finish_reason == "error"
    assert [o.token_ids for o in outs[1:]] == ref
