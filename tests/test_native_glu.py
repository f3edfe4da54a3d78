"""The native gated MLP (``glu``, dspark/native/moe.cpp via ``SwiGLU._native_forward``) against the module path:
SwiGLU (the drafter's and the dense target layers' MLP) and K3's SiTU ``GatedMLP`` in bf16 and fp16 (up to their
rounding); every row of a batch bit for bit its one-row result; and the modules keep what the kernel does not take
(fp32, the bit-exact reference; grad mode; biases)."""

from __future__ import annotations

import pytest
import torch

from dspark import native
from dspark.models.k3 import GatedMLP
from dspark.models.layers import SwiGLU

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")

D, INTER = 48, 80


def make_mlp(kind: str, dtype: torch.dtype, bias: bool = False) -> SwiGLU:
    torch.manual_seed(0)
    mlp = GatedMLP(D, INTER, "situ", (4.0, 25.0)) if kind == "situ" else SwiGLU(D, INTER, bias=bias)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
    mlp = mlp.to(dtype)
    mlp.fuse()
    return mlp


def rows(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return (torch.randn(2, n, D, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "situ"])
def test_native_mlp_equals_the_module_path(kind: str, dtype: torch.dtype, monkeypatch) -> None:
    mlp = make_mlp(kind, dtype)
    for n in (1, 7, 40):
        x = rows(n, dtype, seed=n)
        with torch.no_grad():
            gate_up = mlp.fused_gate_up()
            assert gate_up is not None and mlp._native_forward(x, gate_up) is not None  # the kernel applies here
            got = mlp(x)
            monkeypatch.setenv(native.ENV, "0")
            want = mlp(x)
            monkeypatch.delenv(native.ENV)
        scale = float(want.float().abs().max())
        tol = 2e-3 if dtype == torch.float16 else 1e-2  # ~1 ulp of the scale
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_row_of_a_batch_is_its_one_row_result(dtype: torch.dtype) -> None:
    mlp = make_mlp("silu", dtype)
    x = rows(9, dtype)
    with torch.no_grad():
        batch = mlp(x)
        ones = [mlp(x[b : b + 1, t : t + 1]) for b in range(2) for t in range(9)]
    assert all(torch.equal(batch[i // 9, i % 9], one[0, 0]) for i, one in enumerate(ones))


def test_the_modules_keep_what_the_kernel_does_not_take() -> None:
    mlp = make_mlp("silu", torch.bfloat16)
    x = rows(3, torch.bfloat16)
    with torch.no_grad():
        assert mlp._native_forward(x, mlp.fused_gate_up()) is not None
        assert mlp._native_forward(x.float(), mlp.fused_gate_up()) is None  # x's dtype is not the weights'
        full = make_mlp("silu", torch.float32)
        assert full._native_forward(x.float(), full.fused_gate_up()) is None  # fp32: the reference modules
    assert mlp.fused_gate_up() is None  # grad mode (training): the modules
    biased = make_mlp("silu", torch.bfloat16, bias=True)
    with torch.no_grad():
        assert biased._native_forward(x, biased.fused_gate_up()) is None
        torch.testing.assert_close(biased(x), biased.down_proj(biased.activate(biased.gate_proj(x), biased.up_proj(x))))
