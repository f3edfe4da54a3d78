"""Named profiler scopes in library code, free when no breakdown is being recorded.

``scope("target.moe.experts")`` is a ``torch.profiler.record_function`` while ``recording()`` is active (as in
``dspark profile --breakdown``) and a shared no-op context otherwise (~0.2 µs), so the hot path keeps them.
Scope names are dotted: the first part is the phase (step, target, draft, ...), the rest the piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

_NULL = contextlib.nullcontext()
_recording = False


def scope(name: str) -> AbstractContextManager[object]:
    """A profiler range named ``dspark::<name>`` while recording, else a no-op."""
    return torch.profiler.record_function("dspark::" + name) if _recording else _NULL


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Turn the scopes on for the duration (use inside a ``torch.profiler.profile`` block)."""
    global _recording
    before, _recording = _recording, True
    try:
        yield
    finally:
        _recording = before
