"""Native CPU kernels (dspark/native): the GGUF block-quantized linear against the dequantize + F.linear oracle,
the int8 arithmetic against its plain-torch emulation, the fp32 helpers, and the PyTorch fallback.

Tolerances (stated, and asserted here):
- exact path: |y - y64| <= 2e-5 · (|x| @ |W|ᵀ) elementwise, y64 = fp64 x @ dequantized Wᵀ (F.linear's own error
  is of the same order: only the order of the sums differs);
- int8 path: within 1e-5 · max|y| of ``reference_quant_linear`` (same arithmetic), and its RMS error against the
  dense product under 2 % of the output RMS on Gaussian activations (int8 activation rounding).
Both paths compute each activation row of a product exactly as a lone row (bit for bit, any batch of 1-130 rows):
a speculative verify of K+1 rows then decodes what K+1 plain steps would.
Native-only assertions skip where the kernels cannot be built; the fallback is tested everywhere.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from dspark import native
from dspark.checkpoint.gguf import GGUFBlocks, dequantize
from dspark.models.quantized import (
    BLOCK_BYTES,
    DENSE_ROWS,
    DENSE_TILE,
    PACKED,
    QTYPES,
    QuantGroup,
    QuantLinear,
    QuantWeight,
    reference_quant_linear,
)

TYPES = ("Q4_0", "Q4_1", "Q8_0")
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


def quantized(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """A [n, k] weight quantized by the gguf package's own quantizer."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = gguf.quants.quantize(w, getattr(Q, qtype))
    return QuantWeight.of(GGUFBlocks(qtype, n, k, raw.reshape(n, -1)))


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Random quant bytes (Q8: every int8 value, -128 included) under finite random fp16 scales/offsets."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    scales = ((torch.rand(n, k // 32, 2, generator=g) - 0.5) * 0.1).half()
    b[..., :2] = scales[..., 0:1].view(torch.uint8)
    if qtype == "Q4_1":
        b[..., 2:4] = scales[..., 1:2].view(torch.uint8)
    return QuantWeight(qtype, b.view(n, -1).contiguous())


def ops():
    return native.ops()


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_the_gguf_reference_bit_for_bit(qtype):
    for w in (quantized(qtype, 5, 96), random_blocks(qtype, 7, 64, seed=1)):
        ref = dequantize(w.blocks.numpy(), qtype, (w.out_features, w.in_features))
        np.testing.assert_array_equal(w.dequantize().numpy(), ref)
        rows = torch.tensor([3, 0])
        np.testing.assert_array_equal(w.dequantize(rows).numpy(), ref[[3, 0]])


