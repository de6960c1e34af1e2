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

from tensorlane.policies.model import CostModel, Profile, load_profile
from tensorlane.units import parse_rate

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
    return float(parse_rate(rate)) if isinstance(rate, str) else float(rate)


def layer_numels(profile: Profile | str, param_scale: float = 1.0) -> list[int]:
    """Elements of each emulated layer's parameter: ``max(1, round(params / param_scale))``, params = bytes / 4.

    Usage: ``sum(layer_numels("resnet50")) == 25_557_032``
    """
    if not param_scale > 0:
        raise ValueError(f"param_scale must be positive, not {param_scale}")
    return [max(1, round(layer.params_bytes / 4 / param_scale)) for layer in _profile(profile).layers]


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


def dependency_bound(profile: Profile | str, ranks: int = 2, rate_bps: float | str = 200e6,
                     param_scale: float = 1.0, compute_scale: float = 1.0) -> dict:
    """The dependency-aware lower bound of an iteration and the layer that sets it.

    Any schedule that all-reduces a layer's whole gradient before updating that layer, and updates a layer before
    the next forward uses it, on one device (forward layers 0..L-1 in order, backward in reverse order) and one
    link per rank direction (ring: ``c_j = 2(n-1)/n * bytes_j * 8 / rate`` for layer ``j``): for every layer ``k``,
    the period is at least ``forward(k..L-1) + backward(L-1..k) + c_0 + ... + c_k``. Between the start of layer
    ``k``'s forward in one iteration and its start in the next, the device runs forward ``k..L-1`` and backward
    ``L-1..k`` before layer ``k``'s gradient exists; from then on, the link must carry the all-reduces of layers
    ``0..k`` of this iteration (none of them is ready earlier: backward produces them after layer ``k``'s; the
    previous iteration's all-reduces all completed before this iteration's forward used them) and all of them are
    needed no later than layer ``k``'s next forward. ``k = 0`` gives compute + the first layer's all-reduce;
    ``k = L-1`` gives the last layer's compute + all communication. So the bound is at least the plain
    :func:`lower_bound_s` (startup latencies left out, as there). Chain models only (the emulated ones are).

    Returns ``lower_bound_dep_s`` (the maximum over ``k``), ``layer`` (that ``k``), ``layer_name``,
    ``first_layer_s`` (the ``k = 0`` term: forward + backward + the first layer's all-reduce) and ``plain_s``.
    Usage: ``dependency_bound("bert_base", 2, 200e6, 23, 3.55)["lower_bound_dep_s"]`` is about 0.94
    """
    p = _profile(profile)
    rate = _rate_bps(rate_bps)
    cost = CostModel(ranks, rate)
    comm = [cost.wire_bits(4 * n) / rate if ranks > 1 else 0.0 for n in layer_numels(p, param_scale)]
    best, best_k, prefix = float("-inf"), 0, [0.0]
    for c in comm:
        prefix.append(prefix[-1] + c)
    tails = [0.0] * (len(p.layers) + 1)
    for k in range(len(p.layers) - 1, -1, -1):
        tails[k] = tails[k + 1] + (p.layers[k].fwd_s + p.layers[k].bwd_s) * compute_scale
    for k in range(len(p.layers)):
        term = tails[k] + prefix[k + 1]
        if term > best:
            best, best_k = term, k
    plain = lower_bound_s(p, ranks, rate, param_scale, compute_scale)
    return {"lower_bound_dep_s": max(best, plain), "layer": best_k, "layer_name": p.layers[best_k].name,
            "first_layer_s": tails[0] + prefix[1], "plain_s": plain}


def lower_bound_dep_s(profile: Profile | str, ranks: int = 2, rate_bps: float | str = 200e6,
                      param_scale: float = 1.0, compute_scale: float = 1.0) -> float:
    """The dependency-aware lower bound (:func:`dependency_bound`): max over layers ``k`` of forward and backward
    of layers ``k..L-1`` plus the all-reduce of layers ``0..k`` at link rate; never below :func:`lower_bound_s`.

    Usage: ``lower_bound_dep_s("bert_base", ranks=2, rate_bps=200e6, param_scale=23, compute_scale=3.55)``
    """
    return dependency_bound(profile, ranks, rate_bps, param_scale, compute_scale)["lower_bound_dep_s"]


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


