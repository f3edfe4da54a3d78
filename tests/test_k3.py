"""Kimi K3's additions (SiTU, latent MoE, AttnRes, tap streams) against direct implementations of the formulas in
k3-mla-architecture.md §2.1, and the published K3 text config's roster."""

from importlib import resources

import pytest
import torch
import torch.nn.functional as F

from dspark.checkpoint.roster import num_params
from dspark.config import KimiLinearConfig
from dspark.models.k3 import K3MoE, situ
from dspark.models.kda import KDACache
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.loading import kimi_roster, load_kimi_linear, save_kimi_linear

V, D = 71, 32


def k3_config(
    block_size: int | None = 2, latent: int | None = 12, act: str = "situ", dense: bool = False
) -> KimiLinearConfig:
    d = {
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": 48,
        "moe_intermediate_size": 10,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "q_lora_rank": 12,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 6,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "hidden_act": act,
        "moe_latent_size": latent,
        "attn_res_block_size": block_size,
        "mlp_layer_types": ["dense"] * 6 if dense else None,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [4, 6],
            "kda_layers": [1, 2, 3, 5],
        },
    }
    return KimiLinearConfig.from_dict(d)


def random_model(cfg: KimiLinearConfig) -> KimiLinearTarget:
    model = KimiLinearTarget(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.2
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def test_situ_formula():
    g = torch.linspace(-40, 40, 801)[:, None]
    u = torch.linspace(-90, 90, 7)[None, :]
    direct = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ(g, u), direct, rtol=0, atol=1e-5)
    small = torch.linspace(-0.05, 0.05, 11)
    torch.testing.assert_close(situ(small, small), F.silu(small) * small, rtol=1e-2, atol=1e-6)  # ≈ SwiGLU near 0


def _direct_latent_moe(moe: K3MoE, x: torch.Tensor, cfg) -> torch.Tensor:
    """Token by token: sigmoid router + correction bias → top-k, renormalised, × scaling; experts on W_down x;
    y = W_up RMSNorm(Σ w_e E_e) + shared(x)."""
    out = []
    for xt in x:
        scores = torch.sigmoid(moe.gate.weight @ xt)
        chosen = (scores + moe.gate.e_score_correction_bias).topk(cfg.base.num_experts_per_tok).indices
        w = scores[chosen] / scores[chosen].sum() * cfg.base.routed_scaling_factor
        lat = moe.latent_down_proj.weight @ xt
        acc = torch.zeros_like(lat)
        for wi, e in zip(w, chosen.tolist()):
            ex = moe.experts[e]
            h = situ(ex.gate_proj.weight @ lat, ex.up_proj.weight @ lat)
            acc += wi * (ex.down_proj.weight @ h)
        normed = acc / torch.sqrt(acc.pow(2).mean() + cfg.base.rms_norm_eps) * moe.latent_norm.weight
        se = moe.shared_experts
        shared = se.down_proj.weight @ situ(se.gate_proj.weight @ xt, se.up_proj.weight @ xt)
        out.append(moe.latent_up_proj.weight @ normed + shared)
    return torch.stack(out)


def test_latent_moe_formula():
    cfg = k3_config()
    model = random_model(cfg)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, K3MoE) and moe.latent == 12
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = moe(x)
        want = _direct_latent_moe(moe, x.reshape(-1, D), cfg).view_as(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _mix(values, norm, proj, eps):
    """AttnRes: softmax_j ⟨RMSNorm_noweight(v_j), norm.weight ⊙ proj.weight⟩ over raw v_j, fp32."""
    w = norm.weight * proj.weight[0]
    scores = torch.stack([(v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)) @ w for v in values])
    p = scores.softmax(0)
    return sum(p[j, ..., None] * values[j] for j in range(len(values)))


def _direct_attn_res(model: KimiLinearTarget, ids: torch.Tensor, block: int):
    """The AttnRes forward written out: snapshots at l % block == 0, prefix restarts, mix before each sublayer."""
    eps = model.config.base.rms_norm_eps
    B, T = ids.shape
    cos, sin = model.rotary.cos_sin(torch.arange(T).expand(B, T))
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    blocks, prefix, prefixes = [], model.model.embed_tokens(ids), []
    for i, layer in enumerate(model.model.layers):
        if i % block == 0:
            blocks, prefix = blocks + [prefix], None
        vals = blocks + ([prefix] if prefix is not None else [])
        x = _mix(vals, layer.self_attention_res.norm, layer.self_attention_res.proj, eps)
        a = layer.attend(layer.input_layernorm(x), cos, sin, causal, None, None, None, False)
        prefix = a if prefix is None else prefix + a
        x = _mix(blocks + [prefix], layer.mlp_res.norm, layer.mlp_res.proj, eps)
        prefix = prefix + layer.mlp(layer.post_attention_layernorm(x))
        prefixes.append((prefix, sum(blocks) + prefix))
    out = _mix(blocks + [prefix], model.model.output_attn_res.norm, model.model.output_attn_res.proj, eps)
    return model.compute_logits(model.model.norm(out)), prefixes


