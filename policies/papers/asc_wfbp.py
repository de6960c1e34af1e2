"""Simultaneous all-reduces with fusion only for the tensors that would wait: ASC-WFBP.

Paper: "Exploiting Simultaneous Communications to Accelerate Data Parallel Distributed Deep Learning", IEEE
INFOCOM 2021. Works in backward order (the order gradients become ready) with the alpha + beta*bytes cost model
of :class:`policies.model.CostModel` (alpha = its startup term, beta = its per-byte wire term).
"""
from __future__ import annotations

import heapq

from tensorlane.policies.model import CostModel, Profile, Schedule, backward_items, make_blocks


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
    idx, ready, sizes = backward_items(profile)
    offs = profile.offsets()
    ranges = [(offs[idx[b]], offs[idx[a] + 1]) for a, b in asc_groups(ready, sizes, cost, slots)]
    blocks = make_blocks(profile, sorted(ranges))
    return Schedule("asc_wfbp", blocks, max_inflight=slots, fusion_bytes=max((b.nbytes for b in blocks), default=0),
                    params=(("slots", slots),))
