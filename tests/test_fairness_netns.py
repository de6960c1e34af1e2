"""No user locks the others out (issue 14): a real agent, clients running as other users.

One allowed user (nobody) opens its whole connection allowance, is refused more with ``user_limit``, and floods
requests on every connection (and keeps trying new ones) while another allowed user (daemon) and root register and
unregister flows in a loop, each request on a fresh connection as the shim does: their p99 register latency stays
under 10 ms (or, where the machine is too loaded for that without any flood, within twice the p99 of the same loops
without the flood, measured just before). The flood's connections are closed
``idle_timeout_s`` after their last answer (measured). With three users filling all connections but the reserve,
root still connects. The agent's log holds a bounded number of refusal lines (counted) and the metrics count the
refusals by reason. Every loop is bounded in count and time; child processes are killed and reaped on failure and
the testbed is removed by its context manager.

The agent checks who owns each flow, as for any unprivileged user: the TCP flows are looked up one by one in
the kernel (sock_diag, about 10 us each) rather than read from ``/proc/self/net/tcp`` (milliseconds: the kernel
walks its whole TCP hash table)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import pwd
import random
import re
import select
import selectors
import signal
import socket
import sys
import time
from collections import Counter

import pytest
from agent_clients import enter_netns
from prometheus_client.parser import text_string_to_metric_families

from bench.agents import running_agents
from testbed import Testbed

pytestmark = pytest.mark.netns

TOTAL, RESERVED, PER_USER, USER_RATE, IDLE_S = 160, 16, 64, 200, 3.0
FLOOD_S = 8.0          # how long the flooding user floods
CHURN_N = 300          # register/unregister pairs of root and of the other user (at most; bounded by CHURN_S too)
CHURN_S = 6.0
CHURN_EVERY_S = 0.02   # a pair every 20 ms on average (random gaps): 100 requests/s, half of requests_per_user_per_s
HELLO = b'{"op":"hello"}\n'
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


@pytest.fixture(scope="module")
def agent():
    extra = {"socket_mode": "0666", "allowed_users": ["nobody", "daemon", "bin"], "max_connections": TOTAL,
             "reserved_connections": RESERVED, "max_connections_per_user": PER_USER,
             "requests_per_user_per_s": USER_RATE, "idle_timeout_s": IDLE_S}
    with Testbed(hosts=1, rate="100mbit", name="fair") as tb, running_agents(tb, levels=3, config_extra=extra) as ags:
        yield ags[1]


# --- helpers ----------------------------------------------------------------------------------------------------

_PARENT_ENDS: set[int] = set()  # the parent's ends of every child's pipes: closed in each new child


class Child:
    """A forked child running ``fn(send, wait_release)`` as user ``name`` (None: root), in network namespace
    ``netns`` if given: ``send(obj)`` hands a JSON line to the parent (``recv``), ``wait_release(timeout)`` blocks
    until the parent calls ``release`` (or the timeout)."""

    def __init__(self, name: str | None, fn, netns: str | None = None):
        out_r, out_w = os.pipe()
        self._rel_r, self._rel_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child: no pytest machinery from here on
            try:
                os.close(out_r)
                os.close(self._rel_w)
                for fd in _PARENT_ENDS:  # else an older child would not see its release pipe close
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if netns is not None:
                    enter_netns(netns)
                if name is not None:
                    pw = pwd.getpwnam(name)
                    os.setgroups([])
                    os.setgid(pw.pw_gid)
                    os.setuid(pw.pw_uid)
                out = os.fdopen(out_w, "w", buffering=1)

                def send(obj):
                    out.write(json.dumps(obj) + "\n")

                def wait_release(timeout: float) -> None:
                    select.select([self._rel_r], [], [], timeout)

                try:
                    fn(send, wait_release)
                except BaseException as exc:  # noqa: BLE001 - the parent reports it
                    send({"child_error": f"{type(exc).__name__}: {exc}"})
            finally:
                os._exit(0)
        os.close(out_w)
        os.close(self._rel_r)
        _PARENT_ENDS.update((out_r, self._rel_w))
        self._out = os.fdopen(out_r)
        self.released = False

    def recv(self, timeout: float) -> dict:
        ready, _, _ = select.select([self._out], [], [], timeout)
        line = self._out.readline() if ready else ""
        assert line, f"child {self.pid} sent nothing within {timeout} s (or exited)"
        obj = json.loads(line)
        assert "child_error" not in obj, obj["child_error"]
        return obj

    def release(self) -> None:
        if not self.released:
            self.released = True
            _PARENT_ENDS.discard(self._rel_w)
            os.close(self._rel_w)

    def reap(self, timeout: float = 10.0) -> None:
        """Release, wait (bounded) for the child to exit, then kill it."""
        self.release()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                break
            time.sleep(0.02)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        _PARENT_ENDS.discard(self._out.fileno())
        self._out.close()


@contextlib.contextmanager
def children():
    """Children started in the block are reaped when it ends, whatever happens."""
    started: list[Child] = []

    def start(name, fn, netns=None) -> Child:
        started.append(Child(name, fn, netns))
        return started[-1]

    try:
        yield start
    finally:
        for child in started:
            child.reap()


def read_line(s: socket.socket, buf: bytearray) -> dict:
    while b"\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise OSError("agent closed the connection")
        buf += chunk
    i = buf.index(b"\n")
    line = bytes(buf[:i])
    del buf[:i + 1]
    return json.loads(line)


def open_connections(path: str, n: int) -> tuple[list[socket.socket], list[str]]:
    """Try ``n`` connections, each checked with a hello; returns the accepted ones and the refusals' codes."""
    conns, refused = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused: the agent may have hung up
            s.sendall(HELLO)
        reply = read_line(s, bytearray())
        if reply["ok"]:
            conns.append(s)
        else:
            refused.append(reply["error"]["code"])
            s.close()
    return conns, refused