@pytest.mark.parametrize("block", [1, 2, 4])
def test_attn_res_formula_and_tap_streams(block):
    cfg = k3_config(block_size=block)
    model = random_model(cfg)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, streams = _direct_attn_res(model, ids, block)
        prefix = model(ids, tap_layers=(0, 2, 5))
        residual = model(ids, tap_layers=(0, 2, 5), tap_stream="residual")
    torch.testing.assert_close(prefix.logits, logits, rtol=1e-4, atol=1e-4)
    assert cfg.tap_streams[0] == "prefix"  # K3's default stream
    for taps, which in ((prefix.taps, 0), (residual.taps, 1)):
        for t, i in zip(taps.split(D, -1), (0, 2, 5)):
            torch.testing.assert_close(t, streams[i][which], rtol=1e-4, atol=1e-4)


def test_prefix_stream_needs_attn_res():
    model = random_model(k3_config(block_size=None))
    assert model.config.tap_streams == ("residual",)
    with pytest.raises(ValueError, match="AttnRes"):
        model(torch.zeros(1, 3, dtype=torch.long), tap_layers=(1,), tap_stream="prefix")


def test_k3_incremental_equals_whole_and_roundtrip(tmp_path):
    model = random_model(k3_config())
    ids = torch.randint(0, V, (1, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(ids).logits
        latents, states, rows = _Latents(), KDACache(), []
        for s, e in ((0, 6), (6, 7), (7, 13)):
            pos = torch.arange(s, e)[None]
            mask = torch.arange(e)[None, None] <= pos[:, :, None]
            rows.append(model(ids[:, s:e], pos, mask, store=latents, states=states).logits)
    torch.testing.assert_close(torch.cat(rows, 1), whole, rtol=1e-4, atol=1e-4)
    save_kimi_linear(model, tmp_path)
    again = load_kimi_linear(tmp_path)
    assert again.config == model.config
    with torch.no_grad():
        assert torch.equal(again(ids).logits, whole)


class _Latents:
    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def update(self, layer, latent):
        self.rows[layer] = latent if layer not in self.rows else torch.cat((self.rows[layer], latent), 1)
        return self.rows[layer]


def test_published_k3_text_config_roster():
    path = resources.files("dspark") / "assets" / "formats" / "kimi-k3-text.config.json"
    cfg = KimiLinearConfig.load(str(path))
    assert (len(cfg.kda_layers), len(cfg.mla_layers)) == (69, 24)
    assert cfg.mla_layers[-2:] == (91, 92)  # every 4th (1-based) and the last
    roster = kimi_roster(cfg)
    n = num_params(roster)
    assert 2.7e12 < n < 2.85e12  # "2.8 T total" (reference §2.1); 2,773,578,764,896 with our [U] name choices
    assert n == 2_773_578_764_896
    assert roster["model.layers.3.self_attn.g_proj.weight"].shape == (12288, 7168)  # MLA output gate
    assert roster["model.layers.1.block_sparse_moe.experts.895.w1.weight"].shape == (3072, 3584)  # latent experts
    assert roster["model.layers.0.self_attention_res_norm.weight"].shape == (7168,)


def test_drafter_tap_stream_key():
    from dspark.config import ConfigError, DraftConfig

    path = resources.files("dspark") / "assets" / "formats" / "kimi-k3-dspark.config.json"
    official = DraftConfig.load(str(path))
    assert official.aux_hidden_stream is None  # Inferact's draft: the target's default ("prefix" on K3)
    d = official.to_dict()
    assert DraftConfig.from_dict(d | {"aux_hidden_stream": "residual"}).aux_hidden_stream == "residual"
    with pytest.raises(ConfigError, match="aux_hidden_stream"):
        DraftConfig.from_dict(d | {"aux_hidden_stream": "attn_res"})
