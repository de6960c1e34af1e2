"""Job priority by GPU intensity, compressed onto the network's levels, as in Crux.

Paper: "Crux: GPU-Efficient Communication Scheduling for Deep Learning Training", ACM SIGCOMM 2024. A job's
priority is its GPU intensity (compute per iteration over its transfer time on the slowest link, corrected per
job); the order is compressed onto the usable queues (``policies.compress``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from tensorlane.policies.compress import compress_levels
from tensorlane.policies.jobs import Job, unique_ids


def gpu_intensity(job: Job) -> float:
    """Crux's GPU intensity: correction * compute per iteration / transfer time on the slowest link
    (bytes * 8 / link_bps); infinite when the job sends nothing.

    Usage: ``gpu_intensity(Job("a", 1.0, 125, 1e3)) == 1.0``
    """
    if job.bytes_per_iter <= 0:
        return math.inf
    if job.slowest_link_bps <= 0:
        raise ValueError(f"job {job.job_id}: slowest_link_bps must be positive")
    return job.correction * job.compute_s / (job.bytes_per_iter * 8 / job.slowest_link_bps)


def gpu_intensity_order(jobs: Sequence[Job]) -> tuple[str, ...]:
    """Crux: most GPU-intensive job first (its traffic keeps the most GPU time busy per byte), ties by job id.

    Usage: ``gpu_intensity_order([Job("a", 1.0, 10**6, 1e9), Job("b", 2.0, 10**6, 1e9)]) == ("b", "a")``
    """
    unique_ids([j.job_id for j in jobs])
    return tuple(j.job_id for j in sorted(jobs, key=lambda j: (-gpu_intensity(j), j.job_id)))


def job_levels(order: Sequence[str], queues: int = 8, reserved: int = 3) -> dict[str, int]:
    """Network level of each job in ``order`` (most urgent first), compressed onto the usable queues with equal
    numbers of jobs per level, order preserved (Crux's compression; see policies.compress).

    Usage: ``job_levels(("b", "a"), queues=8, reserved=3) == {"b": 0, "a": 1}``
    """
    levels = compress_levels(list(range(len(order))), queues=queues, reserved=reserved)
    return dict(zip(order, levels, strict=True))
