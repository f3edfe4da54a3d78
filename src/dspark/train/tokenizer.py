"""Byte-level BPE tokenizer (HF `tokenizers`) and flat token arrays for the code corpus.

Special tokens occupy ids 0..5 in the order of ``SPECIAL_TOKENS``. Text round-trips exactly:
``decode(encode(x).ids) == x`` for any string that does not itself contain a special-token string.

Directory written by :func:`save_tokenizer` (the HF model-directory convention)::

    tokenizer.json          the `tokenizers` model
    tokenizer_config.json   special-token strings, model_max_length, chat_template

Chat format (``CHAT_TEMPLATE``, mirrored by :func:`format_chat`)::

    <|bos|><|user|>{user}<|assistant|>{assistant}<|eos|><|user|>...[<|assistant|>]

Usage: ``python -m dspark.train.tokenizer CORPUS_DIR OUT_DIR [--vocab-size 8192]`` trains on the
corpus's train split and writes the tokenizer plus ``{split}.npy`` uint16 token arrays.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark.train.corpus import SPLITS, atomic_write, atomic_write_bytes, iter_texts, load_manifest

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
MASK = "<|mask|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, MASK, USER, ASSISTANT)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
DEFAULT_MODEL_MAX_LENGTH = 4096
_NUM_BYTES = 256

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('role must be user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE on texts. The same texts in the same order give the same tokenizer."""
    min_vocab = len(SPECIAL_TOKENS) + _NUM_BYTES
    if not min_vocab <= vocab_size <= 65536:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [{min_vocab}, 65536] "
            "(special tokens + 256 bytes at least; token arrays are uint16)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    _check_special_ids(tok, "trained tokenizer")
    return tok


