"""No one squats on another job's flows: ownership is decided in the network namespace the agent manages.

A real agent on host 1 of a 2-host testbed ("sq"); a victim in host 1's namespace holds a real TCP connection
host1 -> host2. An unprivileged user (nobody) in its own user and network namespace gives its loopback the hosts'
addresses, opens a connection with exactly the victim's 5-tuple (its own /proc view shows it) and registers it
through the agent's Unix socket: refused ``foreign_netns``. The same socket passed back into host 1's namespace
over SCM_RIGHTS: refused ``not_owner`` (the socket is not in the agent's tables). A trusted user in a private
namespace: ``foreign_netns`` too. The victim then registers normally and the kernel's map carries its level.
Sweep: a process registers legitimately, moves into a private namespace and keeps a look-alike 5-tuple there;
while it still holds the original socket the flow stays, once it closes it the flow goes within 1 s. A connection
closed (or whose process exited) while the kernel still holds bytes written to it keeps its level until they are
sent (the receiver reads them only later), then goes.

Every child is forked, bounded in time, killed and reaped in ``finally``; a private namespace dies with its
process; the testbed is a context manager.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import time
import traceback

import pytest
from agent_clients import CLONE_NEWNET, request

from bench.agents import running_agents
from tensorlane.agent.ownership import netns_of, not_owned
from tensorlane.cli import format_status
from tensorlane.flows import FlowKey, own_tcp_flows
from testbed import Testbed

pytestmark = pytest.mark.netns

NOBODY = 65534
DAEMON = 1  # 'daemon': a trusted user of this agent
SERVER_PORT = 47300
VICTIM_PORT = 47311
MOVER_PORT = 47321
OPERATOR_PORT = 47331
DRAIN_PORTS = (47341, 47342)  # the writer's two connections (closed while it runs; left open when it exits)
DRAIN_SERVER_PORT = 47340
H1, H2 = "198.18.0.1", "198.18.0.2"
CHILD_LIFETIME_S = 120.0  # no child outlives this, whatever happens to the parent

CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_netns(name: str) -> None:
    """Move the calling (single-threaded, root) process into the named network namespace ``name``."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {name}")
    finally:
        os.close(fd)


def die_with_parent() -> None:
    """SIGKILL when the parent goes (set again after each change of credentials, which clears it)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl pdeathsig")


def become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl dumpable")  # lets it write its own uid_map
    die_with_parent()


def private_netns(addresses: tuple[str, ...]) -> None:
    """As an unprivileged user: a new user and network namespace (``unshare --user --net --map-root-user``) whose
    loopback carries ``addresses``."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare user+net")
    with open("/proc/self/setgroups", "w") as fh:
        fh.write("deny")
    with open("/proc/self/uid_map", "w") as fh:
        fh.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as fh:
        fh.write(f"0 {gid} 1")
    cmds = [["ip", "link", "set", "lo", "up"]] + [["ip", "addr", "add", f"{a}/32", "dev", "lo"] for a in addresses]
    for cmd in cmds:
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)
    die_with_parent()


