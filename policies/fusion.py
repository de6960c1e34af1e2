"""Tensor fusion and simultaneous all-reduces: MG-WFBP / PACE's fusion DP, and ASC-WFBP.

Both work in backward order (the order gradients become ready) with the alpha + beta*bytes cost model of
:class:`policies.model.CostModel` (alpha here = its startup term, beta = its per-byte wire term).
"""
from __future__ import annotations

import heapq

from tensorlane.policies.model import CostModel, Profile, Schedule, grad_ready_times, make_blocks


def _backward_items(profile: Profile) -> tuple[list[int], list[float], list[int]]:
    """Layers with parameters in backward order (last layer first): indices, ready times, bytes."""
    ready = grad_ready_times(profile)
    idx = [i for i in range(len(profile.layers) - 1, -1, -1) if profile.layers[i].params_bytes > 0]
    return idx, [ready[i] for i in idx], [profile.layers[i].params_bytes for i in idx]


def fusion_groups(ready: list[float], sizes: list[int], cost: CostModel) -> tuple[list[tuple[int, int]], float]:
    """Optimal merge of a ready-ordered tensor sequence into consecutive groups for one sequential stream
    (MG-WFBP, INFOCOM'19; the fusion DP of PACE, INFOCOM'20).

    f[0] = 0;  f[k+1] = min over j <= k of  max(f[j], ready[k]) + cost(sizes[j] + ... + sizes[k])
    where f[k] is the earliest time the stream has finished the first k tensors. A group is ready when its last
    tensor is; the finish time is non-decreasing in the start time, so an optimal schedule of a prefix extends
    to an optimal schedule (optimal substructure). O(n^2). Returns the groups as (first, last) item indices
    (inclusive) and f[n]. Usage: ``fusion_groups([1, 2], [10, 10], cost)``
    """
    n = len(sizes)
    f = [0.0] + [float("inf")] * n
    arg = [0] * (n + 1)
    for k in range(n):
        nbytes = 0
        for j in range(k, -1, -1):
            nbytes += sizes[j]
            t = max(f[j], ready[k]) + cost.allreduce_s(nbytes)
            if t < f[k + 1]:
                f[k + 1], arg[k + 1] = t, j
    groups = []
    k = n
    while k > 0:
        groups.append((arg[k], k - 1))
        k = arg[k]
    return groups[::-1], f[n]


def fusion_dp(profile: Profile, cost: CostModel) -> Schedule:
    """MG-WFBP / PACE fusion: merge consecutive layers (in backward order) so that the single communication
    stream finishes as early as possible under time(bytes) = alpha + beta*bytes; see :func:`fusion_groups`.

    With one stream the group holding layer 0 finishes last, so iteration time = f[n] + forward time: the DP is
    exactly optimal for this model. Usage: ``fusion_dp(p, CostModel(8, 10e9, 5e-6))``
    """
    idx, ready, sizes = _backward_items(profile)
    groups, _ = fusion_groups(ready, sizes, cost)
    offs = profile.offsets()
    ranges = [(offs[idx[b]], offs[idx[a] + 1]) for a, b in groups]  # idx decreases along the backward order
    blocks = make_blocks(profile, sorted(ranges))
    return Schedule("fusion_dp", blocks, max_inflight=1, fusion_bytes=max((b.nbytes for b in blocks), default=0))


def sequential_finish_s(a_bytes: int, b_bytes: int, gap_s: float, cost: CostModel) -> float:
    """Finish of two all-reduces on one stream, ``a`` ready at 0 and ``b`` at ``gap_s``:
    max(A, gap) + B with A, B the single-operation times. Usage: ``sequential_finish_s(1, 1, 0.0, cost)``
    """
    return max(cost.allreduce_s(a_bytes), gap_s) + cost.allreduce_s(b_bytes)


def fused_finish_s(a_bytes: int, b_bytes: int, gap_s: float, cost: CostModel) -> float:
    """Finish when ``a`` waits for ``b`` and both go as one all-reduce: gap + alpha + beta*(a + b)."""
    return gap_s + cost.allreduce_s(a_bytes + b_bytes)