def schedstat() -> tuple[float, float] | None:
    """This thread's seconds on a CPU and waiting in a run queue for one (/proc/thread-self/schedstat), or None
    where that cannot be read. The wait shows how much of an interval other processes took.

    Usage: ``run_s, wait_s = schedstat() or (0.0, 0.0)``
    """
    return _read_schedstat("/proc/thread-self/schedstat")


def _read_schedstat(path: str) -> tuple[float, float] | None:
    """The first two fields of a schedstat file in seconds (on a CPU, waiting in a run queue), or None."""
    try:
        with open(path, "rb") as fh:
            run_ns, wait_ns = fh.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def process_schedstat() -> tuple[float, float] | None:
    """:func:`schedstat` summed over this process's threads (/proc/self/task/*/schedstat): its seconds on a CPU
    and in a run queue waiting for one, or None where that cannot be read. Threads that have exited are not
    counted. Usage: ``run_s, wait_s = process_schedstat() or (0.0, 0.0)``
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    stats = [st for tid in tasks if (st := _read_schedstat(f"/proc/self/task/{tid}/schedstat"))]  # None: exited
    return sum(st[0] for st in stats), sum(st[1] for st in stats)


def _busy_s() -> float:
    """Seconds this thread has been running or runnable (on a CPU, or waiting in a run queue for one).

    From :func:`schedstat`; where that is missing, CPU time only.
    """
    stat = schedstat()
    return sum(stat) if stat else time.thread_time()


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
    layers = [cls(layer.name, n, layer.fwd_s * compute_scale, layer.bwd_s * compute_scale, generator=gen)
              for layer, n in zip(p.layers, numels, strict=True)]
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


# ------------------------------------------------------------------------------------- a small real model (CNN)

CNN_WIDTH = 48          # channels of the first block; bench.realtrain's default (1.3 M parameters, 5.2 MB)
CNN_CLASSES = 10
IMAGE_SIZE = 32


def small_cnn(width: int = CNN_WIDTH, classes: int = CNN_CLASSES, seed: int = 0):
    """A small real CNN for 32x32 RGB images (``bench.realtrain``): six conv3x3 + BatchNorm + ReLU blocks with
    channels ``w, 2w, 2w, 4w, 4w, 8w`` (stride 2 in the 2nd, 4th and 6th), global average pooling and a linear
    head. Real compute, no emulation. Initialised from ``seed`` alone, so every rank builds the same model.

    ``width`` 48: 1,292,794 parameters (5.2 MB of float32 gradients), about 0.21 s of forward + backward + step per
    batch of 32 under bf16 autocast on one thread of this machine, alone (width 32: 0.58 M, 0.10 s; width 64:
    2.3 M, 0.36 s). Usage: ``m = small_cnn(48); m(x)``
    """
    torch = _torch()
    nn = torch.nn
    if width < 1 or classes < 2:
        raise ValueError(f"need width >= 1 and classes >= 2, not {width}, {classes}")

    def block(cin: int, cout: int, stride: int):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True))

    w = width
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(block(3, w, 1), block(w, 2 * w, 2), block(2 * w, 2 * w, 1), block(2 * w, 4 * w, 2),
                              block(4 * w, 4 * w, 1), block(4 * w, 8 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(8 * w, classes))
    return model


def synthetic_images(rank: int = 0, step: int = 0, batch: int = 32, classes: int = CNN_CLASSES,
                     size: int = IMAGE_SIZE, seed: int = 0, noise: float = 1.0):
    """A deterministic ``(images, labels)`` batch for ``rank`` and ``step``: ``images[i] = pattern[label_i] +
    noise * N(0, 1)``, with one fixed random pattern per class (from ``seed``), so the task is learnable and the
    loss falls. Every (seed, rank, step) gives the same batch in any process.
    Usage: ``x, y = synthetic_images(rank=1, step=3)``; ``x.shape == (32, 3, 32, 32)``
    """
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, size, size, generator=g)
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 10_007 * step + rank)
    labels = torch.randint(0, classes, (batch,), generator=g)
    images = patterns[labels] + noise * torch.randn(batch, 3, size, size, generator=g)
    return images, labels


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
