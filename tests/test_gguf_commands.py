"""A model given as a `.gguf` file works in the commands: generate, verify-lossless, draft-data and train-draft on a
tiny Llama GGUF written by the test (with a GQA drafter that shares its pages)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dspark.checkpoint.resolve import resolve_model_ref
from dspark.cli import main
from dspark.config import GQATargetConfig
from dspark.models.drafter import DSparkDrafter
from dspark.models.loading import save_drafter
from dspark.models.tiny import randomize_
from dspark.train.draft_config import draft_config_for
from gguf_fixtures import VOCAB_SIZE, write_gguf


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("DSPARK_CACHE", str(tmp / "cache"))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions (tied: the embedding too)
    path = write_gguf(tmp / "tiny.gguf", model, "llama")
    tcfg = GQATargetConfig.load(resolve_model_ref(path))
    drafter = DSparkDrafter(draft_config_for(tcfg, markov_rank=8, taps=(0, 2), mask_token_id=0))
    randomize_(drafter, 1)
    save_drafter(drafter, tmp / "draft", dtype="float32")
    yield path, tmp / "draft", tmp
    mp.undo()


def test_generate_on_a_gguf_matches_transformers_on_its_export(gguf_pair, capsys):
    path, draft, _ = gguf_pair
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 3})
    argv = ["generate", "the other", "--model", str(path), "--speculative-config", spec, "--no-chat-template"]
    assert main([*argv, "--max-tokens", "12", "--temperature", "0", "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    export = resolve_model_ref(path)
    tok = AutoTokenizer.from_pretrained(export)
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.tensor([tok("the other").input_ids])
    hf.generation_config.eos_token_id = 2
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert out["token_ids"] == ref[0, ids.shape[1] :].tolist()
    assert out["acceptance_length"] is not None


def test_verify_lossless_on_a_gguf(gguf_pair, capsys):
    path, draft, tmp = gguf_pair
    data = tmp / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the", "in there", "a re"]) + "\n")
    spec = json.dumps({"method": "dspark", "model": str(draft), "num_speculative_tokens": 3})
    argv = ["verify-lossless", "--dataset", str(data), "--model", str(path), "--speculative-config", spec]
    assert main([*argv, "--max-tokens", "10"]) == 0
    assert "3/3 prompts identical" in capsys.readouterr().out


def test_draft_data_and_train_draft_on_a_gguf(gguf_pair):
    path, _, tmp = gguf_pair
    corpus = tmp / "corpus"
    corpus.mkdir()
    doc = "".join(f"the other one in there {i}\n" for i in range(60))
    for split in ("train", "validation"):
        (corpus / f"{split}.jsonl").write_text(json.dumps({"path": f"{split}.txt", "text": doc}) + "\n")
    data, common = tmp / "data", ["--target", str(path)]
    argv = ["draft-data", *common, "--corpus-dir", str(corpus), "--out-dir", str(data), "--num-prompts", "4"]
    assert main([*argv, "--num-val-prompts", "1", "--max-new-tokens", "12", "--dtype", "float32", "--quiet"]) == 0
    train = ["train-draft", *common, "--data-dir", str(data), "--features", "online", "--max-steps", "1"]
    train += ["--batch-size", "2", "--num-anchors", "2", "--markov-rank", "8", "--quiet"]
    assert main([*train, "--out-dir", str(tmp / "trained")]) == 0
    config = json.loads((tmp / "trained" / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["num_key_value_heads"] == 2


def test_served_model_name_is_the_reference_as_given(gguf_pair):
    """`dspark serve --model X.gguf` (or an alias) answers to that name, not to the cache directory's."""
    from dspark.engine.engine import Engine
    from dspark.llm import build_engine
    from dspark.models.tiny import build_tiny_gqa_pair
    from dspark.serve.state import default_model_name

    path, _, _ = gguf_pair
    assert default_model_name(build_engine(path, None, dtype="float32", max_num_seqs=1)) == "tiny.gguf"
    target, _ = build_tiny_gqa_pair(0)
    assert default_model_name(Engine(target, model_ref="smollm2-135m-instruct")) == "smollm2-135m-instruct"
