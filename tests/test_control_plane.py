"""Smoke run of the control-plane benchmark (quick mode): concurrent clients get no errors and everything the
agent held returns to its baseline afterwards. Timing figures are the benchmark's job, not asserted here."""
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
