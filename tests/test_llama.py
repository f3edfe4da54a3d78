"""The native GQA family (Llama / Qwen2 / Qwen3): parity with transformers on the same weights, paged == contiguous,
speculative greedy == target-only greedy across K, batch sizes and preemption, sampled output == the target's
distribution under standard and block verification, shared vs separate page pools."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark.cache.allocator import BlockManager, PageAllocator
from dspark.cache.pool import CachePools
from dspark.config import CacheConfig, ConfigError, EngineConfig, GQATargetConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.engine.request import Request
from dspark.engine.runner import ModelRunner
from dspark.llm import LLM
from dspark.models.llama import LlamaTarget
from dspark.models.loading import load_target
from dspark.models.rope import RotaryEmbedding
from dspark.models.tiny import build_tiny_gqa_pair, tiny_gqa_config, tiny_gqa_draft_config
from dspark.sampling_params import SamplingParams

FP32 = EngineConfig(dtype="float32", max_num_seqs=8)
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),
}


def hf_model(family, rope=None, tied=False, bias=False):
    cls, cfg_cls = FAMILIES[family]
    extra = {"attention_bias": bias} if family != "qwen2" else {}
    cfg = cfg_cls(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=ROPES[rope] if rope else None,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return model


CASES = [
    ("llama", "default", True, False),
    ("llama", "linear", False, True),
    ("llama", "llama3", True, False),
    ("llama", "yarn", False, False),
    ("qwen2", "default", False, False),
    ("qwen3", "default", False, False),
    ("qwen3", "yarn", True, False),
]


@pytest.mark.parametrize("family,rope,tied,bias", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_logits_taps_and_greedy_match_transformers(tmp_path, family, rope, tied, bias):
    hf = hf_model(family, rope, tied, bias)
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path, "float32")  # the one loading route, strict roster
    assert isinstance(ours, LlamaTarget)
    ids = torch.randint(2, 97, (2, 40), generator=torch.Generator().manual_seed(2))  # past the 32-token window
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, tap_layers=(-1, 0, 1))
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=1e-4, atol=1e-4)
    for i, tap in enumerate(out.taps.split(48, dim=-1)):  # embeddings, then the raw outputs of layers 0 and 1
        torch.testing.assert_close(tap, ref.hidden_states[i], rtol=1e-4, atol=1e-4)
    rot = RotaryEmbedding(ours.config.rope)
    torch.testing.assert_close(rot.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=1e-7)
    assert rot.magnitude == pytest.approx(hf.model.rotary_emb.attention_scaling)
    prompt = [[0, 5, 6, 7, 8]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = LLM.from_engine(Engine(ours, None, None, FP32)).generate(prompt, params)[0].token_ids
    hf.generation_config.eos_token_id = None  # ignore_eos, as ours
    with torch.no_grad():
        x = torch.tensor(prompt)
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)[0, 5:].tolist()
    assert got == want


def test_last_layer_tap_is_the_raw_output_not_post_norm(tmp_path):
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path, "float32")
    seen = {}
    hf.model.layers[2].register_forward_hook(lambda m, i, o: seen.update(out=o[0] if isinstance(o, tuple) else o))
    ids = torch.randint(2, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        tap = ours(ids, tap_layers=(2,)).taps
    torch.testing.assert_close(tap, seen["out"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tap, ref.hidden_states[3], atol=1e-2)  # HF's last entry is post-norm


def test_config_rejects_what_the_decoder_does_not_implement():
    d = {
        "model_type": "qwen2",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    assert GQATargetConfig.from_dict(d).qkv_bias  # Qwen2 always has q/k/v biases
    with pytest.raises(ConfigError, match="use_sliding_window"):
        GQATargetConfig.from_dict(d | {"use_sliding_window": True})
    with pytest.raises(ConfigError, match="hidden_act"):
        GQATargetConfig.from_dict(d | {"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        GQATargetConfig.from_dict(d | {"num_key_value_heads": 3, "num_attention_heads": 4})


def _runner(target, num_pages=16, page=4):
    pools = CachePools.build(target.page_format, None, num_pages, page, torch.float32)
    blocks = BlockManager(PageAllocator(num_pages, page))
    return ModelRunner(target, None, blocks, pools), blocks


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_paged_cache_equals_contiguous_forward_and_rollback(family):
    target, _ = build_tiny_gqa_pair(0, tiny_gqa_config(family))
    runner, blocks = _runner(target)
    ids = torch.randint(4, 96, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    req = Request("a", ids, SamplingParams(), 0)
    blocks.ensure_capacity("decoy", 8)  # scrambled page order
    blocks.ensure_capacity("a", 20)
    blocks.release("decoy")
    logits = []
    for s, e in [(0, 5), (5, 6), (6, 9)]:
        logits.append(runner.target_forward([req], [s], [ids[s:e]], last_only=False)[0])
    runner.target_forward([req], [9], [[50, 51, 52]], last_only=False)  # rejected drafts
    blocks.set_length("a", 9)  # rollback = the length
    logits.append(runner.target_forward([req], [9], [ids[9:13]], last_only=False)[0])
    with torch.no_grad():
        ref = target(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat(logits), ref, rtol=1e-5, atol=1e-5)


def _generate(target, drafter, spec, prompts, params, cache=None):
    eng = Engine(target, drafter, spec, FP32, cache)
    return [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)], eng


def _prompts(seed, n):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 96, (int(ln),), generator=g).tolist() for ln in torch.randint(1, 20, (n,), generator=g)]


@pytest.mark.parametrize("seed,family,share", [(0, "llama", True), (1, "qwen3", False), (2, "qwen2", True)])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculative_equals_target_only(seed, family, share, k):
    tcfg = tiny_gqa_config(family)
    target, drafter = build_tiny_gqa_pair(seed, tcfg, tiny_gqa_draft_config(tcfg, share_pages=share, block_size=7))
    n = [1, 5, 8][seed]
    prompts = _prompts(seed, n)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 4), stop_token_ids=(7 + i,)) for i in range(n)]
    ref, _ = _generate(target, None, None, prompts, params)
    for method, rule, draw in [
        ("dspark", "block", "probabilistic"),
        ("dflash", "standard", "greedy"),
        ("ngram", "standard", "greedy"),
    ]:
        spec = SpeculativeConfig(
            method=method, num_speculative_tokens=k, rejection_sample_method=rule, draft_sample_method=draw
        )
        got, eng = _generate(target, drafter, spec, prompts, params)
        assert got == ref, (method, rule, draw)
        if method != "ngram":
            assert eng.metrics.spec.num_drafts > 0
            assert eng.cache_report()["shared_pool"] is share


@pytest.mark.parametrize("share", [True, False])
def test_small_pool_preempts_and_still_matches(share):
    tcfg = tiny_gqa_config("qwen3")
    target, drafter = build_tiny_gqa_pair(2, tcfg, tiny_gqa_draft_config(tcfg, share_pages=share))
    prompts = _prompts(7, 6)
    params = SamplingParams(temperature=0, max_tokens=30)
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    ref, _ = _generate(target, None, None, prompts, params)
    got, eng = _generate(target, drafter, spec, prompts, params, CacheConfig(num_pages=14, page_size=4))
    assert got == ref
    assert eng.metrics.num_preemptions > 0 and eng.num_pages_free == 14


def _chi_square(counts, expected):
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_sampled_output_matches_target_distribution(rule):
    V = 10
    tcfg = tiny_gqa_config("qwen3", vocab_size=V)
    target, drafter = build_tiny_gqa_pair(5, tcfg, tiny_gqa_draft_config(tcfg, markov_rank=4))
    with torch.no_grad():  # soften the target so many tokens have real mass
        target.lm_head.weight.mul_(0.25)
    prompt = [0, 5, 6]
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = target(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].softmax(-1)
    exact = p1[:, None] * p2
    n = 3000
    spec = SpeculativeConfig(
        method="dspark", num_speculative_tokens=3, rejection_sample_method=rule, draft_sample_method="probabilistic"
    )
    eng = Engine(
        target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=64), CacheConfig(num_pages=1024, page_size=4)
    )
    params = [SamplingParams(temperature=1.0, max_tokens=2, seed=s, ignore_eos=True) for s in range(n)]
    counts = torch.zeros(V, V)
    for o in LLM.from_engine(eng).generate([prompt] * n, params):
        counts[o.token_ids[0], o.token_ids[1]] += 1
    stat, dof = _chi_square(counts.flatten(), (exact * n).flatten())
    assert eng.metrics.spec.num_draft_tokens > 0
    assert stat < dof + 4 * (2 * dof) ** 0.5, (stat, dof)  # ~4 sigma
