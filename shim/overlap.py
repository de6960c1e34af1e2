"""Overlap mode's deferred optimizer steps, and the checks that keep them exactly equal to plain DDP.

In overlap mode the comm hook returns at once (``shim.ddp.overlap_hook``) and the all-reduce of each bucket
continues on a copy of it (a :class:`Pending`). The user's ``optimizer.step()`` does not update anything: it
*stamps* the pending buckets of that iteration with the optimizer's hyperparameters as they are at that moment
(learning rate, momentum, ...: whatever an LR scheduler or the user's code set). Each parameter's step is taken
later, when its own all-reduce has completed, in the forward pre-hook of its module (or on ``flush()``), with the
stamped hyperparameters. So LR schedulers (created before or after ``attach``) and manual changes of
``param_groups`` apply exactly as under DDP.

What overlap mode cannot reproduce, and how it is caught:

- gradients changed between ``backward()`` and ``step()`` (``clip_grad_norm_``, ``clip_grad_value_``,
  ``GradScaler.unscale_``, code writing ``.grad``): under DDP they act on the averaged gradient, which overlap
  mode does not have yet. The first synchronized iteration after ``attach`` is a :class:`Probe` that runs exactly
  like hook mode; if it sees such a change (a gradient's version counter or identity changed), a
  ``step(closure)`` or an optimizer that does not update each parameter on its own, every rank switches to hook
  mode for the rest of the run (one warning; ``stats()["mode_reason"]``). The probe also compares each
  gradient's norm (``GradScaler`` unscales in place without moving the version counter) and notices a step
  taken through ``GradScaler.step``. A change that first appears later and reads the gradients first (clipping,
  ``.grad.mul_``, ``unscale_``) is exact (the :class:`GradWatch` below), and so is a second backward (its first
  gradient makes ``.grad`` DDP's average first, below); one that does not read them (``zero_``, ``.grad = None``)
  raises at that ``step()``, before the update it concerns is applied (seen by version, identity, or a
  ``GradScaler`` caller).
- a parameter used in a forward pass before its module's forward pre-hook ran (a parameter of one module used
  functionally by another, or read by a parent before its module runs): parameters seen so in the probe (a
  :class:`ForwardWatch` on its forward) are applied at the start of every forward; a use that first appears later
  is seen by the :class:`UseGuard`, which stays armed through the forward for the updates not applied yet, and
  applies every pending update first (until 2026-11-27 it left at the forward's start: a momentum encoder updated
  from the online weights at the start of the forward after a warm-up read them before their update, silently;
  one whose use saved it for backward raised).
- ``step()`` after a ``backward()`` that DDP did not synchronize (``no_sync``: Accelerate's ``LocalSGD``, post-local
  SGD after synchronized steps) is the optimizer's own step on this rank's ``.grad``, taken at once after the
  stamped updates are applied, as under DDP (until 2026-11-27 it raised); two steps on one gradient with no
  ``backward()`` between raise. A ``backward()`` with no ``step()`` afterwards (accumulation without ``no_sync``, a
  step skipped with the gradients kept) keeps DDP's semantics: at the first gradient of the next backward the
  shim waits for its all-reduces and writes the averages into ``.grad``, to which the new gradient then adds, as
  under DDP (before 2026-11-27 ``.grad`` kept this rank's own gradient there, and the sum was all-reduced again:
  equal up to float rounding only).
- parameters that DDP all-reduces but the attached optimizer does not hold (a second optimizer, or code that
  updates them itself), and step hooks on the optimizer (``register_step_pre_hook``/``post_hook``, or global
  ones): in overlap mode ``.grad`` holds this rank's own gradient until the deferred step, and that step is taken
  in parts, each of which would run the hooks. The probe sees both and falls back to hook mode; step hooks added
  later are left out of the steps stamped before them, and the next ``step()`` goes on in hook mode, exact (it
  raised there until 2026-11-29), and another optimizer that steps DDP's parameters later raises before its
  update (a global step pre-hook). Parameters the optimizer holds outside DDP's buckets (DDP's ignored
  parameters, a layer frozen when DDP was made, a parameter outside the model such as a learnable temperature)
  are stepped at ``step()`` itself, with their own gradient, as DDP leaves them.
- the optimizer's state (``optimizer.state``) used between ``step()`` and the next forward (reset, read, a new
  param group added) applies the pending updates first, as parameters do; ``optimizer.state`` replaced by another
  dict there raises.
- parameters written in place between ``step()`` and the next forward (checked with their version counters)
  raise, and so does a parameter that changed after ``backward()`` without a ``step()`` through the shim (a
  framework that calls the optimizer's original ``step``); ``load_state_dict`` and ``state_dict`` of the model
  or the optimizer apply pending steps first.

Code that uses parameters between ``step()`` and the next forward (an EMA of the weights, logging their norms,
clamping them) must see them updated, as under DDP. From a stamping ``step()`` until the next forward of the
model, a :class:`UseGuard` (a ``TorchFunctionMode`` on the thread that called ``step()``) watches every torch
operation: the first one that takes a parameter whose update is pending (or a view of its storage), other than
reading its metadata (``.grad``, ``.shape``, ``numel()``, ...), first applies every pending update
(``handle.flush()``), as if the step had been taken at ``step()``. Exact, at the cost of that iteration's overlap.
So does a call of a ``torch.compile``d function or module (:class:`CompiledCalls`: dynamo would trace the guard),
after which the guard leaves the stack and dynamo compiles the call as under plain DDP.
Code that reads ``.grad`` after ``backward()`` (a logged norm, a step skipped on it, clipping) would see this rank's
own gradient (not the average) in overlap mode. A :class:`GradWatch` watches the gradients DDP wrote from the end of
every forward to the next forward. In the probe a read makes the job fall back to hook mode (a loop that reads them
every iteration gains nothing from overlap). Later, the first read of an iteration makes ``.grad`` DDP's average
before it proceeds: before ``step()`` the iteration's all-reduces are waited for and the averages written into
``.grad``, and ``step()`` then takes the optimizer's own step on ``.grad`` as the loop leaves it
(``Deferred.step_synced``, exactly DDP's step); after ``step()`` the stamped updates are applied (a flush), which
leaves the averages in ``.grad``. Exact, at the cost of that iteration's overlap (``averaged_on_read``).

Usage: ``deferred = Deferred(optimizer, holders)`` is made by ``shim.attach``; see shim/ddp.py.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import functools
import os
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

# torch.optim classes whose update of a parameter depends only on that parameter's gradient and state, so that
# stepping a subset of the parameters at a time gives the same result as one step of all (exact classes only:
# a subclass may override step). LBFGS (closure, global state) and wrappers such as ZeroRedundancyOptimizer are
# not among them: with those, overlap mode falls back to hook mode.
PER_PARAMETER_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
    "SparseAdam", "Adafactor") if hasattr(torch.optim, name))

GRADS_CHANGED = ("gradients were changed between backward() and optimizer.step() (gradient clipping, "
                 "GradScaler's unscale_/step, code writing .grad, or a backward() that DDP does not synchronize, "
                 "such as a second one on the same forward with retain_graph=True): under DDP that acts on the "
                 "averaged gradient, which overlap mode only has later")
COUPLED = ("the optimizer's update of a parameter depends on the others it steps with it (Adafactor with "
           "eps=(None, ...) takes its first epsilon from the dtype of the first parameter it steps, and a group holds "
           "several dtypes): overlap mode steps the parameters in parts")
COMPILED = ("the optimizer's step runs under torch.compile: overlap mode takes it later, in parts, outside the "
            "compiled code, and compiled and eager steps round differently")
JOIN = ("DDP's join() (uneven inputs): a rank that has joined runs DDP's all-reduces outside backward, and at the "
        "end DDP broadcasts the last joiner's parameters, whose last step overlap mode has not taken yet")
SPARSE = ("the model has sparse gradients (an embedding with sparse=True): overlap mode defers the step on dense "
          "buckets only")
CLOSURE = ("optimizer.step(closure) runs forward and backward inside the step (LBFGS and similar), so the step "
           "cannot be deferred")
UNOPTIMIZED = ("some parameters that DDP all-reduces are not in the optimizer given to attach (a second optimizer, "
               "or code that updates them itself): in overlap mode their .grad holds this rank's own gradient until "
               "the deferred step, so whatever updates them would not see DDP's average")
BUCKET_VIEW = ("DDP(gradient_as_bucket_view=True): the gradients are views of DDP's buckets, which overlap mode does "
               "not support (it needs them as copies, DDP's default gradient_as_bucket_view=False)")
GRADS_READ = ("the loop reads gradients after backward() (a logged gradient norm, a step skipped when the norm is too "
              "large or not finite, GradScaler's inf/NaN check): in overlap mode .grad holds this rank's own gradient "
              "until the deferred step, not DDP's average, so what the loop read, and decided, would differ")
RANDOM = ("the optimizer's step draws from torch's random number generator (noise added to the update, as in SGLD, "
          "with per_parameter_optimizer=True): overlap mode takes the step later and in parts, interleaved with the "
          "next forward's draws (dropout), so every draw would differ")
STEP_WRAPPED = ("optimizer.step was replaced on the optimizer (or its class) before attach by a function of the "
                "user's (a wrapper that counts or logs its calls, or scales the gradients by a global norm first): "
                "overlap mode takes each step later and in parts, through that function, so it would run once per "
                "part and see only that part's parameters (pass per_parameter_optimizer=True if it updates each "
                "parameter on its own and may run per part)")
GROUP_WRITTEN = ("the optimizer's step writes a tensor of its param groups in place (a step counter kept in the "
                 "group as a tensor, group['step'] += 1): overlap mode takes each step later and in parts, each on a "
                 "copy of the hyperparameters stamped at step(), so the count would advance once per part, on the "
                 "copy, and the group's own tensor not at all")
PARTS_DIFFER = ("the optimizer was declared per parameter (per_parameter_optimizer=True), but its step taken in two "
                "parts, as overlap mode takes it, on copies of the parameters and state, did not give what one step of "
                "all gave, or raised there (an update that depends on other parameters, such as a norm over all "
                "gradients, or a count kept per call of step())")
PARTS_DIFFER_LATER = ("the optimizer was declared per parameter (per_parameter_optimizer=True), but a step after the "
                      "first, taken in parts as overlap mode takes it, did not give what the same step of all "
                      "parameters gives (a coupling that starts later: a clipping by the norm of all gradients once it "
                      "exceeds a limit, as timm's Lamb with max_grad_norm)")
STEP_HOOKS_LATE = ("step hooks were registered on the optimizer (register_step_pre_hook/register_step_post_hook, or "
                   "global ones) after overlap mode had begun: from this step() on the optimizer's whole step is "
                   "taken at step(), with its hooks, as under DDP")
STEP_HOOKS = ("the optimizer has step hooks (register_step_pre_hook/register_step_post_hook, or global ones): "
              "overlap mode takes each step later and in parts, so the hooks would run out of time and once per part")


# what a torch operation may do with a parameter without using its values: its metadata, its gradient, hooks
# (attribute names for the getters and setters of Tensor's properties, function names for the methods)
METADATA = frozenset((
    "grad", "_grad", "shape", "requires_grad", "dtype", "device", "is_leaf", "ndim", "_version", "is_cuda",
    "is_cpu", "is_xpu", "is_mps", "is_meta", "layout", "grad_fn", "_grad_fn", "is_sparse", "is_sparse_csr",
    "is_quantized", "is_mkldnn", "is_nested", "output_nr", "name", "_base", "_cdata", "itemsize", "nbytes",
    "retains_grad", "_backward_hooks", "_post_accumulate_grad_hooks", "numel", "size", "dim", "__len__",
    "data_ptr", "untyped_storage", "stride", "storage_offset", "is_contiguous", "element_size", "get_device",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "__hash__"))
# what hands out a tensor's memory itself: whatever reads it next (torch.save writing a tensor that shares a
# parameter's storage: a state_dict() taken before step(), a detached alias) needs no torch operation, so for the
# parameter guard these are uses, and for the gradient watch reads (until 2026-11-27 they were metadata: such a
# checkpoint held the values before the update, silently, 7e-2 relative off, idiom kept_tensors_saved_wrapper_hook; a
# torch.save of the gradients between backward() and step() held this rank's own, 1.25 relative off)
STORAGE_ACCESS = frozenset(("untyped_storage", "storage", "_typed_storage"))
# what code may do to a gradient without reading its values (zero_grad(set_to_none=False), model.zero_grad())
GRAD_OVERWRITES = frozenset(("zero_", "_foreach_zero_", "fill_", "detach_"))


def inner_optimizer(optimizer):
    """The torch optimizer behind a framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: an ``optimizer`` attribute), or ``optimizer`` itself."""
    inner = getattr(optimizer, "optimizer", None)  # first: AcceleratedOptimizer is an Optimizer subclass too
    if isinstance(inner, torch.optim.Optimizer):
        return inner_optimizer(inner)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(f"shim.attach needs a torch.optim.Optimizer (or a wrapper holding one as .optimizer), "
                    f"not {type(optimizer).__name__}")


def snapshot(value):
    """``value`` as it is now: a tensor copied, a tuple or list of values copied element by element, else itself."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)) and any(isinstance(v, (torch.Tensor, tuple, list)) for v in value):
        return type(value)(snapshot(v) for v in value)
    return value


