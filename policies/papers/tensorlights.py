"""Job order for concurrent training jobs, as in TensorLights: a static order (TLsOne) or a rotation (TLsRR).

Paper: "Green, Yellow, Yield: End-Host Traffic Scheduling for Distributed Deep Learning with TensorLights",
HPBDC 2019 (IPDPS workshops). One priority per job on the host NIC; the rotated order gives every job the top
priority once per n epochs of 20 s. The agent rotates with ``policies.jobs.hashed_rotation_order`` instead
(coordination-free).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from tensorlane.policies.jobs import Job, unique_ids


def static_job_order(jobs: Sequence[Job]) -> tuple[str, ...]:
    """TensorLights TLsOne: a fixed order, by the static ``priority`` then job id (most urgent first).

    Usage: ``static_job_order([Job("b"), Job("a")]) == ("a", "b")``
    """
    unique_ids([j.job_id for j in jobs])
    return tuple(j.job_id for j in sorted(jobs, key=lambda j: (j.priority, j.job_id)))


def rotate_job_order(jobs: Sequence[Job], epoch_s: float = 20.0, now_s: float = 0.0) -> tuple[str, ...]:
    """TensorLights TLsRR: the job ids in sorted order, rotated left by ``floor(now_s / epoch_s) mod n``, so every
    job gets the top priority once per n epochs (TensorLights rotates every 20 s).

    The result depends only on the set of job ids and ``now_s``: agents whose clocks agree (NTP) agree on the
    order, except within the clock skew of an epoch boundary -- but only agents that see the *same set* of jobs:
    the rotation is by position, so an agent that also sees a third job may order two shared jobs the other way
    round. The agent therefore rotates with ``hashed_rotation_order``. Usage:
    ``rotate_job_order([Job("a"), Job("b"), Job("c")], 20.0, 45.0) == ("c", "a", "b")``
    """
    unique_ids([j.job_id for j in jobs])
    if not epoch_s > 0 or not math.isfinite(now_s):
        raise ValueError("epoch_s must be positive and now_s finite")
    ids = sorted(j.job_id for j in jobs)
    if not ids:
        return ()
    r = int(math.floor(now_s / epoch_s)) % len(ids)
    return tuple(ids[r:] + ids[:r])
