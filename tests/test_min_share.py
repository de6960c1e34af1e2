"""A lower class keeps its guaranteed share (``min_share``) while a higher one saturates the link: its TCP flow
stays ACK-clocked and never sits in a retransmission timeout; with ``min_share = 0`` (strict priority) it gets
only what the higher class leaves. Under a job order, ``job_share`` guarantees each job its part of the link,
changing the classes' rates in place as jobs come and go.
A UDP flood at level 0 and a real iperf3 TCP stream at level 2 on a namespace testbed, through a real agent."""
from __future__ import annotations

import json
import pwd
import subprocess
import sys
import time

import pytest
from agent_clients import udpprobe, wait_for

from bench.agents import running_agents
from bench.jobs import tcp_counters
from tensorlane.units import parse_rate
from testbed import Testbed

pytestmark = pytest.mark.netns
TRUST = {"trusted_users": ["root"]}
PY = [sys.executable, "-m"]
SECONDS = 5


def contend(tb, agent, tcp_level: int = 2) -> dict:
    """A UDP flood above the link rate at level 0 (job "flood") and an iperf3 TCP stream at ``tcp_level`` (job
    "tcp"), from host 1 to host 2 for SECONDS at once: the TCP stream's bits/s and host 1's retransmission timeouts
    meanwhile."""
    h1, h2 = tb.host(1), tb.host(2)
    with agent.client() as c:
        c.register("flood", 0, [{"proto": "udp", "src": h1.ip, "sport": 43100, "dst": h2.ip, "dport": 43200}])
        c.register("tcp", tcp_level, [{"proto": "tcp", "src": h1.ip, "sport": 43101, "dst": h2.ip, "dport": 5302}])
    server = h2.popen(["iperf3", "-s", "-1", "-p", "5302"], stdout=subprocess.DEVNULL)
    flood = h1.popen(PY + ["testbed.udpprobe", "send", "--dst", h2.ip, "--port", "43200", "--sport", "43100",
                           "--pps", str(int(1.2 * tb.rate_bps / 8 / 1000)), "--seconds", str(SECONDS + 2)],
                     stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # the flood fills the level-0 queue first
        rto0 = tcp_counters(h1)["TCPTimeouts"]
        tcp = h1.run(["iperf3", "-c", h2.ip, "-p", "5302", "--cport", "43101", "-t", str(SECONDS), "-J"],
                     timeout=SECONDS + 30)
        rto = tcp_counters(h1)["TCPTimeouts"] - rto0
    finally:
        for p in (flood, server):
            if p.poll() is None:
                p.kill()
            p.wait(5)
    return {"low_bps": json.loads(tcp.stdout)["end"]["sum_received"]["bits_per_second"], "rto": rto}


@pytest.fixture(scope="module")
def tb():
    with Testbed(hosts=2, rate="100mbit", name="tms") as bed:
        yield bed


def switch_port(tb, i: int) -> tuple[int, int]:
    """The switch port to host ``i``: ``(packets sent, overlimits)`` of its HTB root (overlimits: the times it held a
    packet back for its rate, i.e. a queue formed there)."""
    out = subprocess.run(["tc", "-n", tb.switch_ns, "-s", "qdisc", "show", "dev", f"p{i}"], capture_output=True,
                         text=True, check=True).stdout.split("\n")
    words = out[next(i for i, ln in enumerate(out) if ln.startswith("qdisc htb 1: root")) + 1].split()
    return int(words[words.index("bytes") + 1]), int(words[words.index("overlimits") + 1].rstrip(","))


def test_a_lower_class_keeps_its_share_and_never_times_out(tb):
    """The agent shapes at 95 % of the link (``link_rate``), so that its classes are the only queue on the path, as
    they are behind a real NIC. At the link's own rate the veth sends the HTB's bursts on at once, and the switch
    port (same rate, strict priority by DSCP, 0.1 % for its lower queues) held packets back for its rate 7,700-48,500
    times in a run of 66,000-70,000 packets here (0-1,600 at 95 %, under 2.5 %): the stream's packets could wait there
    behind the flood, past the agent's guarantee. So it failed once, in a quiet run, with 0.83 Mbit/s and one timeout
    (2026-11-29; 0 in 80 runs since at that rate); with the agent at 101 % of the port, 3 runs of 6 fell to 0.1
    Mbit/s, each with a timeout of this stream (its connection in the Loss state, tcp tracepoints)."""
    rate = int(0.95 * tb.rate_bps)
    sent0, over0 = switch_port(tb, 2)
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra={**TRUST, "link_rate": rate}) as agents:
        assert agents[1].status()["min_share"] == 0.01
        got = contend(tb, agents[1])
    sent, over = (a - b for a, b in zip(switch_port(tb, 2), (sent0, over0), strict=True))
    print(got, {"switch_sent": sent, "switch_overlimits": over})
    assert over <= 0.05 * sent, (sent, over)  # no queue past the host: what follows is the agent's doing
    assert got["rto"] == 0, got
    assert got["low_bps"] >= 0.5 * 0.01 * rate, got  # at least half its 1 % guarantee, over the whole run


