"""The metrics end to end: a real Prometheus (Debian's package) scrapes the agents of a namespace testbed while a
shim training job and iperf3 bulk traffic run; then every panel of both Grafana dashboards is evaluated through
Prometheus' HTTP API and must return data, the rules of dashboards/rules.yml must load and evaluate, and the
series of the run are drawn to docs/img/metrics-testbed.png (the dashboards' picture, without Grafana).

Layout (testbed "tm", 3 hosts at 200 mbit): agents on every host with ``metrics_address = "0.0.0.0:9477"``;
Prometheus runs inside host 3's namespace (on its loopback, port 9090) and scrapes 198.18.0.{1,2,3}:9477 through
the testbed's switch every second; the test talks to it through a small client run in that namespace. Host 1
and host 2 run the training job (2 ranks, ``shim.attach`` with 3 levels and ``shim.report``) and bulk iperf3
in both directions (unregistered: the default class).

A second, smaller test reads a real HTB tree's counters (64-bit packets, lend/borrow, tokens) from the kernel in
a namespace of its own.

Run as a script with ``--worker`` it is that training worker (see ``worker``).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The committed picture is refreshed on request (TENSORLANE_UPDATE_DOCS=1); otherwise the plot goes to /tmp.
PNG = (os.path.join(REPO, "docs", "img", "metrics-testbed.png") if os.environ.get("TENSORLANE_UPDATE_DOCS")
       else os.path.join(tempfile.gettempdir(), "tensorlane-metrics-testbed.png"))
PROM_PORT = 9090
JOB = "metricsjob"
LEVELS = 3
STEPS = 40

CLIENT = r"""
import json, sys, urllib.error, urllib.parse, urllib.request
base, out = sys.argv[1], []
for r in json.loads(sys.stdin.read()):
    url = base + r["path"] + ("?" + urllib.parse.urlencode(r["params"]) if r.get("params") else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            out.append(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        out.append({"status": "error", "error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"})
    except Exception as e:
        out.append({"status": "error", "error": repr(e)})
print(json.dumps(out))
"""


class Prometheus:
    """A Prometheus server in a testbed host's namespace, and a client for its HTTP API run in the same one."""

    def __init__(self, host, workdir: str, targets: list[str], rules: str):
        self.host, self.workdir = host, workdir
        self.base = f"http://127.0.0.1:{PROM_PORT}"
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as fh:
            fh.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
                     f"rule_files:\n  - {rules}\n"
                     "scrape_configs:\n  - job_name: tensorlane\n    static_configs:\n"
                     f"      - targets: [{', '.join(json.dumps(t) for t in targets)}]\n")
        self.log = open(os.path.join(workdir, "prometheus.log"), "wb")  # noqa: SIM115 (closed in stop)
        self.proc = host.popen(["prometheus", f"--config.file={config}",
                                f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                                f"--web.listen-address=127.0.0.1:{PROM_PORT}", "--storage.tsdb.retention.time=1h",
                                "--log.level=warn"], stdin=subprocess.DEVNULL, stdout=self.log,
                               stderr=subprocess.STDOUT, cwd=workdir)

    def log_tail(self, n: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as fh:
            return fh.read()[-n:].decode(errors="replace")

    def call(self, requests: list[dict], timeout: float = 60) -> list[dict]:
        out = self.host.run([sys.executable, "-c", CLIENT, self.base], input=json.dumps(requests), timeout=timeout)
        return json.loads(out.stdout)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}"
            if self.call([{"path": "/api/v1/status/buildinfo"}])[0].get("status") == "success":
                return
            time.sleep(0.3)
        raise AssertionError(f"prometheus not ready after {timeout} s:\n{self.log_tail()}")

    def wait_targets_up(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = self.call([{"path": "/api/v1/targets"}])[0]["data"]["activeTargets"]
            if sum(t["health"] == "up" for t in targets) == n:
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not up after {timeout} s: {json.dumps(targets)[:2000]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def range_req(expr: str, start: float, end: float, step: float = 1.0) -> dict:
    return {"path": "/api/v1/query_range", "params": {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                      "step": f"{step:g}"}}


def finite_points(result: dict) -> int:
    return sum(1 for series in result["data"]["result"] for _, v in series["values"] if math.isfinite(float(v)))


def start_workers(tb, workdir: str, sockets: dict[int, str], steps: int) -> list[tuple[subprocess.Popen, object]]:
    procs = []
    for rank, hi in enumerate((1, 2)):
        host = tb.host(hi)
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR=tb.host(1).ip, MASTER_PORT="29660", GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1")
        log = open(os.path.join(workdir, f"worker{rank}.log"), "wb")  # noqa: SIM115 (closed by the caller)
        procs.append((host.popen([sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps),
                                  "--agent-socket", sockets[hi], "--out", os.path.join(workdir, f"w{rank}.json")],
                                 env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_prometheus_scrapes_agents_and_every_panel_returns_data(tmp_path):
    import matplotlib  # noqa: F401  (the plot needs it: fail here, clearly, when it is missing)
    import torch  # noqa: F401  (the worker needs it)

    assert shutil.which("prometheus"), "prometheus is missing: apt-get install prometheus (scripts/bootstrap)"

    from bench.agents import running_agents
    from bench.bulk import bulk
    from dashboards import build
    from testbed import Testbed

    workdir = str(tmp_path)
    rules = os.path.join(REPO, "dashboards", "rules.yml")
    t_begin = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_begin:5.1f} s] {msg}", flush=True)
    metrics = {"metrics_address": "0.0.0.0:9477"}
    # host 3's agent orders two idle jobs (job_share "auto"), so that the job policy's panels have data too; the
    # training job runs on hosts 1 and 2, whose agents keep no job order (its levels stay its own)
    ordered = {**metrics, "job_policy": "static", "job_priority": {"ordered-a": 0, "ordered-b": 1},
               "job_share": "auto", "trusted_users": ["root"]}
    with Testbed(hosts=3, rate="200mbit", name="tm") as tb, \
            running_agents(tb, levels=LEVELS, hosts=[1, 2], config_extra=metrics) as agents, \
            running_agents(tb, levels=LEVELS, hosts=[3], config_extra=ordered) as third:
        h3, h1 = tb.host(3), tb.host(1)
        with third[3].client() as c:
            for i, job in enumerate(("ordered-a", "ordered-b")):
                c.register(job, 0, [{"proto": "udp", "src": h3.ip, "sport": 43300 + i, "dst": h1.ip, "dport": 43300}])
        targets = [f"{tb.host(i).ip}:9477" for i in (1, 2, 3)]
        progress("testbed and agents up")
        prom = Prometheus(tb.host(3), workdir, targets, rules)
        try:
            prom.wait_ready()
            prom.wait_targets_up(3)
            progress("prometheus up, scraping 3 agents")
            with bulk(tb, [(1, 2, 4), (2, 1, 4)], seconds=120, base_port=5311) as b:
                time.sleep(3)                      # bulk alone: the default class takes the link
                t_start = time.time()
                procs = start_workers(tb, workdir, {i: agents[i].socket for i in (1, 2)}, steps=STEPS)
                try:
                    for proc, _ in procs:
                        proc.wait(timeout=120)
                finally:
                    for proc, log in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait(timeout=5)
                        log.close()
                logs = [Path(log.name).read_text(errors="replace")[-3000:] for _, log in procs]
                assert [p.returncode for p, _ in procs] == [0, 0], "\n---\n".join(logs)
                progress("training done")
                time.sleep(3)                      # bulk alone again; the last reports get scraped
                t_end = time.time()
                b.stop()
            check_prometheus(prom, build, t_start - 2, t_end, tb)
            progress("every panel returned data")
            plot(prom, t_start - 3, t_end, tb)
            progress(f"plot written to {PNG}")
        except BaseException:
            print(f"prometheus log:\n{prom.log_tail()}", file=sys.stderr)
            raise
        finally:
            prom.stop()
        worker = [json.loads(Path(workdir, f"w{r}.json").read_text()) for r in (0, 1)]
        assert all(w["report"]["sent"] >= 2 for w in worker), worker  # a report may time out on a busy machine
    progress("done")  # about 50 s on an idle 2-core machine


def check_prometheus(prom: Prometheus, build, start: float, end: float, tb) -> None:
    """The rules load and evaluate, every dashboard panel has data over the run, and the data tells the run."""
    # every rule loaded and evaluated without error
    groups = prom.call([{"path": "/api/v1/rules"}])[0]["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 10
    bad = [(r["name"], r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"]
    assert not bad, bad

    # every panel's query returns data over the run
    panels = [(name, title, ref, expr) for name in sorted(build.DASHBOARDS)
              for title, ref, expr in build.queries(build.DASHBOARDS[name]())]
    results = prom.call([range_req(build.expand(expr), start, end) for *_, expr in panels])
    empty = []
    for (name, title, ref, expr), res in zip(panels, results, strict=True):
        assert res.get("status") == "success", f"{name} {title} {ref}: {res.get('error')}\n{expr}"
        if finite_points(res) == 0:
            empty.append(f"{name}: {title} ({ref})")
    assert not empty, "panels without data:\n" + "\n".join(empty)

    # and the data says what happened
    h1, h2 = (f"{tb.host(i).ip}:9477" for i in (1, 2))
    instant = [
        {"path": "/api/v1/query", "params": {"query": f'tensorlane_job_allreduces_total{{training_job="{JOB}"}}',
                                             "time": f"{end:.3f}"}},
        {"path": "/api/v1/query", "params": {"query": f'max_over_time(tensorlane_registered_flows{{training_job='
                                                      f'"{JOB}"}}[5m])', "time": f"{end:.3f}"}},
        {"path": "/api/v1/query", "params": {"query": 'tensorlane_class_marked_bytes_total * on (instance, device, '
                                                      'class) group_left (level) tensorlane_class_info',
                                             "time": f"{end:.3f}"}},
        {"path": "/api/v1/query", "params": {"query": 'max_over_time((rate(tensorlane_class_sent_bytes_total[3s]) '
                                                      '* on (instance, device, class) group_left (level) '
                                                      'tensorlane_class_info{level="default"} / on (instance, device)'
                                                      ' group_left () tensorlane_link_rate_bytes_per_second)[5m:1s])',
                                             "time": f"{end:.3f}"}},
        {"path": "/api/v1/query", "params": {"query": "tensorlane:class_link_share:ratio_rate5m > 0",
                                             "time": f"{end:.3f}"}},
    ]
    allreduces, flows, marked, bulk_share, recorded = (r["data"]["result"] for r in prom.call(instant))
    got = {(s["metric"]["instance"], s["metric"]["level"]): float(s["value"][1]) for s in allreduces}
    assert all(got.get((h, str(lvl)), 0) > 0 for h in (h1, h2) for lvl in range(LEVELS)), got
    per_host = {}
    for s in flows:
        per_host.setdefault(s["metric"]["instance"], set()).add(s["metric"]["class"])
    assert len(per_host.get(h1, ())) == LEVELS and len(per_host.get(h2, ())) == LEVELS, per_host
    marked0 = {s["metric"]["instance"]: float(s["value"][1]) for s in marked if s["metric"]["level"] == "0"}
    assert marked0.get(h1, 0) > 0 and marked0.get(h2, 0) > 0, marked0
    share = {s["metric"]["instance"]: float(s["value"][1]) for s in bulk_share}
    assert share.get(h1, 0) > 0.8 and share.get(h2, 0) > 0.8, share   # bulk fills the link when training idles
    assert {s["metric"]["instance"] for s in recorded} >= {h1, h2}, recorded  # a recording rule, live
    check_htb_and_process(prom, end, h1, h2)
    check_job_policy(prom, end, f"{tb.host(3).ip}:9477")


def check_job_policy(prom: Prometheus, end: float, h3: str) -> None:
    """Host 3's agent orders its two idle jobs: the first one at level 0, the second at the other half of the
    levels; with ``job_share = "auto"`` and an idle link, the small part (AUTO_SHARES[0]) and not saturated."""
    from tensorlane.policies.jobs import AUTO_SHARES

    queries = ["tensorlane_job_first_level", "tensorlane_job_share_ratio", "tensorlane_job_link_saturated",
               "tensorlane_job_link_busy_ratio"]
    first, share, saturated, busy = (r["data"]["result"] for r in prom.call(
        [{"path": "/api/v1/query", "params": {"query": q, "time": f"{end:.3f}"}} for q in queries]))
    assert {s["metric"]["instance"] for s in first + share + saturated + busy} == {h3}, (first, share)
    assert {s["metric"]["training_job"]: float(s["value"][1]) for s in first} == {"ordered-a": 0,
                                                                                 "ordered-b": LEVELS // 2}, first
    assert [float(s["value"][1]) for s in share] == [AUTO_SHARES[0]], share
    assert [float(s["value"][1]) for s in saturated] == [0] and float(busy[0]["value"][1]) < 0.5, (saturated, busy)


def check_htb_and_process(prom: Prometheus, end: float, h1: str, h2: str) -> None:
    """The scrapes carry HTB's borrow statistics and tokens, the packet counters and the agents' process_*."""
    queries = ['tensorlane_class_borrowed_packets_total * on (instance, device, class) group_left (level) '
               'tensorlane_class_info{level="default"}',
               "count by (instance) (tensorlane_class_tokens_seconds) and count by (instance) "
               "(tensorlane_class_sent_packets_total)",
               'process_resident_memory_bytes{job="tensorlane"} > 0 and on (instance) process_cpu_seconds_total > 0']
    borrows, tokens, process = (r["data"]["result"] for r in prom.call(
        [{"path": "/api/v1/query", "params": {"query": q, "time": f"{end:.3f}"}} for q in queries]))
    borrowed = {s["metric"]["instance"]: float(s["value"][1]) for s in borrows}
    assert borrowed.get(h1, 0) > 0 and borrowed.get(h2, 0) > 0, borrowed  # bulk borrows the link above its rate
    assert len(tokens) == 3 and len(process) == 3, (tokens, process)  # every agent: HTB tokens, process_*


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_htb_counters_from_the_kernel():
    """A real HTB tree of the agent (3 levels) on a veth in a namespace of its own; 300 frames of 1000 bytes sent
    through the default class at once: its tiny rate lends a few, the link lends the rest (borrows). Read once the
    queue has drained (12 ms of frames at this rate, longer on a loaded machine), so every frame has been counted."""
    out = _run_probe(200_000_000, DRAINED_READING)
    stats = {int(k): v for k, v in json.loads(out).items()}
    from tensorlane.agent.kernel.qdisc import HtbBackend

    backend = HtbBackend(3, 200_000_000)
    default = stats[backend.default.classid]
    assert default["packets"] == 300 and default["bytes"] == 300_000, default
    assert default["lends"] + default["borrows"] == 300 and default["borrows"] > 250, default
    assert default["tokens"] < 0 < default["overlimits"], default  # in debt on its own rate, throttled
    for spec in backend.classes:  # idle levels: a full bucket of their burst at their tiny rate, nothing sent
        idle = stats[spec.classid]
        assert idle["packets"] == idle["lends"] == idle["borrows"] == 0 and idle["tokens"] > 0.1, idle


def _run_probe(rate_bps: int, reading: str) -> str:
    """In a network namespace of its own: the agent's HTB tree (3 levels, ``rate_bps``) on a veth ``tl0``, 300 frames
    of 1000 bytes sent through it (unclassified: the default class), then ``reading`` (Python with ``ipr``, ``index``,
    ``tcstats``) prints what the test reads. Returns its stdout."""
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", PROBE % (rate_bps, reading)], capture_output=True,
                         text=True, timeout=50, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    return out.stdout


PROBE = r"""
import json, socket, subprocess
from pyroute2 import IPRoute
from tensorlane.agent.kernel import tcstats
from tensorlane.agent.kernel.qdisc import HtbBackend

# no IPv6 on the pair: its neighbour discovery and MLD packets would go through the default class too
subprocess.run("ip link add tl0 type veth peer name tl1 && sysctl -qw net.ipv6.conf.tl0.disable_ipv6=1 "
               "net.ipv6.conf.tl1.disable_ipv6=1 && ip link set tl1 up && ip link set tl0 up", shell=True, check=True)
with IPRoute() as ipr:
    index = ipr.link_lookup(ifname="tl0")[0]
    HtbBackend(3, %d).apply(ipr, index)
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:  # through the qdisc, unclassified: default
        s.bind(("tl0", 0))
        frame = b"\xff" * 6 + b"\x02\x00\x00\x00\x00\x01" + b"\x88\xb5" + bytes(986)
        for _ in range(300):
            s.send(frame)
%s
"""


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_class_backlogs_read_the_queue_lengths_that_class_stats_decodes():
    """The job policy's cheap sample (``tcstats.class_backlogs``: only the queue lengths, from the dump's bytes)
    against the full decode (``class_stats``), on a real HTB tree at 1 Mbit/s with 300 frames queued in its default
    class (as many as its queue holds, the rest dropped): the queue drains between the reads, so the decode's count
    lies between the two cheap ones."""
    before, full, after, missing = json.loads(_run_probe(1_000_000, BACKLOG_READING))  # 2.4 s of frames: most wait
    from tensorlane.agent.kernel.qdisc import HtbBackend

    default = str(HtbBackend(3, 1_000_000).default.classid)
    assert set(before) == set(full) == set(after) and default in before, (before, full)
    assert 0 < after[default] <= full[default] <= before[default] <= 300, (before, full, after)
    assert all(before[c] == full[c] == after[c] == 0 for c in before if c != default)
    assert missing == {}  # an interface with no classes: an empty dump, not an error


DRAINED_READING = """
    import time
    deadline = time.monotonic() + 10  # bounded: the queue holds 300 frames at most, sent at 200 Mbit/s
    while sum(tcstats.class_backlogs(index).values()) and time.monotonic() < deadline:
        time.sleep(0.005)
    print(json.dumps(tcstats.class_stats(ipr, index)))"""


BACKLOG_READING = """
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as nl:
        before = tcstats.class_backlogs(index, nl)
        full = {k: v["backlog_packets"] for k, v in tcstats.class_stats(ipr, index).items()}
        after = tcstats.class_backlogs(index, nl)
    missing = tcstats.class_backlogs(ipr.link_lookup(ifname="lo")[0])
    print(json.dumps([before, full, after, missing]))"""


def plot_views(tb) -> list[tuple[str, str, str, str, bool]]:
    """The panels of the picture: (title, unit, legend, PromQL, stacked)."""
    sel = f'instance="{tb.host(1).ip}:9477"'
    level = f" * on (instance, device, class) group_left (level) tensorlane_class_info{{{sel}}}"
    return [
        ("Link share, host 1, by class", "percent", "level {level}",
         f"100 * rate(tensorlane_class_sent_bytes_total{{{sel}}}[3s]){level}"
         f" / on (instance, device) group_left () tensorlane_link_rate_bytes_per_second", True),
        ("Backlog, host 1, by class", "KiB", "level {level}",
         f"tensorlane_class_backlog_bytes{{{sel}}}{level} / 1024", False),
        ("Top-class queueing delay", "ms", "{instance}",
         '1000 * tensorlane_class_queue_delay_seconds * on (instance, device, class) group_left () '
         'tensorlane_class_info{level="0"}', False),
        ("Priority inversion (share of link)", "percent", "{instance}",
         "100 * sum by (instance, device) (rate(tensorlane_class_inversion_bytes_total[3s]))"
         " / on (instance, device) tensorlane_link_rate_bytes_per_second", False),
        ("All-reduce time by level (mean per piece)", "ms", "level {level}",
         f'1000 * sum by (level) (rate(tensorlane_job_allreduce_seconds_total{{training_job="{JOB}"}}[5s]))'
         f' / sum by (level) (rate(tensorlane_job_allreduces_total{{training_job="{JOB}"}}[5s]))', False),
        ("Registered flows by level, all hosts", "flows", "level {level}",
         "sum by (level) (tensorlane_registered_flows * on (instance, device, class) group_left (level) "
         "tensorlane_class_info)", False),
    ]


def draw_series(ax, series: list[dict], legend: str, stacked: bool, start: float) -> None:
    """One panel's series (a range query's result) on ``ax``: stacked areas or lines, seconds since ``start``."""
    def label(s):
        return legend.format(**{k: s["metric"].get(k, "") for k in ("level", "instance")})

    if stacked:
        grid = sorted({float(t) for s in series for t, _ in s["values"]})
        ys = []
        for s in series:
            vals = {float(t): float(v) for t, v in s["values"]}
            ys.append([vals.get(t, 0.0) if math.isfinite(vals.get(t, 0.0)) else 0.0 for t in grid])
        if grid:
            ax.stackplot([t - start for t in grid], *ys, labels=[label(s) for s in series])
        return
    for s in series:
        pts = [(float(t) - start, float(v)) for t, v in s["values"] if math.isfinite(float(v))]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=label(s))


def plot(prom: Prometheus, start: float, end: float, tb) -> None:
    """The fleet dashboard's main panels for the run, as one PNG (docs/img/metrics-testbed.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views = plot_views(tb)
    results = prom.call([range_req(expr, start, end, 0.5) for *_, expr, _ in views])
    flows = results[-1]["data"]["result"]
    trained = sorted(float(t) - start for s in flows for t, v in s["values"] if float(v) > 0)
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
    for ax, (title, unit, legend, _, stacked), res in zip(axes.flat, views, results, strict=False):
        assert res.get("status") == "success", res
        series = sorted(res["data"]["result"], key=lambda s: json.dumps(s["metric"], sort_keys=True))
        draw_series(ax, series, legend, stacked, start)
        if trained:
            ax.axvspan(trained[0], trained[-1], color="grey", alpha=0.12, lw=0)
        ax.set_xlim(0, end - start)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_xlabel("seconds since bulk started (grey: the shim job's flows are registered)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("tensorlane metrics, testbed run: 2-rank shim job (3 levels) + iperf3 bulk both ways, "
                 "200 Mbit/s, scraped by Prometheus every 1 s")
    os.makedirs(os.path.dirname(PNG), exist_ok=True)
    fig.savefig(PNG, dpi=80)
    plt.close(fig)
    assert os.path.getsize(PNG) > 10_000


# --- the training worker (run by the test in a host namespace) --------------------------------------------------

def worker(argv=None) -> int:
    """One rank of a small DDP job with ``shim.attach`` (3 levels) and ``shim.report``; writes its stats as JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--agent-socket", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tensorlane import shim

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    model = DDP(net, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handle = shim.attach(model, levels=LEVELS, agent_socket=args.agent_socket, job=JOB, report_interval_s=1.0)
    reporter = handle.reporter
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
    stats = handle.stats()
    last = reporter.close()
    handle.close()
    with open(args.out, "w") as fh:
        json.dump({"stats": stats, "report": reporter.counters, "last_report_taken": last,
                   "last_error": reporter.last_error}, fh)
    dist.barrier()
    dist.destroy_process_group()
    del model, opt, handle
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    return 0


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(worker())
