"""The native absorbed MLA core (``mla_attend``) and projections (``mla_project``): the module path's values (fp32: up
to the order of the sums; bf16: within its rounding), each query row bit for bit alone, and greedy generation
unchanged with them on or off."""

import pytest
import torch

import dspark.models.mla as mla
import dspark.native as native
from dspark.config import EngineConfig, MLAConfig, RopeConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.layers import causal_mask
from dspark.models.mla import MLAttention
from dspark.models.rope import RotaryEmbedding
from dspark.models.tiny import build_tiny_hybrid_pair, build_tiny_pair
from dspark.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


def make(
    gate: bool, use_nope: bool = False, bias: bool = False, q_lora: int | None = None, interleave: bool = True
) -> tuple[MLAttention, RotaryEmbedding]:
    rope = RopeConfig(dim=8, theta=10000.0, interleave=interleave)
    cfg = MLAConfig(
        hidden_size=32,
        num_heads=4,
        q_lora_rank=q_lora,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        rope=rope,
        use_nope=use_nope,
        use_output_gate=gate,
        attention_bias=bias,
    )
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn, RotaryEmbedding(rope)


def inputs(attn, rot, T, dtype, B=3, S=21):
    """Queries at the last T of S positions over random latents; sequence b left-padded by b keys."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, attn.cfg.hidden_size, generator=g).to(dtype)
    pos = torch.arange(S - T, S).expand(B, T)
    cos, sin = rot.cos_sin(pos)
    keys = torch.arange(S).expand(B, S)
    mask = causal_mask(pos, keys) & (keys >= torch.arange(B)[:, None])[:, None]
    kv = torch.randn(B, S, attn.cfg.latent_dim, generator=g).to(dtype)
    with torch.no_grad():
        q_nope, q_pe = attn.query(x, cos, sin)
    return x, (q_nope, q_pe), kv, mask


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_core_equals_module_path(monkeypatch, T, gate, dtype):
    attn, rot = make(gate, use_nope=gate, bias=gate)
    attn = attn.to(dtype)
    x, queries, kv, mask = inputs(attn, rot, T, dtype)
    calls = []
    real = attn._native_attend
    monkeypatch.setattr(attn, "_native_attend", lambda *a: calls.append(real(*a)) or calls[-1])
    with torch.no_grad():
        fast = attn.attend_queries(x, queries, kv, mask, True)
        monkeypatch.setattr(mla, "NATIVE_INFERENCE", False)
        ref = attn.attend_queries(x, queries, kv, mask, True)
    assert calls[0] is not None and calls[1] is None  # the first call ran the kernel, the second the modules
    assert fast.dtype == ref.dtype and fast.shape == ref.shape == (3, T, attn.cfg.hidden_size)
    if dtype == torch.float32:
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    else:  # a few bf16 ulps at most (sums in another order can flip a rounding)
        torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_alone_bit_for_bit(dtype):
    attn, rot = make(gate=True)
    attn = attn.to(dtype)
    x, (q_nope, q_pe), kv, mask = inputs(attn, rot, 8, dtype)
    with torch.no_grad():
        whole = attn.attend_queries(x, (q_nope, q_pe), kv, mask, True)
        for t in range(8):
            rows = slice(t, t + 1)
            one = attn.attend_queries(x[:, rows], (q_nope[:, rows], q_pe[:, rows]), kv, mask[:, rows], True)
            assert torch.equal(one, whole[:, t : t + 1]), t
        for b in range(3):  # and alone in its batch
            seq = slice(b, b + 1)
            one = attn.attend_queries(x[seq], (q_nope[seq], q_pe[seq]), kv[seq], mask[seq], True)
            assert torch.equal(one, whole[b : b + 1]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_k3_latent_width(dtype):
    """K3's 576-wide latent (kv_lora_rank 512 + rope 64: the wide-row score path, and bf16 pair products where the
    CPU has them), 3 heads (query tiles not a multiple of 4), 37 keys (odd: a half pair): the module path's values,
    each row alone bit for bit, and the same bits when hidden keys follow (a longer cache, a later chunk)."""
    rope = RopeConfig(dim=64, theta=10000.0)
    cfg = MLAConfig(hidden_size=64, num_heads=3, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32,
                    qk_rope_head_dim=64, v_head_dim=24, rope=rope, use_nope=False, use_output_gate=True)  # fmt: skip
    torch.manual_seed(1)
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.1)
    attn = attn.to(dtype)
    x, (q_nope, q_pe), kv, mask = inputs(attn, RotaryEmbedding(rope), 5, dtype, B=2, S=37)
    with torch.no_grad():
        fast = attn.attend_queries(x, (q_nope, q_pe), kv, mask, True)
        mla.NATIVE_INFERENCE = False
        try:
            ref = attn.attend_queries(x, (q_nope, q_pe), kv, mask, True)
        finally:
            mla.NATIVE_INFERENCE = True
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(fast.float(), ref.float(), rtol=tol, atol=tol)
        for t in range(5):
            rows = slice(t, t + 1)
            one = attn.attend_queries(x[:, rows], (q_nope[:, rows], q_pe[:, rows]), kv, mask[:, rows], True)
            assert torch.equal(one, fast[:, rows]), t
        longer = torch.cat([kv, torch.randn(2, 6, kv.shape[-1]).to(dtype)], 1)  # 6 more keys, hidden from every row
        hidden = torch.cat([mask, torch.zeros(*mask.shape[:-1], 6, dtype=torch.bool)], -1)
        assert torch.equal(attn.attend_queries(x, (q_nope, q_pe), longer, hidden, True), fast)


@pytest.mark.parametrize("build", [build_tiny_pair, build_tiny_hybrid_pair])
def test_greedy_generation_same_with_native_on_and_off(monkeypatch, build):
    target, drafter = build(0)
    taken = []
    real = MLAttention._native_attend

    def spy(self, *a):
        out = real(self, *a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(MLAttention, "_native_attend", spy)
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 13, 2)]
    params = [SamplingParams(temperature=0, max_tokens=12) for _ in prompts]

    def run(on):
        monkeypatch.setenv(native.ENV, "1" if on else "0")
        eng = Engine(target, drafter, spec, EngineConfig(dtype="float32", max_num_seqs=4))
        return [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)]

    off = run(False)
    assert not any(taken)
    on = run(True)
    assert any(taken)  # the kernel ran (decode and verification rows)
    assert on == off


@pytest.mark.parametrize("variant", ["plain", "lora", "nope", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_projections_equal_the_module_path(variant, dtype, monkeypatch):
    attn, rot = make(
        gate=False, use_nope=variant == "nope", q_lora=16 if variant == "lora" else None, interleave=variant != "halves"
    )
    attn = attn.to(dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 8, 32, generator=g).to(dtype)
    cos, sin = rot.cos_sin(torch.arange(5, 13).expand(3, 8))
    calls = []
    real = attn._native_project
    monkeypatch.setattr(attn, "_native_project", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        monkeypatch.setenv(native.ENV, "0")
        ref = attn.project(x, cos, sin)
        monkeypatch.setenv(native.ENV, "1")
        got = attn.project(x, cos, sin)
        rows = [attn.project(x[:, t : t + 1], cos[:, t : t + 1], sin[:, t : t + 1]) for t in range(8)]
        assert real(x, cos, sin) is not None  # the native path applies here
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b, one in zip(got, ref, zip(*rows)):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol)
        assert torch.equal(a, torch.cat(one, 1))  # each row alone, bit for bit
    assert len(calls) == 10
