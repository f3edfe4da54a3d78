"""`dspark roster` on target and draft configs (meta device, no weights allocated)."""

import json

import torch

from dspark.checkpoint.roster import module_roster, num_params
from dspark.cli import main
from dspark.config import TargetConfig
from dspark.models.loading import target_roster
from dspark.models.target import MLATarget
from dspark.models.tiny import tiny_target_config

K2 = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


def test_fast_roster_equals_module_roster():
    cfg = tiny_target_config()
    with torch.device("meta"):
        model = MLATarget(cfg)
    assert target_roster(cfg) == module_roster(model)


def test_kimi_k2_roster_matches_arithmetic(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(K2))
    assert main(["roster", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d, V, L = 7168, 163840, 61
    attn = d * 1536 + 1536 + 1536 * 64 * 192 + d * 576 + 512 + 512 * 64 * 256 + 64 * 128 * d
    norms = 2 * d
    dense = 3 * d * 18432
    moe = 384 * 3 * d * 2048 + 3 * d * 2048 + 384 * d + 384
    expected = 2 * V * d + d + L * (attn + norms) + dense + (L - 1) * moe
    assert out["num_params"] == expected == num_params(target_roster(TargetConfig.from_dict(K2)))
    assert len(out["tensors"]) == 3 + L * 9 + 3 + (L - 1) * (384 * 3 + 3 + 2)
    assert out["tensors"]["model.layers.60.mlp.experts.383.down_proj.weight"] == [7168, 2048]
