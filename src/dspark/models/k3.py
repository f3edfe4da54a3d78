"""Kimi K3's additions to the Kimi Linear decoder (k3-mla-architecture.md §2.1), each behind a config key.

- SiTU (``hidden_act: "situ"``): act(g, u) = b_g·tanh(g/b_g)·σ(g) · b_u·tanh(u/b_u), betas (4, 25): a soft-capped
  SwiGLU used by the dense FFN and every expert.
- Latent MoE (``moe_latent_size``): x_lat = W_down x; routed experts (GLU, ``moe_intermediate_size``) run in the
  latent space on x_lat; their weighted sum is RMS-normalised and projected back, y = W_up RMSNorm(Σ w_e E_e(x_lat)).
  The router and the shared experts read the full hidden x (K3: shared experts fused, intermediate 2·3072).
- AttnRes (``attn_res_block_size``): replaces the residual stream. Every layer l adds its attention and FFN outputs
  to a running ``prefix``; at layers with l % block_size == 0 the incoming prefix is snapshotted into the block list
  (the embedding is the first snapshot) and the prefix restarts empty. Each sublayer's input (and the final norm's)
  is a softmax mix over [snapshots…, prefix]: score_j = ⟨RMSNorm(v_j), norm.weight ⊙ proj.weight⟩ (RMSNorm without
  weight), mix = Σ_j softmax(score)_j · v_j of the raw v_j, in fp32.
Names whose checkpoint spelling is not public yet ([U] in the reference) are ours: ``latent_down_proj``,
``latent_norm``, ``latent_up_proj``; the AttnRes ones follow the reference (``self_attention_res_{norm,proj}``,
``mlp_res_{norm,proj}``, ``output_attn_res_{norm,proj}``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dspark.native as native
from dspark.config import TargetConfig
from dspark.models.layers import RMSNorm, SwiGLU
from dspark.models.packing import Linear, version_of
from dspark.models.target import MoE, plain_weight, routed_experts
from dspark.profiling import scope


def situ(gate: torch.Tensor, up: torch.Tensor, betas: tuple[float, float] = (4.0, 25.0)) -> torch.Tensor:
    """SiTU: b_g·tanh(g/b_g)·σ(g) · b_u·tanh(u/b_u)."""
    bg, bu = betas
    return bg * torch.tanh(gate / bg) * torch.sigmoid(gate) * (bu * torch.tanh(up / bu))


class GatedMLP(SwiGLU):
    """down_proj(act(gate_proj(x), up_proj(x))) with act = SwiGLU's silu(g)·u or SiTU; SwiGLU's fused inference
    path (one gate|up GEMM, packed weights) with this activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, betas: tuple[float, float]) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.act, self.betas = act, betas

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ(gate, up, self.betas) if self.act == "situ" else F.silu(gate) * up

    def native_activation(self) -> tuple[int, float, float]:
        """``glu``'s and ``moe_rows``' activation: (0, -, -) silu·up or (1, b_g, b_u) SiTU."""
        return (1, *map(float, self.betas)) if self.act == "situ" else (0, 0.0, 0.0)


class K3MoE(MoE):
    """Routed experts (optionally in a latent space) + shared experts; the router is the MLA target's MoEGate.
    Inference runs the routed experts through the MLA target's stacked paths (``routed_experts``)."""

    def __init__(self, cfg: TargetConfig, act: str, betas: tuple[float, float], latent: int | None) -> None:
        super().__init__(cfg, lambda width, inter: GatedMLP(width, inter, act, betas), width=latent)
        D = cfg.hidden_size
        if latent:
            self.latent_down_proj = Linear(D, latent, bias=False)
            self.latent_norm = RMSNorm(latent, cfg.rms_norm_eps)
            self.latent_up_proj = Linear(latent, D, bias=False)
        self.latent = latent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] → [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])
        fused = self.native_forward(flat)  # the whole block in one native call (decode, verification)
        if fused is not None:
            return fused.view_as(x)
        with scope("moe.route"):
            idx, weights = self.gate(flat)  # [N, k]
        with scope("moe.experts"):
            inp = self.latent_down_proj(flat) if self.latent else flat
            stacked = self.stacked_experts()
            if stacked is None:
                routed = self._routed_loop(inp, idx, weights)
            else:
                routed = routed_experts(inp, idx, weights, self._stacked, stacked, self.experts[0].activate)
            out = self.latent_up_proj(self.latent_norm(routed)) if self.latent else routed
            if self.shared_experts is not None:
                out = out + self.shared_experts(flat)
        return out.view_as(x)

    def native_latent(self, dtype: torch.dtype) -> tuple | None:
        """``moe_rows``' latent arguments (down weight, norm weight, eps, up weight); None if they are not plain
        ``dtype`` weights (the module path then runs)."""
        if not self.latent:
            return (None, None, 0.0, None)
        down, up = plain_weight(self.latent_down_proj, dtype), plain_weight(self.latent_up_proj, dtype)
        norm = self.latent_norm
        if down is None or up is None or norm.weight.dtype != dtype:
            return None
        return (down, norm.weight, norm.eps, up)