def test_quant_weight_checks_its_layout_and_concatenates_rows():
    a, b = quantized("Q4_1", 3, 64), quantized("Q4_1", 5, 64, seed=1)
    cat = QuantWeight.cat([a, b])
    assert (cat.out_features, cat.in_features) == (8, 64)
    torch.testing.assert_close(cat.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one type and one width"):
        QuantWeight.cat([a, quantized("Q8_0", 2, 64)])
    with pytest.raises(ValueError, match=r"contiguous uint8 \[N, K/32"):
        QuantWeight("Q4_1", torch.zeros(2, 21, dtype=torch.uint8))
    with pytest.raises(ValueError, match="supports"):
        QuantWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- exact path


@needs_native
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_exact_kernel_is_f_linear_over_the_dequantized_weight(qtype, m):
    torch.manual_seed(m)
    for k, w in ((576, quantized(qtype, 40, 576)), (96, random_blocks(qtype, 33, 96, seed=m))):  # 96: odd blocks
        dense = w.dequantize()
        x = torch.randn(m, k) * torch.rand(1, k) * 4  # uneven channel scales
        y = ops().quant_linear(x, w.blocks, None, QTYPES[qtype], False)
        y64 = x.double() @ dense.double().T
        bound = 2e-5 * (x.abs().double() @ dense.abs().double().T) + 1e-30
        assert y.dtype == torch.float32 and y.shape == (m, w.out_features)
        assert bool(((y.double() - y64).abs() <= bound).all()), float(((y.double() - y64).abs() / bound).max())
        # F.linear itself sits within the same bound: the oracle is tight, not loose
        assert bool(((F.linear(x, dense).double() - y64).abs() <= bound).all())


@needs_native
def test_exact_kernel_takes_bf16_and_a_bias_and_is_row_independent():
    w = quantized("Q4_1", 64, 128)
    x = torch.randn(5, 128)
    bias = torch.randn(64)
    q = QTYPES["Q4_1"]
    y = ops().quant_linear(x, w.blocks, None, q, False)
    assert torch.equal(ops().quant_linear(x, w.blocks, bias, q, False), y + bias)
    xb = x.bfloat16()
    assert torch.equal(
        ops().quant_linear(xb, w.blocks, None, q, False), ops().quant_linear(xb.float(), w.blocks, None, q)
    )
    # a row's output does not depend on the rows batched with it (decode M=1 == verify M=8 row)
    assert torch.equal(ops().quant_linear(x[2:3], w.blocks, None, q, False), y[2:3])


@needs_native
@pytest.mark.parametrize("qtype", TYPES)
def test_many_rows_are_each_their_one_row_result_bit_for_bit(qtype):
    """Any batch (a verify's K+1 rows, tiles of 8 plus a remainder) computes each row exactly as M = 1 does, in both
    arithmetics: widths that are not a multiple of the 16-row output groups, a K of several L1 chunks (1536), an
    x that is not 64-byte aligned, and a bias."""
    for n, k, seed in ((37, 1536, 1), (21, 96, 2)):
        w, bias = random_blocks(qtype, n, k, seed=seed), torch.randn(n)
        for m in (1, 2, 3, 7, 8, 9, 16, 33, 65, 130):
            x = torch.randn(m * k + 1)[1:].view(m, k)  # offset by one float: misaligned rows
            for int8 in (False, True):
                y = ops().quant_linear(x, w.blocks, bias, QTYPES[qtype], int8)
                lone = [ops().quant_linear(x[i : i + 1].clone(), w.blocks, bias, QTYPES[qtype], int8) for i in range(m)]
                assert torch.equal(y, torch.cat(lone)), (m, int8)


@needs_native
@pytest.mark.parametrize("qtype", TYPES)
def test_native_dequantize_and_the_many_rows_path_are_the_dense_product(qtype):
    n = DENSE_TILE + 44  # two weight tiles, the second partial
    w = random_blocks(qtype, n, 96, seed=3)
    dense = w.dequantize()
    assert torch.equal(ops().dequantize(w.blocks, QTYPES[qtype], 96), dense)
    lin = QuantLinear(w, torch.randn(n))
    x = torch.randn(2, DENSE_ROWS, 96)  # 128 rows: GEMMs in x's dtype over dequantized tiles, as the dense model
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, dense, lin.bias_f32))
        xb = x.bfloat16()
        assert torch.equal(lin(xb), F.linear(xb, dense.bfloat16(), lin.bias_f32.bfloat16()))
        x = torch.randn(DENSE_ROWS, 96)  # up to DENSE_ROWS rows: the block kernel
        assert torch.equal(lin(x), ops().quant_linear(x, w.blocks, lin.bias_f32, QTYPES[qtype], False))


@needs_native
def test_a_quantized_head_gives_its_rows_as_a_quantized_head():
    head = QuantLinear(random_blocks("Q8_0", 300, 64, seed=4), torch.randn(300))
    ids = torch.tensor([299, 5, 0, 17, 120])
    rows = head.rows(ids)
    assert isinstance(rows, QuantLinear) and rows.out_features == 5 and rows.qweight.qtype == "Q8_0"
    x = torch.randn(7, 64)
    with torch.inference_mode():
        assert torch.equal(rows(x), head(x)[:, ids])  # each output row's result depends on its weight row only


# ---------------------------------------------------------------------------------------------- int8 path


@needs_native
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_int8_kernel_matches_its_emulation_and_stays_near_the_dense_product(qtype, m):
    torch.manual_seed(10 + m)
    for w in (quantized(qtype, 48, 576), random_blocks(qtype, 20, 96, seed=m)):
        x = torch.randn(m, w.in_features)
        x[0, :32] = 0.0  # an all-zero block: scale 0, no NaN
        y = ops().quant_linear(x, w.blocks, None, QTYPES[qtype], True)
        emu = reference_quant_linear(x, w)
        assert torch.isfinite(y).all()
        assert (y - emu).abs().max() <= 1e-5 * emu.abs().max()
        dense = F.linear(x, w.dequantize())
        assert (y - dense).pow(2).mean().sqrt() <= 0.02 * dense.pow(2).mean().sqrt()


