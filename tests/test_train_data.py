"""Corpus, tokenizer and anchor/mask building blocks of DSpark training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.tokenizer import load_tokenizer
from dspark.train.anchors import (
    block_inputs,
    block_positions,
    block_targets,
    block_visibility,
    sample_anchors,
    valid_anchor_mask,
)
from dspark.train.corpus import (
    SPLITS,
    CorpusConfig,
    build_corpus,
    iter_documents,
    load_manifest,
    source_files,
    split_of,
)
from dspark.train.tokenizer import (
    SPECIAL_TOKENS,
    encode_corpus,
    format_chat,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)


def iter_source_files(cfg: CorpusConfig) -> list[Path]:
    """Paths of the corpus's .py files, in the deterministic order of their relative names."""
    return [path for _, path in source_files(cfg)]


UNICODE_CODE = (
    "def grüße(name: str) -> str:\n"
    '    """Say hello — in 日本語 too. 🎉"""\n'
    "\treturn f'héllo {name!r}'  # naïve, Ωmega\r\n"
    "\n\n    x = {'κ': 1, \"€\": [2, 3]}\n  "
)

# ----------------------------------------------------------------------------- corpus


def _make_source_tree(root: Path) -> dict[str, str]:
    """A fake source dir; returns the {relname: text} the corpus must contain."""
    pkg = root / "srcpkg"
    expected: dict[str, str] = {}
    for i in range(60):
        sub = pkg / f"mod{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        text = f"# module {i}\nVALUE_{i} = {i}\n" + UNICODE_CODE
        (sub / f"f{i}.py").write_text(text, encoding="utf-8")
        expected[f"srcpkg/mod{i % 4}/f{i}.py"] = text
    (pkg / "tests").mkdir()
    (pkg / "tests" / "test_x.py").write_text("assert True\n")
    (pkg / "mod0" / "test").mkdir()
    (pkg / "mod0" / "test" / "t.py").write_text("assert True\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "c.py").write_text("x = 1\n")
    (pkg / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
    (pkg / "big.py").write_text("x = 1\n" * 1000)  # 6000 bytes > max_file_bytes below
    (pkg / "notes.txt").write_text("not python\n")
    return expected


def test_split_of_is_deterministic_and_follows_fractions() -> None:
    cfg = CorpusConfig(val_fraction=0.1, test_fraction=0.2)
    names = [f"stdlib/pkg{i}/mod{i * 7}.py" for i in range(4000)]
    first = [split_of(n, cfg) for n in names]
    assert first == [split_of(n, cfg) for n in names]
    counts = {s: first.count(s) for s in SPLITS}
    assert abs(counts["test"] / 4000 - 0.2) < 0.03
    assert abs(counts["validation"] / 4000 - 0.1) < 0.03
    # Known value: the split depends only on sha256 of the name, never on process hash seeds.
    u = int.from_bytes(hashlib.sha256(b"stdlib/os.py").digest()[:8], "big") / 2.0**64
    expected = "test" if u < 0.2 else "validation" if u < 0.3 else "train"
    assert split_of("stdlib/os.py", cfg) == expected


def test_build_corpus_filters_splits_disjointly_and_reproducibly(tmp_path: Path) -> None:
    expected = _make_source_tree(tmp_path)
    cfg = CorpusConfig(
        sources=(f"dir:{tmp_path / 'srcpkg'}",), max_file_bytes=5000, val_fraction=0.2, test_fraction=0.2
    )
    manifest = build_corpus(tmp_path / "out", cfg)
    seen: dict[str, str] = {}
    for split in SPLITS:
        docs = list(iter_documents(tmp_path / "out" / f"{split}.jsonl"))
        assert [d["path"] for d in docs] == sorted(d["path"] for d in docs)
        for doc in docs:
            assert doc["path"] not in seen, f"{doc['path']} in two splits"
            assert split_of(doc["path"], cfg) == split
            seen[doc["path"]] = doc["text"]
        stats = manifest.splits[split]
        assert stats.files == len(docs) > 0
        assert stats.bytes == sum(len(d["text"].encode()) for d in docs)
        data = (tmp_path / "out" / f"{split}.jsonl").read_bytes()
        assert stats.sha256 == hashlib.sha256(data).hexdigest()
    assert seen == expected  # tests/, test/, __pycache__, non-UTF-8 and oversize files are excluded
    assert load_manifest(tmp_path / "out") == manifest
    before = {s: (tmp_path / "out" / f"{s}.jsonl").read_bytes() for s in SPLITS}
    build_corpus(tmp_path / "out2", cfg)
    assert before == {s: (tmp_path / "out2" / f"{s}.jsonl").read_bytes() for s in SPLITS}
    assert not list((tmp_path / "out").glob("*.tmp"))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["total_files"] == len(expected)


def test_stdlib_source_excludes_tests_idle_and_site_packages() -> None:
    cfg = CorpusConfig()
    pairs = source_files(cfg)
    names = [name for name, _ in pairs]
    assert names == sorted(names) and len(names) > 100
    assert "stdlib/os.py" in names and "stdlib/asyncio/base_events.py" in names
    for name in names:
        parts = name.split("/")
        assert not {"test", "tests", "idlelib", "site-packages", "idle_test"} & set(parts), name
    assert iter_source_files(cfg) == [p for _, p in pairs]
    assert all(p.stat().st_size <= cfg.max_file_bytes for p in iter_source_files(cfg))


def test_corpus_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown corpus source"):
        CorpusConfig(sources=("pypi",))
    with pytest.raises(ValueError, match="no training data"):
        CorpusConfig(val_fraction=0.5, test_fraction=0.5)


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def small_tokenizer():
    texts = [p.read_text(encoding="utf-8") for p in iter_source_files(CorpusConfig())[:25]]
    texts.append(UNICODE_CODE * 3)
    return train_tokenizer(texts, vocab_size=600), texts


def test_tokenizer_special_ids_and_round_trip(small_tokenizer) -> None:
    tok, texts = small_tokenizer
    assert [tok.id_to_token(i) for i in range(6)] == list(SPECIAL_TOKENS)
    assert special_token_ids(tok) == {"bos": 0, "eos": 1, "pad": 2, "mask": 3}
    assert tok.get_vocab_size() == 600
    for text in [UNICODE_CODE, texts[0], "  leading spaces\n\n\ttabs\r\n", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ", ""]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert all(i >= len(SPECIAL_TOKENS) for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(tok.encode(texts[0]).ids) < 0.75 * len(texts[0].encode())  # BPE actually merges


def test_tokenizer_training_is_deterministic(small_tokenizer) -> None:
    tok, texts = small_tokenizer
    assert train_tokenizer(texts, vocab_size=600).to_str() == tok.to_str()


def test_tokenizer_save_load_and_chat_format(small_tokenizer, tmp_path: Path) -> None:
    tok, _ = small_tokenizer
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    save_tokenizer(tok, tmp_path / "tok", model_max_length=1024)
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.encode(UNICODE_CODE, add_special_tokens=False) == tok.encode(UNICODE_CODE).ids
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["mask_token"]) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|mask|>",
    )
    assert config["model_max_length"] == 1024
    assert "<|user|>" in config["chat_template"] and "<|assistant|>" in config["chat_template"]
    chat = format_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], True)
    assert chat == "<|bos|><|user|>hi<|assistant|>ok<|eos|><|assistant|>"
    assert loaded.encode(chat, add_special_tokens=False)[:2] == [0, 4]
    assert (
        loaded.encode_chat([{"role": "user", "content": "hi"}])
        == tok.encode(format_chat([{"role": "user", "content": "hi"}], True)).ids
    )
    jinja2 = pytest.importorskip("jinja2")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    rendered = jinja2.Environment().from_string(config["chat_template"])
    for gen in (False, True):
        out = rendered.render(messages=messages, add_generation_prompt=gen, bos_token="<|bos|>", eos_token="<|eos|>")
        assert out == format_chat(messages, gen)


