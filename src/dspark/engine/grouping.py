"""Splitting a step's batch into groups of similar context length (pure Python, no torch).

A batched forward pads every request to the batch's longest rows and longest context: its attention reads
``B · max rows · max keys`` (row, key) pairs, and its linear layers run ``B · max rows`` rows. One 16k-token request
decoding next to 31 short ones makes all 32 rows read 16k keys in every layer of every step. A group of its own
costs one more forward (weights streamed again, per-op overhead), so a batch is split only where the padding saved
exceeds that: the partition of the requests, sorted by context length, into contiguous groups that minimises

    Σ_groups  fixed + B_g · max_rows_g · (max_keys_g + fixed)

where ``fixed`` (``EngineConfig.split_batch_keys``) is one forward's fixed cost and one row's linear-layer cost,
both in units of one (row, key) attention pair. A batch without much padding (the usual case) is one group after
an O(B) check; otherwise a dynamic programme over the sorted lengths (O(B²)) picks the groups.
"""

from __future__ import annotations

from collections.abc import Sequence


def _cost(n: int, rows: int, keys: int, fixed: int) -> int:
    return fixed + n * rows * (keys + fixed)


def length_groups(keys: Sequence[int], rows: Sequence[int], fixed: int) -> list[list[int]]:
    """Indices 0..B-1 partitioned into groups (each sorted by keys, groups in increasing keys) of least padded cost;
    ``[[0, 1, ..., B-1]]`` when splitting does not pay or ``fixed`` <= 0 (splitting disabled).

    keys[i]: context positions request i's forward attends to (cached + new); rows[i]: its new rows."""
    n = len(keys)
    if len(rows) != n:
        raise ValueError(f"length_groups: {n} key counts but {len(rows)} row counts")
    whole = list(range(n))
    if n <= 1 or fixed <= 0:
        return [whole]
    one = _cost(n, max(rows), max(keys), fixed)
    # a split costs at least one more forward on top of the unpadded work of one forward: no split can beat the
    # whole batch unless the padding costs more than that forward
    unpadded = fixed + sum(r * (k + fixed) for r, k in zip(rows, keys))
    if one - unpadded <= fixed:
        return [whole]
    order = sorted(whole, key=lambda i: (keys[i], rows[i]))
    best = [0] * (n + 1)  # best[j]: least cost of the first j requests in sorted order
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest, max_rows, best[j] = keys[order[j - 1]], 0, one + 1
        for i in range(j - 1, -1, -1):  # group = order[i:j]
            max_rows = max(max_rows, rows[order[i]])
            c = best[i] + _cost(j - i, max_rows, longest, fixed)
            if c < best[j]:
                best[j], cut[j] = c, i
    if best[n] >= one:
        return [whole]
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]
