"""Unequal-sized tensor blocks, as in US-Byte.

Paper: "US-Byte: An Efficient Communication Framework for Scheduling Unequal-Sized Tensor Blocks in Distributed
Deep Learning", IEEE Transactions on Parallel and Distributed Systems (TPDS), 2023. Blocks grow from the input
side (needed first by the next forward: small, early) to the output side (needed last: large, fewer startups);
after backward the remaining blocks go in forward-layer order.
"""
from __future__ import annotations

from collections.abc import Sequence

from tensorlane.policies.compress import with_levels
from tensorlane.policies.model import Block, MiB, Profile, Schedule, layer_pieces, make_blocks


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
    """Unequal-sized tensor blocks (US-Byte, TPDS'23): layer-order priority (the phase-2 optimal order, kept
    for phase 1 as well: a simplification, the paper finds input-first not optimal while backward runs and solves
    that phase with an algorithm of its own, not reproduced here) with block sizes growing linearly towards the
    output layers (:func:`unequal_sizes`; the paper derives them from its model), under a credit window like
    ByteScheduler's.

    Usage: ``us_byte(p, first_bytes=1 << 20, slope=3.0)``
    """
    ranges, prios = layer_pieces(profile, unequal_sizes(profile, first_bytes, slope))
    blocks = with_levels(make_blocks(profile, ranges, prios), queues)
    return Schedule("us_byte", blocks, credit_bytes=credit_bytes, partition_bytes=first_bytes,
                    params=(("slope", slope), ("credit_bytes", credit_bytes or 0), ("queues", queues)))
