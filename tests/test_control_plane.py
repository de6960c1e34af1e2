"""Smoke run of the control-plane benchmark (quick mode): concurrent clients get no errors and everything the
agent held returns to its baseline afterwards; the busy-host part records its figures. Timing figures are the
benchmark's job, not asserted here."""
import pytest

from bench import control_plane

pytestmark = pytest.mark.netns


def test_quick_control_plane_run_leaves_baseline():
    res = control_plane.run(quick=True, name="tkq", progress=lambda *_: None)
    assert set(res["sizes"]) == {"0", "1000"}
    for fig in res["sizes"].values():
        assert fig["register_p50_ms"] > 0 and fig["throughput_bps"] > 0 and fig["agent_rss_bytes"] > 0
    soak = res["soak"]
    assert soak["errors"] == 0, soak["error_samples"]
    assert soak["operations"] > 0 and soak["flows_after"] == 0
    assert soak["objects_after"] == soak["objects_before"]
    busy = res["busy_host"]
    assert {"sockets", "owners", "agent_cpu_ratio", "register_p99_ms"} <= set(busy)
    assert busy["sockets"] >= 2000 and busy["owners"] == 8
    assert busy["flows_kept"] == busy["owners"] * busy["flows_per_owner"]  # the sweep kept every held flow
    assert busy["rounds"] > 0 and 0 < busy["agent_cpu_ratio"] < 1 and busy["register_p99_ms"] > 0
