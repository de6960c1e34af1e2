"""Job-side priorities (TensorLights, Crux): hand-checked orders and agent agreement."""
from __future__ import annotations

import hashlib
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorlane.policies.jobs import (
    AUTO_BUSY,
    AUTO_SHARES,
    JOB_POLICIES,
    Job,
    alternating_rotation_order,
    banded_level,
    hashed_rotation_order,
    job_bands,
    job_order,
    job_shares,
    link_saturated,
    measured_intensity_rank,
    rotation_epoch,
    rotation_key,
    slowdown_rank,
    tier_weights,
    tiered_bands,
)
from tensorlane.policies.papers.crux import gpu_intensity, gpu_intensity_order, job_levels
from tensorlane.policies.papers.tensorlights import rotate_job_order, static_job_order

JOBS = [Job("c", priority=1), Job("a", priority=1), Job("b", priority=0)]
job_ids = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=0, max_size=8, unique=True)


def test_static_order_by_hand() -> None:
    """b has static priority 0; a and c tie at 1 and go by id."""
    assert static_job_order(JOBS) == ("b", "a", "c")
    with pytest.raises(ValueError):
        static_job_order([Job("a"), Job("a")])


def test_rotation_by_hand() -> None:
    """Ids sorted a, b, c; epoch 20 s: [0, 20) -> a b c, [20, 40) -> b c a, [40, 60) -> c a b, 60 -> a b c."""
    assert rotate_job_order(JOBS, 20.0, 0.0) == ("a", "b", "c")
    assert rotate_job_order(JOBS, 20.0, 19.999) == ("a", "b", "c")
    assert rotate_job_order(JOBS, 20.0, 20.0) == ("b", "c", "a")
    assert rotate_job_order(JOBS, 20.0, 45.0) == ("c", "a", "b")
    assert rotate_job_order(JOBS, 20.0, 60.0) == ("a", "b", "c")
    assert rotate_job_order([], 20.0, 5.0) == ()
    with pytest.raises(ValueError):
        rotate_job_order(JOBS, 0.0, 1.0)


def test_gpu_intensity_by_hand() -> None:
    """x: 0.2 s compute, 10 MB over 1 Gbit/s = 0.08 s -> 2.5; y: 0.1 s, 1 MB over 1 Gbit/s = 0.008 s -> 12.5;
    z: 0.5 s, 100 MB at 10 Gbit/s = 0.08 s -> 6.25; w sends nothing -> infinite (first)."""
    jobs = [Job("x", 0.2, 10_000_000, 1e9), Job("y", 0.1, 1_000_000, 1e9), Job("z", 0.5, 100_000_000, 10e9),
            Job("w", 1.0, 0, 0.0)]
    assert gpu_intensity(jobs[0]) == pytest.approx(2.5) and gpu_intensity(jobs[1]) == pytest.approx(12.5)
    assert math.isinf(gpu_intensity(jobs[3]))
    assert gpu_intensity_order(jobs) == ("w", "y", "z", "x")
    # Crux's correction factor can move a job: x corrected by 4 -> 10.0, between y and z
    assert gpu_intensity_order(jobs[:3] + [Job("x2", 0.2, 10_000_000, 1e9, correction=4.0)])[:2] == ("y", "x2")
    # equal intensity: by job id
    assert gpu_intensity_order([Job("q", 1.0, 1000, 1e6), Job("p", 1.0, 1000, 1e6)]) == ("p", "q")


def test_job_levels() -> None:
    """8 queues, 3 reserved -> 5 levels; 7 jobs spread 2,1,... keeping order (least urgent filled first)."""
    lv = job_levels(tuple("abcdefg"))
    assert list(lv.values()) == sorted(lv.values()) and set(lv.values()) == {0, 1, 2, 3, 4}
    assert job_levels(("b", "a")) == {"b": 0, "a": 1}


job_st = st.builds(Job, st.text("abcdefgh", min_size=1, max_size=3), st.floats(0, 10),
                   st.integers(0, 10**9), st.floats(1e6, 1e11), st.integers(0, 3), st.floats(0.5, 2))


@settings(max_examples=100, deadline=None)
@given(st.lists(job_st, min_size=0, max_size=8, unique_by=lambda j: j.job_id), st.randoms(), st.floats(0, 1e6))
def test_every_agent_computes_the_same_order(jobs, rnd, now) -> None:
    """Agents may list the jobs in any order: the result depends only on the inputs' values."""
    shuffled = list(jobs)
    rnd.shuffle(shuffled)
    assert static_job_order(jobs) == static_job_order(shuffled)
    assert rotate_job_order(jobs, 20.0, now) == rotate_job_order(shuffled, 20.0, now)
    assert gpu_intensity_order(jobs) == gpu_intensity_order(shuffled)
    assert sorted(rotate_job_order(jobs, 20.0, now)) == sorted(j.job_id for j in jobs)


# ---- the agent's job policy: hashed rotation, bands, effective levels ----------------------------------------


