"""Control-plane benchmark: registration latency and agent memory with 0, 1,000 and 10,000 flows registered,
bulk throughput through the host queue at each size, and a soak of many concurrent clients.

Figures (keys of the JSON): per size ``register_p50_ms``, ``register_p99_ms`` (one-flow register round trips,
client side, through the Unix socket, including the nftables transaction), ``throughput_bps`` and
``throughput_ratio`` (iperf3 host1 -> host2 relative to 0 flows, same run), ``agent_rss_bytes``; and ``soak``:
clients, seconds, operations, errors, p99, and whether flows, map elements, tc classes, agent fds and memory
returned to their baseline; and ``busy_host``: with ``sockets`` open TCP sockets in the agent's namespace and
``owners`` owner processes with registered flows (the ownership sweep checks them every 0.5 s), the agent's CPU
(``agent_cpu_ratio``: cores used over ``window_s``, from /proc/PID/stat) and ``register_p99_ms`` (one-flow register
round trips of the owners, ownership checked). Usage: ``python -m bench.control_plane --json out.json [--quick]``;
``--busy-host-only --json out.json`` runs only that part and merges it into the file.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

from bench.agents import running_agents
from bench.bulk import iperf_server, run_client
from bench.workers import REPO_ROOT, repo_env, stop_process, write_json
from tensorlane.client import AgentClient, AgentError, AgentUnavailable
from tensorlane.flows import socket_inodes
from testbed import Testbed

BATCH = 500  # flows per request: under the 64 KiB message limit


def synthetic_flows(start: int, count: int, src: str = "198.18.0.1", dst: str = "198.18.0.2") -> list[dict]:
    """``count`` distinct flows numbered from ``start`` (ports and a spread of destination addresses)."""
    return [{"proto": "tcp", "src": src, "sport": 1024 + (i % 60000), "dst": f"198.18.{2 + i // 60000}.{(i % 250) + 2}"
             if dst is None else dst, "dport": 5000 + i // 60000} for i in range(start, start + count)]


def fill(path: str, target: int, have: int) -> None:
    """Register filler flows until ``target`` are registered (job ``filler``)."""
    with AgentClient(path, timeout=30) as agent:
        for start in range(have, target, BATCH):
            agent.register("filler", 3, synthetic_flows(start, min(BATCH, target - start), dst=None))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation). Usage: ``percentile(lat, 0.99)``"""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(path: str, rounds: int) -> list[float]:
    """One-flow register + unregister round trips; returns the register latencies in ms."""
    out = []
    with AgentClient(path, timeout=5) as agent:
        for i in range(rounds):
            flow = [{"proto": "udp", "src": "198.18.0.1", "sport": 20000 + i % 1000, "dst": "198.18.0.2",
                     "dport": 7000}]
            t0 = time.perf_counter()
            agent.register("probe", 0, flow)
            out.append((time.perf_counter() - t0) * 1000)
            agent.unregister("probe", flow)
    return out


