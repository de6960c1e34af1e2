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
(docs/jobs-measured.md, "Parts among the jobs sending"). Usage::

    jobs = [MixJob(compute_s=0.84, comm_s=0.36, iters=12), MixJob(0.65, 0.35, 12, offset_s=1.0)]
    fifo, ordered = simulate_mix(jobs), simulate_mix(jobs, order=[1, 0], job_share=0.8)
    [o / f for o, f in zip(ordered, fifo)]      # each job's JCT against FIFO's

``simulate_links`` is the same model on several links, each job on some of them (a job's rate is what its most
constrained link gives it), under FIFO (max-min fair rates), a static order, or ``"slowdown"``: the agents' order
that moves with the clock (``policies.jobs.slowdown_rank`` of each job's last step ends, re-ranked every
``rerank_s``). Every job sending on a link gets ``job_share / k`` of it, the rest goes by the order. Usage::

    ring = [(3, 0), (0, 1), (1, 2), (2, 3)]     # link l carries jobs l - 1 and l (bench.jobs' spread4)
    simulate_links(jobs4, ring), simulate_links(jobs4, ring, order="slowdown", job_share=0.2)
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tensorlane.policies.jobs import SHARE_AMONG, SLOWDOWN_WINDOW, job_shares, slowdown_rank

EPS = 1e-12


@dataclass(frozen=True)
class MixJob:
    """One job of a mix: seconds of compute and of the whole link per iteration, iterations, start."""

    compute_s: float
    comm_s: float
    iters: int
    offset_s: float = 0.0


def link_rates(sending: Sequence[int], order: Sequence[int] | None, job_share: float, present: Collection[int],
               among: str = "sending", counted: Collection[int] | None = None,
               borrow: str = "order") -> dict[int, float]:
    """The share of the link each sending job gets now (see the module docstring); ``present``: the jobs started
    and not finished; ``counted``: the jobs the agent counts as sending (default: ``sending``, as if it saw them at
    once). The parts are the agent's own (``policies.jobs.job_shares``, each job on a level of its own); a part
    counted for a job that is not sending goes, like all the link left, to the most urgent sending job.

    ``borrow="even"`` models a design the agent does not have (docs/jobs-measured.md, "What an order costs on
    stagger4"): each job present keeps ``job_share / n``, the most urgent one present also the link the parts
    leave, and what the parts of the jobs not sending leave unused is shared evenly by the jobs sending (HTB's
    borrowing among classes of one ``prio`` with equal quanta), so nothing follows samples (``among`` and
    ``counted`` do not apply).
    Usage: ``link_rates([0, 1], None, 0.8, {0, 1}) == {0: 0.5, 1: 0.5}``"""
    if not sending:
        return {}
    if order is None:
        return {j: 1.0 / len(sending) for j in sending}
    if borrow not in ("order", "even"):
        raise ValueError(f"borrow must be 'order' or 'even', not {borrow!r}")
    if borrow == "even":
        part = {j: job_share / len(present) for j in present}
        part[min(present, key=list(order).index)] += 1.0 - job_share
        rates = {j: part[j] for j in sending}
        spare = max(0.0, 1.0 - sum(rates.values())) / len(sending)
        return {j: rate + spare for j, rate in rates.items()}
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
                 among: str = "sending", sample_s: float = 0.0, hold_s: float = 0.0,
                 borrow: str = "order") -> list[float]:
    """Each job's JCT (from its offset to the end of its last iteration's communication) under FIFO
    (``order=None``) or a job order with ``job_share``; with ``sample_s > 0`` the parts follow the jobs found
    sending at sample ticks ``0, sample_s, 2 sample_s, ...`` within ``hold_s`` before the last tick; ``borrow``:
    as :func:`link_rates`. Bounded: at most 4 events per iteration and job, plus the ticks."""
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
        _end_phases(jobs, phase, remaining, left, end, now)
        if all(p == "done" for p in phase):
            return end
        sending = [i for i in range(n) if phase[i] == "comm"]
        present = {i for i in range(n) if phase[i] in ("compute", "comm")}
        if sample_s > 0 and now >= next_tick - EPS:  # a sample: the agent's view changes only here
            seen.update((i, now) for i in sending)
            counted = {i for i, t in seen.items() if now - t <= hold_s + EPS and i in present}
            next_tick += sample_s
        rates = link_rates(sending, order, job_share, present, among, counted if sample_s > 0 else None, borrow)
        now += _advance(phase, remaining, rates, [next_tick - now] if sample_s > 0 else [])
    raise RuntimeError("simulate_mix: event bound exceeded")  # cannot happen: every event ends a phase


def _end_phases(jobs: Sequence[MixJob], phase: list[str], remaining: list[float], left: list[int],
                end: list[float], now: float) -> list[tuple[int, str]]:
    """Move every job whose phase has run out at ``now`` on to its next (wait, then compute and communication in
    turn until its last iteration's communication, then done: ``end`` is its JCT). Returns each ``(job, phase
    ended)`` in order."""
    ended = []
    for i, job in enumerate(jobs):
        while phase[i] != "done" and remaining[i] <= EPS:
            ended.append((i, phase[i]))
            if phase[i] == "comm":
                left[i] -= 1
            if left[i] == 0:
                phase[i], end[i] = "done", now - job.offset_s
            elif phase[i] in ("wait", "comm"):
                phase[i], remaining[i] = "compute", job.compute_s
            else:
                phase[i], remaining[i] = "comm", job.comm_s
    return ended


