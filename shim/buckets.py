"""Which level each gradient byte goes at, and how a DDP bucket is cut into all-reduce pieces.

Pure functions over parameter sizes (no torch calls beyond reading ``numel``): the policy gives every parameter a
level, a bucket is split where the level changes and wherever a piece would exceed ``partition_bytes``.
Usage: ``levels = parameter_levels(sizes, levels=4); pieces = pieces_of(bucket_sizes, bucket_levels, 4 << 20)``
"""
from __future__ import annotations

from tensorlane.policies.partition import bucket_pieces, forward_order_levels

POLICIES = ("layer_order", "flat")


def parameter_levels(sizes_bytes: list[int], levels: int, policy: str = "layer_order") -> list[int]:
    """Level of each parameter, given in forward order (index 0 nearest the input).

    ``layer_order`` (P3, ByteScheduler): the first layers are needed first by the next forward pass, so they get
    the most urgent level; the forward order is compressed onto ``levels`` queues by contiguous byte-balanced
    groups (CEFS/Crux compression, ``policies.compress``). ``flat``: every parameter at level 0 (WFBP, Poseidon).
    Usage: ``parameter_levels([4, 4, 4, 4], levels=2) == [0, 0, 1, 1]``
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    if policy == "flat":
        return [0] * len(sizes_bytes)
    return list(forward_order_levels(sizes_bytes, levels))


def pieces_of(numels: list[int], levels: list[int], partition_elems: int | None) -> list[tuple[int, int, int]]:
    """Cut a bucket (parameters of ``numels`` elements, concatenated) into ``(offset, length, level)`` pieces.

    A piece never mixes levels and never exceeds ``partition_elems`` (None: no limit). Adjacent parameters of one
    level are fused into one piece. Usage: ``pieces_of([3, 3], [0, 1], None) == [(0, 3, 0), (3, 3, 1)]``
    """
    return bucket_pieces(numels, levels, partition_elems)
