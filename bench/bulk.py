"""iperf3 bulk traffic between testbed hosts (every process started here is killed on exit), and one timed
transfer whose sender registers its own flow with the agent (``python -m bench.bulk sink`` / ``send``).

A *host* is anything with ``.ip`` and ``.popen(argv, **kw)`` / ``.run(argv, ...)`` running inside its network
namespace (``testbed.Host``). Usage::

    with bulk(tb, [(1, 2, 4), (2, 1, 4)], seconds=60) as b:   # host1->host2 and host2->host1, 4 streams each
        ...                                                  # contended work
        results = b.stop()                                   # SIGINT the clients: per-second intervals so far
    print(results[0].mean_bps(since=5.0))

    with iperf_server(h2, port=5301):
        r = run_client(h1, h2.ip, port=5301, seconds=3, streams=4)   # waits, returns an IperfResult
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from dataclasses import dataclass, field

from bench.workers import REPO_ROOT, register_flows, repo_env, stop_process, unregister_flows
from tensorlane.flows import own_tcp_flows

DEFAULT_PORT = 5301


class BulkError(RuntimeError):
    """iperf3 failed or produced no parsable result."""


class BulkCrash(BulkError):
    """An iperf3 client died by a signal of its own (SIGABRT, SIGSEGV) and left no JSON. iperf3 3.12 prints its JSON
    from its SIGINT handler, which allocates: an interrupt that lands inside malloc aborted it once here ("Fatal glibc
    error: malloc assertion failure in sysmalloc", `make demo`, 2026-11-28). Not a measurement: the phase may be run
    again (``bench.contention.Scenario.step_under_bulk`` does so once)."""


@dataclass
class IperfResult:
    """One iperf3 client run (sender side): summed per-interval throughput and totals."""

    src: str
    dst: str
    port: int
    streams: int
    started_at: float                      # wall clock (time.time()) when the client was started
    intervals: list[tuple[float, float, float]] = field(default_factory=list)  # (start_s, end_s, bit/s)
    sent_bps: float = 0.0                  # whole-run sender average
    received_bps: float | None = None      # whole-run receiver average (absent when the client was interrupted)
    retransmits: int | None = None
    error: str | None = None

    def mean_bps(self, since: float = 0.0, until: float | None = None) -> float:
        """Time-weighted mean of the intervals that start at or after ``since`` (s from the client start)."""
        chosen = [(s, e, b) for s, e, b in self.intervals if s >= since - 1e-6 and (until is None or e <= until + 1e-6)]
        total = sum(e - s for s, e, _ in chosen)
        if total <= 0:
            raise BulkError(f"iperf3 {self.src}->{self.dst}:{self.port}: no interval between {since} and {until} s "
                            f"(has {len(self.intervals)} intervals)")
        return sum((e - s) * b for s, e, b in chosen) / total

    def mean_bps_wall(self, t0: float, t1: float | None = None) -> float:
        """Like ``mean_bps`` with wall-clock bounds (time.time() values)."""
        return self.mean_bps(since=t0 - self.started_at, until=None if t1 is None else t1 - self.started_at)

    @property
    def bps(self) -> float:
        """The receiver's average when iperf3 reported it, else the sender's."""
        return self.received_bps if self.received_bps is not None else self.sent_bps


def parse_iperf_json(text: str, src: str = "?", dst: str = "?", port: int = 0, streams: int = 1,
                     started_at: float = 0.0) -> IperfResult:
    """Parse ``iperf3 -J`` client output (complete, or cut short by SIGINT)."""
    try:
        data = json.loads(text)
    except ValueError:
        raise BulkError(f"iperf3 {src}->{dst}:{port}: output is not JSON: {text[-500:]!r}") from None
    res = IperfResult(src=src, dst=dst, port=port, streams=streams, started_at=started_at, error=data.get("error"))
    for iv in data.get("intervals", []):
        s = iv.get("sum") or {}
        if "start" in s and "end" in s and s["end"] > s["start"]:
            res.intervals.append((float(s["start"]), float(s["end"]), float(s.get("bits_per_second", 0.0))))
    end = data.get("end") or {}
    sent = end.get("sum_sent") or {}
    recv = end.get("sum_received") or {}
    res.sent_bps = float(sent.get("bits_per_second", 0.0))
    if recv.get("bytes"):
        res.received_bps = float(recv["bits_per_second"])
    if "retransmits" in sent:
        res.retransmits = int(sent["retransmits"])
    if not res.intervals and res.received_bps is None:
        raise BulkError(f"iperf3 {src}->{dst}:{port}: no result ({res.error or 'no intervals'})")
    return res


def _close(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs and close its pipes."""
    stop_process(proc, signal.SIGKILL)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def _listening(host, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in ``host``'s namespace."""
    out = host.run(["ss", "-Htln", f"sport = :{port}"], check=False, timeout=5)
    return str(port) in (out.stdout if isinstance(out.stdout, str) else (out.stdout or b"").decode())


@contextlib.contextmanager
def iperf_server(host, port: int = DEFAULT_PORT, one_off: bool = False, ready_timeout: float = 5.0):
    """An ``iperf3 -s`` on ``host`` (ready when this yields the Popen); killed on exit."""
    argv = ["iperf3", "-s", "-p", str(port)] + (["-1"] if one_off else [])
    proc = host.popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + ready_timeout
        while not _listening(host, port):
            if proc.poll() is not None:
                raise BulkError(f"iperf3 server on {getattr(host, 'name', host)}:{port} exited "
                                f"({proc.returncode}): {proc.stderr.read().decode(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                raise BulkError(f"iperf3 server on {getattr(host, 'name', host)}:{port} not listening "
                                f"after {ready_timeout} s")
            time.sleep(0.05)
        yield proc
    finally:
        stop_process(proc)
        if proc.stderr:
            proc.stderr.close()


class IperfClient:
    """A running ``iperf3 -c``; ``stop()`` interrupts it (SIGINT keeps its JSON), ``result()`` waits for the end."""

    def __init__(self, host, server_ip: str, port: int = DEFAULT_PORT, seconds: float = 10, streams: int = 1,
                 interval: float = 0.5, extra: list[str] | None = None):
        """Start ``iperf3 -c server_ip`` on ``host`` now (JSON output, intervals of ``interval`` s)."""
        self.host, self.server_ip, self.port, self.streams, self.seconds = host, server_ip, port, streams, seconds
        argv = ["iperf3", "-c", server_ip, "-p", str(port), "-t", f"{seconds:g}", "-P", str(streams),
                "-i", f"{interval:g}", "-J"] + list(extra or [])
        self.started_at = time.time()
        self.proc = host.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._result: IperfResult | None = None
        self._interrupted = False

    def interrupt(self) -> None:
        """Send SIGINT once: iperf3 then prints its JSON with the intervals measured so far."""
        if not self._interrupted and self.proc.poll() is None:
            self._interrupted = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)

    def _collect(self, timeout: float) -> IperfResult:
        """Wait (bounded) for the client's output and parse it; BulkError (client killed) if it does not end."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, signal.SIGKILL)
            self.proc.communicate(timeout=5)
            raise BulkError(f"iperf3 client {getattr(self.host, 'name', self.host)}->{self.server_ip}:{self.port} "
                            f"did not finish in {timeout} s") from None
        try:
            self._result = parse_iperf_json(out.decode(errors="replace"), src=getattr(self.host, "ip", "?"),
                                            dst=self.server_ip, port=self.port, streams=self.streams,
                                            started_at=self.started_at)
        except BulkError as exc:
            crashed = self.proc.returncode is not None and self.proc.returncode < 0 \
                and -self.proc.returncode not in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
            kind = BulkCrash if crashed else BulkError
            raise kind(f"{exc}; exit {self.proc.returncode}; stderr: {err.decode(errors='replace')[-500:]}") from None
        return self._result

    def result(self, timeout: float | None = None) -> IperfResult:
        """Wait for the run to end by itself (bounded) and parse it."""
        if self._result is None:
            self._collect(timeout if timeout is not None else self.seconds + 15)
        return self._result

    def stop(self, timeout: float = 5.0) -> IperfResult:
        """Interrupt the run now and parse what it measured so far."""
        if self._result is None:
            self.interrupt()
            self._collect(timeout)
        return self._result

    def kill(self) -> None:
        """Kill the client now (no result) and close its pipes."""
        _close(self.proc)


def run_client(host, server_ip: str, port: int = DEFAULT_PORT, seconds: float = 3, streams: int = 1,
               omit: float = 0, extra: list[str] | None = None) -> IperfResult:
    """Run one client to its end (bounded) and return its result; ``omit`` skips the first seconds (-O)."""
    client = IperfClient(host, server_ip, port, seconds, streams, extra=(["-O", f"{omit:g}"] if omit else [])
                         + list(extra or []))
    try:
        return client.result()
    finally:
        client.kill()


class Bulk:
    """Several iperf3 client/server pairs started together (see ``bulk``)."""

    def __init__(self, clients: list[IperfClient], pairs: list[tuple[int, int, int]]):
        """The running ``clients``, one per ``(src, dst, streams)`` of ``pairs``."""
        self.clients, self.pairs = clients, pairs
        self.results: list[IperfResult] | None = None

    def stop(self, timeout: float = 5.0) -> list[IperfResult]:
        """Interrupt all clients and return their results, in the order of ``pairs``."""
        if self.results is None:
            for c in self.clients:
                c.interrupt()
            self.results = [c.stop(timeout) for c in self.clients]
        return self.results

    def wait(self, timeout: float | None = None) -> list[IperfResult]:
        """Wait for all clients to end by themselves."""
        if self.results is None:
            self.results = [c.result(timeout) for c in self.clients]
        return self.results

    def alive(self) -> bool:
        """Whether every client is still running."""
        return all(c.proc.poll() is None for c in self.clients)


@contextlib.contextmanager
def bulk(tb, pairs: list[tuple[int, int, int]], seconds: float = 60, base_port: int = DEFAULT_PORT,
         interval: float = 0.5, extra: list[str] | None = None):
    """Bulk iperf3 traffic: for each ``(src_index, dst_index, streams)`` a server on dst and a client on src.

    Yields a ``Bulk``; everything is killed on exit, results or not.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for n, (_, dst, _) in enumerate(pairs):
            port = base_port + n
            stack.enter_context(iperf_server(tb.host(dst), port))
            ports.append(port)
        clients: list[IperfClient] = []
        try:
            for (src, dst, streams), port in zip(pairs, ports, strict=True):
                clients.append(IperfClient(tb.host(src), tb.host(dst).ip, port, seconds, streams, interval, extra))
            yield Bulk(clients, pairs)
        finally:
            for c in clients:
                c.kill()


# --- a single timed transfer (a flow that registers itself, like a training job's) ---------------------------------

def sink(bind: str, port: int, nbytes: int, timeout: float = 60.0) -> dict:
    """Accept one connection on ``bind:port``, read ``nbytes``, answer one byte; return what was seen."""
    import socket

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((bind, port))
        listener.listen(1)
        listener.settimeout(timeout)
        print("listening", flush=True)
        conn, peer = listener.accept()
        with conn:
            conn.settimeout(timeout)
            got, t_first = 0, None
            while got < nbytes:
                chunk = conn.recv(min(1 << 20, nbytes - got))
                if not chunk:
                    break
                if t_first is None:
                    t_first = time.perf_counter()
                got += len(chunk)
            t_last = time.perf_counter()
            conn.sendall(b"k")
    return {"peer": f"{peer[0]}:{peer[1]}", "bytes": got,
            "seconds": (t_last - t_first) if t_first is not None else None}


def _connect(dst: str, port: int, timeout: float, connect_timeout: float):
    """A TCP connection to ``dst:port``, retried for ``connect_timeout`` s (the receiver may not listen yet)."""
    import socket

    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            return socket.create_connection((dst, port), timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(dst: str, port: int, nbytes: int, agent_socket: str | None = None, job: str = "transfer",
         level: int = 0, timeout: float = 60.0, connect_timeout: float = 10.0) -> dict:
    """Connect to ``dst:port``, register the flow with the agent (if ``agent_socket``), send ``nbytes``, wait for
    the receiver's one-byte answer; return the flow, whether it was registered and the transfer time."""
    registered, error = False, None
    with _connect(dst, port, timeout, connect_timeout) as sock:
        sport = sock.getsockname()[1]
        flows = [f for f in own_tcp_flows(remote_filter=dst) if (f["sport"], f["dport"]) == (sport, port)]
        if agent_socket:
            registered, error = register_flows(agent_socket, job, level, flows)
        block = memoryview(b"\0" * (1 << 20))
        t0 = time.perf_counter()
        for start in range(0, nbytes, len(block)):
            sock.sendall(block[:min(len(block), nbytes - start)])
        ack = sock.recv(1)
        seconds = time.perf_counter() - t0
        if registered:
            unregister_flows(agent_socket, job, flows)
    return {"flows": flows, "registered": registered, "agent_error": error, "bytes": nbytes, "acked": ack == b"k",
            "seconds": seconds, "goodput_bps": nbytes * 8 / seconds if seconds > 0 else None}


def _start_sink(host, port: int, nbytes: int, timeout: float) -> subprocess.Popen:
    """``python -m bench.bulk sink`` on ``host``, once it says it listens (BulkError, and killed, if it does not)."""
    import select
    import sys

    proc = host.popen([sys.executable, "-m", "bench.bulk", "sink", "--port", str(port), "--bytes", str(nbytes),
                       "--timeout", f"{timeout:g}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=repo_env(), cwd=REPO_ROOT)
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    line = proc.stdout.readline() if ready else ""  # "listening" (or EOF if it died)
    if "listening" not in line:
        stop_process(proc, signal.SIGKILL)
        err = proc.stderr.read()[-1000:]
        _close(proc)
        raise BulkError(f"sink on {host.name}:{port} did not start: {err}")
    return proc


def timed_transfer(tb, src: int, dst: int, port: int, nbytes: int, agent_socket: str | None = None,
                   job: str = "transfer", level: int = 0, timeout: float = 60.0) -> dict:
    """One transfer of ``nbytes`` from testbed host ``src`` to ``dst`` (sender registered when ``agent_socket``);
    returns the sender's result with the receiver's under ``"sink"``. Both processes are bounded and killed."""
    import sys

    sink_proc = _start_sink(tb.host(dst), port, nbytes, timeout)
    try:
        argv = [sys.executable, "-m", "bench.bulk", "send", "--to", f"{tb.host(dst).ip}:{port}", "--bytes",
                str(nbytes), "--job", job, "--level", str(level), "--timeout", f"{timeout:g}"]
        if agent_socket:
            argv += ["--agent-socket", agent_socket]
        sender = tb.host(src).run(argv, check=False, timeout=timeout + 15, env=repo_env(), cwd=REPO_ROOT)
        if sender.returncode != 0:
            raise BulkError(f"sender on {tb.host(src).name} exited {sender.returncode}: {sender.stderr[-1000:]}")
        result = json.loads(sender.stdout.strip().splitlines()[-1])
        out, _ = sink_proc.communicate(timeout=10)
        result["sink"] = json.loads(out.strip().splitlines()[-1])
        return result
    finally:
        _close(sink_proc)


def main(argv=None) -> int:
    """``python -m bench.bulk sink|send ...``: the two ends of one timed transfer, JSON result on stdout."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.bulk")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sink", help="receive one transfer")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--timeout", type=float, default=60.0)
    c = sub.add_parser("send", help="send one transfer, registered with the agent if --agent-socket")
    c.add_argument("--to", required=True, metavar="ADDR:PORT")
    c.add_argument("--bytes", type=int, required=True)
    c.add_argument("--agent-socket")
    c.add_argument("--job", default="transfer")
    c.add_argument("--level", type=int, default=0)
    c.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.cmd == "sink":
        out = sink(args.bind, args.port, args.bytes, args.timeout)
    else:
        host, _, port = args.to.rpartition(":")
        out = send(host, int(port), args.bytes, args.agent_socket, args.job, args.level, args.timeout)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
