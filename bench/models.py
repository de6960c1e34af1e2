"""Emulated models for the training benchmarks: a profile's layers with real (scaled) parameter tensors whose
compute is emulated by sleeping, and the lower bound of an iteration on a given link.

Each layer of a :class:`policies.model.Profile` becomes one module holding one float32 parameter tensor of
``round(params / param_scale)`` elements (at least 1), so DDP buckets, all-reduces and optimizer steps move the
model's bytes divided by ``param_scale``. Its forward sleeps ``fwd_s * compute_scale`` and its backward
``bwd_s * compute_scale`` (a custom autograd function); sleeping holds no CPU and releases the GIL, so gloo's
threads and the shim run as they would beside a GPU, and two or three ranks fit on a 2-core machine.
The sleeps form a per-thread emulated device (:func:`emulate_compute`): the host work between kernels (autograd,
hooks, optimizer) overlaps with the device, as with a GPU's asynchronous launches, while time the thread spends
blocked (waiting for an all-reduce) leaves the device idle; ``TENSORLANE_BENCH_STRICT_COMPUTE=1`` turns the
overlap off.

The activation is a small ``(batch, width)`` tensor: ``y = x + C * p[:k].sum()`` (``k = min(8, numel)``,
``C = 1e-3``), and the backward returns ``grad_x = grad_y`` and a full-size ``grad_p`` filled with
``C * grad_y.sum()`` (every element non-zero, deterministic for a given batch), so every layer's gradient flows and
DDP all-reduces every byte.

Scales (:func:`balanced_scales`): ``param_scale`` makes one all-reduce of all gradients take ``comm_s`` on the link
(ring: ``2(n-1)/n * bytes * 8 / rate``), rounded to a whole number, and ``compute_scale`` then makes forward +
backward equal that communication time (``comm_to_compute`` = 1). At 200 Mbit/s with 2 ranks and the default
``comm_s = 0.75``:

=========  ===========  =============  ===================  =============
profile    param_scale  compute_scale  gradient bytes (MB)  comm = compute
=========  ===========  =============  ===================  =============
resnet50   5            10.4           20.4                 0.82 s
vgg16      30           2.48           18.4                 0.74 s
bert_base  23           3.55           19.0                 0.76 s
=========  ===========  =============  ===================  =============

(:data:`DEFAULT_SCALES` holds these; ``python -m bench.models --rate 500mbit --ranks 3`` prints the table for
other rates and ranks.)

Usage::

    from bench.models import emulated_model, balanced_scales, lower_bound_s
    ps, cs = balanced_scales("resnet50", rate_bps=200e6, ranks=2)
    model = emulated_model("resnet50", param_scale=ps, compute_scale=cs)
    lower_bound_s("resnet50", ranks=2, rate_bps=200e6, param_scale=ps, compute_scale=cs)
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from policies.model import CostModel, Profile, load_profile

ACT_SCALE = 1e-3     # C: the weight of the parameter's partial sum in the activation
ACT_TAP = 8          # k: how many parameter elements the forward reads
DEFAULT_COMM_S = 0.75
DEFAULT_WIDTH = 16
DEFAULT_BATCH = 8
CPU_OVERLAP = os.environ.get("TENSORLANE_BENCH_STRICT_COMPUTE", "") in ("", "0")
# balanced_scales(name, 200e6, 2) for the shipped profiles (checked by tests/test_models.py)
DEFAULT_SCALES = {"resnet50": (5.0, 10.416), "vgg16": (30.0, 2.484), "bert_base": (23.0, 3.55)}


def _profile(profile: Profile | str) -> Profile:
    return load_profile(profile) if isinstance(profile, str) else profile


def _rate_bps(rate: float | str) -> float:
    if isinstance(rate, str):
        from testbed.topology import parse_rate

        return float(parse_rate(rate))
    return float(rate)


def layer_numels(profile: Profile | str, param_scale: float = 1.0) -> list[int]:
    """Elements of each emulated layer's parameter: ``max(1, round(params / param_scale))``, params = bytes / 4.

    Usage: ``sum(layer_numels("resnet50")) == 25_557_032``
    """
    if not param_scale > 0:
        raise ValueError(f"param_scale must be positive, not {param_scale}")
    return [max(1, round(l.params_bytes / 4 / param_scale)) for l in _profile(profile).layers]


def gradient_bytes(profile: Profile | str, param_scale: float = 1.0) -> int:
    """Bytes of all gradients of the emulated model (float32). Usage: ``gradient_bytes("vgg16", 30)``"""
    return 4 * sum(layer_numels(profile, param_scale))


def compute_s(profile: Profile | str, compute_scale: float = 1.0) -> float:
    """Emulated forward + backward seconds per iteration. Usage: ``compute_s("vgg16", 2.0)``"""
    p = _profile(profile)
    return (p.fwd_total + p.bwd_total) * compute_scale


def comm_s(profile: Profile | str, ranks: int, rate_bps: float | str, param_scale: float = 1.0) -> float:
    """Seconds to ring-all-reduce every gradient once on the link: ``2(n-1)/n * bytes * 8 / rate`` (0 for 1 rank).

    Usage: ``comm_s("resnet50", 2, "200mbit", 5)`` is about 0.82
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    return CostModel(ranks, _rate_bps(rate_bps)).wire_bits(gradient_bytes(profile, param_scale)) / _rate_bps(rate_bps)


