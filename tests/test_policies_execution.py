"""Execution model (policies.execution): DDP buckets, the shim's pieces, gloo's sharing, and small iterations whose
numbers are checked by hand."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorlane.policies.execution import (
    HostCosts,
    Op,
    bucket_pieces,
    ddp_buckets,
    ddp_iteration,
    fit_alpha_beta,
    gloo_segment_bytes,
    layer_order_levels,
    op_done_times,
    shim_iteration,
    shim_ops,
)
from tensorlane.policies.model import CostModel, Layer, Profile, Schedule, make_blocks
from tensorlane.policies.simulator import network_done_times

# 2 ranks at 8000 bit/s: an all-reduce of 1000 bytes moves 2*(1/2)*8000 = 8000 bits = 1 s.
COST = CostModel(ranks=2, link_bps=8000.0)


def two_layers(b0: int, b1: int, bwd: tuple[float, float] = (2.0, 2.0)) -> Profile:
    return Profile("t", (Layer("l0", b0, 1.0, bwd[0]), Layer("l1", b1, 1.0, bwd[1])))


# ------------------------------------------------------------------------------------------------ buckets

def test_ddp_buckets_by_hand() -> None:
    """Gradient-ready order (last layer first); a bucket closes once it holds >= its cap."""
    assert ddp_buckets([4, 4, 4, 8], 8) == ((3,), (2, 1), (0,))
    assert ddp_buckets([4, 4, 4, 8], 100) == ((3, 2, 1, 0),)
    assert ddp_buckets([4, 4, 4, 8], 8, first_bucket_bytes=100) == ((3, 2, 1, 0),)
    assert ddp_buckets([4, 0, 4, 8], 4, first_bucket_bytes=16) == ((3, 2, 0),)  # empty layers are in no bucket
    with pytest.raises(ValueError):
        ddp_buckets([4], 0)


def test_ddp_buckets_match_torch() -> None:
    """The rebuilt buckets DDP logs for the emulated VGG-16 (2 ranks, gloo, checked once by hand with
    ``_get_ddp_logging_data()['rebuilt_per_bucket_param_indices']``), and torch's own assignment function."""
    from bench.models import layer_numels

    sizes = [4 * n for n in layer_numels("vgg16", 30)]
    assert ddp_buckets(sizes, int(0.2 * (1 << 20))) == (
        (15,), (14,), (13,), (12,), (11,), (10,), (9,), (8,), (7, 6), (5, 4, 3, 2, 1, 0))
    assert ddp_buckets(sizes, 25 << 20, first_bucket_bytes=1 << 20) == ((15, 14), tuple(range(13, -1, -1)))
    import torch  # the test extra installs it: a missing torch fails here, it does not skip
    import torch.distributed as dist

    for cap, first in ((int(0.2 * (1 << 20)), None), (1 << 20, None), (25 << 20, 1 << 20)):
        tensors = [torch.empty(s // 4) for s in reversed(sizes)]
        limits = [cap] if first is None else [first, cap]
        got, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        want = ddp_buckets(sizes, cap, first)
        assert [tuple(len(sizes) - 1 - i for i in b) for b in got] == list(want)


def test_bucket_pieces_by_hand() -> None:
    assert bucket_pieces([12, 12], [0, 1], None) == [(0, 12, 0), (12, 12, 1)]
    assert bucket_pieces([12, 12, 8], [1, 1, 0], None) == [(0, 24, 1), (24, 8, 0)]
    assert bucket_pieces([12, 12], [0, 0], 8) == [(0, 8, 0), (8, 8, 0), (16, 8, 0)]


@pytest.mark.torch
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=12),
       st.one_of(st.none(), st.integers(1, 50)))
def test_bucket_pieces_is_the_shims_rule(params, partition) -> None:
    """Equal to policies.cutting.pieces_of (what the shim runs) on elements of 4 bytes."""
    from tensorlane.policies.cutting import pieces_of

    numels = [n for n, _ in params]
    levels = [lv for _, lv in params]
    want = [(4 * o, 4 * n, lv) for o, n, lv in pieces_of(numels, levels, partition)]
    assert bucket_pieces([4 * n for n in numels], levels, None if partition is None else 4 * partition) == want


