"""DSpark loss against a naive per-element reference, and its training behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.train.loss import DSparkLoss, LossWeights, dspark_loss, position_weights


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def _naive(draft, target, conf, labels, mask, weights: LossWeights) -> dict[str, float]:
    """Pure-Python loops over every (b, a, k) slot."""
    B, A, K, V = draft.shape
    num = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    den = 0.0
    for b in range(B):
        for a in range(A):
            for k in range(K):
                if not mask[b, a, k]:
                    continue
                w = math.exp(-k / weights.decay_gamma)
                pd = _softmax(draft[b, a, k].tolist())
                pt = _softmax(target[b, a, k].tolist())
                ce = -math.log(pd[int(labels[b, a, k])])
                l1 = sum(abs(x - y) for x, y in zip(pd, pt))
                c = min(max(1.0 - 0.5 * l1, 0.0), 1.0)
                z = float(conf[b, a, k])
                bce = -(c * math.log(1 / (1 + math.exp(-z))) + (1 - c) * math.log(1 - 1 / (1 + math.exp(-z))))
                num["ce"] += w * ce
                num["l1"] += w * l1
                num["conf"] += w * bce
                den += w
    out = {key: value / den for key, value in num.items()}
    out["total"] = weights.ce * out["ce"] + weights.l1 * out["l1"] + weights.confidence * out["conf"]
    return out


def _case(seed: int, B: int = 2, A: int = 3, K: int = 4, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(B, A, K, V, generator=g, dtype=torch.float64) * 2
    target = torch.randn(B, A, K, V, generator=g, dtype=torch.float64) * 2
    conf = torch.randn(B, A, K, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A, K), generator=g)
    lengths = torch.randint(0, K + 1, (B, A), generator=g)
    mask = torch.arange(K).view(1, 1, K) < lengths.unsqueeze(-1)  # prefix masks, some empty
    mask[0, 0] = True
    return draft, target, conf, labels, mask


def test_loss_matches_naive_reference() -> None:
    weights = LossWeights(ce=0.3, l1=0.6, confidence=0.8, decay_gamma=4.0)
    for seed in range(3):
        draft, target, conf, labels, mask = _case(seed)
        out = dspark_loss(draft, target, conf, labels, mask, weights)
        ref = _naive(draft, target, conf, labels, mask, weights)
        assert out.ce.item() == pytest.approx(ref["ce"], rel=1e-5)
        assert out.l1.item() == pytest.approx(ref["l1"], rel=1e-5)
        assert out.confidence.item() == pytest.approx(ref["conf"], rel=1e-5)
        assert out.loss.item() == pytest.approx(ref["total"], rel=1e-5)
        assert out.num_supervised.item() == int(mask.sum())


def test_metrics_match_naive_reference() -> None:
    draft, target, conf, labels, mask = _case(5)
    out = dspark_loss(draft, target, conf, labels, mask)
    B, A, K, _ = draft.shape
    c = torch.zeros(B, A, K, dtype=torch.float64)
    for b in range(B):
        for a in range(A):
            for k in range(K):
                if mask[b, a, k]:
                    pd, pt = _softmax(draft[b, a, k].tolist()), _softmax(target[b, a, k].tolist())
                    c[b, a, k] = max(0.0, 1 - 0.5 * sum(abs(x - y) for x, y in zip(pd, pt)))
    for k in range(K):
        sel = mask[..., k]
        want = c[..., k][sel].mean().item() if sel.any() else 0.0
        assert out.accept_rate[k].item() == pytest.approx(want, abs=1e-6)
    taus = []
    for b in range(B):
        for a in range(A):
            if mask[b, a, 0]:
                surv, tau = 1.0, 1.0
                for k in range(K):
                    surv *= c[b, a, k].item()
                    tau += surv
                taus.append(tau)
    assert out.tau_probabilistic.item() == pytest.approx(sum(taus) / len(taus), rel=1e-6)
    assert torch.allclose(out.accept_target.double(), c, atol=1e-6)


def test_perfect_draft_has_zero_l1_and_full_acceptance() -> None:
    draft, _, conf, labels, mask = _case(1)
    out = dspark_loss(draft, draft.clone(), conf, labels, mask)
    assert out.l1.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(out.accept_target[mask], torch.ones(()).to(out.accept_target), atol=1e-6)
    K = draft.shape[2]
    present = mask.sum(dim=(0, 1)) > 0
    assert torch.allclose(out.accept_rate[present], torch.ones(int(present.sum())).to(out.accept_rate))
    # tau = 1 + (number of supervised slots) when every c* is 1.
    blocks = mask[..., 0]
    assert out.tau_probabilistic.item() == pytest.approx(1 + mask[blocks].sum().item() / blocks.sum().item())
    assert out.accept_rate.shape == (K,)


def test_position_weights_decay_as_exp_minus_k_over_gamma() -> None:
    w = position_weights(6, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-k / 4) for k in range(6)]))
    # Two supervised slots with known CE: slot 0 (CE = log V) and slot 1 (CE ~ 0).
    V = 5
    draft = torch.zeros(1, 1, 3, V)
    draft[0, 0, 1, 2] = 50.0
    labels = torch.tensor([[[0, 2, 0]]])
    mask = torch.tensor([[[True, True, False]]])
    out = dspark_loss(draft, draft, None, labels, mask, LossWeights(decay_gamma=4.0))
    w1 = math.exp(-1 / 4)
    assert out.ce.item() == pytest.approx((math.log(V) * 1.0 + 0.0 * w1) / (1.0 + w1), rel=1e-5)


def test_denominator_override_and_skipped_confidence() -> None:
    draft, target, conf, labels, mask = _case(2)
    weights = LossWeights()
    base = dspark_loss(draft, target, conf, labels, mask, weights)
    w_sum = (position_weights(draft.shape[2], 4.0) * mask.float()).sum()
    doubled = dspark_loss(draft, target, conf, labels, mask, weights, denominator=2 * w_sum)
    for field in ("loss", "ce", "l1", "confidence"):
        assert getattr(doubled, field).item() == pytest.approx(getattr(base, field).item() / 2, rel=1e-6)
    assert torch.equal(doubled.accept_rate, base.accept_rate)
    no_conf = dspark_loss(draft, target, None, labels, mask, weights)
    assert no_conf.confidence.item() == 0.0
    assert no_conf.loss.item() == pytest.approx(base.loss.item() - base.confidence.item(), rel=1e-6)
    zero_w = dspark_loss(draft, target, conf, labels, mask, LossWeights(confidence=0.0))
    assert zero_w.loss.item() == pytest.approx(no_conf.loss.item(), rel=1e-6)


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    draft, target, conf, labels, mask = _case(3)
    out = dspark_loss(draft, target, conf, labels, torch.zeros_like(mask))
    assert out.loss.item() == 0.0 and out.num_supervised.item() == 0


def test_unsupervised_slots_are_ignored_even_if_junk() -> None:
    draft, target, conf, labels, mask = _case(7)
    base = dspark_loss(draft, target, conf, labels, mask)
    junk_draft, junk_labels = draft.clone(), labels.clone()
    junk_draft[~mask] = float("nan")
    junk_labels[~mask] = -100
    out = dspark_loss(junk_draft, target, conf, junk_labels, mask)
    assert out.loss.item() == pytest.approx(base.loss.item(), rel=1e-12)
    assert torch.equal(out.accept_rate, base.accept_rate)


def test_chunked_checkpointed_path_matches_dense() -> None:
    draft, target, conf, labels, mask = _case(4, B=2, A=5, K=3, V=11)
    grads = []
    outs: list[DSparkLoss] = []
    for max_elems in (10**9, 2 * 3 * 11):  # dense; then chunks of 2 blocks with recomputation
        d = draft.clone().requires_grad_(True)
        c = conf.clone().requires_grad_(True)
        out = dspark_loss(d, target, c, labels, mask, max_chunk_elements=max_elems)
        out.loss.backward()
        grads.append((d.grad, c.grad))
        outs.append(out)
    assert outs[0].loss.item() == pytest.approx(outs[1].loss.item(), rel=1e-12)
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-12)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-12)


def test_bf16_inputs_are_computed_in_fp32() -> None:
    draft, target, conf, labels, mask = _case(6)
    ref = dspark_loss(draft.bfloat16().double(), target.bfloat16().double(), conf, labels, mask)
    out = dspark_loss(draft.bfloat16(), target.bfloat16(), conf.float(), labels, mask)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-4)


def test_one_optimizer_step_lowers_the_loss() -> None:
    torch.manual_seed(0)
    B, A, K, V, D = 2, 4, 3, 16, 8
    features = torch.randn(B, A, K, D)
    target = torch.randn(B, A, K, V) * 3
    labels = target.argmax(-1)
    mask = torch.ones(B, A, K, dtype=torch.bool)
    mask[1, 3, 1:] = False
    head = torch.nn.Linear(D, V)
    conf_head = torch.nn.Linear(D, 1)
    opt = torch.optim.SGD([*head.parameters(), *conf_head.parameters()], lr=0.5)

    def step() -> torch.Tensor:
        out = dspark_loss(head(features), target, conf_head(features).squeeze(-1), labels, mask)
        return out.loss

    before = step()
    opt.zero_grad()
    before.backward()
    assert head.weight.grad is not None and conf_head.weight.grad is not None
    assert head.weight.grad.abs().sum() > 0 and conf_head.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        after = step()
    assert after.item() < before.item() - 1e-3


def test_shape_errors_name_the_argument() -> None:
    draft, target, conf, labels, mask = _case(0)
    with pytest.raises(ValueError, match="target_logits"):
        dspark_loss(draft, target[..., :-1], conf, labels, mask)
    with pytest.raises(ValueError, match="eval_mask"):
        dspark_loss(draft, target, conf, labels, mask[:, :1])


# ---- forward KL and the reduced draft vocabulary ------------------------------------------------------------------


def _inputs(B=2, A=3, K=4, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft = torch.randn(B, A, K, V, generator=g, dtype=torch.float64)
    target = 2 * torch.randn(B, A, K, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A, K), generator=g)
    mask = torch.ones(B, A, K, dtype=torch.bool)
    mask[1, 2, 2:] = False
    return draft, target, labels, mask


def test_kl_term_is_the_forward_kl_and_pulls_up_underrated_tokens():
    draft, target, labels, mask = _inputs()
    res = dspark_loss(draft, target, None, labels, mask, LossWeights(ce=0, l1=0, confidence=0, kl=1.0))
    p_t, logp_d = target.softmax(-1), draft.log_softmax(-1)
    kl = (p_t * (p_t.log() - logp_d)).sum(-1)
    w = position_weights(4, 4.0).double() * mask
    assert res.kl.item() == pytest.approx(float((w * kl).sum() / w.sum()), rel=1e-9)
    d = draft.clone().requires_grad_(True)
    dspark_loss(d, target, None, labels, mask, LossWeights(ce=0, l1=0, confidence=0, kl=1.0)).loss.backward()
    expected = (d.detach().softmax(-1) - p_t) * (w / w.sum())[..., None]  # gradient q − p per slot
    torch.testing.assert_close(d.grad, expected)


def test_reduced_vocabulary_over_every_id_equals_the_full_loss():
    draft, target, labels, mask = _inputs()
    weights = LossWeights(kl=0.5)
    full = dspark_loss(draft, target, None, labels, mask, weights)
    order = torch.randperm(11, generator=torch.Generator().manual_seed(1))
    same = dspark_loss(draft[..., order], target, None, labels, mask, weights, vocab_ids=order)
    for name in ("loss", "ce", "l1", "kl", "tau_probabilistic"):
        torch.testing.assert_close(getattr(same, name), getattr(full, name), msg=name)


def test_reduced_vocabulary_acceptance_counts_the_target_mass_outside_it():
    draft, target, labels, mask = _inputs()
    ids = torch.tensor([0, 3, 4, 7, 9])
    small = draft[..., ids]
    res = dspark_loss(small, target, None, labels, mask, LossWeights(), vocab_ids=ids)
    q, p = small.softmax(-1), target.softmax(-1)[..., ids]
    accept = torch.minimum(q, p).sum(-1)  # the exact acceptance of a draft that can only propose the ids
    torch.testing.assert_close(res.accept_target, torch.where(mask, accept, 0.0))
    in_vocab = torch.isin(labels, ids) & mask
    index_of = torch.full((11,), 0, dtype=torch.long)
    index_of[ids] = torch.arange(5)
    ce = -small.log_softmax(-1).gather(-1, index_of[labels][..., None])[..., 0]
    w = position_weights(4, 4.0).double() * mask
    assert res.ce.item() == pytest.approx(float((w * ce * in_vocab).sum() / w.sum()), rel=1e-9)
    with pytest.raises(ValueError, match="reduced vocabulary"):
        dspark_loss(small, target[..., :6], None, labels, mask, vocab_ids=ids)
