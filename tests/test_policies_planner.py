"""Planner: choice, the policy ordering on a communication-bound profile, the table, and 1,024-rank speed."""
from __future__ import annotations

import time

import pytest

from tensorlane.policies.levels import dscp_table
from tensorlane.policies.model import CostModel, balance_scale, load_profile, scaled
from tensorlane.policies.papers.compare import POLICIES, compare, plan, table
from tensorlane.policies.simulator import simulate


def test_plan_is_the_best_of_compare() -> None:
    prof = load_profile("resnet50")
    plans = compare(prof, ranks=8, link_bps=10e9, latency_s=5e-6)
    assert [p.policy for p in plans] == list(POLICIES)
    best = plan(prof, ranks=8, link_bps=10e9, latency_s=5e-6)
    assert best.predicted_iter_s == min(p.predicted_iter_s for p in plans)
    assert 1 <= best.levels <= 5 and len(dscp_table(best.levels)) == best.levels
    compute = prof.fwd_total + prof.bwd_total
    assert all(p.predicted_iter_s >= compute - 1e-12 for p in plans)
    # the plan's prediction is reproducible from its schedule
    cost = CostModel(8, 10e9, 5e-6, 20e-6)
    assert simulate(prof, best.schedule, cost).iter_s == best.predicted_iter_s
    assert len(best.layer_levels(len(prof.layers))) == len(prof.layers)


def test_one_rank_needs_no_communication() -> None:
    prof = load_profile("vgg16")
    p = plan(prof, ranks=1, link_bps=1e9)
    assert p.predicted_iter_s == pytest.approx(prof.fwd_total + prof.bwd_total)


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "bert_base"])
def test_comm_bound_ordering_usbyte_bytescheduler_wfbp(name: str) -> None:
    """Communication twice the compute, 8 ranks at 1 Gbit/s: US-Byte <= ByteScheduler <= WFBP.

    US-Byte's grid contains ByteScheduler's configurations (slope 0), so the first inequality holds by
    construction; the second is the simulator's prediction (layer-order priority lets the next forward start
    on the input layers while the rest is still on the wire; WFBP sends layer 0 last)."""
    cost = CostModel(8, 1e9, 5e-6, 20e-6)
    prof = load_profile(name)
    prof = scaled(prof, balance_scale(prof, cost, 2.0))
    t = {p.policy: p.predicted_iter_s for p in compare(prof, 8, 1e9, 5e-6, candidates=("wfbp", "bytescheduler",
                                                                                        "us_byte"))}
    assert t["us_byte"] <= t["bytescheduler"] < t["wfbp"]


def test_bert_1024_ranks_under_a_minute() -> None:
    t0 = time.perf_counter()
    p = plan("bert_base", ranks=1024, link_bps=100e9, latency_s=5e-6)
    assert time.perf_counter() - t0 < 60.0
    assert p.predicted_iter_s > load_profile("bert_base").fwd_total


def test_table_renders() -> None:
    out = table(profiles=("resnet50",), candidates=("wfbp", "bytescheduler"))
    lines = out.splitlines()
    assert lines[0] == "| policy | resnet50 |" and lines[2].startswith("| wfbp | ") and "(1.00x)" in lines[2]
    assert lines[-1].startswith("| compute + comm, no overlap |")


def test_docs_table_is_current() -> None:
    """docs/policies.md carries the output of table(); regenerate it there when the model changes."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    assert table() in doc


def test_policies_stay_pure() -> None:
    """No torch and no file or network I/O in policies/ and its subpackages (load_profile's importlib.resources read
    excepted). Until 2026-11-28 only the top folder was read: policies/papers/ went unchecked."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "policies"
    files = sorted(root.rglob("*.py"))
    assert root / "papers" / "compare.py" in files
    for f in files:
        src = f.read_text()
        assert "import torch" not in src and "open(" not in src and "socket" not in src, f.name
        if f.name != "model.py":
            assert "resources" not in src and "read_text" not in src, f.name


# ------------------------------------------------------------------------------------------------ plan_shim

def _emulated(name: str):
    """The profile of bench.models' emulated model at 200 Mbit/s, 2 ranks (what bench.validate plans for)."""
    from dataclasses import replace

    from bench.models import DEFAULT_SCALES, layer_numels
    from tensorlane.policies.model import Profile

    ps, cs = DEFAULT_SCALES[name]
    p = load_profile(name)
    layers = tuple(replace(ly, params_bytes=4 * n) for ly, n in zip(p.layers, layer_numels(p, ps), strict=True))
    return scaled(Profile(name, layers), cs), ps


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "bert_base"])
def test_plan_shim_is_the_min_of_its_candidates_fast_and_deterministic(name: str) -> None:
    from tensorlane.policies.execution import shim_iteration
    from tensorlane.policies.planner import (
        DEFAULT_SHIM_ALPHA_S,
        DEFAULT_SHIM_HOST,
        plan_shim,
        shim_levels,
    )

    prof, ps = _emulated(name)
    buckets = tuple(int(mb / ps * (1 << 20)) for mb in (25, 5, 1))
    parts = (None, int((4 << 20) / ps), int((1 << 20) / ps))
    t0 = time.perf_counter()
    p = plan_shim(prof, ranks=2, link_bps=200e6, bucket_bytes=buckets, partitions=parts)
    assert time.perf_counter() - t0 < 2.0  # ~0.2 s unloaded
    assert p == plan_shim(prof, ranks=2, link_bps=200e6, bucket_bytes=buckets, partitions=parts)
    best = min(c.predicted_iter_s for c in p.candidates)
    assert best <= p.predicted_iter_s <= best * 1.01  # a tie within 1%: the fewest operations win
    near = [c for c in p.candidates if c.predicted_iter_s <= best * 1.01]
    chosen = next(c for c in p.candidates if c.label == p.label)
    assert chosen.ops == min(c.ops for c in near) and chosen.ops > 0
    exact = plan_shim(prof, ranks=2, link_bps=200e6, bucket_bytes=buckets, partitions=parts, tie_tolerance=0.0)
    assert exact.predicted_iter_s == best
    assert len(p.candidates) == 5 * len(parts) * len(buckets)  # flat + layer order on 2..5 levels
    assert len(p.layer_levels) == len(prof.layers) and p.levels == 1 + max(p.layer_levels) and 1 <= p.levels <= 5
    assert p.layer_levels == shim_levels(prof, p.policy, p.levels)
    assert p.bucket_bytes in buckets and p.partition_bytes in parts
    # the prediction is reproducible from the execution model
    cost = CostModel(2, 200e6 * 1448 / 1514, 0.0, DEFAULT_SHIM_ALPHA_S)
    r = shim_iteration(prof, cost, p.layer_levels, p.bucket_bytes, p.partition_bytes, host=DEFAULT_SHIM_HOST)
    assert r.iter_s == p.predicted_iter_s and len(r.ops) == chosen.ops
    # priority levels beat one level when communication is as large as compute
    flat = min(c.predicted_iter_s for c in p.candidates if c.policy == "flat")
    assert p.policy == "layer_order" and p.predicted_iter_s < flat
    assert p.label.startswith("layer_order L")


