"""bench.realtrain: the quick run on the namespace testbed (a real CNN, bf16 autocast, LR warm-up, clipping; plain
DDP, the shim with and without clipping, under iperf3 bulk with agents on both hosts), through
``python -m bench realtrain --quick --json FILE``. Checks the JSON's structure, that the shim with clipping runs
hook mode and trains exactly like plain DDP step by step, and that the shim without clipping runs overlap mode.
No timing assertions (the 2-core machine is shared). Plus the analysis helpers and the report's rows on synthetic
figures (no testbed)."""
from __future__ import annotations

import json
import math

import pytest

from bench import realtrain
from bench.realtrain import LOSS_TOLERANCE, format_table, loss_diff, rel_diff


def _finite_positive(v) -> bool:
    return isinstance(v, float) and math.isfinite(v) and v > 0


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(900)
def test_realtrain_quick(tmp_path):
    import torch  # noqa: F401  (required: a missing torch fails the test)

    import bench

    out = tmp_path / "realtrain.json"
    code = bench.main(["realtrain", "--quick", "--json", str(out), "--plot", str(tmp_path / "rt.png"),
                       "--name", "tr2"])
    d = json.loads(out.read_text())
    assert d["benchmark"] == "realtrain" and d["machine"]["cores"] >= 1 and d["quick"] is True
    assert d["hosts"] == 2 and d["link_bps"] > 0
    assert d["model"]["params"] == realtrain._count_params(d["model"]["width"])
    # (the bulk's figures, unless an iperf3 client aborted on its interrupt: bench.bulk.BulkCrash, iperf3's bug)
    assert _finite_positive(d["comm_s"]) and (set(d["bulk_bps"]) == {"h1->h2", "h2->h1"} or "bulk_crash" in d)
    steps = d["warmup"] + d["iters"] + 1
    for mode in realtrain.MODES:
        m = d["modes"][mode]
        assert _finite_positive(m["median_s"]) and d[realtrain.KEY[mode]] == m["median_s"]
        assert len(m["times_s"]) == d["iters"] * d["rounds"] and all(t > 0 for t in m["times_s"])
        assert len(m["losses"]) == d["rounds"] and len(m["losses"][0]) == steps
        assert len(m["losses_by_rank"][0]) == 2
        assert all(math.isfinite(x) and x > 0 for x in m["losses"][0])
    for key in ("shim_clip_vs_ddp", "shim_noclip_vs_ddp"):
        assert _finite_positive(d[key])
    # the shim with clipping: hook mode (it saw the clipping), exactly plain DDP's losses and parameters
    assert d["modes"]["shim_clip"]["shim_mode"] == ["hook"] and d["modes"]["shim_clip"]["mode_reason"]
    assert d["modes"]["shim_noclip"]["shim_mode"] == ["overlap"]
    lc = d["loss"]["shim_clip_vs_ddp"]
    assert len(lc["per_step"]) == steps and lc["max"] == max(lc["per_step"])
    assert lc["max"] <= LOSS_TOLERANCE, lc
    assert d["loss_max_rel_diff"] == lc["max"] and d["pass"]["loss_equal"] is True and code == 0
    assert d["modes"]["shim_clip"]["param_max_abs_diff_vs_ddp"] <= 1e-5
    stats = d["modes"]["shim_clip"]["shim_stats"]
    assert stats["agent"]["registrations"] > 0, stats["agent"]   # the shim's flows reached the agents
    # clipping is active in this loop (otherwise the comparison would not show anything)
    assert any(n > realtrain.DEFAULTS["max_norm"] for n in d["modes"]["ddp"]["grad_norms"][0])
    assert "shim_clip" in format_table(d)
    assert (tmp_path / "rt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _runs(losses_by_rank_round):
    """``runs_of[mode]`` as the workers give it: per rank, a list of runs with ``losses``."""
    return [[{"losses": losses} for losses in rounds] for rounds in losses_by_rank_round]


def test_loss_diff_and_rel_diff():
    assert rel_diff(2.0, 2.0) == 0.0 and rel_diff(2.2, 2.0) == pytest.approx(0.1) and rel_diff(0.5, 0.0) == 0.5
    ref = _runs([[[2.0, 1.0, 0.5]], [[2.2, 1.1, 0.6]]])
    same = _runs([[[2.0, 1.0, 0.5]], [[2.2, 1.1, 0.6]]])
    off = _runs([[[2.0, 1.0, 0.5]], [[2.2, 1.1, 0.66]]])
    assert loss_diff({"a": same, "b": ref}, "a", "b") == {"per_step": [0.0, 0.0, 0.0], "max": 0.0,
                                                          "exact_steps": 3, "steps": 3}
    r = loss_diff({"a": off, "b": ref}, "a", "b")
    assert r["per_step"][:2] == [0.0, 0.0] and r["per_step"][2] == pytest.approx(0.1) and r["exact_steps"] == 2
    assert loss_diff({"a": off}, "a", "b") is None


def test_report_rows_and_plot(tmp_path):
    from bench import report

    d = {"hosts": 2, "rate": "200mbit", "link_bps": 2e8, "iters": 10, "rounds": 3, "steps": 13, "quick": False,
         "bulk_streams": 4, "comm_s": 0.367, "compute_s": 0.45, "ddp_s": 1.8, "shim_clip_s": 0.9,
         "shim_noclip_s": 0.7, "ddp_noclip_s": 1.75,
         "model": {"params": 2295114, "gradient_bytes": 9180456, "batch_per_rank": 32},
         "train": {"warmup_steps": 5, "max_norm": 1.0}, "targets": {"loss_max_rel_diff_max": 1e-6},
         "loss": {"shim_clip_vs_ddp": {"per_step": [0.0] * 13, "max": 0.0, "exact_steps": 13, "steps": 13}},
         "modes": {"compute": {"median_s": 0.45}, "ddp": {"median_s": 1.8, "losses": [[2.3, 2.1, 1.9]]},
                   "shim_clip": {"median_s": 0.9, "losses": [[2.3, 2.1, 1.9]], "shim_mode": ["hook"] * 3},
                   "shim_noclip": {"median_s": 0.7, "losses": [[2.3, 2.0, 1.7]], "shim_mode": ["overlap"] * 3}}}
    rows = {r.figure: r for r in report.rows_realtrain(d)}
    r = rows["shim with clipping (hook mode) vs plain DDP with clipping, under bulk"]
    assert (r.ours, r.alternatives, r.ratio, r.result) == ("900 ms", "DDP 1800 ms", "0.50", "-")
    assert rows["shim without clipping (overlap mode) vs plain DDP without clipping, under bulk"].ratio == "0.40"
    assert rows["what clipping costs the shim (hook mode instead of overlap): with vs without"].ratio == "1.29"
    r = rows["loss curve, shim with clipping vs plain DDP with clipping: largest relative difference per step"]
    assert (r.ours, r.alternatives, r.target, r.result) == ("0", "13 of 13 steps bit-equal", "<= 1e-06", "met")
    d["loss"]["shim_clip_vs_ddp"]["max"] = 3e-5
    r = report.rows_realtrain(d)[-1]
    assert r.result.startswith("**missed**") and r.missed
    line = report.describe_run("realtrain", d, "docs/img/bench-realtrain.png")
    assert "2.30 M parameters" in line and "median of 30 iterations per mode (3 interleaved rounds of 10)" in line
    assert report.save_plot("realtrain", d, str(tmp_path / "rt.png"))
    assert (tmp_path / "rt.png").stat().st_size > 1000
    assert report.rows_realtrain({})[0].ours == "-"   # a partial file: dashes, no crash