def _check_special_ids(tok: Tokenizer, where: str) -> None:
    for expected, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != expected:
            raise ValueError(f"{where}: special token {token!r} has id {got}, expected {expected}")


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{'bos', 'eos', 'pad', 'mask'} -> id; raises if the tokenizer lacks one."""
    out: dict[str, int] = {}
    for key, token in (("bos", BOS), ("eos", EOS), ("pad", PAD), ("mask", MASK)):
        idx = tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"tokenizer has no {token!r} token; train it with dspark.train.tokenizer")
        out[key] = idx
    return out


def tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> dict:
    """Contents of tokenizer_config.json (loadable by transformers' PreTrainedTokenizerFast)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,
        "additional_special_tokens": [USER, ASSISTANT],
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def format_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages exactly as CHAT_TEMPLATE does, without jinja."""
    parts = [BOS]
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "user":
            parts.append(USER + content)
        elif role == "assistant":
            parts.append(ASSISTANT + content + EOS)
        else:
            raise ValueError(f"chat message role must be 'user' or 'assistant', got {role!r}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)


def save_tokenizer(tok: Tokenizer, directory: str | Path, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> None:
    """Write tokenizer.json and tokenizer_config.json into directory (created if needed)."""
    out = Path(directory)
    _check_special_ids(tok, f"save_tokenizer({out})")
    atomic_write_bytes(out / TOKENIZER_FILE, tok.to_str(pretty=True).encode("utf-8"))
    config = json.dumps(tokenizer_config(model_max_length), indent=2) + "\n"
    atomic_write_bytes(out / TOKENIZER_CONFIG_FILE, config.encode("utf-8"))


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_texts(texts: Iterable[str], tok: Tokenizer, batch_size: int = 64) -> np.ndarray:
    """Flat uint16 array: tokens of each text followed by EOS."""
    eos = special_token_ids(tok)["eos"]
    if tok.get_vocab_size() > 65536:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit uint16 token arrays")
    chunks: list[np.ndarray] = []
    for batch in _batches(texts, batch_size):
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids, dtype=np.uint16))
            chunks.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def encode_corpus(jsonl_path: str | Path, tok: Tokenizer, out_path: str | Path) -> int:
    """Tokenise a corpus split into a flat uint16 .npy (EOS after each document); return the count."""
    tokens = encode_texts(iter_texts(jsonl_path), tok)
    with atomic_write(out_path) as f:
        np.save(f, tokens, allow_pickle=False)
    return int(tokens.size)


@dataclass(frozen=True)
class TokenizedData:
    out_dir: str
    vocab_size: int
    tokens: dict[str, int]  # split -> token count
    documents: dict[str, int]  # split -> document count
    bytes: dict[str, int]  # split -> UTF-8 bytes of text
    tokenizer_sha256: str
    train_seconds: float
    encode_seconds: float


def build_tokenizer_and_data(corpus_dir: str | Path, out_dir: str | Path, vocab_size: int = 8192) -> TokenizedData:
    """Train on the corpus's train split, save the tokenizer and one {split}.npy per split into out_dir."""
    corpus, out = Path(corpus_dir), Path(out_dir)
    manifest = load_manifest(corpus)
    t0 = time.perf_counter()
    tok = train_tokenizer(iter_texts(corpus / "train.jsonl"), vocab_size=vocab_size)
    save_tokenizer(tok, out)
    t1 = time.perf_counter()
    counts = {split: encode_corpus(corpus / f"{split}.jsonl", tok, out / f"{split}.npy") for split in SPLITS}
    t2 = time.perf_counter()
    result = TokenizedData(
        out_dir=str(out),
        vocab_size=tok.get_vocab_size(),
        tokens=counts,
        documents={split: manifest.splits[split].files for split in SPLITS},
        bytes={split: manifest.splits[split].bytes for split in SPLITS},
        tokenizer_sha256=hashlib.sha256((out / TOKENIZER_FILE).read_bytes()).hexdigest(),
        train_seconds=round(t1 - t0, 3),
        encode_seconds=round(t2 - t1, 3),
    )
    summary = {**asdict(result), "corpus_manifest": manifest.to_json()}
    atomic_write_bytes(out / "data_manifest.json", (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    return result


TINY_VOCAB_SIZE = 512
TINY_TRAIN_BYTES = 300_000
TINY_VALIDATION_BYTES = 30_000


def build_tiny_data(
    out_dir: str | Path,
    vocab_size: int = TINY_VOCAB_SIZE,
    train_bytes: int = TINY_TRAIN_BYTES,
    validation_bytes: int = TINY_VALIDATION_BYTES,
) -> TokenizedData:
    """A sub-second stand-in for ``corpus`` + ``tokenizer`` (what ``dspark train-target --tiny`` trains on): the
    standard library's top-level modules in name order, split as the full corpus splits them, until each split has
    its bytes; a ``vocab_size`` BPE; train/validation/test ``.npy`` arrays and ``data_manifest.json`` in out_dir,
    and the documents themselves as the corpus step writes them (``<split>.jsonl``: what ``draft-data`` reads)."""
    import sysconfig

    from dspark.train.corpus import CorpusConfig, split_of

    cfg = CorpusConfig()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    budget = {"train": train_bytes, "validation": validation_bytes, "test": validation_bytes}
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    names: dict[str, list[str]] = {split: [] for split in SPLITS}
    for path in sorted(stdlib.glob("*.py")):
        split = split_of(f"stdlib/{path.name}", cfg)
        if budget[split] <= 0 or path.stat().st_size > cfg.max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts[split].append(text)
        names[split].append(f"stdlib/{path.name}")
        budget[split] -= len(text.encode("utf-8"))
        if all(b <= 0 for b in budget.values()):
            break
    for split in ("validation", "test"):  # a split the hash left short borrows the last training file
        if not texts[split]:
            texts[split].append(texts["train"][-1])
            names[split].append(names["train"][-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        lines = (json.dumps({"path": n, "text": t}, ensure_ascii=False) for n, t in zip(names[split], texts[split]))
        atomic_write_bytes(out / f"{split}.jsonl", ("\n".join(lines) + "\n").encode("utf-8"))
    t0 = time.perf_counter()
    tok = train_tokenizer(texts["train"], vocab_size=vocab_size)
    save_tokenizer(tok, out)
    t1 = time.perf_counter()
    counts = {}
    for split in SPLITS:
        tokens = encode_texts(texts[split], tok)
        with atomic_write(out / f"{split}.npy") as f:
            np.save(f, tokens, allow_pickle=False)
        counts[split] = int(tokens.size)
    result = TokenizedData(
        out_dir=str(out),
        vocab_size=tok.get_vocab_size(),
        tokens=counts,
        documents={split: len(texts[split]) for split in SPLITS},
        bytes={split: sum(len(t.encode("utf-8")) for t in texts[split]) for split in SPLITS},
        tokenizer_sha256=hashlib.sha256((out / TOKENIZER_FILE).read_bytes()).hexdigest(),
        train_seconds=round(t1 - t0, 3),
        encode_seconds=round(time.perf_counter() - t1, 3),
    )
    summary = {**asdict(result), "source": f"tiny: top-level modules of {stdlib}"}
    atomic_write_bytes(out / "data_manifest.json", (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the BPE tokenizer and encode the corpus splits.")
    parser.add_argument("corpus_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    result = build_tokenizer_and_data(args.corpus_dir, args.out_dir, args.vocab_size)
    json.dump(asdict(result), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