class ResMix(nn.Module):
    """One AttnRes mixing point; holds ``{prefix}_norm`` and ``{prefix}_proj`` under the names the reference gives."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.proj = Linear(dim, 1, bias=False)

    def forward(self, values: list[torch.Tensor]) -> torch.Tensor:
        """values: J tensors [B, T, D] → Σ_j softmax_j(⟨RMSNorm(v_j), norm.weight ⊙ proj.weight⟩)·v_j [B, T, D].
        Inference with the native kernels runs it as one call (``res_mix``, dspark/native/resmix.cpp)."""
        ops = native.inference_ops()
        if ops is not None and all(v.dtype == values[0].dtype and v.shape == values[0].shape for v in values):
            return ops.res_mix(values, self._mix_weight(), self.norm.eps)
        v = torch.stack(values).float()  # [J, B, T, D]
        unit = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        scores = unit @ (self.norm.weight.float() * self.proj.weight.float()[0])  # [J, B, T]
        mixed = (scores.softmax(0)[..., None] * v).sum(0)
        return mixed.to(values[0].dtype)

    def _mix_weight(self) -> torch.Tensor:
        """norm.weight ⊙ proj.weight in fp32, cached until either changes (pointer, dtype, in-place version)."""
        n, p = self.norm.weight, self.proj.weight
        key = (n.data_ptr(), n.dtype, version_of(n), p.data_ptr(), p.dtype, version_of(p))
        cached = self.__dict__.get("_mix_cache")
        if cached is None or cached[0] != key:
            cached = (key, self.norm.weight.float() * self.proj.weight.float()[0])
            self.__dict__["_mix_cache"] = cached
        return cached[1]


class ResidualStream:
    """The classic residual stream h (every sublayer adds its output); taps: "residual" = h after the layer."""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.h = embedding

    def enter_layer(self, layer: int) -> None:
        pass

    def input(self, mix: ResMix | None) -> torch.Tensor:
        return self.h

    def add(self, out: torch.Tensor) -> None:
        self.h = self.h + out

    def tap(self, stream: str) -> torch.Tensor:
        if stream != "residual":
            raise ValueError(f"tap stream {stream!r} needs an AttnRes target; this target has only 'residual'")
        return self.h

    def output(self, mix: ResMix | None) -> torch.Tensor:
        return self.h


class AttnResStream(ResidualStream):
    """The AttnRes state of one forward: completed block snapshots and the running prefix (None = empty).

    Taps: "prefix" = the prefix sum after the layer (Inferact's K3 DSpark), "residual" = embedding + every
    sublayer output so far (what a residual network would carry)."""

    def __init__(self, embedding: torch.Tensor, block_size: int) -> None:
        self.blocks: list[torch.Tensor] = []
        self.prefix: torch.Tensor | None = embedding
        self.block_size = block_size

    def enter_layer(self, layer: int) -> None:
        if layer % self.block_size == 0:
            assert self.prefix is not None
            self.blocks.append(self.prefix)
            self.prefix = None

    def values(self) -> list[torch.Tensor]:
        return self.blocks + ([] if self.prefix is None else [self.prefix])

    def input(self, mix: ResMix | None) -> torch.Tensor:
        assert mix is not None
        return mix(self.values())

    def add(self, out: torch.Tensor) -> None:
        self.prefix = out if self.prefix is None else self.prefix + out

    def tap(self, stream: str) -> torch.Tensor:
        if stream == "prefix":
            assert self.prefix is not None
            return self.prefix
        if stream == "residual":
            return torch.stack(self.values()).sum(0)
        raise ValueError(f"tap stream {stream!r} is unknown; use 'prefix' or 'residual'")

    def output(self, mix: ResMix | None) -> torch.Tensor:
        return self.input(mix)