def test_rotation_epoch_and_key_by_hand() -> None:
    """Epoch = floor(now / epoch_s); the key is SHA-256 of "EPOCH/JOB", the same on every machine."""
    assert rotation_epoch(0.0, 20.0) == 0 and rotation_epoch(19.999, 20.0) == 0 and rotation_epoch(45.0, 20.0) == 2
    assert rotation_epoch(1_700_000_001.5, 2.0) == 850_000_000
    assert rotation_key("job-a", 3) == hashlib.sha256(b"3/job-a").digest()
    # a fixed vector: this order must never change between versions (agents of two versions must agree)
    assert hashed_rotation_order(["a", "b", "c"], 0) == tuple(sorted("abc", key=lambda j: rotation_key(j, 0)))
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError):
            rotation_epoch(1.0, bad)
    with pytest.raises(ValueError):
        hashed_rotation_order(["a", "a"], 1)


def test_hashed_rotation_is_fair_and_rotates() -> None:
    """Over 3,000 epochs each of 3 jobs is first in about a third of them, and the order does change."""
    firsts = {"a": 0, "b": 0, "c": 0}
    orders = set()
    for epoch in range(3000):
        order = hashed_rotation_order(["a", "b", "c"], epoch)
        firsts[order[0]] += 1
        orders.add(order)
    assert all(850 <= n <= 1150 for n in firsts.values()), firsts
    assert len(orders) == 6  # every permutation occurs


@settings(max_examples=100, deadline=None)
@given(job_ids, st.integers(0, 10**9))
def test_alternating_rotation_swaps_every_pair_every_epoch_pair(ids, k) -> None:
    """In epochs 2k and 2k+1 every two jobs take both orders: each precedes the other in exactly half of the
    epochs (the hashed rotation only on average: a job can lead several epochs in a row by chance)."""
    even, odd = alternating_rotation_order(ids, 2 * k), alternating_rotation_order(ids, 2 * k + 1)
    assert even == hashed_rotation_order(ids, k) and odd == even[::-1]
    for a, b in itertools.combinations(ids, 2):
        assert (even.index(a) < even.index(b)) != (odd.index(a) < odd.index(b))


def test_alternating_rotation_leads_in_turn() -> None:
    """Two jobs: over any 8 epochs from an even one, each leads exactly 4 (the hashed rotation: 2 to 6 of 8)."""
    hashed = []
    for start in range(0, 2000, 2):
        leads = [alternating_rotation_order(["p", "q"], e)[0] for e in range(start, start + 8)]
        assert leads.count("p") == 4
        hashed.append([hashed_rotation_order(["p", "q"], e)[0] for e in range(start, start + 8)].count("p"))
    assert min(hashed) <= 2 and max(hashed) >= 6


def test_job_order_by_hand() -> None:
    ids = ["c", "a", "b", "d"]
    assert job_order("none", ids) == (("a", "b", "c", "d"), (0.0, 0.0, 0.0, 0.0))
    # static: listed by priority (ties by id), unlisted after them, all alike
    assert job_order("static", ids, priority={"c": 0, "a": 5, "b": 5}) == (
        ("c", "a", "b", "d"), (0.0, 5.0, 5.0, math.inf))
    # intensity: most intensive first; unlisted = 0; equal intensities tie
    assert job_order("intensity", ids, intensity={"d": 3.0, "b": 1.0, "a": 1.0}) == (
        ("d", "a", "b", "c"), (-3.0, -1.0, -1.0, 0.0))
    order, ranks = job_order("rotate", ids, now_s=41.0, epoch_s=20.0)
    assert order == hashed_rotation_order(ids, 2) and ranks == (0.0, 1.0, 2.0, 3.0)
    order, ranks = job_order("alternate", ids, now_s=61.0, epoch_s=20.0)  # epoch 3: epoch pair 1, reversed
    assert order == hashed_rotation_order(ids, 1)[::-1] and ranks == (0.0, 1.0, 2.0, 3.0)
    # shortest: fewest bytes per step first; equal sizes tie; jobs without a report after every reported one
    assert job_order("shortest", ids, step_bytes={"d": 10, "b": 40, "a": 40}) == (
        ("d", "a", "b", "c"), (10.0, 40.0, 40.0, math.inf))
    assert job_order("shortest", ids) == (("a", "b", "c", "d"), (math.inf,) * 4)  # no reports: one band
    with pytest.raises(ValueError, match="step_bytes"):
        job_order("shortest", ids, step_bytes={"a": -1})
    # measured_intensity: most compute per all-reduced byte first; within one INTENSITY_STEP a band may be shared;
    # jobs without both reports after every reported one
    order, ranks = job_order("measured_intensity", ids, step_bytes={"a": 10**6, "b": 4 * 10**6, "c": 10**6, "d": 1},
                             compute_s={"a": 0.5, "b": 0.5, "c": 0.501})
    assert order == ("a", "c", "b", "d") and ranks[0] == ranks[1] < ranks[2] < ranks[3] == math.inf
    assert job_order("measured_intensity", ids)[1] == (math.inf,) * 4
    with pytest.raises(ValueError, match="compute_s"):
        job_order("measured_intensity", ids, step_bytes={"a": 1}, compute_s={"a": math.nan})
    # slowdown: the job furthest behind its ideal step over its window first, at the time given; the order moves
    # with the clock: a job that has just ended a step drops back; jobs without every report after the others
    reports = {"tail_bytes": {"a": 10**6, "b": 10**6, "c": 0}, "compute_s": {"a": 0.5, "b": 0.5, "c": 1.0},
               "window_start": {"a": 100.0, "b": 101.0, "c": 100.0}, "window_steps": {"a": 4, "b": 0, "c": 4}}
    # ideal steps at 8 Mbit/s: a and b 1.5 s, c 1.0 s; at 102 s: a 2/7.5, b 1/1.5, c 2/5
    order, ranks = job_order("slowdown", ids, now_s=102.0, link_bps=8e6, **reports)
    assert order == ("b", "c", "a", "d") and ranks[:3] == pytest.approx((-1 / 1.5, -2 / 5, -2 / 7.5))
    assert ranks[3] == math.inf
    # later: a's window ran long, b's moved on (9/7.5 against 6/7.5), c's has just begun
    later = reports | {"window_start": {"a": 100.0, "b": 103.0, "c": 108.0}, "window_steps": {"a": 4, "b": 4, "c": 4}}
    assert job_order("slowdown", ids, now_s=109.0, link_bps=8e6, **later)[0] == ("a", "b", "c", "d")
    assert slowdown_rank(12.0, 10.0, 1, 0.5, 0, None) == -2.0  # no rate known: the compute time alone
    assert slowdown_rank(12.0, 10.0, 1, 0.0, 10, 8e6) == math.inf  # nothing measured yet
    assert slowdown_rank(9.0, 10.0, 1, 0.5, 0, None) == 0.0  # a window reported from ahead of this clock
    with pytest.raises(ValueError, match="window_steps"):
        slowdown_rank(12.0, 10.0, -1, 0.5, 0, None)
    assert job_order("slowdown", ids, now_s=102.0, link_bps=8e6, step_bytes=reports["tail_bytes"],
                     **{k: v for k, v in reports.items() if k != "tail_bytes"})[1] == (math.inf,) * 4  # the tail
    assert set(JOB_POLICIES) == {"none", "static", "rotate", "alternate", "intensity", "shortest",
                                 "measured_intensity", "slowdown"}
    with pytest.raises(ValueError, match="policy"):
        job_order("fair", ids)
    with pytest.raises(ValueError):
        job_order("static", ["a", "a"])


