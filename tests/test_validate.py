"""bench.validate: its pure helpers, and a quick smoke run on the namespace testbed (calibration, planning, the
measured modes, predictions). Checks that every figure is there and positive; no timing assertions (the 2-core
machine is noisy: docs/policies.md has the figures of a full run)."""
from __future__ import annotations

import math

import pytest
from agent_clients import require_netns_tools

from bench.validate import (
    POLICIES,
    calibration_costs,
    emulated_profile,
    format_table,
    judge,
    pick_candidates,
    predict,
    setting_of,
    steady_median,
)


def test_emulated_profile_and_settings() -> None:
    from bench.models import gradient_bytes

    p = emulated_profile("resnet50", 5, 10.416)
    assert p.total_bytes == gradient_bytes("resnet50", 5) and p.dag is None
    assert emulated_profile("resnet50", 5, 10.416, 1.1).fwd_total == pytest.approx(1.1 * p.fwd_total)
    assert setting_of("ddp", 5)["bucket_bytes"] == 5 << 20
    assert setting_of("shim_overlap", 5) == {"kind": "shim", "policy": "layer_order", "levels": 4,
                                             "partition_bytes": None, "bucket_bytes": 1 << 20}
    assert setting_of("app_order", 5)["levels"] == 1


def test_calibration_predict_judge_and_candidates() -> None:
    cal = {"samples": [[4096, 1e-3 + 8 * 4096 / 190e6], [1 << 20, 1e-3 + 8 * (1 << 20) / 190e6],
                       [4 << 20, 1e-3 + 8 * (4 << 20) / 190e6]], "launch_s": 3e-5, "wake_s": 5e-5, "copy_bps": 2e9}
    costs = calibration_costs(cal, 2)
    assert costs["alpha_s"] == pytest.approx(1e-3) and costs["link_bps"] == pytest.approx(190e6)
    prof = emulated_profile("vgg16", 30, 2.484)
    t = {pol: predict(setting_of(pol, 30), prof, costs, 2) for pol in POLICIES}
    assert all(v > prof.fwd_total + prof.bwd_total for v in t.values())
    assert t["shim_overlap"] < t["ddp"]
    assert steady_median([0.8, 1.0, 1.1, 0.8, 1.2, 1.0], 3) == pytest.approx(1.05)
    assert steady_median([0.8, 1.0], 1) == pytest.approx(0.9)
    j = judge(1.1, 1.0)
    assert j["error"] == pytest.approx(0.1) and j["within_15pct"] and not judge(0.8, 1.0)["within_15pct"]

    from tensorlane.policies.planner import plan_shim

    plan = plan_shim(prof, 2, costs["link_bps"], bucket_bytes=(1 << 20, 1 << 18), partitions=(None, 1 << 16),
                     payload_fraction=1.0)
    picks = pick_candidates(plan, 3)
    assert picks[0].predicted_iter_s == plan.predicted_iter_s and len(picks) == 4
    assert len({(c.policy, c.levels, c.partition_bytes, c.bucket_bytes) for c in picks}) == 4
    assert picks[1].levels != picks[0].levels and picks[2].bucket_bytes != picks[0].bucket_bytes
    assert any(c.policy == "flat" for c in pick_candidates(plan, 9))


def test_format_table() -> None:
    row = {"predicted_s": 0.9, "measured_s": 1.0, "error": -0.1, "within_15pct": True}
    result = {"profiles": {"vgg16": {pol: row for pol in POLICIES}},
              "planner": {"vgg16": {"chosen": "a", "chosen_s": 1.0, "best": "a", "best_s": 1.0, "ratio": 1.0,
                                    "within_5pct": True, "candidates": [
                                        {"label": "a", "chosen": True, "planned_s": 0.9, "measured_s": 1.0,
                                         "predicted_s": 0.95}]}},
              "calibration": {"alpha_s": 1e-3, "link_bps": 190e6, "launch_s": 3e-5, "wake_s": 5e-5,
                              "copy_bps": 2e9}, "rounds": 1, "iters": 3, "quick": True, "elapsed_s": 60}
    out = format_table(result)
    assert "| VGG-16 | plain DDP | 1000 ms | 900 ms | -10.0% | yes |" in out
    assert "`a` **(chosen)** (best)" in out and "1.000 met" in out and "(quick)" in out


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_validate_quick_smoke():
    require_netns_tools()
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.validate import run

    lines = []
    result = run(profiles=("resnet50",), quick=True, iters=2, warmup=1, candidates=1, comm_s=0.3, name="tv2",
                 progress=lines.append, port_base=29960)
    for key in ("rate", "hosts", "rounds", "iters", "elapsed_s", "calibration", "profiles", "planner"):
        assert key in result, key
    cal = result["calibration"]
    for key in ("alpha_s", "link_bps", "launch_s", "wake_s", "copy_bps"):
        assert isinstance(cal[key], float) and math.isfinite(cal[key]) and cal[key] >= 0, (key, cal[key])
    assert cal["link_bps"] > 0
    fig = result["profiles"]["resnet50"]
    for pol in POLICIES:
        j = fig[pol]
        assert j["predicted_s"] > 0 and j["measured_s"] > 0, (pol, j)
        assert j["error"] == pytest.approx(j["predicted_s"] / j["measured_s"] - 1)
        assert isinstance(j["within_15pct"], bool)
    pl = result["planner"]["resnet50"]
    for key in ("chosen", "chosen_s", "best_s", "best", "ratio", "within_5pct", "candidates"):
        assert key in pl, key
    assert pl["chosen_s"] > 0 and pl["best_s"] > 0 and pl["ratio"] >= 1.0 - 1e-12
    assert len(pl["candidates"]) >= 2 and pl["candidates"][0]["chosen"]
    assert all(row["measured_s"] > 0 and row["predicted_s"] > 0 for row in pl["candidates"])
    assert "ResNet-50" in format_table(result)
    assert lines, "no progress reported"
