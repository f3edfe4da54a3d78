"""Shared by the server tests: a live uvicorn around an engine, and ways to wait on engine state (not wall time)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import uvicorn

from dspark.llm import build_engine
from dspark.serve.app import create_app

K = 4


def make_engine(pair, spec: bool = True, **kw):
    """The tiny pair served in fp32; with ``spec`` every step drafts (the guard off), so that the speculative
    counters a test reads move with each request."""
    cfg = {"method": "dspark", "model": str(pair[1]), "num_speculative_tokens": K, "speculation_guard": False}
    cfg = cfg if spec else None
    return build_engine(pair[0], cfg, dtype="float32", **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine, **kw):
    app = create_app(engine, **kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def wait_idle(engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished or engine.num_pages_free != engine.pool.num_pages:
        assert time.monotonic() < deadline, (engine.num_pages_free, engine.pool.num_pages)
        time.sleep(0.02)


class StepGate:
    """Lets the engine thread take a step only when the test allows one, so a test waits on engine state, not on
    how fast the machine is: while closed, commands (add, abort) are still applied but nobody generates."""

    def __init__(self, engine) -> None:
        self.permits = threading.Semaphore(0)
        self.opened = threading.Event()
        real = engine.step

        def gated():
            if self.opened.is_set() or self.permits.acquire(timeout=0.005):
                return real()
            return engine._drain()  # still report aborted/finished requests

        engine.step = gated

    def allow(self, n: int = 1) -> None:
        self.permits.release(n)

    def open(self) -> None:
        self.opened.set()


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "engine state not reached"
        time.sleep(0.005)


def sse_events(lines) -> list:
    """Parse SSE lines into JSON chunks; the last element is the string '[DONE]' when the stream ended cleanly."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
