"""The native AttnRes mixing point (dspark/native/resmix.cpp) against ResMix's PyTorch formula, fp32 and bf16, and
row independence (a row mixes the same alone as in a block)."""

import pytest
import torch

from dspark import native
from dspark.models.k3 import ResMix

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_res_mix_matches_the_formula(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    mix = ResMix(40, 1e-6)
    with torch.no_grad():
        mix.norm.weight.copy_(1 + 0.2 * torch.randn(40, generator=g))
        mix.proj.weight.copy_(torch.randn(1, 40, generator=g))
    mix = mix.to(dtype)
    values = [(torch.randn(2, 5, 40, generator=g) * s).to(dtype) for s in (1.0, 3.0, 0.5)]
    with torch.no_grad():
        monkeypatch.setenv(native.ENV, "0")
        ref = mix(values)
        monkeypatch.setenv(native.ENV, "1")
        got = mix(values)
        one = mix([v[:, 2:3] for v in values])
    assert got.dtype == dtype and not torch.equal(values[0], got)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    assert torch.equal(one, got[:, 2:3])
