"""Per-packet cost of the candidate flow classifiers as a function of the number of registered flows N.

The issue: "Choose the mechanism for each with measurements (u32 filters, SO_PRIORITY and IP_TOS, nftables sets or
maps); per-packet cost must not grow linearly with the number of registered flows." This benchmark measures, side
by side in one run, the throughput of one CPU-bound TCP stream through the agent's egress tree for:

- ``none``: the HTB tree alone, no classifier (every packet in the default class): the reference.
- ``so-priority``: no classifier; the sending socket sets ``IP_TOS`` (the DSCP) and then ``SO_PRIORITY`` (the class
  id), the order that works: setting IP_TOS resets SO_PRIORITY. The zero-lookup baseline.
- ``nft-map``: the agent's own table (``agent.kernel.nft.table_commands`` + ``element_commands``) with N flows in
  its verdict map, the measured flow one of them; the level chain sets ``meta priority`` and the DSCP.
- ``u32-linear``: N u32 filters on the root qdisc, one per 5-tuple (protocol, source, destination, ports), the
  measured flow last (the worst case). One u32 hash table holds at most 4095 nodes, so the filters are spread over
  priorities of ``U32_PER_PRIO`` each (the kernel walks the priorities in order, each list linearly).

Every measurement builds fresh: two network namespaces ``tlc{pid}-{k}a`` / ``...b`` (198.18.250.1/24 and .2, the
benchmarking range, no other route), a veth pair, on the sender's egress the agent's own HTB tree
(``HtbBackend(levels=3, link_rate_bps=100 Gbit/s)``: a rate far above what the CPU pushes, so the stream is
CPU-bound) and the mechanism. The sender's veth gets ``gso_max_segs 1`` (unless ``--gso``), so that every MTU-sized
packet, not a 64 KB GSO burst, goes through the classifier: the throughput then reflects the per-packet cost. The
sender and the sink (small Python programs, the same for every mechanism: iperf3 cannot set SO_PRIORITY) are pinned
to one CPU, so the packets per second measure the whole per-packet CPU cost, classification included. After the
transfer the HTB class counters say which class the stream went to (``class_ok``).

Repetitions are interleaved (every round measures every configuration, in a rotated order); reported: the median
Gbit/s, its ratio to ``none`` and the extra CPU time per packet relative to ``none``
(``1/pps - 1/pps_none``, in ns).

Usage: ``python -m bench.classifier --json out.json [--quick]`` (root), or ``run(quick=True)`` from Python. The
``_setup``/``_send``/``_sink`` sub-commands are this module's own children, run inside a namespace.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Self

from bench.workers import REPO_ROOT, repo_env, stop_process

MECHANISMS = ("none", "so-priority", "nft-map", "u32-linear")
FULL_N = {"nft-map": (1, 1000, 10000), "u32-linear": (1, 100, 1000, 4000, 10000)}
QUICK_N = {"nft-map": (1, 1000), "u32-linear": (1, 1000)}
FULL_SECONDS, QUICK_SECONDS = 3.0, 1.0
FULL_ROUNDS, QUICK_ROUNDS = 3, 1

NS_PREFIX = "tlc"
IF_A, IF_B = "tlc0", "tlc1"
SRC, DST, PLEN = "198.18.250.1", "198.18.250.2", 24
PORT, CPORT = 5201, 40001            # the measured flow: tcp SRC:CPORT -> DST:PORT
LEVELS, LINK_RATE_BPS = 3, 100 * 10**9
LEVEL = 0                            # the measured flow's level
DSCP = (46, 34, 26)                  # per level (the agent's defaults: EF, AF41, AF31)
U32_PER_PRIO = 2000                  # u32 filters per priority (auto handles 800..fff of one hash table)
MSS_FALLBACK = 1448

CMD_TIMEOUT_S = 30.0                 # any single ip/tc/setup command
SETUP_TIMEOUT_S = 120.0              # the in-namespace set-up (10k u32 filters through pyroute2 are slow)


class BenchError(RuntimeError):
    """A step failed; the message names it and includes the command's stderr."""


