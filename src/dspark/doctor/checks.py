"""The deployment doctor behind ``dspark check DRAFT [--target MODEL] [--json]`` and the load-time gate.

Runs the deployment checklist for a DSpark draft (and, with ``--target``, its pairing with the target) and
reports every problem found, each with its fix. One small function per check; each returns the problems it
found (``Problem(message, fix)``) or raises ``_Skip`` when its inputs are absent or already reported broken.
Nothing here raises on broken input: configs are read as raw JSON first, checkpoints through their
headers only, and weights one tensor (chunk) at a time with safetensors ``safe_open`` — never into a model.

The checks follow the six deployment steps of the Kimi-K3-DSpark card (``STEPS``): 1 weights (incl. the separate
lm_head and Git LFS pointers), 2 layer mapping, 3 KV cache and YaRN identity with the target, 4 confidence and
Markov heads, 5 the lossless-acceptance run to do next, 6 the metrics to monitor. Without a draft (``draft_dir``
None) only the target's checks run: that is what ``generate``/``serve``/``LLM`` run before an n-gram or plain
target (dspark.doctor.gate).

Dependency direction: this package reads checkpoints (dspark.checkpoint) and builds meta-device rosters from the
model classes (dspark.models); neither of those imports the doctor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dspark.checkpoint.io import (
    SINGLE_FILE,
    CheckpointError,
    Problem,
    TensorInfo,
    is_lfs_pointer,
    list_checkpoint_tensors,
)
from dspark.checkpoint.roster import TensorSpec, compare_roster, report_problems
from dspark.config import RANDOM_WEIGHTS_KEY, ConfigError, DraftConfig, KimiLinearConfig, TargetConfig

__all__ = [
    "CHECKS",
    "LOAD_CHECKS",
    "METRICS",
    "STEPS",
    "CheckProblem",
    "CheckReport",
    "format_report",
    "report_json",
    "run_checks",
]

LM_HEAD_FILE = "lm_head.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # fast tokenizer, or a SentencePiece model
MLA_TARGET_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")
BF16_MAX = torch.finfo(torch.bfloat16).max
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "rope_theta",
)
_CHUNK_ELEMENTS = 1 << 24  # bf16/finiteness scan reads at most this many elements at once
_HEADS = ("markov_head.", "confidence_head.")  # presence checked by their own checks, not by the roster


# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class CheckProblem:
    """One problem: the check that found it, what is wrong (naming the file/key/value) and how to fix it."""

    check: str
    message: str
    fix: str


@dataclass(frozen=True)
class CheckReport:
    """Every problem found, and which checks passed or were skipped (with why, in ``skip_reasons``)."""

    problems: tuple[CheckProblem, ...]
    passed: tuple[str, ...]
    skipped: tuple[str, ...]
    skip_reasons: Mapping[str, str] = field(default_factory=dict, compare=False)
    notes: Mapping[int, tuple[str, ...]] = field(default_factory=dict, compare=False)  # step -> facts/advice
    draft_dir: Path | None = None
    target_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


class _Skip(Exception):
    """A check cannot run: its inputs are absent (e.g. no --target) or broken (reported by another check)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


NEEDS_TARGET = "needs --target"
NO_DRAFT = "no draft model"


# ---------------------------------------------------------------------------------------- inputs


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _id_set(v: Any) -> set[int]:
    """A token id field (int, list of ints, or null) as a set."""
    if _as_int(v) is not None:
        return {v}
    if isinstance(v, list):
        return {i for i in v if _as_int(i) is not None}
    return set()


def _read_raw(d: Path) -> tuple[dict[str, Any] | None, Problem | None]:
    """config.json of directory d as a dict, or the problem that prevents reading it."""
    if not d.is_dir():
        what = "is not a directory" if d.exists() else "does not exist"
        return None, Problem(f"{d} {what}", "pass a model directory holding config.json and model.safetensors")
    p = d / "config.json"
    if not p.is_file():
        return None, Problem(f"{p} is missing", "copy config.json from the model's repository into the directory")
    if is_lfs_pointer(p):
        return None, Problem(f"{p} is a Git LFS pointer file, not the config", "run `git lfs pull`")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, Problem(f"{p} is not valid JSON ({e})", "fix the file or re-download it")
    if not isinstance(raw, dict):
        return None, Problem(f"{p} holds a JSON {type(raw).__name__}, not an object", "re-download the file")
    return raw, None


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's keys in text_config; top-level keys fill the gaps."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in raw:
        return {k: v for k, v in raw.items() if k != "text_config"} | text
    return raw


def _roster_view(raw: dict[str, Any]) -> dict[str, Any]:
    """The draft config with the keys that do not affect the tensor roster made valid, so that a bad mask id
    or bad layer ids are reported by their own checks instead of preventing the roster check."""
    d = dict(raw)
    ids = d.get("target_layer_ids")
    n = len(ids) if isinstance(ids, list) and ids else 1
    d["target_layer_ids"] = list(range(n))
    d["target_num_hidden_layers"] = n + 1
    archs = d.get("architectures")
    if isinstance(archs, list) and archs and archs[0] == "Qwen3DSparkModel":
        d["num_target_layers"] = n + 1
    d["mask_token_id"] = 0
    d.pop("draft_vocab_size", None)
    return d