def test_job_bands_by_hand() -> None:
    """Bands tile the levels, most urgent first; jobs beyond the levels share bands (least urgent filled first)."""
    assert job_bands(("x", "y"), 4) == {"x": (0, 2), "y": (2, 2)}
    assert job_bands(("x", "y", "z"), 4) == {"x": (0, 1), "y": (1, 1), "z": (2, 2)}
    assert job_bands(tuple("abcd"), 4) == {j: (i, 1) for i, j in enumerate("abcd")}
    six = job_bands(tuple("abcdef"), 4)
    assert [six[j][0] for j in "abcdef"] == [0, 1, 2, 2, 3, 3]
    assert job_bands(("x", "y"), 4, ranks=(0, 0)) == {"x": (0, 4), "y": (0, 4)}  # a tie: one band
    assert job_bands(("x", "y"), 1) == {"x": (0, 1), "y": (0, 1)}
    assert job_bands((), 4) == {}
    with pytest.raises(ValueError):
        job_bands(("x", "y"), 4, ranks=(1, 0))
    with pytest.raises(ValueError):
        job_bands(("x",), 0)


def test_one_users_many_jobs_take_one_jobs_levels_by_hand() -> None:
    """On 4 levels, root's job r, user B's job b and user A's 20 jobs (``groups``: A's jobs weigh one job): r and b
    keep a level each, A's jobs split the two levels a third job would get. Before, bands were cut by the number of
    jobs, and r, b and two of A's jobs shared level 0 (and its class); A's 20 jobs behind b took b's levels 2-3."""
    many = [f"a{i:02d}" for i in range(20)]
    groups = dict.fromkeys(many, 1000)
    bands = job_bands(("r", "b", *many), 4, groups=groups)
    assert bands["r"] == (0, 1) and bands["b"] == (1, 1)
    assert [bands[j] for j in many] == [(2, 1)] * 10 + [(3, 1)] * 10  # as A's jobs alone on levels 2-3
    assert job_bands(("r", *many, "b"), 4, groups=groups) == {"r": (0, 1), **dict.fromkeys(many, (1, 1)),
                                                              "b": (2, 2)}
    # a tie of A's jobs with b's: one item, weighing two jobs; A's jobs split by b: each run its own item
    assert job_bands(("r", "a1", "a2", "b"), 4, (0, 1, 1, 1), {"a1": 1, "a2": 1}) == {
        "r": (0, 2), "a1": (2, 2), "a2": (2, 2), "b": (2, 2)}
    assert job_bands(("a1", "b", "a2"), 4, groups={"a1": 1, "a2": 1}) == {"a1": (0, 1), "b": (1, 1), "a2": (2, 2)}
    # in root's tier and in a tier limited to level 1 alike
    limited = ("x", "y1", "y2", "y3", "z")
    floors = dict.fromkeys(("r", "u1", "u2", "u3", "v"), 0) | dict.fromkeys(limited, 1)
    owners = {"u1": 7, "u2": 7, "u3": 7, "v": 8, "y1": 9, "y2": 9, "y3": 9, "z": 10}
    got = tiered_bands(("r", "u1", "u2", "u3", "v", *limited), 4, floors=floors, owners=owners)
    assert [got[j] for j in ("r", "u1", "u2", "u3", "v")] == [(0, 1), (1, 1), (1, 1), (1, 1), (2, 2)]
    assert [got[j] for j in limited] == [(1, 1), (2, 1), (2, 1), (2, 1), (3, 1)]  # before: y3 beside z at 3


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([None, 1001, 1002])), min_size=0, max_size=8),
       st.integers(0, 8), st.integers(1, 20), st.sampled_from(["distinct", "tied", "with_prev"]), st.integers(1, 5))
