"""Steps 2 to 4 of the doctor, the draft against its target: the tapped layers lie inside the target, the taps are
as wide as the target's hidden state, the draft's cache rows fit the target's latent pages, the rotary (YaRN)
parameters are the target's, and the confidence and Markov head tensors match what config.json enables."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark.checkpoint.io import Problem
from dspark.config import RopeConfig
from dspark.doctor.context import Context, as_int
from dspark.models.families import MLA, is_gqa_drafter

YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "rope_theta",
)


def _rope(d: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(uses YaRN, {key: value}) with the defaults the config classes use for absent keys."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        params = {}
    kind = params.get("rope_type", params.get("type", "default"))
    values: dict[str, Any] = {}
    for key in YARN_KEYS:
        if key == "rope_theta":
            value = params.get("rope_theta", d.get("rope_theta", RopeConfig.theta))
        else:
            value = params.get(key, getattr(RopeConfig, key))
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = float(value)
        values[key] = value
    return kind in ("yarn", "deepseek_yarn"), values


def _plain_rope_problems(src: Path, d_yarn: bool, d: dict[str, Any], t: dict[str, Any]) -> list[Problem]:
    """The target rotates without YaRN: the draft must not scale, and rope_theta must be the target's."""
    if d_yarn and d["factor"] != 1.0:
        return [
            Problem(
                f"{src} uses YaRN (factor {d['factor']}) but the target does not",
                f"set rope_parameters in {src} to the target's: {json.dumps({'rope_type': 'default'} | t)}",
            )
        ]
    if d["rope_theta"] != t["rope_theta"]:
        return [
            Problem(
                f"rope_theta differs: draft {d['rope_theta']!r} vs target {t['rope_theta']!r}",
                f"set rope_theta = {t['rope_theta']!r} in {src} (the draft rotates positions as the target does)",
            )
        ]
    return []


def check_yarn(ctx: Context) -> list[Problem]:
    """The draft's rotary parameters are the target's: every YaRN key when the target uses YaRN (factor,
    original_max_position_embeddings, betas, mscales, rope_theta), else rope_theta and no scaling."""
    t = ctx.target()
    raw = ctx.raw()
    t_yarn, t_vals = _rope(t)
    d_yarn, d_vals = _rope(raw)
    src = ctx.draft_dir / "config.json"
    if not t_yarn:
        return _plain_rope_problems(src, d_yarn, d_vals, t_vals)
    if not d_yarn:
        return [
            Problem(
                f"the target uses YaRN (factor {t_vals['factor']}) but {src} does not "
                "(rope_parameters.rope_type is not 'yarn')",
                f"copy the target's rope_parameters into {src}: {json.dumps(t_vals)}",
            )
        ]
    return [
        Problem(
            f"YaRN {key} differs: draft {d_vals[key]!r} vs target {t_vals[key]!r}",
            f"set rope_parameters.{key} = {t_vals[key]!r} in {src} (the draft must use the target's YaRN parameters)",
        )
        for key in YARN_KEYS
        if d_vals[key] != t_vals[key]
    ]