def agent_rss(pid: int) -> int:
    """The resident memory of process ``pid`` in bytes (0 if /proc does not say)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def kernel_objects(host, pid: int) -> dict:
    """What the agent holds in the kernel and in its process, to compare with a baseline."""
    elems = 0
    for fam in (4, 6):
        out = host.run(["nft", "-j", "list", "map", "inet", "tensorlane", f"flows{fam}"]).stdout
        elems += len(json.loads(out)["nftables"][1]["map"].get("elem", []))
    classes = host.run(["tc", "class", "show", "dev", "eth0"]).stdout.count("class ")
    return {"map_elements": elems, "tc_classes": classes, "agent_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def settled_objects(host, pid: int, timeout_s: float = 5.0) -> dict:
    """:func:`kernel_objects` once two samples 0.3 s apart agree (up to ``timeout_s``): a client's connection
    being closed or the journal being written holds an fd for a moment, which is not a leak."""
    deadline, last = time.monotonic() + timeout_s, kernel_objects(host, pid)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        cur = kernel_objects(host, pid)
        if cur == last:
            break
        last = cur
    return last


def soak(path: str, clients: int, seconds: float, levels: int) -> dict:
    """``clients`` threads, each on its own connection, register and unregister 5 flows in a loop."""
    ops, errors, lat = [0] * clients, [], []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        flows = [{"proto": "tcp", "src": "198.18.0.1", "sport": 30000 + (i * 5 + k) % 30000, "dst": "198.18.0.2",
                  "dport": 9000 + (i * 5 + k) // 30000} for k in range(5)]
        mine = []
        try:
            with AgentClient(path, timeout=10) as agent:
                start.wait(30)
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    agent.register(f"soak{i}", i % levels, flows)
                    mine.append((time.perf_counter() - t0) * 1000)
                    agent.unregister(f"soak{i}", flows)
                    ops[i] += 2
        except (AgentError, AgentUnavailable, OSError, threading.BrokenBarrierError) as exc:
            with lock:
                errors.append(f"client {i}: {exc}")
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait(60)
    for t in threads:
        t.join(seconds + 60)
    return {"clients": clients, "seconds": seconds, "operations": sum(ops), "errors": len(errors),
            "error_samples": errors[:5], "ops_per_s": sum(ops) / seconds,
            "register_p50_ms": percentile(lat, 0.5) if lat else None,
            "register_p99_ms": percentile(lat, 0.99) if lat else None}


BUSY_LISTEN_PORT = 5402  # the owners' peers listen here on host 2
SOCKETS_PER_HOLDER = 8000  # under the usual hard RLIMIT_NOFILE, which a container may not let even root raise


def hold_sockets(count: int) -> None:
    """Child process: open ``count`` TCP sockets as established loopback pairs, print "ready", hold them until
    stdin closes. Usage: ``python -c "from bench.control_plane import hold_sockets; hold_sockets(20000)"``"""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    lst = socket.create_server(("127.0.0.1", 0), backlog=4096)
    held = []
    for _ in range(count // 2):
        held.append(socket.create_connection(lst.getsockname()))
        held.append(lst.accept()[0])
    print("ready", flush=True)
    sys.stdin.read()


def accept_forever(port: int) -> None:
    """Child process: listen on ``port``, print "ready", accept TCP connections and hold them (the owners' peer
    on host 2)."""
    lst = socket.create_server(("0.0.0.0", port), backlog=1024)
    print("ready", flush=True)
    held = []
    while True:
        held.append(lst.accept()[0])


def owner_process(path: str, job: str, flows: int, rounds: int, peer: str, port: int) -> None:
    """Child process: open ``flows`` + 1 connections to ``peer``, register ``flows`` of them as ``job`` (so the
    sweep checks them), print "ready"; on each line from stdin, time ``rounds`` one-flow register round trips of
    the last connection on a new agent connection (each flow unregistered again) and print the latencies in ms as
    JSON; exit when stdin closes."""
    conns = [socket.create_connection((peer, port)) for _ in range(flows + 1)]
    keys = [{"proto": "tcp", "src": c.getsockname()[0], "sport": c.getsockname()[1], "dst": peer, "dport": port}
            for c in conns]
    with AgentClient(path, timeout=10) as agent:  # the flows stay with the process, not the connection
        agent.register(job, 1, keys[:-1])
    print("ready", flush=True)
    for _ in sys.stdin:
        lat = []
        with AgentClient(path, timeout=10) as agent:  # a new connection: the agent closes idle ones
            for _ in range(rounds):
                t0 = time.perf_counter()
                agent.register(job, 1, keys[-1:])
                lat.append((time.perf_counter() - t0) * 1000)
                agent.unregister(job, keys[-1:])
        print(json.dumps(lat), flush=True)


def register_rounds(owner_procs: list[subprocess.Popen]) -> list[float]:
    """Let each owner process do its register rounds, one after the other; all their latencies in ms."""
    lat: list[float] = []
    for i, proc in enumerate(owner_procs):
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"owner {i} failed during its register rounds (exit {proc.poll()})")
        lat += json.loads(line)
    return lat


def _child(host, func: str, *args) -> subprocess.Popen:
    """Start ``func(*args)`` of this module in a Python process in ``host``'s namespace, stdin and stdout piped."""
    code = f"from bench.control_plane import {func}; {func}(*{args!r})"
    return host.popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                      env=repo_env(), cwd=REPO_ROOT)


