"""bench.priority: a quick smoke run on the namespace testbed (DDP, application order, shim with overlap, agents on
every host). Checks that every figure is there and positive; no timing assertions (the 2-core machine is noisy:
docs/priority.md has the figures of a full run)."""
from __future__ import annotations

import math
import os
import shutil

import pytest

from bench.priority import format_table, passes


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
    stats = fig["shim_overlap_stats"]
    assert stats["enabled"] and stats["mode"] == "overlap" and len(stats["levels"]) == 4
    assert stats["agent"]["registrations"] > 0, stats["agent"]        # the flows reached the agent
    assert fig["app_order_stats"]["enabled"] and len(fig["app_order_stats"]["levels"]) == 1
    assert set(fig["pass"]) == set(passes(fig))
    assert "resnet50" in format_table(result)
    assert lines, "no progress reported"
