"""`shim.attach` (this module: DDP integration): prioritized, wait-free all-reduce for a DDP model, with optional
overlap of communication and the next forward pass.

- One gloo process group per priority level: each level is its own set of TCP connections, which the shim finds
  in /proc and registers with the local agent (job id, rank, level): ``shim/groups.py``.
- A DDP communication hook cuts every gradient bucket into pieces by level (``policies.cutting``) and launches each
  piece's all-reduce on its level's group as soon as the bucket is ready; several levels are in flight at once
  and the network (the agent's queues, the switches' DSCP queues) serves the urgent ones first.
- Hook mode (``priority_hook``): DDP waits for the pieces before ``backward()`` returns; the training loop is
  exactly plain DDP's. ``comm_state()`` makes a state for frameworks that own DDP (Lightning's ``DDPStrategy``).
- Overlap mode (``attach(..., optimizer)``, ``overlap_hook``): the hook returns at once and each parameter's
  optimizer step is taken when its own all-reduce has completed, in a forward pre-hook of its module, so the next
  forward pass starts while later layers are still synchronizing. The first synchronized iteration is a probe
  that runs like hook mode and checks that the loop is one overlap mode reproduces exactly; if not (gradient
  clipping, GradScaler, ``step(closure)``, an optimizer that is not per-parameter) the job stays in hook mode
  with one warning (``shim/overlap.py`` has the rules).

Usage::

    model = DDP(net)
    handle = shim.attach(model, optimizer=opt, levels=4)   # collective: every rank calls it
    for x, y in data:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    handle.close()
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer

from tensorlane.policies.cutting import parameter_levels, pieces_of
from tensorlane.policies.levels import DEFAULT_LEVELS, MAX_LEVELS
from tensorlane.shim import overlap as ov
from tensorlane.shim import report
from tensorlane.shim.agent_link import AgentLink
from tensorlane.shim.compute import ComputeClock, StepWindow
from tensorlane.shim.groups import _FALSE, _TRUE, connect
from tensorlane.shim.report import Reporter

log = logging.getLogger("tensorlane.shim")
PLANNER_POLICIES = ("planner", "layer_order", "flat")
PROBE_MAX_BACKWARDS = 16  # synchronized iterations without a step() seen before overlap mode gives up
CLOSE_WAIT_S = 300.0  # close() on another thread: how long to wait for the training thread's backward to end
AGREE_TIMEOUT_S = 10.0  # close(): how long to wait for the compute time's all-reduce in flight before freeing groups
# what the guard's flush warns of, by ov.cause(): until 2026-11-28 a DataLoader's workers forked at iter(loader) were
# warned of as "an EMA of the weights, logging or changing them", which a loop without any had to hunt for
_USE_CAUSES = {
    None: "a parameter was used between optimizer.step() and the next forward (an EMA of the weights, logging or "
          "changing them); the pending updates were applied first, as under DDP",
    "fork": "a process was forked between optimizer.step() and the next forward (os.fork(): a DataLoader's workers "
            "under the fork start method, made at each iter(loader), or multiprocessing); the pending updates were "
            "applied first, so that the child holds the updated weights, as under DDP (a DataLoader with "
            "persistent_workers=True forks once, at the first iter(loader), before any step)",
    "compiled": "a torch.compile'd function or module was called between optimizer.step() and the next forward "
                "(compiled code may read any weight); the pending updates were applied first, as under DDP",
}


def _disabled(disable: bool | str | None) -> bool:
    """``disable``, else ``$TENSORLANE_DISABLE``; a value that is neither true nor false is refused (a typo such as
    ``ture`` left the shim on, silently, in a run meant to be plain DDP). ``disable`` given as a string (read from
    the user's own variable) takes the variable's spellings: until 2026-11-28 any non-empty string, ``"0"`` and
    ``"false"`` included, disabled the shim. Usage: ``_disabled(None)``"""
    if isinstance(disable, bool) or disable is None and "TENSORLANE_DISABLE" not in os.environ:
        return bool(disable)
    if isinstance(disable, int) and disable in (0, 1):
        return bool(disable)
    name, raw = ("TENSORLANE_DISABLE", os.environ["TENSORLANE_DISABLE"]) if disable is None else ("disable", disable)
    if not isinstance(raw, str) or raw.strip().lower() not in _TRUE + _FALSE:
        raise ValueError(f"{name}={raw!r:.60} is neither true (True, {', '.join(_TRUE)}) nor false "
                         f"(False, {', '.join(v for v in _FALSE if v)}, or unset)")
    return raw.strip().lower() in _TRUE


@dataclass
class LevelStats:
    """Counters of one level: pieces launched, their bytes, and seconds from each piece's launch until the shim
    saw it complete (hook mode: the bucket's completion; overlap mode: the wait or check in a forward pre-hook,
    so an upper bound). No per-piece completion callback: a Python callback runs on a gloo thread and takes the
    GIL, which measurably stalled the training thread (policies/execution.py, ``callback_s``)."""

    allreduces: int = 0
    bytes: int = 0
    comm_s: float = 0.0


SPAWN_REFUSED = (
    "tensorlane: the shim's state (shim.comm_state(), or the one shim.attach put on the DDP model) cannot be pickled: "
    "it holds this process's process groups, threads and locks. A DDP model with the shim attached is pickled with "
    "it (torch.save(ddp_model)): save ddp_model.module or its state_dict() instead (copy.deepcopy(ddp_model) works). "
    "Lightning's strategy='ddp_spawn' "
    "(DDPStrategy(start_method='spawn')) pickles the Trainer, its strategy and callbacks for the processes it starts; "
    "nothing has trained. Use DDPStrategy(start_method='popen') (Lightning's default: it starts the script again, "
    "or run it under torchrun) with shim.comm_state() made in each process")


@dataclass
class ShimState:
    """Everything the hooks need, kept plain and explicit (like DDP's default hook states).

    ``mode`` is ``hook``, ``probing`` (overlap asked for, first iteration under way) or ``overlap``, with
    ``mode_reason``. ``deferred`` holds overlap mode's pending steps (``shim.overlap``). A state made by
    ``comm_state()`` has no groups yet: ``start()`` makes them at the first hook call.
    """

    groups: list | None
    world: int
    param_level: dict  # id(param) -> level
    partition_bytes: int | None  # a piece's most bytes (None: no limit), cut in each bucket's own elements
    levels: int = DEFAULT_LEVELS
    mode: str = "hook"
    mode_reason: str = "no optimizer given: DDP's own step (hook mode)"
    counters: list[LevelStats] = field(default_factory=list)  # per level
    forward_index: dict = field(default_factory=dict)  # id(param) -> position in forward order
    deferred: ov.Deferred | None = None
    require_overlap: bool = False
    link: AgentLink | None = None
    flows: dict = field(default_factory=dict)  # level -> this process's flows (registered while link.connected)
    reporter: Reporter | None = None
    job: str = ""
    options: dict = field(default_factory=dict)  # comm_state(): what start() needs
    order_source: list | None = None  # comm_state() without module: parameters in hook order, to learn levels
    closed: bool = False
    successor: tuple | None = None  # (state, hook) of a later attach to the same DDP model, made after close()
    copied: bool = False  # a deep copy's (__deepcopy__): in the _comm_hooks of a DDP copy whose reducer has no hook
    copy_warned: bool = False  # a copy's hook was called all the same (_after_close warned once)
    # re-entrant: a signal handler (stats() logging progress, close()) runs on the main thread between two bytecodes,
    # also while that thread holds it; until 2026-11-28 it hung there for good (tests/test_shim.py::
    # test_stats_from_a_signal_handler_while_the_shim_counts_returns). A gloo future's callback takes it too
    lock: threading.RLock = field(default_factory=threading.RLock)
    step_bytes: int = 0  # bytes the last complete synchronized backward all-reduced (the same on every rank)
    tail_bytes: int = 0  # bytes of that backward's last bucket: what DDP waits for after backward (every rank alike)
    clock: ComputeClock = field(default_factory=ComputeClock)  # a step's compute seconds, agreed over the ranks
    window: StepWindow = field(default_factory=StepWindow)  # the last steps' wall-clock ends (job_policy "slowdown")
    _pending: dict = field(default_factory=dict)  # step -> its pieces launched and not yet seen complete
    _step_acc: int = 0
    _agreeing: tuple | None = None  # (work, tensor) of the clock's all-reduce in flight
    backwards: int = 0  # synchronized backwards whose buckets this state's hook was given (the same on every rank)
    paired_in: int | None = None  # the synchronized backward of the first bucket all-reduced on DDP's group after close

    def __reduce_ex__(self, _protocol):
        """Refuse pickling with a clear error (until 2026-11-27 Python's own "cannot pickle '_thread.lock' object";
        ``copy.deepcopy`` takes ``__deepcopy__`` below): the state holds this process's groups, threads and locks.
        Lightning's ``strategy="ddp_spawn"`` (``DDPStrategy(start_method="spawn")``) pickles the Trainer, its
        strategy and callbacks, and so ``comm_state()``, for the processes it starts, before any of them trains."""
        raise TypeError(SPAWN_REFUSED)

    def __deepcopy__(self, memo):
        """A deep copy of the DDP model (``AveragedModel(ddp_model)`` for SWA or an EMA, ``copy.deepcopy(ddp_model)``
        for a snapshot) copies the states in its ``_comm_hooks``: the copy is not the model being trained (DDP gives
        it a new reducer, which has no hook), so it gets a closed state, whose hook would be DDP's own all-reduce,
        not a copy of this process's groups, threads and locks. Until 2026-11-28 that deep copy raised (the pickling
        refusal above, about Lightning's ddp_spawn; before it "cannot pickle '_thread.lock' object") where plain
        DDP's loop trains on: a correct loop refused (idiom averaged_model_of_ddp). Pickling still raises."""
        other = ShimState(groups=None, world=self.world, param_level={}, partition_bytes=None, levels=self.levels,
                          mode=self.mode, mode_reason=self.mode_reason, job=self.job, closed=True, copied=True)
        memo[id(self)] = other
        return other

    def __copy__(self):  # copy.copy as before (it shares the groups and the lock, copying nothing of them)
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __post_init__(self):
        if not self.counters:
            self.counters = [LevelStats() for _ in range(self.levels)]

    def start(self) -> None:
        """Make the per-level groups, agree on the job id and register the flows (a collective; idempotent)."""
        if self.groups is not None:
            return
        o = self.options
        self.world = dist.get_world_size()
        self.groups, self.link, self.flows, self.job = connect(self.levels, o.get("agent_socket"), o.get("job"))
        self.reporter = _start_reporter(self, o.get("report_interval_s", report.INTERVAL_S))
        module = o.get("module")
        if module is not None:
            _set_layer_levels(self, [p for p in module.parameters() if p.requires_grad], o.get("policy"))

    def launch(self, buf: torch.Tensor, params: list, last_bucket: bool = False) -> tuple[list, list, list]:
        """Start the all-reduce of ``buf`` (the concatenated grads of ``params``) piece by piece, by level.

        Pieces are launched most urgent first: by level, then by the forward position of their first parameter
        (a level's group runs its operations in launch order). Returns the futures and the pieces
        ``(offset, length, level)`` and their ``(level, launch time, step)``, all in buffer order. ``last_bucket``:
        this is the backward's last bucket (its bytes so far become ``step_bytes``, reported to the agent at once when
        they change; the step's compute time goes to ``clock``, whose window's end launches the all-reduce that
        agrees on it, after the step's own pieces, on the last level's group).
        """
        numels = [_bucket_numel(p, buf) for p in params]
        last = len(self.groups) - 1
        levels = [self.param_level.get(id(p), last) for p in params]
        if buf.is_sparse:  # DDP gives a sparse gradient a bucket of its own: one all-reduce at its level
            return self._launch_sparse(buf, levels[0], last_bucket)
        most = None if self.partition_bytes is None else max(1, self.partition_bytes // buf.element_size())
        pieces = pieces_of(numels, levels, most) if not uncut(buf, self.world) else [(0, buf.numel(), min(levels))]
        order = self.forward_index
        starts, acc = [], 0
        for n in numels:
            starts.append(acc)
            acc += n
        first = []  # forward position of the first parameter of each piece
        for offset, length, _level in pieces:
            covered = [order.get(id(p), 0) for p, s0, n in zip(params, starts, numels, strict=True)
                       if s0 < offset + length and s0 + n > offset]
            first.append(min(covered, default=0))
        futures: list = [None] * len(pieces)
        launched: list = [None] * len(pieces)
        element = buf.element_size()
        for i in sorted(range(len(pieces)), key=lambda i: (pieces[i][2], first[i], pieces[i][0])):
            offset, length, level = pieces[i]
            launched[i] = (level, time.perf_counter(), self._launching())
            futures[i] = dist.all_reduce(buf.narrow(0, offset, length), group=self.groups[level],
                                         async_op=True).get_future()
        self._count([(level, length * element) for _offset, length, level in pieces], buf.numel() * element,
                    last_bucket)
        return futures, pieces, launched

    def _launch_sparse(self, buf: torch.Tensor, level: int, last_bucket: bool) -> tuple[list, list, list]:
        """``launch`` for a sparse gradient (already averaged): one all-reduce of it on ``level``'s group, as DDP
        does on its own (gloo's sparse all-reduce); the future's value is the result (not ``buf``, which stays)."""
        launched = [(level, time.perf_counter(), self._launching())]
        futures = [dist.all_reduce(buf, group=self.groups[level], async_op=True).get_future()]
        size = buf._values().numel() * buf.element_size() + buf._indices().numel() * buf._indices().element_size()
        self._count([(level, size)], size, last_bucket)
        return futures, [(0, buf._nnz(), level)], launched

    def _launching(self) -> int:
        """A piece of the current step is about to be launched: count it pending; returns the step."""
        with self.lock:
            step = self.clock.steps
            self._pending[step] = self._pending.get(step, 0) + 1
            return step

    def _finish_steps(self) -> bool:
        """Under the lock: a step whose last bucket was launched and whose pieces have all completed has ended its
        communication: its wall-clock end goes to ``window`` (job policy ``slowdown``). Returns whether one did."""
        ended = [step for step, n in self._pending.items() if n <= 0 and step < self.clock.steps]
        for step in ended:
            del self._pending[step]
        for step in [step for step in self._pending if step < self.clock.steps - 8]:  # never completed (closed)
            del self._pending[step]
        now = time.time()
        for _step in ended:  # (two steps end together when the later one's pieces complete first)
            self.window.step_end(now)
        return bool(ended)

    def _count(self, sent: list, size: int, last_bucket: bool) -> None:
        """Count the all-reduces ``sent`` (``(level, bytes)`` each) of a bucket of ``size`` bytes; at the
        backward's last bucket, end the step (``step_bytes``, the compute clock) and tell the reporter."""
        changed = ended = False
        with self.lock:
            for level, nbytes in sent:
                s = self.counters[level]
                s.allreduces += 1
                s.bytes += nbytes
            self._step_acc += size
            if last_bucket:
                changed = self._step_acc != self.step_bytes or size != self.tail_bytes
                self.step_bytes, self.tail_bytes, self._step_acc = self._step_acc, size, 0
                self.clock.step_end(time.perf_counter(), hook_waited=self.mode != "overlap")
                ended = self._finish_steps()  # (its pieces may all have completed already)
        if last_bucket:
            changed = self._agree_compute() or changed
        if self.reporter is not None:
            if changed:
                self.reporter.wake()  # the agent's job order (job_policy "shortest", "measured_intensity") may use it
            elif last_bucket and ended:
                self.reporter.step_ended()  # a new window: at once where the agent ranks by it ("slowdown")

    def _agree_compute(self) -> bool:
        """At a step's end: read the clock's all-reduce if it has completed (wait for it when the next window is
        due), and launch the next one when this rank's window is full -- at the same step on every rank. Returns
        whether the agreed compute time changed."""
        changed = False
        due = self.clock.window_due()
        if self._agreeing is not None and (due or self._agreeing[0].is_completed()):
            work, total = self._agreeing
            work.wait()
            self._agreeing = None
            with self.lock:
                changed = self.clock.agreed(int(total[0]), self.world)
        if due:
            with self.lock:
                mine = self.clock.take_window()
            total = torch.tensor([mine], dtype=torch.int64)
            self._agreeing = (dist.all_reduce(total, group=self.groups[-1], async_op=True), total)
        return changed

    def completed(self, launched: list, indexes) -> None:
        """Count the seconds from launch to now of the pieces ``indexes`` of ``launched`` (seen complete now)."""
        now = time.perf_counter()
        with self.lock:
            for i in indexes:
                level, t0, step = launched[i]
                self.counters[level].comm_s += now - t0
                self.clock.completed(step, now)
                if step in self._pending:
                    self._pending[step] -= 1
            ended = self._finish_steps()
        if ended and self.reporter is not None:
            self.reporter.step_ended()  # the step's communication has ended: a new window (job_policy "slowdown")

    def level_stats(self) -> list[dict]:
        with self.lock:
            return [dict(level=i, **vars(s)) for i, s in enumerate(self.counters)]

    def summary(self) -> dict:
        """Mode (and why), flows per level, per-level all-reduce counters, the agent link's counters."""
        link = self.link
        held = link is not None and link.connected  # the flows are registered only with an agent that answered
        # (until 2026-11-28 `flows` counted the connections found, 1 per level with no agent or one refusing this user)
        out = {"enabled": self.mode != "disabled", "mode": self.mode, "mode_reason": self.mode_reason, "job": self.job,
               "flows": {lvl: len(f) if held else 0 for lvl, f in self.flows.items()}, "levels": self.level_stats(),
               "step_bytes": self.step_bytes, "compute_s": self.clock.compute_s, "tail_bytes": self.tail_bytes,
               "window_start": self.window.start, "window_steps": self.window.steps,
               "agent": {"connected": False} if link is None else
               {"connected": link.connected, **link.counters, "last_error": link.last_error}}
        if self.deferred is not None:
            out["overlap"] = {"steps_deferred": self.deferred.steps, "flushes": self.deferred.flushes,
                              "flushed_on_use": self.deferred.flushed_on_use,
                              "averaged_on_read": self.deferred.averaged_on_read,
                              "averaged_unstepped": self.deferred.averaged_unstepped,
                              "early_parameters": len(self.deferred.early)}
        return out

    def stats(self) -> dict:
        """``summary()``: ``Handle.stats()`` without the planner's ``plan`` and ``deferred_steps`` (a ``comm_state()``
        has neither; ``overlap`` only in overlap mode). Usage: ``state.stats()["levels"]``"""
        return self.summary()

    def fallback(self, reason: str) -> None:
        """Leave overlap mode for hook mode for the rest of the run (every rank, at the same iteration)."""
        if self.require_overlap:
            raise RuntimeError(f"tensorlane: overlap mode cannot reproduce this training loop: {reason}. "
                               "Remove that idiom, or attach without require_overlap=True to run in hook mode.")
        self.mode = "hook"
        self.mode_reason = f"overlap mode fell back to hook mode: {reason}"
        if dist.get_rank() == 0:
            warnings.warn(f"tensorlane: {self.mode_reason}", stacklevel=ov.user_stacklevel())
        log.info("tensorlane: %s", self.mode_reason)

    def close(self) -> None:
        """Stop reporting, withdraw the flows and free the per-level groups (for a state made by ``comm_state()``
        call it once training is over; ``Handle.close`` calls it). Idempotent. A ``comm_state()`` closed before its
        hook ever ran warns: nothing went through the shim (Lightning on CPU without the ``CommHook`` callback)."""
        if self.groups is None and not self.closed:
            warnings.warn("tensorlane: the shim's comm hook never ran, so no all-reduce went through it and nothing "
                          "was prioritised: Lightning registers ddp_comm_hook only on CUDA; on CPU also pass "
                          "callbacks=[tensorlane.shim.lightning.CommHook(state)] to the Trainer (docs/frameworks.md)",
                          stacklevel=2)
        self.closed = True
        # DDP keeps this state for good (its comm hook, held in C++, where the garbage collector cannot follow it):
        # nothing in it may lead back to the model, or the model and its process groups are never freed
        for key in ("ddp", "module", "params", "recorder"):
            self.options.pop(key, None)
        self.order_source = None
        if self.deferred is not None:
            self.deferred.release()
        agreeing, self._agreeing = self._agreeing, None
        if agreeing is not None:  # every rank launched it at the same step: it completes (not on a dead peer)
            try:
                agreeing[0].wait(timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S))
            except RuntimeError as exc:
                log.debug("tensorlane: the compute time's last all-reduce: %s", exc)
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None
        if self.link is not None:
            self.link.close()
        groups, self.groups = self.groups or [], None
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError) as exc:  # already gone with the default group
                log.debug("tensorlane: destroying a level's group: %s", exc)


def _set_layer_levels(state: ShimState, params_in_forward_order: list, policy: str | None) -> None:
    sizes = [p.numel() * p.element_size() for p in params_in_forward_order]
    lv = parameter_levels(sizes, state.levels, policy or "layer_order")
    state.param_level = {id(p): level for p, level in zip(params_in_forward_order, lv, strict=True)}
    state.forward_index = {id(p): i for i, p in enumerate(params_in_forward_order)}


def priority_hook(state: ShimState, bucket, counted: bool = False):
    """DDP comm hook: average the bucket with one all-reduce per level piece, all launched at once.

    Usage: ``ddp.register_comm_hook(state, priority_hook)`` (state from ``attach`` or ``comm_state()``)
    """
    if bucket.index() == 0 and _join_divides_by_active(state):  # (DDP launches bucket 0 first, on every rank)
        raise RuntimeError(f"tensorlane: {JOIN_ACTIVE}")
    if not counted:
        _count_backward(state, bucket)
    if state.closed:
        return _after_close(state, bucket)
    if state.groups is None:
        state.start()
    _plan_due(state, bucket)
    if state.order_source is not None:
        _learn_order(state, bucket)
    buf = bucket.buffer()
    buf.mul_(1.0 / state.world)  # as DDP scales each gradient (a division rounds differently at 3 ranks)
    futures, _, launched = state.launch(buf, bucket.parameters(), bucket.is_last())

    def finished(fut):  # one callback per bucket (DDP needs the bucket's future anyway)
        for piece in _piece_value(fut):  # (collect_all may complete without error when a piece failed, a peer gone:
            _piece_value(piece)  # its error is raised here, and DDP's backward raises it, instead of a step on
        state.completed(launched, range(len(launched)))  # unaveraged gradients (until 2026-11-28, silently)
        return fut.value()[0].value()[0] if buf.is_sparse else buf  # a sparse all-reduce's result is new
    return torch.futures.collect_all(futures).then(finished)


CLOSED_APART = ("A peer process ended, or a rank's handle was closed at another point of training than this one's: "
                "from its close() on, a rank all-reduces its buckets on DDP's own process group and no longer on the "
                "shim's, which it destroys. Every rank must close at the same iteration: have a watchdog only set a "
                "flag, agree on it between two iterations (all_reduce with MAX) and call close() on the training "
                "thread of every rank there (docs/shim.md)")


AFTER_CLOSE = "DDP's own process group after close()"  # (where a failed all-reduce ran, for _piece_value's error)


def _piece_value(fut, wait: bool = False, where: str = "the shim's per-level process groups"):
    """The value of a piece's all-reduce on a level's group (``wait``: waited for first); its failure (gloo's
    "Connection closed by peer" when a peer destroyed the shim's groups at its close()) raised with its likely cause."""
    try:
        return fut.wait() if wait else fut.value()
    except RuntimeError as exc:
        if str(exc).startswith("tensorlane"):
            raise
        raise RuntimeError(f"tensorlane: an all-reduce on {where} failed ({exc}). {CLOSED_APART}") from exc


def _count_backward(state: ShimState, bucket) -> None:
    """Count a synchronized backward at its first bucket (DDP launches bucket 0 first, on every rank)."""
    if bucket.index() == 0:
        state.backwards += 1


def _after_close(state: ShimState, bucket):
    """After ``close()``: the hook of a later ``attach`` to the same DDP model (DDP keeps the first hook for good, so
    a new attach, with a new optimizer, chains its state to the closed one), or else DDP's own all-reduce."""
    if state.successor is not None:
        later, hook = state.successor
        return hook(later, bucket)
    if state.copied and not state.copy_warned:  # (a framework that deep-copied comm_state() and trains with the copy)
        state.copy_warned = True
        warnings.warn("tensorlane: a deep copy of the shim's state (copy.deepcopy of shim.comm_state(), or of a DDP "
                      "model after attach) is the comm hook of a model being trained: its all-reduces are DDP's "
                      "own, without priority (the copy holds no process groups). Make the state with "
                      "shim.comm_state() in the process that trains, and do not copy it", stacklevel=2)
    return _plain_allreduce(state, bucket)


def _plain_allreduce(state: ShimState, bucket):
    """After ``close()``: DDP's own all-reduce of the bucket on its process group (DDP keeps a hook for good), after
    a check that every rank all-reduces the same bucket of the same synchronized backward there: a small all-reduce
    (MAX) of (backward, bucket, size) and their negatives, launched before the bucket's, so that both meet their
    partners in the same order. Ranks that closed at different points (a watchdog's close() on one rank, another's
    an iteration later) would pair one rank's bucket with another bucket or iteration of the other's, of the same
    size: a silently wrong average (2.8e-5 off DDP at 2 ranks, docs/shim.md); their backward raises instead.
    Only the buckets of the first such backward are checked: ranks whose first buckets there paired one for one closed
    at the same point, and from then on meet as under DDP (a check every bucket of the rest of the run, until
    2026-11-28, doubled the all-reduces of a run that went on as plain DDP)."""
    buf = bucket.buffer().mul_(1.0 / dist.get_world_size())  # as DDP scales (1/world: not a division)
    backward, index, size = state.backwards, bucket.index(), buf.numel()
    if getattr(state, "paired_in", None) is None:
        state.paired_in = backward
    if backward != state.paired_in:
        return dist.all_reduce(buf, async_op=True).get_future().then(
            lambda fut: _piece_value(fut, where=AFTER_CLOSE)[0])
    mine = torch.tensor([backward, index, size], dtype=torch.float64)
    seen = torch.cat([mine, -mine])
    check = dist.all_reduce(seen, op=dist.ReduceOp.MAX, async_op=True).get_future()
    work = dist.all_reduce(buf, async_op=True).get_future()

    def paired(fut):
        _check, averaged = (_piece_value(part, where=AFTER_CLOSE) for part in _piece_value(fut, where=AFTER_CLOSE))
        high, low = seen[:3], -seen[3:]
        if not torch.equal(high, low):
            lo, hi = [int(v) for v in low.tolist()], [int(v) for v in high.tolist()]
            raise RuntimeError(
                f"tensorlane: this rank's all-reduce of bucket {index} of synchronized backward {backward} "
                f"({size} elements) on DDP's own process group, after close(), met another rank's of another bucket "
                f"or backward (backwards {lo[0]} to {hi[0]}, buckets {lo[1]} to {hi[1]}, {lo[2]} to {hi[2]} "
                f"elements): its average would be wrong, so this backward raises (.grad is not DDP's average). "
                f"{CLOSED_APART}")
        return averaged[0]  # (buf; a sparse all-reduce's result is new)
    return torch.futures.collect_all([check, work]).then(paired)


def _learn_order(state: ShimState, bucket) -> None:
    """comm_state() without a module: levels from the order DDP's rebuilt buckets become ready (the reverse of
    the forward order), learnt in the second synchronized backward and used from its last bucket on; until then
    every piece goes at the last level. The same on every rank (DDP's buckets are)."""
    src = state.order_source
    if bucket.index() == 0:
        src.append([])
    src[-1].extend(bucket.parameters())
    if bucket.is_last() and len(src) >= 2:
        _set_layer_levels(state, list(reversed(src[-1])), state.options.get("policy"))
        state.order_source = None


def overlap_hook(state: ShimState, bucket):
    """DDP comm hook of overlap mode: launch the pieces on a copy of the bucket and return at once (while the
    first iteration probes the loop, and after a fall-back, it is ``priority_hook``).

    Usage: ``ddp.register_comm_hook(state, overlap_hook)`` (``attach(model, optimizer)`` does it)
    """
    d = state.deferred
    if bucket.index() == 0 and _join_divides_by_active(state):
        raise RuntimeError(f"tensorlane: {JOIN_ACTIVE}")
    _count_backward(state, bucket)
    if state.closed:
        return _after_close(state, bucket)
    _plan_due(state, bucket)
    if bucket.index() == 0 and state.mode != "hook" and _joining(state):  # DDP launches bucket 0 first
        if state.mode == "overlap":  # every step so far was exact; the next one could not be
            raise RuntimeError(f"tensorlane overlap mode: {ov.JOIN}. join() was entered after overlap mode had "
                               "started; enter it around the whole loop from the first iteration (overlap mode "
                               "then falls back to hook mode), or attach without the optimizer (hook mode).")
        state.fallback(ov.JOIN)  # probing: this iteration runs as hook mode anyway
    if bucket.index() == 0 and state.mode == "probing" and d.probe.backwards > 0:
        _decide(state)  # a collective, at the same bucket of the same backward on every rank
    if bucket.buffer().is_sparse:
        if state.mode == "overlap":  # a guard: DDP refuses an iteration that leaves a sparse parameter unused
            # ("Expected sparse gradient to be defined", torch 2.13), so the probe sees every one; no step differs
            raise RuntimeError(f"tensorlane overlap mode: {ov.SPARSE}; the first sparse gradient appeared after "
                               "overlap mode had started. Attach without the optimizer (hook mode) for this model.")
        d.probe.sparse = True  # probing: this iteration runs as hook mode anyway
    if state.mode == "probing":
        d.bucketed.update(id(p) for p in bucket.parameters())
    fut = priority_hook(state, bucket, counted=True) if state.mode != "overlap" else _launch_deferred(state, bucket)
    if bucket.is_last() and state.mode != "hook":
        params = state.options["params"]
        probing = state.mode == "probing"
        ov.after_backward_callback(lambda: d.after_backward(params, probing))
    return fut


def _ddp_of(state: ShimState):
    """The DDP model of ``attach`` (None for a state of ``comm_state()``, or once closed)."""
    ddp = state.options.get("ddp")
    ref = state.options.get("ddp_ref")
    return ddp if ddp is not None or ref is None else ref()


def _joining(state: ShimState) -> bool:
    """Whether the DDP model runs inside an enabled ``join()`` (``torch.distributed.algorithms.Join`` sets its
    ``_join_config`` on every rank when the context is made)."""
    cfg = getattr(_ddp_of(state), "_join_config", None)
    return bool(getattr(cfg, "enable", False))


JOIN_ACTIVE = ("DDP's join(divide_by_initial_world_size=False): once a rank has joined, plain DDP divides each "
               "gradient by the number of ranks still training, which it does only without a communication hook "
               "(any hook, the shim's as DDP's own, gets the bucket undivided, and cannot know that number); the shim "
               "divides by the world size, so the steps after the first rank joins would differ from plain DDP's. "
               "Nothing has been all-reduced in this iteration. Use join() with divide_by_initial_world_size=True (the "
               "default), or do not attach")


def _join_divides_by_active(state: ShimState) -> bool:
    """Whether the DDP model runs inside a ``join(divide_by_initial_world_size=False)`` that can go on after a rank
    has joined (``throw_on_early_termination=False``): plain DDP then divides by the ranks not joined yet."""
    ddp = _ddp_of(state)
    cfg = getattr(ddp, "_join_config", None)
    return bool(getattr(cfg, "enable", False)) and not getattr(cfg, "throw_on_early_termination", False) \
        and getattr(ddp, "_divide_by_initial_world_size", True) is False


def _decide(state: ShimState) -> None:
    """End of a probe iteration: agree over the ranks on what they saw, then overlap, hook mode, or go on probing
    (no rank has called step() after a synchronized backward yet: GradScaler skips, accumulation)."""
    d = state.deferred
    pr = d.probe
    held = {id(p) for g in d.optimizer.param_groups for p in g["params"]}
    flags = torch.tensor([0.0 if pr.stepped else 1.0, float(pr.grads_changed), float(pr.closure),
                          float(pr.sparse), float(bool(d.bucketed - held)), float(ov.step_hooks(d.optimizer) > 0),
                          float(pr.compiled), float(ov.coupled_steps(d.optimizer)), float(pr.grads_read),
                          float(pr.random and not pr.closure), float(pr.group_written), float(pr.parts_differ)],
                         dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=state.groups[0])
    not_stepped, changed, closure, sparse, unoptimized, hooks, compiled, coupled, read, random, written, parts = \
        (v > 0 for v in flags.tolist())
    reasons = ((ov.GRADS_CHANGED, changed), (ov.CLOSURE, closure), (ov.SPARSE, sparse),
               (ov.UNOPTIMIZED, unoptimized), (ov.STEP_HOOKS, hooks), (ov.COMPILED, compiled), (ov.COUPLED, coupled),
               (ov.GRADS_READ, read and not changed),  # (a change reads them too: one reason is enough)
               (ov.RANDOM, random), (ov.GROUP_WRITTEN, written),
               (ov.PARTS_DIFFER, parts and not (random or written)))  # (those differ in parts too: one reason)
    if any(f for _r, f in reasons):
        state.fallback("; ".join(r for r, f in reasons if f))
    elif not not_stepped:
        state.mode = "overlap"
        state.mode_reason = "the first iteration showed a loop that overlap mode reproduces exactly"
        # from here on only the parameters DDP all-reduces need watching (and those trainable now, as before): a
        # parameter frozen when DDP was made (the base weights of a LoRA fine-tuning) costs nothing per iteration
        state.options["params"] = [p for p in state.options["params"] if id(p) in d.bucketed or p.requires_grad]
    elif pr.backwards >= PROBE_MAX_BACKWARDS:
        state.fallback(f"optimizer.step() was not seen in {pr.backwards} synchronized iterations (a framework "
                       "calls the optimizer's original step, or GradScaler skipped every step)")


def _graph_task() -> int:
    """The autograd graph task running on this thread (-1: none). torch's own id (``torch._C._current_graph_task_id``,
    torch 2.13); -1 where a torch lacks it, so a ``close()`` inside a backward then runs at once, as before
    2026-11-28. Usage: ``if _graph_task() != -1: ...``"""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else current()


def _launch_deferred(state: ShimState, bucket):
    """Overlap mode's bucket: launch its pieces on a copy and return DDP's own buffer at once (its step deferred).
    Under ``apply_lock``, where a ``close()`` on another thread decides whether a backward is running
    (``Handle._await_backward``): once one has begun, the bucket is DDP's own all-reduce."""
    d = state.deferred
    with d.locked():
        if d.closing:
            return _after_close(state, bucket)
        d.backward_task = _graph_task()  # (until after_backward: a close() in it, or on another thread, waits for it)
        d.backward_thread = threading.get_ident()
        return _launch_locked(state, bucket)


def _launch_locked(state: ShimState, bucket):
    """:func:`_launch_deferred`'s work, under ``apply_lock``."""
    d = state.deferred
    params = list(bucket.parameters())
    for p in params:
        pend = d.pending.get(id(p))
        if pend is None or id(p) in pend.applied:
            continue
        if pend.hparams is None:  # no step() after the last backward: as under DDP, the gradient (still in
            ov.check_unstepped(pend, p)  # .grad) accumulates and is all-reduced again with this one
            pend.applied.add(id(p))
            d.pending.pop(id(p), None)
        elif id(p) in d.got_grad:
            raise RuntimeError(f"tensorlane overlap mode: a parameter (shape {tuple(p.shape)}) was used in this "
                               "forward pass before its step was applied: it is used outside the forward of the "
                               "module that holds it, and was not so in the first iteration. Use hook mode "
                               "(shim.attach without optimizer) for this model.")
        else:  # stamped, but its module did not run forward: its gradient is final, take the step now
            _apply(state, p)
    buf = bucket.buffer().mul(1.0 / state.world)  # a copy, which the all-reduce owns until it completes
    futures, pieces, launched = state.launch(buf, params, bucket.is_last())
    pend, offset = ov.Pending(futures, buf, [], launched), 0
    for p in params:
        n, nb = p.numel(), _bucket_numel(p, buf)
        covering = tuple(i for i, (o, length, _) in enumerate(pieces) if o < offset + nb and o + length > offset)
        pend.params.append((p, offset, n, covering))
        pend.created[id(p)] = p._version
        d.pending[id(p)] = pend
        offset += nb
    d.unstamped.append(pend)
    d.launched_now.append(pend)  # (until after_backward, which runs once DDP's last bucket was ready)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _drop_unfinished(state: ShimState) -> None:
    """Overlap mode, outside a backward: where the last synchronized backward never had DDP's last bucket ready (a
    parameter DDP all-reduces got no gradient: frozen by ``requires_grad_(False)`` mid-run, or unused, without
    ``find_unused_parameters=True``), DDP never finalized it: ``.grad`` keeps this rank's own gradient, the loop's
    ``step()`` takes it, and DDP raises at the next forward ("Expected to have finished reduction in the prior
    iteration"). Drop that backward's pending averages (``Deferred.launched_now``, which ``after_backward`` empties
    once a backward is complete), so that ``.grad`` stays as DDP has it and ``step()`` takes the optimizer's own step
    now, as after a ``no_sync()`` backward. Until 2026-11-28 they stayed pending: the step took the averages of the
    buckets that were ready, and the parameters at DDP's error (an emergency checkpoint) were 2.5e-3 off DDP's at 2
    ranks, silently (idiom ``freeze_without_find_unused``). Called with ``apply_lock`` held."""
    d = state.deferred
    if not d.launched_now or _graph_task() != -1:
        return
    dropped = d.launched_now
    for pend in dropped:
        for p, *_ in pend.params:
            if d.pending.get(id(p)) is pend:
                del d.pending[id(p)]
    d.unstamped = [q for q in d.unstamped if not any(q is pend for pend in dropped)]
    if (later := d.backward_over()) is not None:  # (a close() on another thread waits for it: run once the lock
        d.close_later = later  # is left)


def _grad_view(buffer, p, offset):
    """``p``'s gradient in a copy of DDP's bucket, laid out as DDP lays it there: in the parameter's own memory
    order where it is dense and non-overlapping (``channels_last``, a transposed parameter), row-major otherwise;
    a complex parameter as two reals per element."""
    flat = buffer.narrow(0, offset, _bucket_numel(p, buffer))
    if p.is_complex() and not buffer.is_complex():
        flat = torch.view_as_complex(flat.view(-1, 2))
    if _dense(p):
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset())
    return flat.view(p.shape)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def uncut(buf: torch.Tensor, world: int) -> bool:
    """Whether a bucket goes as one all-reduce, whole, at its most urgent parameter's level: a 16-bit floating one at
    3 or more ranks. Gloo sums each element in an order set by its place in the buffer it all-reduces (at 2 ranks
    every order gives the same sum), so a piece's elements are summed in another order than in DDP's whole bucket.
    In fp32 that is a last-bit difference (docs/shim.md, Tests); in bf16 each step's averaged gradient is one bf16
    rounding (0.4 %) off: until 2026-11-28 a model trained in bf16 ended 1.1e-2 relative off DDP after 8 SGD steps at
    3 ranks, silently, in both modes (idiom ``bf16_parameters``)."""
    return world > 2 and buf.dtype in LOW_PRECISION


