"""The Kimi Linear / Kimi K3 hybrid target: ``KDAConfig`` (one Kimi Delta Attention layer) and ``KimiLinearConfig``
(KDA and MLA layers, dense then MoE feed-forwards, and K3's additions: SiTU, latent experts, AttnRes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from dspark.config.common import ConfigKeys, as_is, fail, given, hf_keys, positive, read_config, require
from dspark.config.target import MLAConfig, TargetConfig

KIMI_LAYER_TYPES = ("linear_attention", "full_attention")
KIMI_MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class KDAConfig:
    """One Kimi Delta Attention layer's geometry (``linear_attn_config`` of a Kimi Linear config.json)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-5
    gate_lower_bound: float | None = None  # None: g = −e^A·softplus(·) (Kimi Linear); K3: g = lb·σ(e^A·(·)), lb −5
    chunk_size: int = 64  # rows per chunk of the chunkwise form
    decode_recurrent: bool = True  # one-row forwards use the recurrent form

    def __post_init__(self) -> None:
        positive(
            "linear_attn_config",
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            short_conv_kernel_size=self.conv_kernel_size,
            chunk_size=self.chunk_size,
        )
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise fail("linear_attn_config", "gate_lower_bound", self.gate_lower_bound, "must be negative or null")

    @property
    def state_numel(self) -> int:
        """Values per request per layer: the recurrent matrix per head + the conv tail."""
        width = self.num_heads * self.head_dim
        return self.num_heads * self.head_dim * self.head_dim + (self.conv_kernel_size - 1) * 3 * width


