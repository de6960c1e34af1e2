"""What actually runs: plain DDP and the shim's overlap mode, modelled operation by operation (pure, no I/O).

``policies.simulator`` judges idealised schedules (any block layout, credit windows, instant launches, a forward
that waits only for its own blocks). This module models the two executions that the testbed measures, on top of
the same network engine (:func:`policies.simulator.network_done_times`), with the host costs that matter there.

**Plain DDP** (``torch.nn.parallel.DistributedDataParallel``, gloo):

* Buckets (:func:`ddp_buckets`): after the first iteration the reducer rebuilds its buckets in gradient-ready
  order (backward runs last layer first) and closes a bucket as soon as it holds at least its cap; the first
  bucket's cap is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) when ``bucket_cap_mb`` is left at its default,
  otherwise the same cap as the others (``_BucketCapacityConfig`` in torch 2.13).
* A bucket is ready when its last gradient is (the lowest layer it holds finishes backward); the reducer issues
  the buckets' all-reduces in bucket order on one process group.
* One gloo process group runs ``threads`` (2: ``ProcessGroupGloo`` gets two worker threads per device) operations
  at once, taken from a FIFO queue in launch order; the operations in flight share the group's connections
  (processor sharing).
* ``backward()`` returns when every bucket is reduced; the optimizer step follows, then the next forward. So the
  next forward starts at ``max(end of backward, last all-reduce done + wake_s)``.

**The shim's overlap mode** (``shim.attach(ddp, optimizer=opt, levels=L)``, ``shim/ddp.py``):

* The same DDP buckets (the shim's bucket cap). When a bucket is ready the reducer calls the shim's Python comm
  hook, one bucket after the other on the training thread. The hook copies the bucket (``buffer.div(world)``),
  cuts it into pieces by level (``policies.cutting.bucket_pieces``, which the shim runs as ``pieces_of``: the
  bucket's parameters in its buffer order, adjacent parameters of one level fused, pieces at most ``partition_bytes``)
  and issues the pieces most urgent level first, then by the forward position of their first layer.
* One gloo group per level (``threads`` operations at once each, FIFO); strict priority across levels on the
  link (the agent's host queue and the DSCP switch queues): fluid preemption, as in the simulator.
* The next forward's layer ``i`` starts when layer ``i - 1`` is done and every piece holding layer ``i``'s bytes
  is reduced (``wait="piece"``; ``wait="bucket"``: every piece of its bucket, the shim before per-piece waits).

**Host costs** (:class:`HostCosts`, calibrated from separate measurements by ``bench.validate``): the
per-operation startup ``alpha`` (the :class:`policies.model.CostModel`'s ``alpha_s``: a small all-reduce's
latency), the time to issue one operation (``launch_s``), the shim hook's copy rate (``copy_bps``) and fixed cost
(``hook_s``), and the wake-up of a thread waiting for an operation (``wake_s``). Host work that does not block
(the optimizer step, DDP's gradient copies, autograd) runs while the device computes (a GPU's asynchronous
launches; ``bench.models``' emulated device) and is not on the critical path; the realised compute (forward and
backward times) is an input: pass a profile scaled to the measured compute (``policies.model.scaled``).

**Iteration time** (as in the simulator): from the start of backward ``k`` to the end of forward ``k + 1``.
Every layer's forward waits for its all-reduces, so nothing of iteration ``k`` is left when backward ``k + 1``
starts and this span is the steady-state period.

Usage::

    cost = CostModel(ranks=2, link_bps=191e6, alpha_s=1.5e-3)
    ddp_iteration(profile, cost, bucket_bytes=5 << 20).iter_s
    shim_iteration(profile, cost, layer_order_levels(profile, 4), bucket_bytes=1 << 20).iter_s
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tensorlane.policies.cutting import bucket_pieces, forward_order_levels
from tensorlane.policies.model import Block, CostModel, Profile, Schedule, grad_ready_times
from tensorlane.policies.simulator import forward_starts, network_done_times

INF = float("inf")
GLOO_THREADS = 2       # ProcessGroupGloo worker threads per group (one device): operations running at once
GLOO_MAX_SEGMENT = 1 << 20  # gloo's ring all-reduce sends segments of at most this (AllreduceOptions kMaxSegmentSize)
ELEMENT_BYTES = 4      # float32 gradients
# Share of a link's rate that carries payload for bulk TCP over IPv4 with timestamps on Ethernet (MTU 1500): a
# 1514-byte frame (as HTB counts it) carries 1448 bytes. The testbed's calibration measures 0.957.
TCP_PAYLOAD_FRACTION = 1448 / 1514
WAITS = ("piece", "bucket")
ORDERS = ("urgent", "buffer")
SHARINGS = ("messages", "ps", "fifo")


@dataclass(frozen=True)
class HostCosts:
    """Host-side costs and limits of an execution (calibrated from separate measurements: ``bench.validate``).

    ``launch_s``: host time to issue one all-reduce (``dist.all_reduce(..., async_op=True)`` and its future);
    ``copy_bps``: bytes per second of the shim hook's copy of its bucket (``bucket.buffer().div(world)``);
    ``hook_s``: fixed host time of one call of the shim's Python comm hook, before its copy;
    ``wake_s``: from an all-reduce's completion to the thread that waits for it running again;
    ``callback_s``: compute time lost per completed operation while the device computes: the shim's Python
    done-callback takes the GIL on a gloo thread and, on a loaded host, holds the training thread up (plain
    DDP's callbacks are C++ and pay nothing);
    ``threads``: operations one process group runs at once (gloo: 2 worker threads per group, a FIFO queue).
    The per-operation startup (alpha) is the :class:`CostModel`'s ``alpha_s``.
    Usage: ``HostCosts(launch_s=1e-4, copy_bps=2e9)``
    """

    launch_s: float = 0.0
    copy_bps: float = INF
    hook_s: float = 0.0
    wake_s: float = 0.0
    threads: int = GLOO_THREADS
    callback_s: float = 0.0

    def __post_init__(self) -> None:
        if (min(self.launch_s, self.hook_s, self.wake_s, self.callback_s) < 0 or not self.copy_bps > 0
                or self.threads < 1):
            raise ValueError(f"bad host costs {self!r}")

    def copy_s(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` on the host. Usage: ``HostCosts(copy_bps=1e9).copy_s(10**6) == 1e-3``"""
        return 0.0 if math.isinf(self.copy_bps) else nbytes / self.copy_bps


@dataclass(frozen=True)
class Op:
    """One all-reduce operation as issued: ``nbytes`` on process group ``level``, holding bytes of ``layers``
    (forward indexes), from DDP bucket ``bucket``, issued at ``launch_s`` (seconds from the start of backward)."""

    nbytes: int
    level: int
    layers: tuple[int, ...]
    bucket: int
    launch_s: float


@dataclass(frozen=True)
class ExecResult:
    """Output of :func:`ddp_iteration` / :func:`shim_iteration`; times in seconds from the start of backward ``k``.

    ``done_s[j]``: completion of ``ops[j]``; ``layer_ready_s[i]``: when layer ``i``'s forward may start as far as
    communication goes (its operations done, plus the wake-up); ``buckets``: the DDP buckets (forward indexes of
    their layers, in gradient-ready order).
    """

    iter_s: float
    backward_s: float
    forward_s: float
    comm_end_s: float
    ops: tuple[Op, ...]
    done_s: tuple[float, ...]
    layer_ready_s: tuple[float, ...]
    layer_fwd_start_s: tuple[float, ...]
    buckets: tuple[tuple[int, ...], ...]

    @property
    def exposed_comm_s(self) -> float:
        """Iteration time not covered by compute: communication (and its host costs) left exposed."""
        return self.iter_s - self.backward_s - self.forward_s


# ------------------------------------------------------------------------------------------------------ buckets

def ddp_buckets(sizes: Sequence[int], bucket_bytes: int, first_bucket_bytes: int | None = None
                ) -> tuple[tuple[int, ...], ...]:
    """DDP's rebuilt buckets: indexes of the layers (forward order) of each bucket, in gradient-ready order.

    Layers are taken last to first (the order backward produces their gradients); a bucket is closed as soon as
    it holds ``>= cap`` bytes, the first bucket's cap being ``first_bucket_bytes`` (None: ``bucket_bytes``, which
    is what DDP does when ``bucket_cap_mb`` is given explicitly; with the default cap it uses 1 MiB), the others
    ``bucket_bytes``. Layers without bytes are in no bucket. (``dist._compute_bucket_assignment_by_size``.)
    Usage: ``ddp_buckets([4, 4, 4, 8], 8) == ((3,), (2, 1), (0,))``
    """
    if bucket_bytes < 1 or (first_bucket_bytes is not None and first_bucket_bytes < 1):
        raise ValueError("bucket caps must be positive")
    cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    out: list[tuple[int, ...]] = []
    cur: list[int] = []
    acc = 0
    for i in range(len(sizes) - 1, -1, -1):
        if sizes[i] <= 0:
            continue
        cur.append(i)
        acc += sizes[i]
        if acc >= cap:
            out.append(tuple(cur))
            cur, acc, cap = [], 0, bucket_bytes
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def layer_order_levels(profile: Profile, levels: int) -> tuple[int, ...]:
    """The shim's ``layer_order`` policy: forward order compressed onto ``levels`` byte-balanced contiguous groups
    (``policies.cutting.forward_order_levels`` of the layers' bytes). Usage: ``layer_order_levels(p, 4)``"""
    return forward_order_levels([ly.params_bytes for ly in profile.layers], levels)


def _partition(partition_bytes: int | None) -> int | None:
    if partition_bytes is None:
        return None
    if partition_bytes < 1:
        raise ValueError(f"partition_bytes must be positive, not {partition_bytes}")
    return max(ELEMENT_BYTES, partition_bytes - partition_bytes % ELEMENT_BYTES)  # whole elements, as the shim


# -------------------------------------------------------------------------------------------------------- ops

def ddp_ops(profile: Profile, buckets: Sequence[Sequence[int]], host: HostCosts = HostCosts()) -> tuple[Op, ...]:
    """Plain DDP: one operation per bucket, issued in bucket order when it is ready (plus ``launch_s``).

    Usage: ``ddp_ops(p, ddp_buckets(sizes, 5 << 20))``
    """
    ready = grad_ready_times(profile)
    ops, t = [], 0.0
    for k, b in enumerate(buckets):
        t = max(t, ready[min(b)]) + host.launch_s
        ops.append(Op(sum(profile.layers[i].params_bytes for i in b), 0, tuple(sorted(b)), k, t))
    return tuple(ops)


def shim_ops(profile: Profile, buckets: Sequence[Sequence[int]], layer_levels: Sequence[int],
             partition_bytes: int | None = None, host: HostCosts = HostCosts(), order: str = "urgent",
             whole: bool = False) -> tuple[Op, ...]:
    """The shim's overlap hook: per bucket (in bucket order, on one thread, when it is ready) a copy, then its
    pieces issued one by one, most urgent level first, then by the forward position of their first layer
    (``order="urgent"``; ``"buffer"``: in buffer order, the shim before that change). ``whole``: every bucket goes
    as one piece at its most urgent layer's level, as the shim sends 16-bit buckets at 3 or more ranks
    (``shim.ddp.uncut``); ``partition_bytes`` then cuts nothing.

    Usage: ``shim_ops(p, ddp_buckets(sizes, 1 << 20), layer_order_levels(p, 4))``
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if len(layer_levels) != len(profile.layers):
        raise ValueError("one level per layer is needed")
    part = _partition(partition_bytes)
    ready = grad_ready_times(profile)
    ops: list[Op] = []
    free = 0.0  # when the training thread has finished the previous hook
    for k, b in enumerate(buckets):
        sizes = [profile.layers[i].params_bytes for i in b]
        pieces = ([(0, sum(sizes), min(layer_levels[i] for i in b))] if whole
                  else bucket_pieces(sizes, [layer_levels[i] for i in b], part))
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        covered = [tuple(sorted(i for i, lo, hi in zip(b, starts, starts[1:], strict=False)
                                if lo < off + n and hi > off))
                   for off, n, _ in pieces]
        idx = list(range(len(pieces)))
        if order == "urgent":
            idx.sort(key=lambda j: (pieces[j][2], covered[j][0], pieces[j][0]))
        t = max(free, ready[min(b)]) + host.hook_s + host.copy_s(sum(sizes))
        for j in idx:
            t += host.launch_s
            ops.append(Op(pieces[j][1], pieces[j][2], covered[j], k, t))
        free = t
    return tuple(ops)


def gloo_segment_bytes(nbytes: int, ranks: int, element_bytes: int = ELEMENT_BYTES) -> int:
    """Size of the messages gloo's ring all-reduce sends for ``nbytes``: the buffer is cut into
    ``roundUp(max(ceil(nbytes / 1 MiB), 2 * ranks), ranks)`` segments (``gloo/allreduce.cc``).

    Usage: ``gloo_segment_bytes(400_000, 2) == 100_000``; ``gloo_segment_bytes(8 << 20, 2) == 1 << 20``
    """
    if nbytes <= 0:
        return 0
    n = max(1, ranks)
    segs = max(-(-nbytes // GLOO_MAX_SEGMENT), 2 * n)
    segs = -(-segs // n) * n
    per = -(-nbytes // segs)
    return -(-per // element_bytes) * element_bytes


def op_done_times(ops: Sequence[Op], cost: CostModel, host: HostCosts = HostCosts(), sharing: str = "messages"
                  ) -> tuple[float, ...]:
    """Completion time of each operation: one FIFO process group per level running ``host.threads`` operations at
    once, strict priority across levels (``policies.simulator.network_done_times``), and within a level:

    * ``"messages"`` (default): the operations in flight on one group share its TCP connections message by
      message, so each gets a share of the link proportional to its gloo segment size
      (:func:`gloo_segment_bytes`): a small operation beside a large one crawls (weighted processor sharing);
    * ``"ps"``: equal shares; ``"fifo"``: one at a time.

    Usage: ``op_done_times(shim_ops(...), CostModel(2, 191e6, alpha_s=1.5e-3))``
    """
    if sharing not in SHARINGS:
        raise ValueError(f"sharing must be one of {SHARINGS}, not {sharing!r}")
    blocks, pos = [], 0
    for seq, op in enumerate(ops):
        blocks.append(Block(pos, pos + op.nbytes, op.layers, op.launch_s, seq, op.level))
        pos += op.nbytes
    sched = Schedule("execution", tuple(blocks), per_level_inflight=host.threads)
    weights = None
    if sharing == "messages":
        weights = [max(1, gloo_segment_bytes(op.nbytes, cost.ranks)) / GLOO_MAX_SEGMENT for op in ops]
    return network_done_times(sched, cost, [op.launch_s for op in ops], "fifo" if sharing == "fifo" else "ps",
                              weights)


def _result(profile: Profile, ops: tuple[Op, ...], done: Sequence[float], layer_ready: Sequence[float],
            buckets: tuple[tuple[int, ...], ...]) -> ExecResult:
    backward = grad_ready_times(profile)[0] if profile.layers else 0.0
    starts = forward_starts(profile, layer_ready, backward, None)
    end = max((s + ly.fwd_s for s, ly in zip(starts, profile.layers, strict=True)), default=backward)
    return ExecResult(end, backward, profile.fwd_total, max(done, default=0.0), ops, tuple(done),
                      tuple(layer_ready), starts, buckets)


# ------------------------------------------------------------------------------------------------- iterations

def ddp_iteration(profile: Profile, cost: CostModel, bucket_bytes: int, first_bucket_bytes: int | None = None,
                  host: HostCosts = HostCosts(), sharing: str = "messages") -> ExecResult:
    """One steady-state iteration of plain DDP: buckets issued when ready on one group, and the next forward
    (a chain, in layer order) only after every bucket is reduced (plus ``wake_s``).

    Usage: ``ddp_iteration(p, CostModel(2, 191e6, alpha_s=1.5e-3), bucket_bytes=5 << 20).iter_s``
    """
    buckets = ddp_buckets([ly.params_bytes for ly in profile.layers], bucket_bytes, first_bucket_bytes)
    ops = ddp_ops(profile, buckets, host)
    done = op_done_times(ops, cost, host, sharing)
    gate = max(done, default=0.0) + (host.wake_s if ops else 0.0)
    return _result(profile, ops, done, [gate] * len(profile.layers), buckets)


def shim_iteration(profile: Profile, cost: CostModel, layer_levels: Sequence[int], bucket_bytes: int,
                   partition_bytes: int | None = None, first_bucket_bytes: int | None = None,
                   host: HostCosts = HostCosts(), wait: str = "piece", order: str = "urgent",
                   sharing: str = "messages", whole: bool = False) -> ExecResult:
    """One steady-state iteration of the shim's overlap mode with per-layer ``layer_levels`` (0 most urgent):
    pieces issued by the Python hook, one group per level, strict priority, and the next forward's layer ``i``
    waiting only for the pieces holding its bytes (``wait="piece"``) or for its whole bucket (``"bucket"``).

    With ``host.callback_s`` > 0, every operation that completes while a layer computes (backward, or forward
    after its wait) lengthens that layer by ``callback_s`` and the iteration is computed again with the
    stretched compute (one fixed-point step: the stalls move the completions only a little). ``whole``: buckets
    are not cut (:func:`shim_ops`).

    Usage: ``shim_iteration(p, cost, layer_order_levels(p, 4), bucket_bytes=1 << 20).iter_s``
    """
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, not {wait!r}")
    r = _shim_pass(profile, cost, layer_levels, bucket_bytes, partition_bytes, first_bucket_bytes, host, wait,
                   order, sharing, whole)
    if host.callback_s <= 0 or not r.ops:
        return r
    return _shim_pass(stalled(profile, r, host.callback_s), cost, layer_levels, bucket_bytes, partition_bytes,
                      first_bucket_bytes, host, wait, order, sharing, whole)


def stalled(profile: Profile, r: ExecResult, callback_s: float) -> Profile:
    """``profile`` with each layer's backward and forward time lengthened by ``callback_s`` per operation of ``r``
    that completes while that layer computes (completions while the compute stream waits cost nothing).

    Usage: ``stalled(p, shim_iteration(p, cost, levels, 1 << 20), 2e-4)``
    """
    n = len(profile.layers)
    grad = grad_ready_times(profile)
    bwd = [0] * n
    fwd = [0] * n
    for t in r.done_s:
        hit = False
        for i in range(n):
            lo = grad[i] - profile.layers[i].bwd_s
            if lo <= t < grad[i]:
                bwd[i] += 1
                hit = True
                break
        if hit:
            continue
        for i in range(n):
            s0 = r.layer_fwd_start_s[i]
            if s0 < t < s0 + profile.layers[i].fwd_s:  # at s0 the layer was waiting for it
                fwd[i] += 1
                break
    layers = tuple(replace(ly, bwd_s=ly.bwd_s + bwd[i] * callback_s, fwd_s=ly.fwd_s + fwd[i] * callback_s)
                   for i, ly in enumerate(profile.layers))
    return replace(profile, layers=layers)


def _shim_pass(profile: Profile, cost: CostModel, layer_levels: Sequence[int], bucket_bytes: int,
               partition_bytes: int | None, first_bucket_bytes: int | None, host: HostCosts, wait: str,
               order: str, sharing: str, whole: bool) -> ExecResult:
    buckets = ddp_buckets([ly.params_bytes for ly in profile.layers], bucket_bytes, first_bucket_bytes)
    ops = shim_ops(profile, buckets, layer_levels, partition_bytes, host, order, whole)
    done = op_done_times(ops, cost, host, sharing)
    ready = [-INF] * len(profile.layers)
    bucket_done = [-INF] * len(buckets)
    for op, t in zip(ops, done, strict=True):
        bucket_done[op.bucket] = max(bucket_done[op.bucket], t)
        for i in op.layers:
            ready[i] = max(ready[i], t)
    if wait == "bucket":
        for k, b in enumerate(buckets):
            for i in b:
                ready[i] = bucket_done[k]
    layer_ready = [0.0 if r == -INF else r + host.wake_s for r in ready]
    return _result(profile, ops, done, layer_ready, buckets)


# ---------------------------------------------------------------------------------------------- calibration

def fit_alpha_beta(samples: Sequence[tuple[int, float]], ranks: int) -> tuple[float, float]:
    """``(alpha_s, link_bps)`` of ``time = alpha + 2(n-1)/n * 8 * bytes / link_bps`` from ``(nbytes, seconds)``
    samples of uncontended all-reduces (at least two distinct sizes; several samples of a size: their median).

    The rate is the slope between the two largest sizes (where the wire term dominates), alpha the smallest size's
    time less its wire time (where the startup dominates); a least-squares line over all sizes would let the large
    sizes' noise decide alpha. Usage: ``fit_alpha_beta([(4096, 1.3e-3), (1 << 20, 45e-3), (4 << 20, 0.177)], 2)``
    """
    if ranks < 2:
        raise ValueError("calibration needs at least 2 ranks")
    by: dict[int, list[float]] = {}
    for b, t in samples:
        by.setdefault(int(b), []).append(float(t))
    if len(by) < 2:
        raise ValueError("need samples of at least two sizes")
    sizes = sorted(by)
    med = {b: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1:len(v) // 2 + 1]) / 2
           for b, v in by.items()}
    bits = 2 * (ranks - 1) / ranks * 8
    lo, hi = sizes[-2], sizes[-1]
    slope = (med[hi] - med[lo]) / (bits * (hi - lo))
    if not slope > 0:
        raise ValueError("time does not grow with size: cannot fit a link rate")
    return max(0.0, med[sizes[0]] - slope * bits * sizes[0]), 1.0 / slope