def test_plan_shim_one_bucket_size_and_limits() -> None:
    from tensorlane.policies.planner import plan_shim

    prof, _ = _emulated("resnet50")
    p = plan_shim(prof, ranks=2, link_bps=200e6, levels_max=2, bucket_bytes=1 << 20, partitions=(None,))
    assert [(c.policy, c.levels) for c in p.candidates] == [("flat", 1), ("layer_order", 2)]
    assert all(c.bucket_bytes == 1 << 20 for c in p.candidates) and p.levels <= 2
    one = plan_shim(prof, ranks=2, link_bps=200e6, levels_max=1, bucket_bytes=1 << 20)
    assert one.levels == 1 and set(one.layer_levels) == {0}
    with pytest.raises(ValueError):
        plan_shim(prof, ranks=2, link_bps=200e6, levels_max=6)
    with pytest.raises(ValueError):
        plan_shim(prof, ranks=2, link_bps=200e6, payload_fraction=0.0)


def test_plan_shim_whole_buckets_plans_levels_only() -> None:
    """16-bit buckets at 3+ ranks go uncut: ``whole`` plans only their levels, each candidate one operation a
    bucket, and predicts that execution (until 2026-11-28 such a model was planned as if cut into pieces)."""
    from tensorlane.policies.execution import TCP_PAYLOAD_FRACTION, ddp_buckets, shim_iteration
    from tensorlane.policies.planner import DEFAULT_SHIM_ALPHA_S, DEFAULT_SHIM_HOST, plan_shim

    prof, _ = _emulated("vgg16")
    cut = plan_shim(prof, ranks=3, link_bps=200e6, bucket_bytes=25 << 20)
    whole = plan_shim(prof, ranks=3, link_bps=200e6, bucket_bytes=25 << 20, whole=True)
    buckets = len(ddp_buckets([ly.params_bytes for ly in prof.layers], 25 << 20))
    assert {c.partition_bytes for c in whole.candidates} == {None} and whole.partition_bytes is None
    assert {c.ops for c in whole.candidates} == {buckets} and any(c.ops > buckets for c in cut.candidates)
    cost = CostModel(3, 200e6 * TCP_PAYLOAD_FRACTION, 0.0, DEFAULT_SHIM_ALPHA_S)
    r = shim_iteration(prof, cost, whole.layer_levels, 25 << 20, None, host=DEFAULT_SHIM_HOST, whole=True)
    assert r.iter_s == whole.predicted_iter_s
    # DDP's default 25 MiB buckets hold layers of several levels: sent whole, 1.78 s predicted, not 1.53 s, and the
    # levels no longer pay (flat; cut: layer order on 3 levels)
    assert whole.predicted_iter_s > 1.1 * cut.predicted_iter_s and (whole.policy, cut.policy) == ("flat", "layer_order")


def test_plan_shim_full_size_profiles() -> None:
    """The shim calls it with the real model's sizes: the shipped profiles at 10 Gbit/s, 8 ranks, one bucket."""
    from tensorlane.policies.planner import plan_shim

    for name in ("resnet50", "bert_base"):
        t0 = time.perf_counter()
        p = plan_shim(name, ranks=8, link_bps=10e9, bucket_bytes=25 << 20)
        assert time.perf_counter() - t0 < 5.0
        assert p.predicted_iter_s >= load_profile(name).fwd_total + load_profile(name).bwd_total


def test_choose_candidate_ties_go_to_fewer_operations() -> None:
    from tensorlane.policies.planner import ShimCandidate, choose_candidate

    c = [ShimCandidate("layer_order", 4, 1024, 4096, 1.000, 90), ShimCandidate("layer_order", 4, None, 4096, 1.005, 12),
         ShimCandidate("flat", 1, None, 4096, 1.02, 10), ShimCandidate("layer_order", 2, None, 4096, 1.005, 12)]
    assert choose_candidate(c, 0.01) == 1          # within 1%: fewest ops, then fastest, then grid order
    assert choose_candidate(c, 0.0) == 0
    assert choose_candidate(c, 0.05) == 2
    with pytest.raises(ValueError):
        choose_candidate([], 0.01)
