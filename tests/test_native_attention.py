"""The native paged attention (dspark/native/attention.cpp): one-token decode in reduced precision reads keys and
values where they lie in the pool. Oracles: fp64 attention over the gathered rows (the kernel is within its dtype's
output rounding of it, hidden keys never count), and a GQA target's decode logits with the kernel vs torch's
attention (bf16: within bf16 noise; fp32 never takes the kernel, so the reference stays bit for bit)."""

from __future__ import annotations

import pytest
import torch

from dspark import native
from dspark.cache.pool import BatchStore
from dspark.models.tiny import build_tiny_gqa_pair

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels could not be built here")


def reference(q, plane, slots, bias, n_kv, v_off, scale):
    """fp64 attention over the gathered rows: q [B, H, T, d], plane [N, W], slots [B, S], bias [B, T, S]."""
    B, H, T, d = q.shape
    rows = plane[slots].double()  # [B, S, W]
    k = rows[..., : n_kv * d].unflatten(-1, (n_kv, d)).transpose(1, 2)  # [B, n_kv, S, d]
    v = rows[..., v_off : v_off + n_kv * d].unflatten(-1, (n_kv, d)).transpose(1, 2)
    k, v = k.repeat_interleave(H // n_kv, 1), v.repeat_interleave(H // n_kv, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale + bias[:, None].double()
    return scores.softmax(-1) @ v


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 3])
def test_kernel_is_attention_over_the_slots_within_one_output_rounding(dtype, T) -> None:
    g = torch.Generator().manual_seed(0)
    B, S, n_kv, group, d = 3, 37, 2, 3, 16
    H, W = n_kv * group, 2 * n_kv * d
    plane = torch.randn(200, W, generator=g).to(dtype)
    slots = torch.randperm(200, generator=g)[: B * S].view(B, S)
    q = torch.randn(B, H, T, d, generator=g).to(dtype)
    visible = torch.rand(B, T, S, generator=g) < 0.7
    visible[:, :, 0] = True
    visible[2, :, 20:] = False  # a shorter sequence: its padded keys hold garbage
    plane[slots[2, 20:]] = float("nan") if dtype != torch.float16 else 6e4
    bias = torch.zeros(B, T, S).masked_fill(~visible, float("-inf"))
    got = native.ops().paged_attention(q, plane, slots, bias, n_kv, 0, n_kv * d, d, 0.25)
    want = reference(q, plane.nan_to_num(0.0).where(~plane.isnan(), 0.0), slots, bias, n_kv, n_kv * d, 0.25)
    assert got.dtype == dtype and got.shape == (B, H, T, d)
    assert torch.isfinite(got).all()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=4 * eps * float(want.abs().max()))


@needs_native
def test_kernel_refuses_bad_inputs_with_a_message() -> None:
    q = torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16)
    plane = torch.zeros(8, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        slots, bias = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 1, 3)
        native.ops().paged_attention(q, plane, slots, bias, 1, 0, 8, 4, 1.0)


def decode_logits(target, pool, B, P, ids, lengths):
    """Prefill P rows per sequence into pool slots b·32 + p, then one decode step over the first ``lengths[b]``
    rows (the rest of the S = P + 1 read slots are padding, hidden) → logits of the decode row."""
    write = torch.arange(P)[None] + 32 * torch.arange(B)[:, None]
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    target(ids[:, :P], positions=torch.arange(P).expand(B, P), mask=causal, cache=BatchStore(pool, write, write))
    new = torch.tensor([[32 * b + lengths[b]] for b in range(B)])
    read = torch.arange(P + 1)[None] + 32 * torch.arange(B)[:, None]
    read = torch.where(torch.arange(P + 1)[None] <= torch.tensor(lengths)[:, None], read, 32 * B)  # pad → scratch
    mask = (torch.arange(P + 1)[None] <= torch.tensor(lengths)[:, None])[:, None]
    pos = torch.tensor(lengths)[:, None]
    out = target(ids[:, P : P + 1], positions=pos, mask=mask, cache=BatchStore(pool, new, read))
    return out.logits[:, -1].float()


@needs_native
def test_a_gqa_target_attends_alike_with_the_kernel_in_every_dtype(monkeypatch) -> None:
    calls = []
    real = BatchStore.paged_attention
    monkeypatch.setattr(BatchStore, "paged_attention", lambda self, *a: calls.append(1) or real(self, *a))
    base, _ = build_tiny_gqa_pair(0)
    B, P = 3, 12
    ids = torch.randint(5, base.config.vocab_size, (B, P + 1), generator=torch.Generator().manual_seed(1))
    lengths = [12, 9, 5]  # a decode row reads its own rows 0..len-1 plus the new one

    def run(dtype, on):
        monkeypatch.setenv(native.ENV, "1" if on else "0")
        target = base.to(dtype).eval()
        fmt = target.page_format
        pool = torch.zeros(fmt.num_layers, 32 * B + 32, fmt.width, dtype=dtype)
        with torch.inference_mode():
            return decode_logits(target, pool, B, P, ids, lengths)

    ref32 = run(torch.float32, False)
    assert not calls
    # fp32 takes the kernel too (the prefill and the decode step): torch's sums in another order
    torch.testing.assert_close(run(torch.float32, True), ref32, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * base.config.num_hidden_layers
    calls.clear()
    with_kernel, without = run(torch.bfloat16, True), run(torch.bfloat16, False)
    assert len(calls) == 2 * base.config.num_hidden_layers  # every layer of the prefill and the decode step
    noise = (without - ref32).abs().max()  # bf16's own distance from the fp32 reference
    assert (with_kernel - without).abs().max() <= 2 * noise + 1e-3
    assert (with_kernel.argmax(-1) == without.argmax(-1)).float().mean() >= 2 / 3
