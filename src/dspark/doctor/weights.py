"""Step 1 of the doctor: the files and tensors themselves. Both config.json files read and parse, no Git LFS pointer
stands in for a file, every safetensors header matches its file, the draft's and the target's tensors are the ones
their configs imply (names, shapes, dtypes), the vocabulary agrees everywhere, an lm_head and an embedding are there
to borrow, and every weight is finite and representable in bf16."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dspark.checkpoint.io import SINGLE_FILE, Problem, TensorInfo, is_lfs_pointer
from dspark.checkpoint.roster import RosterReport, TensorSpec, compare_roster, report_problems
from dspark.config import ConfigError, DraftConfig
from dspark.doctor.context import (
    LM_HEAD_FILE,
    NEEDS_TARGET,
    Context,
    Scan,
    Skip,
    as_int,
    find_tensor,
    text_config,
)
from dspark.doctor.keys import misspelled_keys
from dspark.doctor.rootcause import cause_problems, config_ints, find_root_cause
from dspark.models.families import Family, Weights, model_type, without_model_type

BF16_MAX = torch.finfo(torch.bfloat16).max
_CHUNK_ELEMENTS = 1 << 24  # bf16/finiteness scan reads at most this many elements at once


def check_draft_config(ctx: Context) -> list[Problem]:
    """config.json exists, is JSON, and parses as a k3_dspark / Qwen3DSpark draft config."""
    ctx.draft_dir  # noqa: B018 (skips without a draft)
    problems = [p for p in (ctx.draft_config_read[1], ctx.draft_cfg_parse[1]) if p is not None]
    raw = ctx.draft_config_read[0]
    if raw is None or ctx.draft_target_architectures:
        return problems
    return problems + misspelled_keys(DraftConfig.KEYS, raw, ctx.draft_cfg_parse[0], ctx.draft_dir / "config.json")


def check_target_config(ctx: Context) -> list[Problem]:
    if ctx.target_dir is None:
        raise Skip(NEEDS_TARGET)
    raw, problem = ctx.target_config_read
    if problem is not None:
        return [problem]
    assert raw is not None
    t = text_config(raw)
    src = ctx.target_dir / "config.json"
    problems = [
        Problem(f"{src}: key '{k}' = {t.get(k)!r} is missing or not a positive integer", f"add '{k}' to {src}")
        for k in ("vocab_size", "hidden_size", "num_hidden_layers")
        if (as_int(t.get(k)) or 0) <= 0
    ]
    family = ctx.target_spec.spec.family if ctx.target_spec.spec is not None else None
    if family is None or not family.is_target:
        return problems  # transformers reads it: its keys are transformers' business
    return problems + misspelled_keys(family.config.KEYS, raw, _parsed(ctx), src)


def _parsed(ctx: Context) -> Any:
    """The target's parsed config, or None when it does not parse (target-roster says why)."""
    try:
        return ctx.target_spec.spec.config if ctx.target_spec.spec is not None else None
    except (ConfigError, TypeError, ValueError):
        return None


def _lfs_size(p: Path) -> str:
    try:
        m = re.search(rb"^size (\d+)\s*$", p.read_bytes(), re.MULTILINE)
    except OSError:
        return ""
    return f"; the real file is {int(m.group(1)):,} bytes" if m else ""


def check_lfs_pointers(ctx: Context) -> list[Problem]:
    """No file of the draft/target directories is a Git LFS pointer standing in for the real content."""
    problems = []
    for d in (ctx.draft_path, ctx.target_dir):
        if d is None or not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if ctx.config_is_lfs_pointer(d) if p.name == "config.json" else is_lfs_pointer(p):
                problems.append(
                    Problem(
                        f"{p} is a Git LFS pointer file ({p.stat().st_size} bytes), not the real file{_lfs_size(p)}",
                        f"run `git lfs install && git lfs pull` in {d}, or download the real files, e.g. "
                        "`huggingface-cli download <repo> --local-dir <dir>`",
                    )
                )
    return problems


