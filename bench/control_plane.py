"""Control-plane benchmark: registration latency and agent memory with 0, 1,000 and 10,000 flows registered,
bulk throughput through the host queue at each size, and a soak of many concurrent clients.

Figures (keys of the JSON): per size ``register_p50_ms``, ``register_p99_ms`` (one-flow register round trips,
client side, through the Unix socket, including the nftables transaction), ``throughput_bps`` and
``throughput_ratio`` (iperf3 host1 -> host2 relative to 0 flows, same run), ``agent_rss_bytes``; and ``soak``:
clients, seconds, operations, errors, p99, and whether flows, map elements, tc classes, agent fds and memory
returned to their baseline. Usage: ``python -m bench.control_plane --json out.json [--quick]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from bench.agents import running_agents
from bench.bulk import iperf_server, run_client
from tensorlane.client import AgentClient, AgentError, AgentUnavailable
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
        base_rss, base_objects = agent_rss(pid), kernel_objects(h1, pid)
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
        after = kernel_objects(h1, pid)
        result["soak"].update({"flows_after": flows_after, "objects_before": base_objects, "objects_after": after,
                               "rss_start": base_rss, "rss_before": rss_before_soak, "rss_after": agent_rss(pid)})
        result["soak"]["rss_growth_bytes"] = result["soak"]["rss_after"] - rss_before_soak
        result["soak"]["baseline_restored"] = (flows_after == 0 and after == base_objects
                                               and result["soak"]["rss_growth_bytes"] < 8 * 2**20)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m bench control-plane [--quick] [--json FILE]``: run, print the table; 1 on errors or leftovers."""
    p = argparse.ArgumentParser(prog="python -m bench control-plane", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--soak-seconds", type=float, default=60)
    a = p.parse_args(argv)
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
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0 if s["errors"] == 0 and s["baseline_restored"] else 1


if __name__ == "__main__":
    sys.exit(main())
