"""attention_backend: vLLM's names map to what runs here (one warning naming the substitute), unknown names are
errors listing the accepted ones, and the mapped backend really selects the drafter's attention kernel."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dspark.config import (
    VLLM_ATTENTION_BACKENDS,
    BackendSubstitutionWarning,
    ConfigError,
    DraftConfig,
    SpeculativeConfig,
)
from dspark.models.drafter import DSparkDrafter
from dspark.models.tiny import build_tiny_pair, randomize_

CARD = '{"method": "dspark", "model": "Inferact/Kimi-K3-DSpark", "num_speculative_tokens": 7, "attention_backend": "FLASHINFER_MLA"}'  # noqa: E501


def parse_recording(text: str) -> tuple[SpeculativeConfig | None, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = SpeculativeConfig.parse(text)
    return spec, list(caught)


def test_the_cards_json_parses_with_exactly_one_warning_naming_the_substitute():
    spec, caught = parse_recording(CARD)
    assert spec is not None
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("dspark", "Inferact/Kimi-K3-DSpark", 7)
    assert spec.attention_backend == "FLASHINFER_MLA"  # kept as written (round trip), mapped on use
    assert spec.draft_attention_backend == "sdpa"
    assert len(caught) == 1 and issubclass(caught[0].category, BackendSubstitutionWarning)
    text = str(caught[0].message)
    assert "FLASHINFER_MLA" in text and "'sdpa'" in text


@pytest.mark.parametrize(
    "name", ["FLASH_ATTN_MLA", "TRITON_MLA", "CUTLASS_MLA", "FLASHMLA", "FLASH_ATTN", "flashinfer"]
)
def test_vllm_names_are_case_insensitive_and_mapped(name):
    spec, caught = parse_recording(json.dumps({"attention_backend": name}))
    assert spec is not None and spec.draft_attention_backend == "sdpa" and len(caught) == 1


@pytest.mark.parametrize(
    ("name", "runs"), [("TORCH_SDPA", "sdpa"), ("torch", "torch"), ("sdpa", "sdpa"), ("auto", None)]
)
def test_names_that_run_as_is_do_not_warn(name, runs):
    spec, caught = parse_recording(json.dumps({"attention_backend": name}))
    assert spec is not None and spec.draft_attention_backend == runs and caught == []


@pytest.mark.parametrize("name", ["FLASHINFER_MLAX", "FLASHMLA_SPARSE", "", 7])
def test_unknown_backend_is_an_error_listing_the_accepted_names(name):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(json.dumps({"attention_backend": name}))
    msg = str(e.value)
    assert "attention_backend" in msg
    if isinstance(name, str):
        assert "FLASHINFER_MLA" in msg and "'torch'" in msg and "'sdpa'" in msg


def _gqa_config() -> DraftConfig:
    return DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": 96,
            "target_layer_ids": [0, 2],
            "num_target_layers": 4,
            "mask_token_id": 3,
        }
    )


def _drafters():
    target, mla = build_tiny_pair(1)
    gqa = DSparkDrafter(_gqa_config())
    randomize_(gqa, 3)
    gqa.attach(target.embed_tokens, target.lm_head)
    return {"mla": mla, "gqa": gqa}


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("absorbed", [True, False])
def test_torch_and_sdpa_backends_compute_the_same_attention(kind, absorbed, monkeypatch):
    drafter = _drafters()[kind].float()
    K, n = 4, 6
    taps = torch.randn(2, n, drafter.config.num_taps * drafter.config.target_hidden_size, generator=None)
    block = torch.tensor([[5] + [3] * (K - 1), [7] + [3] * (K - 1)])
    mask = torch.ones(2, K, n + K, dtype=torch.bool)
    mask[1, :, :2] = False  # the second row sees less context

    def run(backend: str):
        drafter.set_attention_backend(backend)
        with torch.no_grad():
            return drafter(
                block, torch.arange(n, n + K).expand(2, K), mask, taps, torch.arange(n)[None], None, absorbed
            )

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ref = run("torch")
    assert calls == []  # the explicit path never calls the fused kernel
    fused = run("sdpa")
    assert len(calls) == drafter.config.num_hidden_layers
    torch.testing.assert_close(fused.base_logits, ref.base_logits, rtol=1e-4, atol=1e-4)


def test_every_mapped_name_runs_something_real():
    assert set(VLLM_ATTENTION_BACKENDS.values()) <= {"torch", "sdpa"}


def _backends(module: torch.nn.Module) -> set[str]:
    from dspark.models.drafter import GQAttention
    from dspark.models.mla import MLAttention

    return {m.backend for m in module.modules() if isinstance(m, MLAttention | GQAttention)}


def test_engine_attention_backend_selects_the_targets_kernel_and_is_the_drafts_default(tmp_path):
    """vLLM's engine-wide --attention-backend: the target's layers, and the draft's unless the speculative
    config names its own (as in vLLM)."""
    from dspark.llm import build_engines, engine_configs
    from dspark.models.tiny import write_tiny_pair

    target_dir, draft_dir = write_tiny_pair(tmp_path / "pair")
    spec = {"method": "dspark", "model": str(draft_dir), "num_speculative_tokens": 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inherit, own = build_engines(
            target_dir,
            [spec, {**spec, "attention_backend": "torch"}],
            *engine_configs(dtype="float32", attention_backend="FLASHMLA"),
        )
    assert [issubclass(w.category, BackendSubstitutionWarning) for w in caught] == [True]  # said once
    assert "engine config" in str(caught[0].message) and "FLASHMLA" in str(caught[0].message)
    assert _backends(inherit.target) == {"sdpa"} and _backends(inherit.drafter) == {"sdpa"}
    assert _backends(own.drafter) == {"torch"}
    (default,) = build_engines(target_dir, [spec], *engine_configs(dtype="float32"))
    assert _backends(default.target) == {"torch"} and _backends(default.drafter) == {"torch"}
    with pytest.raises(ConfigError, match="unknown attention backend"):
        build_engines(target_dir, [None], *engine_configs(dtype="float32", attention_backend="NOPE"))


def test_hf_target_backend_goes_through_transformers_attn_implementation():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark.llm import _set_target_backend
    from dspark.models.hf_target import HFTarget

    cfg = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    target = HFTarget(Qwen3ForCausalLM(cfg).eval())
    _set_target_backend(target, "torch")
    assert target.model.config._attn_implementation == "eager"
    _set_target_backend(target, "sdpa")
    assert target.model.config._attn_implementation == "sdpa"
