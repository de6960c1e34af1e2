"""bench.priority: the dependency-aware lower bound (by hand, and against every schedule the simulator knows), and a
quick smoke run on the namespace testbed (DDP, application order, shim with overlap, agents on every host) that
checks that every figure is there and positive; no timing assertions (the 2-core machine is noisy: docs/priority.md
has the figures of a full run)."""
from __future__ import annotations

import math
import os
import random
import shutil

import pytest

from bench.models import dependency_bound, lower_bound_dep_s, lower_bound_s
from bench.priority import format_table, passes
from tensorlane.policies.model import Layer, Profile


def _chain(layers) -> Profile:
    """A chain profile from ``(bytes, fwd_s, bwd_s)`` per layer (forward order)."""
    return Profile("toy", tuple(Layer(f"l{i}", b, f, w) for i, (b, f, w) in enumerate(layers)))


def test_dependency_bound_by_hand():
    # 2 ranks at 8 Mbit/s: each gradient byte costs 2(n-1)/n * 8 / 8e6 = 1 us on the wire
    p = _chain([(1_000_000, 0.1, 0.2), (200_000, 0.1, 0.2), (3_000_000, 0.1, 0.2)])
    b = dependency_bound(p, 2, 8e6)
    # k=0: 0.9 + 1.0; k=1: 0.6 + 1.2; k=2: 0.3 + 4.2 (the last layer's compute + all communication)
    assert b["lower_bound_dep_s"] == pytest.approx(4.5) and b["layer"] == 2 and b["first_layer_s"] == pytest.approx(1.9)
    assert b["plain_s"] == pytest.approx(4.2) == lower_bound_s(p, 2, 8e6)
    heavy = _chain([(3_000_000, 0.5, 1.0), (200_000, 0.5, 1.0), (1_000_000, 0.5, 1.0)])
    b = dependency_bound(heavy, 2, 8e6)   # k=0: 4.5 + 3.0 (compute + the first layer's all-reduce) dominates
    assert b["lower_bound_dep_s"] == pytest.approx(7.5) and b["layer"] == 0 and lower_bound_s(heavy, 2, 8e6) == 4.5
    assert lower_bound_dep_s(heavy, 2, "8mbit") == pytest.approx(7.5)
    assert dependency_bound(heavy, 1, 8e6)["lower_bound_dep_s"] == pytest.approx(4.5)   # one rank: no communication
    # BERT-base as bench.priority scales it: the embeddings' all-reduce after all compute, then layer 1's
    b = dependency_bound("bert_base", 2, 200e6, 23, 3.55)
    assert 0.93 < b["lower_bound_dep_s"] < 0.95 and b["layer"] == 1 and 0.92 < b["first_layer_s"] < 0.93


def test_dependency_bound_below_every_simulated_schedule():
    """No schedule the simulator knows (priorities, partition, fusion, preemption; no startup latency) beats the
    bound, on random chains; on ResNet-50 (bench.priority's scales) the best one meets it within 0.1%."""
    from bench.models import layer_numels
    from tensorlane.policies.model import load_profile
    from tensorlane.policies.papers.compare import compare

    rng = random.Random(12)
    for _ in range(25):
        n = rng.randint(2, 7)
        p = _chain([(4 * rng.randint(1, 400_000), rng.uniform(0.001, 0.2), rng.uniform(0.001, 0.4))
                    for _ in range(n)])
        rate = rng.choice([1e7, 1e8, 1e9])
        best = min(pl.predicted_iter_s for pl in compare(p, 2, rate, latency_s=0.0, alpha_s=0.0))
        bound = dependency_bound(p, 2, rate)["lower_bound_dep_s"]
        assert bound <= best * (1 + 1e-9), (p, rate, bound, best)
        assert bound >= lower_bound_s(p, 2, rate)
    ps, cs = 5.0, 10.416   # ResNet-50 as bench.priority scales it
    prof = load_profile("resnet50")
    scaled = Profile("resnet50", tuple(Layer(layer.name, 4 * n, layer.fwd_s * cs, layer.bwd_s * cs)
                                       for layer, n in zip(prof.layers, layer_numels(prof, ps), strict=True)))
    best = min(pl.predicted_iter_s for pl in compare(scaled, 2, 200e6, latency_s=0.0, alpha_s=0.0))
    assert best == pytest.approx(dependency_bound("resnet50", 2, 200e6, ps, cs)["lower_bound_dep_s"], rel=1e-3)


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_priority_quick_smoke():
    assert os.geteuid() == 0, "the netns tests need root (network namespaces, tc, nftables): run them as root"
    for tool in ("ip", "tc", "nft"):
        assert shutil.which(tool), f"{tool} is missing: run scripts/bootstrap"
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.priority import run

    lines = []
    result = run(profiles=("resnet50",), quick=True, iters=2, warmup=1, comm_s=0.3, name="tp2",
                 modes=("ddp", "app_order", "shim_overlap"), progress=lines.append, port_base=29900)
    fig = result["profiles"]["resnet50"]
    for key in ("ddp_s", "app_order_s", "shim_s", "lower_bound_s", "shim_vs_ddp", "shim_vs_lower_bound",
                "param_scale", "compute_scale"):
        assert isinstance(fig[key], float) and math.isfinite(fig[key]) and fig[key] > 0, (key, fig.get(key))
    for key in ("ddp_times_s", "app_order_times_s", "shim_times_s"):
        assert len(fig[key]) == 2 and all(t > 0 for t in fig[key]), key
    assert fig["shim_vs_ddp"] == pytest.approx(fig["shim_s"] / fig["ddp_s"])
    assert fig["shim_vs_lower_bound"] == pytest.approx(fig["shim_s"] / fig["lower_bound_s"])
    assert fig["lower_bound_dep_s"] >= fig["lower_bound_s"] and isinstance(fig["lower_bound_dep_layer"], int)
    assert fig["shim_vs_lower_bound_dep"] == pytest.approx(fig["shim_s"] / fig["lower_bound_dep_s"])
    stats = fig["shim_overlap_stats"]
    assert stats["enabled"] and stats["mode"] == "overlap" and len(stats["levels"]) == 4
    assert stats["agent"]["registrations"] > 0, stats["agent"]        # the flows reached the agent
    assert fig["app_order_stats"]["enabled"] and len(fig["app_order_stats"]["levels"]) == 1
    assert set(fig["pass"]) == set(passes(fig))
    assert "resnet50" in format_table(result)
    assert lines, "no progress reported"
