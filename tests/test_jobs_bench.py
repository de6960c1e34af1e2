"""bench.jobs: a quick smoke run on the namespace testbed (2 jobs sharing 2 hosts; FIFO, static priority and
rotation through the agents' job policy). Checks that every figure is there and consistent; no timing assertions
(the 2-core machine is noisy: docs/jobs.md has the figures of a full run)."""
from __future__ import annotations

import math

import pytest
from agent_clients import require_netns_tools

from bench.jobs import PHASES, format_table, passes, summarise


def test_summary_and_targets_by_hand():
    """Rotation 0.7x FIFO on average and no job worse: pass; one job worse: the per-job check fails."""
    fig = summarise({"fifo_jct_s": [20.0, 22.0], "static_jct_s": [14.0, 23.0], "rotate_jct_s": [14.0, 15.4]})
    assert fig["fifo_avg_s"] == 21.0 and fig["fifo_worst_s"] == 22.0 and fig["rotate_avg_s"] == pytest.approx(14.7)
    assert fig["rotate_vs_fifo_avg"] == pytest.approx(0.7) and fig["rotate_worst_vs_fifo_worst"] == pytest.approx(0.7)
    assert fig["pass"] == {"rotate_avg": True, "rotate_no_job_worse": True, "rotate_worst_not_worse": True,
                           "all": True}
    fig = summarise({"fifo_jct_s": [20.0, 22.0], "rotate_jct_s": [21.0, 8.0]})
    p = fig["pass"]
    assert p["rotate_avg"] and not p["rotate_no_job_worse"] and p["rotate_worst_not_worse"]
    assert fig["pass"]["all"] is False
    assert passes({})["all"] is None


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_jobs_quick_smoke():
    require_netns_tools()
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.jobs import run

    lines = []
    result = run(jobs_counts=(2,), quick=True, name="tj2", progress=lines.append, port_base=29950)
    fig = result["runs"]["2"]
    assert fig["jobs"] == ["tj2-j0", "tj2-j1"]
    for phase in PHASES:
        jct = fig[f"{phase}_jct_s"]
        assert len(jct) == 2 and all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in jct), (phase, jct)
        assert fig[f"{phase}_avg_s"] == pytest.approx(sum(jct) / 2)
        assert fig[f"{phase}_worst_s"] == max(jct)
        assert fig[f"{phase}_end_s"][0][0] >= jct[0] * 0.99  # the end of the process comes after the last iteration
    assert fig["rotate_vs_fifo_avg"] == pytest.approx(fig["rotate_avg_s"] / fig["fifo_avg_s"])
    assert fig["rotate_worst_vs_fifo_worst"] == pytest.approx(fig["rotate_worst_s"] / fig["fifo_worst_s"])
    assert set(fig["pass"]) == {"rotate_avg", "rotate_no_job_worse", "rotate_worst_not_worse", "all"}
    assert fig["static_order_changes"][0] >= 1 and fig["rotate_order_changes"][0] >= 1  # the agents ordered jobs
    assert fig["fifo_order_changes"][0] == 0
    assert result["quick"] and result["iters"] == 4 and result["elapsed_s"] > 0 and result["machine"]["cpus"]
    assert "FIFO" in format_table(result) and lines
