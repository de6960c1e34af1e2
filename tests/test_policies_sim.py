"""Simulator and cost model: hand-checked small cases, and properties."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorlane.policies.model import CostModel, Layer, Profile, Schedule, grad_ready_times, make_blocks
from tensorlane.policies.papers.asc_wfbp import concurrent_finish_s, fused_finish_s, sequential_finish_s
from tensorlane.policies.papers.bytescheduler import bytescheduler
from tensorlane.policies.papers.pace import pace
from tensorlane.policies.papers.poseidon_wfbp import wfbp
from tensorlane.policies.simulator import forward_starts, simulate

# 2 ranks at 8000 bit/s: an all-reduce of 1000 bytes moves 2*(1/2)*8000 = 8000 bits = 1 s.
COST = CostModel(ranks=2, link_bps=8000.0)


def two_layers(b0: int, b1: int, bwd: tuple[float, float] = (2.0, 2.0)) -> Profile:
    return Profile("t", (Layer("l0", b0, 1.0, bwd[0]), Layer("l1", b1, 1.0, bwd[1])))


def test_cost_model_by_hand() -> None:
    """n=4, 1 Gbit/s, latency 10 us, alpha 20 us: startup = 20 + 2*3*10 = 80 us;
    1 MB: 2*3/4 * 8e6 bits / 1e9 = 12 ms; total 12.08 ms. One rank sends nothing."""
    c = CostModel(4, 1e9, 1e-5, 2e-5)
    assert c.startup_s() == pytest.approx(8e-5)
    assert c.allreduce_s(10**6) == pytest.approx(0.01208)
    assert CostModel(1, 1e9, 1e-5, 2e-5).allreduce_s(10**6) == 0.0
    assert COST.allreduce_s(1000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        CostModel(0, 1e9)


def test_grad_ready_times() -> None:
    p = Profile("t", (Layer("a", 1, 0, 1.0), Layer("b", 1, 0, 2.0), Layer("c", 1, 0, 3.0)))
    assert grad_ready_times(p) == (6.0, 5.0, 3.0)


def test_wfbp_by_hand() -> None:
    """Layers of 1000 B, fwd 1 s, bwd 2 s. Backward: l1 ready at 2, l0 at 4 (B = 4).
    WFBP: l1 sent 2..3, l0 sent 4..5. Forward: l0 5..6, l1 6..7. Iteration = 7 s."""
    p = two_layers(1000, 1000)
    r = simulate(p, wfbp(p), COST)
    assert r.block_done_s == pytest.approx((5.0, 3.0))
    assert r.layer_fwd_start_s == pytest.approx((5.0, 6.0))
    assert r.iter_s == pytest.approx(7.0) and r.backward_s == 4.0 and r.exposed_comm_s == pytest.approx(1.0)


def test_preemption_by_hand() -> None:
    """l0 = 1000 B (1 s on the wire), l1 = 4000 B (4 s); bwd 1 s each: l1 ready at 1, l0 at 2 (B = 2).
    WFBP (FIFO): l1 1..5, l0 5..6; forward l0 6..7, l1 7..8: 8 s.
    Network priority (PACE, 2 levels): l1 from 1; l0 preempts at 2, done 3; l1 resumes with 3 s left, done 6;
    forward l0 3..4, l1 6..7: 7 s. ByteScheduler, 1000 B partitions, credit 1000 B: l1 piece 1..2,
    l0 jumps the queue 2..3, the rest of l1 3..6: also 7 s."""
    p = two_layers(1000, 4000, bwd=(1.0, 1.0))
    assert simulate(p, wfbp(p), COST).iter_s == pytest.approx(8.0)
    pr = simulate(p, pace(p, queues=2), COST)
    assert pr.block_done_s == pytest.approx((3.0, 6.0)) and pr.iter_s == pytest.approx(7.0)
    bs = simulate(p, bytescheduler(p, partition_bytes=1000, credit_bytes=1000), COST)
    assert bs.block_done_s == pytest.approx((3.0, 2.0, 4.0, 5.0, 6.0)) and bs.iter_s == pytest.approx(7.0)


def test_processor_sharing_and_fifo_by_hand() -> None:
    """One layer of 4000 B (bwd 1, fwd 1) cut into 1000 B and 3000 B, both launched at 1.
    PS: each gets 4000 bit/s; the small one (8000 bits) ends at 3, the big one has 16000 bits left at full
    rate: ends at 5. FIFO: small 1..2, big 2..5. Either way the forward runs 5..6."""
    p = Profile("t", (Layer("l", 4000, 1.0, 1.0),))
    s = Schedule("x", make_blocks(p, [(0, 1000), (1000, 4000)]))
    ps, fifo = simulate(p, s, COST, sharing="ps"), simulate(p, s, COST, sharing="fifo")
    assert ps.block_done_s == pytest.approx((3.0, 5.0)) and fifo.block_done_s == pytest.approx((2.0, 5.0))
    assert ps.iter_s == fifo.iter_s == pytest.approx(6.0)


def test_simultaneous_startups_match_formula() -> None:
    """Startup 0.5 s; a = b = 1000 B (1 s wire); a ready at 1.0 (l1), b at 1.25 (l0): gap 0.25.
    Concurrent: a sends alone 1.5..1.75, then both share: a ends 3.25, b 3.5 = 1 + max(0.5+2, 0.25+0.5+1).
    Fused: 0.25 + 0.5 + 2 = 2.75 after a; sequential: max(1.5, 0.25) + 1.5 = 3.0."""
    c = CostModel(2, 8000.0, 0.0, 0.5)
    p = Profile("t", (Layer("l0", 1000, 1.0, 0.25), Layer("l1", 1000, 1.0, 1.0)))
    s = Schedule("x", make_blocks(p, [(0, 1000), (1000, 2000)]), max_inflight=2)
    r = simulate(p, s, c)
    assert r.block_done_s == pytest.approx((3.5, 3.25))
    assert concurrent_finish_s(1000, 1000, 0.25, c) == pytest.approx(2.5)
    assert fused_finish_s(1000, 1000, 0.25, c) == pytest.approx(2.75)
    assert sequential_finish_s(1000, 1000, 0.25, c) == pytest.approx(3.0)
    seq = simulate(p, Schedule("x", s.blocks, max_inflight=1), c)
    assert max(seq.block_done_s) == pytest.approx(1.0 + 3.0)


def test_dag_forward_list_scheduling() -> None:
    """a -> b -> c and a -> d (side branch), fwd 1 s each, starting at 0. d's gradient is ready at 0, b's at 3:
    the stream runs a 0..1, d 1..2 (b not ready), idles, b 3..4, c 4..5. A chain would run d last at 4."""
    p = Profile("t", tuple(Layer(n, 1, 1.0, 0.0) for n in "abcd"))
    dag = ((), (0,), (1,), (0,))
    assert forward_starts(p, [0.0, 3.0, 0.0, 0.0], 0.0, dag) == (0.0, 3.0, 4.0, 1.0)
    assert forward_starts(p, [0.0, 3.0, 0.0, 0.0], 0.0, None) == (0.0, 3.0, 4.0, 5.0)


def test_credit_window_always_lets_one_block_start() -> None:
    """Credit 1 byte, blocks of 5000 B (5 s): one at a time. l1 ready 2, sent 2..7; l0 ready 4, sent 7..12;
    forward 12..14."""
    p = two_layers(5000, 5000)
    r = simulate(p, bytescheduler(p, partition_bytes=5000, credit_bytes=1), COST)
    assert r.block_done_s == pytest.approx((12.0, 7.0)) and r.iter_s == pytest.approx(14.0)


layers_st = st.lists(st.tuples(st.integers(0, 5000), st.floats(0, 2), st.floats(0, 2)), min_size=1, max_size=6)


def _profile(spec: list[tuple[int, float, float]]) -> Profile:
    layers = tuple(Layer(f"l{i}", b, f, w) for i, (b, f, w) in enumerate(spec))
    if sum(ly.params_bytes for ly in layers) == 0:
        layers = (Layer("x", 1, 0.0, 0.0),) + layers
    return Profile("h", layers)


@settings(max_examples=60, deadline=None)
@given(layers_st, st.integers(1, 4), st.floats(0, 0.3), st.sampled_from(["ps", "fifo"]),
       st.sampled_from([1, 2, 1000, 4000]))
def test_simulator_bounds(spec, ranks, alpha, sharing, part) -> None:
    """Iteration >= backward + forward; every block takes at least its uncontended all-reduce time; with one
    rank nothing is sent and the iteration is exactly backward + forward."""
    p = _profile(spec)
    cost = CostModel(ranks, 8000.0, 0.0, alpha)
    for sched in (wfbp(p), bytescheduler(p, partition_bytes=part, credit_bytes=2 * part, queues=2),
                  pace(p, queues=3)):
        r = simulate(p, sched, cost, sharing=sharing)
        assert r.iter_s >= r.backward_s + r.forward_s - 1e-9
        for b, t in zip(sched.blocks, r.block_done_s, strict=True):
            assert t >= b.ready_s + cost.allreduce_s(b.nbytes) - 1e-9
        wire = cost.wire_bits(p.total_bytes) / cost.link_bps
        assert r.comm_end_s >= min(b.ready_s for b in sched.blocks) + wire - 1e-9
        if ranks == 1:
            assert r.iter_s == pytest.approx(r.backward_s + r.forward_s)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.floats(0, 2)), min_size=1, max_size=5))
def test_phase2_order_is_optimal(spec) -> None:
    """US-Byte phase 2: with every gradient ready at once, sending blocks in forward-layer order minimises the
    iteration among all orders (brute force over permutations, one block per layer, one stream)."""
    from tensorlane.policies.papers.us_byte import phase2_order

    p = Profile("p2", tuple(Layer(f"l{i}", b, f, 0.0) for i, (b, f) in enumerate(spec)))
    blocks = make_blocks(p, [(p.offsets()[i], p.offsets()[i + 1]) for i in range(len(spec))])
    best = min(simulate(p, Schedule("x", make_blocks(p, [(b.start, b.end) for b in blocks], list(perm)),
                                    max_inflight=1), COST).iter_s
               for perm in itertools.permutations(range(len(blocks))))
    order = phase2_order(blocks)
    prios = [order.index(b) for b in blocks]
    got = simulate(p, Schedule("x", make_blocks(p, [(b.start, b.end) for b in blocks], prios), max_inflight=1),
                   COST).iter_s
    assert got <= best + 1e-9


def test_many_blocks_is_fast() -> None:
    """O(E log E): 40,000 blocks simulate well within a second or two."""
    import time

    p = Profile("big", tuple(Layer(f"l{i}", 4_000_000, 1e-3, 2e-3) for i in range(100)))
    s = bytescheduler(p, partition_bytes=10_000, credit_bytes=40_000, queues=5)
    assert len(s.blocks) == 40_000
    t = time.perf_counter()
    simulate(p, s, CostModel(1024, 100e9, 5e-6, 2e-5))
    assert time.perf_counter() - t < 5.0
