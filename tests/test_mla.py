"""Absorbed MLA == naive MLA; YaRN scale of the official draft config."""

import math

import pytest
import torch

import dspark.native as native
from dspark.config import DraftConfig, MLAConfig, RopeConfig, read_json
from dspark.llm import OFFICIAL_DRAFT_CONFIG
from dspark.models.layers import causal_mask
from dspark.models.mla import MLAttention
from dspark.models.rope import RotaryEmbedding, yarn_correction_range

OFFICIAL = OFFICIAL_DRAFT_CONFIG


def make(use_nope: bool, gate: bool, q_lora: int | None, yarn: bool) -> tuple[MLAttention, RotaryEmbedding]:
    rope = RopeConfig(
        dim=8,
        theta=10000.0,
        rope_type="yarn" if yarn else "default",
        factor=4.0 if yarn else 1.0,
        original_max_position_embeddings=16 if yarn else None,
        mscale_all_dim=1.0,
    )
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
    )
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    return attn, RotaryEmbedding(rope)


@pytest.mark.parametrize("use_nope", [False, True])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("q_lora", [None, 16])
@pytest.mark.parametrize("yarn", [False, True])
def test_absorbed_equals_naive(use_nope, gate, q_lora, yarn):
    attn, rot = make(use_nope, gate, q_lora, yarn)
    x = torch.randn(3, 9, 32)
    pos = torch.arange(9).expand(3, 9) + torch.tensor([[0], [5], [30]])  # some past the original window
    cos, sin = rot.cos_sin(pos)
    mask = causal_mask(pos, pos)
    with torch.no_grad():
        a = attn(x, cos, sin, mask, absorbed=True)
        n = attn(x, cos, sin, mask, absorbed=False)
    torch.testing.assert_close(a, n, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_long_chunks_run_in_query_blocks_with_the_same_result(monkeypatch, bias):
    """A prefill chunk whose scores exceed SCORE_BLOCK runs in blocks of query rows: same output (bool mask or
    additive bias), and no block's scores exceed the budget (the modules' path)."""
    import dspark.models.mla as mla
    from dspark.models.layers import attention_bias

    monkeypatch.setattr(mla, "NATIVE_INFERENCE", False)
    attn, rot = make(False, True, None, True)
    x = torch.randn(2, 23, 32)
    pos = torch.arange(23).expand(2, 23) + torch.tensor([[0], [7]])
    cos, sin = rot.cos_sin(pos)
    mask = causal_mask(pos, torch.arange(30).expand(2, 30))
    mask = attention_bias(mask) if bias else mask
    kv = torch.randn(2, 30, attn.cfg.latent_dim)
    with torch.no_grad():
        whole = attn.attend_from_kv(x, cos, sin, kv, mask, absorbed=True)
        monkeypatch.setattr(mla, "SCORE_BLOCK", 2 * 4 * 30 * 5)  # 5 query rows per block
        sizes = []
        inner = attn._attend_absorbed
        monkeypatch.setattr(
            attn, "_attend_absorbed", lambda q, qp, k, m: sizes.append(q.shape[1]) or inner(q, qp, k, m)
        )
        blocked = attn.attend_from_kv(x, cos, sin, kv, mask, absorbed=True)
    assert sizes == [5, 5, 5, 5, 3]
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(native.ops() is None, reason="the native kernels are not built on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_bias", [False, True])
def test_native_long_chunks_run_in_query_blocks_bit_for_bit(monkeypatch, dtype, as_bias):
    """The native core bounds its scores the same way (a bool mask becomes each block's bias, an additive bias is
    sliced), and since each query row is computed alone the blocks give the unblocked result bit for bit."""
    import dspark.models.mla as mla
    from dspark.models.layers import attention_bias

    attn, rot = make(False, True, None, True)
    attn = attn.to(dtype)
    x = torch.randn(2, 23, 32).to(dtype)
    pos = torch.arange(23).expand(2, 23) + torch.tensor([[0], [7]])
    cos, sin = rot.cos_sin(pos)
    mask = causal_mask(pos, torch.arange(30).expand(2, 30))
    mask = attention_bias(mask) if as_bias else mask
    kv = torch.randn(2, 30, attn.cfg.latent_dim).to(dtype)
    sizes = []
    inner = attn._native_block

    def block(ops, x, q, *a):
        assert a[-1].shape == (2, 1, q.shape[1], 30)  # the block's own rows of the bias
        sizes.append(q.shape[1])
        return inner(ops, x, q, *a)

    monkeypatch.setattr(attn, "_native_block", block)
    with torch.no_grad():
        whole = attn.attend_from_kv(x, cos, sin, kv, mask, absorbed=True)
        monkeypatch.setattr(mla, "SCORE_BLOCK", 2 * 4 * 30 * 5)  # 5 query rows per block
        blocked = attn.attend_from_kv(x, cos, sin, kv, mask, absorbed=True)
    assert sizes == [23, 5, 5, 5, 5, 3]
    assert torch.equal(blocked, whole)


def test_cached_latent_is_normalised_ckv_and_rotated_kpe():
    attn, rot = make(False, False, 16, True)
    x = torch.randn(2, 5, 32)
    pos = torch.arange(5).expand(2, 5)
    cos, sin = rot.cos_sin(pos)
    lat = attn.latent(x, cos, sin)
    assert lat.shape == (2, 5, 28)
    c_kv = attn.kv_a_proj_with_mqa(x)[..., :20]
    torch.testing.assert_close(lat[..., :20], attn.kv_a_layernorm(c_kv))
    # position 0 is not rotated
    torch.testing.assert_close(lat[:, 0, 20:], attn.kv_a_proj_with_mqa(x)[:, 0, 20:])


def test_bidirectional_mask_is_respected():
    attn, rot = make(False, False, 16, False)
    x = torch.randn(1, 6, 32)
    pos = torch.arange(6)[None]
    cos, sin = rot.cos_sin(pos)
    full = torch.ones(1, 6, 6, dtype=torch.bool)
    with torch.no_grad():
        a = attn(x, cos, sin, full, absorbed=True)
        n = attn(x, cos, sin, full, absorbed=False)
        c = attn(x, cos, sin, causal_mask(pos, pos))
    torch.testing.assert_close(a, n, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 0], c[:, 0])  # row 0 now sees the future


def test_official_draft_softmax_scale():
    cfg = DraftConfig.from_dict(read_json(OFFICIAL))
    expected = 192**-0.5 * (0.1 * math.log(32) + 1) ** 2
    assert cfg.mla.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert cfg.mla.softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert cfg.mla.latent_dim == 576
    assert yarn_correction_range(cfg.rope) == (15, 26)
    inv = RotaryEmbedding(cfg.rope).inv_freq
    assert inv[0].item() == 1.0
    assert inv[31].item() == pytest.approx(50000 ** (-62 / 64) / 32, rel=1e-5)