def hyperparameters(optimizer) -> list[dict]:
    """Every param group's values except its parameters, as they are now (tensors copied, also inside a tuple:
    schedulers may change a tensor learning rate in place, and a user's momentum schedule a tensor beta of Adam's
    ``betas=(tensor, tensor)``; until 2026-11-28 only a tensor directly in the group was copied, and a beta written
    in place after ``step()`` took effect one step early, silently: 0.3 relative off DDP after 8 Adam steps at 2 ranks,
    idiom ``tensor_betas_in_place``)."""
    return [{k: snapshot(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@dataclass
class Pending:
    """One bucket whose all-reduce is in flight.

    ``params`` holds ``(param, offset, numel, piece indexes)``: the pieces of ``futures`` that cover the
    parameter's slice of ``buffer``, so a parameter waits only for its own pieces. ``hparams`` is set when the
    user's ``step()`` stamps it (None: no step was asked for yet), with each parameter's version at that time.
    """

    futures: list
    buffer: torch.Tensor
    params: list
    launched: list = field(default_factory=list)  # (level, launch time, step) of each piece, for the counters
    applied: set = field(default_factory=set)  # id(param): step taken, or dropped
    timed: set = field(default_factory=set)  # pieces whose completion has been counted
    hparams: list | None = None
    members: list = field(default_factory=list)  # each param group's parameters when stamped (tuples)
    versions: dict = field(default_factory=dict)  # id(param) -> param._version when stamped
    skip: set = field(default_factory=set)  # id(param) with no .grad at step(): the optimizer skips them
    created: dict = field(default_factory=dict)  # id(param) -> param._version when the bucket was launched
    grads: dict = field(default_factory=dict)  # id(param) -> (its .grad, that tensor's version) when stamped
    autocast: dict = field(default_factory=dict)  # autocast's state at step() (autocast_state), for the step
    inference: bool = False  # whether step() ran under torch.inference_mode (the step runs so, not as the forward)


@dataclass
class Probe:
    """What the probe iterations saw, per rank (reduced over the ranks before any decision)."""

    backwards: int = 0  # synchronized backward passes seen
    stepped: bool = False  # step() called after one of them
    grads_changed: bool = False
    closure: bool = False
    sparse: bool = False  # a bucket of sparse gradients (an embedding with sparse=True)
    compiled: bool = False  # step() ran under torch.compile, or the optimizer's step is a compiled function
    grads_read: bool = False  # a torch operation used a gradient DDP wrote (GradWatch), beyond metadata and zeroing
    random: bool = False  # the optimizer's step drew from torch's random number generator (rng_states changed)
    group_written: bool = False  # the optimizer's step wrote a tensor of its param groups in place (GROUP_WRITTEN)
    parts_differ: bool = False  # a declared optimizer's step in parts differed from its whole step (PARTS_DIFFER)
    ran: set = field(default_factory=set)  # id(module) of modules whose forward ran since the last backward


@dataclass
class PartsCheck:
    """One step of an optimizer declared per parameter, in overlap mode, kept from ``step()`` until its last part is
    applied, to be taken once more whole, on copies, and compared with what the parts gave (:func:`whole_step`)."""

    params: list  # the parameters it steps (those with a gradient at step())
    before: dict  # id(param) -> a copy of its value at step()
    state: dict  # id(param) -> a copy of its state at step()
    attrs: dict  # the optimizer's attributes at step() (tensors copied), its state and groups aside
    hparams: list  # the groups' values stamped at step()
    members: list  # each group's parameters at step()
    autocast: dict
    inference: bool
    grads: dict  # id(param) -> the gradient its part stepped on (DDP's average; its own .grad outside the buckets)
    remaining: set  # id(param) of those whose part is not applied yet


class _Hold:
    """``Deferred.locked()``: ``apply_lock`` with its owner and depth, and the owner's ``close_later`` run at the
    outermost exit, once the lock is released."""

    __slots__ = ("d",)

    def __init__(self, deferred):
        self.d = deferred

    def __enter__(self) -> None:
        d = self.d
        d.apply_lock.acquire()
        d.owner, d.depth = threading.get_ident(), d.depth + 1

    def __exit__(self, *_exc) -> bool:
        d, later = self.d, None
        d.depth -= 1
        if not d.depth:
            d.owner, later, d.close_later = None, d.close_later, None
        d.apply_lock.release()
        if later is not None:
            later()
        return False


class Deferred:
    """The deferred-step machinery of one ``attach``: pending buckets, gradient marks, the probe, the checks."""

    def __init__(self, optimizer, holders: dict):
        self.optimizer = optimizer
        self.holders = holders  # id(param) -> ids of the modules that hold it directly
        self.pending: dict = {}  # id(param) -> Pending
        self.unstamped: list = []  # Pendings of the current iteration, not yet stamped by step()
        self.marks: list = []  # (param, grad, grad version) right after the last synchronized backward
        self.got_grad: set = set()  # id(param) of parameters whose gradient was computed in this backward
        self.early: set = set()  # id(param) used before their own module's forward: applied at forward start
        self.probe = Probe()
        self.norms: list | None = None  # while probing: each gradient's norm right after backward
        self.orig_step = None
        self.steps = 0  # step() calls stamped
        self.flushes = 0
        self.guard: UseGuard | None = None  # set by Handle: watches parameter use between step() and forward
        # ddp._apply holds it: two threads applying the same pending step (a validation thread's forward, a fork or
        # a flush() on another thread, while the training thread's forward applies it) take it once
        self.apply_lock = threading.RLock()
        self.owner: int | None = None  # the thread inside locked() (None: none), and how deep
        self.depth = 0
        self.close_later = None  # a close() asked for by the owner itself mid-update (a signal handler): run at exit
        self._hold = _Hold(self)  # (locked(): one object, entered re-entrantly; a generator each time cost 8x)
        self.backward_task = None  # the autograd graph task of the backward that launched buckets, until it ends
        self.launched_now: list = []  # Pendings launched since the last complete backward (ddp._drop_unfinished)
        self.backward_thread: int | None = None  # the thread running that backward
        self.close_after_backward = None  # a close() asked for during it (a signal handler in a gradient hook, or
        # another thread: a watchdog's close() waits for it, Handle.close)
        self.closing = False  # a close() began outside a backward: a bucket launched from then on is DDP's own
        self.flushed_on_use = 0  # times the guard applied pending updates because a parameter was used
        self.bucketed: set = set()  # id(param) of the parameters DDP all-reduces (seen in the probe's buckets)
        self.stamped_state = None  # optimizer.state when step() stamped (the shim's StateView)
        self.on_state_use = None  # set by Handle: a flush, when optimizer.state is used while updates are pending
        self.watch = GradWatch(self.note_read)  # the loop's reads of the gradients after backward (Handle sets it)
        self.synced = False  # a read made this iteration's .grad DDP's average before step(): step() takes it now
        self.averaged_on_read = 0  # iterations in which a read after the probe waited for the averages
        self.averaged_unstepped = 0  # backward passes that found an unstepped one's averages to write first
        self.verify = False  # an optimizer declared per parameter: every overlap step checked whole (PartsCheck)
        self.lost: str | None = None  # a deferred update raised where it was applied, and was not taken (refuse)
        self.check: PartsCheck | None = None  # the last step()'s, until its last part is applied and compared
        self.checked = 0  # steps so checked
        self.previous: list = []  # Pendings of the last synchronized backward, until step() (a later backward
        # that finds them still unstamped writes their averages into .grad first: ddp._average_unstepped)

    def locked(self) -> _Hold:
        """Hold ``apply_lock`` (re-entrant); where a ``close()`` was asked for by this thread meanwhile (a signal
        handler, which Python runs on the main thread between two bytecodes, so inside the shim's own update), run
        it once the outermost hold ends: until 2026-11-28 it ran there, mid-update, and a ``step()`` it landed in was
        dropped, silently (tests/test_shim.py::test_close_from_a_signal_handler_inside_the_shims_update_loses_no_step).
        Usage: ``with d.locked(): ...``"""
        return self._hold

    # -- the user's optimizer.step() ----------------------------------------------------------------------
    def release(self) -> None:
        """Once closed: drop the pending steps, the parameters and the guard (whose ``on_use`` is the handle, which
        holds the model); the counters stay for ``stats()``. Not the optimizer's own step, which a wrapper of the
        shim's ``step`` made by someone else still calls."""
        self.pending, self.unstamped, self.marks, self.holders, self.previous = {}, [], [], {}, []
        self.check = None
        self.launched_now = []
        self.guard = self.norms = self.on_state_use = self.stamped_state = None  # (on_state_use: the handle)
        self.watch.unwatch()
        self.watch.on_read = self.note_read  # (the handle's)
        self.watch.on_compiled = None

    def stamp(self, params: list, closure) -> None:
        """``optimizer.step()`` in overlap mode: check, then stamp this iteration's buckets (no update now)."""
        self.check_step(closure)
        if compiled_step(self.orig_step):
            raise RuntimeError(f"tensorlane overlap mode: {COMPILED}. It was compiled after overlap mode had "
                               "started; this update has not been applied. Compile it before the first iteration "
                               "(overlap mode then falls back to hook mode), or attach without the optimizer.")
        changed = changed_grads(self.marks)
        if changed or called_by_grad_scaler():
            shape = tuple(changed[0].shape) if changed else "any"
            raise RuntimeError(f"tensorlane overlap mode: {GRADS_CHANGED} (first: a parameter of shape "
                               f"{shape}). The first iteration showed no such change, so "
                               "overlap mode was chosen; this update has not been applied. Use hook mode "
                               "(shim.attach without optimizer) for a loop that changes gradients only sometimes.")
        if not self.unstamped:
            if any(p.grad is not None for p in params):
                raise RuntimeError("tensorlane overlap mode: optimizer.step() without a synchronized backward() "
                                   "since the last step (a no_sync() backward whose gradient met an update not yet "
                                   "applied); overlap mode cannot reproduce DDP there. Use hook mode.")
            return  # nothing to update, as under DDP (no gradients)
        hp = hyperparameters(self.optimizer)
        members = [tuple(g["params"]) for g in self.optimizer.param_groups]
        amp = autocast_state({p.device.type for p in params})
        inference = torch.is_inference_mode_enabled()
        for pend in self.unstamped:
            pend.hparams = hp
            pend.members = members
            pend.autocast = amp
            pend.inference = inference
            pend.versions = {id(p): p._version for p, *_ in pend.params}
            pend.skip = {id(p) for p, *_ in pend.params if p.grad is None}  # DDP left no gradient (unused)
            pend.grads = {id(p): (p.grad, p.grad._version) for p, *_ in pend.params if p.grad is not None}
        # (a check of the last step whose parts were not all applied, dropped at a close(), is left)
        self.check = parts_check(self.optimizer, hp, members, amp, inference, self.bucketed) if self.verify else None
        self.unstamped = []
        self.previous = []
        self.marks = []
        self.steps += 1
        self.stamped_state = self.watch_state()
        outside = [p for p in params if id(p) not in self.bucketed and p.grad is not None]
        if outside:  # DDP does not all-reduce these: the step takes their own gradient, now, as under DDP
            self.step_subset(outside, hp)

    def note_read(self) -> None:
        """While probing: the loop read a gradient after backward (the probe falls back to hook mode)."""
        self.probe.grads_read = True

    def step_synced(self, closure) -> None:
        """``optimizer.step()`` in overlap mode after a read made this iteration's ``.grad`` DDP's average
        (``synced``: nothing of it is pending): the optimizer's own step, now, on ``.grad`` as the loop left it
        (clipped, scaled), exactly as DDP takes it."""
        self.check_step(closure)
        self.synced = False
        self.marks = []
        self.orig_step()

    def buckets(self, stamped: bool = False):
        """Each bucket in ``pending``, once (``stamped``: only those a ``step()`` has stamped), in the order of its
        first parameter there. The keys are copied at once and each bucket read when its key comes: another thread's
        flush takes applied updates out meanwhile (until 2026-11-28 a forward iterating ``pending`` itself raised
        "dictionary changed size during iteration" there, tests/test_shim.py::
        test_forward_while_another_thread_flushes_does_not_raise). Usage: ``for pend in d.buckets(): ...``"""
        seen = set()
        for key in list(self.pending):
            pend = self.pending.get(key)
            if pend is not None and id(pend) not in seen and (not stamped or pend.hparams is not None):
                seen.add(id(pend))
                yield pend

    def stamped_params(self):
        """Each parameter whose stamped update is still pending (in ``pending`` under a bucket a ``step()`` stamped,
        not applied), as ``(bucket, param, the bucket's pieces covering it)``; ``pending`` read as :meth:`buckets`."""
        for pend in self.buckets(stamped=True):
            for p, _o, _n, covering in pend.params:
                if self.pending.get(id(p)) is pend and id(p) not in pend.applied:
                    yield pend, p, covering

    def awaiting_step(self) -> bool:
        """Whether the last synchronized backward's averages are still pending without a ``step()`` (its
        ``.grad`` holds this rank's own gradient until the next backward, which all-reduces it again)."""
        return any(self.pending.get(id(p)) is pend for pend in self.unstamped for p, *_ in pend.params)

    def watch_state(self):
        """Put a :class:`StateView` on ``optimizer.state`` (again, after ``load_state_dict`` or the user replaced
        it); return it."""
        opt = self.optimizer
        if not (isinstance(opt.state, StateView) and opt.state.deferred is self):
            opt.state = StateView(opt.state, self)
        return opt.state

    def unwatch_state(self) -> None:
        """Give the optimizer back a plain ``defaultdict`` state (``close()``)."""
        opt = self.optimizer
        if isinstance(opt.state, StateView) and opt.state.deferred is self:
            opt.state = opt.state.plain()

    def check_step(self, closure) -> None:
        """Raise where overlap mode cannot take this ``step()``: a closure, or step hooks on the optimizer now (they
        were not there when the probe chose overlap mode)."""
        if closure is not None:
            raise RuntimeError(f"tensorlane overlap mode: {CLOSURE}. Use hook mode (shim.attach without "
                               "optimizer) for this loop.")
        if step_hooks(self.optimizer):
            raise RuntimeError(f"tensorlane overlap mode: {STEP_HOOKS}. They were registered after overlap mode "
                               "had started; this update has not been applied. Register them before the first "
                               "iteration (overlap mode then falls back to hook mode), or attach without the "
                               "optimizer (hook mode).")

    def step_subset(self, params: list, hparams: list, autocast: dict | None = None,
                    inference: bool | None = None, members: list | None = None) -> None:
        """One step of the user's optimizer over ``params`` only, with the hyperparameters ``hparams`` (one dict per
        param group, as stamped by ``step()``; a group added since then is not stepped, as under DDP, where the step
        came first), each group over its parameters as they were at ``step()`` (``members``, one tuple per group; None:
        as now): a parameter moved to another group or dropped from the optimizer between ``step()`` and the next
        forward was stepped at ``step()`` with its group of then under DDP (until 2026-11-28 it took its new group's
        hyperparameters, or no step, silently: 1.6e-2 relative off DDP after 8 steps, ``regroup_after_step``), under
        autocast as it was at ``step()`` (``autocast``, from :func:`autocast_state`; the deferred step runs in the next
        forward, typically inside the loop's ``torch.autocast``, where Adafactor's ``row_var @ col_var`` would run in
        bf16: until 2026-11-27 it did, 3e-2 from DDP after 8 steps), and in or out of ``torch.inference_mode`` as at
        ``step()`` (``inference``; None: as now): a validation forward under ``inference_mode`` that takes a parameter's
        first step would make its new state inference tensors, which the next step outside it cannot update in place
        (until 2026-11-27 it raised there, ``late_state_inference``); the groups are restored afterwards. Known
        window (docs/shim.md, idioms row "a parameter read in the forward before its own module runs"): the live
        groups hold the stamped values and the stepped part meanwhile, so another thread (the training thread's
        scheduler, while a validation thread takes this step) reads those, and a rate it writes before the optimizer
        reads it is this step's; the optimizer's step reads only the live groups, so hiding them would take a
        per-thread view of ``param_groups`` (left)."""
        opt = self.optimizer
        if self.stamped_state is not None and opt.state is not self.stamped_state:
            raise RuntimeError("tensorlane overlap mode: optimizer.state was replaced between optimizer.step() and "
                               "the next forward; under DDP the step used the state it had at step(), which "
                               "overlap mode applies later. Call handle.flush() after optimizer.step() before "
                               "replacing it, or use hook mode (shim.attach without optimizer).")
        if len(opt.param_groups) < len(hparams):
            raise RuntimeError("tensorlane overlap mode: a param group was removed from the optimizer between "
                               "optimizer.step() and the next forward; under DDP the step had updated it. Call "
                               "handle.flush() after optimizer.step() before changing the groups, or use hook mode.")
        wanted = {id(p) for p in params}
        stamped, later = opt.param_groups[:len(hparams)], opt.param_groups[len(hparams):]
        saved = [(g["params"], {k: g[k] for k in h if k in g}) for g, h in zip(stamped, hparams, strict=True)]
        added = [g["params"] for g in later]
        try:
            for i, (g, h) in enumerate(zip(stamped, hparams, strict=True)):
                g["params"] = [p for p in (g["params"] if members is None else members[i]) if id(p) in wanted]
                g.update(h)
            for g in later:
                g["params"] = []
            quiet = contextlib.nullcontext() if self.stamped_state is None else self.stamped_state.quiet()
            mode = torch.inference_mode(inference) if inference is not None else contextlib.nullcontext()
            stamped_tensors = group_tensors(hparams)
            versions = [t._version for t in stamped_tensors]
            # step hooks registered since that step() did not run for it under DDP (stamp() refuses to stamp with
            # any): until 2026-11-29 this raised, the update not applied, where DDP trains on (step_post_hook_late)
            with mode, torch.no_grad(), quiet, autocast_as(autocast or {}), step_hooks_hidden(opt):
                self.orig_step()
            if written(stamped_tensors, versions):  # (the probe saw none: it began after, or another optimizer's)
                raise RuntimeError(f"tensorlane overlap mode: {GROUP_WRITTEN}. The first iteration showed no such "
                                   "write, so overlap mode was chosen. Use hook mode (shim.attach without "
                                   "optimizer) for this optimizer.")
        finally:
            # put back only what still holds the stamped value: another thread (the training thread's LR scheduler,
            # while this step runs on a validation thread) may have set a new one meanwhile, which holds, as under
            # DDP (until 2026-11-28 the value of before it was put back, silently: tests/test_shim.py::
            # test_lr_scheduled_while_another_thread_applies_the_step_holds)
            for g, h, (ps, current) in zip(stamped, hparams, saved, strict=True):
                g["params"] = ps
                g.update({k: v for k, v in current.items() if g.get(k) is h[k]})
            for g, ps in zip(later, added, strict=True):
                g["params"] = ps

    def probe_step(self, closure) -> None:
        """``optimizer.step()`` while probing: note what this iteration did (the real step follows)."""
        self.probe.stepped = self.probe.backwards > 0 or self.probe.stepped
        self.probe.closure |= closure is not None
        self.probe.compiled |= compiled_step(self.orig_step)
        self.probe.grads_changed |= (bool(changed_grads(self.marks)) or called_by_grad_scaler()
                                     or _norms([g for _p, g, _v in self.marks]) != self.norms)
        self.marks = []
        self.norms = None

    # -- after every synchronized backward ----------------------------------------------------------------
    def after_backward(self, params: list, probing: bool) -> None:
        """Runs once DDP has written the gradients: mark them and watch the loop's reads of those DDP averages;
        while probing, note early-used parameters."""
        if self.closing:  # (closed on another thread meanwhile, this backward's buckets DDP's own: nothing to mark)
            self.backward_task = None
            return
        self.marks = [(p, p.grad, p.grad._version if p.grad is not None else -1) for p in params]
        self.synced = False
        self.previous = [] if probing else list(self.unstamped)
        self.watch.unwatch()  # (a gradient tensor of the last iteration freed since, whose id may come back)
        self.watch.watch([g for p, g, _v in self.marks if id(p) in self.bucketed])  # (the others are per rank)
        if probing:
            with self.watch.paused():
                self.norms = _norms([g for _p, g, _v in self.marks])
            self.probe.backwards += 1
            for p in params:
                if id(p) in self.got_grad and not any(m in self.probe.ran for m in self.holders.get(id(p), ())):
                    self.early.add(id(p))
        self.probe.ran = set()
        self.got_grad.clear()  # in place: the gradient hooks hold this set
        later = self.backward_over()  # (this backward was complete: DDP's last bucket was ready)
        if later is not None:
            later()

    def backward_over(self):
        """The backward that launched buckets is over (complete, or dropped unfinished at ``step()``:
        ``ddp._drop_unfinished``): forget it and its launches; returns the ``close()`` asked for during it, if any,
        for the caller to run."""
        self.backward_task = None
        self.launched_now = []
        later, self.close_after_backward = self.close_after_backward, None
        return later


def autocast_state(device_types) -> dict:
    """Autocast's state now, ``{device type: (enabled, dtype)}``, for the device types among ``device_types`` that
    have autocast."""
    return {dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in sorted(device_types) if torch.amp.is_autocast_available(dt)}


@contextlib.contextmanager
def autocast_as(state: dict):
    """Autocast as ``state`` (:func:`autocast_state`) says, for the device types it names, within the block."""
    with contextlib.ExitStack() as stack:
        for dt, (enabled, dtype) in state.items():
            if torch.is_autocast_enabled(dt) != enabled or (enabled and torch.get_autocast_dtype(dt) != dtype):
                stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled))
        yield


def rng_states() -> list:
    """torch's default generators' states: the CPU one's, and each CUDA device's once CUDA is initialised."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def group_tensors(groups) -> list:
    """The tensors among the values of ``groups`` (param group dicts, or stamped hyperparameters) other than the
    parameters, also inside a tuple or list (Adam's tensor betas)."""
    return tensors_in([v for g in groups for k, v in g.items() if k != "params"])


def tensors_in(values) -> list:
    """The tensors among ``values``, also in lists, tuples and dicts at any depth."""
    found, todo = [], list(values)
    while todo:
        a = todo.pop()
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            todo.extend(a)
        elif isinstance(a, dict):
            todo.extend(a.values())
    return found


def set_rng_states(states: list) -> None:
    """Put back what :func:`rng_states` returned."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


def _copy(value):
    """A copy of a state or group value that a step may change in place: a tensor cloned (:func:`snapshot`; a
    deepcopy costs more, and :func:`parts_check` copies a state at every checked step), other values deep-copied (a
    list the step appends to), else :func:`snapshot` (where a value cannot be deep-copied)."""
    # (not snapshot alone, which shares what is not a tensor: it copies the optimizer's attributes and every step's
    # hyperparameters, which may hold anything, a model or a lock, that a deepcopy would copy whole or fail on)
    if isinstance(value, torch.Tensor):
        return snapshot(value)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001
        return snapshot(value)


@contextlib.contextmanager
def put_back(optimizer):
    """A trial step on ``optimizer`` inside: its groups' values, its attributes (its ``state`` with them) and torch's
    generators are put back as they were when the block ends, however it ends. Yields the groups' saved values.
    Usage: ``with put_back(opt) as saved_groups: opt.state = copies; opt.step()``"""
    groups = optimizer.param_groups
    saved_groups = [dict(g) for g in groups]
    saved_vars = dict(vars(optimizer))
    rng = rng_states()
    try:
        yield saved_groups
    finally:
        for g, saved in zip(groups, saved_groups, strict=True):
            g.clear()
            g.update(saved)
        vars(optimizer).clear()
        vars(optimizer).update(saved_vars)
        set_rng_states(rng)


def step_in_parts(optimizer, step) -> dict | None:
    """The probe's check of an optimizer declared per parameter: ``step()`` (the optimizer's own) taken in two parts,
    as overlap mode takes it, on copies of the parameters that have a gradient, of their gradients and state and of
    the groups' values (each part starting from the same values, as each deferred part starts from the stamped ones).
    The optimizer (its groups, state and attributes) and torch's generators are then put back as they were. Returns
    ``{param: (copy, copied state)}`` for :func:`parts_differ` after the real step; None where there is nothing to
    split (fewer than 2 such parameters, sparse gradients); ``{}`` where the step raised on the copies."""
    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"] if p.grad is not None]
    if len(params) < 2 or any(p.grad.is_sparse for p in params):
        return None
    copies = {}
    for p in params:
        q = p.detach().clone().requires_grad_(p.requires_grad)
        q.grad = p.grad.detach().clone()
        copies[p] = q
    state = collections.defaultdict(dict)
    for p, q in copies.items():
        if p in optimizer.state:
            state[q] = {k: _copy(v) for k, v in optimizer.state[p].items()}
    half = {id(p) for p in params[:len(params) // 2]}
    with put_back(optimizer) as saved_groups:
        try:
            optimizer.state = state
            for part in (True, False):
                for g, saved in zip(groups, saved_groups, strict=True):
                    g.clear()
                    g.update({k: _copy(v) for k, v in saved.items() if k != "params"})
                    g["params"] = [copies[p] for p in saved["params"] if p in copies and (id(p) in half) == part]
                with torch.no_grad():
                    step()
        except Exception:  # noqa: BLE001 - an optimizer that cannot step copies (keyed by its parameters' identity)
            return {}
    return {p: (q, state[q]) for p, q in copies.items()}


def same_bits(a, b) -> bool:
    """Whether two tensors hold the same values (shape, dtype, each element), a NaN matching a NaN in the same place.
    ``torch.equal`` alone takes a NaN as differing from itself: a parameter or state holding one (a diverged run,
    which plain DDP trains on) made the checks of an optimizer declared per parameter report its parts as differing
    from its whole step, a false "not per parameter" (until 2026-11-28: the probe fell back to hook mode, a later
    step raised ``PARTS_DIFFER_LATER`` and went to hook mode)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_sparse or not (a.is_floating_point() or a.is_complex()):
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def parts_differ(trial: dict | None, optimizer) -> bool:
    """Whether the real step (taken since :func:`step_in_parts` returned ``trial``) left any parameter or state value
    other than the step in parts left on the copies (bit for bit)."""
    if trial is None:
        return False
    if not trial:
        return True
    return any(not same_bits(p.detach(), q) or not _same(dict(dict.get(optimizer.state, p) or {}), dict(st))
               for p, (q, st) in trial.items())


_OWN_ATTRS = ("state", "param_groups")


def _attrs(optimizer) -> dict:
    """The optimizer's attributes but its state and groups."""
    return {k: v for k, v in vars(optimizer).items() if k not in _OWN_ATTRS}


def parts_check(optimizer, hparams: list, members: list, autocast: dict, inference: bool,
                bucketed: set) -> PartsCheck | None:
    """At an overlap-mode ``step()`` of an optimizer declared per parameter: copies of what its step starts from (the
    parameters with a gradient, their state, the optimizer's attributes), for :func:`whole_step` once every part is
    applied. None where there is nothing to split (fewer than 2 such parameters)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if len(params) < 2 or any(p.grad.is_sparse for p in params):
        return None
    with torch.no_grad():
        before = {id(p): p.detach().clone() for p in params}
        state = {id(p): {k: _copy(v) for k, v in (dict.get(optimizer.state, p) or {}).items()} for p in params}
        grads = {id(p): p.grad.detach().clone() for p in params if id(p) not in bucketed}
    return PartsCheck(params, before, state, {k: snapshot(v) for k, v in _attrs(optimizer).items()}, hparams,
                      members, autocast, inference, grads, {id(p) for p in params if id(p) in bucketed})


def _same(a, b) -> bool:
    """Whether two state or attribute values are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(v, b[k]) for k, v in a.items())
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot be compared: taken as different
        return False


