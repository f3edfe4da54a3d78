"""GGUF files (llama.cpp) as HF-style model directories.

A ``.gguf`` file holds the weights (often block-quantized), the architecture hyper-parameters and the tokenizer as
metadata under llama.cpp's key names. We read it with the ``gguf`` package's ``GGUFReader``, dequantize every tensor
at load (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K, our own numpy code, checked against ``gguf.quants.dequantize``),
rename llama.cpp's tensors to the HF Llama/Qwen2/Qwen3 names, undo llama.cpp's rotary row permutation of q/k (its
``llama`` converter reorders each head's rows from HF's rotate-half layout to interleaved pairs), and write a cached
HF directory — ``config.json``, ``model.safetensors`` (fp32, the exact dequantized values), ``tokenizer.json`` and
``tokenizer_config.json`` (Jinja chat template, BOS/EOS rules), ``generation_config.json`` — that our loader,
``transformers`` and vLLM all read. The tokenizer is rebuilt by transformers' GGUF tokenizer conversion.

The export lives under ``$DSPARK_CACHE/gguf/<stem>-<hash>/`` (default ``~/.cache/dspark``), keyed by the file's path,
size and mtime, and is written to a temporary sibling then renamed, so a crash never leaves a half-written model.
It also records the file it came from (``dspark_gguf_source.json``), so a loader handed the export can serve the
file's Q4_0/Q4_1/Q8_0 blocks quantized (``read_gguf_blocks``: the raw blocks, HF-named, q/k rows un-permuted;
``dspark.models.quantized``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.checkpoint.io import CheckpointError, Problem, save_state_dict
from dspark.config import GGUF_ARCHS, gqa_header
from dspark.paths import cache_root

EXPORT_VERSION = 1  # bump when the exported layout changes, so stale caches are rebuilt
ROTARY_PERMUTED = {"llama"}  # llama.cpp's converter permutes q/k rows only for these

_F16 = np.dtype("<f2")


# ---------------------------------------------------------------------------------------- dequantization
# Each function takes the raw bytes of n blocks, [n, block_bytes] uint8, and returns [n, block_values] float32.


def _f16(raw: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n, 1] float32
    return np.ascontiguousarray(raw).view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] -> [n, 32]: low nibbles are values 0..15, high 16..31
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:  # d f16 | qs int8[32]
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:  # d f16 | qs u8[16]; x = d * (q - 8)
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]) - 8.0)


def _q4_1(b: np.ndarray) -> np.ndarray:  # d f16 | m f16 | qs u8[16]; x = d * q + m
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]) + _f16(b[:, 2:4])


def _q4_k(b: np.ndarray) -> np.ndarray:
    """Super-block of 256: d, dmin f16 | 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32 | qs u8[128]."""
    n = b.shape[0]
    d, dmin, s, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    q = qs.reshape(n, 4, 1, 32)  # each 32-byte chunk: low nibbles = sub-block 2i, high nibbles = 2i+1
    q = np.concatenate([q & 0xF, q >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    x = d[:, :, None] * sc[:, :, None].astype(np.float32) * q - dmin[:, :, None] * mn[:, :, None].astype(np.float32)
    return x.reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    """Super-block of 256: ql u8[128] (low 4 bits) | qh u8[64] (high 2 bits) | int8 scales[16] | d f16."""
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
    halves = []
    for h in range(2):  # each half of 128 values: four runs of 32 read from ql[64h:64h+64], qh[32h:32h+32]
        lo, hi = ql[:, 64 * h : 64 * h + 64], qh[:, 32 * h : 32 * h + 32]
        runs = [
            (lo[:, :32] & 0xF) | (((hi >> 0) & 3) << 4),
            (lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4),
            (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4),
            (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4),
        ]
        halves.append(np.concatenate(runs, axis=1))
    q = np.concatenate(halves, axis=1).astype(np.float32) - 32.0  # [n, 256]
    # one int8 scale per 16 consecutive values
    return (d[:, :, None] * scales.astype(np.float32).reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, 256)


# type name -> (values per block, bytes per block, block dequantizer)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q4_K": (256, 144, _q4_k),
    "Q6_K": (256, 210, _q6_k),
}
PLAIN_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = PLAIN_TYPES + tuple(BLOCK_TYPES)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of one GGUF tensor. ``shape`` is in numpy order (GGUF's ``ne`` reversed); ``raw`` is the
    tensor data as GGUFReader maps it (any view of the same bytes)."""
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name == "F32":
        out = data.view("<f4").astype(np.float32)
    elif type_name == "F16":
        out = data.view(_F16).astype(np.float32)
    elif type_name == "BF16":
        out = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif type_name in BLOCK_TYPES:
        values, nbytes, fn = BLOCK_TYPES[type_name]
        if data.size % nbytes:
            raise ValueError(f"{type_name} data of {data.size} bytes is not a whole number of {nbytes}-byte blocks")
        out = fn(data.reshape(-1, nbytes)).reshape(-1)
    else:
        raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------- names and config

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """The HF Llama-family name of a llama.cpp tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.
    self_attn.q_proj.weight``), or None when it has none."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head it stores rows as interleaved (x0, x1) rotary pairs, HF
    as the two halves (rotate-half). ``w`` is [n_heads * D, ...]."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(v: float) -> float:  # the shortest decimal of a float32 metadata value (1e-05, not 9.9999997e-06)
    return float(str(np.float32(v)))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: Any, tensor_names: set[str], source: str) -> dict[str, Any]:
    """An HF config.json (LlamaConfig / Qwen2Config / Qwen3Config keys) from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise CheckpointError(
            Problem(
                f"{source}: general.architecture {arch!r} is not supported",
                f"use a GGUF of one of {sorted(GGUF_ARCHS)}, or an HF directory",
            )
        )

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise CheckpointError(Problem(f"{source}: metadata key {arch}.{key} is missing", "re-convert the file"))
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    cfg: dict[str, Any] = gqa_header(arch) | {  # each llama.cpp architecture converts to the model_type it names
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, source, tensor_names),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":  # LlamaConfig's own keys
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        cfg["mlp_bias"] = False
    return cfg