def test_strict_priority_gives_the_lower_class_only_leftovers(tb):
    """Measured for comparison (printed with -s): the lower class gets what the flood leaves and its guarantee of
    link/1000; the retransmission timeouts of strict priority show in the jobs benchmark (results/jobs.json)."""
    with running_agents(tb, levels=3, hosts=[1], backend="htb", config_extra={**TRUST, "min_share": 0}) as agents:
        assert agents[1].status()["min_share"] == 0.0
        got = contend(tb, agents[1])
    print(got)
    assert got["low_bps"] < 0.05 * tb.rate_bps, got  # the flood keeps the link


def class_rates(host) -> dict[str, int]:
    """``{class handle: guaranteed rate in bits/s}`` of host's eth0, as the kernel holds them."""
    rates = {}  # tc prints "class htb 7a1:10 parent 7a1:1 leaf 100: prio 0 rate 25Mbit ceil ..." (no JSON for htb)
    for line in host.run(["tc", "class", "show", "dev", "eth0"]).stdout.splitlines():
        words = line.split()
        if words[:2] == ["class", "htb"] and "rate" in words:
            rates[words[2]] = parse_rate(words[words.index("rate") + 1])
    return rates


def contend_looking(tb, agent, at_s: float) -> tuple[dict, dict]:
    """:func:`contend` with the "tcp" job's stream at level 0, and ``at_s`` seconds after it starts the kernel's class
    rates and the agent's ``status.job_policy`` (``seen``: ``rates``, ``status``)."""
    import threading

    seen: dict = {}

    def look() -> None:
        seen["rates"], seen["status"] = class_rates(tb.host(1)), agent.status()["job_policy"]

    probe = threading.Timer(at_s, look)
    probe.start()
    try:
        got = contend(tb, agent, tcp_level=0)
    finally:
        probe.cancel()
        probe.join(10)
    return got, seen


def test_a_job_order_leaves_every_job_its_part_of_job_share(tb):
    """Job "flood" before job "tcp" (static), ``job_share = 0.5``: each job is guaranteed 25 % of the link on its
    band's first level (levels 0 and 2 of 4), so the lower job's TCP stream keeps most of a quarter of the link
    against a flood above the link rate, where ``min_share`` alone gave it 1 % (above). The classes change in place:
    the qdisc tree is the same one, and when the flood's job leaves, level 2 is back at ``min_share``.
    The agent shapes at 95 % of the link so that its classes are the only queue on the path: a veth has no line rate
    to cap the HTB's bursts, and at the link's own rate the stream once fell to 1.5 Mbit/s with a timeout in a
    full-suite run (likely at the switch port, whose strict priority serves the flood first; not confirmed)."""
    h1 = tb.host(1)
    rate = int(0.95 * tb.rate_bps)
    cfg = {**TRUST, "job_policy": "static", "job_priority": {"flood": 0, "tcp": 1}, "job_share": 0.5,
           "link_rate": rate}
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        tree = h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        before = class_rates(h1)
        got = contend(tb, agents[1], tcp_level=0)
        during = class_rates(h1)
        st = agents[1].status()
        with agents[1].client() as c:
            c.unregister("flood")
        after = class_rates(h1)
        assert h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout == tree
    print(got, during)
    quarter = 0.25 * rate
    floor = max(0.01 * rate, st["min_rate_bps"])  # min_share, raised to min_rate (within the free half)
    assert st["job_policy"]["level_shares"] == {"0": 0.25, "2": 0.25}
    assert before["7a1:10"] == before["7a1:12"] == after["7a1:12"] == pytest.approx(floor, rel=0.02)
    assert during["7a1:10"] == during["7a1:12"] == pytest.approx(quarter, rel=0.02)
    assert during["7a1:11"] == during["7a1:13"] == during["7a1:14"] == pytest.approx(floor, rel=0.02)
    # TCP in a 1000-packet queue drained at 25 Mbit/s (0.5 s deep) ramps unevenly: 14-24 Mbit/s over 5 s in 8 runs
    # here, once with a timeout (the no-timeout guarantee is min_share's, tested above); 1 Mbit/s without the part.
    assert got["low_bps"] >= 0.4 * quarter, got


