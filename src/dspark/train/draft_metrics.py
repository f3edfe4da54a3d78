"""Drafter training metrics: additive sums over micro-steps and ranks (all-reduced as one tensor), from which the
logged loss terms, per-slot acceptance and the probabilistic τ are derived."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.train.loss import DSparkLoss, LossWeights, position_weights


@dataclass
class MetricSums:
    """Additive sums (over micro-steps and ranks) from which step/eval metrics are derived."""

    K: int
    values: torch.Tensor = field(default=None)  # type: ignore[assignment]
    # layout: [w_sum, ce_num, l1_num, conf_num, blocks, tau_sum, kl_num, c_sum[K], count[K]]

    def __post_init__(self) -> None:
        if self.values is None:
            self.values = torch.zeros(7 + 2 * self.K, dtype=torch.float64)

    def add(self, res: DSparkLoss, eval_mask: torch.Tensor, weights: LossWeights, denom: torch.Tensor | float) -> None:
        """Accumulate one micro-batch. Tensor arithmetic only, on the batch's device (no host sync: an accelerator
        keeps running until ``summary`` reads the sums)."""
        K = self.K
        m = eval_mask.bool()
        if self.values.device != m.device:
            self.values = self.values.to(m.device)
        w = (position_weights(K, weights.decay_gamma, m.device) * m).sum().double()
        c = res.accept_target.double()
        blocks = m[..., 0]
        tau = ((1 + torch.cumprod(c, -1).sum(-1)) * blocks).sum()
        d = torch.as_tensor(denom, dtype=torch.float64, device=m.device)
        terms = torch.stack([res.ce.detach(), res.l1.detach(), res.confidence.detach(), res.kl.detach()]).double() * d
        head = torch.stack([w, terms[0], terms[1], terms[2], blocks.sum().double(), tau.double(), terms[3]])
        self.values += torch.cat([head, c.sum((0, 1)), m.sum((0, 1)).double()])

    def summary(self, weights: LossWeights) -> dict[str, Any]:
        K, v = self.K, self.values.cpu()
        w = max(float(v[0]), 1e-12)
        ce, l1, conf, kl = float(v[1]) / w, float(v[2]) / w, float(v[3]) / w, float(v[6]) / w
        loss = weights.ce * ce + weights.l1 * l1 + weights.confidence * conf + weights.kl * kl
        counts = v[7 + K :].clamp_min(1)
        return {
            "loss": round(loss, 5),
            "ce": round(ce, 5),
            "l1": round(l1, 5),
            "confidence": round(conf, 5),
            "kl": round(kl, 5),
            "accept_rate": [round(float(x), 4) for x in v[7 : 7 + K] / counts],
            "tau_probabilistic": round(float(v[5]) / max(float(v[4]), 1.0), 4),
            "supervised_slots": int(v[7 + K :].sum()),
        }