def test_another_users_band_does_not_depend_on_how_many_jobs_a_user_starts(others, at, many, how, levels) -> None:
    """User A's jobs come as one run in the policy's order (ranks between two other jobs', distinct or tied among
    themselves, or all tied with the job before): every other job's band (root's, user B's, user C's) is the same
    whether A runs one job or ``many``. Before, bands were cut by the number of jobs, and A's jobs took levels
    from the jobs around them (B's job behind 20 of A's on 4 levels: level 3 instead of levels 2-3)."""
    ranks_of_others = sorted(10 * r for r, _ in others)
    names = [f"o{i}" for i in range(len(others))]
    owners = {n: u for n, (_, u) in zip(names, others, strict=True) if u is not None}
    at = min(at, len(names))
    lo = ranks_of_others[at - 1] if at else -10
    if at and at < len(names) and ranks_of_others[at] == lo:  # between two tied jobs: only a tie with them
        how = "with_prev"
    if how == "with_prev" and not at:
        how = "tied"

    def bands(k):
        if how == "with_prev":
            mine = [lo] * k
        elif how == "tied":
            mine = [lo + 5] * k
        else:
            mine = [lo + 1 + (i * 8) // k for i in range(k)]  # distinct up to 8 jobs, then ties among them
        a = [f"a{i}" for i in range(k)]
        order = names[:at] + a + names[at:]
        ranks = ranks_of_others[:at] + mine + ranks_of_others[at:]
        got = job_bands(order, levels, ranks, owners | dict.fromkeys(a, 1000))
        _assert_tiled_in_order(got, order, ranks, levels)
        return {j: got[j] for j in names}
    assert bands(many) == bands(1)


def test_banded_level_by_hand() -> None:
    """Two jobs on 4 levels: the first gets 0-1, the second 2-3; tensor levels 0,1 -> first, 2,3 -> second."""
    assert [banded_level((0, 2), t, 4) for t in range(4)] == [0, 0, 1, 1]
    assert [banded_level((2, 2), t, 4) for t in range(4)] == [2, 2, 3, 3]
    assert [banded_level((0, 4), t, 4) for t in range(4)] == [0, 1, 2, 3]  # policy none: the identity
    assert banded_level((0, 2), 0, 4, floor=2) == 2  # never above the user's level limit
    with pytest.raises(ValueError):
        banded_level((0, 2), 4, 4)
    with pytest.raises(ValueError):
        banded_level((3, 2), 0, 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcdefghij"), min_size=0, max_size=10, unique=True),
       st.lists(st.integers(0, 3), min_size=10, max_size=10), st.integers(1, 5),
       st.lists(st.sampled_from([None, 1000, 1001]), min_size=10, max_size=10))
def test_bands_tile_the_levels_and_keep_the_order(jobs, prios, levels, users) -> None:
    """With or without ``groups`` (the jobs' ordinary users), the bands tile the levels along the order; with
    every job one user's, they are the bands without ``groups`` (a host of one user's jobs: as before)."""
    order, ranks = job_order("static", jobs, priority=dict(zip("abcdefghij", prios, strict=True)))
    plain = job_bands(order, levels, ranks)
    assert job_bands(order, levels, ranks, dict.fromkeys(order, 1000)) == plain
    owners = {j: u for j, u in zip("abcdefghij", users, strict=True) if u is not None and j in jobs}
    for bands in (plain, job_bands(order, levels, ranks, owners)):
        _assert_tiled_in_order(bands, order, ranks, levels)


def _assert_tiled_in_order(bands, order, ranks, levels) -> None:
    """``bands`` tile 0..levels-1 contiguously, never less urgent for an earlier job, one band for a tie, and
    the effective levels keep the order (job rank, requested level)."""
    if not order:
        return
    distinct = sorted({bands[j] for j in order})
    assert distinct[0][0] == 0 and distinct[-1][0] + distinct[-1][1] == levels
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(distinct))  # contiguous, no overlap
    for (j1, r1), (j2, r2) in itertools.pairwise(zip(order, ranks, strict=True)):
        assert bands[j1][0] <= bands[j2][0]
        if r1 == r2:
            assert bands[j1] == bands[j2]
    # effective levels: lexicographic (job rank, tensor level) never inverted
    pairs = sorted((r, t, j) for j, r in zip(order, ranks, strict=True) for t in range(levels))
    effective = [banded_level(bands[j], t, levels) for _, t, j in pairs]
    assert effective == sorted(effective)