def _expect_ready(proc: subprocess.Popen, what: str) -> None:
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {line!r}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, in seconds (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_host(tb, agent, sockets: int = 20000, owners: int = 8, flows: int = 40, window_s: float = 60,
              rounds: int = 50) -> dict:
    """The busy-host scenario on host 1 of ``tb`` (``agent``: its agent, ownership checked for root): ``owners``
    processes with ``flows`` registered flows each do ``rounds`` register round trips each on the quiet host
    (``quiet_register_p99_ms``); then processes open ``sockets`` TCP sockets, the agent's CPU is measured over
    ``window_s`` while the sweep runs, and the owners do their rounds again (``register_p99_ms``)."""
    h1, h2 = tb.host(1), tb.host(2)
    procs = [_child(h2, "accept_forever", BUSY_LISTEN_PORT)]
    try:
        _expect_ready(procs[0], "the owners' peer")
        owner_procs = [_child(h1, "owner_process", agent.socket, f"busy{i}", flows, rounds, h2.ip, BUSY_LISTEN_PORT)
                       for i in range(owners)]
        procs += owner_procs
        for i, proc in enumerate(owner_procs):
            _expect_ready(proc, f"owner {i}")
        quiet = register_rounds(owner_procs)
        holders = [_child(h1, "hold_sockets", min(SOCKETS_PER_HOLDER, sockets - start))
                   for start in range(0, sockets, SOCKETS_PER_HOLDER)]
        procs += holders
        for proc in holders:
            _expect_ready(proc, "a socket holder")
        held = sum(len(socket_inodes(proc.pid)) for proc in holders)
        time.sleep(1.0)
        cpu0, t0 = cpu_seconds(agent.proc.pid), time.monotonic()
        time.sleep(window_s)
        ratio = (cpu_seconds(agent.proc.pid) - cpu0) / (time.monotonic() - t0)
        with AgentClient(agent.socket) as c:
            kept = c.status()["flows"]
        lat = register_rounds(owner_procs)
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            stop_process(proc, wait_s=2)
    return {"sockets": held, "owners": owners, "flows_per_owner": flows, "flows_kept": kept,
            "window_s": window_s, "agent_cpu_ratio": ratio, "rounds": len(lat),
            "register_p50_ms": statistics.median(lat), "register_p99_ms": percentile(lat, 0.99),
            "quiet_register_p50_ms": statistics.median(quiet), "quiet_register_p99_ms": percentile(quiet, 0.99),
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


def run_busy_host(quick: bool = False, name: str = "tkb", **kw) -> dict:
    """Only the busy-host scenario, on its own 2-host testbed (quick: 2,000 sockets, a 5 s window)."""
    if quick:
        kw = {"sockets": 2000, "window_s": 5, "rounds": 20} | kw
    with Testbed(hosts=2, rate="1gbit", name=name) as tb, running_agents(tb, hosts=[1], levels=4) as ags:
        return busy_host(tb, ags[1], **kw)


def run(sizes=(0, 1000, 10000), rounds: int = 400, iperf_s: float = 5, clients: int = 200, soak_s: float = 60,
        rate: str = "1gbit", quick: bool = False, progress=print, name: str = "tk") -> dict:
    """Run the whole benchmark on a fresh 2-host testbed; returns the figures."""
    if quick:
        sizes, rounds, iperf_s, clients, soak_s = (0, 1000), 100, 2, 20, 3
    from bench.workers import machine_info

    result: dict = {"rate": rate, "sizes": {}, "machine": machine_info(), "quick": quick, "rounds": rounds,
                    "hosts": 2, "iperf_s": iperf_s}
    with Testbed(hosts=2, rate=rate, name=name) as tb, running_agents(
            tb, hosts=[1], levels=4, config_extra={"trusted_users": ["root"], "rate_limit_per_s": 100000}) as ags:
        agent, h1, h2 = ags[1], tb.host(1), tb.host(2)
        pid = agent.proc.pid
        base_rss, base_objects = agent_rss(pid), settled_objects(h1, pid)
        have = 0
        with iperf_server(h2, 5301):
            for size in sizes:
                progress(f"control-plane: {size} flows registered")
                fill(agent.socket, size, have)
                have = max(have, size)
                lat = latency_ms(agent.socket, rounds)
                bps = run_client(h1, h2.ip, 5301, seconds=iperf_s, omit=1).bps
                result["sizes"][str(size)] = {"register_p50_ms": statistics.median(lat),
                                              "register_p99_ms": percentile(lat, 0.99), "throughput_bps": bps,
                                              "agent_rss_bytes": agent_rss(pid)}
        zero = result["sizes"][str(sizes[0])]["throughput_bps"]
        for fig in result["sizes"].values():
            fig["throughput_ratio"] = fig["throughput_bps"] / zero
        with AgentClient(agent.socket, timeout=30) as c:
            c.unregister("filler")
        progress(f"control-plane: soak, {clients} clients for {soak_s:g} s")
        rss_before_soak = agent_rss(pid)  # Python keeps freed memory: compare with the RSS just before the soak
        result["soak"] = soak(agent.socket, clients, soak_s, 4)
        time.sleep(0.5)
        with AgentClient(agent.socket) as c:
            flows_after = c.status()["flows"]
        after = settled_objects(h1, pid)
        result["soak"].update({"flows_after": flows_after, "objects_before": base_objects, "objects_after": after,
                               "rss_start": base_rss, "rss_before": rss_before_soak, "rss_after": agent_rss(pid)})
        result["soak"]["rss_growth_bytes"] = result["soak"]["rss_after"] - rss_before_soak
        result["soak"]["baseline_restored"] = (flows_after == 0 and after == base_objects
                                               and result["soak"]["rss_growth_bytes"] < 8 * 2**20)
    progress("control-plane: busy host")
    result["busy_host"] = run_busy_host(quick=quick, name=f"{name}b")
    return result


def busy_line(b: dict) -> str:
    """One line of the busy-host figures for the terminal."""
    return (f"busy host: {b['sockets']} sockets, {b['owners']} owners x {b['flows_per_owner']} flows "
            f"({b['flows_kept']} kept): agent CPU {b['agent_cpu_ratio']:.1%} of a core over {b['window_s']:g} s, "
            f"register p50 {b['register_p50_ms']:.2f} ms, p99 {b['register_p99_ms']:.2f} ms "
            f"(quiet host: {b['quiet_register_p50_ms']:.2f}, {b['quiet_register_p99_ms']:.2f} ms)")


def merge_busy_host(path: str, quick: bool) -> int:
    """Run only the busy-host part and write it into the figures in ``path`` (the rest kept)."""
    res = run_busy_host(quick=quick)
    print(busy_line(res))
    with open(path) as fh:
        figures = json.load(fh)
    figures["busy_host"] = res
    write_json(path, figures)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bench control-plane [--quick] [--json FILE]``: run, print the table; 1 on errors or leftovers."""
    p = argparse.ArgumentParser(prog="python -m bench control-plane", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--soak-seconds", type=float, default=60)
    p.add_argument("--busy-host-only", action="store_true", help="run only the busy-host part, merge into --json")
    a = p.parse_args(argv)
    if a.busy_host_only:
        if not a.json:
            p.error("--busy-host-only needs --json FILE (the figures to merge into)")
        return merge_busy_host(a.json, a.quick)
    res = run(clients=a.clients, soak_s=a.soak_seconds, quick=a.quick)
    print(f"{'flows':>6} {'p50 ms':>8} {'p99 ms':>8} {'Mbit/s':>8} {'ratio':>6} {'RSS MB':>7}")
    for size, f in res["sizes"].items():
        print(f"{size:>6} {f['register_p50_ms']:8.2f} {f['register_p99_ms']:8.2f} {f['throughput_bps'] / 1e6:8.0f} "
              f"{f['throughput_ratio']:6.2f} {f['agent_rss_bytes'] / 2**20:7.1f}")
    s = res["soak"]
    print(f"soak: {s['clients']} clients x {s['seconds']:g} s: {s['operations']} ops ({s['ops_per_s']:.0f}/s), "
          f"{s['errors']} errors, register p99 {s['register_p99_ms']:.1f} ms, agent RSS "
          f"{s['rss_before'] / 2**20:.1f} -> {s['rss_after'] / 2**20:.1f} MB, baseline restored: "
          f"{s['baseline_restored']}")
    print(busy_line(res["busy_host"]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0 if s["errors"] == 0 and s["baseline_restored"] else 1


if __name__ == "__main__":
    sys.exit(main())
