"""Prompt ids, chat prompts and streamed text exactly as transformers' AutoTokenizer gives them."""

import json

import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from dspark.config import RANDOM_WEIGHTS_KEY
from dspark.data import load_prompts
from dspark.llm import BUNDLED_TARGET, LLM, build_engine
from dspark.models.tiny import tiny_target_config, write_tiny_pair
from dspark.sampling_params import SamplingParams
from dspark.serve.app import create_app
from dspark.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from dspark.train.tokenizer import format_chat

SPECIALS = ["<s>", "</s>", "<pad>", "<mask>", "<unk>"]  # ids 0..4: bos 0 and eos 1 as in the tiny target config
CHAT = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
TEXTS = ["the quick brown fox", "héllo wörld ∑ 漢字 and more", "def f(x):\n    return x + 1", " leading space"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo the fox"}]


def save_tokenizer(directory, kind: str, add_bos: bool) -> None:
    """A small BPE (byte-level or SentencePiece-like Metaspace) saved HF-style. The BOS rule lives where
    transformers keeps it: the tokenizer.json post-processor, mirrored by add_bos_token in tokenizer_config.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS)
    tok.train_from_iterator(TEXTS * 10 + [m["content"] for m in MESSAGES] * 10, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "chat_template": CHAT,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def model_with_tokenizer(tmp_path, kind: str, add_bos: bool):
    target_dir, _ = write_tiny_pair(tmp_path, target_cfg=tiny_target_config(vocab_size=320))
    save_tokenizer(target_dir, kind, add_bos)
    return target_dir, AutoTokenizer.from_pretrained(str(target_dir))


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("add_bos", [True, False])
def test_prompt_ids_are_the_autotokenizer_ids(tmp_path, kind, add_bos):
    target_dir, ref = model_with_tokenizer(tmp_path, kind, add_bos)
    engine = build_engine(target_dir, None, dtype="float32")
    assert isinstance(engine.tokenizer, HFTokenizer)
    for i, text in enumerate(TEXTS):
        want = ref(text)["input_ids"]
        assert (want[0] == 0) is add_bos  # the two tokenizers really differ in their BOS rule
        assert engine.add_request(text, SamplingParams(max_tokens=1), f"r{i}").prompt_ids == want


@pytest.mark.parametrize("add_bos", [True, False])
def test_chat_prompts_are_apply_chat_template(tmp_path, add_bos):
    target_dir, ref = model_with_tokenizer(tmp_path, "bytelevel", add_bos)
    want = ref.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    engine = build_engine(target_dir, None, dtype="float32")
    assert engine.tokenizer.encode_chat(MESSAGES) == want
    assert engine.tokenizer.apply_chat_template(MESSAGES) == ref.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps({"prompt": TEXTS[0]}) + "\n")
    chat, plain = load_prompts(data, chat_template=engine.tokenizer.apply_chat_template)
    assert chat.token_ids(engine.tokenizer) == want
    assert plain.token_ids(engine.tokenizer) == ref(TEXTS[0])["input_ids"]
    client = TestClient(create_app(engine))
    assert client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == want
    assert client.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"] == ref(TEXTS[1])["input_ids"]


def test_a_tokenizer_without_chat_template_refuses_chat_with_a_message(tmp_path):
    target_dir, _ = model_with_tokenizer(tmp_path, "bytelevel", False)
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tokenizer_config.json has no 'chat_template'"):
        load_tokenizer(target_dir).encode_chat(MESSAGES)
    client = TestClient(create_app(build_engine(target_dir, None, dtype="float32")))
    body = {"model": "target", "messages": MESSAGES, "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "has no 'chat_template'" in r.json()["error"]["message"]


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    client = TestClient(create_app(build_engine(BUNDLED_TARGET, None, dtype="float32")))
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}  # user/assistant only
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "role must be user or assistant" in r.json()["error"]["message"]


def test_bundled_chat_template_renders_the_trained_chat_format():
    tok = load_tokenizer(BUNDLED_TARGET)
    ref = AutoTokenizer.from_pretrained(str(BUNDLED_TARGET))
    msgs = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "ok"}]
    msgs += [{"role": "user", "content": "again"}]
    assert tok.apply_chat_template(msgs) == format_chat(msgs, add_generation_prompt=True)
    assert tok.encode_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    one = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(one) == [
        0,
        4,
        *tok.encode("hi", add_special_tokens=False),
        5,
    ]  # <|bos|><|user|>..<|assistant|>


def test_missing_tokenizer_is_an_error_unless_the_model_is_marked_random(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(tmp_path)
    target_dir, _ = write_tiny_pair(tmp_path)  # marked as explicitly random test weights
    tok = load_tokenizer(target_dir, bos_token_id=0)
    assert isinstance(tok, ByteTokenizer) and tok.encode("a")[0] == 0 and tok.vocab_size == 96
    config = json.loads((target_dir / "config.json").read_text())
    del config[RANDOM_WEIGHTS_KEY]
    (target_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(target_dir, vocab_size=96)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_incremental_detokenization_concatenates_to_the_full_decode(tmp_path, kind):
    save_tokenizer(tmp_path, kind, add_bos=True)
    tok = load_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(0)
    sequences = [tok.encode(t) + tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [torch.randint(0, tok.vocab_size, (40,), generator=g).tolist() for _ in range(30)]
    for ids in sequences:
        detok = tok.detokenizer()
        pieces = [detok.step([i]) for i in ids]
        final = detok.flush()
        assert "".join(pieces) + final == detok.text == tok.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces)  # incomplete characters are held back


def test_engine_text_is_the_decode_of_its_tokens(tmp_path):
    target_dir, _ = model_with_tokenizer(tmp_path, "bytelevel", True)
    llm = LLM(str(target_dir), dtype="float32")
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    for out in llm.generate(TEXTS, params):
        assert out.text == llm.engine.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_exports_tokenize_as_the_gguf_file_does(tmp_path, add_bos):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.checkpoint.gguf import export_gguf
    from gguf_fixtures import VOCAB_SIZE, write_gguf

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    path = write_gguf(tmp_path / "m.gguf", LlamaForCausalLM(cfg).eval(), "llama", add_bos=add_bos)
    tok = load_tokenizer(export_gguf(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    text = "the other one, in there"
    assert tok.encode(text) == ref(text)["input_ids"] and (tok.encode(text)[0] == 1) is add_bos
    msgs = [{"role": "user", "content": "the answer"}]
    assert tok.encode_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert 2 in tok.eos_token_ids