@pytest.mark.parametrize("among", ["sending", "present"])
def test_the_parts_follow_the_jobs_that_are_sending(tb, among):
    """Three jobs in a static order, ``job_share = 0.6``: "flood" (level 0), "idle" (level 1, registered, sends
    nothing) and "tcp" (levels 2-3). With ``job_share_among = "sending"`` the agent's samples find the flood's and
    the stream's classes backlogged, and each of the two gets 0.3 of the link (FIFO would give each about half),
    while the idle job keeps its 0.2; when they stop, every job is back at 0.2. With ``"present"`` each keeps 0.2
    throughout (the parts of the three jobs present). The agent shapes at 95 % of the link, as above: at the link's
    own rate the stream fell to 1.5 Mbit/s in 2 of 28 runs here (and in a full-suite run), its classes' rates as
    asserted, the queue past the host."""
    h1, h2 = tb.host(1), tb.host(2)
    rate = int(0.95 * tb.rate_bps)
    cfg = {**TRUST, "job_policy": "static", "job_priority": {"flood": 0, "idle": 1, "tcp": 2}, "job_share": 0.6,
           "job_share_among": among, "link_rate": rate}
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        with agents[1].client() as c:
            c.register("idle", 0, [{"proto": "udp", "src": h1.ip, "sport": 43102, "dst": h2.ip, "dport": 43202}])
        got, seen = contend_looking(tb, agents[1], 1.0 + SECONDS / 2)  # in the middle of the stream

        def back_idle():  # contend() killed the flood: at the next samples (every 0.05 s) no job counts as sending
            after, st = class_rates(h1), agents[1].status()["job_policy"]
            done = st["sending"] == [] and len({after.get(f"7a1:1{i}") for i in range(3)}) == 1
            return (after, st) if done else None

        after, st = wait_for("no job counted as sending after the flood", back_idle, 10)
    print(among, got, seen)
    idle = 0.2 * rate
    busy = 0.3 * rate if among == "sending" else idle
    assert seen["status"]["sending"] == (["flood", "tcp"] if among == "sending" else []), seen
    assert seen["rates"]["7a1:10"] == seen["rates"]["7a1:12"] == pytest.approx(busy, rel=0.02), seen
    assert seen["rates"]["7a1:11"] == pytest.approx(idle, rel=0.02), seen
    assert st["sending"] == [] and st["level_shares"] == pytest.approx({"0": 0.2, "1": 0.2, "2": 0.2}), st
    assert after["7a1:10"] == after["7a1:11"] == after["7a1:12"] == pytest.approx(idle, rel=0.02), after
    assert (st["share_changes"] >= 2) == (among == "sending"), st
    assert got["low_bps"] >= 0.4 * busy, got


def test_a_job_between_its_idle_and_sending_part_keeps_its_rate(tb):
    """Three jobs in a static order, ``job_share = 0.6`` (parts of 0.2 each, 0.3 for each of two sending): "flood"
    sends above the link rate, "paced" a steady 25 Mbit/s, more than an idle job's part (20) and less than a sending
    one's (30), "idle" nothing. Counted as sending, the paced job's class holds no queue, so the next sample drops
    it; at its idle part it queues up and the sample after counts it again: its count flips with the samples (68
    changes of the parts in 5 s here). That costs netlink requests, bounded by the samples, and not the job's
    rate: its queue holds what the idle part leaves for one sample, and its sending part drains it. (An agent that
    also counted a job by the bytes its band carried kept the parts put, 2 changes, but cost stagger4's last job 6
    points of its JCT: docs/jobs.md, "How quickly the parts follow".)"""
    h1, h2 = tb.host(1), tb.host(2)
    cfg = {**TRUST, "job_policy": "static", "job_priority": {"flood": 0, "idle": 1, "paced": 2}, "job_share": 0.6}
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        with agents[1].client() as c:
            c.register("flood", 0, [{"proto": "udp", "src": h1.ip, "sport": 43110, "dst": h2.ip, "dport": 43210}])
            c.register("idle", 0, [{"proto": "udp", "src": h1.ip, "sport": 43111, "dst": h2.ip, "dport": 43211}])
            c.register("paced", 0, [{"proto": "udp", "src": h1.ip, "sport": 43112, "dst": h2.ip, "dport": 43212}])
        recv = h2.popen(PY + ["testbed.udpprobe", "recv", "--port", "43212", "--seconds", str(SECONDS + 3)],
                        stdout=subprocess.PIPE, text=True)
        senders = [h1.popen(PY + ["testbed.udpprobe", "send", "--dst", h2.ip, "--port", str(port), "--sport",
                                  str(sport), "--pps", str(int(mbit * 1e6 / 8 / 1000)), "--seconds", str(SECONDS)],
                            stdout=subprocess.DEVNULL)
                   for port, sport, mbit in ((43210, 43110, 120), (43212, 43112, 25))]
        try:
            time.sleep(SECONDS / 2)
            mid = agents[1].status()["job_policy"]
            for p in senders:
                p.wait(SECONDS + 10)
            out, _ = recv.communicate(timeout=20)
        finally:
            for p in (*senders, recv):
                if p.poll() is None:
                    p.kill()
                p.wait(5)
        time.sleep(0.5)
        st = agents[1].status()["job_policy"]
    got = json.loads(out)
    print(mid, st, {k: v for k, v in got.items() if k != "timeline"})
    assert "flood" in mid["sending"] and "idle" not in mid["sending"], mid
    assert st["sending"] == [] and st["level_shares"] == pytest.approx({"0": 0.2, "1": 0.2, "2": 0.2}), st
    assert st["share_changes"] <= (SECONDS + 3) / st["job_sample_s"], st  # at most one change per sample
    assert got["packets"] * 1000 * 8 / SECONDS >= 0.9 * 25e6, got  # datagrams of 1000 bytes


