"""One agent, two NICs (a testbed host on two switch segments, as on rail-optimised GPU servers): each job's flows
are marked and queued on the NIC they leave through, status and metrics count per NIC, SIGTERM restores both
NICs exactly, interfaces can be found from the routes to the training subnets, and a NIC dropped from the config
after a killed agent is restored by the next one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from agent_clients import tc_dump

from bench.agents import AgentStartError, running_agents
from tensorlane.shim.agent_link import AgentLink
from testbed import Testbed

pytestmark = pytest.mark.netns
PY = [sys.executable, "-m"]
SCRAPE = ("import urllib.request; "
          "print(urllib.request.urlopen('http://127.0.0.1:9479/metrics', timeout=5).read().decode())")
BOTH = {"interfaces": ["eth0", "eth1"], "trusted_users": ["root"], "metrics_address": "127.0.0.1:9479"}


@pytest.fixture(scope="module")
def tb():
    with Testbed(hosts=2, rate="100mbit", name="tm", segments=2) as bed:
        yield bed


def send_udp(tb, segment: int, sport: int, dport: int, seconds: float = 1.0, pps: int = 300) -> dict:
    """UDP from host 1 to host 2's address on ``segment``; what host 2 received (count and DSCP per datagram)."""
    h1, h2 = tb.host(1), tb.host(2)
    recv = h2.popen(PY + ["testbed.udpprobe", "recv", "--port", str(dport), "--seconds", str(seconds + 4)],
                    stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        h1.run(PY + ["testbed.udpprobe", "send", "--dst", h2.address(segment), "--port", str(dport), "--sport",
                     str(sport), "--pps", str(pps), "--seconds", str(seconds)], timeout=seconds + 10)
        return json.loads(recv.communicate(timeout=seconds + 10)[0])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)


def class_bytes(status: dict, device: str) -> dict:
    """``{level: bytes sent}`` of ``device``'s classes in a status reply."""
    dev = next(d for d in status["devices"] if d["device"] == device)
    return {c["level"]: c.get("bytes", 0) for c in dev["classes"]}


def test_two_jobs_on_two_nics_each_marked_and_queued_on_its_own(tb):
    h1, h2 = tb.host(1), tb.host(2)
    before = {dev: tc_dump(h1, dev) for dev in ("eth0", "eth1")}
    tables_before = h1.run(["nft", "list", "tables"]).stdout
    a = {"proto": "udp", "src": h1.address(0), "sport": 41000, "dst": h2.address(0), "dport": 42000}
    b = {"proto": "udp", "src": h1.address(1), "sport": 41001, "dst": h2.address(1), "dport": 42001}
    rates = {**BOTH, "link_rate": {"eth0": "100mbit", "eth1": "50mbit"}}  # a slower second rail
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=rates) as agents:
        agent = agents[1]
        for dev in ("eth0", "eth1"):
            assert "qdisc htb 7a1: root" in tc_dump(h1, dev)
        with agent.client() as c:
            c.register("rail0", 0, [a])
            c.register("rail1", 2, [b])
            listed = {f["job"]: f["interface"] for f in c.list()["flows"]}
            st0 = c.status()
        assert listed == {"rail0": "eth0", "rail1": "eth1"}
        assert {d["device"]: d["link_rate_bps"] for d in st0["devices"]} == {"eth0": 10**8, "eth1": 5 * 10**7}
        link = AgentLink(agent.socket, "rail1", rank=0, interval_s=60)
        try:
            link.add(2, [b])  # the shim's view: the rate of the NIC its job's flows leave through
            assert link.link_bps == 5 * 10**7
        finally:
            link.close()
        with agent.client() as c:
            c.register("rail1", 2, [b])  # the link's close withdrew it
        assert [(i["name"], i["queues"], i["flows"]) for i in st0["interfaces"]] == [
            ("eth0", ["eth0"], 1), ("eth1", ["eth1"], 1)]
        verify = h1.popen(PY + ["tensorlane", "verify", "--socket", agent.socket, "--seconds", "4", "--json"],
                          stdout=subprocess.PIPE, text=True)  # captures on both NICs meanwhile
        try:
            time.sleep(0.5)
            got_a = send_udp(tb, 0, 41000, 42000)
            got_b = send_udp(tb, 1, 41001, 42001)
            report = json.loads(verify.communicate(timeout=20)[0])
        finally:
            if verify.poll() is None:
                verify.kill()
                verify.wait(5)
        st1 = agent.status()
        metrics = h1.run([sys.executable, "-c", SCRAPE]).stdout
    # On the wire: each flow carries its own level's DSCP (EF for level 0, the third level's for level 2).
    assert got_a["packets"] >= 250 and set(got_a["dscp"]) == {str(st0["classes"][0]["dscp"])}, got_a
    assert got_b["packets"] >= 250 and set(got_b["dscp"]) == {str(st0["classes"][2]["dscp"])}, got_b
    # In the queues: job rail0's bytes went through eth0's level-0 class, rail1's through eth1's level-2 class.
    d0 = {lvl: class_bytes(st1, "eth0")[lvl] - class_bytes(st0, "eth0")[lvl] for lvl in (0, 2)}
    d1 = {lvl: class_bytes(st1, "eth1")[lvl] - class_bytes(st0, "eth1")[lvl] for lvl in (0, 2)}
    assert d0[0] >= 250 * 100 and d0[2] == 0, d0
    assert d1[2] >= 250 * 100 and d1[0] == 0, d1
    assert st1["classes"][0]["bytes"] == sum(class_bytes(st1, d)[0] for d in ("eth0", "eth1"))  # summed
    # A capture on both NICs: each flow seen with its DSCP, its bytes in its level's class.
    assert report["ok"] and report["interface"] == ["eth0", "eth1"], report
    assert sorted((r["job"], r["verdict"]) for r in report["flows"]) == [("rail0", "ok"), ("rail1", "ok")], report
    for dev in ("eth0", "eth1"):  # one series per NIC and class
        for cls in ("7a1:10", "7a1:12", "7a1:13"):
            assert f'tensorlane_class_sent_bytes_total{{class="{cls}",device="{dev}"}}' in metrics
    for dev in ("eth0", "eth1"):
        assert tc_dump(h1, dev) == before[dev], dev
    assert h1.run(["nft", "list", "tables"]).stdout == tables_before