def whole_step(optimizer, step, check: PartsCheck):
    """The step ``check`` holds, taken whole (as DDP takes it) on its copies, the optimizer put back as it is after
    the parts (its groups, state, attributes; torch's generators). Returns None where it matches what the parts left
    (parameters, state and attributes, bit for bit), else ``(values, states, attrs)``, what the whole step gave (each
    keyed by ``id(param)``, and the attributes it changed; ``values`` None where the whole step raised). The step
    reads the optimizer's attributes as they were at ``step()``: a deferred part reads them later, so one the loop
    sets between ``step()`` and the next forward (a limit lowered) shows here as a difference."""
    copies = {}
    for p in check.params:
        q = check.before[id(p)].requires_grad_(p.requires_grad)
        q.grad = check.grads.get(id(p))
        copies[id(p)] = q
    state = collections.defaultdict(dict)
    for p in check.params:
        if check.state[id(p)]:
            state[copies[id(p)]] = check.state[id(p)]
    groups = optimizer.param_groups
    with put_back(optimizer) as saved_groups:
        try:
            # (its attributes as at step(): one the loop set after step(), a clipping limit lowered, is not this
            # step's)
            vars(optimizer).clear()
            vars(optimizer).update({**check.attrs, "param_groups": groups})
            optimizer.state = state
            for i, g in enumerate(groups):
                g.clear()
                if i < len(check.hparams):
                    g.update({k: _copy(v) for k, v in check.hparams[i].items()})
                    g["params"] = [copies[id(p)] for p in check.members[i] if id(p) in copies]
                else:
                    g.update(saved_groups[i])
                    g["params"] = []
            with torch.inference_mode(check.inference), torch.no_grad(), autocast_as(check.autocast):
                step()
            attrs = _attrs(optimizer)
        except Exception:  # noqa: BLE001 - the whole step raised where the parts did not: they differ
            return None, {}, {}
    states = {id(p): state.get(copies[id(p)], {}) for p in check.params}
    values = {id(p): copies[id(p)].detach() for p in check.params}
    same = all(same_bits(p.detach(), values[id(p)]) and _same(dict(dict.get(optimizer.state, p) or {}),
                                                                 dict(states[id(p)])) for p in check.params)
    # an attribute the whole step changes (a count of its calls) must be as the parts left it; the others may have
    # been set by the loop since step()
    changed = {k: v for k, v in attrs.items() if k not in check.attrs or not _same(v, check.attrs[k])}
    now = _attrs(optimizer)
    if same and all(k in now and _same(now[k], v) for k, v in changed.items()):
        return None
    return values, states, changed


