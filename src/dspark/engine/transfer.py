"""Prefill/decode (P/D) disaggregation, the engine's side: a prefilled request's whole state as one self-checking
payload (``export_request``), and its import into another engine straight into decode (``import_request``).

A prefill instance adds the request with ``hold_for_export``: it runs the prompt and samples the first token
(max_tokens=1), and at that finish the engine keeps the request's pages and state slot (``Request.hold``) instead of
freeing them. ``export_request`` then reads, for the pages covering the prompt (whole pages), the rows of every
layer of every pool — the target's latent / GQA rows and the drafter's context rows, which are extra layers of the
same pages or a second pool indexed by the same page ids — plus the recurrent state slot of a hybrid (KDA) target,
and frees them. The payload is::

    magic (8 bytes) | header length (uint32 LE) | sha256 of header + body (32 bytes) | header (JSON) | body

The header names what the rows depend on (the model salt: models, page formats, dtype), the pools' layers, widths
and dtypes, the state's shape, the prompt and output token ids, the seed and the sampling params; the body is the
pools' rows ``[layers, pages · page_size, width]`` then the state ``[layers, *shape]``, raw. So a payload's size is
pages × page_size × bytes per token of all pools + state bytes + header. ``import_request`` checks the magic, the
checksum and every header key against its own engine (a mismatch names the key, both values and the fix), allocates
pages, writes the first ``num_computed`` rows (page sizes may differ), restores the state slot, and schedules the
request as running with the first token appended: the next step decodes it (speculatively), with no prefill.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dspark.engine.request import Request, Status
from dspark.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.cache.pool import PagedPool
    from dspark.engine.engine import Engine

MAGIC = b"DSPKV\x00\x01\n"
PREFIX = struct.Struct("<8sI32s")  # magic, header length, sha256 of header + body
VERSION = 1
FALLBACK = "the request falls back to a local prefill"


class TransferError(ValueError):
    """A payload cannot be exported or imported (the message says why and what to change)."""


@dataclass
class TransferMetrics:
    """Counters of a server's transfers (``dspark:kv_transfer_*`` on /metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    requests_sent: int = 0
    requests_imported: int = 0
    failures: int = 0  # exports, pushes or imports that failed (each request then prefilled elsewhere)
    fallbacks: int = 0  # requests a decode instance prefilled itself because their payload was missing or refused


# ---- export ----------------------------------------------------------------------------------------------------


def hold_for_export(
    engine: Engine, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
) -> Request:
    """Add a request that runs its prompt and samples its first token only (max_tokens=1); at that finish the
    engine keeps its pages and state slot for ``export_request``."""
    req = engine.add_request(prompt, replace(params, max_tokens=1), request_id)
    req.hold = True
    return req


def release_held(engine: Engine, request_id: str) -> None:
    """Free the pages and state slot a finished held request kept (``export_request`` does it by default)."""
    if request_id in engine.blocks:
        engine.blocks.release(request_id)
    engine.runner.release_state(request_id)


def export_request(engine: Engine, req: Request, params: SamplingParams | None = None, release: bool = True) -> bytes:
    """The payload of a held request that finished its prompt and first token (``params``: what the decode side
    continues with; default the request's own). ``release``: free its pages and state slot (also on failure)."""
    try:
        if not req.hold or req.request_id not in engine.blocks:
            raise TransferError(
                f"request {req.request_id!r} holds no pages to export: add it with hold_for_export and export it "
                "once it has finished its prompt and first token"
            )
        if not req.output_ids or req.num_computed != req.num_tokens - 1:
            raise TransferError(
                f"request {req.request_id!r} is not prefilled ({req.num_computed} of {req.num_tokens - 1} positions "
                "computed, no first token yet): step the engine until it finishes"
            )
        engine.runner.flush_context([req.request_id])
        header, parts = _collect(engine, req, params or req.params)
    finally:
        if release:
            release_held(engine, req.request_id)
    return frame(header, parts)


