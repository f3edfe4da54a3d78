"""What a P/D decode instance received: pushed payloads (and ids it refused, with why), each claimed once by the
decode request that follows (``serve/disagg.py``)."""

from __future__ import annotations

import time
from collections import OrderedDict

from dspark.engine.transfer import TransferError

INBOX_TTL_S = 300.0  # a payload nobody claims within this is dropped (the proxy sends its decode request at once)
INBOX_MAX = 1024  # payloads kept at most (the oldest dropped first)


class KVInbox:
    def __init__(self, ttl_s: float = INBOX_TTL_S, max_items: int = INBOX_MAX) -> None:
        self.ttl_s, self.max_items = ttl_s, max_items
        self._items: OrderedDict[str, tuple[float, bytes | None, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, transfer_id: str, payload: bytes | None, refused: str = "") -> None:
        """Keep ``payload`` under ``transfer_id`` (None: refused, ``refused`` saying why)."""
        now = time.monotonic()
        while self._items and (len(self._items) >= self.max_items or self._oldest() < now - self.ttl_s):
            self._items.popitem(last=False)
        self._items.pop(transfer_id, None)
        self._items[transfer_id] = (now, payload, refused)

    def _oldest(self) -> float:
        return next(iter(self._items.values()))[0]

    def take(self, transfer_id: str) -> bytes:
        """The payload received under ``transfer_id``, forgotten; raises ``TransferError`` saying why there is none."""
        item = self._items.pop(transfer_id, None)
        if item is None:
            raise TransferError(f"kv transfer {transfer_id!r}: no payload arrived under this id (lost or expired)")
        if item[1] is None:
            raise TransferError(f"kv transfer {transfer_id!r} was refused on arrival: {item[2]}")
        return item[1]