def written(tensors: list, versions: list) -> bool:
    """Whether any of ``tensors`` was written in place since ``versions`` (their ``_version``s) were taken."""
    return any(t._version != v for t, v in zip(tensors, versions, strict=True))


def coupled_steps(optimizer) -> bool:
    """Whether one parameter's update depends on which others the same ``step()`` takes: Adafactor with
    ``eps[0] = None`` (the default) in a group of several dtypes uses the first parameter's dtype's epsilon for all
    (torch 2.13). Every other optimizer of ``PER_PARAMETER_OPTIMIZERS`` was found per parameter with every option."""
    if type(optimizer).__name__ != "Adafactor":
        return False
    for group in optimizer.param_groups:
        eps = group.get("eps")
        first = eps[0] if isinstance(eps, (tuple, list)) and eps else eps
        if first is None and len({p.dtype for p in group["params"]}) > 1:
            return True
    return False


def compiled_step(step) -> bool:
    """Whether ``optimizer.step()`` is being traced by torch.compile now (a compiled training step that calls it),
    or the step itself is a compiled function (``opt.step = torch.compile(opt.step)``)."""
    return torch.compiler.is_compiling() or hasattr(step, "_torchdynamo_orig_callable")


def wrapped_step(optimizer) -> bool:
    """Whether ``optimizer.step`` is a function of the user's: an instance attribute other than torch's LR scheduler
    wrapper (recognised by its code, not by its ``_wrapped_by_lr_sched`` flag, which ``functools.wraps`` copies onto a
    user's wrapper of it) and than a compiled step (the probe sees that one), or a class ``step`` of the user's
    (:func:`class_step_wrapped`): the deferred step would call it once per part, on that part's parameters only. Until
    2026-11-27 such a wrapper was called so, silently: one that scaled the gradients by their global norm left the
    parameters 1.1e-3 from DDP after 8 SGD steps at 2 ranks, and a call counter logged 13 calls for 8 steps (idiom
    ``wrapped_optimizer_step``)."""
    import torch.optim.lr_scheduler as lr_scheduler
    step = optimizer.__dict__.get("step")
    if step is not None and not hasattr(step, "_torchdynamo_orig_callable"):
        code = getattr(step, "__code__", None)
        ours = os.path.join("optim", os.path.basename(lr_scheduler.__file__).replace(".pyc", ".py"))
        if not (code is not None and code.co_filename.endswith(ours) and code.co_name == "wrapper"):
            return True
    return class_step_wrapped(type(optimizer))


def class_step_wrapped(cls) -> bool:
    """Whether ``cls.step`` is a function of the user's, not torch's: some function of its chain of wrappers
    (``__wrapped__``, as ``functools.wraps`` leaves it) is not torch's own code, e.g. ``torch.optim.SGD.step``
    replaced by a call counter or a gradient scaling (only torch's optimizers are asked: a user's own optimizer class
    is not known per parameter anyway). Until 2026-11-27 such a class-level wrapper went unseen, as an instance one
    had (:func:`wrapped_step`)."""
    root = os.path.dirname(torch.__file__) + os.sep
    f = getattr(cls, "step", None)
    for _ in range(32):  # (a chain of wrappers has a few links; a cycle of __wrapped__ must not loop forever)
        code = getattr(f, "__code__", None)
        if code is None or not os.path.abspath(code.co_filename).startswith(root):
            return True
        f = getattr(f, "__wrapped__", None)
        if f is None:
            return False
    return True


def step_hooks(optimizer) -> int:
    """How many step hooks will run around ``optimizer.step()``: its own pre and post hooks, and the global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``), not counting the shim's own."""
    import torch.optim.optimizer as optim
    own = len(getattr(optimizer, "_optimizer_step_pre_hooks", ())) + \
        len(getattr(optimizer, "_optimizer_step_post_hooks", ()))
    glob = [h for d in (optim._global_optimizer_pre_hooks, optim._global_optimizer_post_hooks) for h in d.values()]
    return own + sum(1 for h in glob if not getattr(h, "tensorlane", False))