def check_safetensors(ctx: Context) -> list[Problem]:
    """Every safetensors file has a valid header that matches its size (LFS pointers are reported above)."""
    draft_scans = (ctx.draft_scan, ctx.lm_head_scan) if ctx.has_draft and ctx.draft_dir.is_dir() else ()
    if ctx.has_draft and not draft_scans:
        raise Skip("the draft directory does not exist: see draft-config")
    problems = []
    for scan in (*draft_scans, ctx.target_scan):
        if scan is None:
            continue
        problems += [p for p in scan.problems if "Git LFS pointer" not in p.message]
    return problems


def check_roster(ctx: Context) -> list[Problem]:
    """Draft tensor names, shapes and dtypes match what config.json implies (the official roster); a disagreement
    one config key explains is reported once, as that key and both values."""
    report = ctx.draft_report
    source = str(ctx.draft_scan.path / SINGLE_FILE)
    cause = ctx.draft_cause
    if cause is not None:
        return cause_problems(cause, report, ctx.draft_dir / "config.json", source)
    return report_problems(report, source=source)


def check_vocab(ctx: Context) -> list[Problem]:
    """vocab_size agrees with draft_vocab_size, with the embedding / lm_head rows, and with the target."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    v = as_int(raw.get("vocab_size"))
    if v is None or v <= 0:
        return [Problem(f"{src}: vocab_size = {raw.get('vocab_size')!r} is missing or invalid", "set vocab_size")]
    problems = []
    dv = raw.get("draft_vocab_size")
    if dv is not None and dv != v:
        problems.append(
            Problem(
                f"{src}: draft_vocab_size = {dv!r} differs from vocab_size = {v}",
                f"checkpoints with their own reduced lm_head (d2t maps) are not supported; set draft_vocab_size to "
                f"{v} and reduce at inference instead (draft_vocab.json, speculative config draft_vocab_size)",
            )
        )
    problems += _draft_vocab_rows(ctx, v) + _draft_vocab_file(ctx.draft_dir, v)
    if ctx.target_dir is None or ctx.target_config_read[0] is None:
        return problems
    return problems + _target_vocab(ctx, v)


def _draft_vocab_rows(ctx: Context, v: int) -> list[Problem]:
    """The draft's embed_tokens / lm_head rows (its own file and an external lm_head file) equal vocab_size v."""
    rows: list[tuple[str, Mapping[str, TensorInfo]]] = []
    if not ctx.draft_scan.problems:
        rows.append((str(ctx.draft_scan.path / SINGLE_FILE), ctx.draft_scan.infos))
    if ctx.lm_head_scan is not None and not ctx.lm_head_scan.problems:
        rows.append((str(ctx.lm_head_scan.path), ctx.lm_head_scan.infos))
    problems = []
    for where, infos in rows:
        for name in ("embed_tokens.weight", "lm_head.weight"):
            info = infos.get(name)
            if info is not None and info.shape and info.shape[0] != v:
                problems.append(
                    Problem(
                        f"{where}: {name} has {info.shape[0]} rows but the draft vocab_size is {v}",
                        "use the config.json that belongs to these weights (vocab_size = rows)",
                    )
                )
    return problems


def _draft_vocab_file(draft_dir: Path, v: int) -> list[Problem]:
    """A draft_vocab.json next to the weights must rank distinct ids of this vocabulary, its default within it."""
    from dspark.speculative.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab

    if not (draft_dir / DRAFT_VOCAB_FILE).is_file():
        return []
    try:
        read_draft_vocab(draft_dir, None, v)
    except ConfigError as e:
        fix = "rewrite it with `dspark draft-vocab` or delete it (full vocabulary)"
        return [Problem(str(e), fix)]
    return []


