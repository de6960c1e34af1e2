"""Tensor-side policies and level compression: hand-checked cases and properties."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorlane.policies.compress import compress_levels, contiguous_split
from tensorlane.policies.model import CostModel, Layer, Profile, Schedule, check_blocks, make_blocks, split_range
from tensorlane.policies.papers.asc_wfbp import asc_groups, asc_wfbp, concurrency_beats_fusion
from tensorlane.policies.papers.bytescheduler import bytescheduler
from tensorlane.policies.papers.mg_wfbp import fusion_dp, fusion_groups
from tensorlane.policies.papers.pace import consumer_order, dag_indices, pace
from tensorlane.policies.papers.poseidon_wfbp import wfbp
from tensorlane.policies.papers.us_byte import unequal_sizes, us_byte
from tensorlane.policies.simulator import simulate

COST = CostModel(ranks=2, link_bps=8000.0)  # 1000 B = 1 s on the wire


def chain(*sizes: int, fwd: float = 1.0, bwd: float = 1.0) -> Profile:
    return Profile("c", tuple(Layer(f"l{i}", s, fwd, bwd) for i, s in enumerate(sizes)))


# ------------------------------------------------------------------------------------------------ partition

def test_split_range_and_bytescheduler_by_hand() -> None:
    """Layers of 10 and 3 bytes, partition 4: l0 -> [0,4) [4,8) [8,10) at priority 0, l1 -> [10,13) at 1."""
    assert split_range(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    s = bytescheduler(chain(10, 3), partition_bytes=4, credit_bytes=8)
    assert [(b.start, b.end, b.priority) for b in s.blocks] == [(0, 4, 0), (4, 8, 0), (8, 10, 0), (10, 13, 1)]
    assert s.credit_bytes == 8 and all(b.level == 0 for b in s.blocks)
    two = bytescheduler(chain(10, 3), partition_bytes=4, credit_bytes=8, queues=2)
    assert [b.level for b in two.blocks] == [0, 0, 0, 1]


def test_wfbp_one_block_per_layer_skips_empty_layers() -> None:
    s = wfbp(chain(5, 0, 7))
    assert [(b.start, b.end, b.layers) for b in s.blocks] == [(0, 5, (0,)), (5, 12, (2,))]
    assert s.max_inflight == 1 and {b.priority for b in s.blocks} == {0}
    assert [b.ready_s for b in s.blocks] == [3.0, 1.0]


def test_unequal_sizes_by_hand() -> None:
    """Layers 100, 100, 200 B (offsets 0, 100, 200 of 400); first 10, slope 2: 10*(1 + 2*o/400) = 10, 15, 20."""
    assert unequal_sizes(chain(100, 100, 200), 10, 2.0) == (10, 15, 20)
    s = us_byte(chain(100, 100, 200), first_bytes=10, slope=2.0)
    assert [b.nbytes for b in s.blocks if b.layers == (2,)] == [20] * 10


def test_us_byte_with_zero_slope_is_bytescheduler() -> None:
    p = chain(1000, 3000, 7000)
    a, b = us_byte(p, first_bytes=700, slope=0.0, credit_bytes=1400), bytescheduler(p, 700, 1400)
    assert a.blocks == b.blocks and a.credit_bytes == b.credit_bytes


sizes_st = st.lists(st.integers(0, 50_000), min_size=1, max_size=8).filter(lambda s: sum(s) > 0)


@settings(max_examples=80, deadline=None)
@given(sizes_st, st.integers(500, 20_000), st.floats(0, 8), st.integers(1, 5))
def test_partitions_conserve_bytes(sizes, part, slope, queues) -> None:
    """Every partition tiles the gradient array exactly once; pieces never exceed the partition size and never
    span layers; levels stay within the queues and never invert the priorities."""
    p = chain(*sizes)
    for s in (bytescheduler(p, part, 2 * part, queues), us_byte(p, part, slope, None, queues),
              pace(p, partition_bytes=part, queues=queues)):
        check_blocks(p, s.blocks)
        assert sum(b.nbytes for b in s.blocks) == p.total_bytes
        assert all(len(b.layers) == 1 for b in s.blocks)
        assert all(0 <= b.level < queues for b in s.blocks)
        by_prio = sorted(s.blocks, key=lambda b: b.priority)
        assert all(x.level <= y.level for x, y in itertools.pairwise(by_prio))
    assert all(b.nbytes <= part for b in bytescheduler(p, part, part).blocks)


# ------------------------------------------------------------------------------------------------ fusion

def test_fusion_dp_by_hand() -> None:
    """Startup 1 s, 100 B tensors (0.1 s wire); backward order l2, l1, l0 ready at 0.1, 0.2, 0.3.
    WFBP: 0.1..1.2, 1.2..2.3, 2.3..3.4. One fused block: 0.3 + 1 + 0.3 = 1.6, the DP optimum
    (any split pays a second startup: >= 0.1 + 2 + 0.3)."""
    c = CostModel(2, 8000.0, 0.0, 1.0)
    p = chain(100, 100, 100, fwd=1.0, bwd=0.1)
    groups, f = fusion_groups([0.1, 0.2, 0.3], [100, 100, 100], c)
    assert groups == [(0, 2)] and f == pytest.approx(1.6)
    s = fusion_dp(p, c)
    assert [(b.start, b.end) for b in s.blocks] == [(0, 300)] and s.fusion_bytes == 300
    assert simulate(p, s, c).iter_s == pytest.approx(1.6 + 3.0)
    assert simulate(p, wfbp(p), c).iter_s == pytest.approx(3.4 + 3.0)


def test_fusion_dp_keeps_layers_apart_without_startup() -> None:
    """No startup cost: fusing only delays, so the DP keeps one block per layer (ties go to smaller groups)."""
    s = fusion_dp(chain(1000, 1000, 1000), COST)
    assert len(s.blocks) == 3


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.floats(0.01, 1)), min_size=1, max_size=6), st.floats(0, 2))
def test_fusion_dp_is_optimal_and_never_adds_blocks(spec, alpha) -> None:
    """Against brute force over all 2^(n-1) contiguous groupings on one stream: the DP's simulated iteration is
    the minimum and equals its own prediction f[n] + forward; it never has more blocks than layers. (Backward
    times are positive: with ties in ready time the stream's order is not the backward order the DP assumes.)"""
    c = CostModel(2, 8000.0, 0.0, alpha)
    p = Profile("f", tuple(Layer(f"l{i}", b, 0.5, w) for i, (b, w) in enumerate(spec)))
    s = fusion_dp(p, c)
    got = simulate(p, s, c).iter_s
    assert len(s.blocks) <= len(p.layers)
    offs = p.offsets()
    n = len(spec)
    best = float("inf")
    for cuts in itertools.product([0, 1], repeat=n - 1):
        bounds = [0] + [i + 1 for i in range(n - 1) if cuts[i]] + [n]
        ranges = [(offs[a], offs[b]) for a, b in itertools.pairwise(bounds)]
        best = min(best, simulate(p, Schedule("x", make_blocks(p, ranges), max_inflight=1), c).iter_s)
    assert got == pytest.approx(best, abs=1e-9)
    ready = sorted(b.ready_s for b in wfbp(p).blocks)
    _, f = fusion_groups(ready, [ly.params_bytes for ly in reversed(p.layers)], c)
    assert got == pytest.approx(f + p.fwd_total, abs=1e-9)


def test_asc_groups_by_hand() -> None:
    """Three 1000 B tensors ready at 0 (1 s each). One slot: the first goes alone, the other two wait and are
    fused. Two slots: the first two go alone, the third waits (alone)."""
    assert asc_groups([0.0, 0.0, 0.0], [1000] * 3, COST, 1) == [(0, 0), (1, 2)]
    assert asc_groups([0.0, 0.0, 0.0], [1000] * 3, COST, 2) == [(0, 0), (1, 1), (2, 2)]
    assert asc_groups([0.0, 2.0, 4.0], [1000] * 3, COST, 1) == [(0, 0), (1, 1), (2, 2)]


def test_concurrency_rule() -> None:
    c = CostModel(2, 8000.0, 0.0, 0.5)
    assert concurrency_beats_fusion(1000, 1000, 0.25, c, slot_free=True)
    assert not concurrency_beats_fusion(1000, 1000, 0.25, c, slot_free=False)


@settings(max_examples=60, deadline=None)
@given(sizes_st, st.floats(0, 1), st.integers(1, 8))
def test_fusion_never_produces_more_blocks_than_layers(sizes, alpha, slots) -> None:
    p = chain(*sizes, bwd=0.01)
    c = CostModel(4, 8000.0, 0.0, alpha)
    nonempty = sum(1 for s in sizes if s)
    for s in (fusion_dp(p, c), asc_wfbp(p, c, slots), pace(p, fusion_bytes=10_000, queues=3)):
        check_blocks(p, s.blocks)
        assert len(s.blocks) <= nonempty


# ------------------------------------------------------------------------------------------------ DAG order

def test_consumer_order_chain_and_dag() -> None:
    """Chain: layer order. DAG a->b->c, a->d (fwd 1 s): earliest starts a 0, b 1, c 2, d 1 -> ranks 0, 1, 3, 2."""
    p = chain(4, 4, 4, 4)
    assert consumer_order(p) == (0, 1, 2, 3)
    assert consumer_order(p, {"l1": ["l0"], "l2": ["l1"], "l3": ["l0"]}) == (0, 1, 3, 2)
    assert consumer_order(p, {1: [0], 2: [1], 3: [0]}) == (0, 1, 3, 2)
    with pytest.raises(ValueError):
        dag_indices(p, {"l0": ["l1"]})
    s = pace(p, dag={"l1": ["l0"], "l2": ["l1"], "l3": ["l0"]}, queues=5)
    assert [b.priority for b in s.blocks] == [0, 1, 3, 2] and s.per_level_inflight == 1


def test_pace_fuses_only_priority_neighbours() -> None:
    """Fusion threshold 8 B over 4 B layers: pairs (l0, l1) and (l2, l3) in a chain; in the DAG above l2 and l3
    are not neighbours in priority (ranks 3 and 2), so only (l0, l1) fuse."""
    p = chain(4, 4, 4, 4)
    assert [(b.start, b.end) for b in pace(p, fusion_bytes=8).blocks] == [(0, 8), (8, 16)]
    dag = {"l1": ["l0"], "l2": ["l1"], "l3": ["l0"]}
    assert [(b.start, b.end) for b in pace(p, dag=dag, fusion_bytes=8).blocks] == [(0, 8), (8, 12), (12, 16)]


def test_pace_fuses_across_a_layer_without_parameters() -> None:
    """A layer without gradients (a ReLU in the profile) between two 4 B layers keeps nothing apart: they are
    neighbours in priority among the tensors that are sent, and fuse under an 8 B threshold as without it."""
    assert [(b.start, b.end) for b in pace(chain(4, 0, 4), fusion_bytes=8).blocks] == [(0, 8)]
    assert [(b.start, b.end) for b in pace(chain(4, 0, 4), fusion_bytes=4).blocks] == [(0, 4), (4, 8)]


# ------------------------------------------------------------------------------------------------ compression

def test_compress_levels_by_hand() -> None:
    assert compress_levels([0, 1, 2, 3], queues=2, reserved=0) == (0, 0, 1, 1)
    assert contiguous_split([1, 1, 1, 5], 2) == (0, 0, 0, 1)
    # 8 switch queues, 3 reserved (best effort, CS6, CS7): 5 levels; 3 priorities use 3 of them
    assert compress_levels([7, 3, 3, 9]) == (1, 0, 0, 2)
    # bytes: one huge low-urgency tensor gets its own level, the small urgent ones share
    assert compress_levels([0, 1, 2, 3], queues=2, reserved=0, weights=[1, 1, 1, 100]) == (0, 0, 0, 1)
    with pytest.raises(ValueError):
        compress_levels([0], queues=3, reserved=3)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=25), st.integers(1, 8), st.integers(0, 3),
       st.data())
