"""Our hybrid KDA + MLA target vs transformers' KimiLinearForCausalLM, and the KDA forms against each other."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import KimiLinearConfig as HFKimiConfig
from transformers import KimiLinearForCausalLM

from dspark.config import KimiLinearConfig
from dspark.models.kda import KDACache, kda_chunked, kda_recurrent, l2_normalize
from dspark.models.kimi_linear import KimiLinearTarget
from dspark.models.loading import kimi_roster, load_kimi_linear, save_kimi_linear

V, D = 89, 40


class Latents:
    """A contiguous per-batch latent store (tests only): keeps every MLA layer's rows in order."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def update(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        old = self.rows.get(layer)
        self.rows[layer] = latent if old is None else torch.cat((old, latent), 1)
        return self.rows[layer]


def hf_config(layer_spec: str = "lac", q_lora_rank=None, n_group=1) -> HFKimiConfig:
    lac = {"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 4}
    kw = {}
    if layer_spec == "lac":  # layer types from linear_attn_config (1-based), as Moonshot's config.json has them
        lac |= {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]}
    else:
        kw["layer_types"] = [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ]
    return HFKimiConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=56,
        moe_intermediate_size=12,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=6,
        qk_nope_head_dim=10,
        v_head_dim=8,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=n_group,
        topk_group=1,
        routed_scaling_factor=1.7,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config=lac,
        attn_implementation="eager",
        **kw,
    )


def randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the FLA initialisation (meaningful decay rates)
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


@pytest.fixture(params=["lac", "layer_types-qlora"])
def pair(request, tmp_path):
    torch.manual_seed(0)
    spec = request.param
    hf = KimiLinearForCausalLM(hf_config(spec.split("-")[0], 12 if "qlora" in spec else None)).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = load_kimi_linear(tmp_path, "float32")  # strict: every tensor save_pretrained wrote, nothing else
    assert set(kimi_roster(ours.config)) == set(load_file(tmp_path / "model.safetensors"))
    return hf, ours


def test_layer_types_from_either_key():
    a = KimiLinearConfig.from_dict(hf_config("lac").to_dict())
    b = KimiLinearConfig.from_dict({**hf_config("lac").to_dict(), "layer_types": None})
    assert a.layer_types == b.layer_types == ("linear_attention",) * 3 + ("full_attention", "linear_attention")
    assert a.mlp_layer_types == ("dense",) + ("sparse",) * 4
    assert a.kda_layers == (0, 1, 2, 4) and a.mla_layers == (3,)


@pytest.mark.parametrize("absorbed", [True, False])
def test_logits_and_taps_match_transformers(pair, absorbed):
    hf, ours = pair
    ids = torch.randint(3, V, (2, 75), generator=torch.Generator().manual_seed(1))  # > one 64-row chunk
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = ours(ids, tap_layers=(0, 1, 2, 3), absorbed=absorbed)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=1e-4, atol=1e-4)
    for i, t in enumerate(out.taps.split(D, dim=-1)):  # HF hidden_states[i + 1] = output of layer i
        torch.testing.assert_close(t, ref.hidden_states[i + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1], rtol=1e-4, atol=1e-4)  # HF's last is post-norm


def _greedy(model: KimiLinearTarget, ids: torch.Tensor, steps: int) -> torch.Tensor:
    latents, states = Latents(), KDACache()
    out = model(ids, store=latents, states=states)
    seq, pos = ids, ids.shape[1]
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat((seq, nxt), 1)
        positions = torch.full_like(nxt, pos)
        mask = torch.ones(ids.shape[0], 1, pos + 1, dtype=torch.bool)
        out = model(nxt, positions, mask, store=latents, states=states)
        pos += 1
    return seq


def test_greedy_token_for_token(pair):
    hf, ours = pair
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=14, do_sample=False, min_new_tokens=14)
        seq = _greedy(ours, ids, 14)
    assert torch.equal(seq, ref)


