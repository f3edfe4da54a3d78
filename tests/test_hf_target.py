"""Any HF causal LM as target: a tiny Qwen3 with a DeepSpec-format Qwen3DSpark drafter."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark.config import DraftConfig, EngineConfig, SpeculativeConfig
from dspark.engine.engine import Engine
from dspark.llm import LLM, build_engines, engine_configs
from dspark.models.drafter import DSparkDrafter
from dspark.models.hf_target import HFTarget
from dspark.models.loading import load_drafter, save_drafter
from dspark.models.tiny import mark_random_weights, randomize_
from dspark.sampling_params import SamplingParams


def tiny_qwen3(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(tmp_path / "qwen3")
    mark_random_weights(tmp_path / "qwen3")  # no tokenizer: random test weights run on bytes
    draft_cfg = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": 80,
            "rope_theta": 10000.0,  # the target's (Qwen3Config default); the doctor refuses a mismatch
            "num_target_layers": 4,
            "block_size": 7,
            "target_layer_ids": [0, 2],
            "mask_token_id": 3,
            "markov_rank": 8,
            "enable_confidence_head": True,
            "torch_dtype": "float32",
        }
    )
    drafter = DSparkDrafter(draft_cfg)
    randomize_(drafter, 4)
    save_drafter(drafter, tmp_path / "draft", dtype="float32")
    return tmp_path / "qwen3", tmp_path / "draft"


def test_taps_are_layer_outputs(tmp_path):
    target_dir, _ = tiny_qwen3(tmp_path)
    target = HFTarget.load(target_dir)
    ids = torch.tensor([[0, 5, 6, 7, 8]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        out = target(ids, pos, pos[:, None, :] <= pos[:, :, None], None, (0, 2), torch.tensor([[2, 3, 4]]))
        ref = target.model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0, 2:].float())
    torch.testing.assert_close(out.taps[0, 2:, :32], ref.hidden_states[1][0, 2:])
    torch.testing.assert_close(out.taps[0, 2:, 32:], ref.hidden_states[3][0, 2:])


def test_a_last_layer_tap_is_the_raw_layer_output_not_the_final_norm(tmp_path):
    target_dir, _ = tiny_qwen3(tmp_path)
    target = HFTarget.load(target_dir)
    ids = [[0, 5, 6, 7, 8], [0, 9, 10]]
    raw = []
    hook = target.model.model.layers[3].register_forward_hook(lambda m, a, out: raw.append(out))
    with torch.no_grad():
        ref = target.model(torch.tensor([ids[0]]), output_hidden_states=True)
    hook.remove()
    batch = torch.tensor([ids[0], ids[1] + [0, 0]])
    pos = torch.arange(5).expand(2, 5)
    mask = (pos[:, None, :] <= pos[:, :, None]) & torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None]
    with torch.no_grad():
        taps = target(batch, pos, mask, None, (-1, 3)).taps
    last = raw[0][0] if isinstance(raw[0], tuple) else raw[0]
    torch.testing.assert_close(taps[0, 1:, 32:], last[0, 1:])
    torch.testing.assert_close(taps[0, 1:, :32], target.model.model.embed_tokens(torch.tensor(ids[0][1:])))
    assert not torch.allclose(taps[0, 1:, 32:], ref.hidden_states[4][0, 1:])  # post-norm: not what a tap reads


@pytest.mark.parametrize("method", ["dspark", "dflash", "ngram"])
def test_hf_target_speculative_greedy_equals_target_only(tmp_path, method):
    """Native Qwen3 target (paged K/V shared with the DeepSpec drafter) and the transformers fallback (token
    pages, recompute) under the same engine: speculative greedy == target-only greedy == transformers generate."""
    target_dir, draft_dir = tiny_qwen3(tmp_path)
    spec = {"method": method, "model": str(draft_dir), "num_speculative_tokens": 4}
    spec_eng, ar_eng = build_engines(target_dir, [spec, None], *engine_configs(dtype="float32", max_num_seqs=4))
    assert spec_eng.cache_report()["target_page_kind"] == "gqa"
    fallback = HFTarget.load(target_dir)
    drafter = spec_eng.drafter and load_drafter(draft_dir, fallback)
    hf_eng = Engine(fallback, drafter, spec_eng.spec, EngineConfig(dtype="float32", max_num_seqs=4))
    assert hf_eng.cache_report()["target_page_kind"] == "tokens"
    prompts = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 9, 10], [0, 20]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM.from_engine(ar_eng).generate(prompts, params)]
    got = [o.token_ids for o in LLM.from_engine(spec_eng).generate(prompts, params)]
    assert got == ref
    assert [o.token_ids for o in LLM.from_engine(hf_eng).generate(prompts, params)] == ref
    with torch.no_grad():
        hf = target_dir and HFTarget.load(target_dir).model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False
        )
    assert hf[0, 4:].tolist() == ref[0]
    if method != "ngram":
        assert spec_eng.metrics.spec.num_drafts > 0


def test_drafter_of_another_page_width_gets_its_own_pool():
    """A drafter whose latent width differs from the target's cannot share its pages: it gets a second pool on the
    same block tables, and speculative greedy still equals target-only greedy."""
    from dataclasses import replace

    from dspark.models.tiny import build_tiny_pair, tiny_draft_config, tiny_target_config

    tcfg = tiny_target_config()
    target, _ = build_tiny_pair(0)
    drafter = DSparkDrafter(replace(tiny_draft_config(tcfg), kv_lora_rank=8))
    randomize_(drafter, 4)
    drafter.attach(target.embed_tokens, target.lm_head)
    spec = Engine(
        target, drafter, SpeculativeConfig(method="dspark", num_speculative_tokens=3), EngineConfig(dtype="float32")
    )
    rep = spec.cache_report()
    assert not rep["shared_pool"] and rep["draft_width"] == 8 + tcfg.qk_rope_head_dim != rep["target_width"]
    ar = Engine(target, None, None, EngineConfig(dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[0, 5, 6, 7], [0, 9, 10, 11, 12]]
    got = [o.token_ids for o in LLM.from_engine(spec).generate(prompts, params)]
    assert got == [o.token_ids for o in LLM.from_engine(ar).generate(prompts, params)]
    assert spec.metrics.spec.num_drafts > 0
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, None, SpeculativeConfig(method="dspark"), EngineConfig(dtype="float32"))
