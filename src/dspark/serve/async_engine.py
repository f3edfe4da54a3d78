"""An asyncio front for the synchronous :class:`Engine`: one background thread owns the engine and runs
``Engine.step()`` while any request is unfinished (continuous batching across HTTP requests); coroutines talk to
it through a command queue (add / abort) and receive each request's outputs on its own asyncio queue.

Only the engine thread touches the engine. ``lock`` is held while it applies commands and steps, so a metrics
scrape (from another thread) sees a consistent snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from dspark.engine.engine import Engine, EngineError, RequestOutput
from dspark.engine.request import Request
from dspark.engine.transfer import export_request, hold_for_export, import_request
from dspark.sampling_params import SamplingParams

logger = logging.getLogger("dspark.serve")

_IDLE_POLL_S = 0.5  # how often an idle engine thread wakes to check for shutdown


class QueueFullError(EngineError):
    """The engine's waiting queue is full (the server answers 503; retry later)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; the server must be restarted."""


class RequestFailedError(RuntimeError):
    """Processing this request raised inside the engine; the engine finished it alone and keeps serving."""


@dataclass(frozen=True)
class _Add:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    done: Future
    export: bool = False  # P/D prefill: run the prompt and first token only, then export the state (stream.payload)


@dataclass(frozen=True)
class _Import:
    """P/D decode: a shipped request (``engine/transfer.py``) joins the running batch."""

    payload: bytes
    params: SamplingParams
    request_id: str
    prompt_ids: list[int]
    done: Future


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class RequestStream:
    """Outputs of one request, newest first-come; iterating yields cumulative ``RequestOutput`` snapshots
    (several engine steps may be coalesced into one when the consumer is slower than the engine)."""

    def __init__(self, owner: AsyncEngine, request_id: str, num_prompt_tokens: int) -> None:
        self.owner = owner
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.payload: bytes | BaseException | None = None  # an exported request's state, or why its export failed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()  # outputs are cumulative: the newest one says everything
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def final(self) -> RequestOutput:
        last = None
        async for out in self:
            last = out
        assert last is not None
        return last

    def abort(self) -> None:
        """Stop generating (client gone): the engine frees the request's cache pages on its next turn."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncEngine:
    """``await add(prompt_ids, params, request_id) -> RequestStream``; raises ``QueueFullError`` (503),
    ``EngineError`` / ``SamplingParamsError`` (400) or ``EngineDeadError`` (500). A stream raises
    ``RequestFailedError`` when the engine finished its request with an error (the others carry on)."""

    def __init__(self, engine: Engine, on_outputs: Callable[[Sequence[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_outputs = on_outputs  # called on the engine thread, under ``lock``, after every step
        self.lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # P/D prefills to export when they finish, with the params their decode continues with
        self._held: dict[str, tuple[Request, SamplingParams]] = {}

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    # ---- request API (event-loop thread) ---------------------------------------------------------------
    async def add(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, export: bool = False
    ) -> RequestStream:
        """``export``: a P/D prefill; the final output's stream holds the request's exported state (``payload``)."""
        return await self._enqueue(
            lambda done: _Add(prompt_ids, params, request_id, done, export), request_id, len(prompt_ids)
        )

    async def import_(
        self, payload: bytes, params: SamplingParams, request_id: str, prompt_ids: list[int]
    ) -> RequestStream:
        """A P/D decode: continue a request from its shipped state; raises ``TransferError`` (nothing added)."""
        return await self._enqueue(
            lambda done: _Import(payload, params, request_id, prompt_ids, done), request_id, len(prompt_ids)
        )

    async def _enqueue(
        self, command: Callable[[Future], object], request_id: str, num_prompt_tokens: int
    ) -> RequestStream:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop stopped after an error: {self.error!r}")
        self.start()
        stream = RequestStream(self, request_id, num_prompt_tokens)
        self._streams[request_id] = stream
        done: Future = Future()
        self._commands.put(command(done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away: undo the add if the engine applied it already
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(_Abort(request_id))

    # ---- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished
                commands = self._take_commands(block)
                if _STOP in commands:
                    return
                with self.lock:
                    touched = self._apply(commands)
                    outs = self.engine.step() if self.engine.has_unfinished or touched else []
                    if outs and self.on_outputs is not None:
                        self.on_outputs(outs)
                    exports = self._export(outs) if self._held else {}
                if outs:
                    self._post(self._deliver, outs, exports)
        except BaseException as e:  # noqa: BLE001 - anything here kills the loop; tell every waiter
            logger.exception("engine loop failed")
            self.error = e
            self._post(self._fail_all, e)

    def _take_commands(self, block: bool) -> list:
        out = []
        if block:
            try:
                out.append(self._commands.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def _apply(self, commands: list) -> bool:
        touched = False
        for cmd in commands:
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
                touched = True  # a step drains the aborted request's output
            elif isinstance(cmd, _Add | _Import):
                if not cmd.done.set_running_or_notify_cancel():
                    continue  # the caller was cancelled before the engine got to it
                try:
                    self._add(cmd)
                except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                    cmd.done.set_exception(e)
                else:
                    cmd.done.set_result(None)
                    touched = touched or isinstance(cmd, _Import)  # a step reports its first token
        return touched

    def _add(self, cmd: _Add | _Import) -> None:
        if isinstance(cmd, _Import):
            import_request(self.engine, cmd.payload, cmd.params, cmd.request_id, cmd.prompt_ids)
            return
        if len(self.engine.scheduler.waiting) >= self.engine.cfg.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.engine.cfg.max_waiting} requests); retry later "
                "or start the server with a larger --max-waiting"
            )
        if cmd.export:
            req = hold_for_export(self.engine, cmd.prompt_ids, cmd.params, cmd.request_id)
            self._held[cmd.request_id] = (req, cmd.params)
        else:
            self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.request_id)

    def _export(self, outs: Sequence[RequestOutput]) -> dict[str, bytes | BaseException]:
        """The payloads of held requests that finished this step (their pages and state slots freed either way);
        one that was aborted or failed has nothing to export."""
        exports: dict[str, bytes | BaseException] = {}
        for out in outs:
            held = self._held.pop(out.request_id, None) if out.finished else None
            if held is None or out.finish_reason in ("abort", "error"):
                continue
            req, params = held
            try:
                exports[out.request_id] = export_request(self.engine, req, params)
            except Exception as e:  # noqa: BLE001 - the route reports it; the decode side then prefills itself
                logger.exception("exporting request %s failed", out.request_id)
                exports[out.request_id] = e
        return exports

    def _post(self, fn: Callable, *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call (shutdown)
                pass

    # ---- event-loop thread callbacks -------------------------------------------------------------------
    def _deliver(self, outs: Sequence[RequestOutput], exports: dict[str, bytes | BaseException]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.payload = exports.get(out.request_id, stream.payload)
            failed = out.finished and out.finish_reason == "error"
            item = RequestFailedError(f"request {out.request_id} failed: {out.error}") if failed else out
            stream.queue.put_nowait(item)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        wrapped = EngineDeadError(f"the engine loop stopped after an error: {error!r}")
        for stream in self._streams.values():
            stream.queue.put_nowait(wrapped)
        self._streams.clear()


class IncrementalText:
    """Text deltas for streaming, computed from the full decoded text of each snapshot.

    Holds back a trailing U+FFFD (an incomplete multi-byte character) and any suffix that could be the start of a
    stop string (the engine cuts the final text there), so the concatenated deltas equal the final text."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self.sent = ""

    def update(self, text: str, finished: bool) -> str:
        safe = text
        if not finished:
            safe = safe.rstrip("\ufffd")
            safe = safe[: len(safe) - _partial_stop_len(safe, self.stop)]
        if len(safe) <= len(self.sent):
            return ""
        # (if the decoder ever revised text already sent, the new tail is sent by position: best effort)
        delta = safe[len(self.sent) :]
        self.sent = safe
        return delta


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