def test_layer_order_levels_is_the_shims_policy() -> None:
    p = Profile("t", tuple(Layer(f"l{i}", 4, 0.0, 0.0) for i in range(4)))
    assert layer_order_levels(p, 2) == (0, 0, 1, 1)
    assert layer_order_levels(p, 1) == (0, 0, 0, 0)


def test_gloo_segment_bytes() -> None:
    """2 ranks: at least 4 segments, at most 1 MiB each, a whole number of float32 elements."""
    assert gloo_segment_bytes(400_000, 2) == 100_000
    assert gloo_segment_bytes(8 << 20, 2) == 1 << 20
    assert gloo_segment_bytes(10, 2) == 4
    assert gloo_segment_bytes((9 << 20) + 4, 2) == 943_720  # 10 segments
    assert gloo_segment_bytes(0, 2) == 0


# ------------------------------------------------------------------------------------------ network sharing

def test_weights_none_is_equal_sharing() -> None:
    p = two_layers(1000, 3000)
    sched = Schedule("x", make_blocks(p, [(0, 1000), (1000, 4000)]), per_level_inflight=2)
    ready = [1.0, 1.0]
    assert network_done_times(sched, COST, ready) == network_done_times(sched, COST, ready, weights=[5.0, 5.0])
    assert network_done_times(sched, COST, ready, weights=[1.0, 3.0]) == pytest.approx((5.0, 5.0))


def _flat_ops() -> tuple[Op, ...]:
    # l1 (4000 B) issued at 1, l0 (1000 B) at 2, one group (level 0)
    return (Op(4000, 0, (1,), 0, 1.0), Op(1000, 0, (0,), 1, 2.0))


def test_sharing_by_hand() -> None:
    """l1 = 4000 B from t=1 (32000 bits), l0 = 1000 B from t=2 (8000 bits); at t=2 l1 has 24000 bits left.
    messages: gloo segments of 1000 B and 252 B (250 rounded up to whole float32 elements), shares 1000:252:
    l1 gets 8000 * 1000/1252 bit/s and ends at 2 + 24000 * 1252 / 8e6 = 5.756; l0 ends when all 40000 bits
    are through: 6.0. ps: 4000 bit/s each: l0 ends at 4, l1 has 16000 bits left: 6. fifo: l1 1..5, l0 5..6."""
    ops = _flat_ops()
    assert op_done_times(ops, COST) == pytest.approx((2 + 24000 * 1252 / 8e6, 6.0))
    assert op_done_times(ops, COST, sharing="ps") == pytest.approx((6.0, 4.0))
    assert op_done_times(ops, COST, sharing="fifo") == pytest.approx((5.0, 6.0))
    # one thread: the second waits in the group's queue whatever the sharing
    assert op_done_times(ops, COST, HostCosts(threads=1), sharing="ps") == pytest.approx((5.0, 6.0))
    with pytest.raises(ValueError):
        op_done_times(ops, COST, sharing="lottery")


# ----------------------------------------------------------------------------------------- iterations

def test_ddp_by_hand() -> None:
    """Layers of 1000 B, fwd 1 s, bwd 2 s: l1 ready at 2, l0 at 4 (backward ends at 4).
    Buckets of 1000 B: l1 2..3, l0 4..5; forward 5..6, 6..7: 7 s. One bucket of 2000 B: 4..6, iteration 8 s.
    With alpha 0.5 s: l0's bucket 4..5.5: 7.5 s; plus wake 0.1 s and launch 0.2 s: 7.8 s."""
    p = two_layers(1000, 1000)
    r = ddp_iteration(p, COST, bucket_bytes=1000)
    assert r.buckets == ((1,), (0,))
    assert r.done_s == pytest.approx((3.0, 5.0)) and r.iter_s == pytest.approx(7.0)
    assert r.backward_s == 4.0 and r.forward_s == 2.0 and r.exposed_comm_s == pytest.approx(1.0)
    assert ddp_iteration(p, COST, bucket_bytes=2000).iter_s == pytest.approx(8.0)
    slow = CostModel(2, 8000.0, alpha_s=0.5)
    assert ddp_iteration(p, slow, bucket_bytes=1000).iter_s == pytest.approx(7.5)
    assert ddp_iteration(p, slow, 1000, host=HostCosts(wake_s=0.1, launch_s=0.2)).iter_s == pytest.approx(7.8)


