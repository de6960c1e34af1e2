"""`shim.attach` (this module: DDP integration): prioritized, wait-free all-reduce for a DDP model, with optional overlap of communication and
the next forward pass.

- One gloo process group per priority level: each level is its own set of TCP connections, which the shim finds
  in /proc and registers with the local agent (job id, rank, level).
- A DDP communication hook cuts every gradient bucket into pieces by level (``shim.buckets``) and launches each
  piece's all-reduce on its level's group as soon as the bucket is ready; several levels are in flight at once
  and the network (the agent's queues, the switches' DSCP queues) serves the urgent ones first.
- With ``optimizer``, overlap mode: DDP waits for every hook future before ``backward()`` returns, so the hook
  returns at once and the all-reduce continues on a copy of the bucket. Each parameter's optimizer step is taken
  when its own all-reduce has completed, lazily, in a forward pre-hook of the module that owns it: the next
  forward pass starts while later layers are still synchronizing. ``optimizer.step()`` in the user's loop does
  nothing (updates are applied per parameter); ``zero_grad()`` is harmless. ``state_dict()`` of the model or the
  optimizer, ``flush()`` and ``close()`` apply every pending update first.

Usage::

    model = DDP(net)
    handle = shim.attach(model, optimizer=opt, levels=4)   # collective: every rank calls it
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    handle.close()
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shim import report
from shim.agent_link import AgentLink
from shim.buckets import parameter_levels, pieces_of
from shim.flows import new_flows, own_tcp_flows

log = logging.getLogger("tensorlane.shim")
PLANNER_POLICIES = ("planner", "layer_order", "flat")
DEFAULT_SOCKET = "/run/tensorlane/agent.sock"
_TRUE = ("1", "true", "yes", "on")


def _disabled(disable: bool | None) -> bool:
    if disable is not None:
        return disable
    return os.environ.get("TENSORLANE_DISABLE", "").strip().lower() in _TRUE


def default_job_id() -> str:
    """A job id every rank agrees on: TENSORLANE_JOB, else torchrun's run id, else the rendezvous address."""
    raw = (os.environ.get("TENSORLANE_JOB") or os.environ.get("TORCHELASTIC_RUN_ID")
           or f"job-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}")
    job = re.sub(r"[^A-Za-z0-9_.:\-]", "-", raw)[:64]
    return job if job[:1].isalnum() else f"j{job}"[:64]


@dataclass
class LevelStats:
    """Counters of one level: pieces launched, their bytes, and seconds from each piece's launch until the shim
    saw it complete (hook mode: the bucket's completion; overlap mode: the wait or check in a forward pre-hook,
    so an upper bound). No per-piece completion callback: a Python callback runs on a gloo thread and takes the
    GIL, which measurably stalled the training thread (policies/execution.py, ``callback_s``)."""

    allreduces: int = 0
    bytes: int = 0
    comm_s: float = 0.0


@dataclass
class _Pending:
    """A bucket whose all-reduce is in flight (overlap mode).

    ``params`` holds ``(param, offset, numel, piece indexes)``: the pieces of ``futures`` that cover the
    parameter's slice of ``buffer``, so that a parameter waits only for its own pieces.
    """

    futures: list
    buffer: torch.Tensor
    params: list  # (param, offset, numel, tuple of piece indexes)
    launched: list = field(default_factory=list)  # (level, launch time) of each piece, for the counters
    applied: set = field(default_factory=set)  # id(param) of the parameters whose step has been taken
    timed: set = field(default_factory=set)  # pieces whose completion has been counted


