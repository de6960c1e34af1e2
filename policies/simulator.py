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
from collections.abc import Sequence
from dataclasses import dataclass

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


class _Network:
    """State of :func:`network_done_times` while it runs: the application's queues, the startups in flight and the
    levels' fluid service (virtual clocks for processor sharing, FIFO queues otherwise)."""

    def __init__(self, schedule: Schedule, cost: CostModel, ready: Sequence[float], sharing: str,
                 weights: Sequence[float] | None) -> None:
        blocks = schedule.blocks
        n = len(blocks)
        self.blocks, self.ready, self.sharing, self.n = blocks, ready, sharing, n
        self.done = [0.0] * n
        self.rate = cost.link_bps
        self.startup = cost.startup_s()
        self.nlev = nlev = 1 + max((b.level for b in blocks), default=0)
        self.bits = [cost.wire_bits(b.nbytes) for b in blocks]
        self.key = [(b.priority, ready[i], b.start, i) for i, b in enumerate(blocks)]
        self.arrivals = sorted(range(n), key=lambda i: (ready[i], i))
        self.max_inflight, self.credit = schedule.max_inflight, schedule.credit_bytes
        self.per_level = schedule.per_level_inflight
        self.pending: list[list[tuple]] = [[] for _ in range(nlev)]  # app queue per level
        self.starting: list[tuple[float, int]] = []                  # (end of startup, block)
        self.ps_heap: list[list[tuple[float, int]]] = [[] for _ in range(nlev)]  # (virtual finish, block)
        self.vclock = [0.0] * nlev                                   # bits served per unit weight in the level
        self.fifo: list[deque[int]] = [deque() for _ in range(nlev)]
        self.remaining = list(self.bits)
        self.weight = [1.0] * n if weights is None else [float(w) for w in weights]
        self.active = [0] * nlev
        self.wsum = [0.0] * nlev                                     # total weight of the level's active flows
        self.lvl_inflight = [0] * nlev
        self.inflight = self.inflight_bytes = 0
        self.now = 0.0
        self.ptr = self.finished = 0

    def transmit(self, b: int) -> None:
        """Block ``b`` has finished its startup: it joins its level's service."""
        lv = self.blocks[b].level
        self.active[lv] += 1
        self.wsum[lv] += self.weight[b]
        if self.sharing == "ps":
            heapq.heappush(self.ps_heap[lv], (self.vclock[lv] + self.bits[b] / self.weight[b], b))
        else:
            self.fifo[lv].append(b)

    def complete(self, b: int) -> None:
        """Block ``b`` has sent its last bit: it leaves the link and the launch limits, done now."""
        lv = self.blocks[b].level
        self.active[lv] -= 1
        self.wsum[lv] = self.wsum[lv] - self.weight[b] if self.active[lv] else 0.0
        self.lvl_inflight[lv] -= 1
        self.inflight -= 1
        self.inflight_bytes -= self.blocks[b].nbytes
        self.done[b] = self.now
        self.finished += 1

    def launch(self) -> None:
        """Launch queued blocks, most urgent level first, while the schedule's limits allow."""
        for lv in range(self.nlev):
            q = self.pending[lv]
            while q:
                if self.per_level is not None and self.lvl_inflight[lv] >= self.per_level:
                    break
                if self.max_inflight is not None and self.inflight >= self.max_inflight:
                    return
                b = q[0][-1]
                if (self.credit is not None and self.inflight > 0
                        and self.inflight_bytes + self.blocks[b].nbytes > self.credit):
                    return
                heapq.heappop(q)
                self.inflight += 1
                self.inflight_bytes += self.blocks[b].nbytes
                self.lvl_inflight[lv] += 1
                if self.startup > 0:
                    heapq.heappush(self.starting, (self.now + self.startup, b))
                else:
                    self.transmit(b)

    def next_event(self) -> tuple[int, float, float]:
        """The most urgent level with bits to send (-1: none), the time of the next event, and the time the
        first transmission of that level ends (INF: none)."""
        top = next((lv for lv in range(self.nlev) if self.active[lv]), -1)
        t_arr = self.ready[self.arrivals[self.ptr]] if self.ptr < self.n else INF
        t_start = self.starting[0][0] if self.starting else INF
        t_tx = INF
        if top >= 0:
            if self.sharing == "ps":
                t_tx = self.now + (self.ps_heap[top][0][0] - self.vclock[top]) * self.wsum[top] / self.rate
            else:
                t_tx = self.now + self.remaining[self.fifo[top][0]] / self.rate
        return top, min(t_arr, t_start, t_tx), t_tx

    def serve(self, top: int, t: float, t_tx: float) -> None:
        """Serve level ``top`` until ``t`` and complete what it finished then."""
        if top >= 0 and t > self.now:
            if self.sharing == "ps":
                self.vclock[top] += (t - self.now) * self.rate / self.wsum[top]
            else:
                self.remaining[self.fifo[top][0]] -= (t - self.now) * self.rate
        self.now = max(self.now, t)
        if t_tx <= t:
            if self.sharing == "ps":
                h = self.ps_heap[top]
                self.vclock[top] = max(self.vclock[top], h[0][0])
                limit = self.vclock[top] * (1 + 1e-12) + 1e-9
                while h and h[0][0] <= limit:
                    self.complete(heapq.heappop(h)[1])
            else:
                self.complete(self.fifo[top].popleft())

    def admit(self) -> None:
        """Start transmitting the blocks whose startup has ended, queue the blocks that became ready, launch."""
        while self.starting and self.starting[0][0] <= self.now:
            self.transmit(heapq.heappop(self.starting)[1])
        while self.ptr < self.n and self.ready[self.arrivals[self.ptr]] <= self.now:
            b = self.arrivals[self.ptr]
            self.ptr += 1
            if self.bits[b] <= 0:
                self.done[b] = self.now
                self.finished += 1
            else:
                heapq.heappush(self.pending[self.blocks[b].level], self.key[b])
        self.launch()

    def run(self) -> tuple[float, ...]:
        """Advance event by event until every block is done; the completion time of each block."""
        while self.finished < self.n:
            top, t, t_tx = self.next_event()
            if t == INF:
                raise RuntimeError("simulator stalled: blocks pending but nothing can launch")
            self.serve(top, t, t_tx)
            self.admit()
        return tuple(self.done)


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
    if cost.ranks == 1:
        return tuple(ready)
    return _Network(schedule, cost, ready, sharing, weights).run()


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
    for b, t in zip(schedule.blocks, done, strict=True):
        for i in b.layers:
            layer_ready[i] = max(layer_ready[i], t)
    starts = forward_starts(profile, layer_ready, backward, graph)
    end = max((s + ly.fwd_s for s, ly in zip(starts, profile.layers, strict=True)), default=backward)
    return SimResult(end, backward, profile.fwd_total, max(done, default=0.0), tuple(done), tuple(layer_ready),
                     starts)