def sent_whole(model, world: int) -> bool:
    """Whether every bucket of ``model`` goes uncut (:func:`uncut`): each trained parameter 16-bit, 3 or more ranks.
    The planner then plans levels for whole buckets; a model of mixed dtypes is planned as cut (its fp32 buckets
    are, and the planner's buckets are not split by dtype). Usage: ``plan_shim(..., whole=sent_whole(ddp, 4))``"""
    trained = [p for p in model.parameters() if p.requires_grad]
    return world > 2 and bool(trained) and all(p.dtype in LOW_PRECISION for p in trained)


def _bucket_numel(p, buffer) -> int:
    """How many of ``buffer``'s elements ``p``'s gradient takes in DDP's bucket: a complex parameter's two reals each
    where the bucket is real."""
    return p.numel() * (2 if p.is_complex() and not buffer.is_complex() else 1)


def _dense(t) -> bool:
    """Whether ``t``'s elements fill its memory without overlap, in some order of its dimensions (DDP's reducer
    then gives its gradient the same strides)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _apply(state: ShimState, param) -> bool:
    """Wait for the pieces holding ``param``, then take the stamped optimizer step of every parameter of its
    bucket whose pieces have all completed by then (``param`` among them; the others are not waited for).
    Nothing happens before the user's ``step()`` stamped the bucket. Returns whether a step was taken. One thread
    at a time (``apply_lock``): until 2026-11-28 two threads that left the wait together could both find the same
    parameters not yet applied and both step them (``tests/test_shim.py::
    test_two_threads_applying_one_pending_step_take_it_once``)."""
    with state.deferred.locked():
        return _apply_locked(state, param)


def _apply_locked(state: ShimState, param) -> bool:
    """:func:`_apply`'s work, under the deferred steps' ``apply_lock``."""
    d = state.deferred
    pend = d.pending.get(id(param))
    if pend is None or id(param) in pend.applied:
        d.pending.pop(id(param), None)
        return False
    if pend.hparams is None:  # step() not called for it yet: DDP has not updated it either
        ov.check_unstepped(pend, param)
        return False
    covering = next(c for p, _o, _n, c in pend.params if p is param)
    done = _wait(state, pend, covering)
    ready = [(p, o, n) for p, o, n, covering in pend.params
             if id(p) not in pend.applied and all(done[i] for i in covering)]
    for p, _o, _n in ready:
        if p._version != pend.versions.get(id(p), p._version):
            raise RuntimeError(f"tensorlane overlap mode: a parameter (shape {tuple(p.shape)}) was changed in "
                               "place between optimizer.step() and the next forward, where the shim could not "
                               "see it (another thread than the one that called step()); under DDP that change "
                               "comes after the update, which overlap mode has not applied yet. Call "
                               "handle.flush() after optimizer.step() before changing parameters, or use hook mode.")
    for p, _o, _n in ready:
        pend.applied.add(id(p))
    try:
        try:
            stepped = _step_ready(d, pend, [r for r in ready if id(r[0]) not in pend.skip])
        except BaseException as e:  # (a refusal, an interrupt in the optimizer): these updates are not taken
            d.lost = d.lost or f"{type(e).__name__}: {e}"
            raise
        if d.check is not None and not d.check.remaining and _graph_task() == -1:  # (in a backward: at step())
            _verify_parts(state)
        return stepped
    finally:
        # only now do they leave the pending set and the guard: another thread (the training thread reading the
        # weights, its flush() or forward) that finds them there waits for this lock, and so for the step. Until
        # 2026-11-28 they left before the step: that thread found nothing pending and read the weights before or
        # halfway through their update, silently (test_weights_read_while_another_thread_applies_the_step_are_updated)
        for p, _o, _n in ready:
            d.pending.pop(id(p), None)
            if d.guard is not None and d.guard.armed:
                d.guard.forget(p)
                if not d.guard.ids:  # nothing left to watch (the forward has applied every pending update)
                    d.guard.disarm()


def _guard_elsewhere(d) -> bool:
    """Whether the parameter guard is armed on another thread than this one (a validation thread started after
    ``step()``): no guard watches this thread's operations, so a forward here that uses a weight before its module
    runs (read by its parent, a momentum encoder) would read it before its update: it flushes first (every pending
    update applied)."""
    return d.guard is not None and d.guard.armed and d.guard.thread != threading.get_ident()


def refuse_lost(d) -> None:
    """Raise while a deferred update has raised where it was applied (``Deferred.lost``): it left the pending set
    untaken, so the parameters no longer follow DDP's. Until 2026-11-29 a loop that caught that error and went on
    trained without it, silently (tests/test_shim.py::
    test_a_deferred_step_that_raised_refuses_every_later_step_and_forward)."""
    if d is not None and d.lost is not None:
        raise RuntimeError(f"tensorlane overlap mode: an optimizer update applied in a forward after "
                           f"optimizer.step() raised earlier ({d.lost}), and was not taken: the parameters no longer "
                           "follow DDP's, and training on would differ from it silently. Restart from a checkpoint "
                           "saved before that error (handle.close() lets this process go on as plain DDP).")


def _verify_parts(state: ShimState) -> None:
    """The last part of a checked step (``Deferred.check``: an optimizer declared per parameter) has been applied:
    take that step once more whole, on copies (``ov.whole_step``). Where it differs from what the parts gave, put the
    whole step's parameters, state and attributes in place (DDP's, bit for bit), fall back to hook mode for the rest
    of the run and raise: the forward that applied the parts (or the backward after it, where the last part was
    applied there) ran on the parts' values, so this iteration is not DDP's and must be taken again. Until 2026-11-28
    only the probe's step was so checked, and a coupling that began later (timm's Lamb clipping by the norm of all
    gradients once it exceeds max_grad_norm) overlapped silently: 1.5e-3 relative off DDP after 8 steps at 2 ranks
    (tests/refusal_worker.py, ``parts_differ_later``)."""
    d = state.deferred
    check, d.check = d.check, None
    guard = d.guard if d.guard is not None and d.guard.armed else None
    with d.watch.paused(), guard.paused() if guard is not None else contextlib.nullcontext():
        quiet = d.stamped_state.quiet() if d.stamped_state is not None else contextlib.nullcontext()
        with quiet, ov.step_hooks_hidden(d.optimizer):  # (hooks registered since that step() were not run by it)
            differs = ov.whole_step(d.optimizer, d.orig_step, check)
            d.checked += 1
            if differs is None:
                return
            values, states, attrs = differs
            if values is not None:
                with torch.no_grad():
                    for p in check.params:
                        p.copy_(values[id(p)])
                        if states[id(p)]:
                            dict.__setitem__(d.optimizer.state, p, states[id(p)])
                        else:
                            dict.pop(d.optimizer.state, p, None)
                vars(d.optimizer).update(attrs)
    if d.unstamped:  # (the last part was applied in the next backward: its .grad made DDP's average, as in hook mode)
        _average_into_grads(state)
        d.synced = False
    try:
        state.fallback(ov.PARTS_DIFFER_LATER)
    finally:
        state.mode = "hook"
    fixed = ("the parameters, the optimizer's state and attributes have been set to that whole step's (plain DDP's)"
             if values is not None else "the whole step raised, so the parameters hold the parts' step (not DDP's)")
    raise RuntimeError(f"tensorlane overlap mode: {ov.PARTS_DIFFER_LATER}. The shim checks every step of such an "
                       f"optimizer: {fixed}, and the run goes on in hook mode, exact; the forward pass that applied "
                       "that step ran on the parts' values, so take this iteration again (or stop the run), and "
                       "declare per_parameter_optimizer=True only for an optimizer whose update of a parameter never "
                       "depends on the others")


def _step_ready(d, pend, ready: list) -> bool:
    """Take the stamped step of the parameters ``ready`` (``(param, offset, numel)``: all-reduced, not skipped) on
    their averaged gradients in ``pend.buffer``, ``.grad`` left as DDP leaves it. Returns whether there were any."""
    if not ready:
        return False
    saved = [p.grad for p, _o, _n in ready]
    for p, o, _n in ready:
        p.grad = _grad_view(pend.buffer, p, o)
    check = d.check
    if check is not None:  # (an optimizer declared per parameter: the averages kept for the step whole)
        with d.watch.paused():
            for p, _o, _n in ready:
                if id(p) in check.remaining:
                    check.grads[id(p)] = p.grad.detach().clone()
                    check.remaining.discard(id(p))
    try:
        with d.watch.paused():  # the shim's step and its copies are not the loop reading gradients
            d.step_subset([p for p, _o, _n in ready], pend.hparams, pend.autocast, pend.inference, pend.members)
    finally:
        with d.watch.paused():
            for (p, o, _n), g in zip(ready, saved, strict=True):
                was, version = pend.grads.get(id(p), (None, None))
                if g is not None and was is g and g._version == version:  # not zeroed since step(): under DDP it
                    g.copy_(_grad_view(pend.buffer, p, o))  # holds the average, and the next backward adds
                p.grad = g  # (or None after zero_grad, or zeros): it accumulates as there
    return True


def _wait(state: ShimState, pend, pieces) -> list[bool]:
    """Wait for the pieces ``pieces`` of ``pend`` (the clock counts it as waiting, not compute: shim.compute),
    count every piece of it seen complete by now; returns whether each piece has completed."""
    t0 = time.perf_counter()
    for i in pieces:
        _piece_value(pend.futures[i], wait=True)
    with state.lock:
        state.clock.waited(time.perf_counter() - t0)
    done = [fut.done() for fut in pend.futures]
    for i, ok in enumerate(done):  # the others found complete are applied too: their wait() (immediate here) is what
        if ok and i not in pieces:  # orders a CUDA stream after the collective's (done() alone does not, on NCCL)
            pend.futures[i].wait()
    seen = [i for i, ok in enumerate(done) if ok and i not in pend.timed]
    if seen:
        pend.timed.update(seen)
        state.completed(pend.launched, seen)
    return done


def _write_averages(state: ShimState, pends: list) -> bool:
    """Wait for the all-reduces of the unstamped ``pends`` and write each average into ``.grad`` where it still holds
    what DDP wrote at the last synchronized backward (as marked); their pending steps are dropped. Returns whether
    any parameter was still pending."""
    d = state.deferred
    marked = {id(p): (g, version) for p, g, version in d.marks}
    live = False
    with d.watch.paused():
        for pend in pends:
            mine = [(p, o) for p, o, _n, _c in pend.params if d.pending.get(id(p)) is pend]
            if not mine:  # (a backward's buckets that a later backward all-reduced again)
                continue
            live = True
            _wait(state, pend, range(len(pend.futures)))
            for p, o in mine:
                g, version = marked.get(id(p), (None, None))
                if g is not None and p.grad is g and g._version == version:
                    g.copy_(_grad_view(pend.buffer, p, o))
                pend.applied.add(id(p))
                d.pending.pop(id(p), None)
    return live


def _average_into_grads(state: ShimState) -> bool:
    """Overlap mode, a read of the gradients between backward() and step(): wait for this iteration's all-reduces
    and write the averages into ``.grad`` (``_write_averages``), so that the loop reads what DDP's reads; ``step()``
    then takes the optimizer's own step on ``.grad`` (``Deferred.step_synced``), so a change the loop makes next
    (clipping) acts as under DDP. Returns whether anything was pending."""
    d = state.deferred
    with d.locked():  # (one thread at a time: a fork's on another thread, the training thread's step() or read)
        live = _write_averages(state, d.unstamped)
        d.unstamped = []
        d.synced = d.synced or live
    return live


def _average_unstepped(state: ShimState) -> None:
    """Overlap mode, the first gradient of a backward that follows a synchronized backward no ``step()`` followed
    (accumulation without ``no_sync``, a step skipped with the gradients kept): under DDP ``.grad`` holds the
    average by now and the new gradient adds to it, so write the averages first (``_write_averages``), before any
    gradient of this backward accumulates. ``step()`` then takes the optimizer's own step if this backward is not
    synchronized (``no_sync``); a synchronized one all-reduces the sum and defers its step as usual. Under
    ``apply_lock``: another thread making ``.grad`` DDP's average meanwhile (an ``os.fork()`` there) does so first,
    and this hook then finds nothing left (until 2026-11-28 both wrote, and that thread's write could land after this
    backward's gradient had accumulated, dropping it, silently: 7.6e-2 off; and it dropped this backward's buckets
    from the step: tests/test_shim.py::
    test_backward_while_a_fork_on_another_thread_averages_the_unstepped_gradients_keeps_them)."""
    d = state.deferred
    with d.locked():
        stale = [pend for pend in d.previous if any(pend is q for q in d.unstamped)]
        d.previous = []
        if state.mode != "overlap" or not stale:
            return
        for pend in stale:
            for p, *_ in pend.params:
                if d.pending.get(id(p)) is pend:
                    ov.check_unstepped(pend, p)
        d.unstamped = [q for q in d.unstamped if not any(q is pend for pend in stale)]
        if _write_averages(state, stale):
            d.synced = True
            d.averaged_unstepped += 1
            d.watch.unwatch()  # .grad holds DDP's averages now


COMPILED_WRAPPER = (
    "tensorlane: {what} is refused while the shim has hooks on the model's modules{why}: a module with a hook is one "
    "dynamo compiles as a graph of its own where plain DDP compiles it with the rest or not at all, and with inductor "
    "(the default backend) training then differed from plain DDP by float rounding, silently (2.4e-7 on a loss after "
    "8 Adam steps at 2 ranks, 2026-11-27). Nothing of this forward has run. Wrap a compiled module in DDP instead, "
    "which was exact: DDP(torch.compile(module)), then attach{alt}")


class _CompiledWrapper:
    """Refuses ``torch.compile(ddp)`` and a module of the DDP model compiled in place (``ddp.module.compile()``)
    at the first forward, before the model computes anything. ``mark`` is a forward pre-hook on the DDP model that
    dynamo traces (it is not disabled) when the DDP model is being compiled, and it then sets ``seen``, a write that
    dynamo replays when the compiled code runs; ``refuse``, a disabled pre-hook (``ov.ModuleHook``) right behind it,
    runs eagerly and raises. Eagerly, and with ``DDP(torch.compile(module))`` (the DDP model's hooks run outside
    dynamo), ``is_compiling()`` is false."""

    def __init__(self, root, why: str, alt: str):
        self.seen = False
        self.root = weakref.ref(root)
        self.why, self.alt = why, alt

    def mark(self, _module, _inputs) -> None:
        self.seen = torch.compiler.is_compiling()  # (every forward: an eager one after the error is not refused)

    def refuse(self, _module, _inputs) -> None:
        root = self.root()
        what = None
        if self.seen:
            what = "torch.compile of the DDP model itself (torch.compile(ddp), or a compiled function that calls it)"
        elif root is not None and any(getattr(m, "_compiled_call_impl", None) is not None for m in root.modules()):
            what = "a module of the DDP model compiled in place (ddp.module.compile(), or a submodule's .compile())"
        if what is not None:
            raise RuntimeError(COMPILED_WRAPPER.format(what=what, why=self.why, alt=self.alt))

    def __reduce_ex__(self, _protocol):
        """Pickling the DDP model (``torch.save(ddp_model)``) reaches this hook first: the shim's clear refusal
        (SPAWN_REFUSED), not the bare "cannot pickle 'weakref.ReferenceType' object" it was until 2026-11-28."""
        raise TypeError(SPAWN_REFUSED)

    def __deepcopy__(self, memo):  # a deep copy of the DDP model (AveragedModel(ddp_model)) copies it as before
        other = _CompiledWrapper.__new__(_CompiledWrapper)
        other.seen, other.root, other.why, other.alt = False, self.root, self.why, self.alt
        return other

    def install(self, model) -> list:
        """Put both hooks on the DDP ``model`` ahead of every other pre-hook; returns their handles."""
        refuse = model.register_forward_pre_hook(ov.ModuleHook(self.refuse), prepend=True)
        return [model.register_forward_pre_hook(self.mark, prepend=True), refuse]


class Handle:
    """What ``attach`` returns: ``close()``, ``flush()``, ``stats()``."""

    def __init__(self, model, optimizer=None, state: ShimState | None = None, disabled: bool = False):
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.disabled = disabled
        self._closed_event = threading.Event()  # set once closed, or a close() at a backward's end has raised
        self._closer: int | None = None  # the thread whose close() began (Deferred.closing set), if any
        self._hooks: list = []
        self._step_attr = None  # the function put on optimizer.step (overlap mode)
        self._own_step = None  # what optimizer.step was as an instance attribute before that, if anything
        self._class_step = None  # the optimizer class's step function at attach (overlap mode's plumbing)
        self._per_part_ok = False  # attach(per_parameter_optimizer=True): the user's step may run per part
        self._zero_grad_attr = None  # the same for optimizer.zero_grad (overlap mode: the guard pauses there)
        self._own_zero_grad = None
        self.closed = False
        self.plan: dict = {}  # what the default policy decided (shim.plan), in stats()["plan"]
        self._recorder = None  # shim.plan.Recorder while the first iteration is being measured
        self._unhooked: list = []  # overlap mode: parameters frozen at attach, without the gradient hook yet
        self._forward_watch = None  # overlap mode: ov.ForwardWatch, on the mode stack during the probe's forwards
        self._owned: dict = {}  # overlap mode: id(module) -> the parameters it held at attach (_pre_forward)
        self._load_versions: dict = {}  # overlap mode: id(param) -> its version when a load_state_dict began

    @property
    def link(self) -> AgentLink | None:
        return None if self.state is None else self.state.link

    @property
    def flows(self) -> dict:
        return {} if self.state is None else self.state.flows

    @property
    def reporter(self) -> Reporter | None:
        return None if self.state is None else self.state.reporter

    # -- overlap mode plumbing ------------------------------------------------------------------------------
    def _install_overlap(self) -> None:
        opt, root = self.optimizer, self.model.module
        # every parameter, trainable now or not: one frozen after DDP was made (a backbone frozen for a warm-up) is
        # in DDP's buckets, and once unfrozen its gradient, its deferred step and its uses are watched as the others'
        params = list(root.parameters())
        owners = [m for m in root.modules() if any(True for _ in m.parameters(recurse=False))]
        holders: dict = {}
        for m in owners:
            self._owned[id(m)] = list(m.parameters(recurse=False))
            for p in m.parameters(recurse=False):
                holders.setdefault(id(p), []).append(id(m))
        d = self.state.deferred = ov.Deferred(opt, holders)
        self.state.options["params"] = params
        self.state.options["ddp"] = self.model  # overlap_hook checks for DDP's join()
        d.orig_step = opt.step
        self._own_step = opt.__dict__.get("step")  # an LR scheduler made before attach put its wrapper there
        self._class_step = type(opt).step

        @functools.wraps(d.orig_step)  # the signature (frameworks inspect it), not the behaviour
        def step(closure=None):
            opt._opt_called = True  # what an LR scheduler's own wrapper records (it then does not warn)
            return self._user_step(closure)
        step._wrapped_by_lr_sched = True  # LR schedulers made after attach leave it as it is
        step.tensorlane_handle = weakref.ref(self)  # (attach refuses a second overlap attach of this optimizer)
        opt.step = self._step_attr = step
        def state_tensors(p):  # (dict.get: not a use of optimizer.state, which would flush)
            st = dict.get(opt.state, p)
            return [v for v in st.values() if isinstance(v, torch.Tensor)] if st else []
        d.guard = ov.UseGuard(self._flush_on_use, state_tensors)
        d.watch.on_read = self._grads_read  # (release() gives it back its own: the state outlives the handle)
        d.watch.on_compiled = self._grads_compiled
        self._own_zero_grad = opt.__dict__.get("zero_grad")
        zero_grad_of = opt.zero_grad

        @functools.wraps(zero_grad_of)  # Accelerate reads its signature (set_to_none)
        def zero_grad(*args, **kwargs):  # touches .grad only: the guard need not see each of its operations
            with d.guard.paused(), d.watch.paused():
                return zero_grad_of(*args, **kwargs)
        opt.zero_grad = self._zero_grad_attr = zero_grad
        hook = ov.ModuleHook  # a copy of a module (an EMA model, a snapshot) gets inert hooks, not the shim
        # ahead of the user's own pre-hooks (pruning's mask, weight_norm): they must see the updated weights
        # on every module, those without parameters of their own too: a forward of a submodule alone on another
        # thread than the one whose guard watches (a feature extractor on a monitoring thread) applies every pending
        # update first at its first module (_pre_forward), before that module's code reads a child's weight
        for m in root.modules():
            self._hooks.append(m.register_forward_pre_hook(hook(self._pre_forward), prepend=True))
        self._hooks.append(root.register_forward_pre_hook(hook(self._root_pre_forward), prepend=True))
        self._hooks.append(self.model.register_forward_pre_hook(hook(self._end_grad_watch), prepend=True))
        self._hooks.append(self.model.register_forward_hook(hook(self._watch_grads)))
        self._hooks.append(root.register_forward_hook(hook(self._rearm_guard)))
        # the probe's forward: parameters used before their module's forward (not where torch.compile runs modules:
        # a mode on the stack changes what dynamo runs in that forward, and there every parameter is applied early)
        if not any(hasattr(m, "_orig_mod") for m in root.modules()):
            self._forward_watch = ov.ForwardWatch(d)
            self._hooks.append(root.register_forward_hook(hook(self._end_forward_watch)))
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._grad_seen(p)))
            else:  # (a tensor hook needs requires_grad): hooked once it is unfrozen, at a forward
                self._unhooked.append(p)
        # torch.compile(ddp): refused at its first forward (the module hooks above change what dynamo compiles)
        self._hooks.extend(_CompiledWrapper(root, " (overlap mode's pre-hooks)", "").install(self.model))
        flush = hook(self._flush_hook)
        for m in [self.model, *owners] if root in owners else [self.model, root, *owners]:
            self._hooks.append(m.register_state_dict_pre_hook(flush))
            self._hooks.append(m.register_load_state_dict_pre_hook(hook(self._loading)))
            self._hooks.append(m.register_load_state_dict_post_hook(hook(self._loaded)))
        self._hooks.append(opt.register_state_dict_pre_hook(flush))
        self._hooks.append(opt.register_load_state_dict_pre_hook(flush))
        self._hooks.append(opt.register_load_state_dict_post_hook(hook(self._rewatch)))  # a new state dict
        d.on_state_use = self._flush_hook
        me = weakref.ref(self)  # the global hook must not keep a handle (and its model) alive

        def other_step(optimizer, args, kwargs):
            handle = me()
            if handle is not None:
                handle._other_step(optimizer, args, kwargs)
        other_step.tensorlane = True  # not a user's step hook (ov.step_hooks)
        self._hooks.append(torch_optimizer.register_optimizer_step_pre_hook(other_step))

    def _put_back(self, name: str, ours, own) -> None:
        """Restore the optimizer's ``name`` if it is still the function the shim put there: the instance attribute
        it had before (``own``), or none, so that the class's method is back."""
        if ours is not None and self.optimizer.__dict__.get(name) is ours:
            if own is None:
                delattr(self.optimizer, name)
            else:
                setattr(self.optimizer, name, own)

    def _grad_seen(self, p):
        """A hook on ``p``'s gradient, before it accumulates: notes it, and at a backward that follows one no
        ``step()`` did, first makes ``.grad`` DDP's average (``_average_unstepped``)."""
        key, state = id(p), self.state
        d = state.deferred
        seen = d.got_grad

        def hook(_grad):
            seen.add(key)
            if d.previous:
                _average_unstepped(state)
        return hook

    def _flush_hook(self, *_args, **_kwargs) -> None:
        self.flush()

    def _loading(self, module, *_args) -> None:
        """A module's ``load_state_dict`` begins: apply what is stamped (a flush), and note its own parameters'
        versions (``_loaded`` tells the load's writes from others)."""
        self.flush()
        self._load_versions.update({id(p): p._version for p in module.parameters(recurse=False)})

    def _loaded(self, module, _incompatible) -> None:
        """A module's ``load_state_dict`` has ended: its parameters it wrote are the user's values, not a step taken
        around the shim (``ov.loaded``)."""
        d = None if self.state is None else self.state.deferred
        own = list(module.parameters(recurse=False))
        if d is not None and not self.closed:
            ov.loaded(d, own, self._load_versions)
        for p in own:
            self._load_versions.pop(id(p), None)

    def _rewatch(self, *_args) -> None:
        """After ``optimizer.load_state_dict`` (which replaces ``optimizer.state``): watch the new state."""
        d = self.state.deferred
        if d is not None and d.stamped_state is not None:
            d.stamped_state = d.watch_state()

    def _other_step(self, optimizer, _args, _kwargs) -> None:
        """A global step pre-hook: another optimizer about to step parameters that DDP all-reduces, in overlap
        mode, would use this rank's own gradient (not DDP's average) for them: refuse before it updates anything."""
        state = self.state
        if self.closed or state is None or state.mode != "overlap" or ov.inner_optimizer(optimizer) is self.optimizer:
            return
        d = state.deferred
        if any(id(p) in d.bucketed for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(f"tensorlane overlap mode: {type(optimizer).__name__}.step() on parameters that DDP "
                               "all-reduces, with another optimizer than the one given to attach: in overlap mode "
                               "their .grad holds this rank's own gradient until the deferred step, so this update "
                               "would not be DDP's. It has not been applied. Where the loop switches to a new "
                               "optimizer, close the handle and attach that one (handle.close(); handle = "
                               "shim.attach(model, new_optimizer)) before its first step, or use hook mode "
                               "(shim.attach without optimizer).")

    def _disarm(self, *_args) -> None:
        """The inner module's forward begins (or ``close()``): pending updates are applied from here on, not by the
        guard, and ``.grad`` holds DDP's average once they are; the guard and the gradient watch leave the mode stack
        (in either order). The gradients stay watched while the last backward awaits its ``step()``."""
        d = None if self.state is None else self.state.deferred
        if d is None:
            return
        self._disarm_guard()
        self._end_grad_watch()
        self._disarm_guard()  # (below the watch a moment ago)

    def _end_grad_watch(self, *_args) -> None:
        """The DDP model's forward begins: the gradient watch leaves the mode stack. The parameter guard stays armed
        until the inner module's forward begins (``_root_pre_forward``): a forward pre-hook of the user's on the DDP
        model itself runs before that, and may use the weights (until 2026-11-27 the guard was disarmed here, and
        such a hook logging a weight norm read it before its update, silently: 3.8e-4 relative off;
        ``kept_tensors_saved_wrapper_hook``)."""
        d = None if self.state is None else self.state.deferred
        if d is None:
            return
        d.watch.pop()
        if not d.awaiting_step():
            d.watch.unwatch()

    def _rearm_guard(self, *_args) -> None:
        """The model's forward has ended with stamped updates still pending: modules it did not run (a branch that a
        validation forward skips, one unused in this iteration). Under DDP those parameters were updated at
        ``step()``, so until the next forward the guard watches them again (an EMA or a logged norm of the weights
        after the validation applies them first). Until 2026-11-27 the guard stayed off after any forward: such an
        EMA read the branch's weights before their update (2.6e-3 off after 8 steps)."""
        state = self.state
        if self.closed or state is None or state.mode != "overlap" or state.deferred.guard is None:
            return
        waiting = {id(p) for _pend, p, _c in state.deferred.stamped_params()}
        left = [p for p in state.options["params"] if id(p) in waiting]
        if left:
            state.deferred.guard.arm(left)

    def _disarm_guard(self) -> None:
        """Stop the parameter guard (a flush's own uses of the parameters are not the loop's)."""
        d = None if self.state is None else self.state.deferred
        if d is not None and d.guard is not None:
            d.guard.disarm()

    def _watch_grads(self, *_args) -> None:
        """The model's forward has ended: watch the loop's use of the gradients until the next one (probing and
        overlap mode)."""
        if self.state.mode in ("probing", "overlap") and not self.closed:
            d = self.state.deferred
            d.watch = ov.watching_here(d.watch)
            d.watch.push()

    def _grads_read(self) -> None:
        """The gradient watch saw the loop read a gradient DDP wrote: while probing, note it (the probe falls back to
        hook mode); in overlap mode, give ``.grad`` DDP's average before the read proceeds."""
        if self.closed or self.state is None:
            return
        if self.state.mode == "probing":
            self.state.deferred.note_read()
        elif self.state.mode == "overlap":
            self._average_on_read()

    def _grads_compiled(self) -> None:
        """A compiled function or module is called while the gradient watch holds gradients DDP wrote: it may read
        them, unseen (``ov.CompiledCalls``). In overlap mode ``.grad`` becomes DDP's average first (as on a read);
        while probing it is DDP's average already (the probe steps as hook mode), and no read is noted."""
        if not self.closed and self.state is not None and self.state.mode == "overlap":
            self._average_on_read()

    def _average_on_read(self) -> None:
        """Overlap mode, a read of ``.grad`` after the probe: after ``step()``, apply the stamped updates (a flush,
        which leaves the average in ``.grad``, as DDP's step does); before it, wait for this iteration's all-reduces
        and write the averages (``_average_into_grads``). Exact; that iteration does not overlap."""
        d = self.state.deferred
        stamped = next(d.buckets(stamped=True), None) is not None
        if stamped:
            self.flush()
        if not (_average_into_grads(self.state) or stamped):
            return
        self._lost_overlap("averaged_on_read", "the loop read gradients after backward() (a logged norm, a check, "
                           "clipping) in a later iteration than the first; the iteration's all-reduces were waited "
                           "for and .grad made DDP's average first, as under DDP")

    def _flush_on_use(self) -> None:
        """A parameter whose update is pending was used after step() (the guard saw it): apply every update first."""
        self.flush()
        self._lost_overlap("flushed_on_use", _USE_CAUSES[ov.cause()])

    def _lost_overlap(self, counter: str, what: str) -> None:
        """Count an iteration that gave up its overlap to stay exact (``stats()['overlap'][counter]``), and warn
        once, saying ``what`` happened."""
        d = self.state.deferred
        setattr(d, counter, getattr(d, counter) + 1)
        if getattr(d, counter) == 1:
            warnings.warn(f"tensorlane overlap mode: {what}, so that iteration's all-reduces did not overlap the "
                          f"next forward (stats()['overlap']['{counter}'] counts such iterations)",
                          stacklevel=ov.user_stacklevel())

    def _class_step_replaced(self) -> None:
        """The optimizer's class had its ``step`` replaced after attach (``torch.optim.SGD.step = wrapper``): under
        DDP ``optimizer.step()`` calls the new function from now on, unless an instance attribute (an LR
        scheduler's wrapper, made before attach) holds the old one. Hook mode calls it too; overlap mode, which
        would call it once per part, refuses before it runs (until 2026-11-27 both called the old one, silently)."""
        opt, d = self.optimizer, self.state.deferred
        if self._own_step is not None:  # torch's LR scheduler wrapper calls the function it wrapped, as under DDP
            self._class_step = type(opt).step
            return
        if self.closed or self.state.mode == "hook" or self._per_part_ok or not ov.class_step_wrapped(type(opt)):
            self._class_step = type(opt).step
            d.orig_step = self._class_step.__get__(opt, type(opt))
            return
        # (not taken as seen: every step() refuses while it is so; until 2026-11-27 a loop that caught the refusal
        # and stepped again went on in overlap mode with the old step, not the one DDP calls: silently 1.4e-2 off)
        raise RuntimeError(
            f"tensorlane overlap mode: {type(opt).__name__}.step was replaced after attach by a function of the "
            "user's; overlap mode would take each step later and in parts through it, once per part, each call "
            "seeing only that part's parameters. Replace it before attach (the shim then uses hook mode), or pass "
            "per_parameter_optimizer=True to attach if it updates each parameter on its own")

    def _user_step(self, closure=None):
        """The user's ``optimizer.step()``: stamps the pending updates in overlap mode (see shim.overlap)."""
        state, d = self.state, self.state.deferred
        if type(self.optimizer).step is not self._class_step:
            self._class_step_replaced()
        if self.closed or state.mode == "hook":
            return d.orig_step() if closure is None else d.orig_step(closure)
        refuse_lost(d)
        if state.mode == "probing":
            with d.watch.paused():  # (the probe's own checks read the gradients too)
                d.probe_step(closure)
                # a declared optimizer: its step in two parts on copies first (put back as it was), compared with
                # the real step after it
                trial = ov.step_in_parts(d.optimizer, d.orig_step) if self._per_part_ok and closure is None and \
                    not ov.step_hooks(d.optimizer) else None
                rng = ov.rng_states()
                tensors = ov.group_tensors(d.optimizer.param_groups)
                versions = [t._version for t in tensors]
                out = d.orig_step() if closure is None else d.orig_step(closure)
                d.probe.random |= any(not torch.equal(a, b) for a, b in zip(rng, ov.rng_states(), strict=True))
                d.probe.group_written |= ov.written(tensors, versions)
                d.probe.parts_differ |= ov.parts_differ(trial, d.optimizer)
                return out
        # under apply_lock: another thread making .grad DDP's average meanwhile (an os.fork() there) has done so
        # first; until 2026-11-28 this step stamped the updates that thread was dropping, and was lost, silently
        # (tests/test_shim.py::test_step_while_a_fork_on_another_thread_averages_the_gradients_is_taken)
        with d.locked(), d.watch.paused():
            if d.check is not None and not d.check.remaining and not d.closing:
                _verify_parts(state)  # (its last part was applied in a backward; raises where it differs)
            if not d.closing:
                return self._stamp_locked(closure)
        self._await_close()
        return d.orig_step() if closure is None else d.orig_step(closure)

    def _await_close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """``step()`` once a ``close()`` on another thread (a watchdog) has begun: wait for it, holding no lock, up to
        ``timeout`` seconds; the optimizer's own step then takes DDP's averages, which that close wrote into ``.grad``.
        Until 2026-11-28 the step stamped the iteration's updates while that close waited for the all-reduces, and the
        close dropped them: the step was lost, silently (0.37 off DDP at 2 ranks), or it found ``.grad`` being averaged
        and refused the loop (tests/test_shim.py::test_close_on_another_thread_during_step_loses_no_step)."""
        if self._closer == threading.get_ident():  # (this thread's own close() raised midway: nothing to wait for)
            raise RuntimeError("tensorlane: optimizer.step() after a close() on this thread that raised midway (see "
                               "its error): this step has not been taken. Call close() again")
        if not self._closed_event.wait(timeout) or not self.closed:
            raise RuntimeError(f"tensorlane: optimizer.step() waited {timeout:g} s for a close() begun on another "
                               "thread, which has not closed the handle (see that thread's error); this step has not "
                               "been taken. Call close() on the training thread, between two iterations")

    def _step_hooks_registered_late(self, closure):
        """``step()`` in overlap mode with step hooks registered since overlap mode began (a callback that starts an
        EMA in a post-hook, a gradient-scale pre-hook, a logging library's global hook): under DDP they run from this
        ``step()`` on, around the optimizer's whole step. Apply the steps stamped before (without the hooks, as under
        DDP: ``ov.step_hooks_hidden``), make ``.grad`` DDP's average, go on in hook mode, and take the optimizer's own
        step now, hooks and all. Exact. Until 2026-11-29 this ``step()`` (or the forward applying the last stamped
        step, for hooks registered after that ``step()``) raised, that update not applied even by ``close()``: a loop
        DDP trains refused, its parameters one step behind DDP's at the error (6.2e-2 relative at 2 ranks,
        ``step_post_hook_late``)."""
        state, d = self.state, self.state.deferred
        self.flush()
        _average_into_grads(state)
        d.synced = False
        d.marks = []
        state.fallback(ov.STEP_HOOKS_LATE)
        return d.orig_step() if closure is None else d.orig_step(closure)

    def _stamp_locked(self, closure):
        """``_user_step``'s stamping, under ``apply_lock``, no ``close()`` begun."""
        state, d = self.state, self.state.deferred
        _drop_unfinished(state)
        if ov.step_hooks(self.optimizer):
            return self._step_hooks_registered_late(closure)
        if d.synced:  # a read made .grad DDP's average: nothing is pending, the step is DDP's own
            return d.step_synced(closure)
        if not d.unstamped and d.got_grad and not any(key in d.pending for key in d.got_grad):
            # a step after a backward DDP did not synchronize (no_sync: Accelerate's LocalSGD entered after
            # synchronized steps, post-local SGD): DDP steps on this rank's own .grad. Apply what is stamped
            # first (.grad of a parameter its forward did not apply gets the average, as under DDP), then the
            # optimizer's own step, now (until 2026-11-27 this raised, a correct loop refused)
            self.flush()
            if not d.pending:
                return d.step_synced(closure)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not d.unstamped and not d.got_grad and any(p.grad is not None for p in params):
            # a second step() with no backward since the last (torch.distributed.checkpoint's get_state_dict
            # and set_state_dict on an optimizer with no state yet, SGD without momentum: they set every .grad
            # to zeros and call step() at lr 0): DDP steps again on .grad as it is. The stamped updates applied
            # first leave there what DDP has (the average, or what the loop wrote since), so the optimizer's
            # own step, now, is DDP's (until 2026-11-28 this raised: a correct loop refused, idiom
            # dcp_get_state_dict_stateless)
            self.flush()
            if not d.pending:
                return d.step_synced(closure)
        d.stamp(params, closure)
        if d.pending:
            d.guard = ov.watching_here(d.guard)
            d.guard.arm([p for p in state.options["params"] if id(p) in d.pending])
        return None

    def _hook_unfrozen(self) -> None:
        """Give the parameters frozen at attach and trainable now the gradient hook the others got at attach. Once
        the probe is over, those DDP does not all-reduce (frozen when DDP was made: stepped at ``step()`` itself)
        need none, and in hook mode none does: they leave the list, which then costs a forward nothing."""
        state = self.state
        if state.mode == "hook":
            self._unhooked = []
            return
        bucketed = state.deferred.bucketed if state.mode == "overlap" else None
        frozen = []
        for p in self._unhooked:
            if bucketed is not None and id(p) not in bucketed:
                continue
            if p.requires_grad:
                self._hooks.append(p.register_hook(self._grad_seen(p)))
            else:
                frozen.append(p)
        self._unhooked = frozen

    def _end_forward_watch(self, *_args) -> None:
        if self._forward_watch is not None:
            self._forward_watch.pop()

    def _root_pre_forward(self, _module, _inputs) -> None:
        d = self.state.deferred
        if self.state.mode == "overlap":
            refuse_lost(d)
        guarded = self.state.mode == "overlap" and d.guard is not None and d.guard.armed
        if guarded and ov.in_jit_trace():
            self.flush()  # a torch.jit.trace of the model: the guard's frames would be in the traced graph, which the
            self._disarm()  # tracer's check then finds different from its second run; exact all the same
        elif guarded and _guard_elsewhere(d):
            # (until 2026-11-27 such a thread's outputs read the weights stale while their all-reduces were in
            # flight, silently: idiom validation_thread_reads_early)
            self.flush()
        elif guarded:
            # the guard stays armed through the forward for the parameters not applied yet: each module's pre-hook
            # applies its own (and forgets them), and a use before that, by code that is not their module (a
            # momentum encoder updated from them at the start of the forward, from an iteration after the probe on,
            # under no_grad: nothing autograd saves), applies every pending update first. Until 2026-11-27 the guard
            # left here, and such a use read the weights before their update, silently: the momentum encoder 1.9e-2
            # relative off after 8 steps (idiom momentum_encoder_after_warmup). The updates whose all-reduces have
            # completed are applied now (no wait), so that the guard, a Python call per torch operation, watches
            # only those still in flight, and leaves the mode stack once there are none
            self._end_grad_watch()
            self._apply_completed()
        else:
            self._disarm()  # also when the inner module is called directly
        if self._unhooked:
            self._hook_unfrozen()
        if self.state.mode == "probing" and self._forward_watch is not None:
            self._forward_watch.pop()  # (left by a forward that raised)
            self._forward_watch.push()
        if self.state.mode == "overlap" and d.early:
            with self._unguarded():
                for p in self.state.options["params"]:
                    if id(p) in d.early:
                        _apply(self.state, p)

    @contextlib.contextmanager
    def _unguarded(self):
        """Off the guard's mode stack while the shim applies updates in a forward (the guard stays armed there for
        the parameters not applied yet): the shim's own operations are no use of them, and cost no Python call
        each. A refusal raised there disarms the guard (what the loop does after catching it is not watched)."""
        g = self.state.deferred.guard
        try:
            with g.paused() if g is not None and g.armed else contextlib.nullcontext():
                yield
        except BaseException:
            if g is not None:
                g.disarm()
            raise

    def _apply_completed(self) -> None:
        """Apply the stamped updates whose all-reduces have all completed (none is waited for)."""
        d = self.state.deferred
        with self._unguarded():
            for pend, p, covering in d.stamped_params():
                if all(pend.futures[i].done() for i in covering):
                    _apply(self.state, p)

    def _pre_forward(self, module, _inputs) -> None:
        d = self.state.deferred
        if self.state.mode == "probing":
            d.probe.ran.add(id(module))
        elif self.state.mode == "overlap" and d.pending:
            # the parameters it held at attach, not those it holds now: torch.func.functional_call(model.module,
            # tensors) puts other tensors in their place for that forward, and where those share the parameters'
            # memory (detached aliases kept from before) the forward reads it; the guard is off by then (until
            # 2026-11-27 nothing was applied there: the outputs 9e-2 relative off, silently; idiom
            # functional_call_traced)
            if ov.in_jit_trace() and d.guard is not None and d.guard.armed:
                self.flush()  # a torch.jit.trace of a submodule: no guard in the traced graph (see _root_pre_forward)
            elif _guard_elsewhere(d):
                # a forward of this submodule alone there (the whole model's has flushed at _root_pre_forward
                # already): as for the whole model, a child's or a sibling's weight its code reads first. Until
                # 2026-11-29 only the module's own parameters were applied, and such a read took the weight before
                # its update, silently
                # (tests/test_shim.py::test_a_submodule_forward_on_another_thread_reads_updated_weights)
                self.flush()
                return
            with self._unguarded():
                for p in self._owned.get(id(module), ()):
                    _apply(self.state, p)
                for p in module.parameters(recurse=False):  # (one put there since attach: not in DDP's buckets)
                    _apply(self.state, p)

    # -- public -------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply every update whose step() was called (overlap mode): call it before reading or changing
        parameters outside a forward pass. A no-op otherwise. Usage: ``opt.step(); handle.flush(); ema.update()``"""
        d = None if self.state is None else self.state.deferred
        if not self.closed and d is not None and not d.closing:  # (close() applies what is left, and goes on)
            refuse_lost(d)
        if d is None or d.guard is None or d.guard.thread in (None, threading.get_ident()):
            self._disarm_guard()
        # (on another thread than the guard's, a validation forward or a user's flush(): the guard stays armed, so
        # that the training thread's use of a weight meanwhile waits for its update; each update applied leaves it.
        # Until 2026-11-28 that flush disarmed it first, and an EMA there read the weights before their update,
        # silently: test_weights_read_while_another_thread_applies_the_step_are_updated)
        if d is None or not d.pending:
            return
        applied = False
        for pend in d.buckets(stamped=True):
            for p, *_ in pend.params:  # (all, not stamped_params(): _apply checks one now a later bucket's)
                applied |= _apply(self.state, p)
        d.flushes += applied

    def _await_backward(self, d, timeout: float) -> bool:
        """``close()`` on a thread other than the one in a synchronized backward that launched buckets (a watchdog,
        a signal-handling thread): have the training thread close at that backward's end, once DDP has written
        ``.grad``, as for a signal handler inside it, and wait for it there, up to ``timeout`` seconds; returns True
        once closed so. Otherwise (no such backward) mark the close begun, so that a backward's bucket launched from
        now on is DDP's own all-reduce, and return False: close now. The decision is taken under ``apply_lock``, which
        the bucket's launch holds; the wait holds no lock (the training thread takes ``apply_lock`` in its backward and
        to close). Until 2026-11-28 this close ran at once, mid-backward: the averages of the buckets launched before it
        were dropped and the step took each rank's own gradient there, silently (2.2e-2 off DDP at 2 ranks,
        tests/test_shim.py::test_close_on_another_thread_during_backward_keeps_the_averages)."""
        with d.locked():
            running = d.backward_task is not None and d.backward_thread != threading.get_ident()
            if not running:  # (on the training thread, outside a backward that never ended: close now)
                d.closing, self._closer = True, threading.get_ident()
            elif d.close_after_backward is None:
                d.close_after_backward = self._close_deferred
        if not running:
            return False
        if not self._closed_event.wait(timeout):
            raise TimeoutError(f"tensorlane: close() on another thread waited {timeout:g} s for the synchronized "
                               "backward() on the training thread to end; the handle closes at that backward's end "
                               "(once DDP has written .grad). Pass a longer close(timeout=...), or call close() on "
                               "the training thread")
        if not self.closed:
            raise RuntimeError("tensorlane: close() on another thread: the close at the end of the training "
                               "thread's backward() raised there (see that thread's error); call close() again")
        return True

    def _close_deferred(self) -> None:
        """``close()`` at a backward's end for another thread's ``close()`` (``_await_backward``), which it wakes."""
        try:
            self.close()
        finally:
            self._closed_event.set()

    def _settle(self) -> None:
        """``close()``'s updates, once ``Deferred.closing`` is set: apply every stamped one, write the averages of a
        backward no ``step()`` followed into ``.grad`` and let the other all-reduces end. A ``step()`` on the training
        thread meanwhile (``close()`` on a watchdog thread) waits for the close (``_user_step``)."""
        try:
            self.flush()
        except RuntimeError as exc:  # a refusal was raised already: clean up all the same
            warnings.warn(f"tensorlane: close() dropped updates it could not apply exactly: {exc}", stacklevel=3)
        d = self.state.deferred
        if d is None:
            return
        if self.state.mode == "overlap" and d.unstamped:  # closed between backward() and step(): .grad holds
            _write_averages(self.state, d.unstamped)  # this rank's own gradient; under DDP the average, which
            d.unstamped = []  # the optimizer's own step (given back in close) then takes
        for pend in d.buckets():
            for fut in pend.futures:  # steps never asked for: let their all-reduces end before we leave
                _piece_value(fut, wait=True)
        d.pending.clear()

    def stats(self) -> dict:
        """Mode and why, flows per level, agent link counters, per-level all-reduce counts, bytes and seconds,
        and the planner's decision."""
        if self.disabled:  # every key, at nothing: a script that logs stats() runs unchanged with TENSORLANE_DISABLE=1
            return {**_disabled_state().summary(), "plan": {"policy": None}, "deferred_steps": 0}
        out = self.state.summary()
        out["plan"] = dict(self.plan)
        out["deferred_steps"] = out.get("overlap", {}).get("steps_deferred", 0)
        return out

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Apply pending updates, restore the optimizer, withdraw the flows from the agent. Idempotent. On another
        thread than the training thread while that one is in a synchronized ``backward()`` (overlap mode: a watchdog),
        it waits up to ``timeout`` seconds for that backward's end, where the training thread closes (TimeoutError
        past it, the close still due there); a ``step()`` there once it has begun waits for it (``_await_close``).
        Every rank must close at the same point of training (docs/shim.md): ranks that close at different points fail
        with the shim's error (``CLOSED_APART``), none averaging a bucket with another rank's other bucket."""
        if self.closed or self.disabled:
            self.closed = True
            return
        d = self.state.deferred
        task = _graph_task()  # (-1: not in a backward; a hook run outside one, under Join)
        if d is not None and task != -1 and d.backward_task == task:
            # inside that backward (a signal handler, which Python runs in a gradient hook there): closed at its end,
            # once DDP has written .grad, so that close() writes the averages of the buckets launched before it
            # (until 2026-11-28 it ran there, those buckets' averages were dropped and the step took this rank's own
            # gradient, silently: 2.2e-2 off DDP at 2 ranks, tests/test_shim.py::
            # test_close_from_a_signal_handler_during_backward_keeps_the_averages)
            d.close_after_backward = self.close
            return
        if d is not None and d.owner == threading.get_ident():  # a signal handler inside the shim's own update on
            d.close_later = self.close  # this thread: closed once that update ends (Deferred.locked)
            return
        if d is not None and self._await_backward(d, timeout):
            return
        self._settle()
        self._disarm()  # the guard and the gradient watch off this thread's mode stack
        self._end_forward_watch()
        for mode in ((d.guard, d.watch) if d is not None else ()) + (self._forward_watch,):
            if mode is not None:  # (on another thread than the training thread: see StackMode.retire)
                mode.retire()
        if self._recorder is not None:
            self._recorder.remove()
        for h in self._hooks:
            h.remove()
        self._unhooked = []
        self._owned = {}
        self._put_back("step", self._step_attr, self._own_step)
        self._put_back("zero_grad", self._zero_grad_attr, self._own_zero_grad)
        if d is not None:
            d.unwatch_state()
        self.state.close()
        self.closed = True
        self._closed_event.set()  # (another thread's close() waiting for a backward's end: _await_backward)


def _plan_due(state: ShimState, bucket) -> None:
    """At the first bucket of a synchronized backward (the same point on every rank, unlike a forward, which one
    rank may run alone: a validation on rank 0), once the measured iteration is over: agree on the profile and
    install the plan (a collective on the first level's group), before this backward's pieces are cut."""
    rec = state.options.get("recorder")
    if rec is not None and rec.done and bucket.index() == 0:
        del state.options["recorder"]
        rec.consume()
    elif rec is not None:
        rec.note_synced()  # (the measured iteration ends with a synchronized backward on every rank)


def _agree(prof, rate: float | None, group=None):
    """Make every rank plan from the same inputs (a collective): each layer's slowest forward and backward over
    the ranks, and the slowest link (None if any rank does not know its link). Ranks that planned from their own
    measurements would cut buckets differently and their all-reduces would not match."""
    from tensorlane.policies.model import Layer, Profile

    n = len(prof.layers)
    vals = [layer.fwd_s for layer in prof.layers] + [layer.bwd_s for layer in prof.layers]
    vals.append(1.0 if rate is None else -float(rate))
    t = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    v = t.tolist()
    layers = tuple(Layer(layer.name, layer.params_bytes, v[i], v[n + i]) for i, layer in enumerate(prof.layers))
    return Profile(prof.name, layers, prof.dag), (None if v[-1] > 0 else -v[-1])


def _apply_plan(handle: Handle, prof, owners: list, levels: int, link_bps: float | None,
                partition_fixed: bool, source: str) -> None:
    """Plan with ``prof`` (one layer per owner module) and install the per-parameter levels and partition size."""
    from tensorlane.shim.plan import choose, first_bucket_bytes

    prof, rate = _agree(prof, link_bps or handle.link.link_bps, group=handle.state.groups[0])
    if rate is None:
        handle.plan.update(status="layer_order: link rate unknown on some rank (pass link_bps= or run agents)",
                           source=source)
        return
    state = handle.state
    bucket = int(getattr(handle.model, "bucket_bytes_cap", 25 << 20))
    first = first_bucket_bytes(handle.model)
    try:
        chosen = choose(prof, state.world, rate, levels, bucket, first, sent_whole(handle.model, state.world))
    except (ValueError, ArithmeticError) as exc:  # keep training on the layer-order levels, say why
        handle.plan.update(status=f"layer_order: the planner failed: {exc}", source=source)
        log.warning("tensorlane: the planner failed (%s); keeping layer-order levels", exc)
        return
    for m, lvl in zip(owners, chosen["layer_levels"], strict=True):
        for p in m.parameters(recurse=False):
            state.param_level[id(p)] = min(max(0, int(lvl)), levels - 1)
    if not partition_fixed:
        state.partition_bytes = chosen["partition_bytes"]
    handle.plan.update(status="planned", source=source, link_bps=rate, bucket_bytes=bucket, first_bucket_bytes=first,
                       **{k: v for k, v in chosen.items()})


def _start_planner(handle: Handle, model, levels: int, profile, link_bps: float | None,
                   partition_bytes: int | None) -> None:
    """Plan now from ``profile``, or measure the next iteration and plan at the start of the one after."""
    from tensorlane.shim.plan import Recorder, owner_modules

    owners = owner_modules(model.module)
    fixed = partition_bytes is not None
    if profile is not None:
        from tensorlane.policies.model import load_profile

        prof = load_profile(profile) if isinstance(profile, str) else profile
        if len(prof.layers) != len(owners):
            raise ValueError(f"profile {prof.name!r} has {len(prof.layers)} layers but the model has {len(owners)} "
                             "modules with parameters (one layer per such module, in parameter order)")
        _apply_plan(handle, prof, owners, levels, link_bps, fixed, "profile")
        return

    def planned(rec: Recorder) -> None:
        _apply_plan(handle, rec.profile("measured"), owners, levels, link_bps, fixed, "measured")

    handle.plan["status"] = "measuring the first iteration (layer_order until then)"
    handle._recorder = Recorder(owners, on_done=planned)
    # torch.compile(ddp) while the Recorder's hooks are on: refused (they go with the Recorder's, after the first
    # iteration; hook mode then has no module hooks, and compiling the DDP model later was exact)
    handle._recorder._hooks.extend(_CompiledWrapper(
        model.module, " (the planner's measurement of the first iteration)",
        "; or, in hook mode, attach with policy='flat' or a profile= (no module hooks)").install(model))
    handle.state.options["recorder"] = handle._recorder  # consumed by the comm hook (_plan_due)


def _start_reporter(state, interval_s: float):
    """The job's reporter (``report.start``), stopped with the agent link if the link retires itself (its groups
    destroyed without ``close()``). Usage: ``state.reporter = _start_reporter(state, 5.0)``"""
    reporter = report.start(state, interval_s=interval_s)
    if reporter is not None:
        state.link.on_retired = reporter.stop
    return reporter


def _fabric_ddp(model):
    """The DDP model inside Lightning Fabric's ``_FabricModule`` (what ``fabric.setup(model, opt)`` returns with
    ``strategy="ddp"``): it keeps it as ``_forward_module`` and calls it in its own forward, so ``attach`` takes that
    one (docs/frameworks.md). Known by its class, without importing Lightning; any other model is returned as it is.
    Usage: ``model, opt = fabric.setup(net, opt); handle = shim.attach(model, opt)``."""
    if not any(c.__name__ == "_FabricModule" and c.__module__.endswith("fabric.wrappers") for c in type(model).__mro__):
        return model
    return model._forward_module


def _not_ddp(model) -> str:
    """What ``attach`` says of a model that is not DDP: its type, and where this process is not part of a
    distributed job, that this is why a framework handed back the bare model (Accelerate's ``prepare()`` wraps it
    in DDP only with several processes)."""
    why = f", not a {type(model).__name__}"
    if not dist.is_available() or not dist.is_initialized():
        return why + ("; torch.distributed is not initialized in this process: with Accelerate or Lightning this is "
                      "a single process, whose model is not wrapped (start the processes with torchrun, e.g. "
                      "torchrun --nproc-per-node 2 train.py; `accelerate launch --cpu` starts one process per "
                      "machine)")
    if dist.get_world_size() == 1:
        return why + ("; the process group has one process, where Accelerate and Lightning do not wrap the model "
                      "(start several, e.g. torchrun --nproc-per-node 2 train.py)")
    return why


MAX_REPORT_INTERVAL_S = 86400.0  # (a day: threading's waits take no timeout beyond time_t)


def _check_levels(levels: int, partition_bytes: int | None = None,
                  report_interval_s: float = report.INTERVAL_S) -> None:
    if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= MAX_LEVELS:
        # (a string, as from os.environ, was a bare "'<=' not supported between instances of 'int' and 'str'")
        raise ValueError(f"levels must be an integer 1..{MAX_LEVELS} (the DSCP table's distinct switch queues), "
                         f"not {levels!r}")
    if partition_bytes is not None and (isinstance(partition_bytes, bool) or not isinstance(partition_bytes, int)
                                        or partition_bytes < 1):
        raise ValueError(f"partition_bytes must be a positive number of bytes (or None), not {partition_bytes!r}")
    if isinstance(report_interval_s, bool) or not isinstance(report_interval_s, int | float) \
            or not 0 < report_interval_s <= MAX_REPORT_INTERVAL_S:
        # (0 or less: the reporter's thread sent reports to the agent in a loop; inf or 1e300: its wait raised
        # OverflowError, a traceback from the thread, no report ever)
        raise ValueError(f"report_interval_s must be a number of seconds above 0, at most {MAX_REPORT_INTERVAL_S:g}, "
                         f"not {report_interval_s!r}")


def _comm_hook_name(model) -> str | None:
    """The communication hook already on a DDP model (``register_comm_hook`` or a builtin one such as
    ``FP16_COMPRESS``), or None."""
    try:
        name = model._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):  # another torch: DDP's list of registered hooks alone
        name = None
    hooks = getattr(model, "_comm_hooks", None) or []
    if not name and hooks:
        name = getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
    return str(name) if name else None


def _shim_state_of(model) -> ShimState | None:
    """The state of the shim's own comm hook on a DDP model from an earlier ``attach`` (the latest one, following
    the attaches made after a ``close()``), or None when the model has no hook of the shim's."""
    for hook, state in getattr(model, "_comm_hooks", None) or []:
        if hook in (priority_hook, overlap_hook) and isinstance(state, ShimState):
            while state.successor is not None:
                state = state.successor[0]
            return state
    return None


