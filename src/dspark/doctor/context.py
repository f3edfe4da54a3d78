"""What the doctor's checks read, each read once and lazily and never raising: the draft's and the target's
``ModelSpec`` (config.json as raw JSON first, the family, the checkpoint's tensor table from its headers: the same
spec the loader then takes, inside one command), the tokenizer files, and ``Context``, which hands them to the
checks. A check that lacks an input raises ``Skip`` with the reason."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from dspark.checkpoint.io import CheckpointError, Problem, TensorInfo, is_lfs_pointer, list_checkpoint_tensors
from dspark.checkpoint.roster import RosterReport, TensorSpec, compare_roster
from dspark.config import DRAFT_ARCHITECTURES, RANDOM_WEIGHTS_KEY, ConfigError, DraftConfig
from dspark.doctor.rootcause import RootCause, config_ints, find_root_cause
from dspark.models.families import Family, architectures, is_gqa_drafter
from dspark.models.model_spec import ConfigFileError, ModelSpec, model_spec

LM_HEAD_FILE = "lm_head.safetensors"
HEADS = ("markov_head.", "confidence_head.")  # presence checked by their own checks, not by the roster
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # fast tokenizer, or a SentencePiece model


class Skip(Exception):
    """A check cannot run: its inputs are absent (e.g. no --target) or broken (reported by another check)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


NEEDS_TARGET = "needs --target"
NO_DRAFT = "no draft model"


def as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def id_set(v: Any) -> set[int]:
    """A token id field (int, list of ints, or null) as a set."""
    if as_int(v) is not None:
        return {v}
    if isinstance(v, list):
        return {i for i in v if as_int(i) is not None}
    return set()


@dataclass(frozen=True)
class SpecRead:
    """A model directory's spec, or the problem that prevents reading its config.json."""

    spec: ModelSpec | None
    problem: Problem | None = None
    lfs: bool = False  # config.json is a Git LFS pointer

    @property
    def raw(self) -> dict[str, Any] | None:
        return dict(self.spec.raw) if self.spec is not None else None


def read_spec(d: Path) -> SpecRead:
    """The spec of directory d (config.json read once per command, shared with the loader)."""
    if not d.is_dir():
        what = "is not a directory" if d.exists() else "does not exist"
        fix = "pass a model directory holding config.json and model.safetensors"
        return SpecRead(None, Problem(f"{d} {what}", fix))
    try:
        return SpecRead(model_spec(d))
    except ConfigFileError as e:
        return SpecRead(None, Problem(e.problem, e.fix), e.lfs)


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's keys in text_config; top-level keys fill the gaps."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in raw:
        return {k: v for k, v in raw.items() if k != "text_config"} | text
    return raw


def roster_view(raw: dict[str, Any]) -> dict[str, Any]:
    """The draft config with the keys that do not affect the tensor roster made valid, so that a bad mask id
    or bad layer ids are reported by their own checks instead of preventing the roster check."""
    d = dict(raw)
    ids = d.get("target_layer_ids")
    n = len(ids) if isinstance(ids, list) and ids else 1
    d["target_layer_ids"] = list(range(n))
    d["target_num_hidden_layers"] = n + 1
    if is_gqa_drafter(d):
        d["num_target_layers"] = n + 1
    d["mask_token_id"] = 0
    d.pop("draft_vocab_size", None)
    return d


def draft_report(cfg: DraftConfig, found: Mapping[str, TensorInfo]) -> RosterReport:
    """The draft checkpoint's tensors against the roster of ``cfg`` (an embedding copy is optional; an lm_head and
    the heads are checked elsewhere)."""
    from dspark.models.families import draft_roster

    expected = draft_roster(cfg, include_embedding="embed_tokens.weight" in found)
    report = compare_roster(expected, found, ignore_unexpected=("lm_head.weight",) + tuple(h + "*" for h in HEADS))
    return replace(report, missing=tuple(n for n in report.missing if not n.startswith(HEADS)))


@dataclass(frozen=True)
class Scan:
    """A checkpoint's tensors read from its headers, or the problems that prevented it."""

    path: Path
    infos: Mapping[str, TensorInfo]
    problems: tuple[Problem, ...]


def scan_checkpoint(path: Path, spec: ModelSpec | None = None) -> Scan:
    """The tensors of a checkpoint: its spec's table (read once per command) when the spec could be read."""
    if spec is not None:
        return Scan(path, *spec.weight_scan)
    try:
        return Scan(path, list_checkpoint_tensors(path), ())
    except CheckpointError as e:
        return Scan(path, {}, e.problems)


