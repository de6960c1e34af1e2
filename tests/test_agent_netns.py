"""The agent against the real kernel, in a testbed of its own: take-over and exact restore, refusals that
leave the host untouched, marking and queueing of registered flows, churn, drift repair, status and verify."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from agent_clients import flow, nft_tables, tc_dump, udp_exchange, wait_for

from bench.agents import AgentStartError, running_agents
from tensorlane.agent.kernel import nft as nftables
from testbed import Testbed

pytestmark = pytest.mark.netns
PY = [sys.executable, "-m"]
TRUST = {"trusted_users": ["root"]}  # the test registers flows of its probe processes on their behalf





@pytest.fixture(scope="module")
def tb():
    with Testbed(hosts=2, rate="100mbit", name="ta") as bed:
        yield bed


def test_take_over_and_restore_exactly(tb):
    h1 = tb.host(1)
    before, tables_before = tc_dump(h1), nft_tables(h1)
    assert "htb 1:" in before  # the testbed's emulated NIC: a root tensorlane did not create
    with running_agents(tb, levels=3, hosts=[1], backend="htb") as agents:
        during = tc_dump(h1)
        assert "qdisc htb 7a1: root" in during and "prio 2" in during
        assert "tensorlane" in nft_tables(h1)
        assert agents[1].status()["backend"] == "htb"
    assert tc_dump(h1) == before
    assert nft_tables(h1) == tables_before


def test_refuses_foreign_root_without_take_over(tb, tmp_path):
    h1 = tb.host(1)
    before = tc_dump(h1)
    with pytest.raises(AgentStartError, match=r"root qdisc 'htb' \(handle 1:\) that tensorlane did not create"):
        with running_agents(tb, hosts=[1], config_extra={"take_over_root": False}, workdir=str(tmp_path)):
            pass
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


@pytest.mark.parametrize("kwargs,field", [({"config_extra": {"interfaces": "auto",  # (an absent one is followed)
                                                            "training_subnets": ["10.99.0.0/16"]}}, "interfaces"),
                                          ({"levels": 7}, "levels"),
                                          ({"config_extra": {"dscp": {"0": 99}}}, "dscp")])
def test_config_errors_stop_before_the_kernel(tb, kwargs, field, tmp_path):
    h1 = tb.host(1)
    before = tc_dump(h1)
    with pytest.raises(AgentStartError, match=f"config field '{field}'"):
        with running_agents(tb, hosts=[1], workdir=str(tmp_path), **kwargs):
            pass
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


def test_registered_flow_is_marked_and_queued(tb):
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            reply = agent.register("job-a", 1, [flow(h1, 9101, h2, 9100)], rank=0)
            assert reply["dscp"] == 34 and reply["class"] == "7a1:11"
            before = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
            marked = udp_exchange(h1, h2, 9101, 9100)
            plain = udp_exchange(h1, h2, 9102, 9100, seconds=0.5)
            after = {c["class"]: c for c in agent.status()["classes"]}
    assert marked["packets"] >= 0.95 * marked["sent"]["sent"] and marked["dscp"] == {"34": marked["packets"]}
    assert plain["dscp"] == {"0": plain["packets"]} and plain["packets"] > 0
    assert after["7a1:11"]["bytes"] - before["7a1:11"] >= marked["sent"]["bytes"]
    assert after["7a1:11"]["marked_bytes"] >= marked["sent"]["bytes"]
    assert after["7a1:13"]["bytes"] - before["7a1:13"] >= plain["sent"]["bytes"]  # default class


def test_a_users_unregistered_traffic_leaves_without_the_dscp_it_set(tb):
    """``IP_TOS`` needs no privilege: a local user (not even one the agent lets register) set DSCP 46, level 0's,
    or CS6 above every level, on traffic it never registered, and the switch queued it with the most urgent
    training traffic or above, past ``level_limits`` and the agent. Since 2026-11-28 a user's unregistered packets
    on a managed interface leave with DSCP 0; root's keep theirs, and a registered flow its level's.
    ``reset_user_dscp = false`` keeps users' own marks (and is changed in place at a restart)."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("job-a", 1, [flow(h1, 9111, h2, 9110)], rank=0)
            users = {tos: udp_exchange(h1, h2, 9112, 9110, seconds=0.5, tos=tos, as_uid=65534) for tos in (184, 192)}
            roots = udp_exchange(h1, h2, 9113, 9110, seconds=0.5, tos=184)
            marked = udp_exchange(h1, h2, 9111, 9110, seconds=0.5, tos=192)
            egress = json.loads(h1.run(["nft", "-j", "list", "chain", "inet", "tensorlane", "egress"]).stdout)
    # what tensorlane_unregistered_dscp_reset_packets_total reports: the users' packets (those received, and a few
    # the probe sends besides), not root's or the registered flow's
    received = sum(got["packets"] for got in users.values())
    assert received <= nftables.reset_counters(egress)["packets"] <= received + 16, egress
    for got in users.values():
        assert got["packets"] > 0 and got["dscp"] == {"0": got["packets"]}, users
    assert roots["packets"] > 0 and roots["dscp"] == {"46": roots["packets"]}, roots
    assert marked["packets"] > 0 and marked["dscp"] == {"34": marked["packets"]}, marked
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra={**TRUST, "reset_user_dscp": False}):
        kept = udp_exchange(h1, h2, 9112, 9110, seconds=0.5, tos=184, as_uid=65534)
    assert kept["packets"] > 0 and kept["dscp"] == {"46": kept["packets"]}, kept