def test_link_saturated_by_hand() -> None:
    """A full window decides, with hysteresis between AUTO_BUSY's two bounds; a window not yet full keeps the state;
    only the last ``window`` samples count."""
    assert AUTO_BUSY[0] < AUTO_BUSY[1] <= 1.0 and AUTO_SHARES[0] < AUTO_SHARES[1] < 1.0
    assert link_saturated([True] * 9, False, 10) is False and link_saturated([False] * 9, True, 10) is True
    assert link_saturated([True] * 20, False, 20) is True
    assert link_saturated([False] + [True] * 19, False, 20) is True  # 0.95
    assert link_saturated([False] * 2 + [True] * 18, False, 20) is False  # 0.90: not yet
    assert link_saturated([False] * 2 + [True] * 18, True, 20) is True  # 0.90: still
    assert link_saturated([False] * 4 + [True] * 16, True, 20) is False  # 0.80: no longer
    assert link_saturated([False] * 30 + [True] * 20, False, 20) is True  # older samples do not count
    with pytest.raises(ValueError):
        link_saturated([], False, 0)


def test_job_shares_by_hand() -> None:
    assert job_shares({"x": (0, 2), "y": (2, 2)}, 0.5) == {0: 0.25, 2: 0.25}
    assert job_shares({"a": (0, 1), "b": (1, 1), "c": (2, 2), "d": (2, 2)}, 0.8) == pytest.approx(
        {0: 0.2, 1: 0.2, 2: 0.4})  # c and d share a band: their parts add up
    assert job_shares({"x": (0, 4)}, 0.5) == {}  # one job: nothing to guarantee against
    assert job_shares({"x": (0, 2), "y": (2, 2)}, 0.0) == {}  # strict order
    # sending: x and z are backlogged, y idle: x and z 0.45 each (FIFO's halves of the part); y would keep 0.9 / 3,
    # but the parts never add up to more than the link: y keeps the 0.1 left
    assert job_shares({"x": (0, 1), "y": (1, 1), "z": (2, 2)}, 0.9, {"x", "z"}) == pytest.approx(
        {0: 0.45, 1: 0.1, 2: 0.45})
    # stagger4's four jobs, two sending, job_share 0.8: the idle two share the 0.2 left, or what a budget of 0.95
    # (five classes at min_share 0.01) leaves; at 0.95 nothing is left to them (the classes keep min_share)
    four = {"a": (0, 1), "b": (1, 1), "c": (2, 1), "d": (3, 1)}
    assert job_shares(four, 0.8, {"a", "b"}) == pytest.approx({0: 0.4, 1: 0.4, 2: 0.1, 3: 0.1})
    assert job_shares(four, 0.8, {"a", "b"}, 0.95) == pytest.approx({0: 0.4, 1: 0.4, 2: 0.075, 3: 0.075})
    assert job_shares(four, 0.95, {"a", "b"}, 0.95) == pytest.approx({0: 0.475, 1: 0.475, 2: 0.0, 3: 0.0})
    assert job_shares(four, 0.8, {"a", "b", "c"}, 0.95) == pytest.approx({0: 0.8 / 3, 1: 0.8 / 3, 2: 0.8 / 3,
                                                                          3: 0.15})
    assert job_shares(four, 0.8, (), 0.95) == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2})  # all idle: 0.8
    assert job_shares(four, 0.9, {"a", "b"}, 0.5) == pytest.approx({0: 0.25, 1: 0.25, 2: 0.0, 3: 0.0})
    assert job_shares({"x": (0, 1), "y": (1, 1), "z": (2, 2)}, 0.9, {"x"}) == pytest.approx(
        {0: 0.3, 1: 0.3, 2: 0.3})  # one sender has the link anyway: every job its 1/n
    # b and c share a band: it counts once, so it sends alone and every band keeps its idle parts
    assert job_shares({"a": (0, 2), "b": (2, 2), "c": (2, 2)}, 0.9, {"b", "c"}) == pytest.approx({0: 0.3, 2: 0.6})
    # measured_intensity's tie on stagger4: j0 and j2 in one band, backlogged; j1 too: two bands send, 0.4 each
    # (counted per job, j1 got 0.8 / 3 while only one of j0, j2 sent)
    tie = {"j0": (0, 1), "j2": (0, 1), "j1": (1, 1), "j3": (2, 2)}
    assert job_shares(tie, 0.8, {"j0", "j2", "j1"}) == pytest.approx({0: 0.4, 1: 0.4, 2: 0.2})
    # a band of three jobs keeps at least its idle parts (0.6 of 0.8) beside a sending job's 0.4: scaled to 0.8
    three = {"a": (0, 2), "b": (0, 2), "c": (0, 2), "d": (2, 2)}
    assert job_shares(three, 0.8, {"a", "d"}) == pytest.approx({0: 0.8 * 0.6 / 1.0, 2: 0.8 * 0.4 / 1.0})
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ValueError, match="job_share"):
            job_shares({"x": (0, 2), "y": (2, 2)}, bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="budget"):
            job_shares({"x": (0, 2), "y": (2, 2)}, 0.5, (), bad)
    # a link so slow that the classes' least guarantees fill it (8 kbit/s each): no parts, and no error
    assert job_shares({"x": (0, 1), "y": (1, 1), "z": (2, 1)}, 0.5, {"x", "y"}, 0.0) == {0: 0.0, 1: 0.0, 2: 0.0}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcdefghij"), min_size=2, max_size=10, unique=True),
       st.lists(st.integers(0, 3), min_size=10, max_size=10), st.integers(1, 5), st.floats(0.01, 0.95))