@dataclass(frozen=True)
class TokenizerFiles:
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


def token_string(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def load_tokenizer_files(dirs: list[Path]) -> TokenizerFiles:
    json_path = next((d / TOKENIZER_FILE for d in dirs if (d / TOKENIZER_FILE).is_file()), None)
    home = [json_path.parent] if json_path is not None else []
    config_path = next((d / TOKENIZER_CONFIG_FILE for d in home + dirs if (d / TOKENIZER_CONFIG_FILE).is_file()), None)
    found = [p for p in (json_path, config_path) if p is not None]
    if any(is_lfs_pointer(p) for p in found):
        return TokenizerFiles(json_path, config_path, lfs=True)
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
    return TokenizerFiles(json_path, config_path, tok, config, tuple(problems))


class Context:
    """Everything the checks read, each read once and lazily; reading never raises."""

    def __init__(self, draft_dir: Path | None, target_dir: Path | None) -> None:
        self._draft_dir = draft_dir
        self.target_dir = target_dir

    @property
    def draft_dir(self) -> Path:
        if self._draft_dir is None:
            raise Skip(NO_DRAFT)
        return self._draft_dir

    @property
    def has_draft(self) -> bool:
        return self._draft_dir is not None

    @property
    def draft_path(self) -> Path | None:
        return self._draft_dir

    @cached_property
    def draft_spec(self) -> SpecRead:
        return read_spec(self.draft_dir)

    @cached_property
    def target_spec(self) -> SpecRead:
        return read_spec(self.target_dir) if self.target_dir is not None else SpecRead(None)

    @cached_property
    def draft_config_read(self) -> tuple[dict[str, Any] | None, Problem | None]:
        return self.draft_spec.raw, self.draft_spec.problem

    @cached_property
    def target_config_read(self) -> tuple[dict[str, Any] | None, Problem | None]:
        return self.target_spec.raw, self.target_spec.problem

    @cached_property
    def draft_cfg_parse(self) -> tuple[DraftConfig | None, Problem | None]:
        raw = self.draft_config_read[0]
        if raw is None:
            return None, None
        target_archs = self.draft_target_architectures
        if target_archs:
            where = self.draft_dir / "config.json"
            return None, Problem(
                f"{where}: architectures {target_archs} is a target model's config, not a DSpark drafter's "
                f"(expected one of {list(DRAFT_ARCHITECTURES)})",
                f"pass the drafter as DRAFT and this model as the target: dspark check DRAFT --target {self.draft_dir}",
            )
        try:
            return DraftConfig.from_dict(roster_view(raw), source=str(self.draft_dir / "config.json")), None
        except (ConfigError, TypeError, ValueError) as e:
            return None, Problem(str(e), "fix config.json (compare with the official k3_dspark config)")

    @cached_property
    def draft_target_architectures(self) -> list[str]:
        """The draft's ``architectures`` when they name a target model (e.g. ``LlamaForCausalLM``: a target given
        as DRAFT), else [] (a drafter, or a config too broken to tell: draft-config says what is wrong)."""
        raw = self.draft_config_read[0]
        archs = architectures(raw) if raw is not None else []
        if not archs or any(a in DRAFT_ARCHITECTURES for a in archs):
            return []
        spec = self.draft_spec.spec
        known_family = spec is not None and spec.family is not None
        causal_lm = all(isinstance(a, str) and a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)
        return archs if known_family or causal_lm else []

    @cached_property
    def draft_scan(self) -> Scan:
        return scan_checkpoint(self.draft_dir, self.draft_spec.spec)

    @cached_property
    def lm_head_scan(self) -> Scan | None:
        p = self.draft_dir / LM_HEAD_FILE
        return scan_checkpoint(p) if p.exists() else None

    @cached_property
    def target_scan(self) -> Scan | None:
        if self.target_dir is None or not self.target_dir.is_dir():
            return None
        return scan_checkpoint(self.target_dir, self.target_spec.spec)

    @cached_property
    def tokenizer(self) -> TokenizerFiles:
        """The engine reads the tokenizer from the target directory; without --target, the draft's is checked."""
        home = self.target_dir if self.target_dir is not None else self._draft_dir
        return load_tokenizer_files([home] if home is not None and home.is_dir() else [])

    def random_weights(self) -> bool:
        """The target (or, without one, the draft) is marked as explicitly random test weights."""
        raw = self.target_config_read[0] if self.target_dir is not None else None
        if raw is None and self._draft_dir is not None:
            raw = self.draft_config_read[0]
        return bool(raw and raw.get(RANDOM_WEIGHTS_KEY) is True)

    @cached_property
    def draft_roster(self) -> dict[str, TensorSpec]:
        from dspark.models.families import draft_roster

        return draft_roster(self.cfg(), include_embedding=False)

    @cached_property
    def draft_report(self) -> RosterReport:
        """The draft checkpoint against the roster its config.json implies (Skip: either is unusable)."""
        return draft_report(self.cfg(), self.tensors())

    @cached_property
    def draft_cause(self) -> RootCause | None:
        """The one config.json key that explains the draft's roster disagreement (see dspark.doctor.rootcause)."""
        raw, cfg = self.raw(), self.cfg()
        values = config_ints(raw, cfg, DraftConfig.KEYS.read)
        return find_root_cause(values, raw, self.draft_report, list(self.tensors()), self._draft_retry)

    def _draft_retry(self, key: str, value: int) -> RosterReport | None:
        try:
            cfg = DraftConfig.from_dict(roster_view(self.raw() | {key: value}))
        except (ConfigError, TypeError, ValueError):
            return None
        return draft_report(cfg, self.tensors())

    def trust(self, key: str) -> None:
        """Skip the calling check when the draft's ``key`` is what disagrees with its weights (roster says so)."""
        try:
            cause = self.draft_cause
        except Skip:
            return
        if cause is not None and cause.key == key:
            raise Skip(f"the draft config.json's {key} does not match its weights: see roster")

    # ---- accessors that skip the calling check when an input is missing ----
    def raw(self) -> dict[str, Any]:
        raw = self.draft_config_read[0]
        if raw is None:
            raise Skip("the draft config.json is unusable: see draft-config")
        if self.draft_target_architectures:
            raise Skip("DRAFT is a target model: see draft-config")
        return raw

    def cfg(self) -> DraftConfig:
        self.raw()
        cfg = self.draft_cfg_parse[0]
        if cfg is None:
            raise Skip("the draft config.json does not parse: see draft-config")
        return cfg

    def target(self) -> dict[str, Any]:
        if self.target_dir is None:
            raise Skip(NEEDS_TARGET)
        raw = self.target_config_read[0]
        if raw is None:
            raise Skip("the target config.json is unusable: see target-config")
        return text_config(raw)

    def target_family(self) -> Family | None:
        """The target's native family (None: transformers serves it), as the loader will choose it."""
        self.target()
        assert self.target_spec.spec is not None
        return self.target_spec.spec.family

    def config_is_lfs_pointer(self, d: Path) -> bool:
        """Whether d/config.json is a Git LFS pointer, from the read the configs already had (no second open)."""
        if d == self._draft_dir:
            return self.draft_spec.lfs
        if d == self.target_dir:
            return self.target_spec.lfs
        return is_lfs_pointer(d / "config.json")

    def tensors(self) -> Mapping[str, TensorInfo]:
        """The draft model.safetensors tensors (from headers)."""
        self.raw()
        if self.draft_scan.problems:
            raise Skip("the draft weights are unreadable: see lfs-pointers / safetensors")
        return self.draft_scan.infos

    def target_tensors(self) -> Mapping[str, TensorInfo]:
        self.target()
        scan = self.target_scan
        if scan is None or scan.problems:
            raise Skip("the target weights are unreadable: see lfs-pointers / safetensors")
        return scan.infos

    def vocab(self) -> int:
        v = as_int(self.raw().get("vocab_size"))
        if v is None or v <= 0:
            raise Skip("the draft config has no valid vocab_size: see vocab")
        self.trust("vocab_size")
        return v

    def hidden(self) -> int:
        h = as_int(self.raw().get("hidden_size"))
        if h is None or h <= 0:
            raise Skip("the draft config has no valid hidden_size: see draft-config")
        self.trust("hidden_size")
        return h


def find_tensor(infos: Mapping[str, TensorInfo], suffix: str) -> str | None:
    """The shortest tensor name equal to or ending in ``.suffix`` (e.g. 'model.embed_tokens.weight')."""
    hits = [n for n in infos if n == suffix or n.endswith("." + suffix)]
    return min(hits, key=len) if hits else None