def test_job_share_auto_gives_large_parts_while_the_jobs_saturate_the_link(tb):
    """Job "flood" before job "tcp" (static), ``job_share = "auto"``: with the link idle the parts are small
    (AUTO_SHARES[0], 0.1 each); once the flood has kept the link busy for a window of samples the agent finds it
    saturated and gives each job AUTO_SHARES[1] / 2, so the lower job's TCP stream gets about FIFO's half instead of
    its small part; after the traffic ends the link idles and the parts are small again. Link rate as above."""
    from tensorlane.policies.jobs import AUTO_SHARES, AUTO_WINDOW_S

    h1 = tb.host(1)
    rate = int(0.95 * tb.rate_bps)
    cfg = {**TRUST, "job_policy": "static", "job_priority": {"flood": 0, "tcp": 1}, "job_share": "auto",
           "link_rate": rate}
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        got, seen = contend_looking(tb, agents[1], 1.0 + SECONDS - 1)  # late in the stream
        deadline = time.monotonic() + 3 * AUTO_WINDOW_S + 2  # the flood ends 1 s after the stream, then idle
        while time.monotonic() < deadline and agents[1].status()["job_policy"]["saturated"]:
            time.sleep(0.2)
        after, st = class_rates(h1), agents[1].status()["job_policy"]
    print(got, seen, st)
    small, large = AUTO_SHARES[0] / 2 * rate, AUTO_SHARES[1] / 2 * rate
    assert seen["status"]["saturated"] and seen["status"]["link_busy"] >= 0.95, seen
    assert seen["rates"]["7a1:10"] == seen["rates"]["7a1:12"] == pytest.approx(large, rel=0.02), seen
    assert not st["saturated"] and st["saturation_changes"] == 2 and st["saturated_s"] > 2, st
    assert after["7a1:10"] == after["7a1:12"] == pytest.approx(small, rel=0.02), after
    # the stream's first second or so ran at the small part, before a window of samples found the link saturated
    assert got["low_bps"] >= 0.3 * large, got


def register_as(user: str, path: str, jobs: dict[str, dict]) -> None:
    """Register ``jobs`` (``{job: flow}``, level 0 each) through the agent's socket ``path`` as ``user``, from a
    forked child that takes that user's uid (the agent knows its clients by their socket's credentials)."""
    import os
    import pwd

    from tensorlane.client import AgentClient

    pid = os.fork()
    if pid == 0:  # child: no pytest machinery from here on
        code = 1
        try:
            pw = pwd.getpwnam(user)
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            with AgentClient(path, timeout=5.0) as c:
                for job, spec in jobs.items():
                    c.register(job, 0, [spec])
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"{user} could not register {sorted(jobs)}"