@contextlib.contextmanager
def step_hooks_hidden(optimizer):
    """Take the optimizer's step hooks and the global ones (not the shim's own) out of the way for a block: a deferred
    part of a step stamped with none (they were registered after that ``step()``, so under DDP they did not run for
    it). The dictionaries are edited in place (another thread's step in that window runs without them: left); a hook
    registered meanwhile (another thread's: the training thread's, while a validation thread applies the step) is
    kept, after them, and its handle still removes it (until 2026-11-29 it was dropped: an EMA in a post-hook never
    ran, silently). Usage: ``with step_hooks_hidden(opt): opt.step()``"""
    import torch.optim.optimizer as optim
    if not step_hooks(optimizer):
        yield
        return
    own = [getattr(optimizer, name) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
           if hasattr(optimizer, name)]
    hidden = [(d, dict(d)) for d in (*own, optim._global_optimizer_pre_hooks, optim._global_optimizer_post_hooks)]
    try:
        for d, kept in hidden:
            for key, h in kept.items():
                if not getattr(h, "tensorlane", False):
                    del d[key]
        yield
    finally:
        for d, kept in hidden:
            meanwhile = {key: h for key, h in d.items() if key not in kept}
            d.clear()
            d.update(kept)
            d.update(meanwhile)


class StateView(collections.defaultdict):
    """``optimizer.state`` in overlap mode: used by anything but the shim's own steps while updates are pending
    (between ``step()`` and the next forward: an optimizer state reset, a read of Adam's moments, a param group
    added), it first applies them (``Deferred.on_state_use``: a flush), as DDP's step would have done by then.
    Copied or pickled, it is a plain ``defaultdict``.

    Usage: ``optimizer.state = StateView(optimizer.state, deferred)`` (``Deferred.watch_state`` does it)
    """

    def __init__(self, state, deferred):
        super().__init__(dict, state)
        self.deferred = deferred
        self.quiet_depth = 0

    @contextlib.contextmanager
    def quiet(self):
        """The shim's own step: its uses of the state need no flush."""
        self.quiet_depth += 1
        try:
            yield
        finally:
            self.quiet_depth -= 1

    def _use(self) -> None:
        d = self.deferred
        if not self.quiet_depth and d.pending and d.on_state_use is not None:
            d.on_state_use()

    def plain(self) -> collections.defaultdict:
        return collections.defaultdict(dict, dict.items(self))

    def copy(self) -> collections.defaultdict:
        """A shallow copy, as ``optimizer.state.copy()`` and ``copy.copy`` give under DDP: a ``defaultdict`` (the
        inherited ones gave a plain ``dict``, and ``copy.copy`` raised a TypeError), once the pending updates are
        applied."""
        self._use()
        return self.plain()

    __copy__ = copy

    def __reduce__(self):  # (copy.deepcopy, pickle, torch.save: the pending updates applied first)
        self._use()
        return (collections.defaultdict, (dict,), None, None, iter(dict.items(self)))


def _state_method(name):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._use()
        return base(self, *args, **kwargs)
    method.__name__ = name
    return method


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "get", "keys",
              "values", "items", "pop", "popitem", "clear", "update", "setdefault", "__eq__", "__repr__"):
    setattr(StateView, _name, _state_method(_name))


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the caller of this function, of the first frame outside torch and
    tensorlane: the line of the training loop that a warning concerns."""
    import tensorlane
    import tensorlane.policies

    own = (*tensorlane.__path__, os.path.dirname(os.path.abspath(__file__)), *tensorlane.policies.__path__)
    # (each package's folder, not the folder above the shim: in an editable install that is the checkout, whose
    # tests and scripts are the user's code)
    skip = tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), *own))
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(skip):
        f, level = f.f_back, level + 1
    return level


def _span(t) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` of a tensor's storage (None when it has none: sparse, meta, empty)."""
    try:
        with _DISABLE_TORCH_FUNCTION():  # the shim's own look at the storage is no use of it (STORAGE_ACCESS)
            st = t.untyped_storage()
        start = st.data_ptr()
        return (start, start + st.nbytes()) if start else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _tensors(args, kwargs):
    """The tensors among a torch function's arguments, and in the lists and tuples among them (``_foreach_*``)."""
    # (not tensors_in: this runs for every torch operation while a watch is armed, so it is lazy, an any() over it
    # stopping at the first watched tensor, and one level deep, where torch passes tensors or lists of them; a
    # TorchScript call's or a param group's values may nest deeper, in dicts too: those take tensors_in)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _function_name(func) -> str:
    """A torch function's name; for a property's getter or setter, the property's."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _on_stack(mode) -> bool:
    """Whether ``mode`` is on this thread's torch-function mode stack."""
    return any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


def _insert_low(mode) -> None:
    """Put ``mode`` on this thread's torch-function mode stack below the modes already there (above a
    ``DeviceContext``, ``torch.device(...)`` or ``set_default_device``, which keeps the bottom)."""
    from torch.utils._device import DeviceContext

    n = torch._C._len_torch_function_stack()
    held = [torch._C._pop_torch_function_stack() for _ in range(n)][::-1]  # bottom first
    keep = 0
    while keep < len(held) and isinstance(held[keep], DeviceContext):
        keep += 1
    for m in (*held[:keep], mode, *held[keep:]):
        torch._C._push_on_torch_function_stack(m)


def _take_out(mode) -> bool:
    """Remove ``mode`` from this thread's torch-function mode stack wherever it is (the modes above it stay, in
    order); False when it is not there."""
    n = torch._C._len_torch_function_stack()
    for i in range(n - 1, -1, -1):
        if torch._C._get_function_stack_at(i) is mode:
            above = [torch._C._pop_torch_function_stack() for _ in range(n - 1 - i)]
            torch._C._pop_torch_function_stack()
            for m in reversed(above):
                torch._C._push_on_torch_function_stack(m)
            return True
    return False


class ScriptCalls:
    """Calls of TorchScript functions and methods from Python (``torch.jit.script`` of a function, a scripted or
    traced module's ``forward`` or other method called directly): their operations run in C++, where no
    torch-function mode sees them, so a :class:`UseGuard` is told of each call here instead. While any hook is
    registered, ``torch.jit.ScriptFunction.__call__`` and ``torch.ScriptMethod.__call__`` are wrapped so that each
    hook sees ``(callable, args, kwargs)`` before the call runs; with none, torch's own are back in place (nothing
    is wrapped, nothing costs).

    Usage: ``handle = SCRIPT_CALLS.register(hook)``; ``handle.remove()``
    """

    def __init__(self):
        self.hooks: dict = {}  # key -> hook, in registration order
        self.originals: dict = {}  # the class -> its own __call__, while wrapped
        self.next_key = 0

    def register(self, hook):
        key, self.next_key = self.next_key, self.next_key + 1
        self.hooks[key] = hook
        if not self.originals:
            for cls in (torch._C.ScriptFunction, torch._C.ScriptMethod):
                self.originals[cls] = own = cls.__call__
                cls.__call__ = self._wrapper(own)
        return _WrapHandle(self, key)

    def _wrapper(self, own):
        hooks = self.hooks

        def call(fn, *args, **kwargs):
            for hook in list(hooks.values()):
                hook(fn, args, kwargs)
            return own(fn, *args, **kwargs)
        return call

    def remove(self, key) -> None:
        self.hooks.pop(key, None)
        if not self.hooks:
            for cls, own in self.originals.items():
                cls.__call__ = own
            self.originals = {}


class _WrapHandle:
    """One registration with a wrapper registry (:class:`ScriptCalls`, :class:`CompiledCalls`,
    :class:`DisabledCalls`): ``remove()`` takes it back, and the last one out puts torch's own function back."""

    def __init__(self, calls, key: int):
        self.calls, self.key = calls, key

    def remove(self) -> None:
        self.calls.remove(self.key)


SCRIPT_CALLS = ScriptCalls()


class _WrapRegistry:
    """Registrations of a wrapper of torch's (the shim's modes on a stack register, and take it back when popped):
    the first registration wraps (``_wrap``; an exception there refuses the registration), the last one out puts
    torch's own back (``_unwrap``). Usage: ``handle = registry.register()``; ``handle.remove()``"""

    def __init__(self):
        self.keys: set = set()
        self.next_key = 0

    def register(self):
        key, self.next_key = self.next_key, self.next_key + 1
        if not self.keys:
            self._wrap()
        self.keys.add(key)
        return _WrapHandle(self, key)

    def remove(self, key) -> None:
        self.keys.discard(key)
        if not self.keys:
            self._unwrap()

    def _wrap(self) -> None:
        raise NotImplementedError

    def _unwrap(self) -> None:
        raise NotImplementedError


class CompiledCalls(_WrapRegistry):
    """Calls of ``torch.compile``d functions and modules while one of the shim's modes is on a thread's stack.
    dynamo compiles (and guards) a frame with the torch-function modes on the stack at its call, tracing their
    ``__torch_function__`` into the compiled code: with the shim's modes there, a compiled frozen teacher was compiled
    again (graph breaks where the guard looks at a tensor's memory) and rounded differently from DDP's compiled code,
    silently (until 2026-11-28: soft targets 6e-8 off from the third iteration, the student 9e-8 relative off DDP
    after 8 steps at 2 ranks, idiom ``compiled_teacher``), and a compiled function reading the model's weights traced
    the guard's flush, the shim's own optimizer steps included, and raised inside it. Every call of a compiled
    function or module (``OptimizedModule``'s ``forward`` is one) runs ``OptimizeContext``'s ``on_enter``, which calls
    ``torch._dynamo.eval_frame.install_generation_tagging_init`` with dynamo's frame evaluation off, before any of
    the compiled frame runs (torch 2.13): while any of the shim's modes is on a stack (registered by ``push``, removed
    by ``pop``), that function is wrapped so that :func:`_before_compiled` runs first; with none, torch's own is
    back (nothing is wrapped, nothing costs).

    Usage: ``handle = COMPILED_CALLS.register()``; ``handle.remove()``
    """

    def __init__(self):
        super().__init__()
        self.original = None  # torch's install_generation_tagging_init, while wrapped

    def _wrap(self) -> None:
        from torch._dynamo import eval_frame  # (loaded with this module: torch.compiler.disable below)

        own = getattr(eval_frame, "install_generation_tagging_init", None)
        if own is None:  # refused at the first arming, before a compiled call could run unseen
            raise RuntimeError(
                "tensorlane's overlap mode cannot see calls of torch.compile'd functions with this torch "
                f"({torch.__version__}: torch._dynamo.eval_frame has no install_generation_tagging_init, where "
                "torch 2.13 starts every compiled call); such a call between step() and the next forward could "
                "read weights before their update. Attach without the optimizer (hook mode): "
                "shim.attach(ddp_model)")
        self.original = own

        @functools.wraps(own)
        def install_generation_tagging_init(*args, **kwargs):
            _before_compiled()
            return own(*args, **kwargs)
        eval_frame.install_generation_tagging_init = install_generation_tagging_init

    def _unwrap(self) -> None:
        if self.original is not None:
            from torch._dynamo import eval_frame

            eval_frame.install_generation_tagging_init, self.original = self.original, None


COMPILED_CALLS = CompiledCalls()


# torch's own, as imported: the shim's own use of it is not a use of the weights (DisabledCalls wraps the public names)
_DISABLE_TORCH_FUNCTION = torch._C.DisableTorchFunction