def _kimi_layer_types(d: Mapping[str, Any], n: int, source: str) -> tuple[str, ...]:
    """``layer_types``, else ``linear_attn_config.{kda_layers, full_attn_layers}`` (1-based), else every 4th."""
    lac = d.get("linear_attn_config") or {}
    types = d.get("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:
        types = [None] * n
        for key, kind in (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention")):
            for one_based in lac[key]:
                if not 1 <= int(one_based) <= n:
                    raise fail(source, f"linear_attn_config.{key}", one_based, f"layers are 1-based in [1, {n}]")
                types[int(one_based) - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in KIMI_LAYER_TYPES for t in types):
        raise fail(source, "layer_types", types, f"need {n} entries from {list(KIMI_LAYER_TYPES)}")
    return tuple(types)


def _kimi_mlp_types(d: Mapping[str, Any], n: int, source: str) -> tuple[str, ...]:
    types = d.get("mlp_layer_types")
    if types is None:
        first_dense = int(d.get("first_k_dense_replace", 1))
        types = ["dense" if i < first_dense else "sparse" for i in range(n)]
    if len(types) != n or any(t not in KIMI_MLP_TYPES for t in types):
        raise fail(source, "mlp_layer_types", types, f"need {n} entries from {list(KIMI_MLP_TYPES)}")
    return tuple(types)


def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first present key (HF attribute names and their aliases in saved configs)."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class KimiLinearConfig:
    """A ``kimi_linear`` config.json: KDA and MLA layers (``layer_types``), dense first layer(s) then MoE.

    ``base`` carries the MLA / MoE / embedding fields in TargetConfig form (shared with the MLA target's code);
    ``mlp_layer_types`` decides dense vs MoE per layer.
    """

    KEYS: ClassVar[ConfigKeys]  # the config.json keys it reads and lets pass (set below the class)
    base: TargetConfig
    kda: KDAConfig
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    mla_norm_eps: float = 1e-6  # q_a/kv_a layernorms (transformers' KimiLinearAttention builds them with 1e-6)
    # Kimi K3 additions (models/k3.py); off for Kimi Linear
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "situ"
    situ_betas: tuple[float, float] = (4.0, 25.0)
    moe_latent_size: int | None = None  # routed experts in a latent space of this width
    attn_res_block_size: int | None = None  # AttnRes replaces the residual stream

    def __post_init__(self) -> None:
        src = "kimi_linear config.json"
        n = self.base.num_hidden_layers
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise fail(src, "layer_types", self.layer_types, f"need {n} entries")
        if "sparse" in self.mlp_layer_types and not self.base.is_moe:
            raise fail(src, "num_experts", None, "sparse mlp_layer_types need experts")
        if self.hidden_act not in ("silu", "situ"):
            raise fail(src, "hidden_act", self.hidden_act, "use 'silu' or 'situ'")
        positive(src, moe_latent_size=self.moe_latent_size, attn_res_block_size=self.attn_res_block_size)
        if len(self.situ_betas) != 2 or min(self.situ_betas) <= 0:
            raise fail(src, "situ_betas", self.situ_betas, "two positive numbers (gate, up), K3: [4, 25]")

    @property
    def tap_streams(self) -> tuple[str, ...]:
        """Streams a drafter may tap; the first is the default (K3 / AttnRes: "prefix")."""
        return ("prefix", "residual") if self.attn_res_block_size else ("residual",)

    # TargetInfo (what the engine, tokenizer and doctor read) ---------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return self.base.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    @property
    def max_position_embeddings(self) -> int:
        return self.base.max_position_embeddings

    @property
    def bos_token_id(self) -> int | None:
        return self.base.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.base.pad_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.base.eos_token_ids

    @property
    def model_type(self) -> str:
        return "kimi_linear"

    @property
    def mla(self) -> MLAConfig:
        return replace(self.base.mla, rms_norm_eps=self.mla_norm_eps)

    def is_kda(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda(i))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_kda(i))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "kimi_linear config.json") -> KimiLinearConfig:
        if d.get("model_type") != "kimi_linear":
            raise fail(source, "model_type", d.get("model_type"), "the hybrid target reads 'kimi_linear' configs")
        n = int(require(d, "num_hidden_layers", source))
        # Kimi Linear's own names and defaults (transformers' KimiLinearConfig) for the fields TargetConfig holds
        base_keys = {
            "n_routed_experts": _first(d, "num_experts", "num_local_experts", "n_routed_experts"),
            "num_experts_per_tok": _first(d, "num_experts_per_token", "num_experts_per_tok"),
            "n_shared_experts": _first(d, "num_shared_experts", "n_shared_experts", default=1),
            "n_group": _first(d, "num_expert_group", "n_group", default=1),
            "norm_topk_prob": _first(d, "moe_renormalize", "norm_topk_prob", default=True),
            "max_position_embeddings": _first(d, "model_max_length", "max_position_embeddings", default=1048576),
            "first_k_dense_replace": 0,
            "routed_scaling_factor": d.get("routed_scaling_factor", 2.446),
            "rms_norm_eps": d.get("rms_norm_eps", 1e-5),
            "model_type": "deepseek_v3",
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        }
        act = d.get("hidden_act", cls.hidden_act)
        base = TargetConfig.from_dict({**d, **base_keys, "hidden_act": "silu"}, source)  # the FFN act is ours
        base = replace(base, model_type="kimi_linear", mla_use_nope=bool(d.get("mla_use_nope", True)))
        lac = d.get("linear_attn_config") or {}
        conv = KDAConfig.conv_kernel_size
        kda = KDAConfig(
            hidden_size=base.hidden_size,
            num_heads=int(_first(lac, "num_heads", default=d.get("linear_num_heads", 32))),
            head_dim=int(_first(lac, "head_dim", default=d.get("linear_head_dim", 128))),
            conv_kernel_size=int(_first(lac, "short_conv_kernel_size", default=d.get("linear_conv_kernel_dim", conv))),
            rms_norm_eps=base.rms_norm_eps,
            gate_lower_bound=lac.get("gate_lower_bound"),
        )
        return cls(
            base,
            kda,
            _kimi_layer_types(d, n, source),
            _kimi_mlp_types(d, n, source),
            hidden_act=act,
            **given(d, {"situ_betas": _floats, "moe_latent_size": as_is, "attn_res_block_size": as_is}),
        )

    @classmethod
    def load(cls, path: str | Path) -> KimiLinearConfig:
        return cls.from_dict(*read_config(path))

    def to_hf_dict(self) -> dict[str, Any]:
        d = self.base.to_hf_dict()
        for k in (
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "n_group",
            "first_k_dense_replace",
            "topk_method",
            "scoring_func",
            "rope_interleave",
        ):
            d.pop(k, None)
        d |= {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "num_experts": self.base.n_routed_experts,
            "num_experts_per_token": self.base.num_experts_per_tok,
            "num_shared_experts": self.base.n_shared_experts,
            "num_expert_group": self.base.n_group,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "linear_attn_config": {
                "num_heads": self.kda.num_heads,
                "head_dim": self.kda.head_dim,
                "short_conv_kernel_size": self.kda.conv_kernel_size,
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
            },
        }
        if self.kda.gate_lower_bound is not None:
            d["linear_attn_config"]["gate_lower_bound"] = self.kda.gate_lower_bound
        d["hidden_act"] = self.hidden_act
        if self.hidden_act == "situ":
            d["situ_betas"] = list(self.situ_betas)
        for key in ("moe_latent_size", "attn_res_block_size"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


KimiLinearConfig.KEYS = hf_keys(
    TargetConfig.KEYS.read
    | {"num_experts", "num_local_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group",
       "moe_renormalize", "model_max_length", "linear_attn_config", "linear_num_heads", "linear_head_dim",
       "linear_conv_kernel_dim", "layer_types", "mlp_layer_types", "situ_betas", "moe_latent_size",
       "attn_res_block_size"},
    # Moonshot's Kimi Linear config.json keys dspark does not need (MTP layers, router details it fixes)
    TargetConfig.KEYS.passed
    | {"moe_layer_freq", "moe_router_activation_func", "use_grouped_topk", "num_nextn_predict_layers"},
)  # fmt: skip