def test_job_shares_give_every_job_its_part(jobs, prios, levels, share) -> None:
    """The guarantees add up to ``job_share``, each on a band's first level, and every job's band holds at least
    its equal part (more when jobs share the band)."""
    order, ranks = job_order("static", jobs, priority=dict(zip("abcdefghij", prios, strict=True)))
    bands = job_bands(order, levels, ranks)
    shares = job_shares(bands, share)
    assert sum(shares.values()) == pytest.approx(share)
    assert set(shares) == {first for first, _ in bands.values()}
    assert all(shares[bands[j][0]] >= share / len(jobs) - 1e-12 for j in jobs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdefghij"), min_size=2, max_size=10, unique=True), st.integers(1, 5),
       st.floats(0.01, 0.95), st.sets(st.sampled_from("abcdefghij")), st.floats(0.05, 1.0))
def test_job_shares_of_sending_jobs(jobs, levels, share, sending, budget) -> None:
    """Each of k >= 2 bands with a sending job holds at least half of ``min(job_share, budget) / k`` on its first
    level (all of it where no band is shared), each idle band its jobs' ``job_share / n`` each as far as the budget
    has room beside the sending bands, all idle bands alike; the sending bands' parts together never exceed
    ``job_share``, no level holds more than ``job_share``, and all parts together never exceed ``budget`` (HTB
    would send more than the link)."""
    bands = job_bands(jobs, levels)
    members = {b: sum(1 for j in jobs if bands[j] == b) for b in set(bands.values())}
    busy = {bands[j] for j in jobs if j in sending}
    shares = job_shares(bands, share, sending, budget)
    k = len(busy)
    busy = busy if k >= 2 else set()
    sent = sum(shares[b[0]] for b in busy)
    idle_want = sum(m * share / len(jobs) for b, m in members.items() if b not in busy)
    idle_scale = min(1.0, max(0.0, budget - sent) / idle_want) if idle_want else 1.0
    for band, m in members.items():
        if band in busy:
            least = min(share, budget) / k if max(members.values()) == 1 else min(share, budget) / k / 2
            assert shares[band[0]] >= min(share, least) - 1e-12
        else:
            assert shares[band[0]] == pytest.approx(m * share / len(jobs) * idle_scale, abs=1e-12)
    assert max(shares.values()) <= share + 1e-12
    assert sent <= min(share, budget) + 1e-12
    assert sum(shares.values()) <= budget + 1e-12


@settings(max_examples=200, deadline=None)
@given(job_ids, job_ids, st.integers(0, 10**9), st.integers(1, 5), st.sampled_from(["rotate", "alternate"]))
def test_agents_with_different_job_sets_agree_on_shared_jobs(seen1, seen2, epoch, levels, policy) -> None:
    """Two agents see different jobs (e.g. host 1 runs a, b, c; host 2 runs b, c, d): in every epoch they order
    each pair of shared jobs alike, and their effective levels for a shared pair are never inverted."""
    now = epoch * 20.0 + 3.0
    o1, r1 = job_order(policy, seen1, now_s=now, epoch_s=20.0)
    o2, r2 = job_order(policy, seen2, now_s=now, epoch_s=20.0)
    shared = set(seen1) & set(seen2)
    assert [j for j in o1 if j in shared] == [j for j in o2 if j in shared]
    b1, b2 = job_bands(o1, levels, r1), job_bands(o2, levels, r2)
    for a in shared:
        for b in shared:
            for t in range(levels):
                l1a, l1b = banded_level(b1[a], t, levels), banded_level(b1[b], t, levels)
                l2a, l2b = banded_level(b2[a], t, levels), banded_level(b2[b], t, levels)
                assert not (l1a < l1b and l2a > l2b), (a, b, o1, o2)


def test_position_rotation_disagrees_but_hashed_does_not() -> None:
    """Why the agent does not use rotate_job_order: by position in the locally seen list, an agent that also sees
    a third job can order two shared jobs the other way round. The hashed order never does."""
    found = False
    for now in range(0, 200, 20):
        o1 = rotate_job_order([Job("a"), Job("b")], 20.0, float(now))
        o2 = rotate_job_order([Job("a"), Job("b"), Job("c")], 20.0, float(now))
        if [j for j in o2 if j != "c"] != list(o1):
            found = True
        h1, h2 = hashed_rotation_order(["a", "b"], now), hashed_rotation_order(["a", "b", "c"], now)
        assert [j for j in h2 if j != "c"] == list(h1)
    assert found