@dataclass(frozen=True)
class _Scan:
    """A checkpoint's tensors read from its headers, or the problems that prevented it."""

    path: Path
    infos: Mapping[str, TensorInfo]
    problems: tuple[Problem, ...]


def _scan(path: Path) -> _Scan:
    try:
        return _Scan(path, list_checkpoint_tensors(path), ())
    except CheckpointError as e:
        return _Scan(path, {}, e.problems)


@dataclass(frozen=True)
class _Tokenizer:
    """The tokenizer files found (target dir first, then draft dir) and what was read from them."""

    json_path: Path | None
    config_path: Path | None
    tokenizer: Any = None  # tokenizers.Tokenizer
    config: Mapping[str, Any] = field(default_factory=dict)
    problems: tuple[Problem, ...] = ()
    lfs: bool = False

    def token_id(self, token: str) -> int | None:
        if self.tokenizer is not None:
            tid = self.tokenizer.token_to_id(token)
            if tid is not None:
                return int(tid)
        decoder = self.config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            for k, v in decoder.items():
                if isinstance(v, dict) and v.get("content") == token and str(k).isdigit():
                    return int(k)
        return None

    def added_tokens(self) -> dict[int, str]:
        """id -> content of the added (special) tokens, from tokenizer.json and tokenizer_config.json."""
        out: dict[int, str] = {}
        decoder = self.config.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            out |= {int(k): v["content"] for k, v in decoder.items() if str(k).isdigit() and isinstance(v, dict)}
        if self.tokenizer is not None:
            out |= {int(i): t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        return out


def _token_string(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _load_tokenizer(dirs: list[Path]) -> _Tokenizer:
    json_path = next((d / TOKENIZER_FILE for d in dirs if (d / TOKENIZER_FILE).is_file()), None)
    home = [json_path.parent] if json_path is not None else []
    config_path = next((d / TOKENIZER_CONFIG_FILE for d in home + dirs if (d / TOKENIZER_CONFIG_FILE).is_file()), None)
    found = [p for p in (json_path, config_path) if p is not None]
    if any(is_lfs_pointer(p) for p in found):
        return _Tokenizer(json_path, config_path, lfs=True)
    problems: list[Problem] = []
    tok = None
    if json_path is not None:
        try:  # the loader the engine uses (transformers.AutoTokenizer)
            from dspark.tokenizer import HFTokenizer

            tok = HFTokenizer(json_path.parent).backend
        except Exception as e:  # tokenizers and transformers raise their own exception types
            problems.append(
                Problem(f"{json_path} cannot be loaded by transformers.AutoTokenizer ({e})", "re-download the file")
            )
    config: dict[str, Any] = {}
    if config_path is not None:
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(loaded, dict):
                raise ValueError(f"a JSON {type(loaded).__name__}, not an object")
            config = loaded
        except (OSError, UnicodeDecodeError, ValueError) as e:
            problems.append(Problem(f"{config_path} is not a valid JSON object ({e})", "re-download the file"))
    return _Tokenizer(json_path, config_path, tok, config, tuple(problems))


class _Context:
    """Everything the checks read, each read once and lazily; reading never raises."""

    def __init__(self, draft_dir: Path | None, target_dir: Path | None) -> None:
        self._draft_dir = draft_dir
        self.target_dir = target_dir

    @property
    def draft_dir(self) -> Path:
        if self._draft_dir is None:
            raise _Skip(NO_DRAFT)
        return self._draft_dir

    @property
    def has_draft(self) -> bool:
        return self._draft_dir is not None

    @property
    def draft_path(self) -> Path | None:
        return self._draft_dir

    @cached_property
    def draft_config_read(self) -> tuple[dict[str, Any] | None, Problem | None]:
        return _read_raw(self.draft_dir)

    @cached_property
    def target_config_read(self) -> tuple[dict[str, Any] | None, Problem | None]:
        if self.target_dir is None:
            return None, None
        return _read_raw(self.target_dir)

    @cached_property
    def draft_cfg_parse(self) -> tuple[DraftConfig | None, Problem | None]:
        raw = self.draft_config_read[0]
        if raw is None:
            return None, None
        try:
            return DraftConfig.from_dict(_roster_view(raw), source=str(self.draft_dir / "config.json")), None
        except (ConfigError, TypeError, ValueError) as e:
            return None, Problem(str(e), "fix config.json (compare with the official k3_dspark config)")

    @cached_property
    def draft_scan(self) -> _Scan:
        return _scan(self.draft_dir)

    @cached_property
    def lm_head_scan(self) -> _Scan | None:
        p = self.draft_dir / LM_HEAD_FILE
        return _scan(p) if p.exists() else None

    @cached_property
    def target_scan(self) -> _Scan | None:
        return _scan(self.target_dir) if self.target_dir is not None and self.target_dir.is_dir() else None

    @cached_property
    def tokenizer(self) -> _Tokenizer:
        """The engine reads the tokenizer from the target directory; without --target, the draft's is checked."""
        home = self.target_dir if self.target_dir is not None else self._draft_dir
        return _load_tokenizer([home] if home is not None and home.is_dir() else [])

    def random_weights(self) -> bool:
        """The target (or, without one, the draft) is marked as explicitly random test weights."""
        raw = self.target_config_read[0] if self.target_dir is not None else None
        if raw is None and self._draft_dir is not None:
            raw = self.draft_config_read[0]
        return bool(raw and raw.get(RANDOM_WEIGHTS_KEY) is True)

    @cached_property
    def draft_roster(self) -> dict[str, TensorSpec]:
        from dspark.models.loading import draft_roster

        return draft_roster(self.cfg(), include_embedding=False)

    # ---- accessors that skip the calling check when an input is missing ----
    def raw(self) -> dict[str, Any]:
        raw = self.draft_config_read[0]
        if raw is None:
            raise _Skip("the draft config.json is unusable: see draft-config")
        return raw

    def cfg(self) -> DraftConfig:
        self.raw()
        cfg = self.draft_cfg_parse[0]
        if cfg is None:
            raise _Skip("the draft config.json does not parse: see draft-config")
        return cfg

    def target(self) -> dict[str, Any]:
        if self.target_dir is None:
            raise _Skip(NEEDS_TARGET)
        raw = self.target_config_read[0]
        if raw is None:
            raise _Skip("the target config.json is unusable: see target-config")
        return _text_config(raw)

    def tensors(self) -> Mapping[str, TensorInfo]:
        """The draft model.safetensors tensors (from headers)."""
        self.raw()
        if self.draft_scan.problems:
            raise _Skip("the draft weights are unreadable: see lfs-pointers / safetensors")
        return self.draft_scan.infos

    def target_tensors(self) -> Mapping[str, TensorInfo]:
        self.target()
        scan = self.target_scan
        if scan is None or scan.problems:
            raise _Skip("the target weights are unreadable: see lfs-pointers / safetensors")
        return scan.infos

    def vocab(self) -> int:
        v = _as_int(self.raw().get("vocab_size"))
        if v is None or v <= 0:
            raise _Skip("the draft config has no valid vocab_size: see vocab")
        return v

    def hidden(self) -> int:
        h = _as_int(self.raw().get("hidden_size"))
        if h is None or h <= 0:
            raise _Skip("the draft config has no valid hidden_size: see draft-config")
        return h


def _find(infos: Mapping[str, TensorInfo], suffix: str) -> str | None:
    """The shortest tensor name equal to or ending in ``.suffix`` (e.g. 'model.embed_tokens.weight')."""
    hits = [n for n in infos if n == suffix or n.endswith("." + suffix)]
    return min(hits, key=len) if hits else None


# ---------------------------------------------------------------------------------------- checks


def check_draft_config(ctx: _Context) -> list[Problem]:
    """config.json exists, is JSON, and parses as a k3_dspark / Qwen3DSpark draft config."""
    ctx.draft_dir  # noqa: B018 (skips without a draft)
    return [p for p in (ctx.draft_config_read[1], ctx.draft_cfg_parse[1]) if p is not None]


def check_target_config(ctx: _Context) -> list[Problem]:
    if ctx.target_dir is None:
        raise _Skip(NEEDS_TARGET)
    raw, problem = ctx.target_config_read
    if problem is not None:
        return [problem]
    assert raw is not None
    t = _text_config(raw)
    src = ctx.target_dir / "config.json"
    return [
        Problem(f"{src}: key '{k}' = {t.get(k)!r} is missing or not a positive integer", f"add '{k}' to {src}")
        for k in ("vocab_size", "hidden_size", "num_hidden_layers")
        if (_as_int(t.get(k)) or 0) <= 0
    ]


def _lfs_size(p: Path) -> str:
    try:
        m = re.search(rb"^size (\d+)\s*$", p.read_bytes(), re.MULTILINE)
    except OSError:
        return ""
    return f"; the real file is {int(m.group(1)):,} bytes" if m else ""


def check_lfs_pointers(ctx: _Context) -> list[Problem]:
    """No file of the draft/target directories is a Git LFS pointer standing in for the real content."""
    problems = []
    for d in (ctx.draft_path, ctx.target_dir):
        if d is None or not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if is_lfs_pointer(p):
                problems.append(
                    Problem(
                        f"{p} is a Git LFS pointer file ({p.stat().st_size} bytes), not the real file{_lfs_size(p)}",
                        f"run `git lfs install && git lfs pull` in {d}, or download the real files, e.g. "
                        "`huggingface-cli download <repo> --local-dir <dir>`",
                    )
                )
    return problems


def check_safetensors(ctx: _Context) -> list[Problem]:
    """Every safetensors file has a valid header that matches its size (LFS pointers are reported above)."""
    draft_scans = (ctx.draft_scan, ctx.lm_head_scan) if ctx.has_draft and ctx.draft_dir.is_dir() else ()
    if ctx.has_draft and not draft_scans:
        raise _Skip("the draft directory does not exist: see draft-config")
    problems = []
    for scan in (*draft_scans, ctx.target_scan):
        if scan is None:
            continue
        problems += [p for p in scan.problems if "Git LFS pointer" not in p.message]
    return problems


def check_roster(ctx: _Context) -> list[Problem]:
    """Draft tensor names, shapes and dtypes match what config.json implies (the official roster)."""
    found = ctx.tensors()
    expected = dict(ctx.draft_roster)
    embed = "embed_tokens.weight"
    if embed in found:  # optional: a frozen copy of the target's embedding (always borrowed at load)
        expected[embed] = TensorSpec((ctx.vocab(), ctx.hidden()))
    report = compare_roster(expected, found, ignore_unexpected=("lm_head.weight",) + tuple(h + "*" for h in _HEADS))
    report = replace(report, missing=tuple(n for n in report.missing if not n.startswith(_HEADS)))
    return report_problems(report, source=str(ctx.draft_scan.path / SINGLE_FILE))


def check_vocab(ctx: _Context) -> list[Problem]:
    """vocab_size agrees with draft_vocab_size, with the embedding / lm_head rows, and with the target."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    v = _as_int(raw.get("vocab_size"))
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


def _draft_vocab_rows(ctx: _Context, v: int) -> list[Problem]:
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
    from dspark.config import ConfigError
    from dspark.spec.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab

    if not (draft_dir / DRAFT_VOCAB_FILE).is_file():
        return []
    try:
        read_draft_vocab(draft_dir, None, v)
    except ConfigError as e:
        return [Problem(str(e), "rewrite it with `python -m dspark.spec.draft_vocab` or delete it (full vocabulary)")]
    return []


def _target_vocab(ctx: _Context, v: int) -> list[Problem]:
    """The target's vocab_size equals the draft's v, and its embedding / lm_head rows equal its vocab_size."""
    tv = _as_int(ctx.target().get("vocab_size"))
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
        name = _find(scan.infos, suffix)
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


def check_lm_head(ctx: _Context) -> list[Problem]:
    """An lm_head [vocab, hidden] exists: the draft's own lm_head.safetensors (or in model.safetensors), or
    the target's (borrowed), or the target's embedding when the target ties them."""
    want = (ctx.vocab(), ctx.hidden())
    own = ctx.lm_head_scan
    if own is not None:
        if own.problems:
            raise _Skip(f"{own.path} is unreadable: see lfs-pointers / safetensors")
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
        raise _Skip(f"{NEEDS_TARGET}: the draft has no {LM_HEAD_FILE} and borrows the target's lm_head")
    t = ctx.target()
    target = ctx.target_tensors()
    tied = bool(t.get("tie_word_embeddings", False))
    name = _find(target, "embed_tokens.weight" if tied else "lm_head.weight")
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


def check_embedding(ctx: _Context) -> list[Problem]:
    """The draft always borrows the target's embedding: it must be [draft vocab, draft hidden]."""
    t = ctx.target()
    want = (ctx.vocab(), ctx.hidden())
    target = ctx.target_tensors()
    name = _find(target, "embed_tokens.weight")
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


def check_tokenizer(ctx: _Context) -> list[Problem]:
    """tokenizer.json found in the target dir (where the engine reads it; without --target the draft dir),
    loadable, within the vocabulary. Only explicitly random test weights may go without one."""
    tok = ctx.tokenizer
    if tok.json_path is None:
        home = ctx.target_dir if ctx.target_dir is not None else ctx.draft_path
        if ctx.random_weights():
            raise _Skip(f"{home} holds explicitly random test weights ({RANDOM_WEIGHTS_KEY}): bytes stand in for text")
        if ctx.target_dir is None:
            raise _Skip(f"{NEEDS_TARGET}: no {TOKENIZER_FILE} in the draft dir")
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
        raise _Skip("a tokenizer file is a Git LFS pointer: see lfs-pointers")
    problems = list(tok.problems)
    for role in ("bos", "eos", "pad", "mask", "unk") if tok.tokenizer is not None else ():
        s = _token_string(tok.config.get(f"{role}_token"))
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
            v = _as_int(_text_config(raw).get("vocab_size")) if raw is not None else None
            if v is not None and n > v:
                problems.append(
                    Problem(
                        f"{tok.json_path} has {n} tokens but the {who} vocab_size is {v}: ids >= {v} have no "
                        "embedding row",
                        "use the tokenizer that belongs to the target model",
                    )
                )
    return problems


def _tokenizer_ids(ctx: _Context) -> dict[str, tuple[str, int]]:
    """role -> (token, id) for the special tokens the tokenizer declares (mask also found by name)."""
    tok = ctx.tokenizer
    if tok.lfs or (tok.tokenizer is None and not tok.config):
        return {}
    out: dict[str, tuple[str, int]] = {}
    for role in ("bos", "eos", "pad", "mask"):
        s = _token_string(tok.config.get(f"{role}_token"))
        tid = tok.token_id(s) if s is not None else None
        if s is not None and tid is not None:
            out[role] = (s, tid)
    if "mask" not in out:
        masks = [(c, i) for i, c in tok.added_tokens().items() if "mask" in c.lower()]
        if len(masks) == 1:
            out["mask"] = masks[0]
    return out


def check_special_tokens(ctx: _Context) -> list[Problem]:
    """mask/bos/eos/pad ids are in the vocabulary and agree between draft, target and tokenizer."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    v = ctx.vocab()
    mask, problems = _mask_id(raw.get("mask_token_id"), src, v)
    draft_ids = {r: _id_set(raw.get(f"{r}_token_id")) for r in ("bos", "eos", "pad")}
    for role, ids in draft_ids.items():
        for i in sorted(ids):
            if not 0 <= i < v:
                problems.append(
                    Problem(f"{src}: {role}_token_id {i} is outside [0, {v})", f"set {role}_token_id to the target's")
                )
    target_ids: dict[str, set[int]] = {}
    if ctx.target_dir is not None and ctx.target_config_read[0] is not None:
        t = ctx.target()
        target_ids = {r: _id_set(t.get(f"{r}_token_id")) for r in ("bos", "eos", "pad")}
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
    if _as_int(mask) is None:
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
    ctx: _Context, mask: int | None, draft_ids: dict[str, set[int]], target_ids: dict[str, set[int]]
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


def _rope(d: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(uses YaRN, {key: value}) with the defaults the config classes use for absent keys."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        params = {}
    kind = params.get("rope_type", params.get("type", "default"))
    defaults = {"factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    values: dict[str, Any] = {}
    for key in YARN_KEYS:
        if key == "rope_theta":
            value = params.get("rope_theta", d.get("rope_theta", 10000.0))
        else:
            value = params.get(key, defaults.get(key))
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


def check_yarn(ctx: _Context) -> list[Problem]:
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


def check_target_layer_ids(ctx: _Context) -> list[Problem]:
    """target_layer_ids are strictly increasing, inside the target's depth, and not its last layer."""
    raw = ctx.raw()
    src = ctx.draft_dir / "config.json"
    ids = raw.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or any(_as_int(i) is None for i in ids):
        return [
            Problem(
                f"{src}: target_layer_ids = {ids!r} must be a non-empty list of integers",
                "set target_layer_ids to the target layers the draft was trained on (Kimi-K3-DSpark: "
                "[2, 23, 47, 71, 89])",
            )
        ]
    problems = []
    archs = raw.get("architectures")
    gqa = isinstance(archs, list) and "Qwen3DSparkModel" in archs
    declared = _as_int(raw.get("num_target_layers" if gqa else "target_num_hidden_layers"))
    depth = declared
    if ctx.target_dir is not None and ctx.target_config_read[0] is not None:
        depth = _as_int(ctx.target().get("num_hidden_layers")) or declared
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


def check_hidden_size(ctx: _Context) -> list[Problem]:
    """The target's hidden_size equals the draft's target_hidden_size (the width of each tap)."""
    t = ctx.target()
    raw = ctx.raw()
    th = _as_int(t.get("hidden_size"))
    dth = _as_int(raw.get("target_hidden_size")) or _as_int(raw.get("hidden_size"))
    if th is None or dth is None or th == dth:
        return []
    return [
        Problem(
            f"the target hidden_size is {th} but the draft's target_hidden_size is {dth}",
            "pair the draft with the target it was trained for (context_proj reads taps of width target_hidden_size)",
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


def check_bf16(ctx: _Context) -> list[Problem]:
    """Every floating weight of the draft (and its own lm_head) is finite and representable in bf16."""
    ctx.raw()
    scans = [s for s in (ctx.draft_scan, ctx.lm_head_scan) if s is not None and not s.problems]
    if not scans:
        raise _Skip("the draft weights are unreadable: see lfs-pointers / safetensors")
    problems = []
    for scan in scans:
        for name in sorted(scan.infos):
            info = scan.infos[name]
            if info.dtype in ("F16", "BF16", "F32", "F64"):
                p = _scan_values(info.file, name, info)
                if p is not None:
                    problems.append(p)
    return problems


def _head_presence(ctx: _Context, prefix: str) -> tuple[list[str], list[str]]:
    """(expected names missing from the checkpoint, checkpoint names with this prefix)."""
    found = ctx.tensors()
    expected = [n for n in ctx.draft_roster if n.startswith(prefix)]
    present = sorted(n for n in found if n.startswith(prefix))
    return [n for n in expected if n not in found], present


def check_confidence_head(ctx: _Context) -> list[Problem]:
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


def check_markov_head(ctx: _Context) -> list[Problem]:
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


def _mla_roster(raw: dict[str, Any], src: Path) -> dict[str, TensorSpec]:
    try:
        cfg = TargetConfig.from_dict(raw, source=str(src))
    except (ConfigError, TypeError, ValueError) as e:
        raise _Skip(f"the target config.json does not parse ({e})") from e
    from dspark.models.loading import target_roster

    roster = target_roster(cfg)
    if raw.get("tie_word_embeddings"):
        roster.pop("lm_head.weight", None)
    return roster


def _kimi_roster(raw: dict[str, Any], target_dir: Path) -> dict[str, TensorSpec]:
    """Our kimi_linear roster (K3's additions included, which transformers' class lacks); no model import."""
    from dspark.models.loading import _dense_prefix, kimi_roster

    try:
        cfg = KimiLinearConfig.from_dict(raw, source=str(target_dir / "config.json"))
    except (ConfigError, TypeError, ValueError) as e:
        raise _Skip(f"the target config.json does not parse ({e})") from e
    return kimi_roster(cfg, _dense_prefix(target_dir, cfg))


def _hf_roster(raw: dict[str, Any]) -> dict[str, TensorSpec]:
    """The tensors transformers' model class for this config holds (built on the meta device)."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark.checkpoint.roster import module_roster

    mt = raw.get("model_type")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.for_model(mt, **{k: v for k, v in raw.items() if k != "model_type"})
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers raises many types for configs it cannot build
        raise _Skip(f"transformers cannot build model_type {mt!r} to list its tensors ({type(e).__name__})") from e
    return module_roster(model)


def check_target_roster(ctx: _Context) -> list[Problem]:
    """Every tensor the target's config.json implies is in its checkpoint, with its shape: our roster for MLA
    and kimi_linear targets (strict), transformers' model class for the others (missing / wrong shape;
    transformers would otherwise initialize a missing tensor at random and only warn)."""
    raw = ctx.target()
    assert ctx.target_dir is not None
    found = ctx.target_tensors()
    if raw.get("model_type", "deepseek_v3") in MLA_TARGET_TYPES:
        expected = _mla_roster(raw, ctx.target_dir / "config.json")
        report = compare_roster(
            expected, found, ignore_unexpected=("model.layers.*.mlp.experts.*.*_scale*", "lm_head.*")
        )
    elif raw.get("model_type") == "kimi_linear":
        report = compare_roster(_kimi_roster(raw, ctx.target_dir), found, ignore_unexpected=("*_scale*",))
    else:
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


def check_dtype(ctx: _Context) -> list[Problem]:
    """Half-precision tensors agree with each other and with config.json's torch_dtype (draft and target)."""
    scans: list[tuple[dict[str, Any] | None, _Scan | None, str]] = []
    if ctx.has_draft and ctx.draft_dir.is_dir():
        raw = ctx.draft_config_read[0]
        scans += [(raw, ctx.draft_scan, f"draft {ctx.draft_scan.path}"), (raw, ctx.lm_head_scan, "")]
    if ctx.target_dir is not None:
        raw = ctx.target_config_read[0]
        scans.append((_text_config(raw) if raw else None, ctx.target_scan, f"target {ctx.target_dir}"))
    problems = []
    for raw, scan, who in scans:
        if scan is not None and not scan.problems:
            problems += _dtype_problems(raw, scan.infos, who or str(scan.path))
    return problems


def _latent_width(d: Mapping[str, Any], gqa: bool) -> int | None:
    """Values cached per token per layer: MLA kv_lora_rank + qk_rope_head_dim; GQA [k | v] = 2·kvH·head_dim."""
    if gqa:
        kv, hd = _as_int(d.get("num_key_value_heads")), _as_int(d.get("head_dim"))
        return 2 * kv * hd if kv and hd else None
    c, r = _as_int(d.get("kv_lora_rank")), _as_int(d.get("qk_rope_head_dim"))
    return c + r if c and r else None


def check_kv_cache(ctx: _Context) -> list[Problem]:
    """An MLA target shares its latent pages with the draft: the draft's cached row must have the same width."""
    t = ctx.target()
    cfg = ctx.cfg()
    if t.get("model_type", "deepseek_v3") not in MLA_TARGET_TYPES:
        return []  # the target recomputes its prefix; the pool holds the draft's rows only
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


def _kv_note(ctx: _Context) -> str | None:
    raw = ctx.draft_config_read[0] if ctx.has_draft else None
    if raw is None:
        return None
    archs = raw.get("architectures")
    gqa = isinstance(archs, list) and "Qwen3DSparkModel" in archs
    width, layers = _latent_width(raw, gqa), _as_int(raw.get("num_hidden_layers"))
    if width is None or layers is None:
        return None
    return (
        f"draft KV cache: {layers} layers x {width} values x 2 B (bf16) = {layers * width * 2:,} B per token, "
        "in the target's pages (one block table per request)"
    )


# ---------------------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[_Context], list[Problem]]
    title: str
    step: int  # the deployment step (STEPS) it belongs to


# The six deployment steps of the Kimi-K3-DSpark card, in order; steps 5 and 6 are what to do next.
STEPS: tuple[tuple[int, str], ...] = (
    (1, "load the draft weights: model.safetensors + lm_head.safetensors, shapes and vocabulary"),
    (2, "layer mapping: target_layer_ids into the target's layers"),
    (3, "KV cache and YaRN: shared latent pages, rotary parameters identical to the target's"),
    (4, "confidence head + Markov head enabled"),
    (5, "lossless acceptance: target-only and speculative output must be identical token by token"),
    (6, "monitoring: acceptance rate, throughput (Prometheus at /metrics)"),
)

CHECKS: tuple[Check, ...] = (
    Check("draft-config", check_draft_config, "draft config.json parses as a DSpark draft config", 1),
    Check("target-config", check_target_config, "target config.json is readable", 1),
    Check("lfs-pointers", check_lfs_pointers, "no Git LFS pointer files in place of real files", 1),
    Check("safetensors", check_safetensors, "safetensors files match their headers", 1),
    Check("roster", check_roster, "draft tensor names, shapes and dtypes match config.json", 1),
    Check("target-roster", check_target_roster, "every tensor of the target's config is in its checkpoint", 1),
    Check("dtype", check_dtype, "half-precision tensors all of the torch_dtype config.json declares", 1),
    Check("bf16", check_bf16, "weights finite and representable in bf16", 1),
    Check("vocab", check_vocab, "vocab_size matches embedding/lm_head rows and the target", 1),
    Check("lm-head", check_lm_head, "an lm_head [vocab, hidden] is available (own file or the target's)", 1),
    Check("embedding", check_embedding, "the target's embedding is [vocab, draft hidden]", 1),
    Check("tokenizer", check_tokenizer, "the target's tokenizer.json found, loadable and within the vocabulary", 1),
    Check("special-tokens", check_special_tokens, "mask/bos/eos/pad ids agree with each other and the vocab", 1),
    Check("target-layer-ids", check_target_layer_ids, "target_layer_ids increasing, inside the target, not last", 2),
    Check("hidden-size", check_hidden_size, "target hidden_size == draft target_hidden_size", 2),
    Check("kv-cache", check_kv_cache, "draft cache rows as wide as the target's latent pages", 3),
    Check("yarn", check_yarn, "draft rotary/YaRN parameters equal the target's", 3),
    Check("confidence-head", check_confidence_head, "confidence head tensors match enable_confidence_head", 4),
    Check("markov-head", check_markov_head, "Markov head tensors present iff markov_rank > 0", 4),
)
# What generate/serve/LLM run before loading (headers and configs only; the finiteness scan runs over the loaded
# weights instead of bf16's second read from disk).
LOAD_CHECKS: tuple[str, ...] = tuple(c.name for c in CHECKS if c.name != "bf16")

# Step 6: what to watch in production (dspark serve exports vLLM's names).
METRICS: tuple[tuple[str, str], ...] = (
    ("vllm:spec_decode_num_drafts_total", "speculative rounds"),
    ("vllm:spec_decode_num_draft_tokens_total", "drafted tokens"),
    ("vllm:spec_decode_num_accepted_tokens_total", "accepted drafts; acceptance rate = accepted / draft tokens"),
    (
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "accepted per draft position {position}: a drop after position 0 points at layer mapping or precision",
    ),
    ("dspark:spec_decode_mean_acceptance_length", "τ = 1 + accepted / drafts"),
    ("vllm:generation_tokens_total", "end-to-end throughput (rate of this counter)"),
    ("vllm:kv_cache_usage_perc", "latent page usage"),
)


def _notes(ctx: _Context) -> dict[int, tuple[str, ...]]:
    """Facts and next steps per deployment step (never problems)."""
    notes: dict[int, list[str]] = {}
    kv = _kv_note(ctx) if ctx.has_draft else None
    if kv:
        notes.setdefault(3, []).append(kv)
    cfg = ctx.draft_cfg_parse[0] if ctx.has_draft and ctx.draft_config_read[0] is not None else None
    if cfg is not None:
        if cfg.enable_confidence_head:
            notes.setdefault(4, []).append(
                'serve with "enable_adaptive_verification": true so the confidence head sets the verify length'
            )
        else:
            notes.setdefault(4, []).append("no confidence head: adaptive verification is unavailable with this draft")
        if cfg.markov_rank == 0:
            notes.setdefault(4, []).append('markov_rank 0: run it as "method": "dflash"')
    notes[5] = (lossless_command(ctx),)
    notes[6] = tuple(f"{name}  ({what})" for name, what in METRICS)
    return {k: tuple(v) for k, v in notes.items()}


def lossless_command(ctx: _Context) -> str:
    target = str(ctx.target_dir) if ctx.target_dir is not None else "<target>"
    draft = str(ctx.draft_path) if ctx.draft_path is not None else "<draft>"
    spec = json.dumps({"method": "dspark", "model": draft, "num_speculative_tokens": 7})
    return f"dspark verify-lossless --model {target} --speculative-config '{spec}' --dataset <prompts.jsonl>"


def run_checks(
    draft_dir: str | Path | None,
    target_dir: str | Path | None = None,
    *,
    only: tuple[str, ...] | None = None,
) -> CheckReport:
    """Run the checks (``only``: these names) on a draft and/or its target; never raises on broken input."""
    draft = Path(draft_dir) if draft_dir is not None else None
    ctx = _Context(draft, Path(target_dir) if target_dir is not None else None)
    problems: list[CheckProblem] = []
    passed: list[str] = []
    skipped: list[str] = []
    reasons: dict[str, str] = {}
    for check in CHECKS:
        if only is not None and check.name not in only:
            continue
        try:
            found = check.run(ctx)
        except _Skip as s:
            skipped.append(check.name)
            reasons[check.name] = s.reason
            continue
        except Exception as e:  # a check must never take the doctor down; report it as a problem instead
            found = [
                Problem(
                    f"the check could not complete: {type(e).__name__}: {e}",
                    "fix the problems reported above and re-run; if it persists, report this as a dspark bug",
                )
            ]
        if found:
            problems += [CheckProblem(check.name, p.message, p.fix) for p in found]
        else:
            passed.append(check.name)
    return CheckReport(tuple(problems), tuple(passed), tuple(skipped), reasons, _notes(ctx), draft, ctx.target_dir)


def report_json(report: CheckReport) -> dict[str, Any]:
    """The ``check --json`` schema: ``{"ok": bool, "problems": [{"check", "message", "fix"}]}`` (all str), plus
    ``steps``: the six deployment steps in order, each with its checks' status and notes."""
    return {
        "ok": report.ok,
        "problems": [{"check": p.check, "message": p.message, "fix": p.fix} for p in report.problems],
        "steps": [
            {
                "step": n,
                "title": title,
                "checks": {c.name: _status(report, c.name) for c in CHECKS if c.step == n and _status(report, c.name)},
                "notes": list(report.notes.get(n, ())),
            }
            for n, title in STEPS
        ],
    }


def _status(report: CheckReport, name: str) -> str:
    if any(p.check == name for p in report.problems):
        return "problem"
    return "passed" if name in report.passed else "skipped" if name in report.skipped else ""


def _problem_line(p: CheckProblem, bad_mark: str, dash: str) -> str:
    """``  ✖ check: message – fix: fix``; a multi-line message keeps its lines indented under it, the fix last."""
    if "\n" not in p.message:
        return f"  {bad_mark} {p.check}: {p.message} {dash} fix: {p.fix}"
    message = p.message.replace("\n", "\n      ")
    return f"  {bad_mark} {p.check}: {message}\n    {dash} fix: {p.fix}"


def format_report(report: CheckReport, *, ascii_only: bool = False) -> str:
    """Human output in the six deployment steps: ✔ per passed check, ✖ + fix per problem, – per skipped check
    (and why), then each step's notes (step 5: the command to run next; step 6: the metrics to watch).

    Every problem is printed: one found before the checks could run (a model reference that names nothing, check
    ``model-reference``, or any check outside the table) comes first; when nothing else ran, the steps are left
    out (they would list checks that never looked at anything)."""
    ok_mark, bad_mark, dash = ("OK", "X", "-") if ascii_only else ("✔", "✖", "–")
    names = {c.name for c in CHECKS}
    by_check: dict[str, list[CheckProblem]] = {}
    for p in report.problems:
        by_check.setdefault(p.check, []).append(p)
    lines = [_problem_line(p, bad_mark, dash) for p in report.problems if p.check not in names]
    ran = bool(report.passed or report.skipped or any(p.check in names for p in report.problems))
    for n, title in STEPS if ran else ():
        lines.append(f"[{n}/6] {title}")
        for check in (c for c in CHECKS if c.step == n):
            if check.name in report.passed:
                lines.append(f"  {ok_mark} {check.name}: {check.title}")
            lines += [_problem_line(p, bad_mark, dash) for p in by_check.get(check.name, [])]
            if check.name in report.skipped:
                lines.append(f"  {dash} {check.name}: skipped ({report.skip_reasons.get(check.name, 'not run')})")
        lines += [f"    {note}" for note in report.notes.get(n, ())]
    n_checks = len(report.passed) + len(by_check)
    skipped = f", {len(report.skipped)} skipped" if report.skipped else ""
    if report.ok:
        lines.append(f"{ok_mark} all {n_checks} checks passed{skipped}")
    else:
        n = len(report.problems)
        lines.append(
            f"{bad_mark} {n} problem{'s' if n != 1 else ''} in {len(by_check)} of {n_checks} checks{skipped}"
            + ("" if ran else ": nothing else could be checked")
        )
    return "\n".join(lines)