def check_target_layer_ids(ctx: Context) -> list[Problem]:
    """target_layer_ids are strictly increasing, inside the target's depth, and not its last layer."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    ids = raw.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or any(as_int(i) is None for i in ids):
        return [
            Problem(
                f"{src}: target_layer_ids = {ids!r} must be a non-empty list of integers",
                "set target_layer_ids to the target layers the draft was trained on (Kimi-K3-DSpark: "
                "[2, 23, 47, 71, 89])",
            )
        ]
    problems = []
    gqa = is_gqa_drafter(raw)
    declared = as_int(raw.get("num_target_layers" if gqa else "target_num_hidden_layers"))
    depth = declared
    if ctx.target_dir is not None and ctx.target_config_read[0] is not None:
        depth = as_int(ctx.target().get("num_hidden_layers")) or declared
        if declared is not None and depth is not None and declared != depth:
            key = "num_target_layers" if gqa else "target_num_hidden_layers"
            problems.append(
                Problem(
                    f"{src}: {key} = {declared} but the target has num_hidden_layers = {depth}",
                    f"set {key} to {depth}, or pair the draft with the target it was trained for",
                )
            )
    elif depth is None:
        problems.append(
            Problem(
                f"{src}: target_num_hidden_layers is missing",
                "add the target's num_hidden_layers to config.json",
            )
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(
            Problem(
                f"{src}: target_layer_ids {ids} are not strictly increasing",
                "list the tapped layers in increasing order, each once (the taps' order in context_proj)",
            )
        )
    if depth is None:
        return problems
    outside = [i for i in ids if not -1 <= i < depth]
    if outside:
        problems.append(
            Problem(
                f"{src}: target_layer_ids {outside} are outside the target's {depth} layers",
                f"use ids in [0, {depth - 1}) (id i = the output of decoder layer i)",
            )
        )
    if depth - 1 in ids:
        problems.append(
            Problem(
                f"{src}: target_layer_ids include the target's last layer {depth - 1}; its output is not a valid tap",
                f"use ids < {depth - 1}; note HF hidden_states[-1] is the post-norm final state, not layer "
                f"{depth - 1}'s output (tap i = hidden_states[i + 1])",
            )
        )
    return problems


def check_hidden_size(ctx: Context) -> list[Problem]:
    """The target's hidden_size equals the draft's target_hidden_size (the width of each tap)."""
    t = ctx.target()
    raw = ctx.raw()
    ctx.trust("target_hidden_size" if "target_hidden_size" in raw else "hidden_size")
    th = as_int(t.get("hidden_size"))
    dth = as_int(raw.get("target_hidden_size")) or as_int(raw.get("hidden_size"))
    if th is None or dth is None or th == dth:
        return []
    return [
        Problem(
            f"the target hidden_size is {th} but the draft's target_hidden_size is {dth}",
            "pair the draft with the target it was trained for (context_proj reads taps of width target_hidden_size)",
        )
    ]


def _head_presence(ctx: Context, prefix: str) -> tuple[list[str], list[str]]:
    """(expected names missing from the checkpoint, checkpoint names with this prefix)."""
    found = ctx.tensors()
    expected = [n for n in ctx.draft_roster if n.startswith(prefix)]
    present = sorted(n for n in found if n.startswith(prefix))
    return [n for n in expected if n not in found], present


def check_confidence_head(ctx: Context) -> list[Problem]:
    """confidence_head tensors present when enable_confidence_head is true, absent when it is false."""
    cfg = ctx.cfg()
    missing, present = _head_presence(ctx, "confidence_head.")
    src = ctx.draft_dir / "config.json"
    if cfg.enable_confidence_head and missing:
        return [
            Problem(
                f"{src} has enable_confidence_head: true but the checkpoint lacks {missing}",
                "use the checkpoint that includes the trained confidence head, or set "
                "enable_confidence_head: false (adaptive verification then cannot be used)",
            )
        ]
    if not cfg.enable_confidence_head and present:
        return [
            Problem(
                f"{src} has enable_confidence_head: false but the checkpoint has {present}",
                "set enable_confidence_head: true to use the trained head (and check "
                "confidence_head_with_markov against its input width), or remove the tensors",
            )
        ]
    return []


def check_markov_head(ctx: Context) -> list[Problem]:
    """markov_head tensors present if and only if markov_rank > 0."""
    cfg = ctx.cfg()
    missing, present = _head_presence(ctx, "markov_head.")
    src = ctx.draft_dir / "config.json"
    if cfg.markov_rank > 0 and missing:
        return [
            Problem(
                f"{src} has markov_rank {cfg.markov_rank} but the checkpoint lacks {missing}",
                "use the checkpoint that includes the Markov head, or set markov_rank: 0 if the draft was "
                "trained without one",
            )
        ]
    if cfg.markov_rank == 0 and present:
        w1 = ctx.tensors().get("markov_head.markov_w1.weight")
        rank = f" to {w1.shape[1]}" if w1 is not None and len(w1.shape) == 2 else ""
        return [
            Problem(
                f"{src} has markov_rank 0 but the checkpoint has Markov head tensors {present}",
                f"set markov_rank{rank} (and markov_head_type) so the trained Markov head is used",
            )
        ]
    return []


def _latent_width(d: Mapping[str, Any], gqa: bool) -> int | None:
    """Values cached per token per layer: MLA kv_lora_rank + qk_rope_head_dim; GQA [k | v] = 2·kvH·head_dim."""
    if gqa:
        kv, hd = as_int(d.get("num_key_value_heads")), as_int(d.get("head_dim"))
        return 2 * kv * hd if kv and hd else None
    c, r = as_int(d.get("kv_lora_rank")), as_int(d.get("qk_rope_head_dim"))
    return c + r if c and r else None


def check_kv_cache(ctx: Context) -> list[Problem]:
    """An MLA target shares its latent pages with the draft: the draft's cached row must have the same width."""
    t = ctx.target()
    cfg = ctx.cfg()
    if ctx.target_family() is not MLA:
        return []  # the check covers DeepSeek-V3-family targets and their latent pages
    tw, dw = _latent_width(t, gqa=False), _latent_width(ctx.raw(), gqa=cfg.is_gqa)
    if tw is None or dw is None or tw == dw:
        return []
    return [
        Problem(
            f"the draft caches {dw} values per token per layer but the target's latent pages are {tw} wide "
            "(kv_lora_rank + qk_rope_head_dim): they cannot share one paged cache",
            "use an MLA draft with the target's kv_lora_rank and qk_rope_head_dim (Kimi-K3: 512 + 64 = 576)",
        )
    ]


def kv_note(ctx: Context) -> str | None:
    raw = ctx.draft_config_read[0] if ctx.has_draft else None
    if raw is None:
        return None
    width, layers = _latent_width(raw, is_gqa_drafter(raw)), as_int(raw.get("num_hidden_layers"))
    if width is None or layers is None:
        return None
    return (
        f"draft KV cache: {layers} layers x {width} values x 2 B (bf16) = {layers * width * 2:,} B per token, "
        "in the target's pages (one block table per request)"
    )
