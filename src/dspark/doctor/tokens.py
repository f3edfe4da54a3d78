"""Step 1 of the doctor, the tokenizer: the target's tokenizer.json is there (where the engine reads it), loads,
fits the vocabulary, and its special tokens have the ids the draft and target configs name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.checkpoint.io import Problem
from dspark.config import RANDOM_WEIGHTS_KEY
from dspark.doctor.context import (
    NEEDS_TARGET,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    Context,
    Skip,
    as_int,
    id_set,
    text_config,
    token_string,
)


def check_tokenizer(ctx: Context) -> list[Problem]:
    """tokenizer.json found in the target dir (where the engine reads it; without --target the draft dir),
    loadable, within the vocabulary. Only explicitly random test weights may go without one."""
    tok = ctx.tokenizer
    if tok.json_path is None:
        home = ctx.target_dir if ctx.target_dir is not None else ctx.draft_path
        if ctx.random_weights():
            raise Skip(f"{home} holds explicitly random test weights ({RANDOM_WEIGHTS_KEY}): bytes stand in for text")
        if ctx.target_dir is None:
            raise Skip(f"{NEEDS_TARGET}: no {TOKENIZER_FILE} in the draft dir")
        if not ctx.target_dir.is_dir() or any((ctx.target_dir / f).is_file() for f in TOKENIZER_FILES[1:]):
            return []  # no target dir (see target-config), or a SentencePiece model transformers converts
        return [
            Problem(
                f"no {TOKENIZER_FILE} in the target directory {ctx.target_dir}: prompts cannot be tokenized "
                "(the text would be garbage)",
                f"copy {TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE} from the target model's repository into "
                f"{ctx.target_dir} (a tokenizer in the draft directory is not used)",
            )
        ]
    if tok.lfs:
        raise Skip("a tokenizer file is a Git LFS pointer: see lfs-pointers")
    problems = list(tok.problems)
    for role in ("bos", "eos", "pad", "mask", "unk") if tok.tokenizer is not None else ():
        s = token_string(tok.config.get(f"{role}_token"))
        if s is not None and tok.token_id(s) is None:
            problems.append(
                Problem(
                    f"{tok.config_path} declares {role}_token {s!r} but the tokenizer has no such token",
                    f"fix {role}_token in {TOKENIZER_CONFIG_FILE} or use the matching {TOKENIZER_FILE}",
                )
            )
    if tok.tokenizer is not None:
        n = tok.tokenizer.get_vocab_size(with_added_tokens=True)
        draft_raw = ctx.draft_config_read[0] if ctx.has_draft else None
        for who, raw in (("draft", draft_raw), ("target", ctx.target_config_read[0])):
            v = as_int(text_config(raw).get("vocab_size")) if raw is not None else None
            if v is not None and n > v:
                problems.append(
                    Problem(
                        f"{tok.json_path} has {n} tokens but the {who} vocab_size is {v}: ids >= {v} have no "
                        "embedding row",
                        "use the tokenizer that belongs to the target model",
                    )
                )
    return problems


def _tokenizer_ids(ctx: Context) -> dict[str, tuple[str, int]]:
    """role -> (token, id) for the special tokens the tokenizer declares (mask also found by name)."""
    tok = ctx.tokenizer
    if tok.lfs or (tok.tokenizer is None and not tok.config):
        return {}
    out: dict[str, tuple[str, int]] = {}
    for role in ("bos", "eos", "pad", "mask"):
        s = token_string(tok.config.get(f"{role}_token"))
        tid = tok.token_id(s) if s is not None else None
        if s is not None and tid is not None:
            out[role] = (s, tid)
    if "mask" not in out:
        masks = [(c, i) for i, c in tok.added_tokens().items() if "mask" in c.lower()]
        if len(masks) == 1:
            out["mask"] = masks[0]
    return out


def check_special_tokens(ctx: Context) -> list[Problem]:
    """mask/bos/eos/pad ids are in the vocabulary and agree between draft, target and tokenizer."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    v = ctx.vocab()
    mask, problems = _mask_id(raw.get("mask_token_id"), src, v)
    draft_ids = {r: id_set(raw.get(f"{r}_token_id")) for r in ("bos", "eos", "pad")}
    for role, ids in draft_ids.items():
        for i in sorted(ids):
            if not 0 <= i < v:
                problems.append(
                    Problem(f"{src}: {role}_token_id {i} is outside [0, {v})", f"set {role}_token_id to the target's")
                )
    target_ids: dict[str, set[int]] = {}
    if ctx.target_dir is not None and ctx.target_config_read[0] is not None:
        t = ctx.target()
        target_ids = {r: id_set(t.get(f"{r}_token_id")) for r in ("bos", "eos", "pad")}
        for role in ("bos", "eos", "pad"):
            d, tg = draft_ids[role], target_ids[role]
            if d and tg and not d <= tg:
                problems.append(
                    Problem(
                        f"{role}_token_id differs: draft {sorted(d)} vs target {sorted(tg)}",
                        f"set {role}_token_id in {src} to the target's ({sorted(tg)})",
                    )
                )
    return problems + _tokenizer_id_problems(ctx, mask, draft_ids, target_ids)


def _mask_id(mask: Any, src: Path, v: int) -> tuple[int | None, list[Problem]]:
    """(the draft's mask_token_id if usable, its problems): an integer inside the vocabulary [0, v)."""
    if as_int(mask) is None:
        fix = "set mask_token_id to the id the draft was trained with (Kimi-K3-DSpark: 163837)"
        return None, [Problem(f"{src}: mask_token_id = {mask!r} is missing or not an integer", fix)]
    if not 0 <= mask < v:
        return mask, [
            Problem(
                f"{src}: mask_token_id {mask} is outside the vocabulary [0, {v})",
                f"set mask_token_id to the (reserved) token id the draft was trained with; it must be < {v}",
            )
        ]
    return mask, []


def _tokenizer_id_problems(
    ctx: Context, mask: int | None, draft_ids: dict[str, set[int]], target_ids: dict[str, set[int]]
) -> list[Problem]:
    """The tokenizer's special tokens have the ids the draft and target configs name."""
    src = ctx.draft_dir / "config.json"
    problems = []
    for role, (token, tid) in _tokenizer_ids(ctx).items():
        where = f"the tokenizer's {role}_token {token!r} is id {tid}"
        if role == "mask":
            if mask is not None and mask != tid:
                problems.append(
                    Problem(
                        f"{where} but the draft mask_token_id is {mask}",
                        f"set mask_token_id to {tid} in {src}, or use the tokenizer the draft was trained with",
                    )
                )
            continue
        for who, ids in (("draft", draft_ids.get(role, set())), ("target", target_ids.get(role, set()))):
            if ids and tid not in ids:
                problems.append(
                    Problem(
                        f"{where} but the {who} config has {role}_token_id {sorted(ids)}",
                        f"make {role}_token_id in the {who} config.json and {TOKENIZER_CONFIG_FILE} agree "
                        "(the target's tokenizer is the reference)",
                    )
                )
    return problems