@needs_native
def test_int8_row_results_do_not_depend_on_the_batch():
    w = quantized("Q8_0", 30, 64)
    x = torch.randn(9, 64)
    y = ops().quant_linear(x, w.blocks, None, QTYPES["Q8_0"], True)
    assert torch.equal(ops().quant_linear(x[8:9], w.blocks, None, QTYPES["Q8_0"], True), y[8:9])


@needs_native
@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_int8_layout_computes_the_int8_arithmetic_one_row_at_a_time(qtype):
    """int8 QuantLinears of 16k outputs read their weight repacked (16 outputs side by side): within 1e-5 · max|y| of
    the emulation, and each of 1..16 rows bit for bit its one-row result."""
    w = quantized(qtype, 48, 576)
    lin = QuantLinear(w, torch.randn(48), int8=True)
    blocks, code = lin.kernel_blocks()
    assert code == QTYPES[qtype] + PACKED and blocks.shape == w.blocks.shape and not torch.equal(blocks, w.blocks)
    x = torch.randn(16, 576)
    x[0, :32] = 0.0
    with torch.inference_mode():
        y = lin(x)
        emu = reference_quant_linear(x, w, lin.bias_f32)
        assert (y - emu).abs().max() <= 1e-5 * emu.abs().max()
        for m in range(1, 17):
            assert torch.equal(lin(x[:m]), y[:m]), m
    assert QuantLinear(quantized(qtype, 20, 64), int8=True).kernel_blocks()[1] == QTYPES[qtype]  # 20 rows: as stored


@needs_native
def test_kernel_rejects_bad_shapes_with_a_clear_message():
    w = quantized("Q4_0", 4, 64)
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[N, 36\]"):
        ops().quant_linear(torch.randn(1, 64), w.blocks[:, :30].contiguous(), None, QTYPES["Q4_0"], False)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        ops().quant_linear(torch.randn(1, 40), w.blocks, None, QTYPES["Q4_0"], False)
    with pytest.raises(RuntimeError, match="unknown qtype"):
        ops().quant_linear(torch.randn(1, 64), w.blocks, None, 7, False)


# ---------------------------------------------------------------------------------------------- fp32 helpers


@needs_native
def test_rms_norm_and_silu_mul_match_torch():
    torch.manual_seed(0)
    x, r, w = torch.randn(3, 5, 100), torch.randn(3, 5, 100), torch.randn(100)
    y, h = ops().rms_norm(x, w, 1e-5, None)
    torch.testing.assert_close(y, w * F.rms_norm(x, (100,), eps=1e-5), rtol=1e-6, atol=1e-6)
    assert h.data_ptr() == x.data_ptr()
    y, h = ops().rms_norm(x, w, 1e-5, r)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, w * F.rms_norm(x + r, (100,), eps=1e-5), rtol=1e-6, atol=1e-6)
    gu = torch.randn(4, 2, 60) * 5
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops().silu_mul(gu), F.silu(g) * u, rtol=1e-6, atol=1e-6)
    gu = torch.cat((torch.randn(5, 1543) * 30, torch.randn(5, 1543)), -1)  # saturated gates; tails of 7 lanes
    gu[0, :8] = torch.tensor([-200.0, -88.5, -87.5, -20.0, 0.0, 20.0, 88.5, 200.0])
    g, u = gu.chunk(2, dim=-1)
    rows = ops().silu_mul(gu)
    torch.testing.assert_close(rows, F.silu(g) * u, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.cat([ops().silu_mul(gu[i : i + 1]) for i in range(5)]), rows)  # each row alone


# ---------------------------------------------------------------------------------------------- the module