def lower_bound_s(profile: Profile | str, ranks: int = 2, rate_bps: float | str = 200e6, param_scale: float = 1.0,
                  compute_scale: float = 1.0) -> float:
    """No schedule beats max(compute of an iteration, communication of all its gradients at link rate).

    Compute: forward + backward (each rank computes its whole model); communication: one ring all-reduce of all
    gradients, ``2(n-1)/n * bytes * 8 / rate`` (startup latencies left out, so this is a true lower bound).
    Usage: ``lower_bound_s("resnet50", ranks=2, rate_bps=200e6, param_scale=5, compute_scale=10.4)``
    """
    return max(compute_s(profile, compute_scale), comm_s(profile, ranks, rate_bps, param_scale))


def balanced_scales(profile: Profile | str, rate_bps: float | str = 200e6, ranks: int = 2,
                    comm_s_target: float = DEFAULT_COMM_S, comm_to_compute: float = 1.0) -> tuple[float, float]:
    """``(param_scale, compute_scale)``: communication of all gradients ~ ``comm_s_target`` (param_scale rounded
    to a whole number >= 1), and compute = communication / ``comm_to_compute``.

    Usage: ``balanced_scales("vgg16", "200mbit", 2) == (30.0, ...)``
    """
    p = _profile(profile)
    if ranks < 2:
        raise ValueError("balancing needs communication: ranks must be >= 2")
    if not comm_s_target > 0 or not comm_to_compute > 0:
        raise ValueError("comm_s_target and comm_to_compute must be positive")
    full = comm_s(p, ranks, rate_bps, 1.0)
    param_scale = float(max(1, round(full / comm_s_target)))
    comm = comm_s(p, ranks, rate_bps, param_scale)
    compute_scale = comm / comm_to_compute / (p.fwd_total + p.bwd_total)
    return param_scale, round(compute_scale, 3)


# ------------------------------------------------------------------------------------------------------- torch part

class _Stream(threading.local):
    free_at = float("-inf")   # perf_counter time at which this thread's emulated device finishes its last kernel
    busy_mark = 0.0           # _busy_s() when the last emulate_compute returned
    late = 0.0                # how late that call's sleep woke up


_STREAM = _Stream()
# totals over every thread: emulated seconds, seconds slept, wake-up lateness, the thread's own busy time that
# was overlapped with the emulated device, and the emulated device's idle time between kernels (``idle_s``:
# the thread was blocked, e.g. waiting for an all-reduce or a barrier)
STREAM_STATS = {"compute_s": 0.0, "slept_s": 0.0, "late_s": 0.0, "cpu_hidden_s": 0.0, "idle_s": 0.0, "calls": 0}


def _busy_s() -> float:
    """Seconds this thread has been running or runnable (on a CPU, or waiting in a run queue for one).

    From /proc/thread-self/schedstat (on-CPU ns, run-queue wait ns); where that is missing, CPU time only.
    """
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
        return (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


def emulate_compute(seconds: float, cpu_overlap: bool | None = None) -> None:
    """Run ``seconds`` of emulated device compute on this thread's "stream": sleep until it is done.

    A GPU runs kernels asynchronously: while it computes, the host runs the framework (autograd, DDP's and the
    shim's hooks, optimizer bookkeeping), so host work costs no device time unless the device runs out of queued
    work. Sleeping serialises the two, so by default (``CPU_OVERLAP``) the device is taken to have been busy
    while this thread was busy since the previous call returned -- running, or runnable and waiting for one of
    this 2-core machine's CPUs -- and during that call's sleep overshoot: a kernel starts at
    ``max(device free, now - that busy time)``. Time in which the thread was blocked (waiting for an all-reduce,
    a barrier, a lock) leaves the device idle, as it would on a GPU (``STREAM_STATS["idle_s"]``). With
    ``cpu_overlap=False`` (TENSORLANE_BENCH_STRICT_COMPUTE=1) only the sleep overshoot is taken back and all host
    work adds to the iteration. Usage: ``emulate_compute(0.002)``
    """
    if seconds <= 0:
        return
    overlap = CPU_OVERLAP if cpu_overlap is None else cpu_overlap
    st = _STREAM
    now = time.perf_counter()
    if st.free_at == float("-inf"):
        start = now
    else:
        hidden = st.late + (_busy_s() - st.busy_mark if overlap else 0.0)
        start = max(st.free_at, now - hidden)
        STREAM_STATS["cpu_hidden_s"] += min(hidden, max(0.0, now - st.free_at))
        STREAM_STATS["idle_s"] += start - st.free_at
    st.free_at = end = start + seconds
    STREAM_STATS["calls"] += 1
    STREAM_STATS["compute_s"] += seconds
    st.late = 0.0
    if end > now:
        time.sleep(end - now)
        woke = time.perf_counter()
        st.late = max(0.0, woke - end)
        STREAM_STATS["slept_s"] += woke - now
        STREAM_STATS["late_s"] += st.late
    if overlap:
        st.busy_mark = _busy_s()


def reset_stream() -> None:
    """Forget this thread's stream position (the next compute starts when issued). Usage: between runs."""
    _STREAM.free_at = float("-inf")
    _STREAM.late = 0.0


def _torch():
    import torch

    return torch


_FUNCTION = None


def _emulated_function():
    """The autograd function (built on first use so that importing this module does not import torch)."""
    global _FUNCTION
    if _FUNCTION is not None:
        return _FUNCTION
    torch = _torch()

    class EmulatedCompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p, fwd_s: float, bwd_s: float):
            emulate_compute(fwd_s)
            ctx.bwd_s = bwd_s
            ctx.p_shape = p.shape
            return x + ACT_SCALE * p[:ACT_TAP].sum()

        @staticmethod
        def backward(ctx, grad_y):
            emulate_compute(ctx.bwd_s)
            grad_p = grad_y.new_empty(ctx.p_shape).fill_(float(ACT_SCALE * grad_y.sum()))
            return grad_y, grad_p, None, None

    _FUNCTION = EmulatedCompute
    return _FUNCTION