def test_encode_corpus_writes_documents_with_eos(small_tokenizer, tmp_path: Path) -> None:
    tok, _ = small_tokenizer
    docs = ["x = 1\n", UNICODE_CODE, "", "def f():\n    pass\n"]
    jsonl = tmp_path / "split.jsonl"
    jsonl.write_text("".join(json.dumps({"path": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    count = encode_corpus(jsonl, tok, tmp_path / "split.npy")
    arr = np.load(tmp_path / "split.npy")
    assert arr.dtype == np.uint16 and arr.ndim == 1 and count == arr.size
    expected: list[int] = []
    for text in docs:
        expected += tok.encode(text, add_special_tokens=False).ids + [1]
    assert arr.tolist() == expected


# ----------------------------------------------------------------------------- anchors


def _random_loss_mask(gen: torch.Generator, B: int, S: int, p: float) -> torch.Tensor:
    return torch.rand(B, S, generator=gen) < p


def test_sample_anchors_valid_distinct_sorted_and_padded() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, S, A = 3, 5 + trial, 1 + trial % 9
        loss_mask = _random_loss_mask(gen, B, S, 0.3 + 0.02 * trial)
        loss_mask[0] = False  # a row with no valid anchor at all
        anchors, keep = sample_anchors(loss_mask, A, gen)
        assert anchors.shape == keep.shape == (B, A) and anchors.dtype == torch.long
        for b in range(B):
            valid = [a for a in range(S - 1) if loss_mask[b, a] and loss_mask[b, a + 1]]
            kept = anchors[b][keep[b]].tolist()
            assert len(kept) == min(A, len(valid))
            assert all(a in valid for a in kept)
            assert kept == sorted(set(kept))  # distinct and sorted
            n = len(kept)
            assert keep[b, :n].all() and not keep[b, n:].any()  # dummies padded at the end


def test_sample_anchors_is_uniform_over_valid_positions() -> None:
    gen = torch.Generator().manual_seed(1)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 2:10] = True  # valid anchors 2..8 (7 positions)
    counts = torch.zeros(12)
    for _ in range(700):
        anchors, keep = sample_anchors(loss_mask, 3, gen)
        counts[anchors[keep]] += 1
    assert counts[:2].sum() == 0 and counts[9:].sum() == 0
    freq = counts[2:9] / 700
    assert torch.allclose(freq, torch.full((7,), 3 / 7), atol=0.08)


def test_sample_anchors_reproducible_with_seed() -> None:
    loss_mask = torch.ones(2, 40, dtype=torch.bool)
    a1 = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    a2 = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])


def test_block_targets_match_brute_force_and_form_a_prefix() -> None:
    gen = torch.Generator().manual_seed(2)
    B, S, A, K = 3, 17, 6, 5
    for _ in range(10):
        input_ids = torch.randint(10, 100, (B, S), generator=gen)
        loss_mask = _random_loss_mask(gen, B, S, 0.75)
        anchors, keep = sample_anchors(loss_mask, A, gen)
        labels, eval_mask = block_targets(input_ids, loss_mask, anchors, keep, K)
        assert labels.shape == eval_mask.shape == (B, A, K)
        for b in range(B):
            for a in range(A):
                anchor = int(anchors[b, a])
                alive = bool(keep[b, a])
                for j in range(K):
                    pos = anchor + j + 1
                    want_label = int(input_ids[b, pos]) if pos < S else 0
                    assert int(labels[b, a, j]) == want_label
                    alive = alive and pos < S and bool(loss_mask[b, pos])
                    assert bool(eval_mask[b, a, j]) == alive, (b, a, j)
        # Contiguous prefix: once False, stays False along j.
        assert (eval_mask[..., 1:] <= eval_mask[..., :-1]).all()
        assert not eval_mask[~keep].any()


def test_block_targets_never_supervise_past_the_end() -> None:
    input_ids = torch.arange(8).unsqueeze(0)
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    anchors = torch.tensor([[5, 6]])
    keep = torch.tensor([[True, True]])
    labels, eval_mask = block_targets(input_ids, loss_mask, anchors, keep, 4)
    assert eval_mask.tolist() == [[[True, True, False, False], [True, False, False, False]]]
    assert labels.tolist() == [[[6, 7, 0, 0], [7, 0, 0, 0]]]


def _visibility_reference(S: int, anchors: torch.Tensor, keep: torch.Tensor, K: int) -> torch.Tensor:
    B, A = anchors.shape
    out = torch.zeros(B, A * K, S + A * K, dtype=torch.bool)
    for b in range(B):
        for q in range(A * K):
            blk = q // K
            if not keep[b, blk]:
                continue
            for kv in range(S + A * K):
                if kv < S:
                    out[b, q, kv] = kv < int(anchors[b, blk])
                else:
                    out[b, q, kv] = (kv - S) // K == blk
    return out


def test_block_visibility_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(3)
    B, S, A, K = 2, 13, 4, 3
    for _ in range(5):
        loss_mask = _random_loss_mask(gen, B, S, 0.6)
        anchors, keep = sample_anchors(loss_mask, A, gen)
        vis = block_visibility(S, anchors, keep, K)
        assert vis.shape == (B, A * K, S + A * K) and vis.dtype == torch.bool
        assert torch.equal(vis, _visibility_reference(S, anchors, keep, K))


def test_block_positions_and_inputs() -> None:
    anchors = torch.tensor([[0, 4], [2, 3]])
    assert block_positions(anchors, 3).tolist() == [[0, 1, 2, 4, 5, 6], [2, 3, 4, 3, 4, 5]]
    input_ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    assert block_inputs(input_ids, anchors, 3, mask_token_id=3).tolist() == [
        [[10, 3, 3], [14, 3, 3]],
        [[22, 3, 3], [23, 3, 3]],
    ]


def test_valid_anchor_mask_requires_next_token_in_loss() -> None:
    loss_mask = torch.tensor([[False, True, True, False, True, True]])
    assert valid_anchor_mask(loss_mask).tolist() == [[False, True, False, False, True, False]]
