"""Job-side priorities: static order and periodic rotation (TensorLights, HPBDC'19), GPU intensity (Crux, SIGCOMM'24).

Every agent must compute the same job order from the same inputs without a coordination service, so each
function here is a pure function of its arguments, sorts with a total order, and breaks ties by job id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from policies.compress import compress_levels


@dataclass(frozen=True)
class Job:
    """A training job as the agents see it.

    ``compute_s``: GPU compute per iteration; ``bytes_per_iter``: bytes one iteration puts on its slowest link;
    ``slowest_link_bps``: that link's rate; ``priority``: an operator-given static priority (smaller first);
    ``correction``: Crux's per-job correction factor on the intensity (1.0: none).
    """

    job_id: str
    compute_s: float = 0.0
    bytes_per_iter: int = 0
    slowest_link_bps: float = 0.0
    priority: int = 0
    correction: float = 1.0


def _unique(jobs: Sequence[Job]) -> None:
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("job ids must be unique")


def static_job_order(jobs: Sequence[Job]) -> tuple[str, ...]:
    """TensorLights TLsOne: a fixed order, by the static ``priority`` then job id (most urgent first).

    Usage: ``static_job_order([Job("b"), Job("a")]) == ("a", "b")``
    """
    _unique(jobs)
    return tuple(j.job_id for j in sorted(jobs, key=lambda j: (j.priority, j.job_id)))


def rotate_job_order(jobs: Sequence[Job], epoch_s: float = 20.0, now_s: float = 0.0) -> tuple[str, ...]:
    """TensorLights TLsRR: the job ids in sorted order, rotated left by ``floor(now_s / epoch_s) mod n``, so every
    job gets the top priority once per n epochs (TensorLights rotates every 20 s).

    The result depends only on the set of job ids and ``now_s``: agents whose clocks agree (NTP) agree on the
    order, except within the clock skew of an epoch boundary. Usage:
    ``rotate_job_order([Job("a"), Job("b"), Job("c")], 20.0, 45.0) == ("c", "a", "b")``
    """
    _unique(jobs)
    if not epoch_s > 0 or not math.isfinite(now_s):
        raise ValueError("epoch_s must be positive and now_s finite")
    ids = sorted(j.job_id for j in jobs)
    if not ids:
        return ()
    r = int(math.floor(now_s / epoch_s)) % len(ids)
    return tuple(ids[r:] + ids[:r])


def gpu_intensity(job: Job) -> float:
    """Crux's GPU intensity: correction * compute per iteration / transfer time on the slowest link
    (bytes * 8 / link_bps); infinite when the job sends nothing. Usage: ``gpu_intensity(Job("a", 1.0, 125, 1e3)) == 1.0``
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
    _unique(jobs)
    return tuple(j.job_id for j in sorted(jobs, key=lambda j: (-gpu_intensity(j), j.job_id)))


def job_levels(order: Sequence[str], queues: int = 8, reserved: int = 3) -> dict[str, int]:
    """Network level of each job in ``order`` (most urgent first), compressed onto the usable queues with equal
    numbers of jobs per level, order preserved (Crux's compression; see policies.compress).

    Usage: ``job_levels(("b", "a"), queues=8, reserved=3) == {"b": 0, "a": 1}``
    """
    levels = compress_levels(list(range(len(order))), queues=queues, reserved=reserved)
    return dict(zip(order, levels))