class DisabledCalls(_WrapRegistry):
    """Blocks under ``torch._C.DisableTorchFunction()`` (also ``torch.DisableTorchFunction``) while one of the shim's
    modes is on a thread's stack: torch-function modes are off there, so no mode sees what the block reads. A mode
    of the user's whose handler runs each operation that way (a pattern of user-written modes and tensor
    subclasses: ``with torch._C.DisableTorchFunction(): return func(*args, **kwargs)``) entered around an EMA
    after ``step()`` read the weights before their update, silently, until 2026-11-28 (7.7e-3 relative off DDP
    after 8 Adam steps at 2 ranks, idiom ``user_mode_disabling_torch_function``). While any of the shim's modes is
    on a stack (registered by ``push``, removed by ``pop``) both names are a wrapper whose entry on the thread of
    those modes first runs :func:`_before_compiled` (a use of every watched parameter and gradient, as for a compiled
    call); with none, torch's own class is back (nothing is wrapped, nothing costs). Code that bound the class
    before (``from torch._C import DisableTorchFunction``) is not seen. The wrapper is one class, made once, and
    dynamo traces it as torch's own (a compiled call has run :func:`_before_compiled` at its start): until
    2026-11-28 a new class at each arming made dynamo recompile a compiled function entering the block at every
    iteration (its guard on the name's identity), graph-broken there, until the recompile limit (8) left it eager.

    Usage: ``handle = DISABLED_CALLS.register()``; ``handle.remove()``
    """

    OWNERS = (torch._C, torch)

    def _wrap(self) -> None:
        for owner in self.OWNERS:
            if getattr(owner, "DisableTorchFunction", None) is _DISABLE_TORCH_FUNCTION:
                owner.DisableTorchFunction = _DISABLE_SEEN

    def _unwrap(self) -> None:
        for owner in self.OWNERS:
            if getattr(getattr(owner, "DisableTorchFunction", None), "tensorlane", False):
                owner.DisableTorchFunction = _DISABLE_TORCH_FUNCTION


def _disable_seen(own):
    """A stand-in for torch's ``DisableTorchFunction`` (``own``) whose entry runs :func:`_before_compiled` first. It
    passes for torch's class where code checks or saves it (torch's class cannot be subclassed): ``isinstance``
    either way (its instances report torch's class as their ``__class__``; torch's instances are its instances),
    ``issubclass``, and pickling it by name (``torch._C.DisableTorchFunction``, which it is while installed: it loads
    as torch's class). Until 2026-11-28, while the shim's modes were on a stack (overlap mode from the first
    ``step()``), ``pickle.dumps(torch._C.DisableTorchFunction)`` raised and ``isinstance`` of a block made there
    against torch's class (bound before) was False. Pickling torch's class itself, bound before (``from torch._C
    import DisableTorchFunction``), still raises while the stand-in is installed (pickle finds the name taken)."""

    class Passes(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, own) or type.__instancecheck__(cls, obj)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, own) or type.__subclasscheck__(cls, sub)

    class DisableTorchFunction(metaclass=Passes):
        __doc__ = own.__doc__
        __module__ = own.__module__
        __qualname__ = own.__qualname__
        tensorlane = True

        @property
        def __class__(self):
            return own

        def __init__(self):
            self._inner = own()

        def __enter__(self):
            _before_compiled()
            return self._inner.__enter__()

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)
    return DisableTorchFunction


_DISABLE_SEEN = _disable_seen(_DISABLE_TORCH_FUNCTION)


def _dynamo_traces_as_torchs(wrapper) -> None:
    """Make dynamo trace ``wrapper`` (installed under torch's name) as torch's ``DisableTorchFunction``: one of its
    supported context managers, matched by the public name's identity at trace time (torch 2.13); a torch whose
    dynamo lacks that table traces the wrapper (a graph break there, still exact).
    Usage: ``_dynamo_traces_as_torchs(_DISABLE_SEEN)``"""
    try:
        from torch._dynamo.variables import torch as dynamo_torch
    except ImportError:
        return
    table = getattr(dynamo_torch, "supported_ctx_manager_classes", None)
    if isinstance(table, dict):
        table[wrapper] = None


_dynamo_traces_as_torchs(_DISABLE_SEEN)
DISABLED_CALLS = DisabledCalls()


def _before_compiled() -> None:
    """A compiled function or module is about to run on this thread (dynamo's frame evaluation still off): each of
    the shim's modes on this thread's stack acts on what the call may use. The guard applies every pending update
    first, waiting for the all-reduces in flight (compiled code may read any weight through its closures), and
    leaves the stack, so that dynamo compiles and runs the call as under plain DDP; that iteration loses its overlap.
    The gradient watch, in overlap mode, makes ``.grad`` DDP's average first if it still watches gradients (a
    compiled gradient norm), and stays on the stack with nothing to watch: dynamo traces it as an operation's plain
    call (bit for bit as without it: a compiled teacher, 2026-11-28), and it watches the next backward's gradients.
    Usage: called by the wrapper :class:`CompiledCalls` installs."""
    with _because("compiled"):
        _each_before_compiled(_modes_on_this_thread())


_CAUSE = threading.local()  # .what: why the shim's modes act on every watched tensor now ("fork", "compiled")


@contextlib.contextmanager
def _because(what: str):
    """Within: :func:`cause` says ``what`` on this thread (for the shim's warning), as it was after."""
    before = getattr(_CAUSE, "what", None)
    _CAUSE.what = what
    try:
        yield
    finally:
        _CAUSE.what = before


def cause():
    """Why the guard applies every pending update now on this thread: ``"fork"`` (an ``os.fork()``),
    ``"compiled"`` (a compiled call), or None (a use of a parameter). Usage: in the guard's ``on_use``"""
    return getattr(_CAUSE, "what", None)


def _each_before_compiled(modes: list) -> None:
    """``before_compiled()`` of each of ``modes``, the guard first: its flush leaves the averages in ``.grad``.
    Usage: ``_each_before_compiled(_modes_on_this_thread())``"""
    for m in sorted(modes, key=lambda m: not isinstance(m, UseGuard)):
        m.before_compiled()


def _script_module_tensors(cpp_module) -> list:
    """The parameters and buffers of a TorchScript module (C++, a ``ScriptMethod``'s ``owner``), its submodules'
    included: the model's own where it was scripted or traced from the model."""
    try:
        it = torch._C._jit_debug_module_iterators(cpp_module)  # (what RecursiveScriptModule's own lists use)
        return [*it["parameters_r"], *it["buffers_r"]]
    except (AttributeError, KeyError, RuntimeError):  # another torch: the public, slower way
        module = torch.jit._recursive.wrap_cpp_module(cpp_module)
        return [*module.parameters(), *module.buffers()]


class StackMode(TorchFunctionMode):
    """A mode the shim leaves on the training thread's torch-function mode stack across the loop's own code (from
    a forward's end or ``step()`` to the next forward). It goes in below the modes already there and comes out
    from wherever it is, so that a mode of the user's entered before it and exited after (``with Counter():
    loss.backward(); opt.step()``) pops itself at its exit, as it does without the shim: ``TorchFunctionMode``'s
    ``__exit__`` pops whatever is on top, and until 2026-11-27 that was the shim's mode, lost from then on (an EMA
    after ``step()`` read weights before their update, 4e-3 off), while the user's stayed on the stack.
    ``handling`` counts this mode's handlers running: torch takes a mode off the stack while its handler runs and
    puts it back after, so it is not to be taken out (nor put in again) meanwhile.
    """

    def __init__(self):
        super().__init__()
        self.thread: int | None = None  # the thread whose mode stack holds it (None: on no stack)
        self.handling = 0
        self.wraps: list = []  # while on a stack: its registrations with COMPILED_CALLS and DISABLED_CALLS
        self.retired = False  # for good (retire()): passes every operation through until its thread takes it out
        install_fast_path_bypass()

    def before_fast_path(self, module, args, kwargs) -> None:
        """``module`` (a torch module with a fused fast path, :data:`FAST_PATH_MODULES`) is about to run with this
        mode off the stack: act on the uses the mode would have seen there (nothing by default)."""

    def before_compiled(self) -> None:
        """A ``torch.compile``d function or module is about to run on this thread (:func:`_before_compiled`): act on
        what the call may use (nothing by default)."""

    def push(self) -> None:
        """On this thread's mode stack, below the modes there (once: a second push changes nothing)."""
        me = threading.get_ident()
        if self.retired:  # (closed: nothing is watched any more)
            return
        if self.thread == me and not self.handling and not _on_stack(self):
            self.thread = None  # taken off by someone else (code popping more modes than it pushed)
        if self.thread is None:
            if not self.wraps:  # (first: a torch it cannot serve is refused before the mode goes in)
                self.wraps = [COMPILED_CALLS.register(), DISABLED_CALLS.register()]
            _insert_low(self)
            self.thread = me
            _PUSHED[id(self)] = self

    def pop(self) -> None:
        """Off this thread's mode stack, wherever it is (not from inside its own handler)."""
        if self.thread == threading.get_ident() and not self.handling:
            _take_out(self)
            self.thread = None
            _PUSHED.pop(id(self), None)
            self._unregister()

    def retire(self) -> None:
        """For good (``close()``), from any thread: off the stack of the thread holding it. On that thread (outside
        its own handler) it is popped now. From another thread, which cannot reach that thread's stack (torch keeps
        it per thread), it gives up its registrations at once (torch's ``DisableTorchFunction`` and dynamo's hook are
        torch's own again once no other mode holds them), passes every operation through from then on (nothing
        watched, nothing applied: ``close()`` applied what was pending before), and is taken out of that thread's
        stack at the thread's next torch operation (:func:`_reap_soon`; under ``cProfile``, at its next call of one
        of torch's fused modules in eval mode). Until 2026-11-28 a ``close()`` on another thread left the
        modes on the training thread's stack, live, and both of torch's names wrapped for the rest of the process
        (``isinstance`` against torch's class and pickling it failed there)."""
        if self.thread is None:
            return
        if self.thread == threading.get_ident() and not self.handling:
            self.pop()
            return
        self.retired = True
        self._unregister()
        _reap()  # (drops it at once where its thread has ended: its stack ended with it)

    def _unregister(self) -> None:
        """Give up its registrations with COMPILED_CALLS and DISABLED_CALLS (the last one out puts torch's own back)."""
        for wrap in self.wraps:
            wrap.remove()
        self.wraps = []

    def renewed(self) -> StackMode:
        """A new mode doing this one's work (its callbacks), for another thread's stack (:func:`watching_here`)."""
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Each torch operation on its thread: :meth:`_on_operation`, then the operation, ``handling`` counted
        meanwhile; a retired mode's only the operation (:meth:`_pass_through`)."""
        kwargs = kwargs or {}
        if self.retired:
            return self._pass_through(func, args, kwargs)
        self.handling += 1
        try:
            self._on_operation(func, args, kwargs)
            return func(*args, **kwargs)
        finally:
            self.handling -= 1

    def _on_operation(self, func, args, kwargs) -> None:
        """What this mode does on ``func(*args, **kwargs)`` before it runs (nothing by default)."""

    def _pass_through(self, func, args, kwargs):
        """A retired mode's handler: the operation as without it, and this mode out of the stack right after."""
        _reap_soon()
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _off_stack(self):
        out = self.thread == threading.get_ident() and not self.handling and _take_out(self)
        try:
            yield
        finally:
            if out and self.thread is not None:  # (not if popped meanwhile: a guard disarmed off the stack)
                _insert_low(self)


_PUSHED: dict = {}  # id -> each StackMode pushed by push() and not yet popped by pop() (_modes_on_this_thread)


def _modes_on_this_thread() -> list:
    """The shim's modes on this thread's stack, not inside their own handler: those ``push()`` put there (not every
    mode ever made: a walk of those cost 3.2 us per entry of the ``DisableTorchFunction`` wrapper, 1.3 so).
    Usage: ``for m in _modes_on_this_thread(): m.before_compiled()``"""
    _reap()
    me = threading.get_ident()
    return [m for m in list(_PUSHED.values()) if m.thread == me and not m.handling and not m.retired]


def watching_here(mode: StackMode) -> StackMode:
    """``mode``, or, where it is on another thread's stack than this one's (the training loop moved to another
    thread: an iteration per task of a thread pool, a thread per epoch), a new one doing its work (``renewed()``),
    ``mode`` retired there: torch keeps a stack per thread, so it could not watch this thread. Until 2026-11-28 the
    guard and the gradient watch stayed with the first thread, and an EMA after ``step()`` on the next read the
    weights before their update, silently (3e-3 off after 10 Adam steps, one thread per iteration).
    Usage: ``d.guard = watching_here(d.guard)``"""
    if mode.thread is None or mode.thread == threading.get_ident() or mode.retired:
        return mode
    new = mode.renewed()
    mode.retire()
    return new