def _random_qkvgb(B=2, H=3, T=37, Dk=8, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, H, T, Dk, generator=g)) * Dk**-0.5
    k = l2_normalize(torch.randn(B, H, T, Dk, generator=g))
    v = torch.randn(B, H, T, Dv, generator=g)
    decay = -torch.rand(B, H, T, Dk, generator=g) * 0.7
    beta = torch.rand(B, H, T, generator=g)
    s0 = torch.randn(B, H, Dk, Dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_chunked_equals_recurrent(chunk):
    q, k, v, decay, beta, s0 = _random_qkvgb()
    o_ref, s_ref = kda_recurrent(q, k, v, decay, beta, s0)
    o, s, rows = kda_chunked(q, k, v, decay, beta, s0, chunk_size=chunk, keep_per_row=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    for t in (0, 4, 17, 36):  # the state after row t == the recurrent state after t+1 rows
        _, s_t = kda_recurrent(
            q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], decay[:, :, : t + 1], beta[:, :, : t + 1], s0
        )
        torch.testing.assert_close(rows[:, :, t], s_t, rtol=1e-5, atol=1e-5)


def _run_in_pieces(model: KimiLinearTarget, seqs: list[list[int]], cuts: list[list[int]]) -> list[torch.Tensor]:
    """Feed each row's tokens in pieces (ragged, right-padded batches); return each row's logits [len, V]."""
    latents, states = Latents(), KDACache()
    B, starts = len(seqs), [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(len(cuts[0])):
        pieces = [s[st : st + c[step]] for s, st, c in zip(seqs, starts, cuts)]
        T, S = max(map(len, pieces)), max(st + c[step] for st, c in zip(starts, cuts))
        ids = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        for b, p in enumerate(pieces):
            ids[b, : len(p)] = torch.tensor(p)
            positions[b, : len(p)] = torch.arange(starts[b], starts[b] + len(p))
        lengths = torch.tensor([len(p) for p in pieces])
        # the contiguous test store holds max-width rows: keys beyond a row's length are padding, masked
        mask = torch.arange(S)[None, None] <= positions[:, :, None]
        out = model(ids, positions, mask, store=_Aligned(latents, starts, lengths, S), states=states, lengths=lengths)
        for b, p in enumerate(pieces):
            logits[b].append(out.logits[b, : len(p)])
            starts[b] += len(p)
    return [torch.cat(x) for x in logits]


class _Aligned:
    """Latent store for ragged batches: row b's new latents go to positions start_b.. of a [B, S_max] buffer."""

    def __init__(self, latents: Latents, starts, lengths, S) -> None:
        self.latents, self.starts, self.lengths, self.S = latents, starts, lengths, S

    def update(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        old = self.latents.rows.get(layer)
        buf = latent.new_zeros(latent.shape[0], self.S, latent.shape[-1])
        if old is not None:
            buf[:, : old.shape[1]] = old[:, : self.S]
        for b, (s, n) in enumerate(zip(self.starts, self.lengths.tolist())):
            buf[b, s : s + n] = latent[b, :n]
        self.latents.rows[layer] = buf
        return buf


@pytest.mark.parametrize("decode_recurrent", [True, False])
def test_prefill_in_chunks_equals_one_chunk(pair, decode_recurrent):
    _, ours = pair
    for layer in ours.model.layers:  # both one-row paths: the recurrent loop and a one-row chunk
        if layer.is_kda:
            layer.self_attn.cfg = replace(layer.self_attn.cfg, decode_recurrent=decode_recurrent)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, V, (n,), generator=g).tolist() for n in (23, 17)]
    with torch.no_grad():
        whole = [ours(torch.tensor([s])).logits[0] for s in seqs]
        pieces = _run_in_pieces(ours, seqs, [[7, 1, 1, 9, 5], [3, 6, 1, 1, 6]])
    for w, p in zip(whole, pieces):
        torch.testing.assert_close(p, w, rtol=1e-4, atol=1e-4)


def test_save_and_reload_roundtrip(pair, tmp_path):
    _, ours = pair
    save_kimi_linear(ours, tmp_path / "again")
    again = load_kimi_linear(tmp_path / "again")
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)
    assert KimiLinearConfig.load(tmp_path / "again") == ours.config


def test_roster_per_kind_equals_full_model(pair):
    from dspark.checkpoint.roster import module_roster
    from dspark.models.loading import _kimi_rename

    _, ours = pair
    full = module_roster(ours, rename=_kimi_rename(ours.config))
    fast = kimi_roster(ours.config)
    assert fast == full  # same names and shapes (buffers come after parameters in a module roster)