def request(path: str, msg: dict, timeout: float = 5.0) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(msg).encode() + b"\n")
        return read_line(s, bytearray())


def churn(path: str, port: int, job: str) -> dict:
    """Register and unregister a TCP flow of this process (a loopback connection it holds, as the shim's gloo
    connections), each request on a fresh connection, a pair every CHURN_EVERY_S, at most CHURN_N times and
    CHURN_S seconds; returns the latencies (s) and the error codes."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # plain calls: no name resolution as this user
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.connect(("127.0.0.1", port))
    peer, _ = listener.accept()
    flow = {"proto": "tcp", "src": "127.0.0.1", "sport": s.getsockname()[1], "dst": "127.0.0.1", "dport": port}
    register, unregister, errors = [], [], Counter()
    rng = random.Random(port)  # independent clients: gaps drawn at random, not in step with each other
    deadline = time.monotonic() + CHURN_S
    for _ in range(CHURN_N):
        if time.monotonic() > deadline:
            break
        time.sleep(rng.uniform(0, 2 * CHURN_EVERY_S))
        for op, into in (("register", register), ("unregister", unregister)):
            t0 = time.perf_counter()
            reply = request(path, {"op": op, "job": job, "level": 1, "flows": [flow]} if op == "register"
                            else {"op": op, "job": job, "flows": [flow]})
            into.append(time.perf_counter() - t0)
            if not reply["ok"]:
                errors[reply["error"]["code"]] += 1
    for sock in (s, peer, listener):
        sock.close()
    return {"register": register, "unregister": unregister, "errors": dict(errors)}


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def refusals(host) -> dict[str, float]:
    text = host.run([sys.executable, "-c", FETCH, "http://127.0.0.1:9477/metrics"], timeout=15).stdout
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "tensorlane_agent_connections_refused_total"}


REFUSAL_LINE = re.compile(r" tensorlane\.server: (refused connection|rate-limited|closed idle|closed connection|\d+ "
                          r"more )")


def refusal_lines(agent) -> list[str]:
    with open(agent.stderr_path, errors="replace") as fh:
        return [line for line in fh if REFUSAL_LINE.search(line)]


def flood_requests(path: str, conns: list[socket.socket], bufs: dict, answered_at: dict) -> dict:
    """For FLOOD_S: 4 pipelined hellos on every connection and 2 more connections a round; returns the codes of
    the replies and of the extra connections' refusals."""
    codes, more, deadline = Counter(), Counter(), time.monotonic() + FLOOD_S
    for _ in range(100_000):  # bounded in rounds and time
        if time.monotonic() > deadline:
            break
        for s in conns:  # 4 pipelined requests on every connection
            s.sendall(HELLO * 4)
        more.update(open_connections(path, 2)[1])  # and 2 more connections
        for s in conns:
            for _ in range(4):
                reply = read_line(s, bufs[s])
                codes["ok" if reply["ok"] else reply["error"]["code"]] += 1
            answered_at[s] = time.monotonic()
    return {"codes": codes, "more": more}


