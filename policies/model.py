"""Shared data types for the scheduling policies, the ring all-reduce cost model, and the profile loader.

Everything here is a frozen dataclass or a pure function. The only I/O in ``policies/`` is
:func:`load_profile`, which reads the JSON files shipped in ``policies/profiles/`` through importlib.resources.

Conventions used by every policy:

* A :class:`Profile` lists layers in forward order (index 0 = input side). Backward runs last to first.
* The gradients of a model are one flat byte array in forward-layer order; layer ``i`` owns bytes
  ``[offsets[i], offsets[i + 1])``. A :class:`Block` is one contiguous byte range of that array that is
  all-reduced as one operation: part of a layer (partition), one layer, or several layers (fusion).
* ``priority``: smaller is more urgent (the order the application hands blocks to the network);
  ``level``: the network priority level (0 = most urgent; see ``policies.levels`` for the DSCP of each).
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from importlib import resources

MiB = 1 << 20


@dataclass(frozen=True)
class Layer:
    """One layer (or parameter-tensor group): gradient bytes and per-iteration compute times."""

    name: str
    params_bytes: int
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class Profile:
    """A model: layers in forward order, and optionally the forward DAG.

    ``dag[i]`` holds the indices of the layers whose outputs layer ``i`` consumes (all ``< i``);
    ``None`` means a chain (layer ``i`` consumes layer ``i - 1``).
    """

    name: str
    layers: tuple[Layer, ...]
    dag: tuple[tuple[int, ...], ...] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(ly.params_bytes for ly in self.layers)

    @property
    def fwd_total(self) -> float:
        return sum(ly.fwd_s for ly in self.layers)

    @property
    def bwd_total(self) -> float:
        return sum(ly.bwd_s for ly in self.layers)

    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each layer in the flat gradient array, plus the total at the end."""
        out = [0]
        for ly in self.layers:
            out.append(out[-1] + ly.params_bytes)
        return tuple(out)


@dataclass(frozen=True)
class Block:
    """A byte range ``[start, end)`` of the flat gradient array, all-reduced as one operation.

    ``layers``: the layers it touches (its gradients are complete when the lowest of them finishes backward);
    ``ready_s``: that time, from the start of backward; ``priority``: application order (smaller first);
    ``level``: network priority level (0 most urgent).
    """

    start: int
    end: int
    layers: tuple[int, ...]
    ready_s: float
    priority: float = 0
    level: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Schedule:
    """A policy's output: the blocks, and how the application launches them.

    ``max_inflight``: at most this many all-reduces in flight at once (None: no limit);
    ``credit_bytes``: ByteScheduler's credit window, bytes in flight (a block may always start on an idle link);
    ``per_level_inflight``: in flight per network level (one communicator per level serialises its operations).
    """

    policy: str
    blocks: tuple[Block, ...]
    max_inflight: int | None = None
    credit_bytes: int | None = None
    per_level_inflight: int | None = None
    partition_bytes: int | None = None
    fusion_bytes: int | None = None
    params: tuple[tuple[str, float], ...] = ()

    @property
    def levels(self) -> int:
        return 1 + max((b.level for b in self.blocks), default=0)


@dataclass(frozen=True)
class Plan:
    """The planner's choice for one policy: blocks with their levels, sizes, and the predicted iteration time."""

    policy: str
    blocks: tuple[Block, ...]
    levels: int
    partition_bytes: int | None
    fusion_bytes: int | None
    predicted_iter_s: float
    credit_bytes: int | None = None
    max_inflight: int | None = None
    per_level_inflight: int | None = None
    params: tuple[tuple[str, float], ...] = ()
    schedule: Schedule | None = field(default=None, repr=False, compare=False)

    def layer_levels(self, n_layers: int) -> tuple[int, ...]:
        """Most urgent level of any block of each layer (what a per-layer shim would mark); 0 for empty layers."""
        out = [-1] * n_layers
        for b in self.blocks:
            for i in b.layers:
                out[i] = b.level if out[i] < 0 else min(out[i], b.level)
        return tuple(max(0, x) for x in out)