@pytest.mark.parametrize("qtype", TYPES)
def test_quant_linear_fallback_equals_f_linear_bit_for_bit(qtype, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    w = quantized(qtype, 24, 64)
    bias = torch.randn(24)
    lin = QuantLinear(w, bias)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 3, 64).to(dtype)
            y = lin(x)
            assert y.dtype == dtype and y.shape == (2, 3, 24)
            assert torch.equal(y, F.linear(x, w.dequantize().to(dtype), bias.to(dtype)))
    assert torch.equal(lin.weight, w.dequantize())


@needs_native
def test_quant_linear_runs_the_kernel_and_falls_back_in_grad_mode():
    w = quantized("Q4_1", 24, 64)
    lin = QuantLinear(w)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.equal(lin(x), ops().quant_linear(x, w.blocks, None, QTYPES["Q4_1"], False))
        assert lin(x.bfloat16()).dtype == torch.bfloat16
    xg = x.clone().requires_grad_()
    lin(xg).sum().backward()  # the dense fallback carries the gradient
    torch.testing.assert_close(xg.grad, w.dequantize().sum(0).expand(2, 64))


@needs_native
def test_quant_group_fuses_rows_while_its_parts_stay():
    parts = [QuantLinear(quantized("Q4_0", n, 64, seed=n)) for n in (16, 8, 8)]
    group = QuantGroup.of(parts)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        fused = group.current(parts, x)
        assert fused is not None
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), rtol=0, atol=0)
        swapped = [parts[0], QuantLinear(quantized("Q4_0", 8, 64, seed=99)), parts[2]]
        assert group.current(swapped, x) is None  # a part replaced: the group no longer applies
    assert QuantGroup.regroup(group, parts) is group  # fusing again keeps the group (and its row slices)
    assert parts[1].qweight.blocks.data_ptr() == parts[0].qweight.blocks.data_ptr() + parts[0].qweight.nbytes
    assert QuantGroup.of([parts[0], QuantLinear(quantized("Q8_0", 8, 64))]) is None  # mixed types: unfused
    assert QuantGroup.of([parts[0], torch.nn.Linear(64, 8)]) is None


# ---------------------------------------------------------------------------------------------- build and fallback


def test_a_failed_build_logs_one_line_and_every_module_falls_back(monkeypatch, caplog):
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "_state", {})

    def broken(verbose: bool = False):
        raise RuntimeError("Error building extension 'dspark_native'\ng++: fatal error: no input files")

    monkeypatch.setattr(native, "build", broken)
    with caplog.at_level(logging.WARNING, logger="dspark.native"):
        assert native.ops() is None and native.ops() is None
    lines = [r for r in caplog.records if r.name == "dspark.native"]
    assert len(lines) == 1 and "using the PyTorch fallback" in lines[0].getMessage()
    assert "Error building extension" in native.status()
    w = quantized("Q8_0", 8, 64)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        assert torch.equal(QuantLinear(w)(x), F.linear(x, w.dequantize()))


def test_build_dir_is_keyed_by_source_flags_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    base = native.build_dir()
    assert base.parent == tmp_path / "native"
    monkeypatch.setenv(native.MARCH_ENV, "x86-64")
    assert native.build_dir() != base
    monkeypatch.delenv(native.MARCH_ENV)
    monkeypatch.setattr(native, "cpu_key", lambda: "another cpu")
    assert native.build_dir() != base