def test_ddp_waits_for_every_bucket() -> None:
    """l0 = 1000 B, l1 = 4000 B, bwd 1 s each (l1 ready at 1, l0 at 2); one bucket per layer, one group with two
    threads sharing by messages: l1 ends at 5.756, l0 at 6.0 (test_sharing_by_hand); forward 6..8."""
    p = two_layers(1000, 4000, bwd=(1.0, 1.0))
    r = ddp_iteration(p, COST, bucket_bytes=1000)
    assert r.done_s == pytest.approx((5.756, 6.0)) and r.iter_s == pytest.approx(8.0)


def test_shim_preemption_by_hand() -> None:
    """Same profile, the shim with l0 on level 0 and l1 on level 1, a bucket per layer: l1 runs from 1; l0 preempts
    at 2 and ends at 3; l1 resumes with 3 s left: 6. Forward: l0 3..4, l1 6..7: 7 s (DDP: 8 s).
    Flat (one level): l0 crawls beside l1 (6.0), forward 6..8: 8 s."""
    p = two_layers(1000, 4000, bwd=(1.0, 1.0))
    r = shim_iteration(p, COST, (0, 1), bucket_bytes=1000)
    assert r.done_s == pytest.approx((6.0, 3.0))  # ops in launch order: l1's, then l0's
    assert r.layer_fwd_start_s == pytest.approx((3.0, 6.0)) and r.iter_s == pytest.approx(7.0)
    assert shim_iteration(p, COST, (0, 0), bucket_bytes=1000).iter_s == pytest.approx(8.0)


def test_shim_pieces_of_one_bucket_by_hand() -> None:
    """Layers of 1000 B (fwd 1, bwd 2), one bucket (buffer order l1, l0), levels (0, 1): at t=4 the hook issues
    l0's piece (level 0) first, then l1's. l0 4..5 preempts l1, l1 5..6. Forward: l0 5..6, l1 6..7: 7 s.
    Waiting for the whole bucket (the shim before per-piece waits): l0 waits until 6: 8 s."""
    p = two_layers(1000, 1000)
    r = shim_iteration(p, COST, (0, 1), bucket_bytes=2000)
    assert [(op.layers, op.level, op.launch_s) for op in r.ops] == [((0,), 0, 4.0), ((1,), 1, 4.0)]
    assert r.done_s == pytest.approx((5.0, 6.0)) and r.iter_s == pytest.approx(7.0)
    assert shim_iteration(p, COST, (0, 1), bucket_bytes=2000, wait="bucket").iter_s == pytest.approx(8.0)
    # buffer order issues l1's piece first; with strict priority l0 still goes first on the wire
    assert [op.layers for op in shim_ops(p, r.buckets, (0, 1), order="buffer")] == [(1,), (0,)]


def test_shim_whole_buckets_by_hand() -> None:
    """The shim sends 16-bit buckets at 3+ ranks uncut (``shim.ddp.uncut``): the same profile as above, one bucket,
    levels (0, 1), ``whole``: one operation for both layers at level 0, 4..6; forward l0 6..7, l1 7..8: 8 s (cut
    into pieces: 7 s). A partition cuts nothing then."""
    p = two_layers(1000, 1000)
    r = shim_iteration(p, COST, (0, 1), bucket_bytes=2000, whole=True)
    assert [(op.nbytes, op.level, op.layers, op.launch_s) for op in r.ops] == [(2000, 0, (0, 1), 4.0)]
    assert r.done_s == pytest.approx((6.0,)) and r.iter_s == pytest.approx(8.0)
    assert shim_iteration(p, COST, (1, 1), bucket_bytes=2000, partition_bytes=500, whole=True).ops[0].level == 1
    assert len(shim_iteration(p, COST, (0, 1), bucket_bytes=2000, partition_bytes=500, whole=True).ops) == 1


def test_shim_partition_by_hand() -> None:
    """One layer of 2000 B (fwd 1, bwd 1) cut into 1000 B pieces on one group with two threads: both from 1,
    equal messages, so they share: both end at 3; forward 3..4. Without a partition: 1..3, same here."""
    p = Profile("t", (Layer("l", 2000, 1.0, 1.0),))
    r = shim_iteration(p, COST, (0,), bucket_bytes=4000, partition_bytes=1000)
    assert len(r.ops) == 2 and r.done_s == pytest.approx((3.0, 3.0)) and r.iter_s == pytest.approx(4.0)