# ---- small helpers ----------------------------------------------------------------------------------------

def _sh(argv: list[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (bounded, output captured); BenchError on a timeout or, with ``check``, a failure."""
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, env=repo_env(),
                              cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BenchError(f"'{' '.join(argv)}' timed out after {timeout:g} s") from None
    if check and proc.returncode != 0:
        raise BenchError(f"'{' '.join(argv[:8])}...' failed ({proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc


def _me(ns: str, sub: str, *args: str) -> list[str]:
    """argv running this module's sub-command ``sub`` inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.classifier", sub, *args]


def flow_keys(n: int):
    """The N registered flows: the measured one last, N-1 others between the same two hosts (other ports).

    Same addresses and protocol, so that a u32 filter of another flow mismatches only at its last key (the
    worst case for a linear list; a hash does not care)."""
    from tensorlane.agent.protocol import FlowKey

    others = [FlowKey("tcp", SRC, 10000 + i % 50000, DST, 6000 + i // 50000) for i in range(max(n - 1, 0))]
    return [*others, FlowKey("tcp", SRC, CPORT, DST, PORT)] if n > 0 else []


def _classids() -> tuple[list[int], int]:
    """The agent's HTB class id per level, and its default class id."""
    from tensorlane.agent.kernel.qdisc import HtbBackend

    backend = HtbBackend(levels=LEVELS, link_rate_bps=LINK_RATE_BPS)
    return [backend.classid(lvl) for lvl in range(LEVELS)], backend.default.classid


def _fmt_class(h: int) -> str:
    """A tc handle as tc prints it (``7a1:10``)."""
    from tensorlane.agent.kernel.qdisc import fmt_handle

    return fmt_handle(h)


def _u32_keys(key) -> list[tuple[int, int, int]]:
    """(value, mask, offset from the IP header) of the four 32-bit words u32 compares (IHL 5 assumed)."""
    def ip(a: str) -> int:
        return int.from_bytes(socket.inet_aton(a), "big")

    proto = {"tcp": 6, "udp": 17}[key.proto]
    return [(proto << 16, 0x00FF0000, 8), (ip(key.src), 0xFFFFFFFF, 12), (ip(key.dst), 0xFFFFFFFF, 16),
            ((key.sport << 16) | key.dport, 0xFFFFFFFF, 20)]


def _u32_plan(n: int) -> list[tuple[int, object, int]]:
    """(prio, flow, target class) for the N filters, in list order (the measured flow last, to level 0)."""
    classids, _ = _classids()
    keys = flow_keys(n)
    return [(1 + i // U32_PER_PRIO, k, classids[LEVEL] if i == n - 1 else classids[i % LEVELS])
            for i, k in enumerate(keys)]


def u32_batch_lines(n: int, dev: str = IF_A) -> list[str]:
    """``tc -batch`` lines adding the N u32 filters (the same messages as pyroute2's ``add-filter``)."""
    lines = []
    for prio, key, target in _u32_plan(n):
        matches = " ".join(f"match u32 0x{v:08x} 0x{m:08x} at {off}" for v, m, off in _u32_keys(key))
        lines.append(f"filter add dev {dev} parent 7a1: protocol ip prio {prio} u32 {matches} "
                     f"flowid {_fmt_class(target)}")
    return lines


# ---- children run inside a namespace ----------------------------------------------------------------------

def _child_setup(args) -> dict:
    """In the sender's namespace: the agent's HTB tree, then the mechanism's classifier (nft map, or u32 filters
    through pyroute2 when asked)."""
    from pyroute2 import IPRoute

    from tensorlane.agent.kernel.qdisc import HtbBackend

    out = {}
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=args.ifname)[0]
        HtbBackend(levels=LEVELS, link_rate_bps=LINK_RATE_BPS).apply(ipr, index)
        if args.mech == "u32-linear" and args.u32_via == "pyroute2":
            t0 = time.monotonic()
            for prio, key, target in _u32_plan(args.n):
                ipr.tc("add-filter", "u32", index=index, parent=0x7A10000, prio=prio, protocol=0x0800,
                       target=target, keys=[f"0x{v:08x}/0x{m:08x}+{off}" for v, m, off in _u32_keys(key)])
            out["classifier_setup_s"] = time.monotonic() - t0
    if args.mech == "nft-map":
        from tensorlane.agent.kernel import nft

        classids, _ = _classids()
        t0 = time.monotonic()
        ctx = nft.Nft()
        try:
            ctx.run(nft.table_commands([args.ifname], classids, list(DSCP)))
            items = [(k, LEVEL if (k.sport, k.dport) == (CPORT, PORT) else i % LEVELS)
                     for i, k in enumerate(flow_keys(args.n))]
            for start in range(0, len(items), 5000):
                ctx.run(nft.element_commands("add", items[start:start + 5000]))
            out["classifier_setup_s"] = time.monotonic() - t0
            out["elements"] = len(nft.parse_map_elements(nft.list_table(ctx)))
        finally:
            ctx.close()
    return out


def _pin(cpu: int) -> None:
    """Pin this process to ``cpu`` (-1: leave it)."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _child_sink(args) -> dict:
    """Accept one connection, count what arrives until EOF; the rate is taken after ``warmup`` seconds."""
    _pin(args.cpu)
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((args.addr, args.port))
    ls.listen(1)
    ls.settimeout(args.timeout)
    print("ready", flush=True)
    conn, peer = ls.accept()
    conn.settimeout(10.0)
    buf = bytearray(1 << 20)
    total, t_first, mark, cpu0 = 0, None, None, 0.0
    deadline = time.monotonic() + args.timeout
    while True:
        k = conn.recv_into(buf)
        now = time.monotonic()
        if k == 0:
            break
        if t_first is None:
            t_first, cpu0 = now, _cpu_s()
        total += k
        if mark is None and now - t_first >= args.warmup:
            mark = (now, total)
        if now > deadline:
            raise TimeoutError("sink: transfer still running at its deadline")
    cpu = _cpu_s() - cpu0
    conn.close()
    if t_first is None:
        raise RuntimeError("sink: the connection closed without data")
    if mark is None or now - mark[0] <= 0.05:
        mark = (t_first, 0)
    return {"peer": list(peer), "bytes": total, "seconds": now - t_first,
            "bps": (total - mark[1]) * 8 / (now - mark[0]), "cpu_s": cpu}


def _child_send(args) -> dict:
    """Connect from ``cport`` (so the 5-tuple is known), optionally with IP_TOS then SO_PRIORITY, and write for
    ``seconds``."""
    _pin(args.cpu)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.tos is not None:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.tos)      # first: IP_TOS resets SO_PRIORITY
    if args.priority is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, args.priority)
    s.bind((args.src, args.cport))
    s.settimeout(10.0)
    s.connect((args.dst, args.port))
    mss = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    buf = memoryview(bytearray(1 << 20))
    cpu0, sent = _cpu_s(), 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        s.sendall(buf)
        sent += len(buf)
    cpu = _cpu_s() - cpu0
    s.shutdown(socket.SHUT_WR)
    s.recv(1)                                   # the sink closes after EOF: everything was received
    prio = s.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)
    tos = s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)
    s.close()
    return {"bytes": sent, "mss": mss, "cpu_s": cpu, "so_priority": prio, "ip_tos": tos}


def socket_facts() -> dict:
    """What the kernel does with SO_PRIORITY: is it reset by a later IP_TOS, may an unprivileged user set it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    classids, _ = _classids()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, classids[LEVEL])
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, DSCP[LEVEL] << 2)
        after = s.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY)
    finally:
        s.close()
    unpriv = None
    if os.geteuid() == 0:
        unpriv = _unprivileged_may_set_priority(classids[LEVEL])
    return {"so_priority_after_ip_tos": after, "ip_tos_resets_so_priority": after != classids[LEVEL],
            "unprivileged_may_set_class_priority": unpriv}


def _unprivileged_may_set_priority(priority: int) -> bool | None:
    """Whether uid/gid 65534 without capabilities may set SO_PRIORITY to ``priority`` (a forked child tries)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        code = 3
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, priority)
            code = 0
        except PermissionError:
            code = 1
        except BaseException:  # noqa: BLE001 - anything else: unknown
            code = 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {0: True, 1: False}.get(os.waitstatus_to_exitcode(status))
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


# ---- one measurement --------------------------------------------------------------------------------------

_SERIAL = [0]


class Pair:
    """Two fresh namespaces joined by a veth pair; the sender's egress has the agent's HTB tree. A context
    manager: the namespaces (and every process started through ``popen``) are gone on exit, whatever happened."""

    def __init__(self):
        _SERIAL[0] += 1
        base = f"{NS_PREFIX}{os.getpid()}-{_SERIAL[0]}"
        self.a, self.b = base + "a", base + "b"
        self.procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        """Create the namespaces, the veth pair, the addresses; bring the links up."""
        for ns in (self.a, self.b):
            _sh(["ip", "netns", "add", ns])
            self.created.append(ns)
        _sh(["ip", "link", "add", IF_A, "netns", self.a, "type", "veth", "peer", "name", IF_B, "netns", self.b])
        for ns, ifname, addr in ((self.a, IF_A, SRC), (self.b, IF_B, DST)):
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/{PLEN}", "dev", ifname])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", ns, "link", "set", ifname, "up"])

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` (text pipes), to be killed by ``close``."""
        proc = subprocess.Popen(argv, env=repo_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.procs.append(proc)
        return proc

    def class_bytes(self) -> dict[str, int]:
        """Bytes sent per HTB leaf class on the sender's veth."""
        text = _sh(["tc", "-n", self.a, "-s", "class", "show", "dev", IF_A]).stdout
        return {m.group(1): int(m.group(2))
                for m in re.finditer(r"^class htb (\S+) parent 7a1:1 .*?\n\s*Sent (\d+) bytes", text,
                                      re.MULTILINE | re.DOTALL)}

    def close(self) -> None:
        """Kill every process started here and delete the namespaces (signals deferred meanwhile)."""
        with _signals_deferred():
            for proc in self.procs:
                stop_process(proc, signal.SIGKILL)
            for ns in reversed(self.created):
                _delete_netns(ns)
            self.created.clear()


def _delete_netns(ns: str) -> None:
    """Kill what still runs in ``ns`` (only our own namespaces get here) and delete it."""
    pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        if pid.isdigit() and int(pid) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    _sh(["ip", "netns", "del", ns], check=False)


@contextlib.contextmanager
def _signals_deferred():
    """Ignore SIGINT and SIGTERM while the body runs (clean-up is not cut short); a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def remove_stale_namespaces() -> list[str]:
    """Delete ``tlc{pid}-...`` namespaces left by a run of this benchmark whose process is gone."""
    removed = []
    for line in _sh(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{NS_PREFIX}(\d+)-\d+[ab]", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_netns(name)
            removed.append(name)
    return removed


def _read_json_result(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    """The last JSON line a child printed (bounded wait); BenchError, child killed, if it fails or hangs."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc, signal.SIGKILL)
        raise BenchError(f"{what} still running after {timeout:g} s") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"{what} failed ({proc.returncode}): {(err or out).strip()[-800:]}")
    return json.loads(lines[-1])


def _wait_ready(proc: subprocess.Popen, what: str, timeout: float = 15.0) -> None:
    """Wait (bounded) for the child's "ready" line; BenchError with its stderr, child killed, if it does not come."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if line.strip() == "ready":
                return
            if not line:
                break
    stop_process(proc, signal.SIGKILL)
    raise BenchError(f"{what} did not become ready: {proc.stderr.read()[-800:] if proc.stderr else ''}")


def measure(mech: str, n: int | None, seconds: float, cpu: int = -1, gso: bool = False,
            u32_via: str = "tc") -> dict:
    """One measurement on a fresh pair of namespaces; returns the sink's rate and where the stream went."""
    if mech not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mech!r}")
    classids, default = _classids()
    t_setup = time.monotonic()
    with Pair() as pair:
        if not gso:
            _sh(["ip", "-n", pair.a, "link", "set", IF_A, "gso_max_segs", "1"])
        setup = json.loads(_sh(_me(pair.a, "_setup", "--mech", mech, "--n", str(n or 0), "--ifname", IF_A,
                                   "--u32-via", u32_via), timeout=SETUP_TIMEOUT_S).stdout.strip().splitlines()[-1])
        if mech == "u32-linear" and u32_via == "tc" and n:
            with tempfile.NamedTemporaryFile("w", prefix="tlc-u32-", suffix=".tc") as f:
                f.write("\n".join(u32_batch_lines(n)) + "\n")
                f.flush()
                t0 = time.monotonic()
                _sh(["tc", "-n", pair.a, "-batch", f.name], timeout=SETUP_TIMEOUT_S)
                setup["classifier_setup_s"] = time.monotonic() - t0
        setup_s = time.monotonic() - t_setup
        sink = pair.popen(_me(pair.b, "_sink", "--addr", DST, "--port", str(PORT), "--cpu", str(cpu),
                              "--warmup", f"{min(0.5, seconds / 4):g}", "--timeout", f"{seconds + 30:g}"))
        _wait_ready(sink, "the sink")
        send_args = ["--src", SRC, "--dst", DST, "--port", str(PORT), "--cport", str(CPORT),
                     "--seconds", f"{seconds:g}", "--cpu", str(cpu)]
        if mech == "so-priority":
            send_args += ["--tos", str(DSCP[LEVEL] << 2), "--priority", str(classids[LEVEL])]
        sender = pair.popen(_me(pair.a, "_send", *send_args))
        sent = _read_json_result(sender, "the sender", seconds + 30)
        got = _read_json_result(sink, "the sink", 15)
        per_class = pair.class_bytes()
    expect = _fmt_class(default if mech == "none" or (mech == "u32-linear" and not n) else classids[LEVEL])
    top = max(per_class, key=per_class.get) if per_class else None
    mss = sent.get("mss") or MSS_FALLBACK
    packets = got["bytes"] / mss
    return {"mechanism": mech, "n": n, "gbps": got["bps"] / 1e9, "bytes": got["bytes"], "seconds": got["seconds"],
            "mss": mss, "cpu_ns_per_packet": (got["cpu_s"] + sent["cpu_s"]) * 1e9 / packets if packets else None,
            "class": top, "class_expected": expect,
            "class_ok": bool(top == expect and per_class[top] >= 0.95 * sum(per_class.values())),
            "so_priority": sent.get("so_priority"), "setup_s": setup_s,
            "classifier_setup_s": setup.get("classifier_setup_s"), "nft_elements": setup.get("elements")}


