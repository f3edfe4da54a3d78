"""The native MoE block (``moe_rows``, dspark/native/moe.cpp via ``MoE.native_forward``) against the module path:
DeepSeek-V3 MoE (group-limited sigmoid router, softmax router) and K3's latent SiTU MoE, in fp32 (equal up to the
order of the GEMM sums) and bf16 (up to bf16 rounding); every row of a batch bit for bit its one-row result; and
greedy decoding, plain and speculative, gives the same tokens with the native block as with the modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dspark.models.target as target_mod
from dspark import native
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.k3 import K3MoE
from dspark.models.target import MLATarget, MoE
from dspark.models.tiny import build_tiny_pair, randomize_, tiny_target_config
from dspark.sampling_params import SamplingParams
from test_k3 import k3_config, random_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}")


@pytest.fixture(autouse=True)
def native_fp32(monkeypatch):
    """fp32 through the native block too (by default fp32 keeps the bit-exact module path)."""
    monkeypatch.setattr(target_mod, "NATIVE_MOE_DTYPES", (torch.float32, torch.bfloat16, torch.float16))


VARIANTS = ("mla-groups", "mla-softmax", "k3-latent-situ", "k3-situ", "k3-latent-silu")


def make_moe(variant: str, dtype: torch.dtype) -> tuple[MoE, int]:
    """A random MoE block of a tiny model built from the real config classes, stacked for inference."""
    if variant.startswith("mla"):
        cfg = tiny_target_config()  # n_group 2 (noaux_tc group-limited), routed_scaling_factor 1.5
        if variant == "mla-softmax":
            cfg = dataclasses.replace(cfg, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False)
        model = MLATarget(cfg)
        randomize_(model, 0)
        moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
        width = cfg.hidden_size
    else:
        latent = 12 if "latent" in variant else None
        cfg = k3_config(latent=latent, act=variant.rsplit("-", 1)[1])
        moe = random_model(cfg).model.layers[1].mlp
        assert isinstance(moe, K3MoE) and moe.latent == latent
        width = cfg.base.hidden_size
    moe = moe.to(dtype)
    moe.fuse()
    return moe, width


def rows(n: int, width: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_block_equals_the_module_path(variant: str, dtype: torch.dtype, monkeypatch) -> None:
    moe, width = make_moe(variant, dtype)
    for n in (1, 3, 8):  # bf16 modules: the gathered (1), dense (3, 8) expert passes
        x = rows(n, width, dtype, seed=n)
        with torch.no_grad():
            assert moe.native_forward(x.view(n, width)) is not None  # the native block does apply here
            got = moe(x)
            monkeypatch.setenv(native.ENV, "0")
            want = moe(x)
            monkeypatch.delenv(native.ENV)
        scale = float(want.float().abs().max())
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: the order of sums; bf16: ~1 ulp of the scale
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["mla-groups", "k3-latent-situ"])
def test_every_row_of_a_batch_is_its_one_row_result(variant: str, dtype: torch.dtype) -> None:
    moe, width = make_moe(variant, dtype)
    x = rows(8, width, dtype).view(8, width)
    with torch.no_grad():
        batch = moe.native_forward(x)
        ones = [moe.native_forward(x[i : i + 1]) for i in range(8)]
    assert all(torch.equal(batch[i : i + 1], one) for i, one in enumerate(ones))


def test_native_block_applies_only_where_it_can(monkeypatch) -> None:
    moe, width = make_moe("mla-groups", torch.float32)
    x = rows(4, width, torch.float32).view(4, width)
    with torch.no_grad():
        assert moe.native_forward(x) is not None
        monkeypatch.setattr(target_mod, "NATIVE_MOE_DTYPES", (torch.bfloat16, torch.float16))
        assert moe.native_forward(x) is None  # the default: fp32 keeps the bit-exact module path
        monkeypatch.setattr(target_mod, "NATIVE_MOE_DTYPES", (torch.float32,))
        monkeypatch.setattr(target_mod, "NATIVE_MOE_ROWS", 3)  # more rows than the native block takes
        assert moe.native_forward(x) is None
    assert moe.native_forward(x) is None  # grad mode: the reference loop
    unfused, _ = make_moe("mla-groups", torch.float32)
    unfused.experts[0].down_proj.weight = torch.nn.Parameter(unfused.experts[0].down_proj.weight.clone())
    with torch.no_grad():
        assert unfused.native_forward(x) is None  # an expert left the stack


def test_greedy_decoding_is_the_same_with_the_native_block(monkeypatch) -> None:
    target, drafter = build_tiny_pair(0)
    calls: list[tuple[int, bool]] = []
    native_forward = MoE.native_forward

    def spy(self, flat):
        out = native_forward(self, flat)
        calls.append((flat.shape[0], out is not None))
        return out

    monkeypatch.setattr(MoE, "native_forward", spy)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 5, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def greedy(spec: SpeculativeConfig | None, rows: int) -> list[list[int]]:
        monkeypatch.setattr(target_mod, "NATIVE_MOE_ROWS", rows)
        engine = Engine(target, drafter if spec else None, spec, EngineConfig(dtype="float32", max_num_seqs=4))
        return [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    modules = greedy(None, 0)
    assert calls and not any(fused for _, fused in calls)
    calls.clear()
    plain = greedy(None, 64)
    assert all(fused for _, fused in calls) and (len(prompts), True) in calls  # a decode step: one call per layer
    calls.clear()
    speculative = greedy(SpeculativeConfig(method="dspark", num_speculative_tokens=3), 64)
    assert all(fused for _, fused in calls) and (4 * len(prompts), True) in calls  # whole verifications too
    assert len(modules[0]) == 16 and plain == modules and speculative == plain