def concurrent_finish_s(a_bytes: int, b_bytes: int, gap_s: float, cost: CostModel) -> float:
    """Finish of two simultaneous all-reduces sharing the link (ASC-WFBP, INFOCOM'21), ``b`` started ``gap_s``
    after ``a``: their startups overlap and the link is shared, so
    max(alpha + beta*(a + b), gap + alpha + beta*b). Usage: ``concurrent_finish_s(1, 1, 0.0, cost)``
    """
    s, beta = cost.startup_s(), cost.beta_s_per_byte
    return max(s + beta * (a_bytes + b_bytes), gap_s + s + beta * b_bytes)


def concurrency_beats_fusion(a_bytes: int, b_bytes: int, gap_s: float, cost: CostModel, slot_free: bool) -> bool:
    """ASC-WFBP's choice for a tensor ``b`` that becomes ready ``gap_s`` after ``a`` was launched.

    Under the fluid cost model, concurrent <= fused always (the link is work-conserving and the startups
    overlap), strictly when gap > 0, and concurrent <= sequential with a saving of up to one startup.
    Concurrency therefore wins whenever an in-flight slot is free; fusion wins only when all slots are busy:
    then ``b`` would wait anyway, and merging the waiting tensors pays one startup instead of several.
    Usage: ``concurrency_beats_fusion(4096, 4096, 1e-4, cost, slot_free=True)``
    """
    return slot_free and concurrent_finish_s(a_bytes, b_bytes, gap_s, cost) <= fused_finish_s(a_bytes, b_bytes,
                                                                                            gap_s, cost)


def asc_groups(ready: list[float], sizes: list[int], cost: CostModel, slots: int) -> list[tuple[int, int]]:
    """ASC-WFBP grouping with ``slots`` simultaneous all-reduces: walking the tensors in ready order, a tensor
    that finds a free slot is launched alone (concurrency), one that finds all slots busy joins the waiting
    group, which is launched fused when the earliest slot frees (estimated with the uncontended cost model).
    Returns (first, last) item indices. Usage: ``asc_groups([0, 0, 0], [1, 1, 1], cost, 2)``
    """
    if slots < 1:
        raise ValueError(f"need at least one slot, not {slots}")
    free = [0.0] * slots
    groups: list[tuple[int, int]] = []
    waiting: list[int] = []
    for k in range(len(sizes)):
        if waiting and free[0] <= ready[k]:
            t0 = max(heapq.heappop(free), ready[waiting[-1]])
            heapq.heappush(free, t0 + cost.allreduce_s(sum(sizes[i] for i in waiting)))
            groups.append((waiting[0], waiting[-1]))
            waiting = []
        if not waiting and free[0] <= ready[k]:
            t0 = max(heapq.heappop(free), ready[k])
            heapq.heappush(free, t0 + cost.allreduce_s(sizes[k]))
            groups.append((k, k))
        else:
            waiting.append(k)
    if waiting:
        groups.append((waiting[0], waiting[-1]))
    return groups


def asc_wfbp(profile: Profile, cost: CostModel, slots: int = 2) -> Schedule:
    """ASC-WFBP (INFOCOM'21): WFBP with up to ``slots`` all-reduces in flight at once, fusing only the tensors
    that would otherwise wait for a slot (:func:`asc_groups`, rule in :func:`concurrency_beats_fusion`).

    Usage: ``asc_wfbp(p, cost, slots=4)``
    """
    idx, ready, sizes = _backward_items(profile)
    offs = profile.offsets()
    ranges = [(offs[idx[b]], offs[idx[a] + 1]) for a, b in asc_groups(ready, sizes, cost, slots)]
    blocks = make_blocks(profile, sorted(ranges))
    return Schedule("asc_wfbp", blocks, max_inflight=slots, fusion_bytes=max((b.nbytes for b in blocks), default=0),
                    params=(("slots", slots),))