def watch_idle(conns: list[socket.socket], bufs: dict, answered_at: dict) -> dict:
    """Leave ``conns`` idle: when (after its last answer) does the agent close each, and with which notice?"""
    sel = selectors.DefaultSelector()
    for s in conns:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed_after, notices, deadline = [], Counter(), time.monotonic() + IDLE_S + 5
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(0.5):
            s = key.fileobj
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            bufs[s] += chunk
            if not chunk:
                closed_after.append(time.monotonic() - answered_at[s])
                notices.update(json.loads(x)["error"]["code"] for x in bufs[s].splitlines() if x)
                sel.unregister(s)
                s.close()
    return {"closed_after": closed_after, "still_open": len(sel.get_map()), "notices": notices}


def flooder(path: str):
    """The flooding user's child: its allowance of connections and 8 more, a flood of requests, then idle."""
    def run(send, wait_release):
        conns, refused = open_connections(path, PER_USER + 8)
        send({"accepted": len(conns), "refused": refused})
        bufs = {s: bytearray() for s in conns}
        answered_at = {s: time.monotonic() for s in conns}  # the agent's idle clock starts at its last answer
        send(flood_requests(path, conns, bufs, answered_at))
        send(watch_idle(conns, bufs, answered_at))
    return run


def both_churn(start, agent) -> dict:
    """daemon and root each churn flows in a child (in the agent's namespace); returns their ``churn`` results."""
    def churner(port, job):
        return lambda send, _: send(churn(agent.socket, port, job))

    daemon = start("daemon", churner(40710, "fair-daemon"), netns=agent.host.name)
    root = start(None, churner(40720, "fair-root"), netns=agent.host.name)
    return {"daemon": daemon.recv(timeout=CHURN_S + 30), "root": root.recv(timeout=CHURN_S + 30)}


def latency_figures(lat: dict, quiet: dict) -> dict:
    """Register/unregister latency of each churning user, with the flood and without it (``_without_flood``)."""
    return {f"{who}{tag}": {"n": len(r["register"]), "register_p50_ms": round(median(r["register"]) * 1e3, 3),
                            "register_p95_ms": round(quantile(r["register"], 0.95) * 1e3, 3),
                            "register_p99_ms": round(quantile(r["register"], 0.99) * 1e3, 3),
                            "unregister_p99_ms": round(quantile(r["unregister"], 0.99) * 1e3, 3)}
            for tag, runs in (("", lat), ("_without_flood", quiet)) for who, r in runs.items()}


# --- tests ------------------------------------------------------------------------------------------------------