def _register(model, state: ShimState, hook, prior: ShimState | None) -> None:
    """DDP's ``register_comm_hook``, or, where an earlier attach's closed hook is registered for good, chain to it."""
    if prior is not None and prior.copied:  # a deep copy of an attached DDP model: DDP's _comm_hooks list came with
        # it, but its new reducer has no hook, so chaining there would leave the shim unused (silently plain DDP)
        model._comm_hooks[:] = [(h, st) for h, st in model._comm_hooks if st is not prior]
        prior = None
    if prior is not None:
        prior.successor = (state, hook)
    else:
        model.register_comm_hook(state, hook)


def _disabled_state() -> ShimState:
    """The state of a disabled shim (``disable=True`` or TENSORLANE_DISABLE=1): closed from the start, no groups,
    no levels, no flows; its ``summary()`` has every key of an enabled one's, at nothing (``enabled`` false)."""
    return ShimState(None, 0, {}, None, levels=0, mode="disabled", closed=True,
                     mode_reason="the shim is disabled (disable=True or TENSORLANE_DISABLE=1): plain DDP")


def refuse_delayed_all_reduce(model) -> None:
    """Raise ValueError for a DDP model built with ``delay_all_reduce_named_params``: DDP all-reduces those
    parameters itself, outside its comm hook, and on gloo never waits for that all-reduce (plain DDP ends with
    different parameters on each rank and in each run): nothing exact to reproduce. Usage:
    ``refuse_delayed_all_reduce(ddp)``"""
    if getattr(model, "_delay_all_reduce_params", None):
        raise ValueError("tensorlane refuses a DDP model built with delay_all_reduce_named_params: DDP all-reduces "
                         "those parameters itself, outside its communication hook, and on gloo it never waits for "
                         "that all-reduce (plain DDP ends with different parameters on each rank and in each run), "
                         "so the shim has nothing exact to reproduce. Build the DDP model without it, or leave the "
                         "shim out")


