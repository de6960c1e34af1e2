"""Discrete-event simulator of one data-parallel training iteration with strict-priority network queues.

Model (every policy is judged by it; the numbers it gives are predictions, not measurements):

* **Compute.** One compute stream per rank; all ranks are identical, so one rank is simulated. Backward of
  iteration k starts at t = 0 and runs layers last to first; layer i's gradient is ready at
  ``sum(bwd_s[j] for j >= i)``. Backward is never slowed by communication. The forward pass of iteration
  k + 1 starts after backward ends; layer i's forward may start only when (a) every block holding layer i's
  gradients has been all-reduced (its parameters are updated; the update itself costs nothing) and (b) its
  predecessors' forwards are done: layer i - 1 for a chain, ``dag[i]`` for a DAG, in which case the stream runs,
  whenever it is free, the lowest-index layer whose inputs and gradients are both ready (list scheduling).
* **Network.** One representative link of ``link_bps`` per rank (a ring all-reduce is symmetric, so every
  rank's egress carries the same bytes at the same time). An all-reduce of b bytes first spends the startup
  ``alpha + 2(n-1)*latency`` (in flight, using no bandwidth: startups of concurrent operations overlap), then
  must move ``2(n-1)/n * 8b`` bits. An uncontended operation therefore takes exactly
  ``CostModel.allreduce_s(b)``.
* **Priority and preemption.** Each block carries a network level (0 most urgent). Service is strict priority
  and *fluid preemptive*: at every instant the most urgent level that has bits to send gets the whole link and
  lower levels wait (preemption at zero chunk size; a real switch preempts at packet granularity, which this
  approximates when blocks are much larger than a packet). Within one level the active operations share the
  link equally (processor sharing, as TCP flows in one queue do; ``sharing="fifo"`` serves them one at a time
  in launch order instead; ``network_done_times(weights=...)`` shares in proportion to per-block weights).
* **Launch.** A block enters the application's queue when ready and is launched, most urgent first (level, then
  priority, then ready time, then byte offset), as soon as the schedule's limits allow: ``max_inflight``
  operations in flight, ``credit_bytes`` in flight (a block may always start when nothing is in flight),
  ``per_level_inflight`` per level (one communicator per level runs its operations one at a time).
* **Iteration time.** From the start of backward k to the end of forward k + 1. Every layer's forward needs
  its all-reduce, so no traffic of iteration k is left when forward k + 1 ends and the next backward starts
  from the same empty state: this span is exactly the steady-state period (iteration time) of training.

Complexity: O(E log E) for E = number of blocks (three events per block, heap operations, O(levels) scans),
plus O(L^2) for a DAG forward pass over L layers.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from tensorlane.policies.model import CostModel, Profile, Schedule, check_blocks, grad_ready_times

INF = float("inf")


@dataclass(frozen=True)
class SimResult:
    """Output of :func:`simulate`: times are seconds from the start of backward of iteration k."""

    iter_s: float
    backward_s: float
    forward_s: float
    comm_end_s: float
    block_done_s: tuple[float, ...]
    layer_ready_s: tuple[float, ...]
    layer_fwd_start_s: tuple[float, ...]

    @property
    def exposed_comm_s(self) -> float:
        """Iteration time not covered by compute: communication the schedule failed to hide."""
        return self.iter_s - self.backward_s - self.forward_s


def network_done_times(schedule: Schedule, cost: CostModel, ready: Sequence[float], sharing: str = "ps",
                       weights: Sequence[float] | None = None) -> tuple[float, ...]:
    """Completion time of each block given its ready time; see the module docstring for the model.

    ``weights`` (``sharing="ps"`` only; None: all equal): within a level, the operations in flight share the link
    in proportion to their weights (weighted processor sharing; e.g. the message size of each operation when the
    operations of one connection take turns message by message, ``policies.execution``).
    Usage: ``network_done_times(sched, cost, [b.ready_s for b in sched.blocks])``
    """
    if sharing not in ("ps", "fifo"):
        raise ValueError(f"sharing must be 'ps' or 'fifo', not {sharing!r}")
    if weights is not None and (len(weights) != len(schedule.blocks) or not all(w > 0 for w in weights)):
        raise ValueError("weights must be positive, one per block")
    blocks = schedule.blocks
    n = len(blocks)
    done = [0.0] * n
    if cost.ranks == 1:
        return tuple(ready)
    rate = cost.link_bps
    startup = cost.startup_s()
    nlev = 1 + max((b.level for b in blocks), default=0)
    bits = [cost.wire_bits(b.nbytes) for b in blocks]
    key = [(b.priority, ready[i], b.start, i) for i, b in enumerate(blocks)]
    arrivals = sorted(range(n), key=lambda i: (ready[i], i))
    max_inflight, credit, per_level = schedule.max_inflight, schedule.credit_bytes, schedule.per_level_inflight

    pending: list[list[tuple]] = [[] for _ in range(nlev)]  # app queue per level
    starting: list[tuple[float, int]] = []                  # (end of startup, block)
    ps_heap: list[list[tuple[float, int]]] = [[] for _ in range(nlev)]  # (virtual finish, block)
    vclock = [0.0] * nlev                                   # bits served per unit weight in the level
    fifo: list[deque[int]] = [deque() for _ in range(nlev)]
    remaining = list(bits)
    weight = [1.0] * n if weights is None else [float(w) for w in weights]
    active = [0] * nlev
    wsum = [0.0] * nlev                                     # total weight of the level's active flows
    lvl_inflight = [0] * nlev
    inflight = inflight_bytes = 0
    now = 0.0
    ptr = finished = 0

    def transmit(b: int) -> None:
        lv = blocks[b].level
        active[lv] += 1
        wsum[lv] += weight[b]
        if sharing == "ps":
            heapq.heappush(ps_heap[lv], (vclock[lv] + bits[b] / weight[b], b))
        else:
            fifo[lv].append(b)

    def complete(b: int) -> None:
        nonlocal inflight, inflight_bytes, finished
        lv = blocks[b].level
        active[lv] -= 1
        wsum[lv] = wsum[lv] - weight[b] if active[lv] else 0.0
        lvl_inflight[lv] -= 1
        inflight -= 1
        inflight_bytes -= blocks[b].nbytes
        done[b] = now
        finished += 1

    def launch() -> None:
        nonlocal inflight, inflight_bytes
        for lv in range(nlev):
            q = pending[lv]
            while q:
                if per_level is not None and lvl_inflight[lv] >= per_level:
                    break
                if max_inflight is not None and inflight >= max_inflight:
                    return
                b = q[0][-1]
                if credit is not None and inflight > 0 and inflight_bytes + blocks[b].nbytes > credit:
                    return
                heapq.heappop(q)
                inflight += 1
                inflight_bytes += blocks[b].nbytes
                lvl_inflight[lv] += 1
                if startup > 0:
                    heapq.heappush(starting, (now + startup, b))
                else:
                    transmit(b)

    while finished < n:
        top = next((lv for lv in range(nlev) if active[lv]), -1)
        t_arr = ready[arrivals[ptr]] if ptr < n else INF
        t_start = starting[0][0] if starting else INF
        t_tx = INF
        if top >= 0:
            if sharing == "ps":
                t_tx = now + (ps_heap[top][0][0] - vclock[top]) * wsum[top] / rate
            else:
                t_tx = now + remaining[fifo[top][0]] / rate
        t = min(t_arr, t_start, t_tx)
        if t == INF:
            raise RuntimeError("simulator stalled: blocks pending but nothing can launch")
        if top >= 0 and t > now:
            if sharing == "ps":
                vclock[top] += (t - now) * rate / wsum[top]
            else:
                remaining[fifo[top][0]] -= (t - now) * rate
        now = max(now, t)
        if t_tx <= t:
            if sharing == "ps":
                h = ps_heap[top]
                vclock[top] = max(vclock[top], h[0][0])
                limit = vclock[top] * (1 + 1e-12) + 1e-9
                while h and h[0][0] <= limit:
                    complete(heapq.heappop(h)[1])
            else:
                complete(fifo[top].popleft())
        while starting and starting[0][0] <= now:
            transmit(heapq.heappop(starting)[1])
        while ptr < n and ready[arrivals[ptr]] <= now:
            b = arrivals[ptr]
            ptr += 1
            if bits[b] <= 0:
                done[b] = now
                finished += 1
            else:
                heapq.heappush(pending[blocks[b].level], key[b])
        launch()
    return tuple(done)


def forward_starts(profile: Profile, layer_ready: Sequence[float], start_s: float,
                   dag: Sequence[Sequence[int]] | None = None) -> tuple[float, ...]:
    """Start time of each layer's forward, from ``start_s``: chain rule, or list scheduling on ``dag``.

    Usage: ``forward_starts(p, [0.0, 5.0], 1.0) == (1.0, 5.0)`` for a chain whose layer 0 takes <= 4 s.
    """
    n = len(profile.layers)
    starts = [0.0] * n
    if dag is None:
        t = start_s
        for i, layer in enumerate(profile.layers):
            t = max(t, layer_ready[i])
            starts[i] = t
            t += layer.fwd_s
        return tuple(starts)
    finish = [INF] * n
    remaining = set(range(n))
    t = start_s
    while remaining:
        cands = [i for i in remaining if all(finish[p] <= t for p in dag[i])]
        runnable = [i for i in cands if layer_ready[i] <= t]
        if runnable:
            i = min(runnable)
            starts[i] = t
            t += profile.layers[i].fwd_s
            finish[i] = t
            remaining.discard(i)
        else:
            t = min(layer_ready[i] for i in cands)
    return tuple(starts)


def simulate(profile: Profile, schedule: Schedule, cost: CostModel, sharing: str = "ps",
             dag: Sequence[Sequence[int]] | None | str = "profile") -> SimResult:
    """Simulate one iteration of ``schedule`` (see the module docstring) and return its :class:`SimResult`.

    ``dag="profile"`` uses ``profile.dag`` (None: a chain). Usage: ``simulate(p, wfbp(p), cost).iter_s``
    """
    check_blocks(profile, schedule.blocks)
    graph = profile.dag if isinstance(dag, str) else dag
    grad = grad_ready_times(profile)
    backward = grad[0] if grad else 0.0
    ready = [grad[min(b.layers)] for b in schedule.blocks]
    done = network_done_times(schedule, cost, ready, sharing)
    layer_ready = [0.0] * len(profile.layers)
    for b, t in zip(schedule.blocks, done):
        for i in b.layers:
            layer_ready[i] = max(layer_ready[i], t)
    starts = forward_starts(profile, layer_ready, backward, graph)
    end = max((s + l.fwd_s for s, l in zip(starts, profile.layers)), default=backward)
    return SimResult(end, backward, profile.fwd_total, max(done, default=0.0), tuple(done), tuple(layer_ready),
                     starts)
