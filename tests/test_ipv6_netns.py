"""IPv6 flows end to end on a real agent: a 2-host testbed with IPv6 addresses (``Testbed(ipv6=True)``,
2001:2::/64), the agent on host 1. A UDP flow registered at level 0 leaves with the level's DSCP in its traffic
class (read by the receiver, IPV6_RECVTCLASS) through the level's class, and `tensorlane verify` judges it ok; a
user's TCP connection over IPv6 is found in the kernel's tables (ownership) and queued at its level, and a flow it
does not hold is refused; SIGTERM leaves the host as it was. On IPv6-only hosts the shim's gloo connections are
registered per level and training ends as plain DDP's.

Every child is forked and reaped; the testbed is a context manager."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from agent_clients import dscp_receiver, request, tc_dump
from test_security_netns import NOBODY, in_child

from bench.agents import running_agents
from testbed import Testbed

pytestmark = [pytest.mark.netns, pytest.mark.concurrent]  # beside another file's (make test)
PY = [sys.executable, "-m"]
SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
for _ in range(int(sys.argv[5])):
    s.sendto(b"x" * 500, (sys.argv[3], int(sys.argv[4])))
    time.sleep(0.003)
s.sendto(b"stop", (sys.argv[3], int(sys.argv[4])))
"""
AGENT = {"trusted_users": ["root"], "socket_mode": "0666", "allowed_users": ["nobody"]}


@pytest.fixture(scope="module")
def bed():
    with Testbed(hosts=2, rate="100mbit", name="t6", ipv6=True) as tb:
        yield tb


def class_bytes(status: dict) -> dict:
    return {c["level"]: c.get("bytes", 0) for c in status["classes"] if c["level"] is not None}


def test_ipv6_flows_are_marked_queued_verified_and_owned(bed):
    h1, h2 = bed.host(1), bed.host(2)
    assert (h1.ip6, h2.ip6) == ("2001:2::1", "2001:2::2")
    before, tables = tc_dump(h1), h1.run(["nft", "list", "tables"]).stdout
    udp = {"proto": "udp", "src": h1.ip6, "sport": 41600, "dst": h2.ip6, "dport": 42600}
    with running_agents(bed, levels=2, hosts=[1], backend="htb", config_extra=AGENT) as agents:
        agent = agents[1]
        reply = in_child(lambda: request(agent.socket, {"op": "register", "job": "six", "level": 0, "flows": [udp]}),
                         netns=h1.name)[0]
        assert reply["ok"] and reply["result"]["dscp"] == 46, reply
        st0 = agent.status()
        verify = h1.popen(PY + ["tensorlane", "verify", "--socket", agent.socket, "--seconds", "3", "--json"],
                          stdout=subprocess.PIPE, text=True)
        recv = dscp_receiver(h2, "::", 42600, seconds=6)
        try:
            time.sleep(0.5)
            h1.run([sys.executable, "-c", SEND, h1.ip6, "41600", h2.ip6, "42600", "200"], timeout=20)
            seen = json.loads(recv.communicate(timeout=20)[0])
            report = json.loads(verify.communicate(timeout=20)[0])
        finally:
            for p in (verify, recv):
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
        st1 = agent.status()
        # the level's DSCP in every datagram's traffic class; its bytes in the level's class
        assert seen == {"46": 200}, seen
        sent = {lvl: b - class_bytes(st0)[lvl] for lvl, b in class_bytes(st1).items()}
        assert sent[0] >= 200 * 500 and sent[1] == 0, sent
        assert report["ok"] and [(f["src"], f["verdict"]) for f in report["flows"]] == [(h1.ip6, "ok")], report

        # a user's own TCP connection over IPv6: found by the kernel (sock_diag), queued at its level
        srv = h2.popen([sys.executable, "-c", "import socket,sys\n"
                        "s=socket.create_server(('::', 42601), family=socket.AF_INET6); s.settimeout(20)\n"
                        "c,_=s.accept(); c.settimeout(20); n=0\n"
                        "while (d:=c.recv(65536)): n+=len(d)\n"
                        "print(n)"], stdout=subprocess.PIPE, text=True)

        def nobody_sends():
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                s.bind((h1.ip6, 41601))
                deadline = time.monotonic() + 10
                while True:  # the server may not listen yet (bounded)
                    try:
                        s.connect((h2.ip6, 42601))
                        break
                    except ConnectionRefusedError:
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
                tcp = {"proto": "tcp", "src": h1.ip6, "sport": 41601, "dst": h2.ip6, "dport": 42601}
                out = {"own": request(agent.socket, {"op": "register", "job": "six-tcp", "level": 1, "flows": [tcp]}),
                       "foreign": request(agent.socket, {"op": "register", "job": "six-tcp", "level": 1,
                                                         "flows": [{**tcp, "sport": 41602}]})}
                s.sendall(b"y" * 1_000_000)
            return out

        st2 = agent.status()
        try:
            replies, pid = in_child(nobody_sends, uid=NOBODY, netns=h1.name)
            os.waitpid(pid, 0)
            received = int(srv.communicate(timeout=30)[0])
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait(5)
        st3 = agent.status()
        assert replies["own"]["ok"] and replies["own"]["result"]["level"] == 1, replies
        assert replies["foreign"]["error"]["code"] == "not_owner", replies
        assert received == 1_000_000
        sent = {lvl: b - class_bytes(st2)[lvl] for lvl, b in class_bytes(st3).items()}
        assert sent[1] >= 1_000_000, sent  # the data segments at level 1 (its pure ACKs at level 0: ack_priority)
    assert tc_dump(h1) == before and h1.run(["nft", "list", "tables"]).stdout == tables


def test_the_shim_over_ipv6_registers_each_levels_connections(tmp_path):
    """Hosts with IPv6 addresses only (gloo takes an interface's IPv4 address where it has one): the shim's gloo
    connections are IPv6, found in /proc/self/net/tcp6 and registered per level; training ends as plain DDP's."""
    import torch

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with Testbed(hosts=2, rate="200mbit", name="t6s", ipv6=True) as tb, running_agents(tb, levels=3) as agents:
        for h in tb.hosts:
            h.run(["ip", "addr", "del", f"{h.ip}/24", "dev", "eth0"])
        procs = []
        for rank, host in enumerate(tb.hosts):
            env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR=tb.host(1).ip6, MASTER_PORT="29720", GLOO_SOCKET_IFNAME="eth0",
                       TENSORLANE_JOB="shim6")
            procs.append(host.popen([sys.executable, os.path.join(repo, "tests", "shim_worker.py"), "--out",
                                     str(tmp_path), "--agent-socket", agents[host.index].socket, "--modes",
                                     "ddp,overlap", "--levels", "3", "--steps", "30", "--step-sleep", "0.05"],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            deadline, flows = time.monotonic() + 60, []
            while {f["level"] for f in flows} != {0, 1, 2} and time.monotonic() < deadline:
                time.sleep(0.2)
                with agents[1].client() as c:
                    flows = c.list(job="shim6")["flows"]
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert {f["level"] for f in flows} == {0, 1, 2}, flows
    assert {(f["src"], f["dst"]) for f in flows} == {(tb.host(1).ip6, tb.host(2).ip6)}, flows
    ref, got = torch.load(tmp_path / "ddp-0.pt"), torch.load(tmp_path / "overlap-0.pt")
    assert max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref) <= 1e-5
