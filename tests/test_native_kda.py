"""The native KDA rows (dspark/native/kda.cpp) against the module's paths: outputs and packed states over a prefill
and a run of decode steps (fp32: the order of sums only; bf16: within its rounding), both forget gates, padding
rows that must leave their state alone, a verification block equal to its decode steps bit for bit (with the state
after every row), and greedy decoding of a tiny hybrid target with the native rows on and off."""

import pytest
import torch

from dspark import native
from dspark.config import KDAConfig
from dspark.models.kda import KDACache, KimiDeltaAttention
from dspark.models.tiny import build_tiny_hybrid_pair, tiny_hybrid_config
from dspark.sampling_params import SamplingParams
from test_engine import prompts_for
from test_hybrid_engine import FP32, generate

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def _layer(lower_bound, dtype) -> KimiDeltaAttention:
    cfg = KDAConfig(hidden_size=48, num_heads=3, head_dim=16, conv_kernel_size=4, gate_lower_bound=lower_bound)
    layer = KimiDeltaAttention(cfg, 0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g).log())
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return layer.to(dtype).eval()


def _decode(layer, xs, prefill, monkeypatch, on: bool, lengths=None):
    """A 5-row prefill, then one decode step per x in xs; outputs and final states."""
    monkeypatch.setenv(native.ENV, "1" if on else "0")
    cache, outs = KDACache(), []
    with torch.no_grad():
        layer(prefill, cache)
        for x in xs:
            outs.append(layer(x, cache, lengths))
    return (torch.cat(outs, 1) if outs else None), cache.states[0]


@needs_native
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_steps_match_the_module(lower_bound, dtype, monkeypatch):
    layer = _layer(lower_bound, dtype)
    g = torch.Generator().manual_seed(1)
    prefill = torch.randn(2, 5, 48, generator=g).to(dtype)
    xs = [torch.randn(2, 1, 48, generator=g).to(dtype) for _ in range(6)]
    calls = []
    real = KimiDeltaAttention._native_rows
    monkeypatch.setattr(KimiDeltaAttention, "_native_rows", lambda *a: calls.append(1) or real(*a))
    ref_out, ref_state = _decode(layer, xs, prefill, monkeypatch, on=False)
    out, state = _decode(layer, xs, prefill, monkeypatch, on=True)
    assert len(calls) == 1 + len(xs)  # the prefill and every decode step ran natively (never in the reference run)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(state, ref_state, **tol)


@needs_native
def test_a_padding_row_keeps_its_state(monkeypatch):
    layer = _layer(-5.0, torch.float32)
    g = torch.Generator().manual_seed(2)
    prefill = torch.randn(2, 5, 48, generator=g)
    xs = [torch.randn(2, 1, 48, generator=g)]
    lengths = torch.tensor([1, 0])
    _, before = _decode(layer, [], prefill, monkeypatch, on=True)
    out, after = _decode(layer, xs, prefill, monkeypatch, on=True, lengths=lengths)
    _, ref = _decode(layer, xs, prefill, monkeypatch, on=False, lengths=lengths)
    assert torch.equal(after[1], before[1])  # the padding row: conv tail and recurrent state untouched
    assert not torch.equal(after[0], before[0])
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_greedy_decoding_of_a_hybrid_target_is_the_same_with_the_native_step(monkeypatch):
    target, drafter = build_tiny_hybrid_pair(3, tiny_hybrid_config(k3=True))
    prompts = prompts_for(3, 4)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in prompts]
    monkeypatch.setenv(native.ENV, "0")
    ref, _ = generate(target, drafter, None, prompts, params, ecfg=FP32)
    monkeypatch.setenv(native.ENV, "1")
    got, _ = generate(target, drafter, None, prompts, params, ecfg=FP32)
    assert got == ref


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verification_block_equals_its_decode_steps_bit_for_bit(dtype):
    """The kernel runs the same recurrence for every row: given the same projections, the rows of a 4-row call
    (and the state after each) equal four one-row calls bit for bit; a sequence with 3 valid rows stops there."""
    layer = _layer(-5.0, dtype)
    cfg = layer.cfg
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        z, fa, ga, b = layer.project(torch.randn(2, 4, 48, generator=g).to(dtype))
    state0 = torch.randn(2, cfg.state_numel, generator=g) * 0.1
    weights = (layer.conv_weight(), layer.f_b_proj.weight, layer.dt_bias, layer.A_log, layer.g_b_proj.weight,
               layer.o_norm.weight, cfg.num_heads, cfg.head_dim, cfg.gate_lower_bound, layer.o_norm.eps)  # fmt: skip
    rows = native.ops().kda_rows
    out, final, per_row = rows(z, fa, ga, b, state0, torch.tensor([4, 3]), *weights, True)
    state = state0
    for t in range(4):
        one, state, _ = rows(z[:, t : t + 1], fa[:, t : t + 1], ga[:, t : t + 1], b[:, t : t + 1], state,
                             torch.tensor([1, int(t < 3)]), *weights, False)  # fmt: skip
        assert torch.equal(out[0, t], one[0, 0]) and torch.equal(per_row[0, t], state[0])
        if t < 3:
            assert torch.equal(out[1, t], one[1, 0]) and torch.equal(per_row[1, t], state[1])
    assert torch.equal(final, state)