def _reap() -> bool:
    """Take the retired modes (:meth:`StackMode.retire`) of this thread out of its stack where they are on it and
    not in their handler, and forget those of threads that have ended; True when none of this thread's is left.
    Usage: ``_reap()`` outside any of the shim's handlers"""
    me, alive = threading.get_ident(), None
    left = False
    for m in [m for m in list(_PUSHED.values()) if m.retired]:
        if m.thread != me:
            alive = {t.ident for t in threading.enumerate()} if alive is None else alive
            if m.thread not in alive:
                m.thread = None
                _PUSHED.pop(id(m), None)
        elif not m.handling and _take_out(m):
            m.thread = None
            _PUSHED.pop(id(m), None)
        else:
            left = True
    return not left


def _before_fork() -> None:
    """``os.fork()`` (a DataLoader's workers under the fork start method, ``multiprocessing``): the child gets this
    process's memory as it is, and the all-reduces in flight complete only here (gloo's threads are not forked), so
    every pending update is applied first and watched gradients become DDP's average, as for a compiled call
    (:func:`_before_compiled`), for the shim's modes of every thread; that iteration loses its overlap. Until
    2026-11-28 a worker forked after ``step()`` held the weights before their update, and one that used them ran
    the guard's flush in the child, waiting there for all-reduces of the parent's process groups.
    Usage: registered with ``os.register_at_fork(before=...)``"""
    with _because("fork"):
        _each_before_compiled([m for m in list(_PUSHED.values()) if not m.retired and not m.handling])


def _after_fork_in_child() -> None:
    """In a forked child: none of the shim's modes is the child's (its handle's process groups are the parent's), so
    each is disarmed, taken out of the forking thread's stack (the child's one thread has it) and retired, and
    torch's ``DisableTorchFunction`` and dynamo's hook are torch's own again: the child's torch operations pass
    through no mode of the shim's, as without it. Usage: registered with ``os.register_at_fork(after_in_child=...)``"""
    me = threading.get_ident()
    for m in list(_PUSHED.values()):
        if isinstance(m, UseGuard):
            m.armed = False
            m.disarm()  # (its global hooks; off this thread's stack)
        if m.thread == me:
            _take_out(m)
        m.retired, m.thread, m.handling = True, None, 0
        m._unregister()
    _PUSHED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


_REAPING = threading.local()  # .on: this thread's profile function is _reap_soon's
REAP_EVENTS = 10000  # profile events _reap_soon waits through for its modes to come back on the stack


def _reap_soon() -> None:
    """From a retired mode's handler (where torch has the mode off the stack and puts it back after): take it out
    at this thread's next Python call or return, through a profile function of this thread's that removes itself
    once done (or after :data:`REAP_EVENTS`), and puts back a profile function of the user's that it found there,
    which it calls meanwhile. A profiler in C (``cProfile``) is left alone: there the mode stays, inert, until this
    thread calls one of torch's fused modules (:data:`FAST_PATH_MODULES`) in eval mode. Usage: ``_reap_soon()``"""
    old = sys.getprofile()
    if getattr(_REAPING, "on", False) or (old is not None and not callable(old)):
        return
    _REAPING.on, budget = True, [REAP_EVENTS]

    def reaper(frame, event, arg):
        if old is not None:
            old(frame, event, arg)
        budget[0] -= 1
        if budget[0] <= 0 or _reap():
            sys.setprofile(old)
            _REAPING.on = False
    sys.setprofile(reaper)
# torch's modules whose forward, in eval mode, takes a fused "fast path" (torch._transformer_encoder_layer_fwd,
# torch._native_multi_head_attention) only where torch.overrides.has_torch_function() is false, which any
# torch-function mode on the stack makes true: with the shim's modes there they took the slow path, which rounds
# differently (until 2026-11-28: a frozen transformer teacher's soft targets computed between step() and the next
# forward, 2.3e-2 relative off DDP after 8 steps, silently; idiom transformer_teacher_eval)
FAST_PATH_MODULES = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention)
_FAST_PATH_ORIGINAL: dict = {}  # class -> its __call__ before install_fast_path_bypass() replaced it


def _fast_path_call(cls):
    """``__call__`` for ``cls`` (a :data:`FAST_PATH_MODULES` class), run in eval mode with the shim's modes taken off
    this thread's stack (after each has acted on what the call will use: the guard applies the pending updates of
    the module's parameters first), so that torch chooses its fast path as without the shim. ``__call__``, not
    ``forward``: ``torch.jit.script`` compiles ``forward`` from its source, and a wrapper there cannot be scripted.
    With none of the shim's modes on this thread's stack, or while dynamo traces, it is torch's ``__call__`` as
    looked up at each call (``torch.fx`` replaces ``nn.Module.__call__`` while it traces: until 2026-11-28 the one of
    install time was called, so ``symbolic_trace`` traced into ``MultiheadAttention`` instead of keeping it a leaf
    and raised ``TraceError``, and ``torch.compile(fullgraph=True)`` raised on ``threading.get_ident``, in any
    process where overlap mode had once run, shim closed or not). Usage: ``cls.__call__ = _fast_path_call(cls)``"""
    own = cls.__dict__.get("__call__")  # (none in torch 2.13: nn.Module's)

    def bypass(self, *args, **kwargs):
        call = own.__get__(self) if own is not None else super(cls, self).__call__
        if self.training or torch.compiler.is_compiling():  # (the fast paths are for eval mode only)
            return call(*args, **kwargs)
        modes = _modes_on_this_thread()
        if not modes:
            return call(*args, **kwargs)
        for m in modes:
            m.before_fast_path(self, args, kwargs)
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(m._off_stack())
            return call(*args, **kwargs)
    bypass.tensorlane_fast_path = True
    return bypass


def install_fast_path_bypass() -> None:
    """Put :func:`_fast_path_call` on the :data:`FAST_PATH_MODULES` classes as their ``__call__`` (once per process).
    Usage: ``install_fast_path_bypass()``"""
    for cls in FAST_PATH_MODULES:
        if cls not in _FAST_PATH_ORIGINAL:
            _FAST_PATH_ORIGINAL[cls] = cls.__call__
            cls.__call__ = _fast_path_call(cls)


class UseGuard(StackMode):
    """Overlap mode between a stamping ``step()`` and the next forward of the model: the first torch operation
    that uses a watched parameter (or a tensor on its storage) beyond its metadata calls ``on_use()`` before it
    runs (``Handle`` passes a flush: the pending updates are applied, as DDP's step would have done). Pushed on
    the torch-function mode stack of the thread that called ``step()`` and left there, disarmed, until it can be
    popped (at the next forward, ``flush()`` or ``close()``); a disarmed guard passes every operation through.

    ``related(p)`` (optional) gives further tensors that the pending update of ``p`` changes in place: its optimizer
    state (Adam's moments, which a ``optimizer.state_dict()`` kept from an earlier step shares; until 2026-11-27 a
    ``torch.save`` of one after ``step()`` held the moments before the update, silently,
    ``kept_tensors_saved_wrapper_hook``). Their memory is watched as the parameter's, until ``p``'s update is applied.

    Usage: ``guard = UseGuard(handle.flush); guard.arm(params)`` after ``step()``; ``guard.disarm()`` at forward
    """

    def __init__(self, on_use, related=None):
        super().__init__()
        self.on_use = on_use
        self.related = related
        self.ids: set = set()
        self.starts: list = []  # sorted storage starts of the watched parameters (and related tensors), their ends
        self.ends: list = []
        self.owned: dict = {}  # id(param) -> the storage spans of its related tensors
        self.armed = False
        self.calls = None  # while armed: a global forward pre-hook that sees TorchScript modules called (_called)
        self.script_calls = None  # while armed: sees TorchScript functions and methods called (_script_called)
        self.scripts: list = []  # while armed: (TorchScript module (C++), whether it holds a watched parameter)

    def renewed(self) -> UseGuard:
        """A new guard with this one's flush and related tensors (:func:`watching_here`)."""
        return UseGuard(self.on_use, self.related)

    def arm(self, params) -> None:
        """Watch ``params`` from now on (putting the guard on this thread's mode stack if it is not there)."""
        self.ids = {id(p) for p in params}
        self.owned, self.scripts = {}, []
        spans = [s for p in params if (s := _span(p))]
        if self.related is not None:
            for p in params:
                extra = [s for t in self.related(p) if (s := _span(t))]
                if extra:
                    self.owned[id(p)] = extra
                    spans += extra
        spans.sort()
        self.starts, self.ends = [a for a, _ in spans], [b for _, b in spans]
        self.push()
        self.armed = self.thread == threading.get_ident()  # on another thread than the one holding it: not watched
        if self.armed and self.calls is None:
            self.calls = torch.nn.modules.module.register_module_forward_pre_hook(self._called)
            self.script_calls = SCRIPT_CALLS.register(self._script_called)

    def _called(self, module, _args) -> None:
        """A module is called while the guard is armed: a TorchScript one (``torch.jit.trace``/``script`` of the
        model, which shares its parameters) runs its operations in C++, where no torch-function mode sees them, so
        its call is a use of its parameters and buffers. Until 2026-11-27 a model traced before training and run
        after ``step()`` read the weights before their update, silently: 9e-2 relative off (idiom
        ``functional_call_traced``)."""
        if self.armed and isinstance(module, torch.jit.ScriptModule) and self.thread == threading.get_ident() \
                and self._script_uses(getattr(module, "_c", module), lambda: [*module.parameters(), *module.buffers()]):
            self.armed = False
            self.on_use()

    def _script_called(self, fn, args, kwargs) -> None:
        """A TorchScript function or method is called from Python while the guard is armed: a use if it can reach a
        watched parameter (:func:`_script_tensors`). Until 2026-11-28 such a call read the weights before their
        update, silently: a logged ``scripted_norm(weight)`` after ``step()`` and a traced model's ``forward``
        called directly, 1.1e-1 relative off after 8 steps (idiom ``scripted_function_reads_weights``)."""
        if not self.armed or self.thread != threading.get_ident():
            return
        owner = getattr(fn, "owner", None)  # a method's module (C++): a scripted module shares the model's tensors
        if self.uses((tensors_in([*args, *kwargs.values()]),), {}) or \
                (owner is not None and self._script_uses(owner, lambda: _script_module_tensors(owner))):
            self.armed = False
            self.on_use()

    def before_fast_path(self, module, args, kwargs) -> None:
        """A fused forward of torch's is about to run off the stack: a use if it can reach a watched tensor."""
        if self.armed and self.uses(([*module.parameters(), *module.buffers()], args), kwargs):
            self.armed = False
            self.on_use()

    def before_compiled(self) -> None:
        """A compiled function or module is about to run (:func:`_before_compiled`): a use of every watched
        parameter (compiled code may reach any through its closures), so every pending update is applied first.
        Called on another thread than the guard's (an ``os.fork()`` there, :func:`_before_fork`), the guard stays
        armed while that thread applies them, so that a use on the guard's thread meanwhile waits for them (until
        2026-11-28 it was disarmed first: such a use read the weights before their update, silently; tests/
        test_shim.py::test_weights_read_while_another_thread_applies_the_step_are_updated, ``fork``)."""
        if self.armed and self.thread not in (None, threading.get_ident()):
            self.on_use()  # (each update applied leaves the guard, which disarms once none is left)
            return
        if self.armed:
            self.armed = False
            self.on_use()
        self.disarm()  # (off the stack: nothing is left to watch)

    def _script_uses(self, cpp_module, tensors) -> bool:
        """Whether a TorchScript module holds a watched parameter (``tensors()`` gives its tensors), found once per
        arming (a module's call, then its ``forward`` method, ask twice; its tensors cost 1-2 ms for 100 modules)."""
        for seen, uses in self.scripts:
            if seen == cpp_module:
                return uses
        uses = self.uses((tensors(),), {})
        self.scripts.append((cpp_module, uses))
        return uses

    def disarm(self) -> None:
        """Stop watching; the guard leaves this thread's stack (not from inside its own handler: later). Cheap when
        there is nothing to do (every forward calls it)."""
        if not self.armed and self.thread is None:
            return
        self.armed = False
        self.ids, self.starts, self.ends, self.owned, self.scripts = set(), [], [], {}, []
        if self.calls is not None:
            self.calls.remove()
            self.calls = None
        if self.script_calls is not None:
            self.script_calls.remove()
            self.script_calls = None
        self.pop()

    def retire(self) -> None:
        """As :meth:`StackMode.retire`, the handle's flush let go (a retired guard held on another thread's stack
        must not keep the model alive)."""
        self.disarm()
        super().retire()
        if self.retired:
            self.on_use = self.related = None

    @contextlib.contextmanager
    def paused(self):
        """Off the stack for a block that only touches metadata (``zero_grad``): no cost per operation there."""
        with self._off_stack():
            yield

    def forget(self, p) -> None:
        """``p``'s update has been applied: its use no longer needs a flush."""
        self.ids.discard(id(p))
        for span in (_span(p), *self.owned.pop(id(p), ())):
            i = bisect.bisect_left(self.starts, span[0]) if span else len(self.starts)
            if i < len(self.starts) and self.starts[i] == span[0]:
                # ends first: uses() on the guard's thread, meanwhile (this runs where the update is applied, on
                # any thread), then finds a watched span's end too far, a use (one flush too many), never a watched
                # span missed (until 2026-11-28, starts first: an alias of a parameter still pending was missed
                # there; tests/test_shim.py::test_guard_forgetting_on_another_thread_misses_no_watched_alias)
                del self.ends[i]
                del self.starts[i]

    def uses(self, args, kwargs) -> bool:
        """Whether any tensor among the arguments is a watched parameter or lives on one's storage."""
        for t in _tensors(args, kwargs):
            if id(t) in self.ids:
                return True
            if self.starts:
                try:
                    ptr = t.data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue
                i = bisect.bisect_right(self.starts, ptr) - 1
                try:
                    if i >= 0 and ptr < self.ends[i]:
                        return True
                except IndexError:  # (forget() on another thread in between: taken as a use, see there)
                    return True
        return False

    def _on_operation(self, func, args, kwargs) -> None:
        """Armed, the first operation using a guarded parameter beyond its metadata disarms it and calls ``on_use``."""
        name = _function_name(func)
        if self.armed and (name not in METADATA or name in STORAGE_ACCESS) and self.uses(args, kwargs):
            self.armed = False
            self.on_use()