def connect_from(src: str, sport: int, dst: str, dport: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((src, sport))
    s.settimeout(5)
    s.connect((dst, dport))
    return s


def look_alike(flow: dict) -> tuple[socket.socket, socket.socket, socket.socket]:
    """In the caller's (private) namespace: a listener on the flow's destination and a connection with exactly
    the flow's 5-tuple; returns (listener, client end, server end)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((flow["dst"], flow["dport"]))
    listener.listen(4)
    client = connect_from(flow["src"], flow["sport"], flow["dst"], flow["dport"])
    server, _ = listener.accept()
    return listener, client, server


class Child:
    """``fn(chan)`` in a forked child; JSON messages both ways over pipes, every wait bounded; ``stop()`` kills and
    reaps it (idempotent). The child exits when the parent closes its pipe, dies, or after CHILD_LIFETIME_S."""

    def __init__(self, fn):
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child: no pytest machinery from here on
            code = 0
            try:
                os.close(up_r)
                os.close(down_w)
                signal.alarm(int(CHILD_LIFETIME_S))  # SIGALRM's default action ends it
                die_with_parent()
                fn(_Chan(down_r, up_w))
            except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
                code = 1
                with contextlib.suppress(OSError):
                    os.write(up_w, json.dumps({"error": traceback.format_exc()}).encode() + b"\n")
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self._chan = _Chan(up_r, down_w)

    def recv(self, timeout: float = 10.0) -> dict:
        msg = self._chan.recv(timeout)
        if "error" in msg:
            raise AssertionError(f"child {self.pid} failed:\n{msg['error']}")
        return msg

    def send(self, msg: dict) -> None:
        self._chan.send(msg)

    def alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def stop(self) -> None:
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.pid = None
        self._chan.close()


class _Chan:
    def __init__(self, rfd: int, wfd: int):
        self.rfd, self.wfd, self.buf = rfd, wfd, b""

    def send(self, msg: dict) -> None:
        os.write(self.wfd, json.dumps(msg).encode() + b"\n")

    def recv(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                raise TimeoutError(f"no message within {timeout} s")
            chunk = os.read(self.rfd, 65536)
            if not chunk:
                raise EOFError("the other side closed its pipe")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def children():
    """Collects Child objects; kills and reaps every one of them on the way out, whatever happened."""
    made: list[Child] = []

    def spawn(fn) -> Child:
        made.append(Child(fn))
        return made[-1]

    try:
        yield spawn
    finally:
        for child in made:
            child.stop()


def flow_dict(sport: int, dport: int = SERVER_PORT) -> dict:
    return {"proto": "tcp", "src": H1, "sport": sport, "dst": H2, "dport": dport}


def registered(path: str) -> dict[tuple, str]:
    flows = request(path, {"op": "list"})["result"]["flows"]
    return {(f["proto"], f["src"], f["sport"], f["dst"], f["dport"]): f["job"] for f in flows}


def key(flow: dict) -> tuple:
    return (flow["proto"], flow["src"], flow["sport"], flow["dst"], flow["dport"])


def kernel_map(tb) -> dict[tuple, int]:
    out = tb.host(1).run(["nft", "-j", "list", "map", "inet", "tensorlane", "flows4"]).stdout
    found = {}
    for elem in json.loads(out)["nftables"][1]["map"].get("elem", []):
        src, dst, proto, sport, dport = elem[0]["concat"]
        found[(proto, src, sport, dst, dport)] = int(elem[1]["goto"]["target"][5:])
    return found


@pytest.fixture(scope="module")
def bed():
    extra = {"socket_mode": "0666", "allowed_users": ["nobody", "daemon"], "trusted_users": ["daemon"],
             "level_limits": {"nobody": 1, "daemon": 1}, "rate_limit_per_s": 100000}
    with Testbed(hosts=2, rate="200mbit", name="sq") as tb, \
            running_agents(tb, hosts=[1], levels=3, config_extra=extra) as agents, children() as spawn:

        def serve(chan):  # host 2: accepts and holds every connection
            enter_netns(tb.host(2).name)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((H2, SERVER_PORT))
            listener.listen(16)
            chan.send({"ready": True})
            held = []
            while len(held) < 64:
                conn, _ = listener.accept()
                held.append(conn)

        server = spawn(serve)
        assert server.recv()["ready"]
        yield tb, agents[1], spawn


def test_ownership_is_read_in_the_callers_namespace_not_the_clients():
    """agent.ownership looks the client's sockets up in the CALLER's tables: a process in a private namespace
    holding a connection its own /proc view shows owns nothing in ours (the old /proc/PID/net check said yes)."""
    flow = {"proto": "tcp", "src": "127.0.0.1", "sport": 47341, "dst": "127.0.0.1", "dport": 47340}

    def squat(chan):
        become(NOBODY)
        private_netns(())
        held = look_alike(flow)  # noqa: F841 - kept open until the parent is done
        chan.send({"own_view": own_tcp_flows(), "netns": list(netns_of("self"))})
        chan.recv(CHILD_LIFETIME_S)

    with children() as spawn:
        child = spawn(squat)
        msg = child.recv()
        assert flow in msg["own_view"]  # in its own namespace the 5-tuple is real and established
        assert tuple(msg["netns"]) != netns_of("self") == netns_of(os.getpid())
        assert netns_of(child.pid) == tuple(msg["netns"])
        assert not_owned(child.pid, [FlowKey(**flow)]) == [FlowKey(**flow)]


def test_squatter_in_its_own_namespace_is_refused_and_the_victim_registers(bed):
    tb, agent, spawn = bed
    victim_flow = flow_dict(VICTIM_PORT)

    def victim(chan):  # root, in host 1's namespace: a real connection host1 -> host2
        enter_netns(tb.host(1).name)
        sock = connect_from(H1, VICTIM_PORT, H2, SERVER_PORT)  # noqa: F841 - held
        chan.send({"flows": own_tcp_flows(remote_filter=H2)})
        chan.recv(CHILD_LIFETIME_S)
        chan.send({"reply": request(agent.socket, {"op": "register", "job": "victim", "level": 1,
                                                   "flows": [victim_flow]})})
        chan.recv(CHILD_LIFETIME_S)

    def squat_from_private_netns(uid: int, job: str):
        def run(chan):
            become(uid)
            private_netns((H1, H2))
            held = look_alike(victim_flow)  # noqa: F841 - held while registering
            chan.send({"own_view": own_tcp_flows(remote_filter=H2),
                       "reply": request(agent.socket, {"op": "register", "job": job, "level": 1,
                                                       "flows": [victim_flow]})})
            chan.recv(CHILD_LIFETIME_S)
        return run

    def squat_with_a_passed_socket(chan):
        """nobody in host 1's namespace holds a socket made in its private namespace (passed over SCM_RIGHTS)."""
        enter_netns(tb.host(1).name)
        become(NOBODY)
        mine, theirs = socket.socketpair()
        helper = os.fork()
        if helper == 0:
            try:
                mine.close()
                signal.alarm(int(CHILD_LIFETIME_S))
                die_with_parent()
                private_netns((H1, H2))
                listener, client, server = look_alike(victim_flow)
                socket.send_fds(theirs, [b"fd"], [client.fileno()])
                theirs.settimeout(CHILD_LIFETIME_S)
                with contextlib.suppress(OSError):
                    theirs.recv(1)  # until the parent goes
            finally:
                os._exit(0)
        try:
            theirs.close()
            mine.settimeout(10)
            _, fds, _, _ = socket.recv_fds(mine, 16, 1)
            passed = socket.socket(fileno=fds[0])
            assert passed.getsockname() == (H1, VICTIM_PORT) and passed.getpeername() == (H2, SERVER_PORT)
            chan.send({"netns": list(netns_of("self")),
                       "reply": request(agent.socket, {"op": "register", "job": "squat-fd", "level": 1,
                                                       "flows": [victim_flow]})})
            chan.recv(CHILD_LIFETIME_S)
        finally:
            os.kill(helper, signal.SIGKILL)
            os.waitpid(helper, 0)

    v = spawn(victim)
    assert v.recv()["flows"] == [victim_flow]

    for uid, job in ((NOBODY, "squat"), (DAEMON, "squat-trusted")):
        squatter = spawn(squat_from_private_netns(uid, job))
        msg = squatter.recv()
        assert victim_flow in msg["own_view"], msg  # the squat is real in its own namespace
        reply = msg["reply"]
        assert reply["ok"] is False and reply["error"]["code"] == "foreign_netns", reply
        assert "not the one this agent manages" in reply["error"]["message"]
        assert "host networking" in reply["error"]["message"]
        squatter.stop()

    passer = spawn(squat_with_a_passed_socket)
    msg = passer.recv()
    assert tuple(msg["netns"]) == netns_of(agent.proc.pid)  # the same namespace as the agent (ip netns exec)
    reply = msg["reply"]
    assert reply["ok"] is False and reply["error"]["code"] == "not_owner", reply
    assert "in this agent's network namespace" in reply["error"]["message"]
    assert key(victim_flow) not in registered(agent.socket)  # no squat left anything behind

    v.send({"go": True})
    reply = v.recv()["reply"]
    assert reply["ok"] is True and reply["result"]["added"] == 1, reply
    assert registered(agent.socket)[key(victim_flow)] == "victim"
    assert kernel_map(tb)[(victim_flow["proto"], H1, VICTIM_PORT, H2, SERVER_PORT)] == 1
    passer.stop()


def test_trusted_user_in_the_agents_namespace_still_registers_for_others(bed):
    """Claims on other processes' flows stay open to trusted users whose namespace is the agent's."""
    tb, agent, spawn = bed
    flow = flow_dict(OPERATOR_PORT)

    def operator(chan):
        enter_netns(tb.host(1).name)
        become(DAEMON)
        chan.send({"reg": request(agent.socket, {"op": "register", "job": "op", "level": 1, "flows": [flow]}),
                   "unreg": request(agent.socket, {"op": "unregister", "job": "op", "flows": [flow]})})

    msg = spawn(operator).recv()
    assert msg["reg"]["ok"] and msg["unreg"]["ok"] and msg["unreg"]["result"]["removed"] == 1, msg


def test_sweep_drops_a_flow_whose_owner_moved_to_a_private_namespace(bed):
    tb, agent, spawn = bed
    flow = flow_dict(MOVER_PORT)

    def mover(chan):
        enter_netns(tb.host(1).name)
        become(NOBODY)
        original = connect_from(H1, MOVER_PORT, H2, SERVER_PORT)
        chan.send({"reply": request(agent.socket, {"op": "register", "job": "mover", "level": 1,
                                                   "flows": [flow]})})
        chan.recv(CHILD_LIFETIME_S)
        private_netns((H1, H2))
        held = look_alike(flow)  # noqa: F841 - the look-alike stays open
        chan.send({"own_view": own_tcp_flows(remote_filter=H2), "netns": list(netns_of("self"))})
        chan.recv(CHILD_LIFETIME_S)
        original.close()  # the real socket in host 1's namespace goes; the process and its look-alike stay
        chan.send({"closed": True})
        chan.recv(CHILD_LIFETIME_S)

    m = spawn(mover)
    assert m.recv()["reply"]["ok"]
    assert registered(agent.socket).get(key(flow)) == "mover"
    m.send({"move": True})
    msg = m.recv()
    assert flow in msg["own_view"] and tuple(msg["netns"]) != netns_of("self")
    time.sleep(1.2)  # two sweep passes: it still holds the original socket in the agent's namespace, so it stays
    assert registered(agent.socket).get(key(flow)) == "mover"
    m.send({"close": True})
    assert m.recv()["closed"]
    t0 = time.monotonic()
    while key(flow) in registered(agent.socket):
        assert time.monotonic() - t0 < 3.0, "flow still registered 3 s after its socket left the namespace"
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    assert m.alive(), "the owner exited: this measured the pidfd watch, not the sweep"
    assert elapsed <= 1.0, f"flow went only after {elapsed:.2f} s"
    assert (flow["proto"], H1, MOVER_PORT, H2, SERVER_PORT) not in kernel_map(tb)
    print(f"sweep removed the moved flow {elapsed:.3f} s after the original socket closed")


def class_bytes(status: dict, level: int | None) -> int:
    """Bytes through the class of ``level`` (None: the tree's default class, where unmarked packets go)."""
    return sum(c.get("bytes", 0) for c in status["classes"] if c["level"] == level)


def test_a_closed_connections_queued_bytes_keep_their_level_until_sent(bed):
    tb, agent, spawn = bed
    flows = [flow_dict(port, DRAIN_SERVER_PORT) for port in DRAIN_PORTS]

    def receive(chan):  # host 2: accepts both connections, reads nothing until told, then everything
        enter_netns(tb.host(2).name)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # (inherited by the accepted ends)
        listener.bind((H2, DRAIN_SERVER_PORT))
        listener.listen(4)
        listener.settimeout(10)
        chan.send({"ready": True})
        conns = [listener.accept()[0] for _ in DRAIN_PORTS]
        chan.recv(CHILD_LIFETIME_S)
        received = []
        for conn in conns:
            conn.settimeout(10)
            n = 0
            while data := conn.recv(1 << 20):
                n += len(data)
            received.append(n)
        chan.send({"received": received})

    def write(chan):  # host 1, as nobody: fills both connections' buffers, closes one, then exits holding the other
        enter_netns(tb.host(1).name)
        become(NOBODY)
        conns = [connect_from(H1, port, H2, DRAIN_SERVER_PORT) for port in DRAIN_PORTS]
        reply = request(agent.socket, {"op": "register", "job": "drainer", "level": 1, "flows": flows})
        written = []
        for conn in conns:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            conn.setblocking(False)
            n = 0
            with contextlib.suppress(BlockingIOError):
                while n < 64 << 20:  # the peer reads nothing: the buffers fill (bounded)
                    n += conn.send(b"z" * 65536)
            written.append(n)
        conns[0].close()  # (the sweep sees it)
        chan.send({"reply": reply, "written": written})
        chan.recv(CHILD_LIFETIME_S)
        # returns: the process exits with conns[1] open (its pidfd is watched)

    r = spawn(receive)
    assert r.recv()["ready"]
    before = agent.status()
    w = spawn(write)
    msg = w.recv()
    assert msg["reply"]["ok"], msg
    written = msg["written"]
    assert min(written) > 65536, written
    w.send({"exit": True})
    os.waitpid(w.pid, 0)
    w.pid = None
    time.sleep(1.2)  # two sweep passes after the close and the exit
    st = agent.status()
    assert st["draining_flows"] == 2, st["draining_flows"]
    assert " (2 draining)  jobs " in format_status(st)
    assert {key(f) for f in flows} <= set(registered(agent.socket))
    assert {kernel_map(tb).get(key(f)) for f in flows} == {1}  # still at their level in the kernel
    r.send({"read": True})
    assert r.recv(30)["received"] == written
    t0 = time.monotonic()
    while {key(f) for f in flows} & set(registered(agent.socket)):
        assert time.monotonic() - t0 < 3.0, "drained flows still registered 3 s after their bytes arrived"
        time.sleep(0.05)
    after = agent.status()
    assert after["draining_flows"] == 0
    level1 = class_bytes(after, 1) - class_bytes(before, 1)
    unmarked = class_bytes(after, None) - class_bytes(before, None)
    assert level1 >= sum(written), (level1, unmarked, written)  # every data segment at level 1
    assert unmarked < sum(written) / 20, (level1, unmarked, written)  # not the data: a few pure ACKs, the FINs' ACKs