# ---- the run ----------------------------------------------------------------------------------------------

def configurations(quick: bool, n_nft=None, n_u32=None) -> list[tuple[str, int | None]]:
    """Every (mechanism, N) to measure: the two without a classifier, then nft-map and u32-linear per N."""
    ns = QUICK_N if quick else FULL_N
    nft_ns = tuple(n_nft) if n_nft else ns["nft-map"]
    u32_ns = tuple(n_u32) if n_u32 else ns["u32-linear"]
    return [("none", None), ("so-priority", None), *(("nft-map", n) for n in nft_ns),
            *(("u32-linear", n) for n in u32_ns)]


def _default_cpu() -> int:
    """The CPU sender and sink are pinned to by default: the last one this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1]


def summarize(runs: list[dict]) -> list[dict]:
    """Median per (mechanism, N), the ratio to ``none`` and the extra ns per packet relative to ``none``."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["mechanism"], r["n"]), []).append(r)
    base = groups.get(("none", None))
    base_gbps = statistics.median(r["gbps"] for r in base) if base else None
    base_mss = base[0]["mss"] if base else MSS_FALLBACK
    out = []
    for (mech, n), rs in groups.items():
        gbps = statistics.median(r["gbps"] for r in rs)
        cpu = [r["cpu_ns_per_packet"] for r in rs if r.get("cpu_ns_per_packet")]
        row = {"mechanism": mech, "n": n, "gbps_median": gbps, "gbps_all": [r["gbps"] for r in rs],
               "ratio_to_none": gbps / base_gbps if base_gbps else None,
               "extra_ns_per_packet": None, "cpu_ns_per_packet_median": statistics.median(cpu) if cpu else None,
               "setup_s_median": statistics.median(r["setup_s"] for r in rs),
               "class": rs[0]["class"], "class_ok": all(r["class_ok"] for r in rs)}
        if base_gbps and gbps > 0:
            mss = rs[0]["mss"]
            row["extra_ns_per_packet"] = 1e9 * (mss * 8 / (gbps * 1e9) - base_mss * 8 / (base_gbps * 1e9))
        out.append(row)
    order = {m: i for i, m in enumerate(MECHANISMS)}
    out.sort(key=lambda r: (order[r["mechanism"]], r["n"] or 0))
    return out


