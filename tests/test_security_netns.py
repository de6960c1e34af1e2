"""Hostile and careless clients against a real agent: peer credentials, level limits, ownership of flows checked
against the kernel's socket tables, flows of exited processes and closed sockets removed within 1 s, rate and
size limits, and 10,000 generated messages after which the agent is up and its state consistent."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from agent_clients import dscp_receiver, enter_netns, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.agents import running_agents
from tensorlane.agent.kernel import nft as nftables
from tensorlane.client import AgentClient
from testbed import Testbed

pytestmark = pytest.mark.netns
NOBODY = 65534


def in_child(fn, uid: int | None = None, stay: float = 0.0, netns: str | None = None):
    """Run ``fn()`` in a forked child (optionally in network namespace ``netns``, as ``uid``); return its JSON
    result and the child's pid.

    The child then lives ``stay`` seconds more (0: exits at once) and is reaped by the caller via os.waitpid.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery from here on
        try:
            os.close(r)
            if netns is not None:
                enter_netns(netns)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            out = fn()
            os.write(w, json.dumps(out).encode() + b"\n")
            time.sleep(stay)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        line = fh.readline()
    return json.loads(line), pid


def own_udp_flow(port: int):
    """A UDP socket of this process and the flow dict that describes it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", port))
    s.connect(("127.0.0.1", port + 1000))
    return s, {"proto": "udp", "src": "127.0.0.1", "sport": port, "dst": "127.0.0.1", "dport": port + 1000}


@pytest.fixture(scope="module")
def agent():
    extra = {"socket_mode": "0666", "allowed_users": ["nobody"], "level_limits": {"nobody": 2},
             "rate_limit_per_s": 100000}
    with Testbed(hosts=1, rate="100mbit", name="tx") as tb, running_agents(tb, levels=3, config_extra=extra) as ags:
        yield ags[1]


def registered(path: str) -> list[dict]:
    return request(path, {"op": "list"})["result"]["flows"]


def test_unknown_users_are_refused_by_peer_credentials(agent):
    def as_daemon_user():
        try:
            return request(agent.socket, {"op": "status"})
        except OSError as exc:
            return {"oserror": str(exc)}

    reply, pid = in_child(as_daemon_user, uid=1)  # uid 1 (daemon) is not allowed
    os.waitpid(pid, 0)
    assert reply.get("ok") is False and reply["error"]["code"] == "forbidden", reply
    assert "not allowed" in reply["error"]["message"]


def test_level_limits_and_ownership(agent):
    def nobody_registers():
        s, flow = own_udp_flow(40100)
        out = {"urgent": request(agent.socket, {"op": "register", "job": "n", "level": 0, "flows": [flow]}),
               "allowed": request(agent.socket, {"op": "register", "job": "n", "level": 2, "flows": [flow]}),
               "foreign": request(agent.socket, {"op": "register", "job": "n", "level": 2,
                                                 "flows": [{**flow, "sport": 40101}]})}
        s.close()
        return out

    replies, pid = in_child(nobody_registers, uid=NOBODY, netns=agent.host.name)
    os.waitpid(pid, 0)
    assert replies["urgent"]["error"]["code"] == "forbidden" and "level 2" in replies["urgent"]["error"]["message"]
    assert replies["allowed"]["ok"] is True
    assert replies["foreign"]["error"]["code"] == "not_owner"
    assert "is not a socket of process" in replies["foreign"]["error"]["message"]


def wait_gone(path: str, sport: int, timeout: float = 3.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(f["sport"] == sport for f in registered(path)):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"flow from port {sport} still registered after {timeout} s")


def test_flows_of_an_exiting_process_go_within_one_second(agent):
    def register_and_linger():
        s, flow = own_udp_flow(40200)
        return request(agent.socket, {"op": "register", "job": "exiting", "level": 1, "flows": [flow]})

    reply, pid = in_child(register_and_linger, stay=0.7, netns=agent.host.name)
    assert reply["ok"] and any(f["sport"] == 40200 for f in registered(agent.socket))
    os.waitpid(pid, 0)  # the child exits 0.7 s after registering
    assert wait_gone(agent.socket, 40200) <= 1.0


def test_flows_of_closed_sockets_go_within_one_second(agent):
    r, w = os.pipe()

    def register_then_close():
        s, flow = own_udp_flow(40300)
        out = request(agent.socket, {"op": "register", "job": "closing", "level": 1, "flows": [flow]})
        os.write(w, json.dumps(out).encode() + b"\n")
        time.sleep(0.3)
        s.close()  # the process stays alive, its socket does not
        time.sleep(3)
        return out

    pid = os.fork()
    if pid == 0:
        try:
            enter_netns(agent.host.name)
            register_then_close()
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as fh:
            assert json.loads(fh.readline())["ok"]
        time.sleep(0.3)
        assert wait_gone(agent.socket, 40300) <= 1.0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


class Sender:
    """A forked child in network namespace ``netns``, as ``uid``, that binds a UDP socket to ``(addr, port)`` with
    SO_REUSEADDR (as any user may, to share a port with another user's socket that set it too) and, while it lives,
    runs ``register(sock)`` once and then sends ``count`` datagrams to ``dst`` (and 3 b"stop") at each ``send()``."""

    def __init__(self, netns: str, uid: int, addr: str, port: int, register=None):
        self._cmd_r, self._cmd_w = os.pipe()
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child
            try:
                os.close(r)
                os.close(self._cmd_w)
                enter_netns(netns)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
                os.write(w, json.dumps(register(s) if register else {}).encode() + b"\n")
                with os.fdopen(self._cmd_r) as cmds:
                    for line in cmds:  # "HOST PORT COUNT"
                        host, dport, count = line.split()
                        for _ in range(int(count)):
                            s.sendto(b"x" * 200, (host, int(dport)))
                            time.sleep(0.002)
                        for _ in range(3):
                            s.sendto(b"stop", (host, int(dport)))
                        os.write(w, b"{}\n")
            finally:
                os._exit(0)
        os.close(w)
        os.close(self._cmd_r)
        self._out = os.fdopen(r)
        self.reply = json.loads(self._out.readline())

    def send(self, dst: str, dport: int, count: int) -> None:
        """Send ``count`` datagrams to ``(dst, dport)``, then 3 b"stop"; returns once sent."""
        os.write(self._cmd_w, f"{dst} {dport} {count}\n".encode())
        self._out.readline()

    def close(self) -> None:
        os.close(self._cmd_w)
        self._out.close()
        os.waitpid(self.pid, 0)


@pytest.mark.parametrize("family", [4, 6])
def test_a_udp_flow_registered_before_another_user_shares_its_port_gives_that_user_no_level(family):
    """Linux lets two users' UDP sockets share a port when both set SO_REUSEADDR, and their datagrams carry the same
    5-tuple. A register whose port another user's socket shares is refused; but a flow registered *before* another
    user bound the port so kept its level, and the maps, keyed by the 5-tuple alone, gave that user's datagrams the
    registered flow's level and DSCP (200 of 200 here, IPv4 and IPv6). Since 2026-11-28 a user's UDP flow is keyed
    by its socket's user as well (``meta skuid``): the other user's datagrams leave unmarked, the registering user's
    keep the level (the DSCP read by the receiver)."""
    extra = {"socket_mode": "0666", "allowed_users": ["nobody"], "rate_limit_per_s": 100000}
    with Testbed(hosts=2, rate="100mbit", name="tx4", ipv6=family == 6) as tb, \
            running_agents(tb, levels=3, hosts=[1], config_extra=extra) as agents:
        h1, h2 = tb.host(1), tb.host(2)
        src, dst = (h1.ip, h2.ip) if family == 4 else (h1.ip6, h2.ip6)
        sport, dport = 40500, 40501
        flow = {"proto": "udp", "src": src, "sport": sport, "dst": dst, "dport": dport}

        def register(s):
            return request(agents[1].socket, {"op": "register", "job": "a", "level": 1, "flows": [flow],
                                              "fds": [s.fileno()]})

        def received(sender: Sender, count: int = 200) -> dict:
            recv = dscp_receiver(h2, "::" if family == 6 else "0.0.0.0", dport)
            try:
                sender.send(dst, dport, count)
                return json.loads(recv.communicate(timeout=15)[0])
            finally:
                if recv.poll() is None:
                    recv.kill()
                    recv.wait(5)

        owner = Sender(h1.name, NOBODY, src, sport, register)
        try:
            assert owner.reply["ok"], owner.reply
            dscp = str(owner.reply["result"]["dscp"])
            other = Sender(h1.name, 1, src, sport)  # user daemon shares the port after the register
            try:
                theirs = received(other)
            finally:
                other.close()
            mine = received(owner)
            listed = registered(agents[1].socket)
        finally:
            owner.close()
    assert [f["sport"] for f in listed] == [sport], listed  # the owner's flow stays registered
    assert sum(theirs.values()) >= 190 and list(theirs) == ["0"], theirs
    assert sum(mine.values()) >= 190 and list(mine) == [dscp], mine


def test_an_unchecked_users_udp_flow_gives_another_users_socket_no_level():
    """With ``check_ownership = false`` a user's register is judged by no socket: ``nobody`` may name any 5-tuple,
    one it holds no socket of too. Such a UDP flow was keyed by its 5-tuple alone, so another user's datagrams of
    it (user daemon's socket on that port) left at the level ``nobody`` chose, its DSCP and class. Since
    2026-11-29 an unchecked user's UDP flow is keyed by that user (``meta skuid``): daemon's datagrams leave
    unmarked, and ``nobody``'s own socket on the port, bound after the register, gets the level."""
    extra = {"socket_mode": "0666", "allowed_users": ["nobody", "daemon"], "check_ownership": False,
             "rate_limit_per_s": 100000}
    with Testbed(hosts=2, rate="100mbit", name="tx7") as tb, \
            running_agents(tb, levels=3, hosts=[1], config_extra=extra) as agents:
        h1, h2 = tb.host(1), tb.host(2)
        sport, dport = 40600, 40601
        flow = {"proto": "udp", "src": h1.ip, "sport": sport, "dst": h2.ip, "dport": dport}

        def register():  # nobody, holding no socket of the flow (nothing checks it)
            return request(agents[1].socket, {"op": "register", "job": "a", "level": 1, "flows": [flow]})

        reply, pid = in_child(register, uid=NOBODY, netns=h1.name)
        os.waitpid(pid, 0)
        assert reply["ok"], reply
        dscp = str(reply["result"]["dscp"])
        assert dscp != "0"

        def received(sender: Sender) -> dict:
            recv = dscp_receiver(h2, "0.0.0.0", dport)
            try:
                sender.send(h2.ip, dport, 200)
                return json.loads(recv.communicate(timeout=15)[0])
            finally:
                if recv.poll() is None:
                    recv.kill()
                    recv.wait(5)

        other = Sender(h1.name, 1, h1.ip, sport)  # user daemon's socket on the flow's port
        try:
            theirs = received(other)
        finally:
            other.close()
        mine = Sender(h1.name, NOBODY, h1.ip, sport)  # the registering user's own socket on it
        try:
            own = received(mine)
        finally:
            mine.close()
        listed = registered(agents[1].socket)
    assert [(f["sport"], f["level"]) for f in listed] == [(sport, 1)], listed
    assert sum(theirs.values()) >= 190 and list(theirs) == ["0"], theirs
    assert sum(own.values()) >= 190 and list(own) == [dscp], own


def test_rate_limit_and_oversized_messages(tmp_path):
    with Testbed(hosts=1, rate="100mbit", name="tx2") as tb, \
            running_agents(tb, config_extra={"rate_limit_per_s": 50}) as agents:
        path = agents[1].socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b'{"op":"hello"}\n' * 300)
            buf = b""
            while buf.count(b"\n") < 300:
                buf += s.recv(1 << 20)
        codes = [json.loads(line).get("error", {}).get("code", "ok") for line in buf.splitlines()]
        assert codes.count("ok") >= 50 and codes.count("rate_limited") >= 100
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(b"x" * (70 * 1024))
            reply = s.recv(65536)
        assert json.loads(reply)["error"]["code"] == "too_large"
        with AgentClient(path) as c:  # still serving
            assert c.status()["flows"] == 0


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                           | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=12)
flows = st.fixed_dictionaries({"proto": st.sampled_from(["tcp", "udp", "sctp", 6]),
                               "src": st.sampled_from(["198.18.0.1", "fd00::1", "nope", "::ffff:198.18.0.1"]),
                               "sport": st.integers(-1, 70000), "dst": st.sampled_from(["198.18.0.2", "fd00::2"]),
                               "dport": st.integers(0, 65536)})
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(["register", "unregister", "list", "status", "hello", "boom"])},
    optional={"id": json_values, "job": st.sampled_from(["a", "b", "", "x y", "j" * 70]) | json_values,
              "level": st.integers(-2, 6) | json_values, "rank": st.integers(-1, 3) | json_values,
              "flows": st.lists(flows, max_size=5) | json_values, "extra": json_values})