def assert_shared_pairs_agree(shared: set, levels: int, first: tuple, second: tuple) -> None:
    """Two agents' ``(order, ranks)``: every two ``shared`` jobs in the same order, and no requested level of one
    more urgent than the other's on one agent and less urgent on the other."""
    (o1, r1), (o2, r2) = first, second
    b1, b2 = job_bands(o1, levels, r1), job_bands(o2, levels, r2)
    for a in shared:
        for b in shared:
            assert (o1.index(a) < o1.index(b)) == (o2.index(a) < o2.index(b))
            for t in range(levels):
                l1a, l1b = banded_level(b1[a], t, levels), banded_level(b1[b], t, levels)
                l2a, l2b = banded_level(b2[a], t, levels), banded_level(b2[b], t, levels)
                assert not (l1a < l1b and l2a > l2b), (a, b, o1, o2)


@settings(max_examples=200, deadline=None)
@given(job_ids, job_ids, st.integers(1, 5), st.data())
def test_agents_agree_on_shared_jobs_by_reported_step_bytes(seen1, seen2, levels, data) -> None:
    """``shortest``: every rank of a job reports the same step bytes, so two agents that both have the reports of
    two shared jobs order them alike, whatever other jobs (reported or not) each one sees."""
    every = sorted(set(seen1) | set(seen2))
    sizes = {j: data.draw(st.integers(0, 5)) * 1000 for j in every}
    reported1 = {j: sizes[j] for j in seen1 if data.draw(st.booleans()) or j in seen2}
    reported2 = {j: sizes[j] for j in seen2 if data.draw(st.booleans()) or j in seen1}
    o1, r1 = job_order("shortest", seen1, step_bytes=reported1)
    o2, r2 = job_order("shortest", seen2, step_bytes=reported2)
    assert_shared_pairs_agree(set(seen1) & set(seen2), levels, (o1, r1), (o2, r2))


def test_measured_intensity_is_cruxs_intensity_without_the_link_rate() -> None:
    """The rank is a function of compute seconds per byte only, so agents on links of any rate rank alike; it
    follows Crux's GPU intensity (compute over the step's transfer time at a link rate) in the same direction."""
    jobs = [(0.6, 3_750_000), (0.3, 3_750_000), (1.2, 30_000_000), (0.05, 100_000)]
    for rate in (1e9, 50e6, 25e9):
        by_intensity = [int(j) for j in gpu_intensity_order([Job(str(i), c, b, rate) for i, (c, b) in enumerate(jobs)])]
        by_rank = sorted(range(len(jobs)), key=lambda i: measured_intensity_rank(*jobs[i]))
        assert by_rank == by_intensity
    assert measured_intensity_rank(0.0, 10) == math.inf and measured_intensity_rank(1.0, 0) == math.inf
    with pytest.raises(ValueError):
        measured_intensity_rank(-1.0, 10)


@settings(max_examples=200, deadline=None)
@given(job_ids, job_ids, st.integers(1, 5), st.data())
def test_agents_agree_on_shared_jobs_by_measured_intensity(seen1, seen2, levels, data) -> None:
    """``measured_intensity``: every rank of a job reports the same agreed compute time and step bytes, so two
    agents with both shared jobs' reports order them alike, whatever other jobs each one sees."""
    every = sorted(set(seen1) | set(seen2))
    sizes = {j: data.draw(st.integers(1, 5)) * 10**6 for j in every}
    compute = {j: data.draw(st.sampled_from([0.1, 0.25, 0.26, 0.5, 1.0])) for j in every}
    kept1 = [j for j in seen1 if data.draw(st.booleans()) or j in seen2]
    kept2 = [j for j in seen2 if data.draw(st.booleans()) or j in seen1]
    o1, r1 = job_order("measured_intensity", seen1, step_bytes={j: sizes[j] for j in kept1},
                       compute_s={j: compute[j] for j in kept1})
    o2, r2 = job_order("measured_intensity", seen2, step_bytes={j: sizes[j] for j in kept2},
                       compute_s={j: compute[j] for j in kept2})
    assert_shared_pairs_agree(set(seen1) & set(seen2), levels, (o1, r1), (o2, r2))


@settings(max_examples=200, deadline=None)
@given(job_ids, job_ids, st.integers(1, 5), st.data())
def test_agents_agree_on_shared_jobs_by_slowdown(seen1, seen2, levels, data) -> None:
    """``slowdown``: two agents that read the same clock, on links of the same rate, with both shared jobs'
    windows (each job's ranks report the same step ends up to the hosts' skew, here none) order them alike,
    whatever other jobs each one sees."""
    every = sorted(set(seen1) | set(seen2))
    got = {j: (data.draw(st.integers(1, 5)) * 10**6, data.draw(st.sampled_from([0.1, 0.25, 0.5])),
               100.0 + data.draw(st.integers(0, 40)) / 10, data.draw(st.integers(0, 4))) for j in every}

    def order(seen):
        kept = [j for j in seen if data.draw(st.booleans()) or j in set(seen1) & set(seen2)]
        return job_order("slowdown", seen, now_s=105.0, link_bps=50e6,
                         **{name: {j: got[j][i] for j in kept} for i, name in
                            enumerate(("tail_bytes", "compute_s", "window_start", "window_steps"))})

    assert_shared_pairs_agree(set(seen1) & set(seen2), levels, order(seen1), order(seen2))