def _target_vocab(ctx: Context, v: int) -> list[Problem]:
    """The target's vocab_size equals the draft's v, and its embedding / lm_head rows equal its vocab_size."""
    tv = as_int(ctx.target().get("vocab_size"))
    problems = []
    if tv is not None and tv != v:
        problems.append(
            Problem(
                f"draft vocab_size {v} != target vocab_size {tv} ({ctx.target_dir / 'config.json'})",
                "the draft must share the target's vocabulary: use a draft trained for this target",
            )
        )
    scan = ctx.target_scan
    if tv is None or scan is None or scan.problems:
        return problems
    for suffix in ("embed_tokens.weight", "lm_head.weight"):
        name = find_tensor(scan.infos, suffix)
        info = scan.infos.get(name) if name else None
        if info is not None and info.shape and info.shape[0] != tv:
            problems.append(
                Problem(
                    f"target {info.file}: {name} has {info.shape[0]} rows but the target vocab_size is {tv}",
                    "use the target config.json that belongs to these weights",
                )
            )
    return problems


def _shape_problem(where: str, name: str, got: tuple[int, ...], want: tuple[int, ...], fix: str) -> list[Problem]:
    if tuple(got) == tuple(want):
        return []
    return [Problem(f"{where}: {name} has shape {list(got)}, the draft needs {list(want)} ([vocab, hidden])", fix)]


def check_lm_head(ctx: Context) -> list[Problem]:
    """An lm_head [vocab, hidden] exists: the draft's own lm_head.safetensors (or in model.safetensors), or
    the target's (borrowed), or the target's embedding when the target ties them."""
    want = (ctx.vocab(), ctx.hidden())
    own = ctx.lm_head_scan
    if own is not None:
        if own.problems:
            raise Skip(f"{own.path} is unreadable: see lfs-pointers / safetensors")
        if "lm_head.weight" not in own.infos:
            return [
                Problem(
                    f"{own.path} has no tensor 'lm_head.weight' (it has {sorted(own.infos)[:5]})",
                    f"re-export {LM_HEAD_FILE} with the tensor named lm_head.weight, or delete it to borrow "
                    "the target's lm_head",
                )
            ]
        return _shape_problem(
            str(own.path),
            "lm_head.weight",
            own.infos["lm_head.weight"].shape,
            want,
            f"re-export {LM_HEAD_FILE} from the draft's training run (the target's lm_head, [vocab, hidden])",
        )
    infos = ctx.tensors()
    if "lm_head.weight" in infos:
        return _shape_problem(
            str(ctx.draft_scan.path / SINGLE_FILE),
            "lm_head.weight",
            infos["lm_head.weight"].shape,
            want,
            "re-export the draft with the lm_head of its target",
        )
    if ctx.target_dir is None:
        raise Skip(f"{NEEDS_TARGET}: the draft has no {LM_HEAD_FILE} and borrows the target's lm_head")
    t = ctx.target()
    target = ctx.target_tensors()
    tied = bool(t.get("tie_word_embeddings", False))
    name = find_tensor(target, "embed_tokens.weight" if tied else "lm_head.weight")
    fix = (
        f"put the lm_head the draft was trained with into {ctx.draft_dir / LM_HEAD_FILE} (tensor "
        f"lm_head.weight, shape {list(want)}), or pair the draft with the target it was trained for"
    )
    if name is None:
        return [
            Problem(
                f"no lm_head: the draft has no {LM_HEAD_FILE} and the target checkpoint {ctx.target_dir} has "
                f"no {'embed_tokens' if tied else 'lm_head'}.weight to borrow",
                fix,
            )
        ]
    got = target[name].shape
    if tuple(got) != want:
        return [
            Problem(
                f"no usable lm_head: the draft has no {LM_HEAD_FILE} and the target's {name} has shape "
                f"{list(got)}, but the draft needs [vocab, hidden] = {list(want)}",
                fix,
            )
        ]
    return []


