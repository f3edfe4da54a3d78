"""The family registry (``dspark.models.families``) is the one place that reads what a model is: no other module
reads ``model_type`` / ``architectures`` (as an attribute, a key or a string), and every registered family carries
what the rest of the package asks of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dspark
from dspark.models.families import FAMILIES, GQA, KIMI_LINEAR, MLA, family_of, is_gqa_drafter
from dspark.models.tiny import tiny_draft_config, tiny_gqa_config, tiny_hybrid_config, tiny_target_config

PACKAGE = Path(dspark.__file__).resolve().parent
NAMES = ("model_type", "architectures")

# Where these names may appear, and why. Keep it short: a new entry needs a reason of the same kind.
ALLOWED = {
    "models/families.py": "the registry: family_of and the readers of the names",
    "config/": "the config classes define, parse and write their own config.json keys (from_dict, to_hf_dict, KEYS)",
    "serve/errors.py": "pydantic's validation error type 'model_type', not a config key",
}


def reads(source: str) -> list[tuple[int, str]]:
    """(line, what) for every ``x.model_type`` / ``x.architectures`` and every string literal equal to one of the
    names (``d["model_type"]``, ``d.get("architectures")``, ``{"model_type": ...}``, ``"model_type" in d``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in NAMES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and node.value in NAMES:
            found.append((node.lineno, repr(node.value)))
    return found


def allowed(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in ALLOWED)


def test_the_finder_sees_every_kind_of_read():
    planted = (
        "a = cfg.model_type\n"
        "b = raw['architectures']\n"
        "c = raw.get('model_type')\n"
        "d = {'architectures': []}\n"
        "e = 'model_type' in raw\n"
        "f = cfg.model_types  # another name\n"
        "g = 'a model_type in a sentence'\n"
        "def model_type(x): return x\n"
    )
    assert [line for line, _ in reads(planted)] == [1, 2, 3, 4, 5]


def test_no_module_reads_model_type_or_architectures_outside_the_registry():
    found = [
        f"{rel}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not allowed(rel := path.relative_to(PACKAGE).as_posix())
        for line, what in reads(path.read_text())
    ]
    assert found == [], "ask dspark.models.families (family_of, model_type, architectures, a Family field) instead"


def test_every_allowlisted_path_exists():
    assert all((PACKAGE / p).exists() for p in ALLOWED)


@pytest.mark.parametrize(
    ("make", "family"),
    [(tiny_target_config, MLA), (tiny_gqa_config, GQA), (tiny_hybrid_config, KIMI_LINEAR)],
    ids=["mla", "gqa", "kimi_linear"],
)
def test_a_target_family_builds_the_model_and_shapes_a_drafter_that_shares_its_pages(make, family):
    """family_of agrees on the parsed config and its config.json; the family's drafter shape gives a drafter whose
    page format is the target's, so both share one pool."""
    cfg = make()
    raw = cfg.to_hf_dict() if hasattr(cfg, "to_hf_dict") else None
    assert family_of(cfg) is family and isinstance(cfg, family.config)
    if raw is not None:
        assert family_of(raw) is family
    target = family.build(cfg)
    drafter = FAMILIES["dspark"].build(_draft_for(cfg))
    assert drafter.page_format.compatible(target.page_format)


def _draft_for(cfg):
    from dspark.train.draft_config import draft_config_for

    return draft_config_for(cfg, num_layers=1, markov_rank=8, taps=(0,))


def test_the_draft_family_is_known_by_architecture_and_its_backbone_by_the_first_one():
    d = tiny_draft_config(tiny_target_config())
    raw = d.to_dict()
    assert family_of(raw) is FAMILIES["dspark"] is family_of(d)
    assert not is_gqa_drafter(raw)
    assert is_gqa_drafter(_draft_for(tiny_gqa_config()).to_dict())
    assert not is_gqa_drafter({"architectures": "Qwen3DSparkModel"})  # not a list: no backbone


def test_every_family_carries_what_the_package_asks():
    for f in FAMILIES.values():
        assert f.model_types and callable(f.build) and callable(f.roster)
        if f.is_target:
            assert f.load is not None and f.drafter is not None, f.name
        assert all(family_of({"model_type": t}) is f for t in f.model_types if f.is_target)
    assert [f.name for f in FAMILIES.values() if f.quantizable] == [GQA.name]


def test_the_drafter_has_one_backbone_per_draft_architecture():
    from dspark.config import DRAFT_ARCHITECTURES
    from dspark.models.drafter import BACKBONES

    assert sorted(BACKBONES) == sorted(DRAFT_ARCHITECTURES)
