"""The inference fast paths (issue #14) against the reference paths they replace: oneDNN-packed linear weights,
grouped-head attention folded into query rows, fused q|k|v projections, gathered MoE experts. bf16 fast paths
must equal the reference (bit for bit where the same kernels do the arithmetic, else up to rounding); fp32 keeps
the reference path; a stale pack is never used; engines give the same greedy tokens with and without packing."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.k3 import K3MoE
from dspark.models.layers import RMSNorm, grouped_sdpa
from dspark.models.llama import LlamaTarget
from dspark.models.packing import Linear, PackedWeight, can_pack, pack_for_inference
from dspark.models.rope import apply_rope, apply_rope_half, half_rotation_tables
from dspark.models.target import MLATarget, MoE, dense_experts, gathered_experts, grouped_experts, routed_experts
from dspark.models.tiny import (
    build_tiny_gqa_pair,
    build_tiny_hybrid_pair,
    build_tiny_pair,
    randomize_,
    tiny_gqa_config,
    tiny_target_config,
)
from dspark.sampling_params import SamplingParams

needs_pack = pytest.mark.skipif(
    not can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)), reason="oneDNN cannot pack bf16 weights on this CPU"
)


@needs_pack
def test_packed_linear_equals_f_linear_and_never_uses_a_stale_pack() -> None:
    torch.manual_seed(0)
    lin = Linear(48, 80, bias=True).to(torch.bfloat16)
    keys = set(lin.state_dict())
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = F.linear(x, lin.weight, lin.bias)
        lin.pack()
        assert lin.packed_count() == 1 and set(lin.state_dict()) == keys  # the pack is not a parameter/buffer
        # the same oneDNN arithmetic; the bias add may round differently (one bf16 ulp)
        torch.testing.assert_close(lin(x), ref, rtol=1e-2, atol=1e-2)
        for rows in (x[:1, :1], x[:, :1]):  # decode sizes
            torch.testing.assert_close(lin(rows), F.linear(rows, lin.weight, lin.bias), rtol=1e-2, atol=1e-2)
        nobias = Linear(48, 80, bias=False).to(torch.bfloat16)
        nobias.pack()
        assert torch.equal(nobias(x[:1, :1]), F.linear(x[:1, :1], nobias.weight))  # M = 1, no bias: bit for bit
        lin.weight.mul_(2.0)  # an in-place change: the pack is stale and must not be used
        assert lin.packed_count() == 0
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        lin.weight = torch.nn.Parameter(torch.randn(80, 48, dtype=torch.bfloat16))  # a new tensor: stale too
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.pack()
    y = lin(x)  # grad mode: the plain path, so gradients reach the weight
    y.float().sum().backward()
    assert lin.weight.grad is not None
    assert PackedWeight.of(torch.zeros(4, 4)) is None  # fp32: nothing to pack (the reference path)


@pytest.mark.parametrize("heads,n_kv", [(6, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("T", [1, 5])
def test_grouped_sdpa_equals_enable_gqa(heads: int, n_kv: int, T: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + T)
    B, S, d, dv = 2, 11, 16, 12
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7
    mask[..., 0] = True
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(B, heads, T, d, generator=g), torch.randn(B, n_kv, S, d, generator=g)
        v = torch.randn(B, n_kv, S, dv, generator=g)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3, enable_gqa=n_kv != heads)
        got = grouped_sdpa(q, k, v, bias, 0.3)
        assert got.shape == (B, heads, T, dv)
        if dtype == torch.float32:
            assert torch.equal(got, ref)  # the reference path itself
        else:  # folded query rows: the same attention up to bf16 rounding of the softmax
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            expanded = F.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(heads // n_kv, 1), v.float().repeat_interleave(heads // n_kv, 1),
                attn_mask=bias.float(), scale=0.3,
            )  # fmt: skip
            torch.testing.assert_close(got.float(), expanded, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_qkv_equals_three_projections(family: str) -> None:
    torch.manual_seed(1)
    target = LlamaTarget(tiny_gqa_config(family)).eval()
    ids = torch.randint(0, 96, (2, 9))
    half = copy.deepcopy(target).bfloat16()
    with torch.no_grad():
        ref = target(ids, tap_layers=(0, 2)).logits
        target.fuse_for_inference()
        assert all(layer.self_attn._linked_qkv() is not None for layer in target.model.layers)
        assert torch.equal(target(ids, tap_layers=(0, 2)).logits, ref)  # fp32: the reference path, bit for bit
        ref16 = half(ids).logits.float()
        half.fuse_for_inference()
        fused16 = half(ids).logits.float()  # bf16: the fused GEMM, equal up to rounding
        torch.testing.assert_close(fused16, ref16, rtol=0, atol=0.02 * float(ref16.abs().max()))
    # grad mode (training) still runs, through the separate projections, on the re-pointed parameters
    target(ids).logits.sum().backward()
    assert target.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_fused_mla_projections_equal_the_separate_ones(q_lora_rank: int | None) -> None:
    torch.manual_seed(1)
    target = MLATarget(tiny_target_config(q_lora_rank=q_lora_rank, moe=False)).eval()  # no routing flips in bf16
    randomize_(target, seed=3)
    ids = torch.randint(0, 96, (2, 9))
    positions = torch.arange(3, 12).expand(2, 9)  # past position 0: RoPE rotates every row
    half = copy.deepcopy(target).bfloat16()
    with torch.no_grad():
        ref = target(ids, positions, tap_layers=(0, 2)).logits
        target.fuse_for_inference()
        assert all(layer.self_attn._linked_xproj() is not None for layer in target.model.layers)
        assert torch.equal(target(ids, positions, tap_layers=(0, 2)).logits, ref)  # fp32: the reference path
        ref16 = half(ids, positions).logits.float()
        attn = half.model.layers[1].self_attn
        x = torch.randn(2, 9, 32).bfloat16()
        cos, sin = half.rotary.cos_sin(positions)
        parts = attn.latent(x, cos, sin), *attn.query(x, cos, sin)
        half.fuse_for_inference()
        pack_for_inference(half)
        assert attn.packed_count() == int(can_pack(attn._linked_xproj()[0]))
        fused = attn.project(x, cos, sin)  # one GEMM, q and k rotated in one call: equal up to bf16 rounding
        for got, want in zip(fused, parts):
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.02 * float(want.abs().max()))
        torch.testing.assert_close(
            half(ids, positions).logits.float(), ref16, rtol=0, atol=0.02 * float(ref16.abs().max())
        )
    target(ids).logits.sum().backward()  # training runs the separate projections on the re-pointed parameters
    assert target.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad is not None


def test_gathered_and_dense_experts_equal_grouped_experts() -> None:
    g = torch.Generator().manual_seed(3)
    E, I, D = 6, 20, 16
    for dtype in (torch.float32, torch.bfloat16):
        gate_up, down = torch.randn(E, 2 * I, D, generator=g).to(dtype), torch.randn(E, D, I, generator=g).to(dtype)
        for N, k in ((1, 2), (3, 2), (2, 3), (9, 2)):
            flat = torch.randn(N, D, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
            w = torch.rand(N, k, generator=g)
            views = list(zip(gate_up.unbind(0), down.unbind(0)))
            ref = grouped_experts(flat, idx, w, views)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            for fast in (gathered_experts, dense_experts):
                got = fast(flat, idx, w, gate_up, down)
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
            if dtype == torch.float32:  # the reference dtype always takes the grouped pass, bit for bit
                assert torch.equal(routed_experts(flat, idx, w, (gate_up, down), views), ref)


@needs_pack
@pytest.mark.parametrize("family", ["mla", "gqa"])
def test_engines_pack_bf16_weights_only_and_the_packed_model_computes_the_same_logits(family: str) -> None:
    build = build_tiny_pair if family == "mla" else build_tiny_gqa_pair
    ids = torch.tensor([[3, 7, 11, 2, 9, 5, 1, 4]])
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=3)
    logits = {}
    for dtype, prepack in (("float32", True), ("bfloat16", False), ("bfloat16", True)):
        target, drafter = build(0)  # the same weights each time
        target, drafter = target.to(getattr(torch, dtype)), drafter.to(getattr(torch, dtype))
        eng = Engine(target, drafter, spec, EngineConfig(dtype=dtype, max_num_seqs=4, prepack_weights=prepack))
        assert (eng.packed_weights > 0) == (prepack and dtype == "bfloat16")  # fp32: the reference path, unpacked
        for moe in (m for m in target.modules() if isinstance(m, MoE)):  # stacked experts keep no unused packs
            assert all(e.packed_count() == 0 and e.down_proj.packed_count() == 0 for e in moe.experts)
        with torch.inference_mode():
            logits[dtype, prepack] = target(ids).logits
        if prepack and dtype == "bfloat16":  # and the engine runs on it: greedy speculation == greedy decoding
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            ar = Engine(target, None, None, EngineConfig(dtype=dtype, max_num_seqs=4))
            prompts = [[3, 7, 11, 2, 9], [5, 1, 4]]
            spec_out = [o.token_ids for o in LLM.from_engine(eng).generate(prompts, params)]
            ar_out = [o.token_ids for o in LLM.from_engine(ar).generate(prompts, params)]
            assert len(spec_out[0]) == 10 and eng.metrics.spec.num_drafts > 0
            assert spec_out == ar_out or _near_tie(target, prompts, ar_out, spec_out)
    torch.testing.assert_close(logits["bfloat16", True], logits["bfloat16", False], rtol=0.05, atol=0.05)
    scale = float(logits["float32", True].abs().max())  # bf16 vs the fp32 reference: within bf16 noise of the scale
    torch.testing.assert_close(logits["bfloat16", True].float(), logits["float32", True], rtol=0, atol=0.03 * scale)


def _near_tie(target, prompts, a, b) -> bool:
    """Where two bf16 greedy runs part, the target's top two logits (fp32 recomputation) are within bf16 noise."""
    for p, x, y in zip(prompts, a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if n is None:
            continue
        with torch.inference_mode():
            top = target.float()(torch.tensor([p + x[:n]])).logits[0, -1].topk(2).values
        if float(top[0] - top[1]) > 0.05 * float(top[0].abs()) + 0.05:
            return False
    return True


def test_inference_rms_norm_on_bf16_and_fp16_equals_the_fp32_cast_path() -> None:
    g = torch.Generator().manual_seed(5)
    for i in range(40):
        dim = (64, 576, 48, 256)[i % 4]
        norm = RMSNorm(dim, 1e-6)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5, generator=g)
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        norm = norm.to(dtype)
        x = (torch.randn(3, 5, dim, generator=g) * (0.01 + i)).to(dtype)
        with torch.no_grad():
            fast = norm(x)
        ref = norm.weight * torch.nn.functional.rms_norm(x.float(), (dim,), eps=1e-6).to(dtype)
        assert torch.equal(fast, ref.detach())