def test_compress_levels_preserves_order(prios, queues, reserved, data) -> None:
    usable = queues - reserved
    if usable < 1:
        return
    weights = data.draw(st.lists(st.integers(0, 100), min_size=len(prios), max_size=len(prios)))
    for w in (None, weights):
        lv = compress_levels(prios, queues, reserved, w)
        for i, j in itertools.combinations(range(len(prios)), 2):
            if prios[i] < prios[j]:
                assert lv[i] <= lv[j]
            if prios[i] > prios[j]:
                assert lv[i] >= lv[j]
            if prios[i] == prios[j]:
                assert lv[i] == lv[j]
        used = sorted(set(lv))
        assert used == list(range(min(usable, len(set(prios)))))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 5))
def test_contiguous_split_is_min_max(weights, k) -> None:
    """The split's heaviest group equals the brute-force optimum over all contiguous splits."""
    g = contiguous_split(weights, k)
    got = max(sum(w for w, x in zip(weights, g, strict=True) if x == lv) for lv in set(g))
    n = len(weights)
    best = min(max(sum(weights[a:b]) for a, b in zip((0,) + cuts, cuts + (n,), strict=True))
               for m in range(min(k, n)) for cuts in itertools.combinations(range(1, n), m))
    assert got == best and len(set(g)) == min(k, n)


def test_pace_on_resnet_ranks_downsample_with_block_input() -> None:
    """ResNet-50's DAG: layer2.0.downsample consumes the block input, as layer2.0.conv1 does, so it ranks right
    after that conv1 and before conv2/conv3 (forward order puts it after conv3)."""
    from tensorlane.policies.model import load_profile

    p = load_profile("resnet50")
    rank = consumer_order(p)
    names = [ly.name for ly in p.layers]
    r = {n: rank[names.index(f"layer2.0.{n}")] for n in ("conv1", "conv2", "conv3", "downsample")}
    assert r["conv1"] < r["downsample"] < r["conv2"] < r["conv3"]
    assert consumer_order(load_profile("vgg16")) == tuple(range(16))