def test_a_user_at_its_limits_does_not_slow_root_or_other_users(agent):
    before = refusals(agent.host)
    lines_before = len(refusal_lines(agent))
    t_start = time.monotonic()
    with children() as start:
        quiet = both_churn(start, agent)  # the same loops without the flood
        flood = start("nobody", flooder(agent.socket))
        opened = flood.recv(timeout=30)
        lat = both_churn(start, agent)
        flooded = flood.recv(timeout=FLOOD_S + 30)
        flood_codes = flooded["codes"]
        idle = flood.recv(timeout=IDLE_S + 30)
        stranger = start("sys", lambda send, _: send({"codes": open_connections(agent.socket, 5)[1]}))
        forbidden = stranger.recv(timeout=30)
    elapsed = time.monotonic() - t_start

    # The flooding user got its allowance, no more, with a clear code; its requests were answered at its rate.
    assert opened["accepted"] == PER_USER and opened["refused"] == ["user_limit"] * 8, opened
    assert set(flooded["more"]) == {"user_limit"}, flooded["more"]
    assert set(flood_codes) == {"ok"}, flood_codes
    # Root and the other user were served throughout, fast.
    for who, r in (*lat.items(), *quiet.items()):
        assert not r["errors"], (who, r["errors"])
        assert len(r["register"]) >= 50, (who, len(r["register"]))
    figures = latency_figures(lat, quiet)
    # Idle connections closed on time, each told why.
    closed = idle["closed_after"]
    figures["idle_close_s"] = {"min": round(min(closed), 3) if closed else None,
                               "max": round(max(closed), 3) if closed else None, "n": len(closed)}
    figures["flood"] = {"ok_per_s": round(flood_codes["ok"] / FLOOD_S, 1), "codes": flood_codes}
    # A user who is not allowed is refused.
    assert forbidden["codes"] == ["forbidden"] * 5, forbidden
    after = refusals(agent.host)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    lines = refusal_lines(agent)[lines_before:]
    # One line per reason per 10 s at most (the log's lines, or a summary of those left out), plus the stop.
    bound = len([k for k, v in delta.items() if v]) * (math.ceil(elapsed / 10) + 1)
    figures |= {"refusals": delta, "refusal_log_lines": len(lines), "log_line_bound": bound,
                "elapsed_s": round(elapsed, 1)}
    print("\nfairness figures:", json.dumps(figures))
    for who in ("root", "daemon"):
        # Under 10 ms, or, on a machine too loaded for that even without the flood (a CI run: 31-39 ms without
        # it), no more than twice the same loop's p95 without the flood, measured side by side; the p99 (two or
        # three of some 220 registers: one stall of the machine's) within four times it, or under 20 ms. Judged
        # on the p99 alone, twice it failed beside make test's unit tests (22.9 ms against 2 x 8.2, 2026-11-29);
        # a flood that held the loop would put both at tens to hundreds of ms.
        quiet_ms = figures[f"{who}_without_flood"]
        bound_ms = max(10.0, 2 * quiet_ms["register_p95_ms"])
        assert figures[who]["register_p95_ms"] < bound_ms, (who, bound_ms, figures)
        bound_ms = max(20.0, 4 * quiet_ms["register_p99_ms"])
        assert figures[who]["register_p99_ms"] < bound_ms, (who, bound_ms, figures)
    assert idle["still_open"] == 0 and len(closed) == PER_USER, idle
    assert min(closed) >= IDLE_S - 0.05 and max(closed) <= IDLE_S + 0.5, figures["idle_close_s"]
    assert idle["notices"] == {"idle_timeout": PER_USER}, idle["notices"]
    assert flood_codes["ok"] <= USER_RATE * (FLOOD_S + 3), figures["flood"]  # a second's burst, then the rate
    assert delta["user_limit"] == 8 + flooded["more"]["user_limit"], delta
    assert delta["forbidden"] == 5 and delta["idle_closed"] >= PER_USER and delta["busy"] == 0, delta
    assert delta["user_rate_limited"] > 0 and delta["rate_limited"] == 0, delta
    assert len(lines) <= bound, "".join(lines[-20:])
    assert sum(delta.values()) > 10 * len(lines), (delta, len(lines))


def test_the_reserve_keeps_root_in_when_users_fill_the_cap(agent):
    before = refusals(agent.host)

    def holder(n):
        def run(send, wait_release):
            conns, refused = open_connections(agent.socket, n)
            send({"accepted": len(conns), "refused": refused})
            wait_release(IDLE_S * 10)
            for s in conns:
                s.close()
        return run

    with children() as start:
        got = {}
        for name, tries in (("nobody", PER_USER), ("bin", PER_USER), ("daemon", TOTAL)):
            got[name] = start(name, holder(tries)).recv(timeout=30)
        root_conns, root_refused = open_connections(agent.socket, RESERVED + 2)
        try:
            # every unprivileged connection is taken: daemon got what the others left of all but the reserve
            assert got["nobody"]["accepted"] == got["bin"]["accepted"] == PER_USER, got
            assert got["daemon"]["accepted"] == TOTAL - RESERVED - 2 * PER_USER, got
            assert set(got["daemon"]["refused"]) == {"busy"}, got["daemon"]["refused"][:3]
            # root still gets in: the reserve, then the global cap
            assert len(root_conns) == RESERVED and root_refused == ["busy", "busy"], (len(root_conns), root_refused)
            after = refusals(agent.host)
            assert after["busy"] - before["busy"] == TOTAL - (TOTAL - RESERVED - 2 * PER_USER) + 2, (before, after)
        finally:
            for s in root_conns:
                s.close()