def test_tiered_bands_by_hand() -> None:
    """Jobs of users limited to level f tile [f, levels) among themselves; the other tiers' bands are unchanged."""
    assert tiered_bands(("a", "b", "c"), 4, floors={"b": 2, "c": 2}) == {"a": (0, 4), "b": (2, 1), "c": (3, 1)}
    assert tiered_bands(("a", "b"), 4) == job_bands(("a", "b"), 4) == tiered_bands(("a", "b"), 4, floors={})
    assert tiered_bands(("x", "a"), 4, floors={"x": 3}) == {"x": (3, 1), "a": (0, 4)}
    assert tiered_bands(("x", "y"), 4, ranks=(0, 0), floors={"x": 1, "y": 1}) == {"x": (1, 3), "y": (1, 3)}
    with pytest.raises(ValueError):
        tiered_bands(("x",), 4, floors={"x": 4})
    # parts of bands that begin at one level (two tiers) add up
    assert job_shares({"r": (2, 2), "a": (2, 1), "b": (3, 1), "q": (0, 2)}, 0.8) == {0: 0.2, 2: 0.4, 3: 0.2}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=6, unique=True),
       st.lists(st.text("stuvwxyz", min_size=1, max_size=3), min_size=0, max_size=10, unique=True),
       st.integers(1, 3), st.randoms())
def test_a_limited_users_jobs_never_move_a_more_privileged_job(mine, theirs, floor, rnd) -> None:
    """Whatever the order and however many jobs a user limited to ``floor`` adds, the bands of the jobs of users
    who may use level 0 are what they are without them (a user cannot push another's job down by starting jobs)."""
    levels = 4
    order = mine + theirs
    rnd.shuffle(order)
    ranks = sorted(rnd.randint(0, 3) for _ in order)
    floors = dict.fromkeys(theirs, floor)
    alone = [j for j in order if j in mine]
    with_them = tiered_bands(order, levels, ranks, floors)
    without = tiered_bands(alone, levels, [r for j, r in zip(order, ranks, strict=True) if j in mine])
    assert {j: with_them[j] for j in mine} == without
    assert all(with_them[j][0] >= floor for j in theirs)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 4), st.integers(1, 12), st.integers(1, 3), st.floats(0.05, 0.95))
def test_a_limited_tier_holds_one_part_however_many_jobs(privileged, limited, floor, share) -> None:
    """The parts of the most privileged tier's levels do not depend on how many jobs a limited tier starts."""
    def parts(k):
        floors = {f"r{i}": 0 for i in range(privileged)} | {f"u{i}": floor for i in range(k)}
        order = list(floors)
        bands = tiered_bands(order, 4, floors=floors)
        out = job_shares(bands, share, budget=1.0, weights=tier_weights(floors))
        return {lvl: v for lvl, v in out.items() if lvl < floor}
    assert parts(limited) == pytest.approx(parts(1))


def test_one_ordinary_users_jobs_share_one_part() -> None:
    """In the most privileged tier, the jobs of one ordinary user (``owners``) share one part; root's and trusted
    users' jobs (not in ``owners``) keep one each; a limited tier still shares one part across its users."""
    floors = {"r": 0, "a1": 0, "a2": 0, "a3": 0, "b": 0, "u1": 2, "u2": 2}
    owners = {"a1": 1000, "a2": 1000, "a3": 1000, "b": 1001, "u1": 1002, "u2": 1003}
    w = tier_weights(floors, owners)
    assert w == pytest.approx({"r": 1, "a1": 1 / 3, "a2": 1 / 3, "a3": 1 / 3, "b": 1, "u1": 0.5, "u2": 0.5})
    assert tier_weights({"a1": 0, "a2": 0}) == {"a1": 1.0, "a2": 1.0}  # no owners: one part per job, as before


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.floats(0.05, 0.95), st.booleans())
def test_an_ordinary_user_holds_one_part_however_many_jobs(many, share, sending) -> None:
    """User A's jobs ahead of user B's one job and root's: B's and root's parts do not depend on how many jobs A
    starts (each job on a band of its own), whether every job sends or none."""
    def parts(k):
        order = [f"a{i}" for i in range(k)] + ["root", "b"]
        owners = {f"a{i}": 1000 for i in range(k)} | {"b": 1001}
        floors = dict.fromkeys(order, 0)
        bands = tiered_bands(order, 16, floors=floors)
        out = job_shares(bands, share, order if sending else (), budget=1.0, weights=tier_weights(floors, owners))
        return out[bands["root"][0]], out[bands["b"][0]]
    assert parts(many) == pytest.approx(parts(1))
    assert parts(many)[1] == pytest.approx(share / 3)  # A, root and B: one part each