class GradWatch(StackMode):
    """Calls ``on_read()`` before the first torch operation on the training thread that uses a watched gradient (one
    that DDP wrote at the last synchronized backward) beyond its metadata and zeroing it: a logged norm, a step
    skipped on it, clipping. ``Handle`` passes a function that, while probing, notes the read (the probe then falls
    back to hook mode) and, in overlap mode, makes ``.grad`` DDP's average first (where ``.grad`` holds this rank's
    own gradient until the deferred step). Pushed on the training thread's mode stack at the end of the model's
    forward (``push``), popped at the next forward (``pop``); it holds the watched gradients, so that their ids stay
    theirs, and forgets them after the first read (``unwatch``).

    Usage: ``watch = GradWatch(on_read); watch.push()`` after forward; ``watch.watch(grads)`` after backward
    """

    def __init__(self, on_read):
        super().__init__()
        self.on_read = on_read
        self.on_compiled = None  # set by Handle: a compiled call may read the watched gradients (before_compiled)
        self.grads: list = []
        self.ids: set = set()
        self.quiet = 0

    def renewed(self) -> GradWatch:
        """A new watch with this one's callbacks (:func:`watching_here`)."""
        new = GradWatch(self.on_read)
        new.on_compiled = self.on_compiled
        return new

    def before_compiled(self) -> None:
        """A compiled function or module is about to run: it may read a watched gradient (through a closure), unseen
        (dynamo would trace this mode's handler, not run it), so the watch stops watching and ``on_compiled()`` acts
        as on a read (in overlap mode ``.grad`` becomes DDP's average first; while probing it is DDP's average
        already, and nothing is noted)."""
        if self.ids and not self.quiet and self.thread not in (None, threading.get_ident()):
            # (an os.fork() on another thread: watched until .grad holds the averages, so that a read on the
            # training thread meanwhile waits for them)
            if self.on_compiled is not None:
                self.on_compiled()
            self.unwatch()
        elif self.ids and not self.quiet:
            self.unwatch()
            if self.on_compiled is not None:
                self.on_compiled()

    def watch(self, grads) -> None:
        self.grads = [g for g in grads if g is not None]
        self.ids = {id(g) for g in self.grads}

    def unwatch(self) -> None:
        self.grads, self.ids = [], set()

    @contextlib.contextmanager
    def paused(self):
        """The shim's own uses (the probe's checks and real step, stamping, deferred steps, writing the averages)
        and zero_grad: not the loop reading gradients. Off the stack meanwhile (no cost per operation there), or
        inside its own handler only not noting reads. From another thread than the watch's (an ``os.fork()`` or a
        ``flush()`` there) it leaves the watch as it is: that thread's work is no read of the training thread's
        (until 2026-11-28 the watch was quiet meanwhile, and a read there did not wait for the averages)."""
        mine = self.thread in (None, threading.get_ident())
        self.quiet += mine
        try:
            with self._off_stack():
                yield
        finally:
            self.quiet -= mine

    def _on_operation(self, func, args, kwargs) -> None:
        """The first operation reading a watched gradient (not its metadata, not zeroing it) unwatches them all and
        calls ``on_read``; none while ``paused``."""
        if self.ids and not self.quiet:
            name = _function_name(func)
            if (name not in METADATA or name in STORAGE_ACCESS) and name not in GRAD_OVERWRITES and \
                    any(id(t) in self.ids for t in _tensors(args, kwargs)):
                self.unwatch()
                self.on_read()


class ForwardWatch(StackMode):
    """While probing, during the model's forward: notes (in ``deferred.early``) each parameter that a torch operation
    uses before any module holding it has begun its forward in this pass -- a parent reading a child's weight first
    (a statistic under ``no_grad``, an embedding looked up in an output layer's weight), or a module's parameter used
    by another that runs first. In overlap mode that use would come before the module's forward pre-hook applies
    the parameter's step, and nothing raises where the use saves no tensor for backward: such parameters are
    applied at the start of every forward instead. One Python call per operation, in the probe's forward only.

    Usage: ``watch = ForwardWatch(deferred); watch.push()`` at the root's pre-forward; ``watch.pop()`` at its end
    """

    def __init__(self, deferred):
        super().__init__()
        self.deferred = deferred

    def note(self, tensors) -> None:
        """Note the parameters among ``tensors`` that no module holding them has begun its forward yet."""
        d = self.deferred
        for t in tensors:
            mods = d.holders.get(id(t))
            if mods and id(t) not in d.early and not any(m in d.probe.ran for m in mods):
                d.early.add(id(t))

    def before_fast_path(self, module, args, kwargs) -> None:
        """A fused forward of torch's uses the module's parameters (its submodules' forwards do not run)."""
        self.note([*module.parameters(), *_tensors(args, kwargs)])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Note the tensors an operation uses beyond their metadata, then run it (as it always has, without
        :class:`StackMode`'s count of ``handling``)."""
        kwargs = kwargs or {}
        if self.retired:
            return self._pass_through(func, args, kwargs)
        if _function_name(func) not in METADATA:
            self.note(_tensors(args, kwargs))
        return func(*args, **kwargs)


_JIT = threading.local()  # .tracing: a ModuleHook is running its function for a torch.jit.trace of the model


def in_jit_trace() -> bool:
    """Whether the shim's hook running now was called by a ``torch.jit.trace`` of the model (:class:`ModuleHook`)."""
    return getattr(_JIT, "tracing", False)


class ModuleHook:
    """A hook the shim puts on the user's modules and optimizer. A copy of them (``copy.deepcopy``: an EMA model
    such as ``AveragedModel(model.module)``, a snapshot of the best model; pickling) is not the model being
    trained: it gets an inert hook, not a copy of the shim (whose process groups cannot be copied).

    Usage: ``module.register_forward_pre_hook(ModuleHook(handle._pre_forward))``
    """

    __slots__ = ("fn",)

    def __init__(self, fn=None):
        self.fn = fn

    @torch.compiler.disable  # under torch.compile the shim's work (waits, optimizer steps) runs eagerly, untraced
    def __call__(self, *args, **kwargs):
        if self.fn is None:
            return None
        tracing = torch._C._get_tracing_state()
        if tracing is None:
            return self.fn(*args, **kwargs)
        # torch.jit.trace of the model (after step(): the pending updates are applied here): the shim's work is not
        # the model's, and the tracer refused its futures (until 2026-11-27 the trace raised "Tried to trace Future")
        torch._C._set_tracing_state(None)
        _JIT.tracing = True
        try:
            return self.fn(*args, **kwargs)
        finally:
            _JIT.tracing = False
            torch._C._set_tracing_state(tracing)

    def __deepcopy__(self, memo):
        return ModuleHook()

    def __reduce__(self):
        return (ModuleHook, ())


def _norms(grads: list) -> list | None:
    """Each dense gradient's norm (one pass over the gradients: the probe alone pays it)."""
    dense = [g for g in grads if g is not None and not g.is_sparse]
    if not dense:
        return None
    with torch.no_grad():
        return torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in dense]).tolist()


def called_by_grad_scaler(depth: int = 8) -> bool:
    """Whether this ``step()`` is being called by ``GradScaler.step`` (which unscales, and may skip, first) of an
    enabled scaler: a disabled one (``GradScaler(enabled=False)``, the AMP switch turned off) calls the optimizer's
    step and nothing else."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if os.path.basename(f.f_code.co_filename) == "grad_scaler.py":
            return getattr(f.f_locals.get("self"), "_enabled", True) is not False
        f = f.f_back
    return False


def changed_grads(marks: list) -> list:
    """Parameters whose ``.grad`` is no longer the tensor (or version) DDP wrote at the end of backward, or was
    removed (``.grad = None`` before ``step()`` keeps DDP from updating that parameter)."""
    out = []
    for p, grad, version in marks:
        g = p.grad
        if g is None:
            if grad is not None:
                out.append(p)
        elif g is not grad or g._version != version:
            out.append(p)
    return out


def after_backward_callback(fn) -> None:
    """Run ``fn()`` at the end of the current backward pass, after DDP has copied the buckets into ``.grad``.

    Called from a comm hook: DDP queues its finalizer after the last bucket's hook, so a callback queued here
    would run before it; the callback queues ``fn`` again, behind the finalizer (the engine runs callbacks that
    callbacks queue).
    """
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))


def loaded(deferred: Deferred, params, before: dict) -> None:
    """``params`` were written by a ``load_state_dict`` (their version moved since ``before``, noted when it began):
    a write of the user's, not a step around the shim. Where their last backward's bucket awaits a ``step()``, that
    bucket's baseline moves to the loaded values, so that :func:`check_unstepped` judges later changes only. Until
    2026-11-27 a rollback after a NaN loss (``backward()``, no ``step()``, the model and optimizer restored from
    in-memory copies) raised at the next backward, "changed after backward() although no optimizer.step()", where
    DDP trained on (idiom ``rollback_after_backward``)."""
    for p in params:
        pend = deferred.pending.get(id(p))
        if pend is not None and pend.hparams is None and id(p) in before and p._version != before[id(p)]:
            pend.created[id(p)] = p._version


def check_unstepped(pend: Pending, p) -> None:
    """A parameter whose bucket no ``step()`` stamped must be as it was at backward: if it changed, something
    stepped the optimizer (or wrote the parameter) around the shim, with this rank's own gradient."""
    if p._version != pend.created.get(id(p), p._version):
        raise RuntimeError(f"tensorlane overlap mode: a parameter (shape {tuple(p.shape)}) changed after backward() "
                           "although no optimizer.step() went through the shim (the optimizer's original step was "
                           "called another way, or the parameter was written): under DDP that update would use "
                           "the averaged gradient. Use hook mode (shim.attach without optimizer).")