@dataclass(frozen=True)
class CostModel:
    """Ring all-reduce over ``ranks`` ranks on links of ``link_bps`` bit/s.

    time(bytes) = alpha_s + 2*(n-1)*latency_s + 2*(n-1)/n * bytes*8 / link_bps

    A ring all-reduce is a reduce-scatter then an all-gather, each of n-1 steps; every step moves bytes/n per
    rank and pays one link latency. ``alpha_s`` is the fixed per-operation overhead (kernel launch, negotiation).
    The first two terms are the *startup* (no bandwidth used); the last is the *wire* term. With one rank
    nothing is sent and the time is 0.
    """

    ranks: int
    link_bps: float
    latency_s: float = 0.0
    alpha_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.link_bps <= 0 or self.latency_s < 0 or self.alpha_s < 0:
            raise ValueError(f"bad cost model {self!r}")

    def startup_s(self) -> float:
        """Fixed part: alpha + 2*(n-1)*latency. Usage: ``CostModel(4, 1e9, 1e-5).startup_s() == 6e-5``"""
        return 0.0 if self.ranks == 1 else self.alpha_s + 2 * (self.ranks - 1) * self.latency_s

    def wire_bits(self, nbytes: int) -> float:
        """Bits each rank sends: 2*(n-1)/n * bytes * 8. Usage: ``CostModel(2, 1e9).wire_bits(1) == 8.0``"""
        return 2 * (self.ranks - 1) / self.ranks * nbytes * 8

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per gradient byte on the wire: 2*(n-1)/n * 8 / link_bps."""
        return self.wire_bits(1) / self.link_bps

    def allreduce_s(self, nbytes: int) -> float:
        """Time of one uncontended all-reduce of ``nbytes``. Usage: ``CostModel(2, 8e6).allreduce_s(10**6) == 1.0``"""
        if nbytes <= 0 or self.ranks == 1:
            return 0.0
        return self.startup_s() + self.wire_bits(nbytes) / self.link_bps


# ----------------------------------------------------------------------------------------------- profile helpers

def grad_ready_times(profile: Profile) -> tuple[float, ...]:
    """Time (from the start of backward) at which each layer's gradient is complete; backward runs last to first.

    Usage: layers with bwd_s (1, 2, 3) -> ``(6.0, 5.0, 3.0)``
    """
    out = [0.0] * len(profile.layers)
    t = 0.0
    for i in range(len(profile.layers) - 1, -1, -1):
        t += profile.layers[i].bwd_s
        out[i] = t
    return tuple(out)


def make_blocks(profile: Profile, ranges: Sequence[tuple[int, int]], priorities: Sequence[float] | None = None,
                levels: Sequence[int] | None = None) -> tuple[Block, ...]:
    """Blocks for byte ranges of the flat gradient array, with their layers and ready times filled in.

    Usage: ``make_blocks(p, [(0, 4), (4, 12)])`` for a profile whose layers hold 4 and 8 bytes.
    """
    offs = profile.offsets()
    ready = grad_ready_times(profile)
    out = []
    for k, (lo, hi) in enumerate(ranges):
        if not 0 <= lo < hi <= offs[-1]:
            raise ValueError(f"bad block range [{lo}, {hi}) for {offs[-1]} bytes")
        first = bisect.bisect_right(offs, lo) - 1
        last = bisect.bisect_left(offs, hi) - 1
        layers = tuple(i for i in range(first, last + 1) if profile.layers[i].params_bytes > 0)
        out.append(Block(lo, hi, layers, ready[layers[0]],
                         0 if priorities is None else priorities[k], 0 if levels is None else levels[k]))
    return tuple(out)


def layer_ranges(profile: Profile) -> list[tuple[int, int]]:
    """One byte range per layer that has parameters. Usage: ``layer_ranges(p) == [(0, 4), (4, 12)]``"""
    offs = profile.offsets()
    return [(offs[i], offs[i + 1]) for i in range(len(profile.layers)) if offs[i + 1] > offs[i]]


def split_range(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` into pieces of ``size`` bytes, the last one shorter (ByteScheduler's partition rule).

    Usage: ``split_range(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]``
    """
    if size < 1:
        raise ValueError(f"partition size must be positive, not {size}")
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def layer_pieces(profile: Profile, sizes: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Every layer ``i`` cut into pieces of ``sizes[i]`` bytes (:func:`split_range`): the byte ranges, and each
    piece's layer index as its priority (input side first). Usage: ``ranges, prios = layer_pieces(p, [4, 4])``
    """
    ranges: list[tuple[int, int]] = []
    prios: list[int] = []
    offs = profile.offsets()
    for i in range(len(profile.layers)):
        for r in split_range(offs[i], offs[i + 1], sizes[i]):
            ranges.append(r)
            prios.append(i)
    return ranges, prios


def backward_items(profile: Profile) -> tuple[list[int], list[float], list[int]]:
    """Layers with parameters in backward order (last layer first): indices, gradient-ready times, bytes.

    Usage: ``idx, ready, sizes = backward_items(p)``
    """
    ready = grad_ready_times(profile)
    idx = [i for i in range(len(profile.layers) - 1, -1, -1) if profile.layers[i].params_bytes > 0]
    return idx, [ready[i] for i in idx], [profile.layers[i].params_bytes for i in idx]


def check_blocks(profile: Profile, blocks: Sequence[Block]) -> None:
    """Raise ValueError unless the blocks cover the gradient array exactly once. Usage: ``check_blocks(p, bs)``"""
    pos = 0
    for b in sorted(blocks, key=lambda b: b.start):
        if b.start != pos or b.end <= b.start:
            raise ValueError(f"blocks do not tile the gradients: gap or overlap at byte {pos}")
        pos = b.end
    if pos != profile.total_bytes:
        raise ValueError(f"blocks cover {pos} of {profile.total_bytes} bytes")


def scaled(profile: Profile, compute_scale: float) -> Profile:
    """The same profile with every forward and backward time multiplied by ``compute_scale``.

    Usage: ``scaled(load_profile("vgg16"), 10.0)``
    """
    if not compute_scale > 0 or math.isinf(compute_scale):
        raise ValueError(f"compute_scale must be positive and finite, not {compute_scale}")
    layers = tuple(replace(ly, fwd_s=ly.fwd_s * compute_scale, bwd_s=ly.bwd_s * compute_scale) for ly in profile.layers)
    return replace(profile, layers=layers)


def balance_scale(profile: Profile, cost: CostModel, comm_to_compute: float = 1.0) -> float:
    """Compute scale that makes (one all-reduce of the whole model) / (forward + backward) == comm_to_compute.

    Usage: ``scaled(p, balance_scale(p, cost))`` gives a profile whose compute equals its communication.
    """
    compute = profile.fwd_total + profile.bwd_total
    comm = cost.allreduce_s(profile.total_bytes)
    if compute <= 0 or comm <= 0 or comm_to_compute <= 0:
        raise ValueError("profile needs compute and communication, and comm_to_compute must be positive")
    return comm / comm_to_compute / compute


def profile_names() -> tuple[str, ...]:
    """Names of the shipped profiles. Usage: ``"resnet50" in profile_names()``"""
    root = resources.files("tensorlane.policies.profiles")
    return tuple(sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json")))


def load_profile(name: str) -> Profile:
    """Load a shipped profile (``policies/profiles/<name>.json``); the one function in policies/ that reads a file.

    Usage: ``load_profile("bert_base").total_bytes == 109_482_240 * 4``
    """
    if name not in profile_names():
        raise ValueError(f"unknown profile {name!r}; shipped: {', '.join(profile_names())}")
    text = resources.files("tensorlane.policies.profiles").joinpath(f"{name}.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    return profile_from_dict(doc)


def resolve_profile(profile: Profile | str) -> Profile:
    """``profile`` itself, or the shipped profile of that name. Usage: ``resolve_profile("vgg16").name``"""
    return load_profile(profile) if isinstance(profile, str) else profile


def profile_from_dict(doc: dict) -> Profile:
    """Build a Profile from the JSON document format of policies/profiles (pure). Usage: see load_profile."""
    entries = doc["layers"]
    layers = tuple(Layer(e["name"], int(e["params_bytes"]), float(e["fwd_s"]), float(e["bwd_s"])) for e in entries)
    dag = None
    if any("after" in e for e in entries):
        index = {ly.name: i for i, ly in enumerate(layers)}
        dag = tuple(tuple(sorted(index[a] for a in e.get("after", []))) for e in entries)
        for i, preds in enumerate(dag):
            if any(p >= i for p in preds):
                raise ValueError(f"layer {layers[i].name}: predecessors must come earlier in forward order")
    return Profile(str(doc["name"]), layers, dag)
