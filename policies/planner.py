"""The shim's planner: choose what the shim executes by predicting every configuration it can run.

``plan_shim()`` plans with ``policies.execution``'s model of the shim's overlap mode: per-layer levels (flat, or
layer order compressed onto 2..``levels_max`` levels), partition size and DDP bucket size (fusion); the shim
uses it by default. (The comparison of the published policies, ``plan``/``compare``/``table``, is
``policies.papers.compare``.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorlane.policies.execution import (
    TCP_PAYLOAD_FRACTION,
    HostCosts,
    layer_order_levels,
    shim_iteration,
)
from tensorlane.policies.levels import MAX_LEVELS
from tensorlane.policies.model import CostModel, MiB, Profile, resolve_profile

SHIM_POLICIES = ("flat", "layer_order")
SHIM_BUCKETS = (25 * MiB, 5 * MiB, 1 * MiB)                 # DDP bucket caps (fusion) tried
SHIM_PARTITIONS = (None, 4 * MiB, 1 * MiB, 256 * 1024)     # largest piece; None: cut only where the level changes
# Host costs measured on the 2-host namespace testbed at 200 Mbit/s (bench.validate's calibration, four runs, see
# docs/policies.md "Predicted vs measured"): a 4 KiB gloo all-reduce takes 0.1-0.6 ms end to end, issuing one
# asynchronous all-reduce from Python 30-130 us, a waiting thread wakes 10-50 us after completion, copies run at
# 1.1-2.1 GB/s (the spread is the load of this shared 2-core machine).
# Each completion of the shim's all-reduces runs a Python done-callback on a gloo thread; on this loaded host it
# costs the training thread 0.07-0.75 ms of compute (median of six calibrations ~0.3 ms).
DEFAULT_SHIM_ALPHA_S = 0.5e-3
# callback_s = 0: the shim no longer runs a Python completion callback per piece (shim/ddp.py LevelStats)
DEFAULT_SHIM_HOST = HostCosts(launch_s=50e-6, copy_bps=2e9, wake_s=50e-6, callback_s=0.0)
SHIM_TIE_TOLERANCE = 0.01  # predictions closer than this are a tie; the fewest operations win (choose_candidate)


@dataclass(frozen=True)
class ShimCandidate:
    """One configuration the shim can run, with its predicted iteration time (``policies.execution``).

    ``policy``: ``flat`` (every layer at level 0: WFBP on one group) or ``layer_order`` (forward order compressed
    onto ``levels`` byte-balanced levels, ``policies.cutting.parameter_levels``); ``levels``: levels used;
    ``partition_bytes``: largest all-reduce piece (None: a bucket is cut only where its level changes);
    ``bucket_bytes``: DDP's bucket cap (fusion); ``ops``: all-reduce operations per iteration.
    """

    policy: str
    levels: int
    partition_bytes: int | None
    bucket_bytes: int
    predicted_iter_s: float
    ops: int = 0

    @property
    def label(self) -> str:
        """Short name, e.g. ``layer_order L4 P- B1MiB``."""
        part = "-" if self.partition_bytes is None else _size(self.partition_bytes)
        return f"{self.policy} L{self.levels} P{part} B{_size(self.bucket_bytes)}"


@dataclass(frozen=True)
class ShimPlan:
    """``plan_shim``'s choice: a level per layer (forward order; 0 most urgent), the levels used, the partition
    (None: none) and DDP bucket size, the predicted iteration time, and every candidate considered (grid order)."""

    layer_levels: tuple[int, ...]
    levels: int
    policy: str
    partition_bytes: int | None
    bucket_bytes: int
    predicted_iter_s: float
    candidates: tuple[ShimCandidate, ...]

    @property
    def label(self) -> str:
        """The chosen candidate's label."""
        return ShimCandidate(self.policy, self.levels, self.partition_bytes, self.bucket_bytes,
                             self.predicted_iter_s).label


def _size(n: int) -> str:
    """``1.5MiB``, ``171KiB``, ``512B`` (three significant digits)."""
    if n >= MiB:
        return f"{n / MiB:.3g}MiB"
    return f"{n / 1024:.3g}KiB" if n >= 1024 else f"{n}B"


def shim_levels(profile: Profile, policy: str, levels: int) -> tuple[int, ...]:
    """Per-layer levels of a shim level policy. Usage: ``shim_levels(p, "layer_order", 4)``"""
    if policy == "flat":
        return (0,) * len(profile.layers)
    if policy == "layer_order":
        return layer_order_levels(profile, levels)
    raise ValueError(f"unknown shim policy {policy!r}; known: {', '.join(SHIM_POLICIES)}")


