"""Smoke test of the classifier benchmark (bench/classifier.py). No timing assertions: the quick mode runs every
mechanism once on fresh namespaces and the test checks the JSON's shape, that every throughput is positive and that
each stream went to the class its mechanism promises (the benchmark measures what it says)."""
import json
import os
import subprocess

import pytest

from bench import classifier


def test_flow_keys_put_the_measured_flow_last():
    keys = classifier.flow_keys(5)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert (keys[-1].sport, keys[-1].dport) == (classifier.CPORT, classifier.PORT)
    assert classifier.flow_keys(0) == []
    big = classifier.flow_keys(10000)
    assert len(set(big)) == 10000
    assert [(k.sport, k.dport) for k in big].count((classifier.CPORT, classifier.PORT)) == 1


def test_u32_batch_spreads_filters_over_priorities():
    n = classifier.U32_PER_PRIO + 3
    lines = classifier.u32_batch_lines(n)
    assert len(lines) == n
    assert " prio 1 " in lines[0] and " prio 2 " in lines[-1]
    # the measured flow is the last filter and goes to level 0's class; the ports word is sport<<16 | dport
    assert f"match u32 0x{(classifier.CPORT << 16) | classifier.PORT:08x} 0xffffffff at 20" in lines[-1]
    assert lines[-1].endswith("flowid 7a1:10")
    assert "match u32 0xc612fa01 0xffffffff at 12" in lines[0]  # 198.18.250.1


def test_configurations_cover_every_mechanism():
    for quick in (True, False):
        mechs = {m for m, _ in classifier.configurations(quick)}
        assert mechs == set(classifier.MECHANISMS)


@pytest.mark.netns
def test_quick_run_writes_every_mechanism(tmp_path, capsys):
    out = tmp_path / "classifier.json"
    assert classifier.main(["--json", str(out), "--quick"]) == 0
    result = json.loads(out.read_text())
    assert result["quick"] is True
    by_mech = {}
    for row in result["results"]:
        by_mech.setdefault(row["mechanism"], []).append(row)
    assert set(by_mech) == set(classifier.MECHANISMS)
    assert {r["n"] for r in by_mech["nft-map"]} == set(classifier.QUICK_N["nft-map"])
    assert {r["n"] for r in by_mech["u32-linear"]} == set(classifier.QUICK_N["u32-linear"])
    for row in result["results"]:
        assert row["gbps_median"] > 0, row
        assert row["ratio_to_none"] > 0, row
        assert row["class_ok"], row  # the stream reached the class the mechanism promises
    assert next(r for r in result["runs"] if r["mechanism"] == "nft-map" and r["n"] == 1000)["nft_elements"] == 1000
    assert result["facts"]["ip_tos_resets_so_priority"] is True
    assert "nft-map" in capsys.readouterr().out  # the printed table
    # nothing of ours is left behind
    names = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=10).stdout
    assert f"{classifier.NS_PREFIX}{os.getpid()}-" not in names
