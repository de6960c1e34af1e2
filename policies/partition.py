"""Per-layer and partitioned schedules: WFBP (Poseidon), ByteScheduler/P3 layer-order priority, US-Byte.

Each function returns a :class:`policies.model.Schedule`; :func:`policies.simulator.simulate` predicts its
iteration time.
"""
from __future__ import annotations

from typing import Sequence

from tensorlane.policies.compress import compress_levels
from tensorlane.policies.model import Block, Profile, Schedule, make_blocks

MiB = 1 << 20


def bucket_pieces(sizes: Sequence[int], levels: Sequence[int], limit: int | None) -> list[tuple[int, int, int]]:
    """Cut a bucket (items of ``sizes``, concatenated in buffer order) into ``(offset, length, level)`` pieces: the
    rule the shim runs (``shim.buckets.pieces_of``, in elements) and ``policies.execution`` models (in bytes).

    A piece never mixes levels and never exceeds ``limit`` (None: no limit); adjacent items of one level are fused
    into one piece. Usage: ``bucket_pieces([12, 12], [0, 1], None) == [(0, 12, 0), (12, 12, 1)]``
    """
    pieces: list[tuple[int, int, int]] = []
    offset = 0
    for n, level in zip(sizes, levels):
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


def layer_ranges(profile: Profile) -> list[tuple[int, int]]:
    """One byte range per layer that has parameters. Usage: ``layer_ranges(p) == [(0, 4), (4, 12)]``"""
    offs = profile.offsets()
    return [(offs[i], offs[i + 1]) for i in range(len(profile.layers)) if offs[i + 1] > offs[i]]


def split_range(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` into pieces of ``size`` bytes, the last one shorter (ByteScheduler's partition rule).

    Usage: ``split_range(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]``
    """
    if size < 1:
        raise ValueError(f"partition size must be positive, not {size}")
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def with_levels(blocks: Sequence[Block], queues: int) -> tuple[Block, ...]:
    """Blocks with ``level`` set by compressing their priorities onto ``queues`` levels, balancing bytes (CEFS).

    Usage: ``with_levels(blocks, 5)``
    """
    levels = compress_levels([b.priority for b in blocks], queues=queues, reserved=0,
                             weights=[b.nbytes for b in blocks])
    return tuple(Block(b.start, b.end, b.layers, b.ready_s, b.priority, lv) for b, lv in zip(blocks, levels))


def wfbp(profile: Profile) -> Schedule:
    """Wait-free backpropagation (Poseidon, ATC'17): each layer's all-reduce is launched as soon as its gradient
    is ready, with no priority: one block per layer, first-ready first-served on one communication stream.

    Usage: ``simulate(p, wfbp(p), cost)``
    """
    return Schedule("wfbp", make_blocks(profile, layer_ranges(profile)), max_inflight=1)


def bytescheduler(profile: Profile, partition_bytes: int = 4 * MiB, credit_bytes: int = 16 * MiB,
                  queues: int = 1) -> Schedule:
    """Layer-order priority with fixed partition and a credit window (P3, MLSys'19; ByteScheduler, SOSP'19).

    Every layer is cut into ``partition_bytes`` pieces; pieces of layer ``i`` get priority ``i`` (input side first,
    because the next forward needs them first); a piece may start while fewer than ``credit_bytes`` are in flight.
    Defaults are ByteScheduler's all-reduce suggestion (1M fp32 parameters partition, 4M credit). ``queues > 1``
    also marks the priorities onto that many network levels.
    Usage: ``bytescheduler(p, partition_bytes=1 << 20, credit_bytes=4 << 20)``
    """
    ranges: list[tuple[int, int]] = []
    prios: list[int] = []
    offs = profile.offsets()
    for i in range(len(profile.layers)):
        for r in split_range(offs[i], offs[i + 1], partition_bytes):
            ranges.append(r)
            prios.append(i)
    blocks = with_levels(make_blocks(profile, ranges, prios), queues)
    return Schedule("bytescheduler", blocks, credit_bytes=credit_bytes, partition_bytes=partition_bytes,
                    params=(("credit_bytes", credit_bytes), ("queues", queues)))


def unequal_sizes(profile: Profile, first_bytes: int, slope: float) -> tuple[int, ...]:
    """US-Byte block size of each layer: ``first_bytes * (1 + slope * offset / total)``, so blocks grow from the
    input side (needed first in the next forward: small blocks, early start) to the output side (needed last:
    large blocks, fewer startups). ``slope == 0`` gives ByteScheduler's equal sizes.

    Usage: ``unequal_sizes(p, 1 << 20, 3.0)``
    """
    if first_bytes < 1 or slope < 0:
        raise ValueError("first_bytes must be positive and slope non-negative")
    offs, total = profile.offsets(), max(1, profile.total_bytes)
    return tuple(max(1, round(first_bytes * (1 + slope * offs[i] / total))) for i in range(len(profile.layers)))


def phase2_order(blocks: Sequence[Block]) -> tuple[Block, ...]:
    """US-Byte (TPDS'23) phase 2: once backward has finished, send the remaining blocks in forward-layer order.

    Derivation: in phase 2 the forward pass consumes layers 0, 1, 2, ... in order and layer ``i`` may start only
    when its blocks have arrived. Take any order in which a block of layer ``j`` is sent just before a block of
    layer ``i < j``. Swapping the two makes the ``i`` block arrive earlier and the ``j`` block arrive when the
    ``i`` block arrived before; the forward needs ``i`` first, so no layer starts later (an exchange argument,
    as for a two-machine flow shop whose second machine has a fixed job order). Repeating the swap sorts the
    blocks by layer: input-side-first is optimal. Usage: ``phase2_order(remaining)``
    """
    return tuple(sorted(blocks, key=lambda b: (min(b.layers), b.start)))


def us_byte(profile: Profile, first_bytes: int = 1 * MiB, slope: float = 3.0, credit_bytes: int | None = 16 * MiB,
            queues: int = 1) -> Schedule:
    """Unequal-sized tensor blocks (US-Byte, TPDS'23): layer-order priority (the phase-2 optimal order, which
    also governs phase 1 because the most recently ready, lowest layer goes first) with block sizes growing
    towards the output layers (:func:`unequal_sizes`), under a credit window like ByteScheduler's.

    Usage: ``us_byte(p, first_bytes=1 << 20, slope=3.0)``
    """
    sizes = unequal_sizes(profile, first_bytes, slope)
    offs = profile.offsets()
    ranges: list[tuple[int, int]] = []
    prios: list[int] = []
    for i in range(len(profile.layers)):
        for r in split_range(offs[i], offs[i + 1], sizes[i]):
            ranges.append(r)
            prios.append(i)
    blocks = with_levels(make_blocks(profile, ranges, prios), queues)
    return Schedule("us_byte", blocks, credit_bytes=credit_bytes, partition_bytes=first_bytes,
                    params=(("slope", slope), ("credit_bytes", credit_bytes or 0), ("queues", queues)))
