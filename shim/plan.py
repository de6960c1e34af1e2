"""The shim's default policy: measure the model once, then let the planner (``policies.planner.plan_shim``)
choose each layer's level and the partition size.

A "layer" here is a module that owns parameters, in the order of ``model.parameters()`` (forward order for
models built as a chain of modules). The planner needs per-layer forward and backward times, gradient bytes,
the number of ranks and the link rate:

- times: given as a :class:`policies.model.Profile` (``attach(profile=...)``, one layer per module with
  parameters), or measured by :class:`Recorder` during the first training iteration after ``attach``: a
  forward pre-hook and a forward hook time each module, a post-accumulate-grad hook on each parameter times
  when its gradient is ready (host clock: right for CPU work and for the emulated devices of ``bench.models``;
  on a CUDA device kernels are asynchronous, so pass ``profile=``);
- the link rate: ``attach(link_bps=...)``, else the local agent's ``status`` (its interface's rate).

Until the plan exists (the first iteration, or when an input is missing) the levels are ``layer_order``'s.
What was decided, and why, is in ``handle.stats()["plan"]``.

Usage: ``rec = Recorder(modules); ...one iteration...; prof = rec.profile("measured")`` then
``choose(prof, ranks=2, link_bps=200e6, levels=4, bucket_bytes=25 << 20)``.
"""
from __future__ import annotations

import time

import torch

from tensorlane.policies.model import Layer, Profile


def owner_modules(root) -> list:
    """Modules that own parameters needing gradients, in the order of ``root.parameters()`` (each once).

    Usage: ``owners = owner_modules(ddp.module)``
    """
    by_param = {}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                by_param.setdefault(id(p), m)
    seen, out = set(), []
    for p in root.parameters():
        m = by_param.get(id(p))
        if m is not None and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


class _CopyInert:
    """A :class:`Recorder` hook on a module. A copy of the module (``torch.save(model.module)`` or
    ``copy.deepcopy``: a snapshot, an EMA model) gets an inert one: the copy is not the model being measured, and a
    closure cannot be pickled (until 2026-11-28 ``torch.save(model.module)`` before the first iteration had ended
    raised "Can't pickle local object 'Recorder._post.<locals>.hook'" where plain DDP saves; idiom
    ``whole_model_saved``), while a deep copy shared the closure, so the copy's forwards were timed as the model's."""

    __slots__ = ("fn",)

    def __init__(self, fn=None):
        self.fn = fn

    def __call__(self, *args):
        return None if self.fn is None else self.fn(*args)

    def __reduce__(self):
        return (_CopyInert, ())

    def __deepcopy__(self, memo):
        return _CopyInert()