def _pools(engine: Engine) -> list[tuple[str, PagedPool]]:
    pools = engine.pools
    if pools.draft is None or pools.shared:
        return [("target+draft" if pools.shared else "target", pools.target)]
    return [("target", pools.target), ("draft", pools.draft)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _format(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    dtype = fmt.dtype and _dtype_name(fmt.dtype)
    return {"kind": fmt.kind, "width": fmt.width, "num_layers": fmt.num_layers, "dtype": dtype}


def _layout(engine: Engine) -> dict[str, Any]:
    """What an engine's rows and state depend on and how they are stored: the header keys an import checks."""
    pools = [
        {"name": name, "num_layers": p.num_layers, "width": p.width, "dtype": _dtype_name(p.dtype)}
        for name, p in _pools(engine)
    ]
    s = engine.states
    state = None
    if s is not None:
        state = {"num_layers": s.num_layers, "shape": list(s.states.shape[2:]), "dtype": _dtype_name(s.states.dtype)}
    return {  # the most specific first: a mismatch names the key that differs; the salt (model paths too) last
        "target_format": _format(engine.pools.target_format),
        "draft_format": _format(engine.pools.draft_format),
        "pools": pools,
        "state": state,
        "salt": engine._cache_salt(next(engine.target.parameters()).dtype),
    }


def _collect(engine: Engine, req: Request, params: SamplingParams) -> tuple[dict, list[torch.Tensor]]:
    P = engine.blocks.page_size
    pages = engine.blocks.table(req.request_id).pages[: engine.blocks.allocator.pages_for(req.num_computed)]
    slots = (torch.tensor(pages, dtype=torch.long)[:, None] * P + torch.arange(P)).reshape(-1)
    parts = [pool.pool.index_select(1, slots) for _, pool in _pools(engine)]
    if engine.states is not None:
        parts.append(engine.states.states[:, engine.states.owner[req.request_id]])
    header = {
        "format": "dspark-kv",
        "version": VERSION,
        "request_id": req.request_id,
        **_layout(engine),
        "page_size": P,
        "num_pages": len(pages),
        "num_computed": req.num_computed,
        "prompt_token_ids": list(req.prompt_ids),
        "output_token_ids": list(req.output_ids),
        "seed": req.seed,
        "sampling_params": {k: v for k, v in asdict(params).items() if k != "extra"},
    }
    return header, parts


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def frame(header: dict, parts: Sequence[torch.Tensor]) -> bytes:
    """magic | header length | sha256(header + body) | header | body (the parts' raw bytes, in order)."""
    body = b"".join(_raw(t) for t in parts)
    head = json.dumps(header | {"body_bytes": len(body)}, separators=(",", ":")).encode()
    digest = hashlib.sha256(head)
    digest.update(body)
    return PREFIX.pack(MAGIC, len(head), digest.digest()) + head + body


# ---- reading and checking -------------------------------------------------------------------------------------------


def read_payload(payload: bytes | bytearray | memoryview) -> tuple[dict, memoryview]:
    """(header, body) of a payload whose magic, checksum and sizes are right; raises ``TransferError`` else."""
    view = memoryview(payload)
    if len(view) < PREFIX.size or bytes(view[:8]) != MAGIC:
        raise TransferError(
            f"kv transfer: not a dspark KV payload ({len(view)} bytes, magic {bytes(view[:8])!r}, expected {MAGIC!r}): "
            f"send what export_request produced; {FALLBACK}"
        )
    _, head_len, digest = PREFIX.unpack_from(view)
    if PREFIX.size + head_len > len(view):
        raise TransferError(
            f"kv transfer: the header length {head_len} runs past the payload's {len(view)} bytes (truncated in "
            f"transit?); {FALLBACK}"
        )
    got = hashlib.sha256(view[PREFIX.size :]).digest()
    if got != digest:
        raise TransferError(
            f"kv transfer: checksum mismatch: sha256 of the {len(view) - PREFIX.size} header + body bytes is "
            f"{got.hex()[:16]}…, the payload says {digest.hex()[:16]}… (corrupted or truncated in transit); {FALLBACK}"
        )
    try:
        header = json.loads(bytes(view[PREFIX.size : PREFIX.size + head_len]))
    except ValueError as e:
        raise TransferError(f"kv transfer: the header is not JSON ({e}); {FALLBACK}") from None
    body = view[PREFIX.size + head_len :]
    if not isinstance(header, dict) or header.get("format") != "dspark-kv" or header.get("version") != VERSION:
        seen = (header.get("format"), header.get("version")) if isinstance(header, dict) else header
        raise TransferError(
            f"kv transfer: key 'format'/'version' = {seen!r}, this instance reads ('dspark-kv', {VERSION}): run the "
            f"same dspark version on the prefill and decode instances; {FALLBACK}"
        )
    if header.get("body_bytes") != len(body):
        raise TransferError(
            f"kv transfer: key 'body_bytes' = {header.get('body_bytes')!r} but the body has {len(body)} bytes; "
            f"{FALLBACK}"
        )
    _check_keys(header)
    return header, body


HEADER_KEYS = {"request_id": str, "page_size": int, "num_pages": int, "num_computed": int, "seed": int}
TOKEN_KEYS = ("prompt_token_ids", "output_token_ids")


def _check_keys(header: dict) -> None:
    """The request's keys are there with their types (the layout keys are compared by ``check_compatible``)."""
    for key, kind in HEADER_KEYS.items():
        if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
            raise TransferError(f"kv transfer: key {key!r} = {header.get(key)!r} is not a {kind.__name__}; {FALLBACK}")
    for key in TOKEN_KEYS:
        ids = header.get(key)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise TransferError(f"kv transfer: key {key!r} must be a non-empty list of token ids; {FALLBACK}")
    if not isinstance(header.get("sampling_params"), dict):
        raise TransferError(f"kv transfer: key 'sampling_params' is missing; {FALLBACK}")


def header_size(payload: bytes) -> int:
    """Bytes before the body: the fixed prefix and the JSON header."""
    return PREFIX.size + PREFIX.unpack_from(payload)[1]


def _mismatch(key: str, got: object, want: object) -> TransferError:
    return TransferError(
        f"kv transfer: key {key!r} = {got!r} but this instance has {want!r}: start the prefill and decode instances "
        f"with the same target, drafter (speculative config) and --dtype; {FALLBACK}"
    )


def check_compatible(engine: Engine, header: dict) -> None:
    """Every key the rows depend on equals this engine's: the salt (models, page formats, dtype), the pools' layers,
    widths and dtypes, the state's shape and dtype."""
    for key, want in _layout(engine).items():
        if header.get(key) != want:
            raise _mismatch(key, header.get(key), want)


def _tensors(header: dict, body: memoryview) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The pools' rows and the state, read from the body (after ``check_compatible``: the shapes are ours)."""
    slots = header["num_pages"] * header["page_size"]
    specs = [(getattr(torch, p["dtype"]), (p["num_layers"], slots, p["width"])) for p in header["pools"]]
    st = header["state"]
    if st is not None:
        specs.append((getattr(torch, st["dtype"]), (st["num_layers"], *st["shape"])))
    out, offset = [], 0
    for dtype, shape in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset + n > len(body):
            raise TransferError(f"kv transfer: the body ({len(body)} bytes) is shorter than its tensors; {FALLBACK}")
        out.append(torch.frombuffer(bytearray(body[offset : offset + n]), dtype=torch.uint8).view(dtype).reshape(shape))
        offset += n
    if offset != len(body):
        raise TransferError(f"kv transfer: {len(body) - offset} body bytes past the tensors; {FALLBACK}")
    return (out[:-1], out[-1]) if st is not None else (out, None)


# ---- import ---------------------------------------------------------------------------------------------------


def import_request(
    engine: Engine,
    payload: bytes | bytearray | memoryview,
    params: SamplingParams | None = None,
    request_id: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> Request:
    """Add the payload's request to ``engine`` as running, its prompt's rows and state in place and its first token
    appended: it decodes from the next step. ``params``: what it continues with (default: the payload's);
    ``prompt_token_ids``: the prompt this instance expects (a different one is refused). Raises ``TransferError``,
    changing nothing, when the payload is corrupt, from other models, or there is no room (pages, running slots)."""
    header, body = read_payload(payload)
    check_compatible(engine, header)
    ids, outs = header["prompt_token_ids"], header["output_token_ids"]
    n = header["num_computed"]
    if prompt_token_ids is not None and list(prompt_token_ids) != ids:
        raise TransferError(
            f"kv transfer: key 'prompt_token_ids' ({len(ids)} tokens) differs from this request's prompt "
            f"({len(prompt_token_ids)} tokens): the two instances tokenize differently; {FALLBACK}"
        )
    if n != len(ids) + len(outs) - 1 or n > header["num_pages"] * header["page_size"]:
        raise TransferError(
            f"kv transfer: key 'num_computed' = {n} does not fit {len(ids)} prompt and {len(outs)} output tokens in "
            f"{header['num_pages']} pages of {header['page_size']}; {FALLBACK}"
        )
    rows, state = _tensors(header, body)
    if params is None:
        try:
            params = SamplingParams(**header["sampling_params"])
        except (TypeError, ValueError) as e:
            raise TransferError(f"kv transfer: key 'sampling_params' is invalid ({e}); {FALLBACK}") from None
    rid = request_id or header["request_id"]
    _check_room(engine, rid, ids, outs, params)
    grammar = engine.grammar_matcher(params)  # before any page is taken: a grammar that does not compile raises
    if not engine.blocks.ensure_capacity(rid, n):
        raise TransferError(
            f"kv transfer: {engine.blocks.allocator.pages_for(n)} pages needed for {n} rows but "
            f"{engine.num_pages_free} are free; {FALLBACK} later (or raise --num-pages)"
        )
    try:
        slots = torch.tensor(engine.blocks.slots(rid, 0, n), dtype=torch.long)
        for (_, pool), r in zip(_pools(engine), rows):
            pool.pool.index_copy_(1, slots, r[:, :n])
        engine.blocks.set_length(rid, n)
        if state is not None:
            assert engine.states is not None
            engine.states.restore(rid, state)
    except BaseException:
        release_held(engine, rid)
        raise
    req = Request(rid, list(ids), params, int(header["seed"]), detok=engine.tokenizer.detokenizer(), grammar=grammar)
    for tok in outs[:-1]:  # a request moved mid-decode: its earlier outputs (normally none)
        req.output_ids.append(tok)
        if req.detok is not None:
            req.detok.step((tok,))
    req.num_computed, req.status = n, Status.RUNNING
    engine.requests[rid] = req
    engine.scheduler.running.append(req)
    engine.metrics.prompt_tokens += len(ids)
    engine._append(req, outs[-1:])  # the first token: stop checks, text, time to first token
    return req


def _check_room(engine: Engine, rid: str, ids: list[int], outs: list[int], params: SamplingParams) -> None:
    vocab = engine.target.config.vocab_size
    if any(not 0 <= t < vocab for t in ids + outs):
        raise TransferError(f"kv transfer: token ids outside this model's vocabulary [0, {vocab}); {FALLBACK}")
    if rid in engine.requests or rid in engine.blocks:
        raise TransferError(f"kv transfer: request id {rid!r} is already in use on this instance; {FALLBACK}")
    total = len(ids) + params.max_tokens
    if total > engine.max_model_len:
        raise TransferError(
            f"kv transfer: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds this instance's "
            f"context length {engine.max_model_len}; {FALLBACK}"
        )
    pages = engine.blocks.allocator.pages_for(total + engine.K + 1)
    if pages > engine.pool.num_pages:
        raise TransferError(
            f"kv transfer: prompt + max_tokens needs {pages} KV pages but this instance's pool has "
            f"{engine.pool.num_pages}; {FALLBACK}, or raise --num-pages"
        )
    if len(engine.scheduler.running) >= engine.cfg.max_num_seqs:
        raise TransferError(
            f"kv transfer: {len(engine.scheduler.running)} requests are running, the instance's max_num_seqs; "
            f"{FALLBACK} (queued), or raise --max-num-seqs on the decode instance"
        )
    if engine.states is not None and not engine.states.free:
        raise TransferError(f"kv transfer: no free recurrent-state slot; {FALLBACK}")