def run(quick: bool = False, rounds: int | None = None, seconds: float | None = None, cpu: int | None = None,
        gso: bool = False, n_nft=None, n_u32=None, u32_via: str = "tc", progress=None) -> dict:
    """Measure every (mechanism, N) ``rounds`` times, interleaved; return the JSON-able result."""
    if os.geteuid() != 0:
        raise BenchError("bench.classifier needs root (network namespaces, tc, nftables)")
    rounds = rounds or (QUICK_ROUNDS if quick else FULL_ROUNDS)
    seconds = seconds or (QUICK_SECONDS if quick else FULL_SECONDS)
    cpu = _default_cpu() if cpu is None else cpu
    progress = progress or (lambda msg: None)
    configs = configurations(quick, n_nft, n_u32)
    started = time.time()
    remove_stale_namespaces()
    runs: list[dict] = []
    owner = os.getpid()

    def _interrupt(signum, frame):
        if os.getpid() != owner:
            os._exit(1)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        for rnd in range(rounds):
            shift = (rnd * len(configs)) // rounds
            order = configs[shift:] + configs[:shift]
            if rnd % 2:
                order.reverse()
            for mech, n in order:
                r = measure(mech, n, seconds, cpu=cpu, gso=gso, u32_via=u32_via)
                r["round"] = rnd
                runs.append(r)
                progress(f"round {rnd + 1}/{rounds} {mech:11s} N={'-' if n is None else n:>6}: "
                         f"{r['gbps']:6.2f} Gbit/s  class {r['class']} ({'ok' if r['class_ok'] else 'WRONG'})  "
                         f"setup {r['setup_s']:.1f} s")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return {"benchmark": "classifier", "quick": quick, "rounds": rounds, "seconds": seconds, "cpu": cpu,
            "gso": gso, "u32_via": u32_via, "u32_per_prio": U32_PER_PRIO, "kernel": platform.release(),
            "cpus": os.cpu_count(), "started": started, "elapsed_s": time.time() - started,
            "mechanisms": list(MECHANISMS), "facts": socket_facts(), "runs": runs, "results": summarize(runs)}


