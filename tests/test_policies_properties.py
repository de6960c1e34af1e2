"""Properties of policies/ across modules: agreement between agents on every job policy, levels in range, bytes
conserved by the cutting rule, and the simulator's link never sending faster than its rate. Each test is fast."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorlane.policies.compress import compress_levels
from tensorlane.policies.cutting import bucket_pieces, forward_order_levels, pieces_of
from tensorlane.policies.jobmix import MixJob, link_order_rates, simulate_links
from tensorlane.policies.jobs import (
    banded_level,
    job_bands,
    job_order,
    measured_intensity_rank,
    slowdown_rank,
    tiered_bands,
)
from tensorlane.policies.model import Block, CostModel, Schedule
from tensorlane.policies.simulator import network_done_times

ids_st = st.lists(st.text("abcdef", min_size=1, max_size=2), max_size=7, unique=True)


def _tables(data, every: list[str]) -> dict:
    """One value of every input of ``job_order`` per job (the same on every agent: each job reports alike)."""
    return {
        "priority": {j: data.draw(st.integers(-2, 2)) for j in every},
        "intensity": {j: data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e12])) for j in every},
        "step_bytes": {j: data.draw(st.integers(0, 4)) * 1000 for j in every},
        "compute_s": {j: data.draw(st.sampled_from([0.0, 0.1, 0.25, 0.5])) for j in every},
        "tail_bytes": {j: data.draw(st.integers(0, 3)) * 10**5 for j in every},
        "window_start": {j: 100.0 + data.draw(st.integers(0, 40)) / 10 for j in every},
        "window_steps": {j: data.draw(st.integers(0, 4)) for j in every},
    }


def _seen(tables: dict, jobs: list[str], kept: set[str]) -> dict:
    """The tables as one agent has them: only the jobs in ``kept`` (reported to it, or listed in its config)."""
    return {name: {j: v for j, v in table.items() if j in kept and j in jobs} for name, table in tables.items()}


@settings(max_examples=60, deadline=None)
@given(ids_st, ids_st, st.integers(1, 5), st.sampled_from(["none", "static", "intensity", "shortest",
                                                          "measured_intensity", "slowdown", "rotate", "alternate"]),
       st.data())
def test_two_agents_agree_on_every_shared_pair_under_every_policy(seen1, seen2, levels, policy, data) -> None:
    """The issue's requirement, for every job policy at once: two agents that see overlapping sets of jobs (each
    with the shared jobs' inputs; the others' maybe missing), at the same clock and link rate, order every pair of
    shared jobs alike, and never make one requested level of job a more urgent than b's on one agent and less
    urgent on the other. The answer does not depend on the order the jobs or the tables are listed in."""
    every = sorted(set(seen1) | set(seen2))
    shared = set(seen1) & set(seen2)
    tables = _tables(data, every)
    kept1 = {j for j in seen1 if j in shared or data.draw(st.booleans())}
    kept2 = {j for j in seen2 if j in shared or data.draw(st.booleans())}
    kw = {"now_s": 105.0, "epoch_s": 20.0, "link_bps": 50e6}
    o1, r1 = job_order(policy, seen1, **kw, **_seen(tables, seen1, kept1))
    o2, r2 = job_order(policy, seen2, **kw, **_seen(tables, seen2, kept2))
    # dict and list order play no part
    rev = {name: dict(reversed(list(t.items()))) for name, t in _seen(tables, seen1, kept1).items()}
    assert job_order(policy, list(reversed(seen1)), **kw, **rev) == (o1, r1)
    b1, b2 = job_bands(o1, levels, r1), job_bands(o2, levels, r2)
    for band in (*b1.values(), *b2.values()):
        assert band[0] >= 0 and band[1] >= 1 and band[0] + band[1] <= levels
    for a in shared:
        for b in shared:
            assert (o1.index(a) < o1.index(b)) == (o2.index(a) < o2.index(b)), (policy, a, b, o1, o2)
            for t in range(levels):
                l1a, l1b = banded_level(b1[a], t, levels), banded_level(b1[b], t, levels)
                l2a, l2b = banded_level(b2[a], t, levels), banded_level(b2[b], t, levels)
                assert min(l1a, l1b, l2a, l2b) >= 0 and max(l1a, l1b, l2a, l2b) < levels
                assert not (l1a < l1b and l2a > l2b), (policy, a, b, o1, o2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4)), max_size=12),
       st.one_of(st.none(), st.integers(1, 16)))
def test_bucket_pieces_conserve_bytes_and_levels(items, limit) -> None:
    """The pieces tile the bucket: every byte once, at its own item's level, no piece over ``limit``, none empty."""
    sizes, levels = [n for n, _ in items], [lv for _, lv in items]
    pieces = bucket_pieces(sizes, levels, limit)
    pos = 0
    for off, length, _lv in pieces:
        assert off == pos and length > 0 and (limit is None or length <= limit)
        pos += length
    assert [lv for _o, n, lv in pieces for _ in range(n)] == [lv for n, lv in items for _ in range(n)]
    assert pieces_of(sizes, levels, limit) == pieces