def test_churn_never_demotes_other_flows_and_leaves_no_state(tb):
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("steady", 0, [flow(h1, 9201, h2, 9200)])

            def churn() -> None:
                with agents[1].client() as c:
                    deadline = time.monotonic() + 1.5
                    for i in range(400):
                        if time.monotonic() > deadline:
                            break
                        flows = [flow(h1, 20000 + i * 4 + k, h2, 9300) for k in range(4)]
                        c.register(f"churn{i % 7}", i % 3, flows)
                        if i % 2:
                            c.register(f"churn{i % 7}", (i + 1) % 3, flows)  # move between levels
                        c.unregister(f"churn{i % 7}", flows)

            seen = udp_exchange(h1, h2, 9201, 9200, seconds=2.0, pps=400, during=churn)
            listed = agent.list()["flows"]
        kernel = h1.run(["nft", "-j", "list", "map", "inet", "tensorlane", "flows4"]).stdout
    assert seen["dscp"] == {"46": seen["packets"]} and seen["packets"] > 500
    assert [f["job"] for f in listed] == ["steady"]
    elems = json.loads(kernel)["nftables"][1]["map"].get("elem", [])
    assert len(elems) == 1 and elems[0][0]["concat"][3] == 9201


def test_reconcile_repairs_drift(tb):
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, hosts=[1], backend="htb", config_extra={"reconcile_interval_s": 0.3, **TRUST}) as agents:
        with agents[1].client() as agent:
            agent.register("job-a", 0, [flow(h1, 9401, h2, 9400)])
            h1.run(["nft", "flush", "map", "inet", "tensorlane", "flows4"])
            h1.run(["nft", "add", "element", "inet", "tensorlane", "flows4",
                    "{ 198.18.0.1 . 198.18.0.2 . udp . 1 . 2 : goto level0 }"])
            h1.run(["tc", "class", "change", "dev", "eth0", "parent", "7a1:1", "classid", "7a1:10", "htb",
                    "rate", "1mbit", "ceil", "2mbit", "prio", "5"])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and agent.status()["reconcile"]["repairs"] < 2:
                time.sleep(0.1)
            st = agent.status()
        elems = h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
        classes = h1.run(["tc", "class", "show", "dev", "eth0"]).stdout
    assert st["reconcile"]["repairs"] >= 2 and st["reconcile"]["errors"] == 0
    assert "9401" in elems and ". 1 . 2" not in elems
    assert "class htb 7a1:10 parent 7a1:1 leaf 100: prio 0" in classes


def test_status_and_verify_commands(tb):
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=2, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        sock = agents[1].socket
        with agents[1].client() as agent:
            agent.register("job-v", 0, [flow(h1, 9501, h2, 9500)])
        status = h1.run(PY + ["tensorlane", "status", "--socket", sock]).stdout
        verify = {}

        def run_verify() -> None:
            verify["out"] = h1.run(PY + ["tensorlane", "verify", "--socket", sock, "--seconds", "1.5", "--json"],
                                   check=False, timeout=30)

        udp_exchange(h1, h2, 9501, 9500, seconds=2.5, during=run_verify)
    assert "backend htb" in status and "7a1:10" in status and "job job-v: 1 flows" in status
    out = verify["out"]
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    row = report["flows"][0]
    assert row["verdict"] == "ok" and row["seen_dscp"] == [46] and row["queue"] == "7a1:10"
    assert report["queues"]["7a1:10"]["ok"]


def kill_an_agent(tb, tmp_path) -> None:
    """Start an agent on host 1 and SIGKILL it: it leaves its tree and its state file behind."""
    with pytest.raises(AgentStartError, match="exited with -9"):
        with running_agents(tb, hosts=[1], backend="htb", workdir=str(tmp_path)) as agents:
            agents[1].proc.kill()
            agents[1].proc.wait(5)


def test_sigkill_leaves_state_that_a_new_agent_adopts_then_restores(tb, tmp_path):
    h1 = tb.host(1)
    before = tc_dump(h1)
    kill_an_agent(tb, tmp_path)
    assert "7a1:" in tc_dump(h1)  # the killed agent could not clean up
    with running_agents(tb, hosts=[1], backend="htb") as agents:
        assert agents[1].status()["flows"] == 0
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


def test_unsupported_backend_stops_before_the_kernel(tb, tmp_path):
    from tensorlane.agent.kernel.detect import probe_qdiscs

    h1 = tb.host(1)
    before = tc_dump(h1)
    if "prio" in probe_qdiscs(("prio",)):  # a kernel with sch_prio: the backend is supported and must work
        with running_agents(tb, hosts=[1], backend="prio") as agents:
            assert agents[1].status()["backend"] == "prio"
    else:  # this project's machines: no sch_prio
        with pytest.raises(AgentStartError, match="config field 'backend': backend 'prio' is not supported"):
            with running_agents(tb, hosts=[1], backend="prio", workdir=str(tmp_path)):
                pass
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


def test_two_jobs_with_one_id_are_a_conflict_the_shim_and_metrics_show(tb):
    from tensorlane.shim.agent_link import AgentLink

    h1, h2 = tb.host(1), tb.host(2)
    extra = {**TRUST, "job_policy": "rotate", "metrics_address": "127.0.0.1:9478"}
    with running_agents(tb, levels=2, hosts=[1], config_extra=extra) as agents:
        sock = agents[1].socket
        links = [AgentLink(sock, "none", rank=0, interval_s=60, run=run) for run in ("run-a", "run-b")]
        try:
            links[0].add(0, [flow(h1, 43000, h2, 29500, "tcp")])
            assert links[0].conflict == ""
            links[1].add(0, [flow(h1, 43001, h2, 29501, "tcp")])
            assert "job id 'none' is also used by another run" in links[1].conflict
            assert agents[1].status()["job_conflicts"] == {"none": ["run-a", "run-b"]}
            scrape = h1.run([sys.executable, "-c", "import urllib.request; print(urllib.request.urlopen("
                             "'http://127.0.0.1:9478/metrics', timeout=5).read().decode())"]).stdout
            assert 'tensorlane_job_id_conflicts{device="eth0"} 1.0' in scrape
            assert links[0].link_bps == tb.rate_bps  # the rate of the NIC the job's flows leave through
        finally:
            for link in links:
                link.close()
        assert agents[1].status()["job_conflicts"] == {}
        assert "is used by 2 runs on this host" in agents[1].stderr_tail()


