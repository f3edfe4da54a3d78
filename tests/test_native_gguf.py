"""GGUF weights served quantized: a tiny Llama written as Q4_0/Q4_1/Q8_0 GGUF, loaded with quantization
'gguf-exact' (native kernels, exact fp32 arithmetic), 'gguf', 'none' (the dequantized export) and through the PyTorch
fallback (DSPARK_NATIVE=0).

Tolerances: 'gguf-exact' logits within 1e-4 of the dense fp32 model's (only the order of the sums differs); the
fallback's equal them bit for bit; 'gguf' within 5 % of the logit range (int8 activations).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import LlamaConfig, LlamaForCausalLM

from dspark import native
from dspark.checkpoint.gguf import SOURCE_FILE, export_gguf, gguf_source, read_gguf_blocks
from dspark.config import ConfigError
from dspark.models.loading import load_target
from dspark.models.quantized import QuantLinear, QuantWeight
from gguf_fixtures import VOCAB_SIZE, tiny_hf, write_gguf

NATIVE = native.available()  # built (or found) before any test points DSPARK_CACHE elsewhere
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native kernels: {native.status()}")

# layer 0 all Q4_0 (q|k|v and gate|up fuse), layer 1 Q4_1 with a Q8_0 v (q|k|v stays three products), embedding
# (the tied lm_head) Q8_0; intermediate 96 = 3 blocks: the odd-block tail of down_proj
QTYPES = {f"blk.0.{n}.weight": Q.Q4_0 for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
QTYPES |= {f"blk.1.{n}.weight": Q.Q4_1 for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
QTYPES |= {"blk.1.attn_v.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q8_0, "token_embd.weight": Q.Q8_0}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    tmp = tmp_path_factory.mktemp("native-gguf")
    path = write_gguf(tmp / "tiny-q.gguf", src, "llama", qtypes=QTYPES)
    return export_gguf(path, out=tmp / "export")


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (2, 9), generator=torch.Generator().manual_seed(1))


def logits(model, fuse: bool = False) -> torch.Tensor:
    if fuse:
        model.fuse_for_inference()
    with torch.inference_mode():
        return model(ids()).logits.float()


def test_the_export_records_its_gguf_and_blocks_come_back_in_hf_row_order(export):
    src = gguf_source(export)
    assert src is not None and src.name == "tiny-q.gguf" and (export / SOURCE_FILE).is_file()
    blocks = read_gguf_blocks(src)
    assert blocks["model.layers.0.self_attn.q_proj.weight"].qtype == "Q4_0"
    assert blocks["model.embed_tokens.weight"].qtype == "Q8_0" and "lm_head.weight" not in blocks
    dense = load_target(export, "float32")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        w = dense.get_parameter(name)  # the export's q/k rows are un-permuted: the blocks must be too
        assert torch.equal(torch.from_numpy(blocks[name].dequantize()), w.detach())


@needs_native
@pytest.mark.parametrize("fuse", [False, True])
def test_gguf_serving_matches_the_dense_model(export, fuse):
    dense = logits(load_target(export, "float32"), fuse)
    model = load_target(export, "float32", quantization="gguf-exact")
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 7 + 1 and isinstance(model.lm_head, QuantLinear)  # every linear and the tied head
    assert model.lm_head.qweight.qtype == "Q8_0"
    got = logits(model, fuse)
    assert (got - dense).abs().max() <= 1e-4, float((got - dense).abs().max())
    if fuse:  # layer 0's q|k|v and both layers' gate|up run as one product each; layer 1's mixed q|k|v does not
        layers = model.model.layers
        assert layers[0].self_attn.__dict__["_qkv_quant"] is not None
        assert layers[1].self_attn.__dict__["_qkv_quant"] is None
        assert all(layer.mlp.__dict__["_gate_up_quant"] is not None for layer in layers)


@needs_native
def test_gguf_int8_stays_near_the_dense_model(export):
    dense = logits(load_target(export, "float32"))
    got = logits(load_target(export, "float32", quantization="gguf"), fuse=True)
    assert (got - dense).abs().max() <= 0.05 * (dense.max() - dense.min())


@needs_native
def test_int8_products_give_every_row_its_one_row_result_at_any_row_count(export):
    """The int8 arithmetic keeps the block kernel for every row count (no GEMM above DENSE_ROWS), so a row of a
    192-row product (24 requests' verifications) equals that row alone."""
    from dspark.models.quantized import DENSE_ROWS, QuantLinear

    model = load_target(export, "float32", quantization="gguf")
    linear = next(m for m in model.modules() if isinstance(m, QuantLinear))
    x = torch.randn(3 * DENSE_ROWS, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for m in (DENSE_ROWS + 1, 3 * DENSE_ROWS):
            many = linear(x[:m])
            assert all(torch.equal(many[i], linear(x[i : i + 1])[0]) for i in range(0, m, 7)), m


def test_the_fallback_serves_the_export_values_bit_for_bit(export, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    dense = logits(load_target(export, "float32"))
    model = load_target(export, "float32", quantization="gguf-exact")
    assert isinstance(model.lm_head, QuantLinear)
    assert torch.equal(logits(model, fuse=True), dense)  # fused groups stand aside: the dense path's products
    bf16 = load_target(export, "bfloat16", quantization="gguf-exact")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(logits(bf16), logits(load_target(export, "bfloat16")))


def test_auto_picks_gguf_only_for_a_gguf_export_with_kernels(export, tmp_path, monkeypatch):
    auto = load_target(export, "float32", quantization="auto")
    assert isinstance(auto.lm_head, QuantLinear) == NATIVE
    monkeypatch.setenv(native.ENV, "0")
    assert not isinstance(load_target(export, "float32", quantization="auto").lm_head, QuantLinear)
    plain = tmp_path / "plain"  # the same directory without its source record: an ordinary HF directory
    plain.mkdir()
    for f in export.iterdir():
        if f.name != SOURCE_FILE:
            (plain / f.name).symlink_to(f)
    assert not isinstance(load_target(plain, "float32", quantization="auto").lm_head, QuantLinear)
    with pytest.raises(ConfigError, match="not the export of a .gguf file"):
        load_target(plain, "float32", quantization="gguf-exact")
    with pytest.raises(ConfigError, match="quantization 'q4' is not supported"):
        load_target(export, "float32", quantization="q4")


def test_a_changed_gguf_is_no_longer_a_source(export, tmp_path):
    src = gguf_source(export)
    copy = tmp_path / "export"
    copy.mkdir()
    rec = (export / SOURCE_FILE).read_text()
    (copy / SOURCE_FILE).write_text(rec.replace(str(src.stat().st_size), str(src.stat().st_size + 1)))
    assert gguf_source(copy) is None


@needs_native
def test_a_gguf_layer_runs_as_one_native_call_and_speculation_still_decodes_the_plain_tokens(export, monkeypatch):
    """Decode steps and verifications of a layer whose q|k|v and gate|up are grouped run ``gqa_layer`` (layer 0);
    a layer with mixed q/k/v block types keeps the modules (layer 1). The native layer's tokens equal the modules'
    and, since every row is computed alone, n-gram speculation (8-row verifications) decodes the plain tokens."""
    import dspark.models.llama as llama
    from dspark.config import EngineConfig, SpeculativeConfig
    from dspark.engine.engine import Engine
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    model = load_target(export, "float32", quantization="gguf-exact")
    calls: list[tuple[int, int, bool]] = []
    native_forward = llama.DecoderLayer.native_forward

    def spy(self, h, *args):
        out = native_forward(self, h, *args)
        calls.append((self.self_attn.layer_idx, h.shape[1], out is not None))
        return out

    monkeypatch.setattr(llama.DecoderLayer, "native_forward", spy)
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, VOCAB_SIZE, (6,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(0, VOCAB_SIZE, (21,), generator=g).tolist()]  # n-gram drafts on the first
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def greedy(spec=None, rows=llama.NATIVE_LAYER_ROWS):
        monkeypatch.setattr(llama, "NATIVE_LAYER_ROWS", rows)
        engine = Engine(model, None, spec, EngineConfig(dtype="float32", max_num_seqs=4))
        return [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    modules = greedy(rows=0)
    assert not any(fused for *_, fused in calls)
    calls.clear()
    plain = greedy()
    assert {(layer, fused) for layer, t, fused in calls if t == 1} == {(0, True), (1, False)}
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=7, prompt_lookup_max=3, speculation_guard=False)
    calls.clear()
    speculative = greedy(ngram)
    assert any(layer == 0 and t == 8 and fused for layer, t, fused in calls)  # a whole verification in one call
    assert plain == modules and speculative == plain
    assert model.model.layers[0].native_weights() is not None and model.model.layers[1].native_weights() is None


class _Pool:
    """A minimal paged cache for one sequence of T new rows at slots 1..T (slot 0: scratch): what the native layer
    (``plane_and_slots``) and the native stack (``pool_and_slots``) read and write."""

    def __init__(self, layers: int, width: int, T: int) -> None:
        self.pool = torch.zeros(layers, T + 1, width)
        self.writes = torch.arange(1, T + 1)
        self.slots = torch.arange(1, T + 1)[None]

    def plane_and_slots(self, layer: int):
        return self.pool[layer], self.writes, self.slots

    def pool_and_slots(self):
        return self.pool, 0, self.writes, self.slots


@needs_native
def test_a_stack_of_native_layers_runs_as_one_call_with_the_same_values_and_taps(tmp_path, monkeypatch):
    """Where every layer takes its native call, the whole stack is one ``gqa_stack`` call: logits, taps and the
    pool rows it writes equal the layer-by-layer native calls bit for bit; and greedy decoding (plain and with
    n-gram verifications) is unchanged."""
    import dspark.models.llama as llama
    from dspark.config import EngineConfig, SpeculativeConfig
    from dspark.engine.engine import Engine
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    qtypes = {k: (Q.Q4_1 if v == Q.Q8_0 and k == "blk.1.attn_v.weight" else v) for k, v in QTYPES.items()}
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    model = load_target(export_gguf(write_gguf(tmp_path / "u.gguf", src, "llama", qtypes=qtypes), out=tmp_path / "e"),
                        "float32", quantization="gguf-exact")  # fmt: skip
    model.fuse_for_inference()
    stacks = []
    real, arguments = llama.LlamaTarget.native_stack, llama.LlamaTarget.stack_arguments
    monkeypatch.setattr(llama.LlamaTarget, "native_stack", lambda *a: stacks.append(r := real(*a)) or r)
    L, T = len(model.model.layers), 5
    tokens = ids()[:1, :T]
    width = model.page_format.width

    def run(stack: bool):
        monkeypatch.setattr(llama.LlamaTarget, "stack_arguments", arguments if stack else lambda self: None)
        pool = _Pool(L, width, T)
        with torch.inference_mode():
            out = model(tokens, torch.arange(T)[None], torch.ones(1, T, T, dtype=torch.bool).tril(), pool,
                        tap_layers=(0, L - 1))  # fmt: skip
        return out, pool.pool

    stacks.clear()
    one, pool_one = run(stack=True)
    assert stacks and stacks[-1] is not None  # the stack ran
    per_layer, pool_per_layer = run(stack=False)
    assert stacks[-1] is None
    assert torch.equal(one.logits, per_layer.logits) and torch.equal(one.taps, per_layer.taps)
    assert torch.equal(pool_one, pool_per_layer)

    g = torch.Generator().manual_seed(4)
    motif = torch.randint(0, VOCAB_SIZE, (6,), generator=g).tolist()
    prompts = [motif * 4, torch.randint(0, VOCAB_SIZE, (21,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def greedy(spec=None, stack=True):
        monkeypatch.setattr(llama.LlamaTarget, "stack_arguments", arguments if stack else lambda self: None)
        engine = Engine(model, None, spec, EngineConfig(dtype="float32", max_num_seqs=4))
        return [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=7, prompt_lookup_max=3, speculation_guard=False)
    layers = greedy(stack=False)
    stacks.clear()
    assert greedy() == layers and greedy(ngram) == layers
    assert any(s is not None for s in stacks)


@needs_native
@pytest.mark.parametrize("quantization", ["gguf", "gguf-exact"])
def test_many_requests_verified_together_decode_their_plain_greedy_tokens(tmp_path, quantization, monkeypatch):
    """12 requests' 8-row verifications are 96 rows in one forward, more than the 64 above which products switch
    path: every layer still runs its one native call per row set, so each row equals its plain decode step and
    speculative greedy output equals plain greedy output, in both arithmetics."""
    import dspark.models.llama as llama
    from dspark.config import EngineConfig, SpeculativeConfig
    from dspark.engine.engine import Engine
    from dspark.llm import LLM
    from dspark.sampling_params import SamplingParams

    qtypes = {k: (Q.Q4_1 if v == Q.Q8_0 and k == "blk.1.attn_v.weight" else v) for k, v in QTYPES.items()}
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    exported = export_gguf(write_gguf(tmp_path / "u.gguf", src, "llama", qtypes=qtypes), out=tmp_path / "e")
    model = load_target(exported, "float32", quantization=quantization)
    model.fuse_for_inference()  # q|k|v and gate|up grouped, as engines built by build_engines serve it
    seen = []  # (rows in the forward, whether the one native stack call ran)
    real = llama.LlamaTarget.native_stack

    def recorded(self, h, *rest):
        out = real(self, h, *rest)
        seen.append((h.shape[0] * h.shape[1], h.shape[1] <= 16, out is not None))
        return out

    monkeypatch.setattr(llama.LlamaTarget, "native_stack", recorded)
    g = torch.Generator().manual_seed(7)
    motifs = [torch.randint(0, VOCAB_SIZE, (5,), generator=g).tolist() for _ in range(12)]
    prompts = [m * 4 for m in motifs]  # n-gram lookup proposes K = 7 drafts every round
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=7, prompt_lookup_max=3, speculation_guard=False)

    def greedy(spec):
        engine = Engine(model, None, spec, EngineConfig(dtype="float32", max_num_seqs=16))
        return [o.token_ids for o in LLM.from_engine(engine).generate(prompts, params)], engine

    plain, _ = greedy(None)
    speculative, engine = greedy(ngram)
    assert engine.metrics.spec.num_drafts > 0
    assert speculative == plain
    big = [ran for rows, short, ran in seen if short and rows > 64]
    assert big and all(big)  # 96-row verifications took the native stack, as the decode steps did


@needs_native
def test_stack_arguments_follow_swapped_modules(tmp_path):
    """The remembered gqa_stack arguments are collected again when a layer's module or blocks change: a swapped
    down projection and a swapped norm weight both reach the stack's output (it equals the per-layer path)."""
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    qtypes = {k: (Q.Q4_1 if v == Q.Q8_0 and k == "blk.1.attn_v.weight" else v) for k, v in QTYPES.items()}
    model = load_target(export_gguf(write_gguf(tmp_path / "s.gguf", src, "llama", qtypes=qtypes), out=tmp_path / "e"),
                        "float32", quantization="gguf")  # fmt: skip
    model.fuse_for_inference()
    L, T = len(model.model.layers), 4
    tokens = ids()[:1, :T]

    def logits() -> torch.Tensor:
        pool = _Pool(L, model.page_format.width, T)
        with torch.inference_mode():
            return model(tokens, torch.arange(T)[None], torch.ones(1, T, T, dtype=torch.bool).tril(), pool).logits

    first = logits()
    assert model.stack_arguments() is not None  # every layer runs in the one native call
    assert model.stack_arguments() is model.stack_arguments()  # remembered while nothing changed
    layer = model.model.layers[1]
    down = layer.mlp.down_proj
    layer.mlp.down_proj = QuantLinear(QuantWeight(down.qweight.qtype, down.qweight.blocks.flip(0).contiguous()),
                                      down.bias_f32, down.dtype, down.int8)  # fmt: skip
    swapped = logits()
    assert not torch.equal(first, swapped)
    layer.post_attention_layernorm.weight = torch.nn.Parameter(layer.post_attention_layernorm.weight * 2)
    normed = logits()
    assert not torch.equal(swapped, normed)
    model.__dict__.pop("_stack_memo")
    assert torch.equal(normed, logits())  # collected from scratch: the same arguments


@needs_native
def test_dense_linears_served_as_q8_0_blocks_stay_near_the_dense_product():
    """quantize_linears (a drafter's backbone next to a GGUF target): each named linear whose input width is a
    multiple of 32 becomes Q8_0 blocks in the int8 arithmetic, each value within about half a quantization step of
    its weight, and its product stays near the dense one; other widths stay dense."""
    from dspark.models.quantized import quantize_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(40, 8))
    dense = model[0].weight.detach().clone()
    x = torch.randn(5, 64)
    ref = model[0](x).detach()
    assert quantize_linears(model, ["0", "1"], torch.float32) == 1
    q = model[0]
    assert isinstance(q, QuantLinear) and q.int8 and q.qweight.qtype == "Q8_0"
    assert isinstance(model[1], torch.nn.Linear) and not isinstance(model[1], QuantLinear)
    step = dense.abs().view(48, 2, 32).amax(-1, keepdim=True) / 127
    slack = 0.5 + 127 * 2**-11  # half a step, plus the scale's fp16 rounding times the largest quant
    assert bool(((q.qweight.dequantize() - dense).abs().view(48, 2, 32) <= step * slack + 1e-7).all())
    with torch.inference_mode():
        got = q(x)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


def test_the_drafter_follows_the_target_into_q8_0_unless_told():
    from dspark.config import ConfigError, SpeculativeConfig
    from dspark.models.loading import choose_draft_quantization

    assert choose_draft_quantization(None, "gguf")[0] == "q8_0"
    assert choose_draft_quantization("auto", "gguf-exact")[0] == "none"  # the exact reference stays dense
    assert choose_draft_quantization(None, "none")[0] == "none"
    assert choose_draft_quantization("none", "gguf")[0] == "none"
    assert choose_draft_quantization("q8_0", "none")[0] == "q8_0"
    with pytest.raises(ConfigError, match="quantization"):
        SpeculativeConfig(quantization="int4")
