"""Compression of many priorities onto the few queues a NIC or switch has (CEFS, CoNEXT'20; Crux, SIGCOMM'24).

A switch has usually 8 strict-priority queues, some reserved (best effort, CS6/CS7 network control), and
``policies.levels`` can mark at most 5 distinct levels. Policies produce many priorities (one per layer, block
or job). CEFS maps them onto the queues preserving their order; Crux compresses job priorities onto K levels by a
max K-cut over a contention DAG. Here the mapping is a *contiguous, order-preserving split* of the sorted distinct
priorities into at most ``queues - reserved`` groups that minimises the heaviest group (weights: bytes, or 1 per
item) -- the linear-partition form of the max K-cut when the contention DAG is the priority chain. Ties are
broken towards small urgent levels: the split is filled from the least urgent end.
"""
from __future__ import annotations

from collections.abc import Sequence

from tensorlane.policies.model import Block


def _groups_needed(weights: Sequence[int], bound: int) -> int:
    """Contiguous groups a greedy left-to-right fill needs so that no group sum exceeds ``bound``."""
    groups, acc = 1, 0
    for w in weights:
        if acc + w > bound:
            groups, acc = groups + 1, w
        else:
            acc += w
    return groups


def contiguous_split(weights: Sequence[int], k: int) -> tuple[int, ...]:
    """Group index (0..) of each item for a split of ``weights`` into min(k, n) contiguous non-empty groups that
    minimises the largest group sum; the least urgent (last) groups are filled first.

    Usage: ``contiguous_split([1, 1, 1, 5], 2) == (0, 0, 0, 1)``
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"need at least one group, not {k}")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    if n == 0:
        return ()
    k = min(k, n)
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # smallest bound that k groups can meet
        mid = (lo + hi) // 2
        if _groups_needed(weights, mid) <= k:
            hi = mid
        else:
            lo = mid + 1
    bound = lo
    out = [0] * n
    group, acc = k - 1, 0
    for i in range(n - 1, -1, -1):
        # start a new (more urgent) group when this one is full, or when the items left are only just enough
        # to give every remaining group one item
        if i < n - 1 and group > 0 and (acc + weights[i] > bound or i + 1 == group):
            group, acc = group - 1, 0
        out[i] = group
        acc += weights[i]
    return tuple(out)


def compress_levels(priorities: Sequence[float], queues: int = 8, reserved: int = 3,
                    weights: Sequence[int] | None = None) -> tuple[int, ...]:
    """Level (0 = most urgent) of each priority when ``queues - reserved`` levels are available (CEFS / Crux).

    Order is preserved: a smaller priority never gets a larger level, equal priorities share a level, and the
    levels used are 0..m-1 with m = min(queues - reserved, number of distinct priorities). ``weights`` (e.g. bytes
    per item; default 1 each) are summed per distinct priority and the contiguous split minimises the heaviest
    level. Usage: ``compress_levels([0, 1, 2, 3], queues=2, reserved=0) == (0, 0, 1, 1)``
    """
    usable = queues - reserved
    if usable < 1:
        raise ValueError(f"{queues} queues with {reserved} reserved leave no level")
    if weights is not None and len(weights) != len(priorities):
        raise ValueError("weights and priorities differ in length")
    distinct = sorted(set(priorities))
    rank = {p: i for i, p in enumerate(distinct)}
    per = [0] * len(distinct)
    for i, p in enumerate(priorities):
        per[rank[p]] += 1 if weights is None else int(weights[i])
    group = contiguous_split(per, usable)
    return tuple(group[rank[p]] for p in priorities)


def with_levels(blocks: Sequence[Block], queues: int) -> tuple[Block, ...]:
    """Blocks with ``level`` set by compressing their priorities onto ``queues`` levels, balancing bytes (CEFS).

    Usage: ``with_levels(blocks, 5)``
    """
    levels = compress_levels([b.priority for b in blocks], queues=queues, reserved=0,
                             weights=[b.nbytes for b in blocks])
    return tuple(Block(b.start, b.end, b.layers, b.ready_s, b.priority, lv)
                 for b, lv in zip(blocks, levels, strict=True))