def _rope_scaling(reader: Any, arch: str, source: str, tensor_names: set[str]) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            Problem(
                f"{source}: tensor rope_freqs.weight (llama3-style rope scaling stored as per-frequency factors) is "
                "not supported",
                "use the HF safetensors directory of this model (its config.json has rope_scaling)",
            )
        )
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    out: dict[str, Any] = {"rope_type": kind, "factor": factor}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    elif kind not in ("linear", "yarn"):
        raise CheckpointError(Problem(f"{source}: rope.scaling.type {kind!r} is not supported", "use linear/yarn"))
    return out


# ---------------------------------------------------------------------------------------- reading


def read_gguf_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config dict, HF-named fp32 state dict) of a GGUF file, dequantized and with q/k rows un-permuted.

    Tensors without an HF name or of an unsupported type are reported all together, never loaded half.
    """
    path = Path(path)
    reader = _open(path)
    names = {t.name for t in reader.tensors}
    cfg = hf_config(reader, names, str(path))
    arch = _field(reader, "general.architecture")
    problems = []
    for t in reader.tensors:
        if hf_name(t.name) is None:
            problems.append(Problem(f"{path}: tensor {t.name!r} has no HF {arch} name", ""))
        elif t.tensor_type.name not in SUPPORTED_TYPES:
            problems.append(
                Problem(
                    f"{path}: tensor {t.name!r} has type {t.tensor_type.name}",
                    f"use a GGUF quantized with {', '.join(SUPPORTED_TYPES)}",
                )
            )
    if problems:
        raise CheckpointError(problems, header=f"{path}: cannot load {len(problems)} tensor(s)")
    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)))
        if reader.fields["general.architecture"].contents() in ROTARY_PERMUTED:
            if ".attn_q." in t.name:
                w = unpermute_rotary(w, cfg["num_attention_heads"])
            elif ".attn_k." in t.name:
                w = unpermute_rotary(w, cfg["num_key_value_heads"])
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return cfg, state


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the gguf package raises bare ValueError/struct errors
        raise CheckpointError(Problem(f"{path}: not a readable GGUF file ({e})", "re-download the file")) from e


@dataclass(frozen=True, eq=False)
class GGUFBlocks:
    """One block-quantized tensor as stored: ``raw`` uint8 [rows, cols / values_per_block · bytes_per_block]."""

    qtype: str  # "Q4_0" | "Q4_1" | "Q8_0" | ...
    rows: int
    cols: int
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:  # float32 [rows, cols]: the values the export holds
        return dequantize(self.raw, self.qtype, (self.rows, self.cols))


# value type id -> struct format of the GGUF scalar types (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's scalar/string metadata (arrays skipped) and where each tensor's bytes are."""

    metadata: dict[str, Any]
    tensors: dict[str, tuple[str, tuple[int, ...], int]]  # name -> (type name, ne (GGUF order), absolute offset)


class _Cursor:
    """Reads GGUF header values from a buffer, front to back."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """A metadata value of type ``kind``; arrays are skipped (None)."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise ValueError(f"unknown metadata value type {kind}")
        elem, count = self.take("<I"), self.take("<Q")
        if elem in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[elem])
        else:
            for _ in range(count):
                self.value(elem)
        return None