class Recorder:
    """Times one iteration: per module forward duration and per parameter gradient-ready time (host clock).

    ``done`` becomes true at the end of the first synchronized backward after a forward (one whose buckets DDP
    reduced: the shim's comm hook calls ``note_synced()``), whatever parameters it reached: the same iteration on
    every rank (``on_done`` agrees on the profile over the ranks, a collective). A backward under ``no_sync()`` does
    not count: ranks may accumulate different numbers of micro-batches per step (until 2026-11-28 it counted, and a
    rank whose first backward was under ``no_sync()`` agreed one synchronized backward before the others: gloo's
    collective mismatch, the job aborted; idiom ``uneven_accumulation_per_rank``). Waiting for every
    parameter's gradient instead left a rank whose iteration did not use a branch (``find_unused_parameters``)
    measuring while the others agreed alone: a hang, or a collective mismatch. ``consume()`` then calls
    ``on_done(recorder)``, where ``profile()`` builds the :class:`Profile` (a layer this rank did not run or reach
    counts 0 s here; the agreement takes every rank's largest), and drops the hooks. The shim calls it from its comm
    hook at the first bucket of the next synchronized backward, a point every rank reaches alike: a forward is not
    one (until 2026-11-27 it was the next forward pre-hook, and a validation forward that rank 0 runs alone after the
    first iteration agreed alone: a hang, or a collective mismatch with the other ranks' barrier).
    """

    def __init__(self, modules: list, on_done=None):
        self.modules = modules
        self.on_done = on_done
        self.fwd_start: dict[int, float] = {}
        self.fwd_s: dict[int, float] = {}
        self.ready: dict[int, float] = {}  # id(param) -> time its gradient was accumulated
        self.forward_end = 0.0
        self.done = False
        self.synced = False  # the backward under way is synchronized (note_synced)
        self.consumed = False
        self._params = [[p for p in m.parameters(recurse=False) if p.requires_grad] for m in modules]
        self._hooks = []
        for i, m in enumerate(modules):
            self._hooks.append(m.register_forward_pre_hook(_CopyInert(self._pre(i))))
            self._hooks.append(m.register_forward_hook(_CopyInert(self._post(i))))
            for p in self._params[i]:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad))

    def _pre(self, i: int):
        def hook(_module, _inputs):
            if not self.done:
                self.fwd_start[i] = time.perf_counter()
        return hook

    def consume(self) -> None:
        """Once ``done``: hand the profile to ``on_done`` (once), and drop the hooks."""
        if self.done and not self.consumed:
            self.consumed = True
            self.remove()
            if self.on_done is not None:
                self.on_done(self)

    def _post(self, i: int):
        def hook(_module, _inputs, _output):
            if not self.done and i in self.fwd_start:
                now = time.perf_counter()
                self.fwd_s[i] = now - self.fwd_start[i]
                self.forward_end = max(self.forward_end, now)
                self.ready.clear()  # a new forward: the gradients of this iteration are what counts
        return hook

    def _grad(self, p) -> None:
        if self.done or not self.fwd_s:
            return
        if not self.ready:  # the first gradient of this backward: done when the backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        self.ready[id(p)] = time.perf_counter()

    def note_synced(self) -> None:
        """The backward under way is one DDP synchronizes (the shim's comm hook got a bucket of it). Not before the
        first measured forward: that backward has no end callback here (attach between forward and backward)."""
        if self.fwd_s:
            self.synced = True

    def _backward_ended(self) -> None:
        self.done, self.synced = self.synced, False  # consume() hands it over (the shim: at the next synchronized
        if not self.done:  # backward's first bucket); under no_sync() the next backward (its forward) is measured
            self.ready.clear()

    def profile(self, name: str = "measured") -> Profile:
        """The measured profile: layer i's backward is the time between the gradients of layer i + 1 and i."""
        ready = [max((self.ready[id(p)] for p in ps if id(p) in self.ready), default=None) for ps in self._params]
        for i in range(len(ready) - 1, -1, -1):  # a layer with no gradient here: its backward took no time
            if ready[i] is None:
                ready[i] = ready[i + 1] if i + 1 < len(ready) else self.forward_end
        layers = []
        for i, m in enumerate(self.modules):
            later = ready[i + 1] if i + 1 < len(ready) else self.forward_end
            nbytes = sum(p.numel() * p.element_size() for p in self._params[i])
            layers.append(Layer(f"{i}:{type(m).__name__}", nbytes, max(0.0, self.fwd_s.get(i, 0.0)),
                                max(0.0, ready[i] - later)))
        return Profile(name, tuple(layers))

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def first_bucket_bytes(ddp) -> int:
    """The cap of ``ddp``'s first bucket: torch's 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) where
    ``bucket_cap_mb`` was left at its default, else the other buckets' cap (``_BucketCapacityConfig``, torch 2.13).
    Usage: ``first_bucket_bytes(DistributedDataParallel(model)) == 1 << 20``"""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        return int(config.first_bucket_bytes_cap)
    import torch.distributed as dist

    cap = int(getattr(ddp, "bucket_bytes_cap", 25 << 20))
    return min(cap, dist._DEFAULT_FIRST_BUCKET_BYTES) if getattr(ddp, "bucket_bytes_cap_default", False) else cap


def choose(profile: Profile, ranks: int, link_bps: float, levels: int, bucket_bytes: int,
           first_bucket_bytes: int | None = None, whole: bool = False) -> dict:
    """Run the planner for what the shim can execute; return ``{"layer_levels", "partition_bytes", ...}``.
    ``first_bucket_bytes``: the DDP model's first bucket cap (:func:`first_bucket_bytes`; None: ``bucket_bytes``);
    ``whole``: the shim sends the model's buckets uncut (``shim.ddp.uncut``).

    Usage: ``choose(prof, ranks=2, link_bps=200e6, levels=4, bucket_bytes=5 << 20)["layer_levels"]``
    """
    from tensorlane.policies.planner import plan_shim

    t0 = time.perf_counter()
    plan = plan_shim(profile, ranks, link_bps, levels_max=levels, bucket_bytes=bucket_bytes,
                     first_bucket_bytes=first_bucket_bytes, whole=whole)
    return {"layer_levels": list(plan.layer_levels), "partition_bytes": plan.partition_bytes,
            "levels_used": plan.levels, "predicted_iter_s": plan.predicted_iter_s,
            "candidates": len(plan.candidates), "whole_buckets": whole, "plan_s": time.perf_counter() - t0}
