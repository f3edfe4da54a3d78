"""One drafter data pipeline: ``dspark draft-data --source corpus|sharegpt|sharegpt-text|instructions-hf`` over one
``DraftDataConfig``. A default that differs by source comes from one table (and the help shows it), a setting the
source does not read is refused naming the sources that read it, a manifest's config reads back into the same config,
and the former subcommands answer with the new spelling."""

from __future__ import annotations

import pytest

from dspark.cli import RENAMED, build_parser, main
from dspark.train.draft_data import ALWAYS_READ, READS, SOURCE_DEFAULTS, SOURCES, DraftDataConfig, config_from_manifest


def test_each_source_takes_its_defaults_from_the_one_table():
    for source in SOURCES:
        cfg = DraftDataConfig(source=source)
        assert {name: getattr(cfg, name) for name in SOURCE_DEFAULTS[source]} == SOURCE_DEFAULTS[source]
        assert set(SOURCE_DEFAULTS[source]) <= set(READS[source]) | set(ALWAYS_READ)  # a default it reads
    assert DraftDataConfig(source="sharegpt", max_new_tokens=7).max_new_tokens == 7  # a given value wins
    assert DraftDataConfig().source == "corpus"


def test_a_setting_the_source_does_not_read_is_refused_naming_who_reads_it():
    with pytest.raises(ValueError, match=r"max_context = 4096: --source sharegpt does not read it.*--source corpus"):
        DraftDataConfig(source="sharegpt", max_context=4096)
    with pytest.raises(ValueError, match=r"temperatures.*corpus / instructions-hf.*drop --temperatures"):
        DraftDataConfig(source="sharegpt", temperatures=(0.0,))
    with pytest.raises(ValueError, match="drop --taps"):
        DraftDataConfig(source="corpus", tap_layers=(1, 2))
    with pytest.raises(ValueError, match="source = 'wiki'"):
        DraftDataConfig(source="wiki")


def test_the_command_refuses_before_building_anything(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["draft-data", "--source", "sharegpt-text", "--max-context", "64", "--out-dir", str(out)]) == 1
    assert "--max-context" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["draft-data", "--source", "wiki"])


def test_the_help_shows_each_sources_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["draft-data", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for source in ("corpus", "sharegpt", "instructions-hf"):
        assert f"{source}: {SOURCE_DEFAULTS[source]['max_new_tokens']}" in text


def test_a_manifests_config_reads_back_the_same():
    for cfg in (DraftDataConfig(temperatures=(0.5, 0.0), max_context=512), DraftDataConfig(source="sharegpt")):
        assert config_from_manifest(cfg.to_json(), cfg.source) == cfg
    old = {"target": "t", "source": None, "max_new_tokens": 12, "shard_size": 8}  # written before --sharegpt-file
    cfg = config_from_manifest(old | {"source": "/data/sg.json"}, "sharegpt")
    assert (cfg.source, cfg.sharegpt_file, cfg.max_new_tokens, cfg.shard_size) == ("sharegpt", "/data/sg.json", 12, 8)
    assert config_from_manifest(old, "sharegpt").sharegpt_file is None


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_former_subcommand_names_its_new_spelling(old, capsys):
    assert main([old, "--target", "x"]) == 2
    assert f"now `dspark {RENAMED[old]}`" in capsys.readouterr().err
