"""Merged-gradient wait-free backpropagation: the fusion dynamic programme of MG-WFBP (also PACE's fusion).

Papers: "MG-WFBP: Efficient Data Communication for Distributed Synchronous SGD Algorithms", IEEE INFOCOM 2019;
the tensor fusion of "Preemptive All-reduce Scheduling for Expediting Distributed DNN Training" (PACE), IEEE
INFOCOM 2020. Consecutive gradients (in backward order) are merged so that one sequential communication stream
finishes as early as possible under the alpha + beta*bytes cost model of :class:`policies.model.CostModel`
(alpha = its startup term, beta = its per-byte wire term).
"""
from __future__ import annotations

from tensorlane.policies.model import CostModel, Profile, Schedule, backward_items, make_blocks


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
    idx, ready, sizes = backward_items(profile)
    groups, _ = fusion_groups(ready, sizes, cost)
    offs = profile.offsets()
    ranges = [(offs[idx[b]], offs[idx[a] + 1]) for a, b in groups]  # idx decreases along the backward order
    blocks = make_blocks(profile, sorted(ranges))
    return Schedule("fusion_dp", blocks, max_inflight=1, fusion_bytes=max((b.nbytes for b in blocks), default=0))
