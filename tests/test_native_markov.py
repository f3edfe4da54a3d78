"""The native Markov greedy loop (``markov_greedy``, dspark/native/markov.cpp) against the head's serial path: the
same drafts for every request of a batch, over the full vocabulary and a reduced one, in fp32, in bf16, and for an
fp32 W2 that holds only bf16 values (served from a bf16 copy); ties go to the first index, as
torch.argmax's do."""

import pytest
import torch

from dspark import native
from dspark.models.heads import MarkovHead

pytestmark = pytest.mark.skipif(native.ops() is None, reason="native kernels unavailable")

V, R, D, K, B = 300, 24, 16, 7, 5


def _head(dtype: torch.dtype, bf16_values: bool = False) -> MarkovHead:
    torch.manual_seed(0)
    head = MarkovHead(V, R, D)
    with torch.no_grad():
        head.markov_w1.weight.normal_(0, 1.0)
        head.markov_w2.weight.normal_(0, 0.5)
        if bf16_values:
            head.markov_w2.weight.copy_(head.markov_w2.weight.bfloat16().float())
    return head.to(dtype)


def _reference(head, base, anchor, w2=None, ids=None) -> torch.Tensor:
    def pick(corrected, k):
        index = corrected.argmax(-1)
        return index if ids is None else ids[index]

    hidden = base.new_zeros(base.shape[0], base.shape[1], D)
    return head.sample(base, hidden, anchor, pick, None, w2).tokens


@pytest.mark.parametrize("dtype,bf16_values", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_native_greedy_drafts_equal_the_serial_head(dtype, bf16_values):
    head = _head(dtype, bf16_values)
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(B, K, V, generator=g) * 3).to(dtype).float()
    anchor = torch.randint(0, V, (B,), generator=g)
    with torch.inference_mode():
        native_tokens = head.greedy_tokens(base, anchor)
        assert native_tokens is not None, "the native path must apply here"
        w2 = head._served(head.markov_w2.weight)
        assert w2.dtype == (torch.bfloat16 if bf16_values or dtype == torch.bfloat16 else torch.float32)
        assert torch.equal(native_tokens, _reference(head, base.to(dtype), anchor))
        for b in range(B):  # a request's drafts do not depend on the others
            assert torch.equal(head.greedy_tokens(base[b : b + 1], anchor[b : b + 1]), native_tokens[b : b + 1])


def test_native_greedy_over_a_reduced_vocabulary_maps_ids():
    head = _head(torch.float32)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:100].sort().values
    w2 = torch.nn.Linear(R, len(ids), bias=False)
    with torch.no_grad():
        w2.weight.copy_(head.markov_w2.weight[ids])
    g = torch.Generator().manual_seed(3)
    base = torch.randn(B, K, len(ids), generator=g) * 3
    anchor = torch.randint(0, V, (B,), generator=g)
    with torch.inference_mode():
        tokens = head.greedy_tokens(base, anchor, w2, ids)
        assert tokens is not None and bool(torch.isin(tokens, ids).all())
        assert torch.equal(tokens, _reference(head, base, anchor, w2, ids))


def test_native_greedy_ties_go_to_the_first_index():
    head = _head(torch.float32)
    with torch.no_grad():
        head.markov_w2.weight.zero_()  # no correction: the drafts are the base logits' argmax
    base = torch.zeros(2, K, V)
    for k in range(K):
        base[0, k, [40 + k, 70, 250 - k]] = 5.0  # three equal maxima, in different vector lanes
        base[1, k, [17 * k + 3, 17 * k + 19]] = 1.0
    with torch.inference_mode():
        tokens = head.greedy_tokens(base, torch.tensor([1, 2]))
    assert tokens[0].tolist() == [40 + k for k in range(K)]
    assert tokens[1].tolist() == [17 * k + 3 for k in range(K)]
