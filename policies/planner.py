"""The planner: evaluate every candidate policy over a small grid of sizes in the simulator and keep the best.

``plan()`` returns the blocks, their network levels, and the partition and fusion sizes with the lowest predicted
iteration time of the idealised schedules (``policies.simulator``); ``compare()`` gives the best plan of each
policy and ``table()`` renders the policy x profile table of docs/policies.md.

``plan_shim()`` plans what the shim can execute (``policies.execution``'s model of its overlap mode): per-layer
levels (flat, or layer order compressed onto 2..``levels_max`` levels), partition size and DDP bucket size
(fusion); the shim uses it by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from tensorlane.policies.execution import (
    TCP_PAYLOAD_FRACTION,
    HostCosts,
    layer_order_levels,
    shim_iteration,
)
from tensorlane.policies.fusion import asc_wfbp, fusion_dp
from tensorlane.policies.levels import DEFAULT_DSCP_TABLE
from tensorlane.policies.model import (
    CostModel,
    Plan,
    Profile,
    Schedule,
    balance_scale,
    load_profile,
    scaled,
)
from tensorlane.policies.order import pace
from tensorlane.policies.partition import MiB, bytescheduler, us_byte, wfbp
from tensorlane.policies.simulator import simulate

POLICIES = ("wfbp", "fusion_dp", "asc_wfbp", "bytescheduler", "us_byte", "pace")
MAX_LEVELS = len(DEFAULT_DSCP_TABLE)
PARTITIONS = (256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
CREDITS = (1, 2, 4)            # credit window, in partitions
SLOPES = (0.0, 1.0, 3.0, 7.0)  # US-Byte growth: last blocks are (1 + slope) times the first
SLOTS = (2, 4, 8)              # ASC-WFBP simultaneous all-reduces
FUSIONS = (0, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
DEFAULT_ALPHA_S = 20e-6        # per-operation overhead (kernel launch, negotiation); an assumption


def candidates_for(policy: str, profile: Profile, cost: CostModel, queues: int) -> Iterator[Schedule]:
    """The grid of schedules tried for ``policy``. Usage: ``list(candidates_for("wfbp", p, cost, 5))``"""
    if policy == "wfbp":
        yield wfbp(profile)
    elif policy == "fusion_dp":
        yield fusion_dp(profile, cost)
    elif policy == "asc_wfbp":
        for s in SLOTS:
            yield asc_wfbp(profile, cost, slots=s)
    elif policy == "bytescheduler":
        for p in PARTITIONS:
            for c in CREDITS:
                yield bytescheduler(profile, partition_bytes=p, credit_bytes=c * p, queues=queues)
    elif policy == "us_byte":
        for p in PARTITIONS:
            for c in CREDITS:
                for s in SLOPES:
                    yield us_byte(profile, first_bytes=p, slope=s, credit_bytes=c * p, queues=queues)
    elif policy == "pace":
        for f in FUSIONS:
            for part in (None, 4 * MiB):
                yield pace(profile, fusion_bytes=f, partition_bytes=part, queues=queues)
    else:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")


def _to_plan(s: Schedule, iter_s: float) -> Plan:
    return Plan(s.policy, s.blocks, s.levels, s.partition_bytes, s.fusion_bytes, iter_s, s.credit_bytes,
                s.max_inflight, s.per_level_inflight, s.params, s)


def _resolve(profile: Profile | str) -> Profile:
    return load_profile(profile) if isinstance(profile, str) else profile


def compare(profile: Profile | str, ranks: int, link_bps: float, latency_s: float = 5e-6, queues: int = MAX_LEVELS,
            candidates: Iterable[str] = POLICIES, alpha_s: float = DEFAULT_ALPHA_S, sharing: str = "ps"
            ) -> list[Plan]:
    """Best plan of each candidate policy (in the order given), by simulated iteration time.

    ``queues``: network levels available (1..5, see policies.levels); policies without priorities use one.
    Ties keep the first grid point (smaller sizes first). Usage: ``compare("vgg16", 2, 200e6)``
    """
    prof = _resolve(profile)
    if not 1 <= queues <= MAX_LEVELS:
        raise ValueError(f"queues must be 1..{MAX_LEVELS}, not {queues}")
    cost = CostModel(ranks, link_bps, latency_s, alpha_s)
    out = []
    for policy in candidates:
        best: tuple[float, Schedule] | None = None
        for s in candidates_for(policy, prof, cost, queues):
            t = simulate(prof, s, cost, sharing=sharing).iter_s
            if best is None or t < best[0]:
                best = (t, s)
        assert best is not None
        out.append(_to_plan(best[1], best[0]))
    return out


def plan(profile: Profile | str, ranks: int, link_bps: float, latency_s: float = 5e-6, queues: int = MAX_LEVELS,
         candidates: Iterable[str] = POLICIES, alpha_s: float = DEFAULT_ALPHA_S, sharing: str = "ps") -> Plan:
    """The plan with the lowest predicted iteration time over all candidate policies and their grids.

    Usage: ``plan(load_profile("resnet50"), ranks=16, link_bps=25e9, latency_s=5e-6).blocks``
    """
    plans = compare(profile, ranks, link_bps, latency_s, queues, candidates, alpha_s, sharing)
    return min(plans, key=lambda p: p.predicted_iter_s)


def table(profiles: Sequence[str] = ("resnet50", "vgg16", "bert_base"), ranks: int = 2, link_bps: float = 200e6,
          latency_s: float = 50e-6, queues: int = MAX_LEVELS, comm_to_compute: float | None = 1.0,
          candidates: Sequence[str] = POLICIES, alpha_s: float = DEFAULT_ALPHA_S) -> str:
    """Markdown table of predicted iteration time (s) per policy x profile, compute scaled so that one
    all-reduce of the whole model takes ``comm_to_compute`` times forward + backward; each cell is the best
    grid point (with its speed-up over WFBP), and the last rows give compute alone and the no-overlap bound
    (compute + one all-reduce of the whole model). ``comm_to_compute=None`` keeps the profiles' own compute times.

    Usage: ``print(table())``
    """
    cost = CostModel(ranks, link_bps, latency_s, alpha_s)
    cols: dict[str, dict[str, float]] = {}
    bounds: dict[str, tuple[float, float]] = {}
    for name in profiles:
        prof = load_profile(name)
        if comm_to_compute is not None:
            prof = scaled(prof, balance_scale(prof, cost, comm_to_compute))
        cols[name] = {p.policy: p.predicted_iter_s for p in compare(prof, ranks, link_bps, latency_s, queues,
                                                                   candidates, alpha_s)}
        compute = prof.fwd_total + prof.bwd_total
        bounds[name] = (compute, compute + cost.allreduce_s(prof.total_bytes))
    lines = ["| policy | " + " | ".join(profiles) + " |", "|---|" + "---:|" * len(profiles)]
    for policy in candidates:
        cells = []
        for name in profiles:
            t, ref = cols[name][policy], cols[name]["wfbp"] if "wfbp" in cols[name] else None
            cells.append(f"{t:.3f}" + (f" ({ref / t:.2f}x)" if ref else ""))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append("| compute only | " + " | ".join(f"{bounds[n][0]:.3f}" for n in profiles) + " |")
    lines.append("| compute + comm, no overlap | " + " | ".join(f"{bounds[n][1]:.3f}" for n in profiles) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the shim's planner

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
    onto ``levels`` byte-balanced levels, ``shim.buckets.parameter_levels``); ``levels``: levels used;
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
              payload_fraction: float = TCP_PAYLOAD_FRACTION, tie_tolerance: float = SHIM_TIE_TOLERANCE
              ) -> ShimPlan:
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
    prof = _resolve(profile)
    if not 1 <= levels_max <= MAX_LEVELS:
        raise ValueError(f"levels_max must be 1..{MAX_LEVELS}, not {levels_max}")
    if not 0 < payload_fraction <= 1:
        raise ValueError(f"payload_fraction must be in (0, 1], not {payload_fraction}")
    buckets = (bucket_bytes,) if isinstance(bucket_bytes, int) else tuple(bucket_bytes)
    if not buckets or not partitions or not policies:
        raise ValueError("need at least one bucket size, partition and policy")
    cost = CostModel(ranks, link_bps * payload_fraction, latency_s, alpha_s)
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
                r = shim_iteration(prof, cost, lv, bb, part, first_bucket_bytes, host)
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