def format_table(result: dict) -> str:
    """The end-of-run table: per (mechanism, N) the median rate, its ratio to ``none``, the extra ns per packet."""
    header = (f"{'mechanism':12s} {'N':>6s} {'Gbit/s':>7s} {'x none':>7s} {'+ns/pkt':>8s} {'cpu ns/pkt':>10s} "
              f"{'setup s':>7s}  class")
    lines = [header]
    for r in result["results"]:
        extra = "" if r["extra_ns_per_packet"] is None else f"{r['extra_ns_per_packet']:8.0f}"
        cpu = "" if r["cpu_ns_per_packet_median"] is None else f"{r['cpu_ns_per_packet_median']:10.0f}"
        ratio = "" if r["ratio_to_none"] is None else f"{r['ratio_to_none']:7.2f}"
        lines.append(f"{r['mechanism']:12s} {'-' if r['n'] is None else r['n']:>6} {r['gbps_median']:7.2f} "
                     f"{ratio:>7s} {extra:>8s} {cpu:>10s} {r['setup_s_median']:7.1f}  {r['class']}"
                     f"{'' if r['class_ok'] else ' (WRONG)'}")
    f = result.get("facts", {})
    lines.append(f"IP_TOS after SO_PRIORITY resets it: {f.get('ip_tos_resets_so_priority')}; "
                 f"unprivileged user may set SO_PRIORITY to a class id: {f.get('unprivileged_may_set_class_priority')}")
    return "\n".join(lines)


