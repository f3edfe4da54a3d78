"""Our MLA target vs transformers' DeepseekV3ForCausalLM on the same random weights (fp32)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from dspark.config import TargetConfig
from dspark.models.loading import load_target
from dspark.models.rope import RotaryEmbedding

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_config(q_lora_rank, yarn=True, topk_method="noaux_tc"):
    return DeepseekV3Config(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=3,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        kv_lora_rank=24,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        max_position_embeddings=128,
        rope_scaling=YARN if yarn else None,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attn_implementation="eager",
    )


def randomize(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


@pytest.fixture(params=[(16, True), (None, True), (16, False)], ids=["qlora-yarn", "noqlora-yarn", "qlora-rope"])
def pair(request, tmp_path):
    torch.manual_seed(0)
    q_lora, yarn = request.param
    hf = DeepseekV3ForCausalLM(hf_config(q_lora, yarn)).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = load_target(tmp_path, "float32")  # our strict loader reads what save_pretrained wrote
    assert set(ours.state_dict()) - {"rotary.inv_freq"} == set(load_file(tmp_path / "model.safetensors"))
    return hf, ours


@pytest.mark.parametrize("absorbed", [True, False])
def test_logits_and_taps_match_transformers(pair, absorbed):
    hf, ours = pair
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))  # past the 32-token window
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, tap_layers=(0, 1, 2), absorbed=absorbed)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=1e-4, atol=1e-4)
    taps = out.taps.split(48, dim=-1)
    for i, t in enumerate(taps):
        torch.testing.assert_close(t, ref.hidden_states[i + 1], rtol=1e-4, atol=1e-4)


def test_yarn_frequencies_match_transformers():
    hf = DeepseekV3ForCausalLM(hf_config(16, True)).eval()
    cfg = TargetConfig.from_dict(hf.config.to_dict())
    rot = RotaryEmbedding(cfg.rope)
    torch.testing.assert_close(rot.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=0, atol=1e-7)
    assert rot.magnitude == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert cfg.mla.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    pos = torch.tensor([[0, 31, 32, 100, 127]])  # inside and beyond original_max_position_embeddings
    x = torch.zeros(1, 5, 8)
    cos_ref, sin_ref = hf.model.rotary_emb(x, pos)
    cos, sin = rot.cos_sin(pos)
    torch.testing.assert_close(cos, cos_ref[..., :4].float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[..., :4].float(), rtol=1e-6, atol=1e-6)
