"""Preemptive all-reduce scheduling over the training DAG: PACE, with TicTac's consumption order.

Papers: "Preemptive All-reduce Scheduling for Expediting Distributed DNN Training" (PACE), IEEE INFOCOM 2020;
"TicTac: Accelerating Distributed Deep Learning with Communication Scheduling", MLSys 2019 (the order in which the
next forward consumes the parameters). Priorities follow the earliest consumer in the forward DAG, are compressed
onto the network's levels, and the network preempts the less urgent levels.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensorlane.policies.compress import with_levels
from tensorlane.policies.model import Profile, Schedule, make_blocks, split_range


def dag_indices(profile: Profile, dag: Mapping[str, Sequence[str]] | Mapping[int, Sequence[int]] | None
                ) -> tuple[tuple[int, ...], ...]:
    """Predecessors of each layer by index, from a dict keyed by layer name or index (missing keys: no
    predecessor), or from ``profile.dag``, or a chain when both are None.

    Usage: ``dag_indices(p, {"b": ["a"]})``
    """
    n = len(profile.layers)
    if dag is None:
        if profile.dag is not None:
            return profile.dag
        return tuple(() if i == 0 else (i - 1,) for i in range(n))
    index = {ly.name: i for i, ly in enumerate(profile.layers)}
    out: list[tuple[int, ...]] = [()] * n
    for key, preds in dag.items():
        k = index[key] if isinstance(key, str) else int(key)
        out[k] = tuple(sorted(index[p] if isinstance(p, str) else int(p) for p in preds))
    for i, preds in enumerate(out):
        if any(p >= i for p in preds):
            raise ValueError(f"layer {i}: predecessors must come earlier in forward order (a DAG in forward order)")
    return tuple(out)


def consumer_order(profile: Profile, dag: Mapping[str, Sequence[str]] | Mapping[int, Sequence[int]] | None = None
                   ) -> tuple[int, ...]:
    """Priority rank of each layer's gradient: the earliest time the next forward pass could consume it.

    That time is the layer's as-soon-as-possible start in the forward DAG with the profile's forward times
    (est[i] = max over predecessors p of est[p] + fwd[p]); ties go to the lower forward index. On a chain
    this is the layer order 0, 1, 2, ... (P3 / ByteScheduler); in a DAG a side branch (a ResNet downsample)
    ranks with the first layer that shares its input. Usage: ``consumer_order(p) == (0, 1, 2)`` for a chain.
    """
    preds = dag_indices(profile, dag)
    est = [0.0] * len(profile.layers)
    for i, ps in enumerate(preds):
        est[i] = max((est[p] + profile.layers[p].fwd_s for p in ps), default=0.0)
    order = sorted(range(len(profile.layers)), key=lambda i: (est[i], i))
    rank = [0] * len(order)
    for r, i in enumerate(order):
        rank[i] = r
    return tuple(rank)


def pace(profile: Profile, dag: Mapping[str, Sequence[str]] | Mapping[int, Sequence[int]] | None = None,
         fusion_bytes: int = 0, partition_bytes: int | None = None, queues: int = 5) -> Schedule:
    """PACE (INFOCOM'20): preemptive all-reduce scheduling on the DAG.

    Priority = :func:`consumer_order` (earliest consumer in the next forward); adjacent layers that are also
    adjacent in priority (among the layers with gradients) are fused while the block stays under ``fusion_bytes``
    (PACE merges small tensors; the planner picks the threshold with the simulator as the oracle); optional
    ``partition_bytes`` cuts large tensors. Priorities are compressed onto ``queues`` network levels, each level one
    communicator (one operation in flight per level), and the network preempts lower levels: preemption is in the
    transport.
    Usage: ``pace(load_profile("resnet50"), fusion_bytes=1 << 20)``
    """
    rank = consumer_order(profile, dag)
    offs = profile.offsets()
    # neighbours in priority among the layers that have gradients (a layer without parameters sends nothing and
    # keeps no two tensors apart)
    with_grads = sorted((i for i, ly in enumerate(profile.layers) if ly.params_bytes > 0), key=lambda i: rank[i])
    nth = {i: k for k, i in enumerate(with_grads)}
    groups: list[list[int]] = []  # layers (with parameters) of each fused block, in forward order
    for i in range(len(profile.layers)):
        if profile.layers[i].params_bytes == 0:
            continue
        if groups:
            g = groups[-1]
            if nth[i] == nth[g[-1]] + 1 and offs[i + 1] - offs[g[0]] <= fusion_bytes:
                g.append(i)
                continue
        groups.append([i])
    ranges = [(offs[g[0]], offs[g[-1] + 1]) for g in groups]
    prios = [rank[g[0]] for g in groups]
    if partition_bytes is not None:
        cut_r, cut_p = [], []
        for (lo, hi), p in zip(ranges, prios, strict=True):
            for r in split_range(lo, hi, partition_bytes):
                cut_r.append(r)
                cut_p.append(p)
        ranges, prios = cut_r, cut_p
    blocks = with_levels(make_blocks(profile, ranges, prios), queues)
    return Schedule("pace", blocks, per_level_inflight=1, partition_bytes=partition_bytes, fusion_bytes=fusion_bytes,
                    params=(("queues", queues),))