def _children(argv: list[str]) -> int:
    """``python -m bench.classifier _setup|_sink|_send ARGS``: one child's job, its JSON result on stdout."""
    p = argparse.ArgumentParser(prog=f"python -m bench.classifier {argv[0]}")
    sub = argv[0]
    if sub == "_setup":
        p.add_argument("--mech", required=True)
        p.add_argument("--n", type=int, default=0)
        p.add_argument("--ifname", required=True)
        p.add_argument("--u32-via", default="tc", choices=("tc", "pyroute2"))
        fn = _child_setup
    elif sub == "_sink":
        p.add_argument("--addr", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--cpu", type=int, default=-1)
        p.add_argument("--warmup", type=float, default=0.5)
        p.add_argument("--timeout", type=float, default=60)
        fn = _child_sink
    elif sub == "_send":
        for name in ("--src", "--dst"):
            p.add_argument(name, required=True)
        for name in ("--port", "--cport"):
            p.add_argument(name, type=int, required=True)
        p.add_argument("--seconds", type=float, default=3)
        p.add_argument("--cpu", type=int, default=-1)
        p.add_argument("--tos", type=int)
        p.add_argument("--priority", type=int)
        fn = _child_send
    else:
        print(f"unknown sub-command {sub}", file=sys.stderr)
        return 2
    args = p.parse_args(argv[1:])
    signal.signal(signal.SIGALRM, lambda *_: sys.exit(f"{sub}: timed out"))
    signal.alarm(int(SETUP_TIMEOUT_S + 60 + getattr(args, "seconds", 0) + getattr(args, "timeout", 0)))
    print(json.dumps(fn(args)), flush=True)
    return 0


def _ints(text: str) -> list[int]:
    """``"1,1000"`` as ``[1, 1000]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.classifier [--quick] [--json FILE]`` (or a child's sub-command): run, print the table."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("_"):
        return _children(argv)
    p = argparse.ArgumentParser(prog="python -m bench.classifier", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the result here")
    p.add_argument("--quick", action="store_true", help="few N, 1 s runs, 1 round (a smoke test, < 40 s)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--cpu", type=int, help="pin sender and sink to this CPU (-1: no pinning; default: the last)")
    p.add_argument("--gso", action="store_true", help="keep GSO on the sender's veth (64 KB bursts per lookup)")
    p.add_argument("--n-nft", type=_ints, help="comma-separated N for nft-map")
    p.add_argument("--n-u32", type=_ints, help="comma-separated N for u32-linear")
    p.add_argument("--u32-via", choices=("tc", "pyroute2"), default="tc",
                   help="install the u32 filters with `tc -batch` (fast) or pyroute2 add-filter (~3 ms each)")
    args = p.parse_args(argv)
    try:
        result = run(quick=args.quick, rounds=args.rounds, seconds=args.seconds, cpu=args.cpu, gso=args.gso,
                     n_nft=args.n_nft, n_u32=args.n_u32, u32_via=args.u32_via,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    except BenchError as exc:
        print(f"bench.classifier: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.classifier: interrupted (namespaces removed)", file=sys.stderr)
        return 130
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
