"""The comparison of the paper reproductions: every tensor-side policy over a small grid, in the simulator.

``plan()`` returns the blocks, their network levels, and the partition and fusion sizes with the lowest predicted
iteration time of the idealised schedules (``policies.simulator``); ``compare()`` gives the best plan of each
policy (Poseidon's WFBP, MG-WFBP's fusion, ASC-WFBP, P3/ByteScheduler, US-Byte, PACE; see this package's
modules for the papers) and ``table()`` renders the policy x profile table of docs/policies.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from tensorlane.policies.levels import MAX_LEVELS
from tensorlane.policies.model import (
    CostModel,
    MiB,
    Plan,
    Profile,
    Schedule,
    balance_scale,
    load_profile,
    resolve_profile,
    scaled,
)
from tensorlane.policies.papers.asc_wfbp import asc_wfbp
from tensorlane.policies.papers.bytescheduler import bytescheduler
from tensorlane.policies.papers.mg_wfbp import fusion_dp
from tensorlane.policies.papers.pace import pace
from tensorlane.policies.papers.poseidon_wfbp import wfbp
from tensorlane.policies.papers.us_byte import us_byte
from tensorlane.policies.simulator import simulate

POLICIES = ("wfbp", "fusion_dp", "asc_wfbp", "bytescheduler", "us_byte", "pace")
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
    """The :class:`Plan` of schedule ``s`` with its predicted iteration time."""
    return Plan(s.policy, s.blocks, s.levels, s.partition_bytes, s.fusion_bytes, iter_s, s.credit_bytes,
                s.max_inflight, s.per_level_inflight, s.params, s)


def compare(profile: Profile | str, ranks: int, link_bps: float, latency_s: float = 5e-6, queues: int = MAX_LEVELS,
            candidates: Iterable[str] = POLICIES, alpha_s: float = DEFAULT_ALPHA_S, sharing: str = "ps"
            ) -> list[Plan]:
    """Best plan of each candidate policy (in the order given), by simulated iteration time.

    ``queues``: network levels available (1..5, see policies.levels); policies without priorities use one.
    Ties keep the first grid point (smaller sizes first). Usage: ``compare("vgg16", 2, 200e6)``
    """
    prof = resolve_profile(profile)
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
            t, ref = cols[name][policy], cols[name].get("wfbp")
            cells.append(f"{t:.3f}" + (f" ({ref / t:.2f}x)" if ref else ""))
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines.append("| compute only | " + " | ".join(f"{bounds[n][0]:.3f}" for n in profiles) + " |")
    lines.append("| compute + comm, no overlap | " + " | ".join(f"{bounds[n][1]:.3f}" for n in profiles) + " |")
    return "\n".join(lines)
