"""Small building blocks shared by the target and the drafter: RMSNorm, SwiGLU MLP, attention masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 and cast back (as DeepSeek/HF do)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) · up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """q_positions [B, T], k_positions [B, S] → bool [B, T, S], True where key position <= query position."""
    return k_positions[:, None, :] <= q_positions[:, :, None]


def no_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Padding query rows that see no key get to see every key (their output is ignored), so softmax is finite."""
    return mask | ~mask.any(-1, keepdim=True)