def test_one_users_many_jobs_leave_another_users_job_its_part(tb):
    """With no ``level_limits`` every user is in root's tier. User nobody starts three jobs that each flood UDP (45
    Mbit/s each, above the link together) ahead of user bin's one job, an iperf3 stream (static order, ``job_share =
    0.6``, the parts of the jobs sending). Nobody's jobs share one part, so bin's job keeps half of ``job_share``
    (0.3 of the link) and nobody's three 0.1 each; before 2026-11-28 each job took a part, and bin's fell to 0.15
    (four parts). Nobody's jobs also weigh one job in the bands' cut (since 2026-11-28): they take levels 0-1 (a2 and
    a3 share level 1's class, which counts once among the jobs sending: parts 0.12, 0.2 and 0.36 for bin's, scaled
    to ``job_share``) and bin's job levels 2-3: bin's class is level 2's, with 0.318 of the link (before, each job
    had a level of its own and bin's was level 3, with 0.3). The order is the same either way: only the levels and
    the classes' guarantees differ. Link rate as above. ``job_hold_s = 0.5``: a1 alone on the top level sends all it
    offers, so its class holds a queue only now and then, and one sample taken when it held none took a1 out of
    ``sending`` just as the test looked (make test, 2026-11-29); held, the parts stay those of all four jobs. The floods
    run as nobody, whose flows they are: since 2026-11-29 a flow a user registers unchecked (``check_ownership =
    false``) gives only that user's sockets' datagrams its level, and root's floods went to the default class."""
    h1, h2 = tb.host(1), tb.host(2)
    rate = int(0.95 * tb.rate_bps)
    a_jobs = ("a1", "a2", "a3")
    cfg = {**TRUST, "job_policy": "static", "job_priority": {"a1": 0, "a2": 1, "a3": 2, "b": 3}, "job_share": 0.6,
           "link_rate": rate, "socket_mode": "0666", "allowed_users": ["nobody", "bin"], "check_ownership": False,
           "job_hold_s": 0.5}
    seconds = 4
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        agent = agents[1]
        register_as("nobody", agent.socket, {job: {"proto": "udp", "src": h1.ip, "sport": 43130 + i, "dst": h2.ip,
                                                   "dport": 43230 + i} for i, job in enumerate(a_jobs)})
        register_as("bin", agent.socket, {"b": {"proto": "tcp", "src": h1.ip, "sport": 43139, "dst": h2.ip,
                                                "dport": 5303}})
        server = h2.popen(["iperf3", "-s", "-1", "-p", "5303"], stdout=subprocess.DEVNULL)
        nobody = pwd.getpwnam("nobody").pw_uid  # (nobody's flows: its sockets' datagrams alone get their levels)
        floods = [h1.popen(udpprobe(["send", "--dst", h2.ip, "--port", str(43230 + i), "--sport", str(43130 + i),
                                     "--pps", str(int(45e6 / 8 / 1000)), "--seconds", str(seconds + 2)], nobody),
                           stdout=subprocess.DEVNULL) for i in range(len(a_jobs))]
        try:
            time.sleep(1.0)  # the floods fill their queues first
            stream = h1.popen(["iperf3", "-c", h2.ip, "-p", "5303", "--cport", "43139", "-t", str(seconds), "-J"],
                              stdout=subprocess.PIPE, text=True)
            time.sleep(seconds / 2)
            rates, st = class_rates(h1), agent.status()["job_policy"]
            out, _ = stream.communicate(timeout=seconds + 30)
        finally:
            for p in (*floods, server):
                if p.poll() is None:
                    p.kill()
                p.wait(5)
    b_bps = json.loads(out)["end"]["sum_received"]["bits_per_second"]
    print({"b_bps": b_bps, "rates": rates, "level_shares": st["level_shares"], "sending": st["sending"]})
    assert st["order"] == ["a1", "a2", "a3", "b"] and st["sending"] == ["a1", "a2", "a3", "b"], st
    assert {j: (b["first_level"], b["levels"]) for j, b in st["bands"].items()} == {
        "a1": (0, 1), "a2": (1, 1), "a3": (1, 1), "b": (2, 2)}, st
    assert st["level_shares"] == pytest.approx({"0": 0.6 * 0.15 / 0.85, "1": 0.6 * 0.25 / 0.85,
                                                "2": 0.6 * 0.45 / 0.85}, abs=1e-5), st
    assert rates["7a1:12"] == pytest.approx(0.6 * 0.45 / 0.85 * rate, rel=0.02), rates  # 0.318: bin's class
    assert rates["7a1:10"] == pytest.approx(0.6 * 0.15 / 0.85 * rate, rel=0.02), rates
    assert rates["7a1:11"] == pytest.approx(0.6 * 0.25 / 0.85 * rate, rel=0.02), rates  # a2 and a3 together
    assert b_bps >= 0.2 * rate, b_bps  # a third more than the whole part bin's job had before (0.15 of the link)