def test_half_rotation_tables_rotate_bit_for_bit_like_apply_rope() -> None:
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 5, 7, 16, generator=g).to(dtype)
        angles = torch.rand(2, 5, 8, generator=g) * 40
        cos, sin = angles.cos(), angles.sin()
        ref = apply_rope(x, cos[:, :, None], sin[:, :, None], interleave=False)
        assert torch.equal(apply_rope_half(x, *half_rotation_tables(cos, sin)), ref)


def test_fused_kda_inputs_and_the_hybrid_engine_packs_them() -> None:
    target, drafter = build_tiny_hybrid_pair(0)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = target(ids, tap_layers=(1, 3)).logits
        target.fuse_for_inference()  # fp32 fuses too: the native kernels then run (sums in another order)
        kda = [layer.self_attn for layer in target.model.layers if layer.is_kda]
        assert kda and all(a._linked_inputs() is not None for a in kda)
        torch.testing.assert_close(target(ids, tap_layers=(1, 3)).logits, ref, rtol=1e-5, atol=1e-5)
        a = kda[0].bfloat16()
        a.fuse()
        x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
        sep = (torch.cat((a.q_proj(x), a.k_proj(x), a.v_proj(x)), -1), a.f_a_proj(x), a.g_a_proj(x), a.b_proj(x))
        for fused, one in zip(a.project(x), sep, strict=True):  # bf16: one GEMM, equal up to rounding
            torch.testing.assert_close(fused.float(), one.float(), rtol=0.02, atol=0.02)
        a.float()
    target(ids).logits.sum().backward()  # training: the separate projections, on the re-pointed parameters
    assert kda[0].f_a_proj.weight.grad is not None
    if can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)):
        target, drafter = (m.to(torch.bfloat16) for m in build_tiny_hybrid_pair(0))
        moes = [layer.mlp for layer in target.model.layers if isinstance(layer.mlp, K3MoE)]
        x = torch.randn(1, 14, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
        with torch.no_grad():
            ref16 = [moe(x).float() for moe in moes]
        eng = Engine(target, drafter, None, EngineConfig(dtype="bfloat16", max_num_seqs=2))
        assert all(layer.self_attn.packed_count() == 1 for layer in target.model.layers if layer.is_kda)
        # the latent SiTU MoE on stacked experts (14 tokens: the dense pass) == its per-expert loop up to bf16
        # rounding, layer by layer (a whole random model is not compared: a rounding-level change can flip a
        # near-tied top-k routing choice downstream)
        with torch.no_grad():
            assert all(moe.stacked_experts() is not None for moe in moes)
            for moe, ref in zip(moes, ref16, strict=True):
                torch.testing.assert_close(moe(x).float(), ref, rtol=0, atol=0.02 * float(ref.abs().max()))
        out = LLM.from_engine(eng).generate([[3, 7, 11, 2]], SamplingParams(temperature=0.0, max_tokens=6))
        assert len(out[0].token_ids) == 6


def test_remembered_link_checks_follow_reassigned_and_converted_weights() -> None:
    """Fused paths remember their positive link check; a re-assigned or converted part must still end the link."""
    target, _ = build_tiny_pair(7)
    target = target.bfloat16()
    target.fuse_for_inference()
    moe = next(layer.mlp for layer in target.model.layers if isinstance(layer.mlp, MoE))
    attn = target.model.layers[0].self_attn
    with torch.no_grad():
        assert moe.stacked_experts() is not None and attn._linked_xproj() is not None  # remembered
        assert moe.stacked_experts() is not None and attn._linked_xproj() is not None  # from memory
        moe.experts[0].gate_proj.weight.mul_(2.0)  # in place: still the stack's storage
        assert moe.stacked_experts() is not None
        down = moe.experts[-1].down_proj
        down.weight = torch.nn.Parameter(down.weight.clone())  # re-assigned: the stack no longer holds it
        assert moe.stacked_experts() is None
        moe.fuse()  # re-stacked over the new weight
        assert moe.stacked_experts() is not None
        attn.kv_a_proj_with_mqa.float()  # converted: .data swapped to a new fp32 tensor
        assert attn._linked_xproj() is None
        attn.kv_a_proj_with_mqa.bfloat16()
        attn.fuse()
        assert attn._linked_xproj() is not None
