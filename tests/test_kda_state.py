"""KDA state slots and lossless rollback: after a verification round with rejections, each request's state is the
state of a fresh target-only run over the same accepted tokens (no rejected draft leaks into it)."""

import pytest
import torch

from dspark.cache.state import StatePool
from dspark.models.kda import KDACache, KDAState
from test_k3 import k3_config, random_model
from test_kimi_linear import Latents


def _forward(model, rows, starts, latents, states, lengths):
    B, T = len(rows), max(map(len, rows))
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        pos[b, : len(r)] = torch.arange(starts[b], starts[b] + len(r))
    S = max(s + len(r) for s, r in zip(starts, rows))
    mask = torch.arange(S)[None, None] <= pos[:, :, None]
    return model(ids, pos, mask, store=latents, states=states, lengths=lengths)


class RaggedLatents(Latents):
    """Contiguous latents per request (lists), padded into [B, S] for each forward; rollback = truncation."""

    def __init__(self, B: int) -> None:
        self.per_req: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]
        self.lengths: list[int] = []

    def update(self, layer, latent):
        S = max(self.starts[b] + n for b, n in enumerate(self.lengths))
        out = latent.new_zeros(latent.shape[0], S, latent.shape[-1])
        for b, n in enumerate(self.lengths):
            old = self.per_req[b].get(layer, latent.new_zeros(0, latent.shape[-1]))[: self.starts[b]]
            self.per_req[b][layer] = torch.cat((old, latent[b, :n]))
            out[b, : self.starts[b] + n] = self.per_req[b][layer]
        return out

    def set(self, starts, lengths):
        self.starts, self.lengths = starts, lengths
        return self


def _prefill_and_round(model, prompts, rounds, accepted, round_lengths=None):
    """Prefill the prompts (one batch), then verify ``rounds`` (ragged; valid rows ``round_lengths``, default all)
    keeping every row's state, and commit ``accepted``. Returns the state pool and the slots."""
    B = len(prompts)
    pool = StatePool(model.state_spec, num_slots=4)
    slots = torch.tensor([pool.acquire(f"r{b}") for b in range(B)])
    lat = RaggedLatents(B)
    lengths = torch.tensor([len(p) for p in prompts])
    prefill = pool.view(slots)
    _forward(model, prompts, [0] * B, lat.set([0] * B, lengths.tolist()), prefill, lengths)
    prefill.commit()
    before = pool.states.clone()
    starts = [len(p) for p in prompts]
    lengths = torch.tensor(round_lengths or [len(r) for r in rounds])
    view = pool.view(slots, keep_per_row=True)
    _forward(model, rounds, starts, lat.set(starts, [len(r) for r in rounds]), view, lengths)
    assert torch.equal(pool.states, before)  # verification writes nothing before commit
    view.commit(accepted)
    return pool, slots


@pytest.mark.parametrize("attn_res,moe", [(None, False), (2, False), (2, True)])
def test_state_after_rejections_equals_fresh_run(attn_res, moe):
    """Verify [anchor, d_1..d_L] (L = 5, 1, 3), accept 2, 0, 3 drafts. Every KDA state (recurrent matrices and conv
    tails) then equals, bit for bit in fp32, a target-only run of the same batch in which the rejected positions
    hold nothing (padding: the accepted tokens only), and, to fp32 rounding (another chunking), a fresh prefill of
    prompt + accepted. With MoE layers the expert GEMMs group the rows routed to each expert, so which other rows
    share an expert changes the last bits: there the first comparison is to 1e-5."""
    model = random_model(k3_config(block_size=attn_res, dense=not moe))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 71, (n,), generator=g).tolist() for n in (9, 6, 12)]
    rounds = [[7, 3, 9, 1, 4, 4], [2, 8], [5, 5, 6, 1]]
    accepted = torch.tensor([2, 0, 3])
    kept = [r[: n + 1] for r, n in zip(rounds, accepted.tolist())]
    with torch.no_grad():
        spec, slots = _prefill_and_round(model, prompts, rounds, accepted)
        padded = [k + [0] * (len(r) - len(k)) for k, r in zip(kept, rounds)]  # same shapes, rejected rows empty
        fresh, fslots = _prefill_and_round(model, prompts, padded, accepted, [len(k) for k in kept])
        leaky, _ = _prefill_and_round(model, prompts, rounds, torch.tensor([5, 1, 3]))
        for b in range(len(prompts)):
            whole = KDACache()
            model(torch.tensor([prompts[b] + kept[b]]), states=whole)
            for layer in range(spec.num_layers):
                state = whole.states[layer][0]
                torch.testing.assert_close(spec.states[layer, slots[b]], state, rtol=1e-3, atol=1e-3)
    tol = 1e-5 if moe else 0.0
    torch.testing.assert_close(spec.states[:, slots], fresh.states[:, fslots], rtol=0, atol=tol)
    # a leak would show: installing the state after a rejected draft differs
    assert not torch.allclose(leaky.states[:, slots[:2]], fresh.states[:, fslots[:2]], atol=1e-3)


def test_slots_are_reused_and_zeroed():
    model = random_model(k3_config(block_size=None))
    pool = StatePool(model.state_spec, num_slots=2)
    a = pool.acquire("a")
    pool.states[:, a] = 1.0
    assert pool.acquire("a") == a and pool.states[:, a].abs().sum() == 0  # recompute after preemption: zeros
    pool.acquire("b")
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.acquire("c")
    pool.release("a")
    assert pool.acquire("c") == a
    kda = model.config.kda
    per_layer = kda.num_heads * kda.head_dim**2 + (kda.conv_kernel_size - 1) * 3 * kda.num_heads * kda.head_dim
    assert pool.bytes_per_request == len(model.config.kda_layers) * per_layer * 4  # fp32


def test_pack_roundtrip():
    model = random_model(k3_config(block_size=None))
    kda = model.config.kda
    state = KDAState(
        torch.randn(2, 3, kda.conv_kernel_size - 1, 3 * kda.num_heads * kda.head_dim),
        torch.randn(2, 3, kda.num_heads, kda.head_dim, kda.head_dim),
    )
    flat = state.pack()
    assert flat.shape == (2, 3, kda.state_numel)
    back = KDAState.unpack(flat, kda, torch.float32)
    assert torch.equal(back.conv, state.conv) and torch.equal(back.recurrent, state.recurrent)