def check_embedding(ctx: Context) -> list[Problem]:
    """The draft always borrows the target's embedding: it must be [draft vocab, draft hidden]."""
    t = ctx.target()
    want = (ctx.vocab(), ctx.hidden())
    target = ctx.target_tensors()
    name = find_tensor(target, "embed_tokens.weight")
    if name is None:
        return [
            Problem(
                f"the target checkpoint {ctx.target_dir} has no embed_tokens.weight for the draft to borrow",
                "point --target at the target model the draft was trained for",
            )
        ]
    got = tuple(target[name].shape)
    if got == want:
        return []
    return [
        Problem(
            f"the target's {name} has shape {list(got)} (hidden_size {t.get('hidden_size')}), but the draft "
            f"needs [vocab, hidden] = {list(want)}",
            "the draft's hidden_size must equal the target's: pair the draft with the target it was trained for",
        )
    ]


def _scan_values(file: str, name: str, info: TensorInfo) -> Problem | None:
    """Read one floating tensor in row chunks; report NaN/Inf, or finite values that overflow in bf16."""
    nan = inf = overflow = 0
    peak = 0.0
    with safe_open(file, framework="pt", device="cpu") as f:
        if not info.shape:
            chunks = iter([f.get_tensor(name)])
        else:
            sl = f.get_slice(name)
            per_row = max(1, math.prod(info.shape[1:]))
            step = max(1, _CHUNK_ELEMENTS // per_row)
            chunks = (sl[a : a + step] for a in range(0, info.shape[0], step))
        for x in chunks:
            finite = torch.isfinite(x)
            nan += int(torch.isnan(x).sum())
            inf += int(torch.isinf(x).sum())
            if info.dtype in ("F32", "F64") and bool(finite.any()):
                big = torch.isinf(x.to(torch.bfloat16)) & finite
                overflow += int(big.sum())
                if overflow:
                    peak = max(peak, float(x[finite].abs().max()))
    if nan or inf:
        return Problem(
            f"{file}: tensor {name!r} has {nan} NaN and {inf} Inf values",
            "the checkpoint is corrupt or training diverged: re-export it from a good training checkpoint",
        )
    if overflow:
        return Problem(
            f"{file}: tensor {name!r} ({info.dtype}) has {overflow} values that overflow to inf in bf16 "
            f"(max |w| = {peak:.4g} > bf16 max {BF16_MAX:.4g})",
            "the weights cannot be served in bf16: find why they are so large (diverged training) and "
            "re-export a sane checkpoint",
        )
    return None


def check_bf16(ctx: Context) -> list[Problem]:
    """Every floating weight of the draft (and its own lm_head) is finite and representable in bf16."""
    ctx.raw()
    scans = [s for s in (ctx.draft_scan, ctx.lm_head_scan) if s is not None and not s.problems]
    if not scans:
        raise Skip("the draft weights are unreadable: see lfs-pointers / safetensors")
    problems = []
    for scan in scans:
        for name in sorted(scan.infos):
            info = scan.infos[name]
            if info.dtype in ("F16", "BF16", "F32", "F64"):
                p = _scan_values(info.file, name, info)
                if p is not None:
                    problems.append(p)
    return problems


def _native_report(family: Family, raw: Mapping[str, Any], cfg: Any, found: Weights) -> RosterReport:
    """The target's tensors against what its family's loader expects for ``cfg`` (roster built on the meta device)."""
    roster = family.roster(cfg, found)
    if raw.get("tie_word_embeddings"):
        roster.pop("lm_head.weight", None)
    return compare_roster(roster, found, ignore_unexpected=family.roster_ignores)


def _native_target_problems(ctx: Context, family: Family, found: Weights) -> list[Problem]:
    """The target's checkpoint against its family's roster; one config key that explains a disagreement is
    reported once, as that key and both values."""
    spec = ctx.target_spec.spec
    assert spec is not None
    try:
        report = _native_report(family, spec.raw, spec.config, found)
    except (ConfigError, TypeError, ValueError) as e:
        raise Skip(f"the target config.json does not parse ({e})") from e

    def retry(key: str, value: int) -> RosterReport | None:
        raw = dict(spec.raw) | {key: value}
        try:
            return _native_report(family, raw, family.config.from_dict(raw, source=str(spec.config_file)), found)
        except (ConfigError, TypeError, ValueError):
            return None

    values = config_ints(spec.raw, spec.config, family.config.KEYS.read)
    cause = find_root_cause(values, spec.raw, report, list(found), retry)
    source = f"the target checkpoint {ctx.target_dir}"
    if cause is not None:
        return cause_problems(cause, report, spec.config_file, source)
    return report_problems(report, source=source)


def _hf_roster(raw: dict[str, Any]) -> dict[str, TensorSpec]:
    """The tensors transformers' model class for this config holds (built on the meta device)."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark.checkpoint.roster import module_roster

    mt = model_type(raw)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(mt, **without_model_type(raw))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers raises many types for configs it cannot build
        raise Skip(f"transformers cannot build model_type {mt!r} to list its tensors ({type(e).__name__})") from e
    return module_roster(model)


def check_target_roster(ctx: Context) -> list[Problem]:
    """Every tensor the target's config.json implies is in its checkpoint, with its shape: the family's own roster
    for every natively served target (strict, as its loader), transformers' model class for the others (missing /
    wrong shape; transformers would otherwise initialize a missing tensor at random and only warn)."""
    raw = ctx.target()
    found = ctx.target_tensors()
    family = ctx.target_family()
    if family is not None and family.is_target:
        return _native_target_problems(ctx, family, found)
    report = compare_roster(_hf_roster(raw), found, ignore_unexpected=("*",))
    report = replace(report, wrong_dtype=())
    return report_problems(report, source=f"the target checkpoint {ctx.target_dir}")


_HALF = ("F16", "BF16")


def _dtype_problems(raw: dict[str, Any] | None, infos: Mapping[str, TensorInfo], who: str) -> list[Problem]:
    """16-bit floats are either all F16 or all BF16, and the kind config.json declares (bit-for-bit the same
    size, so a relabelled header passes every size check and silently reinterprets the weights)."""
    raw = raw or {}
    label = raw.get("torch_dtype", raw.get("dtype"))  # transformers 5 writes "dtype"
    declared = {"bfloat16": "BF16", "float16": "F16"}.get(str(label))
    half = {name: i.dtype for name, i in infos.items() if i.dtype in _HALF}
    kinds = sorted(set(half.values()))
    if declared is not None:
        odd = sorted(n for n, d in half.items() if d != declared)
    elif len(kinds) > 1:
        majority = max(kinds, key=lambda k: sum(d == k for d in half.values()))
        odd = sorted(n for n, d in half.items() if d != majority)
        declared = majority
    else:
        return []
    if not odd:
        return []
    other = half[odd[0]]
    return [
        Problem(
            f"{who}: {len(odd)} tensor(s) are stored as {other} while the checkpoint is {declared} "
            f"(torch_dtype {label!r}), e.g. {odd[:3]}: a relabelled header reinterprets "
            "the bits as another number format",
            "re-download or re-export the checkpoint (convert with a real cast, never by editing the header)",
        )
    ]


def check_dtype(ctx: Context) -> list[Problem]:
    """Half-precision tensors agree with each other and with config.json's torch_dtype (draft and target)."""
    scans: list[tuple[dict[str, Any] | None, Scan | None, str]] = []
    if ctx.has_draft and ctx.draft_dir.is_dir():
        raw = ctx.draft_config_read[0]
        scans += [(raw, ctx.draft_scan, f"draft {ctx.draft_scan.path}"), (raw, ctx.lm_head_scan, "")]
    if ctx.target_dir is not None:
        raw = ctx.target_config_read[0]
        scans.append((text_config(raw) if raw else None, ctx.target_scan, f"target {ctx.target_dir}"))
    problems = []
    for raw, scan, who in scans:
        if scan is not None and not scan.problems:
            problems += _dtype_problems(raw, scan.infos, who or str(scan.path))
    return problems