@dataclass
class ShimState:
    """Everything the hooks need, kept plain and explicit (like DDP's default hook states)."""

    groups: list
    world: int
    param_level: dict  # id(param) -> level
    partition_elems: int | None
    overlap: bool
    stats: list[LevelStats] = field(default_factory=list)
    forward_index: dict = field(default_factory=dict)  # id(param) -> position in forward order
    pending: dict = field(default_factory=dict)  # id(param) -> _Pending
    step: object = None  # overlap mode: the optimizer step of a list of parameters (Handle._step_subset)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def launch(self, buf: torch.Tensor, params: list) -> tuple[list, list, list]:
        """Start the all-reduce of ``buf`` (the concatenated grads of ``params``) piece by piece, by level.

        Pieces are launched most urgent first: by level, then by the forward position of their first parameter
        (a level's group runs its operations in launch order). Returns the futures and the pieces
        ``(offset, length, level)`` and their ``(level, launch time)``, all in buffer order.
        """
        numels = [p.numel() for p in params]
        last = len(self.groups) - 1
        levels = [self.param_level.get(id(p), last) for p in params]
        pieces = pieces_of(numels, levels, self.partition_elems)
        order = self.forward_index
        starts, acc = [], 0
        for n in numels:
            starts.append(acc)
            acc += n
        first = []  # forward position of the first parameter of each piece
        for offset, length, _level in pieces:
            covered = [order.get(id(p), 0) for p, s0, n in zip(params, starts, numels)
                       if s0 < offset + length and s0 + n > offset]
            first.append(min(covered, default=0))
        futures: list = [None] * len(pieces)
        launched: list = [None] * len(pieces)
        element = buf.element_size()
        for i in sorted(range(len(pieces)), key=lambda i: (pieces[i][2], first[i], pieces[i][0])):
            offset, length, level = pieces[i]
            launched[i] = (level, time.perf_counter())
            futures[i] = dist.all_reduce(buf.narrow(0, offset, length), group=self.groups[level],
                                         async_op=True).get_future()
        with self.lock:
            for offset, length, level in pieces:
                s = self.stats[level]
                s.allreduces += 1
                s.bytes += length * element
        return futures, pieces, launched

    def completed(self, launched: list, indexes) -> None:
        """Count the seconds from launch to now of the pieces ``indexes`` of ``launched`` (seen complete now)."""
        now = time.perf_counter()
        with self.lock:
            for i in indexes:
                level, t0 = launched[i]
                self.stats[level].comm_s += now - t0


def priority_hook(state: ShimState, bucket):
    """DDP comm hook: average the bucket with one all-reduce per level piece, all launched at once.

    Usage: ``ddp.register_comm_hook(state, priority_hook)``
    """
    buf = bucket.buffer()
    buf.div_(state.world)
    futures, _, launched = state.launch(buf, bucket.parameters())

    def finished(_fut):  # one callback per bucket (DDP needs the bucket's future anyway)
        state.completed(launched, range(len(launched)))
        return buf
    return torch.futures.collect_all(futures).then(finished)


def overlap_hook(state: ShimState, bucket):
    """DDP comm hook of overlap mode: launch the pieces on a copy of the bucket and return at once.

    Usage: ``ddp.register_comm_hook(state, overlap_hook)``
    """
    params = list(bucket.parameters())
    for p in params:  # an update still pending from the last iteration (a module that did not run forward);
        _apply(state, p, state.step)  # its gradient is complete, so autograd no longer reads the parameter
    buf = bucket.buffer().div(state.world)  # a copy, which the all-reduce owns until it completes
    futures, pieces, launched = state.launch(buf, params)
    pend, offset = _Pending(futures, buf, [], launched), 0
    for p in params:
        n = p.numel()
        covering = tuple(i for i, (o, length, _) in enumerate(pieces) if o < offset + n and o + length > offset)
        pend.params.append((p, offset, n, covering))
        state.pending[id(p)] = pend
        offset += n
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _apply(state: ShimState, param, step) -> None:
    """Wait for the pieces holding ``param``, then take the optimizer step of every parameter of its bucket
    whose pieces have all completed by then (``param`` among them; the others are not waited for)."""
    pend = state.pending.get(id(param))
    if pend is None or id(param) in pend.applied:
        state.pending.pop(id(param), None)
        return
    for _p, _o, _n, covering in pend.params:
        if _p is param:
            for i in covering:
                pend.futures[i].wait()
            break
    done = [fut.done() for fut in pend.futures]
    seen = [i for i, d in enumerate(done) if d and i not in pend.timed]
    if seen:
        pend.timed.update(seen)
        state.completed(pend.launched, seen)
    params = []
    for p, offset, numel, covering in pend.params:
        if id(p) in pend.applied or not all(done[i] for i in covering):
            continue
        pend.applied.add(id(p))
        state.pending.pop(id(p), None)
        p.grad = pend.buffer.narrow(0, offset, numel).view_as(p)
        params.append(p)
    if step is not None and params:
        step(params)
    for p in params:
        p.grad = None


