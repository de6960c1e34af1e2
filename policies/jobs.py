"""The agent's job policy: the order of the jobs, each job's band of levels, and a flow's effective level.

Every agent must compute the same job order from the same inputs without a coordination service, so each function
here is a pure function of its arguments, sorts with a total order, and breaks ties by job id.

The agent (``agent/jobs.py``, docs/jobs.md) uses ``job_order`` (the order and rank of the jobs one agent sees, for
policy ``none``, ``static``, ``rotate``, ``alternate``, ``intensity``, ``shortest``, ``measured_intensity`` or
``slowdown``), ``measured_intensity_rank`` (the order of Crux's ``policies.papers.crux.gpu_intensity`` from a job's
reported compute time and bytes), ``slowdown_rank`` (how far a job's last steps ran behind its ideal step),
``job_bands`` (each job's contiguous band of levels; one ordinary user's jobs weigh one job), ``banded_level`` (a
flow's effective level: its job's band, with the level the client asked for compressed inside) and ``job_shares``
(the link's share guaranteed to each band, so that no order leaves a job less than its part). Rotation is
``hashed_rotation_order``: the relative order of two jobs depends only on those two ids and the epoch number, so
agents that see different sets of jobs still agree on every pair they share (TensorLights' positional rotation,
``policies.papers.tensorlights.rotate_job_order``, does not). :class:`Job` is the job as the paper reproductions
(``policies.papers.tensorlights``, ``policies.papers.crux``) see it.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

from tensorlane.policies.compress import compress_levels, contiguous_split

JOB_POLICIES = ("none", "static", "rotate", "alternate", "intensity", "shortest", "measured_intensity", "slowdown")
ROTATING = ("rotate", "alternate")  # the policies whose order changes every epoch
TIMED = ("slowdown",)  # the policies whose order moves with the clock between reports (the agent re-ranks each sample)
REPORTED = {"shortest": ("step_bytes",), "measured_intensity": ("step_bytes", "compute_s"),  # inputs from the shims
            "slowdown": ("tail_bytes", "compute_s", "window_start", "window_steps")}
REPORTED_INPUTS = tuple(dict.fromkeys(name for names in REPORTED.values() for name in names))  # each once
SHARE_AMONG = ("sending", "present")  # how job_share is split: among the jobs sending (1/k), or all present (1/n)
INTENSITY_STEP = 1.1  # measured_intensity: jobs whose intensities differ by less than one such factor may share a band
SLOWDOWN_WINDOW = 4  # slowdown: the steps a shim's window spans (``window_steps`` at most this)
# job_share = "auto": the parts while the jobs leave the link idle at times (an order interleaves them), and while
# they keep it saturated (near FIFO's shares); decided from the samples of the last AUTO_WINDOW_S, saturated from
# AUTO_BUSY[1] of them busy, and again not below AUTO_BUSY[0] (docs/jobs.md, "job_share = auto")
AUTO_SHARES = (0.2, 0.95)
AUTO_WINDOW_S = 2.0
AUTO_BUSY = (0.85, 0.95)


@dataclass(frozen=True)
class Job:
    """A training job as the agents see it.

    ``compute_s``: GPU compute per iteration; ``bytes_per_iter``: bytes one iteration puts on its slowest link;
    ``slowest_link_bps``: that link's rate; ``priority``: an operator-given static priority (smaller first);
    ``correction``: Crux's per-job correction factor on the intensity (1.0: none).
    """

    job_id: str
    compute_s: float = 0.0
    bytes_per_iter: int = 0
    slowest_link_bps: float = 0.0
    priority: int = 0
    correction: float = 1.0


def unique_ids(job_ids: Sequence[str]) -> list[str]:
    """The job ids as a list; ValueError when one appears twice. Usage: ``unique_ids(["a", "b"]) == ["a", "b"]``"""
    ids = list(job_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("job ids must be unique")
    return ids


def rotation_epoch(now_s: float, epoch_s: float) -> int:
    """The number of the rotation epoch that wall-clock time ``now_s`` falls in: ``floor(now_s / epoch_s)``.

    Usage: ``rotation_epoch(45.0, 20.0) == 2``
    """
    if not (epoch_s > 0 and math.isfinite(epoch_s)) or not math.isfinite(now_s):
        raise ValueError("epoch_s must be positive and finite, now_s finite")
    return math.floor(now_s / epoch_s)


def rotation_key(job_id: str, epoch: int) -> bytes:
    """The sort key of ``job_id`` in epoch ``epoch``: SHA-256 of ``"EPOCH/JOB"`` (uniform, the same everywhere).

    Usage: ``rotation_key("a", 3) == hashlib.sha256(b"3/a").digest()``
    """
    return hashlib.sha256(f"{int(epoch)}/{job_id}".encode()).digest()


def hashed_rotation_order(job_ids: Sequence[str], epoch: int) -> tuple[str, ...]:
    """Rotation without coordination: the jobs sorted by ``rotation_key(job, epoch)`` (a fresh pseudo-random
    permutation each epoch, so each of n jobs is first in 1/n of the epochs on average).

    Whether job a comes before job b depends only on a, b and the epoch, never on the other jobs an agent sees:
    two agents with different job sets order every pair of shared jobs alike. Usage:
    ``hashed_rotation_order(["a", "b"], 7) in (("a", "b"), ("b", "a"))``
    """
    ids = unique_ids(job_ids)
    return tuple(sorted(ids, key=lambda j: (rotation_key(j, epoch), j)))


def alternating_rotation_order(job_ids: Sequence[str], epoch: int) -> tuple[str, ...]:
    """Rotation in strict turn without coordination: epochs ``2k`` and ``2k + 1`` take
    ``hashed_rotation_order(job_ids, k)`` and its reverse, so every two jobs swap places every epoch pair and each
    one precedes the other in exactly half of the epochs (the hashed rotation gives that only on average: in a run
    of a few epochs one job can lead most of them).

    The order of jobs a and b still depends only on a, b and the epoch (a reversed order keeps every pair's
    agreement), so agents with different job sets agree on every pair they share. Usage:
    ``alternating_rotation_order(["a", "b"], 7) == alternating_rotation_order(["a", "b"], 6)[::-1]``
    """
    order = hashed_rotation_order(job_ids, epoch // 2)
    return order[::-1] if epoch % 2 else order


def job_order(policy: str, job_ids: Sequence[str], now_s: float = 0.0, epoch_s: float = 20.0,
              priority: Mapping[str, int] | None = None,
              intensity: Mapping[str, float] | None = None,
              step_bytes: Mapping[str, int] | None = None,
              tail_bytes: Mapping[str, int] | None = None,
              compute_s: Mapping[str, float] | None = None,
              window_start: Mapping[str, float] | None = None,
              window_steps: Mapping[str, int] | None = None,
              link_bps: float | None = None) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The order of the jobs ``job_ids`` under ``policy`` (most urgent first) and each one's rank value
    (jobs with equal rank values share a band in ``job_bands``).

    - ``none``: every job rank 0 (one band: the job plays no part);
    - ``static``: by ``priority[job]`` (smaller first; TensorLights TLsOne), ties by id and sharing a band; jobs
      not in ``priority`` rank after every listed one, all alike;
    - ``rotate``: ``hashed_rotation_order`` of epoch ``rotation_epoch(now_s, epoch_s)`` (TensorLights TLsRR
      without a shared job list), ranks 0, 1, 2, ...;
    - ``alternate``: ``alternating_rotation_order`` of that epoch (every pair swaps every epoch pair), ranks as
      ``rotate``;
    - ``intensity``: by ``intensity[job]`` descending (Crux's GPU intensity, computed elsewhere), ties share a
      band; jobs not listed count as intensity 0;
    - ``shortest``: by ``step_bytes[job]`` ascending, the bytes one training step of the job all-reduces as its own
      shims report them (the job whose communication phase is shortest on any shared link first), ties share a
      band; jobs without a report rank after every reported one, all alike. Every rank of a DDP job reduces the same
      buckets, so agents that see two jobs' reports order them alike;
    - ``measured_intensity``: by Crux's GPU intensity from the jobs' own reports, most intense first: a step's
      compute seconds ``compute_s[job]`` (agreed over the job's ranks) per byte it all-reduces ``step_bytes[job]``
      (``measured_intensity_rank``: the link's rate divides every job's transfer time alike, so it drops out of the
      order); ranks are whole steps of ``INTENSITY_STEP`` (jobs within about 10 % of each other may share a band);
      jobs without both reports rank after every reported one, all alike;
    - ``slowdown``: the job slowed down most over its last steps first, at wall-clock ``now_s``
      (``slowdown_rank``: the seconds since ``window_start[job]`` over ``window_steps[job] + 1`` ideal steps of
      ``compute_s[job]`` plus ``tail_bytes[job]`` at ``link_bps``); the order moves with ``now_s``. A job that
      has just ended a step drops back, one whose step runs long rises: on a link the jobs' communication fits,
      the jobs take turns as earliest-deadline-first scheduling would give them (docs/jobs.md). Jobs without the
      reports rank after every reported one, all alike.

    Usage: ``job_order("static", ["b", "a", "c"], priority={"b": 0, "a": 1})``
    ``== (("b", "a", "c"), (0, 1, math.inf))``
    """
    ids = unique_ids(job_ids)
    if policy == "none":
        order = tuple(sorted(ids))
        return order, tuple(0.0 for _ in order)
    if policy == "static":
        prio = priority or {}
        rank = {j: float(prio[j]) if j in prio else math.inf for j in ids}
        return by_rank(rank)
    if policy in ROTATING:
        rotation = hashed_rotation_order if policy == "rotate" else alternating_rotation_order
        order = rotation(ids, rotation_epoch(now_s, epoch_s))
        return order, tuple(float(i) for i in range(len(order)))
    if policy == "intensity":
        inten = intensity or {}
        rank = {j: -float(inten.get(j, 0.0)) + 0.0 for j in ids}
        if any(math.isnan(r) for r in rank.values()):
            raise ValueError("intensity must not be NaN")
        return by_rank(rank)
    if policy == "shortest":
        sizes = step_bytes or {}
        rank = {j: float(sizes[j]) if j in sizes else math.inf for j in ids}
        if any(math.isnan(r) or r < 0 for r in rank.values()):
            raise ValueError("step_bytes must be non-negative numbers")
        return by_rank(rank)
    if policy == "measured_intensity":
        sizes, compute = step_bytes or {}, compute_s or {}
        rank = {j: measured_intensity_rank(compute[j], sizes[j]) if j in sizes and j in compute else math.inf
                for j in ids}
        return by_rank(rank)
    if policy == "slowdown":  # the reports in slowdown_rank's order of arguments
        got = (window_start or {}, window_steps or {}, compute_s or {}, tail_bytes or {})
        return by_rank({j: slowdown_rank(now_s, *(g[j] for g in got), link_bps) if all(j in g for g in got)
                        else math.inf for j in ids})
    raise ValueError(f"policy must be one of {', '.join(JOB_POLICIES)}, not {policy!r}")