valid_flows = st.lists(st.fixed_dictionaries({"proto": st.sampled_from(["tcp", "udp"]), "src": st.just("198.18.0.1"),
                                             "sport": st.integers(1, 40), "dst": st.just("198.18.0.2"),
                                             "dport": st.integers(1, 3)}), min_size=1, max_size=6)
valid = st.one_of(
    st.fixed_dictionaries({"op": st.just("register"), "job": st.sampled_from(["a", "b", "c"]),
                           "level": st.integers(0, 2), "flows": valid_flows}),
    st.fixed_dictionaries({"op": st.just("unregister"), "job": st.sampled_from(["a", "b", "c"])},
                          optional={"flows": valid_flows}),
    st.fixed_dictionaries({"op": st.sampled_from(["list", "hello"])}))
lines = (valid.map(lambda r: json.dumps(r).encode())
         | requests.map(lambda r: json.dumps(r).encode())
         | requests.map(lambda r: json.dumps(r).encode()[: max(1, len(json.dumps(r)) // 2)])  # truncated
         | st.binary(max_size=200).filter(lambda b: b"\n" not in b))


def test_fuzz_10000_messages_agent_stays_up_and_consistent():
    with Testbed(hosts=1, rate="100mbit", name="tx3") as tb, running_agents(
            tb, levels=3, config_extra={"trusted_users": ["root"], "rate_limit_per_s": 1e6}) as agents:
        path = agents[1].socket
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(5)
        conn.connect(path)
        reader = conn.makefile("rb")
        seen = {"ok": 0, "error": 0}

        @settings(max_examples=200, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(lines, min_size=50, max_size=50))
        def send(batch: list[bytes]) -> None:  # 200 batches of 50 pipelined messages: 10,000 messages
            conn.sendall(b"".join(line + b"\n" for line in batch))
            for _ in batch:
                reply = json.loads(reader.readline())
                assert isinstance(reply["ok"], bool)
                seen["ok" if reply["ok"] else "error"] += 1
                if not reply["ok"]:
                    assert reply["error"]["code"] and reply["error"]["message"]

        send()
        conn.close()
        assert sum(seen.values()) >= 10_000 and seen["ok"] > 100 and seen["error"] > 1000
        assert agents[1].proc.poll() is None
        with AgentClient(path) as c:
            listed = {(f["proto"], f["src"], f["sport"], f["dst"], f["dport"]): f["level"]
                      for f in c.list()["flows"]}
            status = c.status()
        kernel = {}
        for fam in (4, 6):
            out = tb.host(1).run(["nft", "-j", "list", "map", "inet", "tensorlane", f"flows{fam}"]).stdout
            for elem in json.loads(out)["nftables"][1]["map"].get("elem", []):
                src, dst, proto, sport, dport = elem[0]["concat"]
                kernel[(proto, src, sport, dst, dport)] = int(elem[1]["goto"]["target"][5:])
        assert listed == kernel and status["reconcile"]["errors"] == 0


def test_a_group_limit_holds_for_a_member_whose_process_dropped_the_group():
    """``level_limits`` may cap a group (``"@nogroup": 2``); such a limit is a user's, not its process's: a member
    whose process left the group (a user with an ``/etc/subgid`` range runs processes as any gid of it and with no
    supplementary groups: ``newgidmap`` in a user namespace of its own, then ``setgroups``) matched no key of its
    own, so the ``"*"`` limit held for it, or none (level 0). The group is read from the account too since
    2026-11-29: the child below has the credentials such a process has (gid 300000, no groups, uid nobody, whose
    group is ``nogroup``), and is refused level 0 as nobody's own process is."""
    extra = {"socket_mode": "0666", "allowed_users": ["nobody"], "level_limits": {"@nogroup": 2},
             "rate_limit_per_s": 100000}

    def register(gid: int, port: int) -> dict:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                enter_netns(agent.host.name)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(NOBODY)
                s, flow = own_udp_flow(port)
                out = request(agent.socket, {"op": "register", "job": "g", "level": 0, "flows": [flow],
                                             "fds": [s.fileno()]})
                os.write(w, json.dumps(out).encode() + b"\n")
                s.close()
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as fh:
            line = fh.readline()
        os.waitpid(pid, 0)
        return json.loads(line)

    with Testbed(hosts=1, rate="100mbit", name="tx5") as tb, \
            running_agents(tb, levels=3, config_extra=extra) as agents:
        agent = agents[1]
        own = register(NOBODY, 40600)
        dropped = register(300000, 40601)
        listed = registered(agent.socket)
    assert own["error"]["code"] == "forbidden" and "level 2" in own["error"]["message"], own
    assert dropped.get("ok") is False and dropped["error"]["code"] == "forbidden", dropped
    assert "level 2" in dropped["error"]["message"] and listed == [], (dropped, listed)


def test_a_users_tcp_sent_after_close_or_through_mptcp_leaves_without_the_dscp_it_set():
    """A user's unregistered packets leave a managed interface with DSCP 0 (``meta skuid``), but that reads the
    socket's file: what a TCP socket still sends after ``close()`` (its send buffer) and every packet of an MPTCP
    connection (its subflows are the kernel's sockets, no file; ``IPPROTO_MPTCP`` needs no privilege) matched no
    rule and kept the user's ``IP_TOS``: here 0.5 MB of 2 MB of plain TCP, and 1.7 MB of 2 MB of MPTCP, arrived with
    DSCP 46 (level 0's) before 2026-11-29. Since, none (the receiver's counters by DSCP)."""
    extra = {"socket_mode": "0666", "allowed_users": ["nobody"], "level_limits": {"nobody": 2}}
    counters = ("table inet cnt { chain in { type filter hook input priority 0; policy accept;\n"
                + "".join(f"tcp dport {port} ip dscp {d} counter\n" for port in (45000, 45001) for d in ("ef", "cs0"))
                + "}\n}\n")
    listen = ("import socket, sys\nls = []\nfor port in (45000, 45001):\n"
              "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              "    s.bind(('0.0.0.0', port)); s.listen(1); ls.append(s)\nprint('ready', flush=True)\n"
              "for s in ls:\n    c, _ = s.accept(); c.settimeout(15)\n    while c.recv(65536):\n        pass\n"
              "print('done', flush=True)\n")
    with Testbed(hosts=2, rate="100mbit", name="tx6") as tb, \
            running_agents(tb, levels=3, hosts=[1], config_extra=extra):
        h1, h2 = tb.host(1), tb.host(2)
        h2.run(["nft", "-f", "-"], input=counters)
        recv = h2.popen([sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout.readline().strip() == "ready"

            def send() -> dict:
                for proto, port in ((socket.IPPROTO_TCP, 45000), (262, 45001)):  # 262: IPPROTO_MPTCP
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto)
                    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0xb8)
                    s.connect((h2.ip, port))
                    s.sendall(b"x" * 2_000_000)
                    s.close()  # (the send buffer's bytes leave after this)
                return {}

            _, pid = in_child(send, uid=NOBODY, netns=h1.name)
            os.waitpid(pid, 0)
            assert recv.stdout.readline().strip() == "done"
        finally:
            if recv.poll() is None:
                recv.kill()
            recv.wait(5)
        listed = json.loads(h2.run(["nft", "-j", "list", "table", "inet", "cnt"]).stdout)
    got = {}
    for item in listed["nftables"]:
        rule = item.get("rule")
        if rule:
            port = next(e["match"]["right"] for e in rule["expr"] if "match" in e
                        and e["match"]["left"].get("payload", {}).get("field") == "dport")
            dscp = next(e["match"]["right"] for e in rule["expr"] if "match" in e
                        and e["match"]["left"].get("payload", {}).get("field") == "dscp")
            got[(port, dscp)] = next(e["counter"]["bytes"] for e in rule["expr"] if "counter" in e)
    assert got[(45000, "cs0")] > 1_900_000 and got[(45001, "cs0")] > 1_900_000, got
    assert got[(45000, "ef")] == 0 and got[(45001, "ef")] == 0, got


def test_kernel_tcp_dscp_keeps_the_dscp_of_the_kernels_tcp_without_a_socket_file():
    """The kernel's own TCP sockets have no socket file either (``meta skuid`` fails): a storage client root gave a
    DSCP (NVMe/TCP's ``nvme connect --tos``), the kernel's resets (IPv4's carry the TOS of the packet they answer).
    Root on the other host sends SYNs with DSCP 24 (``IP_TOS`` 0x60) to closed ports of the agent's host: with the
    default settings the resets leave with DSCP 0 (and the reset counter says so), with ``kernel_tcp_dscp = [24]``
    with 24. Either way the reset of a registered flow leaves with its level's DSCP (the ``sockless`` chain at
    ``output`` comes before the lookup at ``postrouting``), and root's own SYN (a socket file) keeps 24."""
    counters = ("table inet cnt {\nchain in { type filter hook input priority 0; policy accept;\n"
                + "".join(f'tcp {field} {port} ip dscp {d} counter comment "{port}/{d}"\n'
                          for field, port in (("sport", 45100), ("sport", 45101), ("dport", 45102))
                          for d in (0, 24, 46))
                + "}\n}\n")
    syns = ("import socket, sys\nfor i in range(5):\n    for dst, port, sport in {targets}:\n"
            "        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0x60); s.bind(('', sport)); s.settimeout(2)\n"
            "        try:\n            s.connect((dst, port))\n        except ConnectionRefusedError:\n"
            "            pass\n        else:\n            sys.exit(f'port {{port}} is open')\n        s.close()\n")
    got = {}
    with Testbed(hosts=2, rate="100mbit", name="tkr") as tb:
        h1, h2 = tb.host(1), tb.host(2)
        for kept in ([24], None):
            h2.run(["nft", "-f", "-"], input="table inet cnt\ndelete table inet cnt\n" + counters)  # (counting anew)
            # (root registers the flow of h1's kernel on its behalf: the test runs outside h1's namespace)
            extra = {"trusted_users": ["root"], **({} if kept is None else {"kernel_tcp_dscp": kept})}
            with running_agents(tb, levels=3, hosts=[1], config_extra=extra) as agents:
                with agents[1].client() as agent:  # the resets of 45101 are a registered flow's, level 0: DSCP 46
                    agent.register("job-k", 0, [{"proto": "tcp", "src": h1.ip, "sport": 45101, "dst": h2.ip,
                                                 "dport": 45201}])
                h2.run([sys.executable, "-c", syns.format(targets=[(h1.ip, 45100, 45200), (h1.ip, 45101, 45201)])])
                h1.run([sys.executable, "-c", syns.format(targets=[(h2.ip, 45102, 45202)])])  # root's, on h1
                sockless = json.loads(h1.run(["nft", "-j", "list", "chain", "inet", "tensorlane", "sockless"]).stdout)
            listed = json.loads(h2.run(["nft", "-j", "list", "table", "inet", "cnt"]).stdout)["nftables"]
            got[str(kept)] = {r["comment"]: next(e["counter"]["packets"] for e in r["expr"] if "counter" in e)
                              for r in (item["rule"] for item in listed if "rule" in item)}
            # (tensorlane_unregistered_dscp_reset_packets_total: the registered flow's resets too, marked after)
            got[str(kept)]["reset"] = nftables.reset_counters(sockless)["packets"]
    assert got["[24]"] == {"45100/0": 0, "45100/24": 5, "45100/46": 0, "45101/0": 0, "45101/24": 0, "45101/46": 5,
                           "45102/0": 0, "45102/24": 5, "45102/46": 0, "reset": 0}, got
    assert got["None"] == {"45100/0": 5, "45100/24": 0, "45100/46": 0, "45101/0": 0, "45101/24": 0, "45101/46": 5,
                           "45102/0": 0, "45102/24": 5, "45102/46": 0, "reset": 10}, got