def plan_shim(profile: Profile | str, ranks: int, link_bps: float, levels_max: int = MAX_LEVELS,
              bucket_bytes: int | Sequence[int] = SHIM_BUCKETS,
              partitions: Sequence[int | None] = SHIM_PARTITIONS, latency_s: float = 0.0,
              alpha_s: float = DEFAULT_SHIM_ALPHA_S, host: HostCosts = DEFAULT_SHIM_HOST,
              first_bucket_bytes: int | None = None, policies: Sequence[str] = SHIM_POLICIES,
              payload_fraction: float = TCP_PAYLOAD_FRACTION, tie_tolerance: float = SHIM_TIE_TOLERANCE,
              whole: bool = False) -> ShimPlan:
    """The shim configuration with the lowest predicted iteration time (``policies.execution.shim_iteration``).

    Candidates: each level policy (``flat``; ``layer_order`` on 2..``levels_max`` levels) x each partition in
    ``partitions`` x each DDP bucket cap in ``bucket_bytes`` (one int: the model's DDP is already built with it).
    ``profile``: layers in forward order (one per module owning parameters), their gradient bytes and measured or
    estimated forward/backward seconds; ``link_bps``: the link's rate, of which ``payload_fraction`` carries
    gradient bytes (TCP over Ethernet, MTU 1500; pass 1.0 with a measured payload rate); ``alpha_s``:
    per-operation startup; ``host``: host costs (defaults measured on the testbed). The choice
    (:func:`choose_candidate`): among the candidates predicted within ``tie_tolerance`` (1%) of the fastest, the
    one with the fewest operations (then the fastest, then the first in grid order: fewer levels, no partition,
    the first bucket size); ``tie_tolerance=0``: simply the fastest. Candidates that give the same per-layer
    levels (more levels than layers) are tried once.
    Usage: ``plan_shim(p, ranks=2, link_bps=200e6, bucket_bytes=1 << 20).layer_levels``
    """
    prof = resolve_profile(profile)
    if not 1 <= levels_max <= MAX_LEVELS:
        raise ValueError(f"levels_max must be 1..{MAX_LEVELS}, not {levels_max}")
    if not 0 < payload_fraction <= 1:
        raise ValueError(f"payload_fraction must be in (0, 1], not {payload_fraction}")
    buckets = (bucket_bytes,) if isinstance(bucket_bytes, int) else tuple(bucket_bytes)
    if not buckets or not partitions or not policies:
        raise ValueError("need at least one bucket size, partition and policy")
    cost = CostModel(ranks, link_bps * payload_fraction, latency_s, alpha_s)
    if whole:
        partitions = (None,)
    level_sets: list[tuple[str, tuple[int, ...]]] = []
    for policy in policies:
        for k in ((1,) if policy == "flat" else range(2, levels_max + 1)):
            lv = shim_levels(prof, policy, k)
            if all(lv != seen for _, seen in level_sets):
                level_sets.append((policy, lv))
    cands: list[ShimCandidate] = []
    levels_of: list[tuple[int, ...]] = []
    for policy, lv in level_sets:
        used = 1 + max(lv, default=0)
        for part in partitions:
            for bb in buckets:
                r = shim_iteration(prof, cost, lv, bb, part, first_bucket_bytes, host, whole=whole)
                cands.append(ShimCandidate(policy, used, part, bb, r.iter_s, len(r.ops)))
                levels_of.append(lv)
    k = choose_candidate(cands, tie_tolerance)
    c = cands[k]
    return ShimPlan(levels_of[k], c.levels, c.policy, c.partition_bytes, c.bucket_bytes, c.predicted_iter_s,
                    tuple(cands))


def choose_candidate(cands: Sequence[ShimCandidate], tie_tolerance: float = 0.0) -> int:
    """Index of the chosen candidate: among those predicted within ``tie_tolerance`` (relative) of the fastest,
    the one with the fewest all-reduce operations, then the fastest, then the first in grid order.

    Why: when the link is the bottleneck many configurations are predicted within a fraction of a percent of each
    other, and what the model knows least well is the host's cost per operation (callbacks, waits, Python
    bookkeeping), which grows with the number of operations. Usage: ``choose_candidate(plan.candidates, 0.01)``
    """
    if not cands:
        raise ValueError("no candidates")
    best = min(c.predicted_iter_s for c in cands)
    near = [i for i, c in enumerate(cands) if c.predicted_iter_s <= best * (1 + tie_tolerance)]
    return min(near, key=lambda i: (cands[i].ops, cands[i].predicted_iter_s, i))