def test_bucket_pieces_refuse_a_missing_level() -> None:
    """A level list shorter than the bucket's items is an error, not a bucket whose last bytes go in no piece
    (they would never be all-reduced)."""
    with pytest.raises(ValueError, match="levels"):
        bucket_pieces([4, 4], [0], None)
    with pytest.raises(ValueError, match="levels"):
        pieces_of([4], [0, 1], 8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10**12), max_size=12), st.integers(1, 6))
def test_forward_order_levels_stay_in_range_and_keep_the_order(sizes, levels) -> None:
    """Layer order: levels within 0..levels-1, never less urgent for an earlier layer, all of 0..m-1 used; huge
    sizes and zero-size layers included."""
    got = forward_order_levels(sizes, levels)
    assert len(got) == len(sizes) and list(got) == sorted(got)
    assert set(got) == set(range(min(levels, len(sizes))))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([-1.5, 0.0, 1.0, 2.0, 7.0, math.inf]), max_size=10), st.integers(1, 8),
       st.integers(0, 3))
def test_compress_levels_is_monotone_and_in_range(prios, queues, reserved) -> None:
    if queues - reserved < 1:
        with pytest.raises(ValueError):
            compress_levels(prios, queues, reserved)
        return
    got = compress_levels(prios, queues, reserved)
    for (p, a), (q, b) in ((x, y) for x in zip(prios, got, strict=True) for y in zip(prios, got, strict=True)):
        assert (p < q) <= (a <= b) and (p == q) <= (a == b)
    assert set(got) == set(range(min(queues - reserved, len(set(prios)))))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.floats(0, 1), st.integers(0, 3), st.integers(0, 5)),
                min_size=1, max_size=8),
       st.integers(2, 5), st.floats(0, 0.01), st.sampled_from(["ps", "fifo"]), st.one_of(st.none(), st.integers(1, 3)),
       st.one_of(st.none(), st.integers(1, 8000)), st.one_of(st.none(), st.integers(1, 2)), st.booleans())
def test_simulator_never_sends_faster_than_the_link(spec, ranks, alpha, sharing, inflight, credit, per_level,
                                                    weighted) -> None:
    """Whatever the limits, levels and weights: each block takes at least its uncontended time, and the bits of
    the blocks done by any time t fit in the link's rate from the first possible send to t (no link ever carries
    more than its rate; every block's bits are sent)."""
    blocks, pos = [], 0
    for nbytes, ready, level, prio in spec:
        blocks.append(Block(pos, pos + nbytes, (0,), ready, prio, level))
        pos += nbytes
    sched = Schedule("p", tuple(blocks), max_inflight=inflight, credit_bytes=credit, per_level_inflight=per_level)
    cost = CostModel(ranks, 8000.0, 0.0, alpha)
    weights = [1.0 + i % 3 for i in range(len(blocks))] if weighted and sharing == "ps" else None
    done = network_done_times(sched, cost, [b.ready_s for b in blocks], sharing, weights)
    sent, start = 0.0, min(b.ready_s for b in blocks) + cost.startup_s()
    for i in sorted(range(len(blocks)), key=lambda i: done[i]):
        assert done[i] >= blocks[i].ready_s + cost.allreduce_s(blocks[i].nbytes) - 1e-9
        if blocks[i].nbytes:
            sent += cost.wire_bits(blocks[i].nbytes)
            assert sent <= cost.link_bps * (done[i] - start) * (1 + 1e-9) + 1e-6


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.floats(0, 0.99), st.data())
def test_link_order_rates_never_exceed_a_link(n, share, data) -> None:
    """FIFO (max-min) and any order: rates are shares in [0, 1], no link carries more than 1, a job on no link is
    held back by none (rate 1)."""
    sending = sorted(data.draw(st.sets(st.sampled_from(range(n)))))
    links = [data.draw(st.sets(st.sampled_from(range(n)), min_size=1)) for _ in range(data.draw(st.integers(1, 3)))]
    for order in (None, data.draw(st.permutations(range(n)))):
        rates = link_order_rates(sending, links, order, share)
        assert sorted(rates) == sending and all(0.0 <= r <= 1.0 + 1e-12 for r in rates.values())
        for link in links:
            assert sum(rates[j] for j in link if j in rates) <= 1.0 + 1e-9
        for j in sending:
            if not any(j in link for link in links):
                assert rates[j] == 1.0