def by_rank(rank: Mapping[str, float]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The jobs of ``rank`` (job -> rank value) smallest rank first, ties by job id, and their ranks: ``job_order``'s
    answer. Usage: ``by_rank({"b": 1.0, "a": 1.0, "c": 0.0}) == (("c", "a", "b"), (0.0, 1.0, 1.0))``"""
    order = tuple(sorted(rank, key=lambda j: (rank[j], j)))
    return order, tuple(rank[j] for j in order)


def measured_intensity_rank(compute_s: float, step_bytes: int) -> float:
    """The rank of a job under ``measured_intensity`` (smaller first): minus the number of whole ``INTENSITY_STEP``
    factors in its compute seconds per all-reduced byte, so the most GPU-intensive job comes first and jobs whose
    intensities differ by less than 10 % often share a band. ``inf`` (last) when either input is 0: nothing
    measured yet. A pure function of the two reported numbers, which every rank of a job reports alike: two agents
    rank a job alike whatever their link rates.

    Usage: ``measured_intensity_rank(0.5, 10**6) < measured_intensity_rank(0.5, 4 * 10**6)``
    """
    if not (math.isfinite(compute_s) and compute_s >= 0 and math.isfinite(step_bytes) and step_bytes >= 0):
        raise ValueError("compute_s and step_bytes must be non-negative and finite")
    if compute_s == 0 or step_bytes == 0:
        return math.inf
    # the logarithms apart: the quotient of a tiny time and a huge byte count underflows to 0
    return -float(math.floor((math.log(compute_s) - math.log(step_bytes)) / math.log(INTENSITY_STEP)))


def slowdown_rank(now_s: float, window_start: float, window_steps: int, compute_s: float, tail_bytes: int,
                  link_bps: float | None) -> float:
    """The rank of a job under ``slowdown`` at wall-clock ``now_s`` (smaller first): minus its slowdown over its
    window, ``(now_s - window_start) / ((window_steps + 1) * ideal)``: the time since the end of the step
    ``window_steps`` steps before its last one (as its shim reports it) over as many ideal steps plus the one under
    way. ``ideal = compute_s + 8 * tail_bytes / link_bps``: the step's compute time (agreed over the job's ranks: the
    time it does not wait for the network, the backward that overlaps its all-reduces included) plus what it waits
    for after backward on an idle link, its last bucket's bytes at the link's rate (without a rate, the compute time
    alone). ``inf`` (last) while ``compute_s`` is 0: nothing measured yet. A pure function of the reported numbers,
    the clock and the rate: agents whose clocks and link rates agree rank a job alike; near the moment two jobs'
    ranks cross, agents differ by their clock skew and sampling.

    Usage: ``slowdown_rank(12.0, 10.0, 1, 0.5, 0, None) == -2.0``
    """
    if not (math.isfinite(now_s) and math.isfinite(window_start) and math.isfinite(compute_s)):
        raise ValueError("now_s, window_start and compute_s must be finite")
    if compute_s < 0 or tail_bytes < 0 or window_steps < 0:
        raise ValueError("compute_s, tail_bytes and window_steps must not be negative")
    if link_bps is not None and not link_bps >= 0:  # NaN would make every rank NaN: an order by input position
        raise ValueError(f"link_bps must be None or >= 0 (0: no rate), not {link_bps!r}")
    if compute_s == 0:
        return math.inf
    ideal = compute_s + (8.0 * tail_bytes / link_bps if link_bps else 0.0)
    return -max(0.0, now_s - window_start) / ((window_steps + 1) * ideal)


def job_bands(order: Sequence[str], levels: int, ranks: Sequence[float] | None = None,
              groups: Mapping[str, Hashable] | None = None) -> dict[str, tuple[int, int]]:
    """Each job's band of levels ``(first level, width)``: the jobs in ``order`` (most urgent first; equal
    ``ranks`` together, default all distinct) are compressed onto ``b = min(levels, distinct ranks)`` bands
    (``policies.compress``, order preserved, least urgent bands filled first), and band ``i`` gets the levels
    ``[i * levels // b, (i + 1) * levels // b)``: the bands tile all levels, most urgent first.

    ``groups`` (job -> a key, e.g. the one ordinary user that holds it; jobs not named are a group of their own):
    the jobs of one group weigh one job in all in the cut (``1/k`` each of its ``k`` jobs, as ``tier_weights``
    weighs the parts), and a run of consecutive ranks whose jobs are all one group's is cut as one item; its band
    is then cut among its own jobs as they would be cut alone. So a group's many jobs take no more levels from the
    jobs around them than one job would, and the bands of the jobs outside a run do not depend on how many jobs the
    run holds. Bands change levels, never the order: the bands still tile the levels along ``order``. With every
    job in one group, or none named, the bands are those without ``groups``.

    Usage: ``job_bands(("x", "y"), 4) == {"x": (0, 2), "y": (2, 2)}``;
    ``job_bands(("r", "a1", "a2", "a3", "b"), 4, groups={"a1": 1, "a2": 1, "a3": 1})`` gives ``r`` (0, 1), ``a1``
    to ``a3`` level 1 and ``b`` (2, 2), as with one job of that group
    """
    if not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be a positive integer, not {levels!r}")
    order = tuple(order)
    ranks = tuple(range(len(order))) if ranks is None else tuple(ranks)
    if len(ranks) != len(order):
        raise ValueError("order and ranks differ in length")
    if list(ranks) != sorted(ranks):
        raise ValueError("ranks must not decrease along the order")
    if not order:
        return {}
    groups = groups or {}
    key = {job: ("group", groups[job]) if job in groups else ("job", job) for job in order}
    size = Counter(key.values())
    scale = math.lcm(*size.values())  # a job weighs scale // size: whole numbers, exact, proportional to 1/size
    items: list[list[tuple[str, float]]] = []  # the runs cut as one: (job, rank) of each
    owner_of_last = None
    for _, tied in itertools.groupby(zip(order, ranks, strict=True), key=lambda jr: jr[1]):
        tied = list(tied)
        owners = {key[j] for j, _ in tied}
        owner = owners.pop() if len(owners) == 1 else None  # a tie of two groups' jobs is an item of its own
        if owner is not None and owner == owner_of_last:
            items[-1].extend(tied)
        else:
            items.append(tied)
        owner_of_last = owner
    cut = contiguous_split([sum(scale // size[key[j]] for j, _ in item) for item in items], levels)
    n = max(cut) + 1
    out: dict[str, tuple[int, int]] = {}
    for g in range(n):  # more items than levels: width 1, the group's items share it; else one item per band
        first, width = g * levels // n, (g + 1) * levels // n - g * levels // n
        members = [jr for item, c in zip(items, cut, strict=True) if c == g for jr in item]
        inner = compress_levels([r for _, r in members], queues=width, reserved=0)
        m = max(inner) + 1
        out.update({j: (first + i * width // m, (i + 1) * width // m - i * width // m)
                    for (j, _), i in zip(members, inner, strict=True)})
    return out


def tiered_bands(order: Sequence[str], levels: int, ranks: Sequence[float] | None = None,
                 floors: Mapping[str, int] | None = None,
                 owners: Mapping[str, Hashable] | None = None) -> dict[str, tuple[int, int]]:
    """:func:`job_bands` per tier of users: a job's floor (``floors``, default 0) is the most urgent level its users
    may ask for (``level_limits``), and the jobs of one floor ``f`` tile the levels ``[f, levels)`` among themselves,
    in the policy's order. So the bands of one tier do not depend on the jobs of any other: a user limited to less
    urgent levels cannot push a more privileged user's job down, or narrow its band, by starting jobs; its jobs
    share the levels it may use anyway with the lower levels of the privileged jobs' bands. Within a tier the jobs
    of one ordinary user (``owners``: job -> the one user that holds it, as for :func:`tier_weights`) weigh one
    job in all (``job_bands``' ``groups``), so such a user cannot push another user's job of its tier down either.

    Usage: ``tiered_bands(("a", "b", "c"), 4, floors={"b": 2, "c": 2}) == {"a": (0, 4), "b": (2, 1), "c": (3, 1)}``
    """
    order = tuple(order)
    ranks = tuple(range(len(order))) if ranks is None else tuple(ranks)
    if len(ranks) != len(order):
        raise ValueError("order and ranks differ in length")
    floors = floors or {}
    tiers = sorted({floors.get(j, 0) for j in order})
    owners = owners or {}
    if tiers in ([], [0]):
        return job_bands(order, levels, ranks, owners)
    out: dict[str, tuple[int, int]] = {}
    for f in tiers:
        if not isinstance(f, int) or not 0 <= f < levels:
            raise ValueError(f"floor {f!r} outside 0..{levels - 1}")
        mine = [(j, r) for j, r in zip(order, ranks, strict=True) if floors.get(j, 0) == f]
        bands = job_bands([j for j, _ in mine], levels - f, [r for _, r in mine], owners)
        out.update({j: (first + f, width) for j, (first, width) in bands.items()})
    return out


def banded_level(band: tuple[int, int], requested: int, levels: int, floor: int = 0) -> int:
    """A flow's effective level: the level the client asked for (``0..levels-1``) compressed into its job's band
    (``first + requested * width // levels``: order preserved inside the band), never more urgent than
    ``floor`` (the registering user's most urgent allowed level, ``level_limits``).

    Usage: ``banded_level((2, 2), 3, 4) == 3`` and ``banded_level((0, 2), 1, 4) == 0``
    """
    first, width = band
    if not 0 <= requested < levels or width < 1 or first < 0 or first + width > levels:
        raise ValueError(f"level {requested} or band {band} outside 0..{levels - 1}")
    return max(first + requested * width // levels, floor)


def tier_weights(floors: Mapping[str, int], owners: Mapping[str, object] | None = None) -> dict[str, float]:
    """Each job's weight among the parts (:func:`job_shares`): the jobs of one group hold one job's part in all,
    ``1/k`` each for the ``k`` jobs of their group, however many jobs a user starts. A job of a tier of users
    limited to less urgent levels than the most privileged tier present (the least ``floors`` value) is in its
    tier's group; a job of the most privileged tier is in its owner's group (``owners``: job -> the one user that
    holds it, for a user that is neither root nor trusted) or, not named there (root's, a trusted user's), a group of
    its own (weight 1). The weights depend only on who holds the jobs, never on their order.

    Usage: ``tier_weights({"root-a": 0, "u1": 2, "u2": 2}) == {"root-a": 1.0, "u1": 0.5, "u2": 0.5}``;
    ``tier_weights({"r": 0, "a1": 0, "a2": 0, "b": 0}, {"a1": 1000, "a2": 1000, "b": 1001})`` gives ``r`` and ``b``
    1 each, ``a1`` and ``a2`` 0.5 each
    """
    if not floors:
        return {}
    top = min(floors.values())
    owners = owners or {}
    group = {job: ("tier", f) if f != top else ("user", owners[job]) if job in owners else ("job", job)
             for job, f in floors.items()}
    sizes = Counter(group.values())
    return {job: 1.0 / sizes[g] for job, g in group.items()}


def job_shares(bands: Mapping[str, tuple[int, int]], job_share: float,
               sending: Collection[str] = (), budget: float = 1.0,
               weights: Mapping[str, float] | None = None) -> dict[int, float]:
    """The link's share guaranteed to each level so that a job order never leaves a job with less than its part of
    ``job_share`` while it has bytes to send: ``job_share / n`` for each of the ``n`` jobs in ``bands``, and
    ``job_share / k`` while its band is one of ``k >= 2`` bands with a job ``sending`` (queues backlogged: FIFO
    would give each of them about 1/k of the link, not 1/n). Each part goes on its band's first (most urgent) level.
    Jobs that share a band share its classes: their idle parts add up, and a band counts once among the ``k``
    however many of its jobs send (the agent sees one queue, not which of them filled it). A sending band gets the
    larger of ``job_share / k`` and its jobs' idle parts, and where that makes the sending bands' parts exceed
    ``job_share`` they are scaled down to it. No level gets more than ``job_share``. Empty with fewer than two jobs
    or ``job_share = 0`` (strict order). The levels not named keep the backend's ``min_share``.

    An idle job keeps its ``1/n`` part as far as ``budget`` (the share of the link the classes' other guarantees
    leave: ``HtbBackend.share_budget``) has room beside the sending bands' parts; past that the idle parts shrink
    alike, and all parts together never exceed ``budget``. HTB lets every class send up to its guarantee without
    asking its parent, so guarantees that add up to more than the link send more than the link: the queue then
    forms past the host (in the NIC, or a switch port that orders by DSCP), where a job's guarantee means nothing
    and the agent cannot see its backlog. Within the budget an idle job's part costs the sending jobs nothing (HTB
    serves every class below its guarantee before any borrows) and is there at once when it starts to send.
    Priority still decides whatever the guarantees leave: the most urgent job takes all the link the others do not
    use, and with ``job_share`` near 1 a saturated link is shared about as under FIFO.
    ``weights`` (default 1 each; :func:`tier_weights`) counts a job as that fraction of one among the ``n`` and
    the ``k``: the jobs of a limited tier share one part, and so do one ordinary user's jobs.
    Usage: ``job_shares({"x": (0, 2), "y": (2, 2)}, 0.5) == {0: 0.25, 2: 0.25}``;
    ``job_shares({"x": (0, 1), "y": (1, 1), "z": (2, 2)}, 0.9, {"x", "z"})`` gives x and z 0.45 each and the idle
    y the 0.1 they leave, not 0.3
    """
    if not 0.0 <= job_share < 1.0:
        raise ValueError(f"job_share must be in [0, 1), not {job_share!r}")
    if not 0.0 <= budget <= 1.0:  # 0 on an absurdly slow link whose classes' least guarantees fill it: no parts
        raise ValueError(f"budget must be in [0, 1], not {budget!r}")
    if len(bands) < 2 or job_share == 0:
        return {}
    weight = {job: (1.0 if weights is None else weights.get(job, 1.0)) for job in bands}
    members: dict[tuple[int, int], float] = {}  # band -> the weight of the jobs that share it
    heaviest: dict[tuple[int, int], float] = {}  # band -> its heaviest job's weight (a band counts once as sending)
    for job, band in bands.items():
        members[band] = members.get(band, 0.0) + weight[job]
        heaviest[band] = max(heaviest.get(band, 0.0), weight[job])
    n = sum(weight.values())
    busy = {bands[job] for job in sending if job in bands}
    if len(busy) < 2:  # one band sending has the link anyway
        busy = set()
    k = sum(heaviest[band] for band in busy)
    idle = {band: m * job_share / n for band, m in members.items()}
    parts = {band: max(idle[band], job_share * heaviest[band] / k) for band in busy}
    scale = min(1.0, min(job_share, budget) / sum(parts.values())) if parts else 1.0
    parts = {band: part * scale for band, part in parts.items()}
    room = budget - sum(parts.values())  # what the idle bands' parts may hold together
    idle_total = sum(v for band, v in idle.items() if band not in parts)
    idle_scale = min(1.0, max(0.0, room) / idle_total) if idle_total else 1.0
    out: dict[int, float] = {}  # bands of two tiers (tiered_bands) can begin at one level: their parts add up
    for band in members:
        part = parts[band] if band in parts else idle[band] * idle_scale
        out[band[0]] = min(job_share, out.get(band[0], 0.0) + part)
    return out


def link_saturated(busy: Sequence[bool], was: bool, window: int) -> bool:
    """``job_share = "auto"``: whether the jobs keep the link saturated, from the last samples of the classes
    (``busy``, oldest first: whether some job's class had bytes queued). A job that sends queues its bytes (the
    link is the bottleneck), so the share of busy samples is the share of time the jobs use the link: at most their
    load where it fits (less where they collide), most of it where they need more (jobs in lockstep still compute
    at once and leave it idle meanwhile: docs/jobs-measured.md measures both). Saturated from ``AUTO_BUSY[1]``
    of ``window`` samples busy, and still saturated above ``AUTO_BUSY[0]`` (no flapping at the edge); fewer than
    ``window`` samples keep ``was``. Usage: ``link_saturated([True] * 40, False, 40) is True``"""
    if window < 1:
        raise ValueError(f"window must be at least one sample, not {window!r}")
    if len(busy) < window:
        return was
    recent = list(busy)[-window:]
    fraction = sum(map(bool, recent)) / window
    return fraction >= AUTO_BUSY[1] or (was and fraction >= AUTO_BUSY[0])
