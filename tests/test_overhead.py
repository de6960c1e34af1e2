"""bench.overhead (``python -m bench shim-overhead``): a quick smoke run on the namespace testbed at the testbed's
highest rate, agents on every host, plain DDP and the shim in hook and overlap mode interleaved in one set of
workers. Checks that every figure is there and consistent; no timing assertions (the full run is by hand:
docs/benchmarks.md)."""
from __future__ import annotations

import json
import math

import pytest

from bench.overhead import TARGET_RATIO, format_table, passes, per_round


def test_per_round_and_passes():
    assert per_round([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2) == [1.5, 3.5, 5.5]
    assert per_round([1.0, 2.0, 3.0], 2) == [1.5]            # an incomplete round is left out
    assert passes({"ratio": TARGET_RATIO, "ratio_hook": 1.2}) == {"ratio": True, "ratio_hook": False}
    assert passes({}) == {"ratio": None, "ratio_hook": None}


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_overhead_quick_smoke(tmp_path):
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.overhead import run

    lines = []
    result = run(quick=True, iters=2, warmup=1, name="to2", progress=lines.append, port_base=29950)
    for key in ("ddp_s", "shim_s", "shim_hook_s", "ratio", "ratio_hook", "elapsed_s"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, (key, result.get(key))
    for key in ("ddp_times_s", "shim_times_s", "shim_hook_times_s"):
        assert len(result[key]) == 2 and all(t > 0 for t in result[key]), key
    assert result["ratio"] == pytest.approx(result["shim_s"] / result["ddp_s"])
    assert result["ratio_hook"] == pytest.approx(result["shim_hook_s"] / result["ddp_s"])
    assert result["reps"] == 2 and result["rate"] == "10gbit" and result["link_bps"] == 10**10
    assert result["hosts"] == 2 and result["machine"]["cores"] >= 1
    stats = result["shim_overlap_stats"]
    assert stats["enabled"] and stats["mode"] == "overlap" and len(stats["levels"]) == 4
    assert stats["agent"]["registrations"] > 0, stats["agent"]          # the flows reached the agent
    assert result["shim_stats"]["mode"] == "hook"
    assert set(result["pass"]) == {"ratio", "ratio_hook"}
    json.dumps(result)                                                  # what --json writes
    assert "overlap mode" in format_table(result)
    assert lines, "no progress reported"