RECV_TCP = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0
while (b := c.recv(65536)):
    n += len(b)
print(n)
"""
SEND_TCP = """
import socket, sys, time
for _ in range(50):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[3]))); s.settimeout(20)
    try:
        s.connect((sys.argv[1], int(sys.argv[2]))); break
    except ConnectionRefusedError:
        s.close(); time.sleep(0.1)
chunk = int(sys.argv[5]) if len(sys.argv) > 5 else 0
more = len(sys.argv) > 6 and sys.argv[6] == "more"
if chunk and more:  # small writes with MSG_MORE, each pushed by setting TCP_NODELAY: small data segments without PSH
    for _ in range(int(sys.argv[4]) // chunk):
        s.sendall(b"x" * chunk, socket.MSG_MORE); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        time.sleep(0.002)
elif chunk:  # small writes, one segment each (no Nagle, a pause between them): small data segments with PSH
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(int(sys.argv[4]) // chunk):
        s.sendall(b"x" * chunk); time.sleep(0.002)
else:
    s.sendall(b"x" * int(sys.argv[4]))
s.close()
"""


def tcp_push(sender, receiver, sport, dport, nbytes, chunk: int = 0, more: bool = False) -> int:
    """Send ``nbytes`` over one TCP connection ``sender:sport -> receiver:dport`` (in writes of ``chunk`` bytes, each
    its own segment, when given; ``more``: each written with MSG_MORE, then pushed without PSH); the bytes the
    receiver got."""
    recv = receiver.popen([sys.executable, "-c", RECV_TCP, str(dport)], stdout=subprocess.PIPE, text=True)
    try:
        sender.run([sys.executable, "-c", SEND_TCP, receiver.ip, str(dport), str(sport), str(nbytes), str(chunk),
                    "more" if more else ""], timeout=30)
        return int(recv.communicate(timeout=30)[0])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)


@pytest.mark.parametrize("ack_priority", [True, False])
def test_pure_acks_of_a_less_urgent_flow_go_to_the_most_urgent_class(tb, ack_priority):
    """h1 receives 3 MB on a flow registered at level 2: what h1 sends on it is pure ACKs, which leave in level 0's
    class (``ack_priority``, the default), or in level 2's with it off. Data itself keeps its level: h1 sending
    on a registered flow is covered by test_registered_flow_is_marked_and_queued."""
    h1, h2 = tb.host(1), tb.host(2)
    port = 9300 if ack_priority else 9310
    extra = {**TRUST, "ack_priority": ack_priority}
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=extra) as agents:
        with agents[1].client() as agent:
            agent.register("job-a", 2, [flow(h1, port, h2, port + 1, "tcp")], rank=0)
            assert agent.status()["ack_priority"] is ack_priority
            before = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
            assert tcp_push(h2, h1, port + 1, port, 3_000_000) == 3_000_000
            after = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
    top, own = (after[c] - before[c] for c in ("7a1:10", "7a1:12"))
    acks, other = (top, own) if ack_priority else (own, top)
    assert 20_000 <= acks <= 300_000 and other <= 2_000, (top, own)  # ~1 ACK of ~66 B per 1-2 segments


def test_small_data_segments_keep_their_level(tb):
    """h1 sends 400 writes of 20 bytes (each its own small segment, with PSH) on a flow registered at level 2: they
    are data, not pure ACKs, so they stay in level 2's class. Sent to level 0 ahead of the flow's queued data
    (the rule matched by length alone until 2026-11-24) they arrived out of order: on stagger4 the hosts counted
    108 reordering events and 39 fast retransmissions per phase under a job order, against 14 and 5 after."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("job-s", 2, [flow(h1, 9320, h2, 9321, "tcp")], rank=0)
            before = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
            assert tcp_push(h1, h2, 9320, 9321, 8_000, chunk=20) == 8_000
            after = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
    top, own = (after[c] - before[c] for c in ("7a1:10", "7a1:12"))
    assert own >= 400 * (20 + 52) and top <= 1_000, (top, own)  # 20 B of data + 52 B of headers per write


def test_small_data_segments_without_psh_keep_their_level(tb):
    """h1 sends 400 writes of 60 bytes on a flow registered at level 2, each with MSG_MORE and then pushed by setting
    TCP_NODELAY: each leaves as a small data segment *without* PSH (IP length 112). Such segments are data, not pure
    ACKs, so they stay in level 2's class. Until 2026-11-28 the pure-ACK rule matched any segment without SYN, FIN,
    RST or PSH under 128 bytes: any user sent its data so at the most urgent class and DSCP, whatever its
    level_limits."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("job-p", 2, [flow(h1, 9330, h2, 9331, "tcp")], rank=0)
            before = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
            assert tcp_push(h1, h2, 9330, 9331, 24_000, chunk=60, more=True) == 24_000
            after = {c["class"]: c["bytes"] for c in agent.status()["classes"]}
    top, own = (after[c] - before[c] for c in ("7a1:10", "7a1:12"))
    assert own >= 400 * (60 + 52) and top <= 1_000, (top, own)  # 60 B of data + 52 B of headers per write


def test_a_second_agent_with_the_same_state_dir_is_refused(tb):
    """The same config run a second time beside a running agent (by hand beside the service) is refused before it
    changes anything: before, it adopted the running agent's tree, took its socket, and the two reconcilers deleted
    each other's flows every pass."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("job-l", 0, [flow(h1, 9601, h2, 9600)])
        second = h1.run([sys.executable, "-m", "tensorlane.cli", "agent", "--config", agents[1].config_path],
                        check=False, timeout=30)
        assert second.returncode != 0 and "another tensorlane agent (pid" in second.stderr, second.stderr[-2000:]
        st = agents[1].status()
        elems = h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
        assert st["flows"] == 1 and "9601" in elems and "qdisc htb 7a1: root" in tc_dump(h1)


def test_a_root_put_on_the_device_behind_the_agent_is_replaced_by_its_tree(tb):
    """Someone replaces the agent's root qdisc: the next pass puts the agent's tree back (before, every pass failed
    on 'File exists', and the flows' marks were not repaired either), and the original is restored on exit."""
    h1, h2 = tb.host(1), tb.host(2)
    before = tc_dump(h1)
    with running_agents(tb, hosts=[1], backend="htb", config_extra={"reconcile_interval_s": 0.3, **TRUST}) as agents:
        with agents[1].client() as agent:
            agent.register("job-r", 0, [flow(h1, 9611, h2, 9610)])
            h1.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf", "rate", "10mbit", "burst",
                    "32k", "latency", "50ms"])
            h1.run(["nft", "flush", "map", "inet", "tensorlane", "flows4"])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and ("qdisc htb 7a1: root" not in tc_dump(h1) or "9611" not in h1.run(
                    ["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout):
                time.sleep(0.1)
            st = agent.status()
        assert "qdisc htb 7a1: root" in tc_dump(h1) and "class htb 7a1:10" in tc_dump(h1)
        assert "9611" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
        assert st["reconcile"]["errors"] == 0, st["reconcile"]
    assert tc_dump(h1) == before


def test_an_agent_killed_while_restoring_leaves_a_record_the_next_one_keeps(tb, tmp_path):
    """SIGKILL between deleting its root and re-creating the original (simulated: killed, then the root deleted):
    the next agent keeps the state file's record of the original instead of recording the bare device, and
    restores it on exit. Before, the original tree was lost."""
    h1 = tb.host(1)
    before = tc_dump(h1)
    kill_an_agent(tb, tmp_path)
    h1.run(["tc", "qdisc", "del", "dev", "eth0", "root"])
    assert "7a1:" not in tc_dump(h1) and "htb 1:" not in tc_dump(h1)
    with running_agents(tb, hosts=[1], backend="htb") as agents:
        assert agents[1].status()["flows"] == 0
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


@pytest.mark.parametrize("content", ['{"ifindex": 2}', '{"snapshot": {}}', '"x"', "{}", "null"])
def test_a_state_file_that_is_not_an_agents_stops_the_start(tb, tmp_path, content):
    h1 = tb.host(1)
    before = tc_dump(h1)
    from bench.agents import agent_config

    path = f"{agent_config(tb, h1)['state_dir']}/agent-eth0.json"
    h1.run(["mkdir", "-p", path.rsplit("/", 1)[0]])
    with open(path, "w") as fh:
        fh.write(content)
    try:
        with pytest.raises(AgentStartError, match="is not a tensorlane agent's state"):
            with running_agents(tb, hosts=[1], backend="htb", workdir=str(tmp_path)):
                pass
    finally:
        subprocess.run(["rm", "-f", path], check=False)
    assert tc_dump(h1) == before and "tensorlane" not in nft_tables(h1)


ECHO_SERVER = r"""
import socket, sys, time
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
srv.settimeout(15)
conn, _ = srv.accept()
conn.settimeout(5)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    data = conn.recv(65536)
    if not data:
        break
    conn.sendall(data)
"""

ECHO_CLIENT = r"""
import socket, sys, time
s = socket.socket()
s.bind(("0.0.0.0", int(sys.argv[3])))
s.connect((sys.argv[1], int(sys.argv[2])))
s.settimeout(5)
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    s.sendall(b"x" * 4000)
    got = 0
    while got < 4000:
        got += len(s.recv(65536))
    time.sleep(0.002)
"""


def test_verify_accepts_the_pure_acks_that_ack_priority_sends_at_the_most_urgent_level(tb):
    """A TCP flow at level 2 that both sends and receives (as gloo's connections do): its pure ACKs leave at level
    0's DSCP by design (``ack_priority``), its data at level 2's. ``verify`` reports it ok, the ACKs apart; before,
    every such flow was 'wrong dscp'."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra=TRUST) as agents:
        with agents[1].client() as agent:
            agent.register("job-t", 2, [flow(h1, 9701, h2, 9700, proto="tcp")])
        server = h2.popen([sys.executable, "-c", ECHO_SERVER, "9700", "8"])
        time.sleep(0.3)
        client = h1.popen([sys.executable, "-c", ECHO_CLIENT, h2.ip, "9700", "9701", "5"])
        try:
            time.sleep(0.5)
            out = h1.run(PY + ["tensorlane", "verify", "--socket", agents[1].socket, "--seconds", "2", "--json"],
                         check=False, timeout=30)
        finally:
            for p in (client, server):
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
    assert out.returncode == 0, out.stdout + out.stderr
    row = json.loads(out.stdout)["flows"][0]
    assert row["verdict"] == "ok" and row["seen_dscp"] == [26] and row["ack_dscp"] == [46], row



def test_a_managed_interface_renamed_moved_or_re_created_is_followed(tb):
    """A managed interface that is renamed, moved to another namespace, or deleted and re-created: the device that
    left is given back (its recorded tree restored where it is still here), the one that came under the name is
    taken over, and the other interface's tree and the flows' marks never change. Before, a renamed device kept the
    agent's tree while the rule (by name) marked nothing on it, and a deleted or moved one failed every pass; none
    was taken over again until the agent restarted."""
    h1, h2 = tb.host(1), tb.host(2)
    h1.run(["ip", "link", "add", "tlx", "type", "veth", "peer", "name", "tlxp"])
    try:
        h1.run(["tc", "qdisc", "add", "dev", "tlx", "root", "handle", "1:", "tbf", "rate", "10mbit", "burst", "32k",
                "latency", "50ms"])
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx")}
        extra = {"interfaces": ["eth0", "tlx"], "reconcile_interval_s": 0.3, **TRUST}
        with running_agents(tb, hosts=[1], backend="htb", config_extra=extra) as agents:
            state_file = f"{agents[1].socket.rsplit('/', 1)[0]}/agent-tlx.json"

            def index():
                return int(json.loads(h1.run(["ip", "-j", "link", "show", "tlx"]).stdout)[0]["ifindex"])

            def taken(idx):
                st = agents[1].status()
                if "qdisc htb 7a1: root" not in tc_dump(h1, "tlx"):
                    return None
                with open(state_file) as fh:  # recorded before the tree was made
                    recorded = json.load(fh)["ifindex"] == idx
                return recorded and {"device": "tlx", "serves": "tlx"}.items() <= next(  # (status read first:
                    (d for d in st["devices"] if d["device"] == "tlx"), {}).items() and st  # a pass may come between)

            def absent():
                st = agents[1].status()
                tlx = next(i for i in st["interfaces"] if i["name"] == "tlx")
                return not tlx["present"] and tlx["queues"] == [] and "tlx: no such interface" in st[
                    "reconcile"]["failing"] and st

            eth0 = tc_dump(h1, "eth0")
            with agents[1].client() as agent:
                agent.register("job-f", 0, [flow(h1, 9711, h2, 9710)])
            wait_for("tlx taken over at start", lambda: taken(index()))
            # renamed away: its original (the tbf) back on it; renamed back: taken over again
            h1.run(["ip", "link", "set", "tlx", "name", "tly"])
            wait_for("tlx absent after the rename", absent)
            assert tc_dump(h1, "tly") == before["tlx"].replace("tlx", "tly")
            h1.run(["ip", "link", "set", "tly", "name", "tlx"])
            wait_for("tlx taken over after the rename back", lambda: taken(index()))
            # moved to another namespace and back: gone with its tree, then taken over again
            h1.run(["ip", "link", "set", "tlx", "netns", h2.name])
            wait_for("tlx absent after the move", absent)
            h2.run(["ip", "link", "set", "tlx", "netns", h1.name])
            wait_for("tlx taken over after the move back", lambda: taken(index()))
            # deleted and re-created: a new device (a new index) under the name
            old = index()
            h1.run(["ip", "link", "del", "tlx"])
            wait_for("tlx absent after the delete", absent)
            h1.run(["ip", "link", "add", "tlx", "type", "veth", "peer", "name", "tlxp"])
            assert index() != old
            st = wait_for("the new tlx taken over", lambda: taken(index()))
            assert tc_dump(h1, "eth0") == eth0  # the other interface was never touched
            assert "9711" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
            assert st["flows"] == 1 and [i["present"] for i in st["interfaces"]] == [True, True]
            errors = st["reconcile"]["errors"]
            time.sleep(1.0)
            rec = agents[1].status()["reconcile"]
            assert rec["errors"] == errors and rec["failing"] == ""  # followed: no pass fails any more
            assert "tlx: no such interface" in rec["last_error"]  # the last failure, kept
        assert tc_dump(h1, "eth0") == before["eth0"]
        assert "7a1:" not in tc_dump(h1, "tlx")  # the new device's own (default) root back
    finally:
        for host in (h1, h2):
            host.run(["ip", "link", "del", "tlx"], check=False)
            host.run(["ip", "link", "del", "tly"], check=False)


def test_an_interface_absent_at_start_is_taken_over_when_it_appears(tb):
    """The one configured interface is not there yet at start (a NIC or bond still coming up at boot): the agent
    starts holding no device, says which is absent (``status``, every pass failing by name), and takes the
    interface over once it appears; deleted again and the agent stopped, its nftables table goes too. Before, the
    start was refused (exit 2), and an agent that held no device at its stop left its table behind."""
    h1 = tb.host(1)
    extra = {"interfaces": ["tlw"], "reconcile_interval_s": 0.3, **TRUST}
    tables = nft_tables(h1)
    try:
        with running_agents(tb, hosts=[1], backend="htb", config_extra=extra) as agents:
            def state(present: bool):
                st = agents[1].status()
                failing = "tlw: no such interface" in st["reconcile"]["failing"]
                return st if st["interfaces"][0]["present"] is present and failing is not present else None

            st = wait_for("tlw absent, the pass failing by name", lambda: state(False))
            assert st["devices"] == [] and "tensorlane" in nft_tables(h1)
            out = h1.run([sys.executable, "-m", "tensorlane", "verify", "--socket", agents[1].socket, "--seconds",
                          "0.5"], check=False)  # nothing to capture on: said so, not a capture error
            assert out.returncode == 1 and "no managed interface is here" in out.stderr, out
            h1.run(["ip", "link", "add", "tlw", "type", "veth", "peer", "name", "tlwp"])
            st = wait_for("tlw taken over once it appears", lambda: "qdisc htb 7a1: root" in tc_dump(h1, "tlw")
                          and state(True))
            assert [d["device"] for d in st["devices"]] == ["tlw"] and st["reconcile"]["failing"] == ""
            h1.run(["ip", "link", "del", "tlw"])
            wait_for("tlw absent again", lambda: state(False))
        assert nft_tables(h1) == tables  # stopped holding no device: its table gone all the same
    finally:
        h1.run(["ip", "link", "del", "tlw"], check=False)


def test_a_rule_replaced_in_place_and_a_foreign_filter_are_repaired(tb):
    """A rule of the agent's table replaced by another (the count of rules unchanged) and tc filters attached to the
    agent's qdisc and parent class: the next pass puts the rule back and removes the filters. Before, neither was
    seen: the count of rules matched, and filters were never looked at."""
    h1, h2 = tb.host(1), tb.host(2)
    with running_agents(tb, levels=2, hosts=[1], backend="htb",
                        config_extra={"reconcile_interval_s": 0.3, **TRUST}) as agents:
        with agents[1].client() as agent:
            agent.register("job-p", 0, [flow(h1, 9721, h2, 9720)])
        rules = json.loads(h1.run(["nft", "-j", "list", "chain", "inet", "tensorlane", "level0"]).stdout)
        first = next(i["rule"] for i in rules["nftables"] if "rule" in i)
        h1.run(["nft", "replace", "rule", "inet", "tensorlane", "level0", "handle", str(first["handle"]),
                "meta", "nfproto", "ipv4", "ip", "dscp", "set", "cs1", "accept"])  # demoted: DSCP 8, no class
        for parent in ("7a1:", "7a1:1"):
            h1.run(["tc", "filter", "add", "dev", "eth0", "parent", parent, "protocol", "ip", "prio", "5", "u32",
                    "match", "ip", "dst", h2.ip + "/32", "flowid", "7a1:11"])

        def repaired():
            chain = h1.run(["nft", "list", "chain", "inet", "tensorlane", "level0"]).stdout
            filters = "".join(h1.run(["tc", "filter", "show", "dev", "eth0", "parent", p]).stdout
                              for p in ("7a1:", "7a1:1"))
            return "cs1" not in chain and "ip dscp set ef" in chain and not filters.strip()

        wait_for("the rule put back and the filters removed", repaired)
        st = agents[1].status()
        assert st["reconcile"]["errors"] == 0 and st["reconcile"]["repairs"] >= 3, st["reconcile"]
        got = udp_exchange(h1, h2, 9721, 9720, seconds=0.5)
        assert set(got["dscp"]) == {"46"}, got  # the flow leaves marked as its level again


def test_a_killed_agents_marks_are_kept_while_the_jobs_register_again(tb, tmp_path):
    """SIGKILL with flows registered: the next agent keeps the marks it finds for ``INHERIT_S`` (the shims register
    again within 2 s), a flow registered meanwhile replaces its old mark, and the marks nobody registers again go at
    the first pass after that. Before, the new agent's first pass dropped them all: every flow unmarked until its
    shim registered again (0.35-1.7 s measured)."""
    from tensorlane.agent.reconcile import INHERIT_S

    h1, h2 = tb.host(1), tb.host(2)
    extra = {"reconcile_interval_s": 0.5, **TRUST}

    def marks() -> str:
        return h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout

    with pytest.raises(AgentStartError, match="exited with -9"):
        with running_agents(tb, hosts=[1], backend="htb", workdir=str(tmp_path), config_extra=extra) as agents:
            with agents[1].client() as agent:
                agent.register("job-k", 0, [flow(h1, 9731, h2, 9730), flow(h1, 9732, h2, 9730)])
            agents[1].proc.kill()
            agents[1].proc.wait(5)
    with running_agents(tb, hosts=[1], backend="htb", config_extra=extra) as agents:
        started = time.monotonic()
        assert "9731" in marks() and "9732" in marks()  # kept, though this agent has no flows yet
        with agents[1].client() as agent:
            agent.register("job-k", 1, [flow(h1, 9731, h2, 9730)])  # registered again, at another level
            assert "9731 . 9730 : goto level1" in marks() and agent.status()["flows"] == 1
            time.sleep(1.0)
            assert "9732" in marks() and time.monotonic() - started < INHERIT_S  # still within the window
            wait_for("the mark nobody registered again dropped", lambda: "9732" not in marks(), INHERIT_S + 3)
            assert "9731 . 9730 : goto level1" in marks() and agent.status()["reconcile"]["errors"] == 0


def test_a_killed_agents_chains_beyond_fewer_levels_are_removed_and_its_marks_kept_at_the_last(tb, tmp_path):
    """SIGKILL with 4 levels and a flow at level 3, then an agent with 2 levels: the chains ``level2`` and
    ``level3`` (whose rules put packets in classes the new tree no longer has) are removed at start, the killed
    agent's mark kept at level 1 while its job registers again, and the pass repairs nothing after. Before
    (until 2026-11-27) they stayed in the table for the agent's life, and the mark kept sending into them."""
    h1, h2 = tb.host(1), tb.host(2)
    extra = {"reconcile_interval_s": 0.5, **TRUST}

    def table() -> str:
        return h1.run(["nft", "list", "table", "inet", "tensorlane"]).stdout

    with pytest.raises(AgentStartError, match="exited with -9"):
        with running_agents(tb, levels=4, hosts=[1], backend="htb", workdir=str(tmp_path),
                            config_extra=extra) as agents:
            with agents[1].client() as agent:
                agent.register("job-f", 3, [flow(h1, 9741, h2, 9740)])
            assert "chain level3" in table()
            agents[1].proc.kill()
            agents[1].proc.wait(5)
    with running_agents(tb, levels=2, hosts=[1], backend="htb", config_extra=extra) as agents:
        listed = table()
        assert "chain level1" in listed and "chain level2" not in listed and "chain level3" not in listed, listed
        assert "9741 . 9740 : goto level1" in listed
        with agents[1].client() as agent:
            agent.register("job-f", 0, [flow(h1, 9741, h2, 9740)])
            assert "9741 . 9740 : goto level0" in table()
            time.sleep(1.2)  # two passes
            st = agent.status()
            assert st["reconcile"]["errors"] == 0 and st["reconcile"]["repairs"] == 0, st["reconcile"]
    assert "tensorlane" not in nft_tables(h1)


HOLDER = """
import socket, sys
from tensorlane.client import AgentClient
path, src, sport, dst, dport, level, named = sys.argv[1:]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((src, int(sport)))
s.connect((dst, int(dport)))
flow = {"proto": "udp", "src": src, "sport": int(sport), "dst": dst, "dport": int(dport)}
with AgentClient(path) as agent:
    agent.register("job-h", int(level), [flow], fds=[s.fileno()] if named == "1" else None)
print("registered", flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        s.close()
        print("closed", flush=True)
"""


def test_a_hand_over_passes_the_flow_table_to_the_next_agent(tb, tmp_path):
    """SIGUSR2 (the hand-over stop of a planned restart) with four flows registered once by their own processes,
    as ``AgentClient`` users do (no shim registering again): the next agent takes back the two whose owners still
    hold their sockets, at their levels, and keeps their marks past ``INHERIT_S``; the flow whose socket was closed
    while no agent ran and the one whose process exited are not taken back, and their marks go at the first pass
    (not after ``INHERIT_S``). Until 2026-11-28 the next agent kept
    every mark for ``INHERIT_S`` and no flow: all four lost their levels 5 s after the restart, and the job's
    reported step bytes were gone until its shims' next report."""
    from tensorlane.agent.handover import FLOWS_FILE
    from tensorlane.agent.reconcile import INHERIT_S

    h1, h2 = tb.host(1), tb.host(2)
    extra = {"reconcile_interval_s": 0.5, "job_policy": "shortest"}

    def marks() -> str:  # (the holders' UDP flows, their sockets root's: in uflows4, keyed by the socket's user)
        return "".join(h1.run(["nft", "list", "map", "inet", "tensorlane", m]).stdout for m in ("flows4", "uflows4"))

    holders = []
    try:
        with running_agents(tb, hosts=[1], backend="htb", workdir=str(tmp_path), config_extra=extra) as agents:
            state_dir = os.path.dirname(agents[1].socket)
            for sport, level, named in ((9841, 1, "1"), (9842, 2, "0"), (9843, 1, "1"), (9844, 1, "0")):
                p = h1.popen([sys.executable, "-c", HOLDER, agents[1].socket, h1.ip, str(sport), h2.ip, "9840",
                              str(level), named], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                holders.append(p)
                assert p.stdout.readline().strip() == "registered"
            assert agents[1].status()["flows"] == 4
            with agents[1].client() as agent:  # the job's step bytes, as its shims report them (shortest's input)
                agent.request("report", job="job-h", session="s1", step_bytes=4096,
                              levels=[{"level": 1, "allreduces": 1, "bytes": 4096, "comm_s": 0.01}])
            assert agents[1].status()["job_policy"]["step_bytes"] == {"job-h": 4096}
            agents[1].proc.send_signal(signal.SIGUSR2)
            assert agents[1].proc.wait(10) == 0
            assert f"4 flows in {state_dir}/{FLOWS_FILE}" in agents[1].stderr_tail(), agents[1].stderr_tail()
        holders[2].stdin.write("close\n")  # while no agent runs: its socket closed, its process alive
        holders[2].stdin.flush()
        assert holders[2].stdout.readline().strip() == "closed"
        holders[3].kill()  # and an owner that exited
        holders[3].wait(5)
        with running_agents(tb, hosts=[1], backend="htb", config_extra=extra) as agents:
            started = time.monotonic()
            with agents[1].client() as agent:
                got = {f["sport"]: f["requested_level"] for f in agent.list()["flows"]}
            assert got == {9841: 1, 9842: 2}, got
            assert agents[1].status()["job_policy"]["step_bytes"] == {"job-h": 4096}  # no report since: carried
            log = agents[1].stderr_tail()
            assert "took back 2 of the 4 flows" in log and "1 not_owner" in log and "1 owner_gone" in log, log
            assert not os.path.exists(f"{state_dir}/{FLOWS_FILE}")  # read once
            # the marks of the flows not taken back go at the first pass, not after INHERIT_S (another user's
            # connection with such a 5-tuple would have had its level meanwhile)
            wait_for("the marks not taken back dropped", lambda: "9843" not in (m := marks()) and "9844" not in m, 3)
            assert time.monotonic() - started < INHERIT_S - 1
            time.sleep(max(0.0, INHERIT_S + 1.5 - (time.monotonic() - started)))  # past the kept marks' window
            m = marks()
            assert "9841 . 9840 : goto level1" in m and "9842 . 9840 : goto level2" in m, m
            assert "9843" not in m and "9844" not in m, m
            holders[0].kill()  # an owner exiting now loses its flow at once (watched), as at any register
            holders[0].wait(5)
            wait_for("the exited owner's flow dropped", lambda: agents[1].status()["flows"] == 1, 5)
    finally:
        for p in holders:
            p.kill()
            p.wait(5)


def test_a_killed_agents_flow_table_is_taken_back_by_the_next_agent(tb, tmp_path):
    """SIGKILL (a crash) with three flows registered once by their own processes, as ``AgentClient`` users do (no
    shim registering again): the next agent takes back, from the file the killed agent kept (``flows.json``), the
    two whose owners still hold their sockets, at their levels, and their marks stay past ``INHERIT_S`` with no
    register from their clients; the flow whose socket was closed while no agent ran is not taken back and its mark
    goes after ``INHERIT_S``. Until 2026-11-28 a crash lost the flow table: all three lost their levels 5 s after
    the next agent started."""
    from tensorlane.agent.handover import CRASH_FILE
    from tensorlane.agent.reconcile import INHERIT_S

    h1, h2 = tb.host(1), tb.host(2)
    extra = {"reconcile_interval_s": 0.5}

    def marks() -> str:
        return "".join(h1.run(["nft", "list", "map", "inet", "tensorlane", m]).stdout for m in ("flows4", "uflows4"))

    holders = []
    try:
        with pytest.raises(AgentStartError, match="exited with -9"):
            with running_agents(tb, hosts=[1], backend="htb", workdir=str(tmp_path), config_extra=extra) as agents:
                state_dir = os.path.dirname(agents[1].socket)
                for sport, level, named in ((9851, 1, "1"), (9852, 2, "0"), (9853, 1, "1")):
                    p = h1.popen([sys.executable, "-c", HOLDER, agents[1].socket, h1.ip, str(sport), h2.ip, "9850",
                                  str(level), named], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    holders.append(p)
                    assert p.stdout.readline().strip() == "registered"
                assert agents[1].status()["flows"] == 3
                wait_for("the flow table written", lambda: len(_flows_in(f"{state_dir}/{CRASH_FILE}")) == 3, 3)
                agents[1].proc.kill()
                agents[1].proc.wait(5)
        holders[2].stdin.write("close\n")  # while no agent runs: its socket closed, its process alive
        holders[2].stdin.flush()
        assert holders[2].stdout.readline().strip() == "closed"
        with running_agents(tb, hosts=[1], backend="htb", config_extra=extra) as agents:
            started = time.monotonic()
            with agents[1].client() as agent:
                got = {f["sport"]: f["requested_level"] for f in agent.list()["flows"]}
            assert got == {9851: 1, 9852: 2}, got
            log = agents[1].stderr_tail()
            assert "took back 2 of the 3 flows the killed agent kept" in log and "1 not_owner" in log, log
            time.sleep(max(0.0, INHERIT_S + 1.5 - (time.monotonic() - started)))  # past the kept marks' window
            m = marks()
            assert "9851 . 9850 : goto level1" in m and "9852 . 9850 : goto level2" in m, m
            assert "9853" not in m, m
            assert agents[1].status()["flows"] == 2
            state_dir = os.path.dirname(agents[1].socket)
            wait_for("the table written again", lambda: len(_flows_in(f"{state_dir}/{CRASH_FILE}")) == 2, 3)
        assert not os.path.exists(f"{state_dir}/{CRASH_FILE}")  # a SIGTERM stop: the marks gone, and the file
    finally:
        for p in holders:
            p.kill()
            p.wait(5)


def _flows_in(path: str) -> list:
    """The flows of a flow table file (none: no file yet)."""
    try:
        with open(path) as fh:
            return json.load(fh)["flows"]
    except (OSError, ValueError):
        return []


def test_another_users_socket_on_the_metrics_port_after_a_hand_over_does_not_keep_the_agent_down(tmp_path):
    """A hand-over restart (SIGUSR2) leaves the devices taken over and the flow marks for the next agent; in the gap
    a local user (nobody) binds and listens on the metrics port (9477: any user may). The next agent starts all the
    same, adopting the tree, without its metrics, says why in ``status`` (``reconcile.failing``) and serves /healthz
    at the first pass after the user let the port go. Before, that agent refused to start (``cannot listen on
    metrics_address``) for as long as the user held the port: no agent, the marks left as they were."""
    import signal

    with Testbed(hosts=1, rate="100mbit", name="h14h") as bed:
        h1 = bed.host(1)
        extra = {"reconcile_interval_s": 0.5, "metrics_address": "127.0.0.1:9477"}
        with running_agents(bed, hosts=[1], backend="htb", config_extra=extra, workdir=str(tmp_path / "a")) as ags:
            ags[1].proc.send_signal(signal.SIGUSR2)
            assert ags[1].proc.wait(timeout=15) == 0
        assert "qdisc htb 7a1: root" in tc_dump(h1)  # handed over: left for the next agent
        code = ("import os, socket, sys, time\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                "s = socket.socket(); s.bind(('127.0.0.1', 9477)); s.listen(); print('held', flush=True)\n"
                "sys.stdin.readline()")
        squatter = h1.popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert squatter.stdout.readline().strip() == "held"
            with running_agents(bed, hosts=[1], backend="htb", config_extra=extra,
                                workdir=str(tmp_path / "b")) as ags:
                status = wait_for("the port's holder in status", lambda: (
                    s if "9477" in (s := ags[1].status()["reconcile"])["failing"] else None), 5)
                assert "held by uid 65534" in status["failing"] and status["last_error"] == status["failing"], status
                assert "qdisc htb 7a1: root" in tc_dump(h1)
                squatter.stdin.close()
                assert squatter.wait(timeout=10) == 0
                probe = ("import urllib.request, sys\n"
                         "print(urllib.request.urlopen('http://127.0.0.1:9477/healthz', timeout=2).status)")
                wait_for("/healthz served", lambda: h1.run([sys.executable, "-c", probe], check=False,
                                                           timeout=10).stdout.strip() == "200", 10)
                assert "free again" in ags[1].stderr_tail()
        finally:
            if squatter.poll() is None:
                squatter.kill()
                squatter.wait()