def refuse_script_modules(model, optimizer, measured: bool) -> None:
    """Raise ValueError, before any group is made, for a DDP model holding a TorchScript module
    (``torch.jit.script`` output; a ``torch.jit.trace`` one takes hooks) where the shim would put forward hooks on
    it: overlap mode's pre-hooks (``optimizer`` given) and the planner's measurement (``measured``). torch refuses
    those hooks ("register_forward_pre_hook is not supported on ScriptModules"), which until 2026-11-29 came out of
    ``attach`` after the shim had made its groups, with the measurement's hooks left on the modules before it; plain
    DDP trains such a model. Hook mode without module hooks (no optimizer, ``policy`` "flat" or "layer_order", or a
    ``profile``) trains it, exact. Usage: ``refuse_script_modules(ddp, optimizer, measured=True)``"""
    if optimizer is None and not measured:
        return
    scripted = next((name or "the module itself" for name, m in model.module.named_modules()
                     if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is None:
        return
    what = "overlap mode (an optimizer given to attach) puts" if optimizer is not None else \
        "the planner (policy='planner' without a profile) measures the first iteration with"
    raise ValueError(f"tensorlane: the DDP model holds a TorchScript module ({scripted!r}, torch.jit.script output), "
                     f"and {what} forward hooks on its modules, which TorchScript modules refuse. Attach without the "
                     "optimizer and with policy='flat' or 'layer_order' (or a profile=): hook mode, exact; or script "
                     "nothing inside the DDP model (torch.jit.trace output takes hooks)")


def comm_state(levels: int = DEFAULT_LEVELS, *, agent_socket: str | None = None, job: str | None = None,
               partition_bytes: int | None = None, module=None, policy: str = "layer_order",
               report_interval_s: float = report.INTERVAL_S, disable: bool | str | None = None) -> ShimState:
    """A hook-mode state for a framework that wraps the model in DDP itself; nothing collective happens until the
    first hook call, which makes the groups and registers the flows on every rank. ``disable`` (else
    ``$TENSORLANE_DISABLE``, as in ``attach``): a state whose mode is ``"disabled"``, no groups and no flows, that
    ``CommHook`` leaves off the model (plain DDP); until 2026-11-28 the variable was ignored here.

    ``module`` (the model before DDP wraps it) gives the forward order of the parameters for their levels;
    without it the order is learnt from DDP's buckets during the first two iterations. ``state.stats()``,
    ``state.close()``. Usage (Lightning)::

        state = shim.comm_state(levels=4, module=model)
        Trainer(strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                                     ddp_comm_hook=shim.priority_hook),
                callbacks=[shim.lightning.CommHook(state)])   # Lightning registers the hook itself only on CUDA
    """
    _check_levels(levels, partition_bytes, report_interval_s)
    if policy not in ("layer_order", "flat"):
        raise ValueError(f"comm_state's policy must be 'layer_order' or 'flat', not {policy!r}")
    if _disabled(disable):  # closed from the start: its hook, if a framework registers it, is DDP's own all-reduce
        return _disabled_state()
    return ShimState(None, 0, {}, partition_bytes, levels=levels,
                     options={"agent_socket": agent_socket, "job": job, "module": module, "policy": policy,
                              "report_interval_s": report_interval_s},
                     order_source=[] if module is None else None)


def attach(model, optimizer=None, *, levels: int = DEFAULT_LEVELS, policy: str = "planner",
           agent_socket: str | None = None, job: str | None = None, partition_bytes: int | None = None,
           disable: bool | str | None = None, report_interval_s: float = report.INTERVAL_S, profile=None,
           link_bps: float | None = None,
           require_overlap: bool = False, per_parameter_optimizer: bool | None = None) -> Handle:
    """Give ``model`` (a DistributedDataParallel, or Lightning Fabric's wrapper of one) prioritized all-reduce; with
    ``optimizer``, overlap mode.

    Every rank must call it (it creates process groups). ``disable=True`` or TENSORLANE_DISABLE=1 leaves training
    exactly as plain DDP. Options: ``levels`` (1..5), ``policy`` ("planner", the default: ``policies.planner``
    chooses each layer's level and the partition size from a profile measured during the first iteration or
    given as ``profile`` (a policies.model.Profile or a shipped profile's name, one layer per module with
    parameters) and the link rate ``link_bps`` (default: the agent's), see shim.plan; "layer_order" or "flat",
    see policies.cutting), ``partition_bytes`` (largest all-reduce piece; overrides the planner's; None with the other
    policies: a bucket is cut only where its level changes), ``agent_socket`` (default TENSORLANE_AGENT_SOCKET or
    /run/tensorlane/agent.sock), ``job`` (default ``agree_job_id()``), ``report_interval_s`` (how often
    per-level communication counters go to the agent's metrics, ``shim.report``). Overlap mode: ``optimizer`` is a
    torch optimizer or a framework's wrapper of one (Accelerate's, Fabric's); ``require_overlap=True`` raises instead of
    falling back to hook mode when the first iteration shows a loop overlap mode cannot reproduce;
    ``per_parameter_optimizer=True`` declares an optimizer outside ``shim.overlap.PER_PARAMETER_OPTIMIZERS``
    whose update of each parameter depends only on that parameter (otherwise such an optimizer gets hook mode).
    Usage: ``handle = shim.attach(ddp_model, optimizer, levels=4)``
    """
    inner = _fabric_ddp(model)
    fabric, model = inner is not model, inner
    if _disabled(disable):
        return Handle(model, optimizer, disabled=True)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        compiled = isinstance(getattr(model, "_orig_mod", None), torch.nn.parallel.DistributedDataParallel)
        raise TypeError("shim.attach needs a torch.nn.parallel.DistributedDataParallel model" + (
            "; this is a torch.compile'd one: wrap a compiled module in DDP and attach that "
            "(ddp = DDP(torch.compile(module)); handle = shim.attach(ddp, opt)); compiling the DDP model after "
            "attach is refused at its first forward (with inductor it was not exact with the shim's module hooks); "
            + ("with Lightning Fabric, fabric.setup(torch.compile(module), opt, _reapply_compile=False) wraps the "
               "compiled module in DDP instead of compiling the DDP model" if fabric else
               "with Accelerate, leave dynamo_backend unset (with Transformers' Trainer, torch_compile=False)")
            if compiled else _not_ddp(model)))
    _check_levels(levels, partition_bytes, report_interval_s)
    group = getattr(model, "process_group", None)
    if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        raise ValueError("shim.attach supports DDP over every rank of the default process group; this model's DDP "
                         f"runs on a group of {dist.get_world_size(group)} of {dist.get_world_size()} ranks (the "
                         "shim's groups and its averaging span the world). Attach nothing to it, or use one DDP "
                         "over all ranks")
    refuse_delayed_all_reduce(model)
    prior = _shim_state_of(model)
    if prior is not None and not prior.closed:
        raise RuntimeError("tensorlane: this DDP model is attached already and its handle is open; call "
                           "handle.close() first (it applies what is pending), then attach again (with a new "
                           "optimizer, for instance)")
    other = _comm_hook_name(model) if prior is None else None  # (a closed attach's hook is the shim's own)
    if other is not None:  # (DDP's own "can only be called once" came after the groups and the optimizer's wrapping)
        raise RuntimeError(f"tensorlane: the DDP model already has a communication hook ({other}); DDP takes one, "
                           "and the shim's is the one that averages the gradients, by level. Attach to a DDP model "
                           "without a hook of its own, or do not attach")
    if optimizer is not None:
        optimizer = ov.inner_optimizer(optimizer)
        ref = getattr(optimizer.__dict__.get("step"), "tensorlane_handle", None)
        if ref is not None and ref() is not None and not ref().closed:
            raise ValueError("tensorlane: this optimizer is already given to shim.attach for another DDP model "
                             "(overlap mode takes over its step() and its state, for one model). Give it to one "
                             "attach only: the parameters it holds outside that model's DDP are stepped at step(), "
                             "with their gradients as their own DDP leaves them, so attach the other model without "
                             "the optimizer (hook mode)")
    if dist.get_backend() != "gloo":
        warnings.warn("tensorlane's shim is tested with gloo; with NCCL sockets the flows are found the same way, "
                      "over IB/RoCE use NCCL_IB_TC per communicator instead (see docs/shim.md)", stacklevel=2)
    if policy not in PLANNER_POLICIES:
        raise ValueError(f"policy must be one of {PLANNER_POLICIES}, not {policy!r}")
    refuse_script_modules(model, optimizer, policy == "planner" and profile is None)
    params = [p for p in model.module.parameters() if p.requires_grad]
    state = ShimState(None, dist.get_world_size(), {}, None, levels=levels, require_overlap=require_overlap)
    state.options["ddp_ref"] = weakref.ref(model)  # (weak: DDP keeps the state for good, the model must go)
    _set_layer_levels(state, params, "layer_order" if policy == "planner" else policy)
    if partition_bytes is not None:
        state.partition_bytes = partition_bytes
    state.groups, state.link, state.flows, state.job = connect(levels, agent_socket, job)
    state.reporter = _start_reporter(state, report_interval_s)  # counters to the agent's metrics
    handle = Handle(model, optimizer, state)
    handle.plan = {"policy": policy}
    if policy == "planner":
        _start_planner(handle, model, levels, profile, link_bps, partition_bytes)
    if optimizer is None:
        _register(model, state, priority_hook, prior)
        return handle
    per_param = per_parameter_optimizer if per_parameter_optimizer is not None else \
        type(optimizer) in ov.PER_PARAMETER_OPTIMIZERS
    wrapped = ov.wrapped_step(optimizer) and per_parameter_optimizer is not True  # (before the shim's own step)
    handle._per_part_ok = per_parameter_optimizer is True
    users_step = ov.wrapped_step(optimizer)
    handle._install_overlap()
    # every overlap step of an optimizer declared per parameter is checked whole (a known torch.optim class is not)
    state.deferred.verify = handle._per_part_ok and (type(ov.inner_optimizer(optimizer)) not in
                                                     ov.PER_PARAMETER_OPTIMIZERS or users_step)
    if getattr(model, "gradient_as_bucket_view", False):
        why = ov.BUCKET_VIEW
    elif not per_param:
        why = (f"{type(optimizer).__name__} is not known to update each parameter on its own "
               "(shim.overlap.PER_PARAMETER_OPTIMIZERS; pass per_parameter_optimizer=True if it does)")
    else:
        why = ov.STEP_WRAPPED if wrapped else None
    state.mode = "probing"
    if why is None:
        state.mode_reason = "overlap asked for: the first iteration runs as hook mode"
    else:
        state.fallback(why)  # sets hook mode and says why (or raises with require_overlap)
    _register(model, state, overlap_hook, prior)
    return handle