def _layer_class():
    torch = _torch()

    class EmulatedLayer(torch.nn.Module):
        """One profile layer: parameter ``weight`` (1-D, float32) and sleeps of ``fwd_s`` / ``bwd_s`` seconds."""

        def __init__(self, name: str, numel: int, fwd_s: float, bwd_s: float, generator=None):
            super().__init__()
            self.layer_name = name
            self.fwd_s = float(fwd_s)
            self.bwd_s = float(bwd_s)
            w = torch.empty(numel, dtype=torch.float32)
            w.uniform_(-0.05, 0.05, generator=generator)
            self.weight = torch.nn.Parameter(w)

        def forward(self, x):
            return _emulated_function().apply(x, self.weight, self.fwd_s, self.bwd_s)

        def extra_repr(self) -> str:
            return f"{self.layer_name}, numel={self.weight.numel()}, fwd_s={self.fwd_s:.6f}, bwd_s={self.bwd_s:.6f}"

    return EmulatedLayer


def emulated_model(profile: Profile | str, param_scale: float = 1.0, compute_scale: float = 1.0, seed: int = 0):
    """A ``torch.nn.Sequential`` with one :class:`EmulatedLayer` per profile layer (forward order).

    Parameters are initialised from ``seed`` alone (uniform in [-0.05, 0.05]), so every rank builds the same model.
    Usage: ``m = emulated_model("resnet50", 5, 10.4); y = m(torch.randn(8, 16)); y.square().mean().backward()``
    """
    torch = _torch()
    if not compute_scale >= 0:
        raise ValueError(f"compute_scale must be >= 0, not {compute_scale}")
    p = _profile(profile)
    gen = torch.Generator().manual_seed(seed)
    cls = _layer_class()
    numels = layer_numels(p, param_scale)
    layers = [cls(l.name, n, l.fwd_s * compute_scale, l.bwd_s * compute_scale, generator=gen)
              for l, n in zip(p.layers, numels)]
    model = torch.nn.Sequential(*layers)
    model.profile_name = p.name
    model.param_scale = param_scale
    model.compute_scale = compute_scale
    return model


def synthetic_batch(rank: int = 0, step: int = 0, batch: int = DEFAULT_BATCH, width: int = DEFAULT_WIDTH):
    """A deterministic ``(input, target)`` pair for ``rank`` and ``step``. Usage: ``x, t = synthetic_batch(1)``"""
    torch = _torch()
    g = torch.Generator().manual_seed(10_007 * step + rank)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.models", description="balanced scales of the profiles")
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--comm-s", type=float, default=DEFAULT_COMM_S)
    args = ap.parse_args(argv)
    print(f"{'profile':10s} {'param_scale':>11s} {'compute_scale':>13s} {'grad MB':>8s} {'comm s':>7s} "
          f"{'compute s':>9s} {'lower bound s':>13s}")
    for name in ("resnet50", "vgg16", "bert_base"):
        ps, cs = balanced_scales(name, args.rate, args.ranks, args.comm_s)
        print(f"{name:10s} {ps:11g} {cs:13g} {gradient_bytes(name, ps) / 1e6:8.1f} "
              f"{comm_s(name, args.ranks, args.rate, ps):7.3f} {compute_s(name, cs):9.3f} "
              f"{lower_bound_s(name, args.ranks, args.rate, ps, cs):13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
