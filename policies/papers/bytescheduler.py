"""Layer-order priority with tensor partition and a credit window, as in P3 and ByteScheduler.

Papers: "Priority-based Parameter Propagation for Distributed DNN Training" (P3), MLSys 2019; "A Generic
Communication Scheduler for Distributed DNN Training Acceleration" (ByteScheduler), SOSP 2019. Tensors are cut
into fixed-size partitions and sent input-side layer first (the next forward needs them first), with at most a
credit of bytes in flight.
"""
from __future__ import annotations

from tensorlane.policies.compress import with_levels
from tensorlane.policies.model import MiB, Profile, Schedule, layer_pieces, make_blocks


def bytescheduler(profile: Profile, partition_bytes: int = 4 * MiB, credit_bytes: int = 16 * MiB,
                  queues: int = 1) -> Schedule:
    """Layer-order priority with fixed partition and a credit window (P3, MLSys'19; ByteScheduler, SOSP'19).

    Every layer is cut into ``partition_bytes`` pieces; pieces of layer ``i`` get priority ``i`` (input side first,
    because the next forward needs them first); a piece may start when the bytes in flight, its own included, stay
    within ``credit_bytes`` (one may always start on an idle link: ``policies.simulator``). Defaults are
    ByteScheduler's own (1M fp32 parameters partition, 4M credit); for all-reduce it suggests a larger partition
    (about 8M parameters, 32 MiB), which ``policies.papers.compare``'s grid brackets (16 and 64 MiB). ``queues > 1``
    also marks the priorities onto that many network levels.
    Usage: ``bytescheduler(p, partition_bytes=1 << 20, credit_bytes=4 << 20)``
    """
    ranges, prios = layer_pieces(profile, [partition_bytes] * len(profile.layers))
    blocks = with_levels(make_blocks(profile, ranges, prios), queues)
    return Schedule("bytescheduler", blocks, credit_bytes=credit_bytes, partition_bytes=partition_bytes,
                    params=(("credit_bytes", credit_bytes), ("queues", queues)))
