"""The shim's cutting rule: which level each gradient byte goes at, and how a DDP bucket is cut into pieces.

Pure functions over parameter sizes: the level policy gives every parameter (or layer) a level, and a bucket is
split where the level changes and wherever a piece would exceed the partition size. The shim runs these on
element counts (``shim/ddp.py``); ``policies.execution`` models the same rule on bytes.
Usage: ``levels = parameter_levels(sizes, levels=4); pieces = pieces_of(bucket_sizes, bucket_levels, 4 << 20)``
"""
from __future__ import annotations

from collections.abc import Sequence

from tensorlane.policies.compress import compress_levels

POLICIES = ("layer_order", "flat")


def bucket_pieces(sizes: Sequence[int], levels: Sequence[int], limit: int | None) -> list[tuple[int, int, int]]:
    """Cut a bucket (items of ``sizes``, concatenated in buffer order) into ``(offset, length, level)`` pieces: the
    rule the shim runs (:func:`pieces_of`, in elements) and ``policies.execution`` models (in bytes).

    A piece never mixes levels and never exceeds ``limit`` (None: no limit); adjacent items of one level are fused
    into one piece. Usage: ``bucket_pieces([12, 12], [0, 1], None) == [(0, 12, 0), (12, 12, 1)]``
    """
    pieces: list[tuple[int, int, int]] = []
    offset = 0
    if len(sizes) != len(levels):  # a level short would drop the bucket's last bytes from every piece
        raise ValueError(f"{len(sizes)} sizes but {len(levels)} levels")
    for n, level in zip(sizes, levels, strict=True):
        if pieces and pieces[-1][2] == level and (limit is None or pieces[-1][1] < limit):
            start, length, _ = pieces.pop()
        else:
            start, length = offset, 0
        length += n
        while limit is not None and length > limit:
            pieces.append((start, limit, level))
            start, length = start + limit, length - limit
        pieces.append((start, length, level))
        offset += n
    return [p for p in pieces if p[1] > 0]


def forward_order_levels(sizes_bytes: Sequence[int], levels: int) -> tuple[int, ...]:
    """Layer-order priority (P3, ByteScheduler) on ``levels`` queues: items in forward order compressed onto
    contiguous byte-balanced levels, first items most urgent (CEFS/Crux compression, ``policies.compress``).

    Usage: ``forward_order_levels([4, 4, 4, 4], 2) == (0, 0, 1, 1)``
    """
    if levels < 1:
        raise ValueError(f"levels must be >= 1, not {levels}")
    n = len(sizes_bytes)
    if levels == 1 or n == 0:
        return (0,) * n
    return compress_levels(list(range(n)), queues=levels, reserved=0, weights=[max(1, s) for s in sizes_bytes])


def parameter_levels(sizes_bytes: list[int], levels: int, policy: str = "layer_order") -> list[int]:
    """Level of each parameter, given in forward order (index 0 nearest the input).

    ``layer_order`` (P3, ByteScheduler): the first layers are needed first by the next forward pass, so they get
    the most urgent level; the forward order is compressed onto ``levels`` queues by contiguous byte-balanced
    groups (:func:`forward_order_levels`). ``flat``: every parameter at level 0 (WFBP, Poseidon).
    Usage: ``parameter_levels([4, 4, 4, 4], levels=2) == [0, 0, 1, 1]``
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    if policy == "flat":
        return [0] * len(sizes_bytes)
    return list(forward_order_levels(sizes_bytes, levels))


def pieces_of(numels: list[int], levels: list[int], partition_elems: int | None) -> list[tuple[int, int, int]]:
    """Cut a bucket (parameters of ``numels`` elements, concatenated) into ``(offset, length, level)`` pieces
    (:func:`bucket_pieces` in elements).

    A piece never mixes levels and never exceeds ``partition_elems`` (None: no limit). Adjacent parameters of one
    level are fused into one piece. Usage: ``pieces_of([3, 3], [0, 1], None) == [(0, 3, 0), (3, 3, 1)]``
    """
    return bucket_pieces(numels, levels, partition_elems)