def test_interfaces_found_from_the_routes_to_the_training_subnets(tb):
    h1 = tb.host(1)
    extra = {"interfaces": "auto", "training_subnets": ["198.19.0.0/16"], "trusted_users": ["root"]}
    eth0 = tc_dump(h1, "eth0")
    with running_agents(tb, levels=2, hosts=[1], backend="htb", config_extra=extra) as agents:
        st = agents[1].status()
        assert [i["name"] for i in st["interfaces"]] == ["eth1"]
        assert [d["device"] for d in st["devices"]] == ["eth1"]
        assert tc_dump(h1, "eth0") == eth0  # not routed to the training subnet: untouched
        assert "qdisc htb 7a1: root" in tc_dump(h1, "eth1")


def test_a_nic_dropped_from_the_config_after_a_killed_agent_is_restored(tb, tmp_path):
    h1 = tb.host(1)
    before = {dev: tc_dump(h1, dev) for dev in ("eth0", "eth1")}
    with pytest.raises(AgentStartError, match="exited with -9"), \
            running_agents(tb, levels=2, hosts=[1], backend="htb", config_extra=BOTH,
                           workdir=str(tmp_path / "first")) as agents:
        run_dir = os.path.dirname(agents[1].socket)
        agents[1].proc.send_signal(signal.SIGKILL)  # killed: both NICs stay taken over, their records stay
        agents[1].proc.wait(10)
    assert "7a1:" in tc_dump(h1, "eth1") and os.path.exists(os.path.join(run_dir, "agent-eth1.json"))
    only0 = {**BOTH, "interfaces": ["eth0"]}
    with running_agents(tb, levels=2, hosts=[1], backend="htb", config_extra=only0,
                        workdir=str(tmp_path / "second")) as agents:
        assert tc_dump(h1, "eth1") == before["eth1"]  # restored at start: no longer configured, its agent gone
        assert not os.path.exists(os.path.join(run_dir, "agent-eth1.json"))
        assert "restoring it" in agents[1].stderr_tail()
    for dev in ("eth0", "eth1"):
        assert tc_dump(h1, dev) == before[dev], dev