def _advance(phase: list[str], remaining: list[float], rates: dict[int, float], tick: list[float]) -> float:
    """Run every job on to the next event: a phase's end, or the next tick (``tick``: its distance, or empty).
    ``remaining`` drops by the seconds passed (waiting, computing) or the link-seconds sent (communicating).
    Returns the seconds passed."""
    dt = min([remaining[i] for i, p in enumerate(phase) if p in ("wait", "compute")]
             + [remaining[i] / r for i, r in rates.items() if r > EPS] + tick)
    for i, p in enumerate(phase):
        if p in ("wait", "compute"):
            remaining[i] -= dt
        elif p == "comm":
            remaining[i] -= dt * rates[i]
    return dt


def link_order_rates(sending: Sequence[int], links: Sequence[Collection[int]], order: Sequence[int] | None,
                     job_share: float) -> dict[int, float]:
    """Each sending job's rate (a share of one link) on ``links`` (each the jobs whose bytes cross it). FIFO
    (``order=None``): max-min fair, as TCP flows in FIFO queues get on average. A job on none of ``links`` gets
    the whole rate (1.0) under either. An order (job indexes, most urgent
    first): on every link each of the ``k >= 2`` jobs sending keeps ``job_share / k``; in the order's turn each
    job takes what all its links have left beside the parts of the less urgent jobs sending there.
    Usage: ``link_order_rates([0, 1], [(0, 1)], [1, 0], 0.0) == {1: 1.0, 0: 0.0}``"""
    on = [[j for j in link if j in sending] for link in links]
    left = [1.0] * len(links)
    rates: dict[int, float] = {}
    if order is None:
        active = {j for j in sending if any(j in link for link in on)}  # a job on no link is not held back: 1.0
        while active:  # each round fixes the jobs of the most constrained link: at most one round per job
            fair, tight = min((left[k] / n, k) for k, link in enumerate(on)
                              if (n := sum(1 for j in link if j in active)))
            for j in [j for j in on[tight] if j in active]:
                rates[j] = max(0.0, fair)
                active.discard(j)
                for k, link in enumerate(on):
                    if j in link:
                        left[k] -= rates[j]
        return {j: rates.get(j, 1.0) for j in sending}
    ranked = [j for j in order if j in sending]
    for n, j in enumerate(ranked):
        later = set(ranked[n + 1:])
        rate = 1.0
        for k, link in enumerate(on):
            if j in link:
                part = job_share / len(link) if len(link) > 1 else 0.0
                rate = min(rate, left[k] - part * sum(1 for x in link if x in later))
        rates[j] = max(0.0, rate)
        for k, link in enumerate(on):
            if j in link:
                left[k] -= rates[j]
    return rates


def simulate_links(jobs: Sequence[MixJob], links: Sequence[Collection[int]] | None = None,
                   order: Sequence[int] | str | None = None, job_share: float = 0.0,
                   rerank_s: float = 0.05) -> list[float]:
    """Each job's JCT (as ``simulate_mix``) on ``links`` (default: one link that every job crosses) under FIFO
    (``order=None``), a static ``order`` (job indexes, most urgent first), or ``"slowdown"``: each job ranked by
    ``slowdown_rank`` of its last ``SLOWDOWN_WINDOW`` step ends (a step ends with its communication; its ideal step
    is its ``compute_s + comm_s``), re-ranked every ``rerank_s`` and at every phase change, as the agents do.
    Bounded: at most 4 events per iteration and job, plus the re-ranking ticks."""
    n = len(jobs)
    links = [tuple(range(n))] if links is None else [tuple(link) for link in links]
    if isinstance(order, str) and order != "slowdown":
        raise ValueError(f"order must be None, job indexes or 'slowdown', not {order!r}")
    if isinstance(order, (list, tuple)) and sorted(order) != list(range(n)):
        raise ValueError(f"order must list every job index once, not {order!r}")
    if not (rerank_s > 0 and math.isfinite(rerank_s)):
        raise ValueError(f"rerank_s must be finite and > 0, not {rerank_s!r}")
    timed = order == "slowdown"
    horizon = max((j.offset_s for j in jobs), default=0.0) + sum(j.iters * (j.compute_s + j.comm_s) for j in jobs)
    ticks = math.ceil(horizon / rerank_s) + 1 if timed else 0
    left = [j.iters for j in jobs]
    phase = ["wait"] * n
    remaining = [j.offset_s for j in jobs]
    ends: list[list[float]] = [[] for _ in jobs]  # each job's last step ends (its first step's start first)
    end = [math.nan] * n
    now, next_tick, ranked = 0.0, 0.0, list(range(n))
    for _ in range(4 * sum(left) + 2 * n + 1 + 2 * ticks):
        ended = _end_phases(jobs, phase, remaining, left, end, now)
        for i, was in ended:  # a step ends with its communication; the first one starts after the wait
            if was == "comm":
                ends[i] = (ends[i] + [now])[-(SLOWDOWN_WINDOW + 1):]
            elif was == "wait":
                ends[i] = [now]
        changed = bool(ended)
        if all(p == "done" for p in phase):
            return end
        if timed and (changed or now >= next_tick - EPS):
            ranked = sorted(range(n), key=lambda i: (slowdown_rank(
                now, ends[i][0], len(ends[i]) - 1, jobs[i].compute_s + jobs[i].comm_s, 0, None)
                if ends[i] else math.inf, i))
            while next_tick <= now + EPS:
                next_tick += rerank_s
        sending = [i for i in range(n) if phase[i] == "comm"]
        rates = link_order_rates(sending, links, None if order is None else ranked if timed else order, job_share)
        now += _advance(phase, remaining, rates, [next_tick - now] if timed else [])
    raise RuntimeError("simulate_links: event bound exceeded")  # cannot happen: every event ends a phase or a tick