def test_a_job_on_no_shared_link_runs_alone() -> None:
    """``simulate_links`` where a job crosses none of the links given: it runs at the whole rate (before the fix,
    FIFO's max-min loop raised 'min() arg is an empty sequence' while an order gave it 1.0)."""
    assert link_order_rates([0, 1], [(0,)], None, 0.0) == {0: 1.0, 1: 1.0}
    jobs = [MixJob(1.0, 1.0, 2), MixJob(1.0, 1.0, 2)]
    assert simulate_links(jobs, [(0,)]) == pytest.approx([4.0, 4.0])
    assert simulate_links(jobs, [(0,)], order=[1, 0]) == pytest.approx([4.0, 4.0])


def test_job_ranks_refuse_inputs_that_would_break_the_order() -> None:
    """A NaN rank sorts nowhere (every comparison false: the order would follow the input's), so the rank functions
    refuse what would give one, with ValueError as they promise (not OverflowError)."""
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError):
            measured_intensity_rank(1.0, bad)
    for bad in (math.nan, -8.0):
        with pytest.raises(ValueError):
            slowdown_rank(12.0, 10.0, 1, 0.5, 10, bad)
    assert slowdown_rank(12.0, 10.0, 1, 0.5, 10, 0) == slowdown_rank(12.0, 10.0, 1, 0.5, 10, None) == -2.0


@settings(max_examples=150, deadline=None)
@given(ids_st, ids_st, st.integers(2, 5), st.data())
def test_tiered_bands_agree_on_every_shared_pair_of_one_tier(seen1, seen2, levels, data) -> None:
    """With ``level_limits`` (floors), two agents that see different jobs never invert a requested level of two
    shared jobs of one tier (the jobs' own order and floors alike on both), also where one ordinary user's jobs
    weigh one job in the cut (``owners``)."""
    every = sorted(set(seen1) | set(seen2))
    floors = {j: data.draw(st.integers(0, levels - 1)) for j in every}
    prio = {j: data.draw(st.integers(0, 3)) for j in every}
    owners = {j: u for j in every if (u := data.draw(st.sampled_from([None, 1000, 1001]))) is not None}
    bands = []
    for seen in (seen1, seen2):
        order, ranks = job_order("static", seen, priority={j: prio[j] for j in seen})
        bands.append(tiered_bands(order, levels, ranks, {j: floors[j] for j in seen},
                                  {j: owners[j] for j in seen if j in owners}))
    shared = set(seen1) & set(seen2)
    for a in shared:
        for b in shared:
            if floors[a] != floors[b]:
                continue
            for t in range(levels):
                d = [banded_level(bd[a], t, levels, floors[a]) - banded_level(bd[b], t, levels, floors[b])
                     for bd in bands]
                assert not (d[0] < 0 < d[1]), (a, b, t, bands)


def test_tiers_can_invert_a_pair_of_two_tiers() -> None:
    """Across tiers the effective levels need not follow the order, and agents can disagree (docs/jobs.md, "How
    agents agree"): a is first by priority but its user is limited to level 1; b (unlimited) is ahead of a on an
    agent that sees only a and b, behind a on one that also sees c, whose band pushes b down."""
    floors, prio = {"a": 1, "b": 0, "c": 0}, {"a": 0, "b": 1, "c": 0}
    got = []
    for seen in (["a", "b"], ["a", "b", "c"]):
        order, ranks = job_order("static", seen, priority={j: prio[j] for j in seen})
        assert order.index("a") < order.index("b")
        bands = tiered_bands(order, 4, ranks, {j: floors[j] for j in seen})
        got.append((banded_level(bands["a"], 0, 4, 1), banded_level(bands["b"], 0, 4, 0)))
    assert got == [(1, 0), (1, 2)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 << 20), st.floats(0, 0.01), st.floats(0, 0.02)), min_size=1, max_size=6),
       st.integers(1, 5), st.sampled_from([50e6, 1e9]))
def test_plan_shim_levels_in_range_and_in_layer_order(spec, levels_max, rate) -> None:
    """The planner's choice: one level per layer within 0..levels_max-1, never less urgent for an earlier layer,
    ``levels`` the number used, and its prediction within the tie tolerance of the fastest candidate."""
    from tensorlane.policies.model import Layer, Profile
    from tensorlane.policies.planner import SHIM_TIE_TOLERANCE, plan_shim

    prof = Profile("r", tuple(Layer(f"l{i}", b, f, w) for i, (b, f, w) in enumerate(spec)))
    plan = plan_shim(prof, 2, rate, levels_max=levels_max, bucket_bytes=(1 << 20,), partitions=(None, 1 << 20))
    lv = plan.layer_levels
    assert len(lv) == len(spec) and list(lv) == sorted(lv) and min(lv) >= 0 and max(lv) < levels_max
    assert plan.levels == 1 + max(lv)
    best = min(c.predicted_iter_s for c in plan.candidates)
    assert plan.predicted_iter_s <= best * (1 + SHIM_TIE_TOLERANCE) + 1e-12