def read_gguf_index(path: str | Path) -> GGUFIndex:
    """Parse the header of a GGUF file (magic, version 2/3, key/value metadata, tensor infos) without building
    the vocabulary arrays GGUFReader materialises (seconds for a 49k-token vocabulary; this takes milliseconds)."""
    from gguf import GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            c.pos = 4
            version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (2 and 3 are read)")
            meta = {}
            for _ in range(n_kv):
                key = c.string()
                meta[key] = c.value(c.take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                ne = tuple(c.take("<Q") for _ in range(c.take("<I")))
                infos.append((name, GGMLQuantizationType(c.take("<I")).name, ne, c.take("<Q")))
        except (ValueError, struct.error) as e:
            raise CheckpointError(Problem(f"{path}: not a readable GGUF file ({e})", "re-download the file")) from e
        align = int(meta.get("general.alignment") or 32)
        data = -(-c.pos // align) * align
    return GGUFIndex(meta, {name: (kind, ne, data + off) for name, kind, ne, off in infos})


def read_gguf_blocks(path: str | Path, types: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0")) -> dict[str, GGUFBlocks]:
    """The raw blocks of every 2-D tensor of the given block types, by HF name, with llama.cpp's q/k row
    permutation undone (rows are whole blocks, so the permutation moves bytes, never values): what quantized
    serving keeps in memory instead of the dequantized export. ``raw`` may map the file (read-only)."""
    path = Path(path)
    index = read_gguf_index(path)
    arch = index.metadata.get("general.architecture")
    heads = index.metadata.get(f"{arch}.attention.head_count")
    kv_heads = index.metadata.get(f"{arch}.attention.head_count_kv", heads)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, GGUFBlocks] = {}
    for name, (qtype, ne, offset) in index.tensors.items():
        hf = hf_name(name)
        if qtype not in types or hf is None or len(ne) != 2:
            continue
        values, nbytes, _ = BLOCK_TYPES[qtype]
        cols, rows = int(ne[0]), int(ne[1])  # GGUF's ne is (columns, rows)
        raw = file[offset : offset + rows * cols // values * nbytes].reshape(rows, -1)
        if arch in ROTARY_PERMUTED and ".attn_q." in name:
            raw = unpermute_rotary(raw, int(heads))
        elif arch in ROTARY_PERMUTED and ".attn_k." in name:
            raw = unpermute_rotary(raw, int(kv_heads))
        out[hf] = GGUFBlocks(qtype, rows, cols, raw)
    return out


# ---------------------------------------------------------------------------------------- export

SOURCE_FILE = "dspark_gguf_source.json"  # in an export: the GGUF file it was made from


def _source_record(path: Path) -> dict[str, Any]:
    p = path.resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "export_version": EXPORT_VERSION}


def _write_source(path: Path, out: Path) -> None:
    tmp = out / f".{SOURCE_FILE}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(_source_record(path), indent=2))
    os.replace(tmp, out / SOURCE_FILE)


def gguf_source(export: str | Path) -> Path | None:
    """The GGUF file an export directory was made from, while that file is unchanged (same size and mtime);
    None for a directory that is no GGUF export, or whose file moved or changed since."""
    try:
        rec = json.loads((Path(export) / SOURCE_FILE).read_text())
        p = Path(rec["path"])
        st = p.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return p if (st.st_size, st.st_mtime_ns) == (rec.get("size"), rec.get("mtime_ns")) else None


def export_dir_for(path: str | Path) -> Path:
    """Where the HF export of a GGUF file lives: keyed by its resolved path, size and mtime."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{EXPORT_VERSION}|{p}|{st.st_size}|{st.st_mtime_ns}".encode()
    return cache_root() / "gguf" / f"{p.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def export_gguf(path: str | Path, out: str | Path | None = None) -> Path:
    """The HF directory of a GGUF file, exported once (atomically) and reused."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(Problem(f"GGUF file {path} does not exist", "check the path"))
    final = Path(out) if out is not None else export_dir_for(path)
    if (final / "config.json").exists():
        if not (final / SOURCE_FILE).exists():  # an export written before the source record existed
            try:
                _write_source(path, final)
            except OSError:
                pass  # a read-only cache: quantized serving then falls back to the dequantized weights
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _write_export(path, tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first (non-empty target): keep theirs
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_export(path: Path, out: Path) -> None:
    cfg, state = read_gguf_state(path)
    out.mkdir(parents=True)
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    save_state_dict(state, out)
    _write_tokenizer(path, out, cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_source(path, out)
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2))


def _write_tokenizer(path: Path, out: Path, cfg: dict[str, Any]) -> None:
    """tokenizer.json + tokenizer_config.json through transformers' GGUF tokenizer conversion; the chat template
    and the BOS/EOS flags are also written into tokenizer_config.json for readers that look only there."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(path))
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise CheckpointError(
            Problem(f"{path}: no tokenizer in the metadata (tokenizer.ggml.tokens)", "use a GGUF with a tokenizer")
        )
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version (and vLLM) resolves
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tc["chat_template"] = template
    for key in ("add_bos_token", "add_eos_token"):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            tc[key] = bool(v)
    tc["model_max_length"] = cfg["max_position_embeddings"]
    tc_path.write_text(json.dumps(tc, indent=2))
