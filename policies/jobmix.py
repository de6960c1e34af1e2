"""Fluid model of training jobs that share one link under a job order: what the order alone costs each job.

Each job repeats, ``iters`` times from ``offset_s``: compute for ``compute_s`` (no link), then send its step's bits,
``comm_s`` of the whole link. While jobs are in their communication phase they share the link:

* ``order=None`` (FIFO): equally among the k jobs sending (processor sharing, what TCP flows in one queue get on
  average);
* a job order (job indexes, most urgent first): each sending job its guaranteed part, ``job_share / k`` of the k
  jobs sending (``among="sending"``, the agent's default) or ``job_share / n`` of the n jobs started and not
  finished (``among="present"``), and the rest of the link to the most urgent sending job, as HTB's borrowing in
  priority order gives it (``policies.jobs.job_shares``).

Rates are constant between events (a phase starts or ends), so the model is exact for its assumptions: no
transport effects (TCP's ramp and losses, queues, the CPU), communication never overlapped with compute. It tells
what an order costs by *when* it makes each job communicate, apart from how the kernel and TCP carry it out
(docs/jobs.md, "Parts among the jobs sending"). Usage::

    jobs = [MixJob(compute_s=0.84, comm_s=0.36, iters=12), MixJob(0.65, 0.35, 12, offset_s=1.0)]
    fifo, ordered = simulate_mix(jobs), simulate_mix(jobs, order=[1, 0], job_share=0.8)
    [o / f for o, f in zip(ordered, fifo)]      # each job's JCT against FIFO's
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tensorlane.policies.jobs import SHARE_AMONG, job_shares

EPS = 1e-12


@dataclass(frozen=True)
class MixJob:
    """One job of a mix: seconds of compute and of the whole link per iteration, iterations, start."""

    compute_s: float
    comm_s: float
    iters: int
    offset_s: float = 0.0


def link_rates(sending: Sequence[int], order: Sequence[int] | None, job_share: float, present: Collection[int],
               among: str = "sending", counted: Collection[int] | None = None) -> dict[int, float]:
    """The share of the link each sending job gets now (see the module docstring); ``present``: the jobs started
    and not finished; ``counted``: the jobs the agent counts as sending (default: ``sending``, as if it saw them at
    once). The parts are the agent's own (``policies.jobs.job_shares``, each job on a level of its own); a part
    counted for a job that is not sending goes, like all the link left, to the most urgent sending job.
    Usage: ``link_rates([0, 1], None, 0.8, {0, 1}) == {0: 0.5, 1: 0.5}``"""
    if not sending:
        return {}
    if order is None:
        return {j: 1.0 / len(sending) for j in sending}
    if among not in SHARE_AMONG:
        raise ValueError(f"among must be one of {', '.join(SHARE_AMONG)}, not {among!r}")
    bands = {j: (level, 1) for level, j in enumerate(sorted(present))}
    counted = sending if counted is None else counted
    shares = job_shares(bands, job_share, counted if among == "sending" else ())
    rates = {j: shares.get(bands[j][0], 0.0) for j in sending}
    top = min(sending, key=list(order).index)
    rates[top] += max(0.0, 1.0 - sum(rates.values()))
    return rates


def simulate_mix(jobs: Sequence[MixJob], order: Sequence[int] | None = None, job_share: float = 0.0,
                 among: str = "sending", sample_s: float = 0.0, hold_s: float = 0.0) -> list[float]:
    """Each job's JCT (from its offset to the end of its last iteration's communication) under FIFO
    (``order=None``) or a job order with ``job_share``; with ``sample_s > 0`` the parts follow the jobs found
    sending at sample ticks ``0, sample_s, 2 sample_s, ...`` within ``hold_s`` before the last tick. Bounded: at
    most 4 events per iteration and job, plus the ticks."""
    if order is not None and sorted(order) != list(range(len(jobs))):
        raise ValueError(f"order must list every job index once, not {order!r}")
    if sample_s < 0 or hold_s < 0 or not (math.isfinite(sample_s) and math.isfinite(hold_s)):
        raise ValueError(f"sample_s and hold_s must be finite and >= 0, not {sample_s!r}, {hold_s!r}")
    # the jobs one after the other, each alone: no work-conserving sharing ends later
    horizon = max((j.offset_s for j in jobs), default=0.0) + sum(j.iters * (j.compute_s + j.comm_s) for j in jobs)
    ticks = math.ceil(horizon / sample_s) + 1 if sample_s > 0 else 0
    seen: dict[int, float] = {}  # job -> the last tick that found it sending
    counted: set[int] = set()
    next_tick = 0.0
    n = len(jobs)
    left = [j.iters for j in jobs]  # iterations not finished
    phase = ["wait"] * n  # wait (before its offset), compute, comm, done
    remaining = [j.offset_s for j in jobs]  # seconds (wait, compute) or link-seconds (comm) left in the phase
    end = [math.nan] * n
    now = 0.0
    for _ in range(4 * sum(left) + 2 * n + 1 + 2 * ticks):
        for i in range(n):  # phase changes at this instant
            while phase[i] != "done" and remaining[i] <= EPS:
                if phase[i] == "comm":
                    left[i] -= 1
                if left[i] == 0:
                    phase[i], end[i] = "done", now - jobs[i].offset_s
                elif phase[i] in ("wait", "comm"):
                    phase[i], remaining[i] = "compute", jobs[i].compute_s
                else:
                    phase[i], remaining[i] = "comm", jobs[i].comm_s
        if all(p == "done" for p in phase):
            return end
        sending = [i for i in range(n) if phase[i] == "comm"]
        present = {i for i in range(n) if phase[i] in ("compute", "comm")}
        if sample_s > 0 and now >= next_tick - EPS:  # a sample: the agent's view changes only here
            seen.update((i, now) for i in sending)
            counted = {i for i, t in seen.items() if now - t <= hold_s + EPS and i in present}
            next_tick += sample_s
        rates = link_rates(sending, order, job_share, present, among, counted if sample_s > 0 else None)
        dt = min([remaining[i] for i in range(n) if phase[i] in ("wait", "compute")]
                 + [remaining[i] / r for i, r in rates.items() if r > EPS]
                 + ([next_tick - now] if sample_s > 0 else []))
        for i in range(n):
            if phase[i] in ("wait", "compute"):
                remaining[i] -= dt
            elif phase[i] == "comm":
                remaining[i] -= dt * rates[i]
        now += dt
    raise RuntimeError("simulate_mix: event bound exceeded")  # cannot happen: every event ends a phase