OTHER_PATHS = """
import torch, gguf
from gguf import GGMLQuantizationType as Q
from dspark import native
from dspark.checkpoint.gguf import GGUFBlocks
from dspark.models.quantized import QTYPES, QuantWeight, reference_quant_linear
path = {march!r}.replace("x86-64", "scalar").replace("haswell", "avx2")
assert native.status().startswith("exact=" + path), native.status()
for qt in ("Q4_0", "Q4_1", "Q8_0"):
    for k in (64, 96):
        w = torch.randn(20, k)
        qw = QuantWeight.of(GGUFBlocks(qt, 20, k, gguf.quants.quantize(w.numpy(), getattr(Q, qt)).reshape(20, -1)))
        for m in (1, 5):
            x = torch.randn(m, k)
            y = native.ops().quant_linear(x, qw.blocks, None, QTYPES[qt], False)
            y64 = x.double() @ qw.dequantize().double().T
            assert ((y.double() - y64).abs() <= 2e-5 * (x.abs().double() @ qw.dequantize().abs().double().T)).all()
            y8 = native.ops().quant_linear(x, qw.blocks, None, QTYPES[qt], True)
            emu = reference_quant_linear(x, qw)
            assert (y8 - emu).abs().max() <= 1e-5 * emu.abs().max()
    raw = gguf.quants.quantize(torch.randn(19, 2048).numpy(), getattr(Q, qt)).reshape(19, -1)
    qw = QuantWeight.of(GGUFBlocks(qt, 19, 2048, raw))
    for m in (3, 9):  # tiles and a remainder, K of two chunks: each row as alone, bit for bit
        x = torch.randn(m, 2048)
        for int8 in (False, True):
            y = native.ops().quant_linear(x, qw.blocks, None, QTYPES[qt], int8)
            lone = [native.ops().quant_linear(x[i : i + 1], qw.blocks, None, QTYPES[qt], int8) for i in range(m)]
            assert torch.equal(y, torch.cat(lone)), (qt, m, int8)
for dt, values in ((torch.float32, "fp32"), (torch.float32, "bf16"), (torch.bfloat16, "bf16")):
    w = torch.randn(70, 77) * 0.1  # fp32 weights holding bf16 values: packed as bf16 on AVX2, the same sums
    w = (w.bfloat16().float() if values == "bf16" else w).to(dt)
    x = torch.randn(13, 77).to(dt)
    y = native.ops().dense_linear(x, w, None)
    ref = x.double() @ w.double().T
    slack = ref.abs() / 128 if dt == torch.bfloat16 else 0
    assert ((y.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + slack + 1e-6).all()
    for m in (1, 3, 8, 9):  # each row as alone, bit for bit
        assert torch.equal(native.ops().dense_linear(x[:m], w, None), y[:m]), (dt, values, m)
print("ok")
"""


@pytest.mark.skipif(not os.environ.get("DSPARK_TEST_NATIVE_PATHS"), reason="set DSPARK_TEST_NATIVE_PATHS=1 (2 builds)")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_avx2_and_scalar_paths_compute_the_same(march):
    """The AVX2 and scalar code paths, built for a lesser -march in a subprocess (~30 s per build)."""
    env = dict(os.environ, **{native.MARCH_ENV: march})
    out = subprocess.run(
        [sys.executable, "-c", OTHER_PATHS.format(march=march)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [256, 77])
def test_dense_linear_is_near_f_linear_and_each_row_alone(dtype, k):
    """The dense product every native bf16/fp16/fp32 layer uses (bf16 pair products where the CPU has them, k not a
    multiple of the 32-element step too): near F.linear in fp64 over the same values, and any batch of 1-13 rows
    gives each row its one-row result bit for bit (6 weight rows past the last full 4 as well)."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(70, k, generator=g) * 0.1).to(dtype)
    x = torch.randn(13, k, generator=g).to(dtype)
    y = ops().dense_linear(x, w, None)
    ref = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + (0 if dtype == torch.float32 else ref.abs() / 128)
    assert bool(((y.double() - ref).abs() <= bound + 1e-6).all())
    for m in (1, 2, 3, 5, 8):
        for r in range(0, 13, m):
            assert torch.equal(ops().dense_linear(x[r : r + m], w, None), y[r : r + m]), (m, r)
    for m in (9, 13):  # past a tile of 8 rows
        assert torch.equal(ops().dense_linear(x[:m], w, None), y[:m]), m


@needs_native
def test_dense_weights_written_in_place_are_read_again():
    """bf16 products run on a packed copy of the weight made on first use: an in-place write to the weight (its
    version changes), and a new weight at a new address, are what the next product reads."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 48, generator=g) * 0.1).bfloat16()
    x = torch.randn(3, 48, generator=g).bfloat16()
    first = ops().dense_linear(x, w, None)
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(ops().dense_linear(x, w, None), 2 * first, rtol=1e-2, atol=1e-2)
    w2 = w.clone()
    with torch.no_grad():
        w2[:, :7] = 0
    torch.testing.assert_close(ops().dense_linear(x, w2, None).float(), x.float() @ w2.float().T, rtol=2e-2, atol=2e-2)
