"""Prefill/decode (P/D) disaggregation, the server's side (the engine's is ``engine/transfer.py``; the proxy that
drives both instances is ``serve/proxy.py``).

A request carrying ``kv_transfer_params`` (set by the proxy) takes one of two paths:

- ``do_remote_decode`` (``--role prefill`` or ``both``): the instance runs the prompt and samples the first token
  (max_tokens=1), exports the request's state on the engine thread and POSTs it, binary, to
  ``{decode_url}/v1/kv_transfer/{transfer_id}``; it answers with the one-token response plus
  ``kv_transfer_params: {transfer_id, status: "sent" | "failed", bytes, header_bytes, error}``.
- ``do_remote_prefill`` (``--role decode`` or ``both``): the instance continues from the payload it received under
  ``transfer_id`` — pages written, state restored, straight into decode — and streams or returns the completion.

``POST /v1/kv_transfer/{transfer_id}`` (decode roles; not in /openapi.json: it is between instances) checks the
payload's magic, checksum and every header key against its own engine before keeping it, and answers 400 naming
what is wrong. Whatever fails — the decode instance down or slow, a corrupt or mismatched payload, no room to import
it — the request is still answered: the decode instance prefills it itself, with one warning line saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from dspark.engine.engine import RequestOutput
from dspark.engine.transfer import TransferError, check_compatible, header_size, read_payload
from dspark.sampling_params import SamplingParams
from dspark.serve.async_engine import RequestStream
from dspark.serve.errors import APIError
from dspark.serve.protocol import KVTransferParams
from dspark.serve.state import ServerState, State
from dspark.serve.streaming import ClientGone, wait_final

logger = logging.getLogger("dspark.serve.disagg")

router = APIRouter()


def _check_role(state: ServerState, role: str, what: str) -> None:
    if not state.config.takes(role):
        raise APIError(
            400,
            f"{what}: this instance's role is {state.config.role!r}; send it to an instance started with "
            f"`dspark serve --role {role}` (or both)",
            param="kv_transfer_params",
        )


# ---- the decode side ------------------------------------------------------------------------------------------------


@router.post("/v1/kv_transfer/{transfer_id}", include_in_schema=False)
async def receive(transfer_id: str, request: Request, state: State) -> JSONResponse:
    """Keep a pushed payload for the decode request that follows, once its checksum and layout check out."""
    _check_role(state, "decode", "POST /v1/kv_transfer")
    payload = await request.body()
    try:
        header, _ = read_payload(payload)
        check_compatible(state.engine, header)
    except TransferError as e:
        state.inbox.put(transfer_id, None, str(e))
        state.metrics.transfer.failures += 1
        logger.warning("kv transfer %s refused (%d bytes): %s", transfer_id, len(payload), e)
        raise APIError(400, str(e), param="body", code="kv_transfer_refused") from None
    state.inbox.put(transfer_id, payload)
    state.metrics.transfer.bytes_received += len(payload)
    return JSONResponse({"transfer_id": transfer_id, "bytes": len(payload)})


async def open_streams(
    state: ServerState,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    rid: str,
    kv: KVTransferParams | None,
) -> list[RequestStream]:
    """The requests' streams: with ``do_remote_prefill``, continued from the received payload (pages and state in
    place, straight into decode); without one, or when it is missing or cannot be imported, prefilled here."""
    if kv is None or not kv.do_remote_prefill:
        return await state.submit(prompts, params, rid)
    _check_role(state, "decode", "kv_transfer_params.do_remote_prefill")
    try:
        if len(prompts) != 1:
            raise TransferError(f"kv transfer {kv.transfer_id!r}: a request with {len(prompts)} prompts")
        stream = await state.async_engine.import_(state.inbox.take(kv.transfer_id), params[0], rid, prompts[0])
    except Exception as e:  # noqa: BLE001 - whatever went wrong with the payload, the request is served here
        state.metrics.transfer.fallbacks += 1
        why = str(e) if isinstance(e, TransferError) else f"kv transfer {kv.transfer_id!r}: import failed ({e!r})"
        logger.warning("%s; prefilling request %s locally instead (fallback)", why, rid)
        return await state.submit(prompts, params, rid)
    state.metrics.transfer.requests_imported += 1
    return [stream]


# ---- the prefill side -----------------------------------------------------------------------------------------------


async def prefill_for_remote_decode(
    state: ServerState,
    request: Request,
    kv: KVTransferParams,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    rid: str,
    respond: Callable[[RequestOutput], BaseModel],
) -> Response:
    """``do_remote_decode``: run the prompt and first token, push the request's state to the decode instance, and
    answer with ``respond(final)`` plus ``kv_transfer_params`` saying whether the push succeeded."""
    _check_remote_decode(state, kv, prompts)
    stream = (await state.submit(prompts, params, rid, export=True))[0]
    try:
        (final,) = await wait_final([stream], request)
    except ClientGone:
        return Response(status_code=499)
    result = await _push(state, kv, stream.payload, request.headers.get("authorization"))
    return JSONResponse(respond(final).model_dump() | {"kv_transfer_params": result})


def _check_remote_decode(state: ServerState, kv: KVTransferParams, prompts: Sequence[list[int]]) -> None:
    _check_role(state, "prefill", "kv_transfer_params.do_remote_decode")
    if kv.decode_url is None or len(prompts) != 1:
        raise APIError(
            400,
            "kv_transfer_params.do_remote_decode needs one prompt and a decode_url (the decode instance's base URL, "
            "http://host:port)",
            param="kv_transfer_params",
        )


async def _push(state: ServerState, kv: KVTransferParams, payload: object, auth: str | None) -> dict:
    """POST the payload to the decode instance; a failure is logged and reported, never raised."""
    assert kv.decode_url is not None
    url = f"{kv.decode_url.rstrip('/')}/v1/kv_transfer/{kv.transfer_id}"
    result: dict = {"transfer_id": kv.transfer_id, "status": "failed", "bytes": 0, "header_bytes": 0}
    headers = {"content-type": "application/octet-stream"} | ({"authorization": auth} if auth else {})
    try:
        if not isinstance(payload, bytes):
            raise TransferError(f"the export failed: {payload!r}")
        async with httpx.AsyncClient(timeout=state.config.kv_transfer_timeout_s) as client:
            r = await client.post(url, content=payload, headers=headers)
        if r.status_code != 200:
            raise TransferError(f"the decode instance answered {r.status_code}: {r.text[:500]}")
    except (httpx.HTTPError, TransferError) as e:
        state.metrics.transfer.failures += 1
        logger.warning(
            "kv transfer %s to %s failed (%s: %s); the decode instance will prefill the request itself",
            kv.transfer_id,
            url,
            type(e).__name__,
            e,
        )
        return result | {"error": f"{type(e).__name__}: {e}"}
    state.metrics.transfer.bytes_sent += len(payload)
    state.metrics.transfer.requests_sent += 1
    return result | {"status": "sent", "bytes": len(payload), "header_bytes": header_size(payload)}