def test_shim_host_costs_by_hand() -> None:
    """The hook copies the bucket (2000 B at 1000 B/s: 2 s) after a fixed 0.5 s, then issues each piece 0.25 s
    apart: bucket ready at 4, pieces issued at 6.75 (level 0) and 7.0 (level 1)."""
    p = two_layers(1000, 1000)
    host = HostCosts(launch_s=0.25, copy_bps=1000.0, hook_s=0.5, wake_s=0.0)
    ops = shim_ops(p, ddp_buckets([1000, 1000], 2000), (0, 1), host=host)
    assert [op.launch_s for op in ops] == pytest.approx([6.75, 7.0])
    # two buckets on one thread: the second hook starts when the first has finished
    ops = shim_ops(Profile("t", (Layer("a", 1000, 1.0, 0.1), Layer("b", 1000, 1.0, 0.1))),
                   ((1,), (0,)), (0, 0), host=host)
    assert [op.launch_s for op in ops] == pytest.approx([0.1 + 0.5 + 1.0 + 0.25, 1.85 + 0.5 + 1.0 + 0.25])


def test_callback_stall_by_hand() -> None:
    """Layers of 1000 B (fwd 1, bwd 2), a bucket each, levels (0, 1): l1's op is done at 3, while l0's backward
    runs (2..4), so with callback_s = 0.5 that backward takes 2.5: l0 ready at 4.5, its op 4.5..5.5 (it completes
    as l0's forward starts, which was waiting for it: no stall); forward 5.5..6.5, 6.5..7.5."""
    p = two_layers(1000, 1000)
    r = shim_iteration(p, COST, (0, 1), bucket_bytes=1000, host=HostCosts(callback_s=0.5))
    assert r.backward_s == pytest.approx(4.5) and r.iter_s == pytest.approx(7.5)
    assert ddp_iteration(p, COST, 1000, host=HostCosts(callback_s=0.5)).iter_s == pytest.approx(7.0)


def test_one_rank_sends_nothing() -> None:
    p = two_layers(1000, 1000)
    one = CostModel(1, 8000.0, alpha_s=0.5)
    assert ddp_iteration(p, one, 1000).iter_s == pytest.approx(6.0)
    assert shim_iteration(p, one, (0, 1), 1000).iter_s == pytest.approx(6.0)


def test_bad_arguments() -> None:
    p = two_layers(1000, 1000)
    with pytest.raises(ValueError):
        shim_iteration(p, COST, (0,), 1000)
    with pytest.raises(ValueError):
        shim_iteration(p, COST, (0, 1), 1000, wait="never")
    with pytest.raises(ValueError):
        HostCosts(threads=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50_000), st.floats(0.0, 2.0), st.floats(0.0, 2.0)), min_size=1,
                max_size=10), st.integers(1_000, 200_000), st.integers(1, 5))
def test_bounds(layers, bucket, levels) -> None:
    """Never faster than compute alone, nor than the wire time of all gradients."""
    p = Profile("h", tuple(Layer(f"l{i}", 4 * b, f, w) for i, (b, f, w) in enumerate(layers)))
    cost = CostModel(2, 1e6, alpha_s=1e-3)
    compute = p.fwd_total + p.bwd_total
    wire = cost.wire_bits(p.total_bytes) / cost.link_bps
    d = ddp_iteration(p, cost, bucket)
    s = shim_iteration(p, cost, layer_order_levels(p, levels), bucket)
    for r in (d, s):
        assert r.iter_s >= compute - 1e-9 and r.iter_s >= wire - 1e-9


def test_fit_alpha_beta() -> None:
    """Exact data: alpha 1 ms, 190 Mbit/s payload, 2 ranks (bits = 8 * bytes)."""
    def t(b):
        return 1e-3 + 8 * b / 190e6
    samples = [(4096, t(4096)), (4096, t(4096) + 1.0), (4096, t(4096)), (1 << 20, t(1 << 20)), (4 << 20, t(4 << 20))]
    alpha, rate = fit_alpha_beta(samples, 2)  # the outlier does not move the median
    assert alpha == pytest.approx(1e-3) and rate == pytest.approx(190e6)
    with pytest.raises(ValueError):
        fit_alpha_beta([(4096, 1e-3)], 2)
