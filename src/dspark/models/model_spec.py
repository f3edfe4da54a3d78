"""A model directory read once: ``ModelSpec``.

``model_spec(path)`` reads config.json, picks the family (``dspark.models.families.family_of``) and returns a frozen
spec; the parsed config, the checkpoint's tensor table (safetensors headers), the transformers config and the
tokenizer are read from it on first use and kept. The resolver hands specs on, and the doctor, the loaders, the
tokenizer and the bench read the model through them.

Inside ``one_read_per_model()`` (what ``build_engines``, ``run_checks`` and ``run_bench`` run in: one command)
every request for the same directory gets the same spec, so each file is read once however many layers ask.
Outside it, ``model_spec`` reads afresh each time, as a plain function call would.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dspark.checkpoint.io import LFS_POINTER_PREFIX, CheckpointError, Problem, TensorInfo, list_checkpoint_tensors
from dspark.checkpoint.resolve import resolve_model_ref
from dspark.config import ConfigError
from dspark.models.families import Family, family_of, model_type

CONFIG_FILE = "config.json"


class ConfigFileError(ConfigError):
    """config.json is absent or unreadable: ``problem`` says what, ``fix`` what to do (the doctor prints both)."""

    def __init__(self, problem: str, fix: str, *, lfs: bool = False) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
        self.lfs = lfs  # the file is a Git LFS pointer


def read_config_file(file: Path) -> dict[str, Any]:
    """A config.json as a dict, from one read of the file; ``ConfigFileError`` when it cannot be used."""
    if not file.is_file():
        raise ConfigFileError(f"{file} is missing", "copy config.json from the model's repository into the directory")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"{file} cannot be read ({e})", "check its permissions or re-download it") from e
    if data.startswith(LFS_POINTER_PREFIX):
        raise ConfigFileError(f"{file} is a Git LFS pointer file, not the config", "run `git lfs pull`", lfs=True)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigFileError(f"{file} is not valid JSON ({e})", "fix the file or re-download it") from e
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{file} holds a JSON {type(raw).__name__}, not an object", "re-download the file")
    return raw


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """One model, read once: its directory, its config.json and its family; the rest is read on first use."""

    path: Path  # the model directory (for `dspark roster`, possibly a config file itself)
    raw: Mapping[str, Any]  # config.json as read (read-only)
    family: Family | None  # None: a target no native family serves (transformers runs it)

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE if self.path.is_dir() else self.path

    @property
    def is_target(self) -> bool:
        return self.family is not None and self.family.is_target

    @cached_property
    def config(self) -> Any:
        """The family's config dataclass (TargetConfig, GQATargetConfig, KimiLinearConfig or DraftConfig)."""
        if self.family is None:
            raise ConfigError(
                f"{self.config_file}: model_type {model_type(self.raw)!r} has no native dspark family; only "
                "transformers serves it (dspark.models.hf_target)"
            )
        return self.family.config.from_dict(self.raw, source=str(self.config_file))

    @cached_property
    def weight_scan(self) -> tuple[Mapping[str, TensorInfo], tuple[Problem, ...]]:
        """The checkpoint's tensor table from its safetensors headers, or the problems that prevent reading it."""
        try:
            return MappingProxyType(list_checkpoint_tensors(self.directory)), ()
        except CheckpointError as e:
            return MappingProxyType({}), e.problems

    @property
    def weights(self) -> Mapping[str, TensorInfo]:
        """Every tensor of the checkpoint (name -> dtype, shape, file); CheckpointError when unreadable."""
        infos, problems = self.weight_scan
        if problems:
            raise CheckpointError(problems)
        return infos

    @cached_property
    def hf_config(self) -> Any:
        """The transformers config of this directory, built from the dict already read (as AutoConfig would)."""
        from transformers import CONFIG_MAPPING, PreTrainedConfig

        d = dict(self.raw)
        config_class = CONFIG_MAPPING[model_type(d)] if model_type(d) in CONFIG_MAPPING else None
        try:
            config = (config_class or PreTrainedConfig).from_dict(d)
        except (ValueError, TypeError):
            config = PreTrainedConfig.from_dict(d)
        config.name_or_path = str(self.directory)
        return config

    @cached_property
    def tokenizer_backend(self) -> Any:
        """``transformers.AutoTokenizer`` for this directory, given ``hf_config`` so config.json is not read again;
        the exceptions transformers raises pass through (dspark.tokenizer names the fix)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True, config=self.hf_config)


_SPECS: ContextVar[dict[tuple[str, int, int, int], ModelSpec] | None] = ContextVar("dspark_model_specs", default=None)


@contextmanager
def one_read_per_model() -> Iterator[None]:
    """One command: inside, ``model_spec`` returns the same spec for the same directory (while its config.json is
    unchanged); a nested block shares the outer one."""
    if _SPECS.get() is not None:
        yield
        return
    token = _SPECS.set({})
    try:
        yield
    finally:
        _SPECS.reset(token)


def resolve_spec(ref: str | os.PathLike[str], *, role: str = "model") -> ModelSpec:
    """A model reference (directory, .gguf file, alias, bundled name, hub id in the local caches) as its spec."""
    return model_spec(resolve_model_ref(ref, role=role))


def model_directory(model: str | os.PathLike[str] | ModelSpec) -> Path:
    """The directory of a model given as a path or a spec (nothing is read)."""
    return model.directory if isinstance(model, ModelSpec) else Path(model)


def model_spec(path: str | os.PathLike[str] | ModelSpec) -> ModelSpec:
    """The model at ``path`` (a directory holding config.json, or a config file): config.json read and its family
    chosen; ConfigFileError when config.json is missing or unreadable. A spec is returned as it is."""
    if isinstance(path, ModelSpec):
        return path
    p = Path(path)
    file = p / CONFIG_FILE if p.is_dir() else p
    cache = _SPECS.get()
    if cache is None:
        return _read(p, file)
    try:
        st = file.stat()
    except OSError:
        return _read(p, file)  # missing: the reader names it
    key = (str(file.resolve()), st.st_mtime_ns, st.st_size, st.st_ino)
    if key not in cache:
        cache[key] = _read(p, file)
    return cache[key]


def _read(path: Path, file: Path) -> ModelSpec:
    raw = read_config_file(file)
    return ModelSpec(path, MappingProxyType(raw), family_of(raw))