class Handle:
    """What ``attach`` returns: ``close()``, ``flush()``, ``stats()``."""

    def __init__(self, model, optimizer=None, state: ShimState | None = None, link: AgentLink | None = None,
                 flows: dict | None = None, disabled: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.link = link
        self.flows = flows or {}
        self.disabled = disabled
        self._hooks: list = []
        self._orig_step = None
        self.deferred_steps = 0
        self.closed = False
        self.reporter = None  # shim.report: per-level communication counters to the agent (metrics)
        self.plan: dict = {}  # what the default policy decided (shim.plan), in stats()["plan"]
        self._recorder = None  # shim.plan.Recorder while the first iteration is being measured

    # -- overlap mode plumbing ------------------------------------------------------------------------------
    def _install_overlap(self) -> None:
        opt = self.optimizer
        self._orig_step = opt.step
        opt.step = self._deferred_step
        self.state.step = self._step_subset
        owners = [m for m in self.model.module.modules() if any(True for _ in m.parameters(recurse=False))]
        for m in owners:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(self.model.register_state_dict_pre_hook(lambda *a, **k: self.flush()))
        self._hooks.append(opt.register_state_dict_pre_hook(lambda *a, **k: self.flush()))

    def _deferred_step(self, closure=None):
        if closure is not None:
            raise RuntimeError("tensorlane overlap mode applies each parameter's step when its all-reduce "
                               "completes; optimizer.step(closure) is not supported")
        self.deferred_steps += 1

    def _step_subset(self, params: list) -> None:
        opt = self.optimizer
        wanted = {id(p) for p in params}
        saved = [g["params"] for g in opt.param_groups]
        try:
            for g in opt.param_groups:
                g["params"] = [p for p in g["params"] if id(p) in wanted]
            with torch.no_grad():
                self._orig_step()
        finally:
            for g, ps in zip(opt.param_groups, saved):
                g["params"] = ps

    def _pre_forward(self, module, _inputs) -> None:
        for p in module.parameters(recurse=False):
            _apply(self.state, p, self._step_subset)

    # -- public -------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply every pending update (overlap mode); a no-op otherwise."""
        if self.state is not None and self.state.overlap:
            for key in list(self.state.pending):
                pend = self.state.pending.get(key)
                if pend is not None:
                    for p, *_ in pend.params:
                        if id(p) not in pend.applied:
                            _apply(self.state, p, self._step_subset)

    def stats(self) -> dict:
        """Flows per level, agent link counters, and per-level all-reduce counts, bytes and seconds."""
        if self.disabled:
            return {"enabled": False}
        with self.state.lock:
            levels = [dict(level=i, **vars(s)) for i, s in enumerate(self.state.stats)]
        return {"enabled": True, "mode": "overlap" if self.state.overlap else "hook",
                "flows": {lvl: len(f) for lvl, f in self.flows.items()}, "levels": levels,
                "deferred_steps": self.deferred_steps, "plan": dict(self.plan),
                "agent": {"connected": self.link.connected, **self.link.counters, "last_error": self.link.last_error}}

    def close(self) -> None:
        """Apply pending updates, restore the optimizer, withdraw the flows from the agent. Idempotent."""
        if self.closed or self.disabled:
            self.closed = True
            return
        self.flush()
        if self._recorder is not None:
            self._recorder.remove()
        for h in self._hooks:
            h.remove()
        if self._orig_step is not None:
            del self.optimizer.step  # the instance attribute; the class's step is back
        if self.reporter is not None:
            self.reporter.close()
        self.link.close()
        self.closed = True


def _agree(prof, rate: float | None):
    """Make every rank plan from the same inputs (a collective): each layer's slowest forward and backward over
    the ranks, and the slowest link (None if any rank does not know its link). Ranks that planned from their own
    measurements would cut buckets differently and their all-reduces would not match."""
    from policies.model import Layer, Profile

    n = len(prof.layers)
    vals = [l.fwd_s for l in prof.layers] + [l.bwd_s for l in prof.layers] + [1.0 if rate is None else -float(rate)]
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.tolist()
    layers = tuple(Layer(l.name, l.params_bytes, v[i], v[n + i]) for i, l in enumerate(prof.layers))
    return Profile(prof.name, layers, prof.dag), (None if v[-1] > 0 else -v[-1])


def _apply_plan(handle: Handle, prof, owners: list, levels: int, link_bps: float | None,
                partition_fixed: bool, source: str) -> None:
    """Plan with ``prof`` (one layer per owner module) and install the per-parameter levels and partition size."""
    from shim.plan import choose

    prof, rate = _agree(prof, link_bps or handle.link.link_bps)
    if rate is None:
        handle.plan.update(status="layer_order: link rate unknown on some rank (pass link_bps= or run agents)",
                           source=source)
        return
    state = handle.state
    bucket = int(getattr(handle.model, "bucket_bytes_cap", 25 << 20))
    try:
        chosen = choose(prof, state.world, rate, levels, bucket)
    except (ValueError, ArithmeticError) as exc:  # keep training on the layer-order levels, say why
        handle.plan.update(status=f"layer_order: the planner failed: {exc}", source=source)
        log.warning("tensorlane: the planner failed (%s); keeping layer-order levels", exc)
        return
    for m, lvl in zip(owners, chosen["layer_levels"]):
        for p in m.parameters(recurse=False):
            state.param_level[id(p)] = min(max(0, int(lvl)), levels - 1)
    if not partition_fixed:
        pb = chosen["partition_bytes"]
        state.partition_elems = None if pb is None else max(1, pb // 4)
    handle.plan.update(status="planned", source=source, link_bps=rate, bucket_bytes=bucket,
                       **{k: v for k, v in chosen.items()})


def _start_planner(handle: Handle, model, levels: int, profile, link_bps: float | None,
                   partition_bytes: int | None) -> None:
    """Plan now from ``profile``, or measure the next iteration and plan at the start of the one after."""
    from shim.plan import Recorder, owner_modules

    owners = owner_modules(model.module)
    fixed = partition_bytes is not None
    if profile is not None:
        from policies.model import load_profile

        prof = load_profile(profile) if isinstance(profile, str) else profile
        if len(prof.layers) != len(owners):
            raise ValueError(f"profile {prof.name!r} has {len(prof.layers)} layers but the model has {len(owners)} "
                             "modules with parameters (one layer per such module, in parameter order)")
        _apply_plan(handle, prof, owners, levels, link_bps, fixed, "profile")
        return

    def planned(rec: Recorder) -> None:
        rec.remove()
        _apply_plan(handle, rec.profile("measured"), owners, levels, link_bps, fixed, "measured")

    handle.plan["status"] = "measuring the first iteration (layer_order until then)"
    handle._recorder = Recorder(owners, on_done=planned)


def _priority_groups(levels: int, master_port: str | None) -> tuple[list, dict[int, list[dict]]]:
    """Create one gloo group per level (a collective) and return the groups and each level's new TCP flows."""
    groups, flows = [], {}
    for level in range(levels):
        before = own_tcp_flows()
        group = dist.new_group(backend="gloo")
        dist.barrier(group=group)  # every connection of the group is up
        found = new_flows(before, own_tcp_flows())
        flows[level] = [f for f in found if not f["dst"].startswith("127.") and f["dst"] != "::1"
                        and str(f["dport"]) != master_port and str(f["sport"]) != master_port]
        groups.append(group)
    return groups, flows


def attach(model, optimizer=None, *, levels: int = 4, policy: str = "planner", agent_socket: str | None = None,
           job: str | None = None, partition_bytes: int | None = None, disable: bool | None = None,
           report_interval_s: float = 5.0, profile=None, link_bps: float | None = None) -> Handle:
    """Give ``model`` (a DistributedDataParallel) prioritized all-reduce; with ``optimizer``, overlap mode.

    Every rank must call it (it creates process groups). ``disable=True`` or TENSORLANE_DISABLE=1 leaves training
    exactly as plain DDP. Options: ``levels`` (1..5), ``policy`` ("planner", the default: ``policies.planner``
    chooses each layer's level and the partition size from a profile measured during the first iteration or
    given as ``profile`` (a policies.model.Profile or a shipped profile's name, one layer per module with
    parameters) and the link rate ``link_bps`` (default: the agent's), see shim.plan; "layer_order" or "flat",
    see shim.buckets), ``partition_bytes`` given explicitly overrides the planner's,
    ``agent_socket`` (default TENSORLANE_AGENT_SOCKET or /run/tensorlane/agent.sock), ``job`` (default
    ``default_job_id()``), ``partition_bytes`` (largest all-reduce piece; None: a bucket is cut only where its
    level changes), ``report_interval_s`` (how often per-level communication counters go to the agent's
    metrics, ``shim.report``). Usage: ``handle = shim.attach(ddp_model, optimizer, levels=4)``
    """
    if _disabled(disable):
        return Handle(model, optimizer, disabled=True)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("shim.attach needs a torch.nn.parallel.DistributedDataParallel model")
    if not 1 <= levels <= 5:
        raise ValueError(f"levels must be 1..5 (the DSCP table's distinct switch queues), not {levels}")
    if optimizer is not None and getattr(model, "gradient_as_bucket_view", False):
        raise ValueError("overlap mode needs DDP(gradient_as_bucket_view=False)")
    if dist.get_backend() != "gloo":
        warnings.warn("tensorlane's shim is tested with gloo; with NCCL sockets the flows are found the same way, "
                      "over IB/RoCE use NCCL_IB_TC per communicator instead (see docs/shim.md)", stacklevel=2)
    params = [p for p in model.module.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    if policy not in PLANNER_POLICIES:
        raise ValueError(f"policy must be one of {PLANNER_POLICIES}, not {policy!r}")
    first_policy = "layer_order" if policy == "planner" else policy
    param_level = {id(p): lvl for p, lvl in zip(params, parameter_levels(sizes, levels, first_policy))}
    groups, flows = _priority_groups(levels, os.environ.get("MASTER_PORT"))
    link = AgentLink(agent_socket or os.environ.get("TENSORLANE_AGENT_SOCKET", DEFAULT_SOCKET),
                     job or default_job_id(), rank=dist.get_rank())
    for level, fl in flows.items():
        if fl:
            link.add(level, fl)
    element = params[0].element_size() if params else 4
    state = ShimState(groups, dist.get_world_size(), param_level,
                      None if partition_bytes is None else max(1, partition_bytes // element), optimizer is not None,
                      stats=[LevelStats() for _ in range(levels)],
                      forward_index={id(p): i for i, p in enumerate(params)})
    handle = Handle(model, optimizer, state, link, flows)
    handle.plan = {"policy": policy}
    if policy == "planner":
        _start_planner(handle, model, levels, profile, link_bps, partition_bytes)
    handle.reporter = report.start(handle, interval_s=report_interval_s)
    if optimizer is not None:
        handle._install_overlap()
        model.register_comm_hook(state, overlap_hook)
    else:
        model.register_comm_hook(state, priority_hook)
    return handle
