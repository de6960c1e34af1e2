"""The issue's targets on the namespace testbed, with real agents, gloo all-reduce workers and iperf3 bulk.

The ``netns`` tests need root (network namespaces, qdiscs, nftables): they fail, never skip, where they cannot
run. The others check the pieces of the scenario without privileges.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

LINK = "100mbit"  # at 200 Mbit/s some 2-core machines' packet processing, not the queues, limits the senders
SNIFFER = r"""
import json, sys, threading
from collections import Counter, defaultdict
from scapy.all import IP, TCP, AsyncSniffer

args = json.loads(sys.argv[1])
tally = defaultdict(Counter)

def seen(pkt):
    if IP in pkt and TCP in pkt:
        ip, tcp = pkt[IP], pkt[TCP]
        tally[f"{ip.src}:{tcp.sport}>{ip.dst}:{tcp.dport}"][ip.tos >> 2] += 1

ready = threading.Event()
sniffer = AsyncSniffer(iface=args["iface"], filter=args["filter"], prn=seen, store=False, count=args["count"],
                       started_callback=ready.set)
sniffer.start()
if not ready.wait(15):
    sys.exit("sniffer did not start")
print("ready", flush=True)
sys.stdin.readline()  # the test writes a line (or closes stdin) when the traffic is done
if sniffer.running:
    sniffer.stop()
else:
    sniffer.join(5)
print(json.dumps({k: {str(d): n for d, n in v.items()} for k, v in tally.items()}), flush=True)
"""


def _require_root_tools() -> None:
    assert os.geteuid() == 0, "the netns tests need root (network namespaces, tc, nftables): run them as root"
    for tool in ("ip", "tc", "nft", "iperf3"):
        assert shutil.which(tool), f"{tool} is missing: run scripts/bootstrap"


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_contention_targets_quick():
    """One run, three phases: agent <= 1.20x uncontended (target 1.10x in the full benchmark) while FIFO >= 2x;
    bulk >= 65 % once training stops (80 % in the full benchmark)."""
    _require_root_tools()
    import torch  # noqa: F401  (required, not optional: a missing torch fails the test)

    from bench.contention import format_table, run

    lines = []
    result = run(hosts=3, rate=LINK, size_mb=10, quick=True, name="tw", progress=lines.append)
    report = "\n".join(lines) + "\n" + format_table(result)
    print(report)
    assert all(result["agent_registered"]), f"the workers' flows were not registered:\n{report}"
    assert all(len(f) >= 1 for f in result["agent_flows"]), report
    assert result["fifo_ratio"] >= 2.0, f"FIFO under bulk should be >= 2x uncontended:\n{report}"
    # the target is 1.10x (the full benchmark measures it: README); 6 iterations on 2 busy cores vary by
    # a few percent, and FIFO is 4-5x here, so the quick run asserts the protection with some margin
    assert result["agent_ratio"] <= 1.20, f"with the agent the all-reduce should be <= 1.20x uncontended:\n{report}"
    # work-conserving: the bulk gets the link back (the full benchmark: 93 %; 4 s on 2 busy cores vary more)
    assert result["bulk_after_ratio"] >= 0.65, f"bulk should get >= 65 % of the link back:\n{report}"
    assert result["elapsed_s"] < 180, f"the quick scenario took {result['elapsed_s']:.0f} s (demo budget 3 min)"


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_demo_trains_through_the_shim_quick(tmp_path, capsys):
    """`python -m bench.demo`: a training loop through the shim in the three phases, exit 0, a table, the JSON and
    the PNG next to it (smoke: figures present, the shim registered its flows with the agents, no timing assertion)."""
    _require_root_tools()
    import torch  # noqa: F401

    from bench import demo

    out = tmp_path / "demo.json"
    code = demo.main(["--quick", "--iters", "2", "--name", "tdm", "--json", str(out)])
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, printed + captured.err   # the demo says on stderr why the scenario could not run
    assert "median iteration" in printed and f"plot written to {tmp_path / 'demo.png'}" in printed, printed
    assert (tmp_path / "demo.png").read_bytes().startswith(b"\x89PNG")
    result = json.loads(out.read_text())
    assert result["workload"] == "training" and result["profile"] == "resnet50" and result["rate"] == demo.DEMO_RATE
    for key in ("uncontended_s", "fifo_s", "agent_s", "agent_ratio", "fifo_ratio", "bulk_after_ratio"):
        assert isinstance(result[key], float) and result[key] > 0, (key, printed)
    assert all(len(result[f"{k}_times_s"]) == 2 for k in ("uncontended", "fifo", "agent")), printed
    stats = result["agent_shim_stats"]
    assert stats["enabled"] and stats["mode"] == "overlap" and stats["agent"]["registrations"] > 0, stats
    assert result["fifo_shim_stats"]["agent"]["connected"] is False  # no agent: trained unprioritised, no hang


def _start_sniffer(host, iface: str, bpf: str, count: int = 0) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", SNIFFER, json.dumps({"iface": iface, "filter": bpf, "count": count})],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import select

    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"scapy sniffer in {host.name} did not start: {line!r} {err[-2000:]}")
    return proc


def _stop_sniffer(proc: subprocess.Popen) -> dict[str, dict[int, int]]:
    try:
        out, err = proc.communicate("stop\n", timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=5)
        raise AssertionError("scapy sniffer did not stop") from None
    assert proc.returncode == 0, f"sniffer failed ({proc.returncode}): {err[-2000:]}"
    raw = json.loads(out.strip().splitlines()[-1])
    return {k: {int(d): n for d, n in v.items()} for k, v in raw.items()}


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_fabric_contention_switch_protects_registered_flow():
    """host1 (registered at level 0 through its agent) and host2 (bulk, unregistered) both send to host3.

    Their traffic meets in the switch port toward host3: the registered flow must get (nearly) the whole port,
    where the same transfer unregistered gets a FIFO share; a scapy capture on host3 shows DSCP 46 on every data
    packet of the registered flow and 0 on every bulk flow.
    """
    _require_root_tools()
    from bench.agents import running_agents
    from bench.bulk import bulk, timed_transfer
    from testbed import Testbed

    nbytes = 20 * 1024 * 1024
    with Testbed(hosts=3, rate=LINK, name="tw2") as tb, running_agents(tb) as agents:
        link = tb.rate_bps
        h1, h2, h3 = tb.host(1), tb.host(2), tb.host(3)
        with bulk(tb, [(2, 3, 4)], seconds=120) as b:
            time.sleep(2.0)  # let the bulk fill the port
            s0 = tb.switch_port_stats(3)
            reg = timed_transfer(tb, 1, 3, 5400, nbytes, agent_socket=agents[1].socket, job="fabric", level=0)
            s1 = tb.switch_port_stats(3)
            unreg = timed_transfer(tb, 1, 3, 5401, nbytes)
            s2 = tb.switch_port_stats(3)
            # DSCP of every flow, seen by host3: data packets only (the SYN precedes the registration).
            payload = "(ip[2:2] - ((ip[0] & 0xf) << 2) - ((tcp[12] & 0xf0) >> 2)) > 0"
            bpf = f"tcp and dst host {h3.ip} and (src host {h1.ip} or src host {h2.ip}) and {payload}"
            sniffer = _start_sniffer(h3, h3.ifname, bpf)
            try:
                cap = timed_transfer(tb, 1, 3, 5402, 4 * 1024 * 1024, agent_socket=agents[1].socket,
                                     job="fabric", level=0)
            finally:
                seen = _stop_sniffer(sniffer)
            assert b.alive(), "the bulk traffic stopped early"
            bulk_res = b.stop()[0]

        def delta(a, b_, q, key="bytes"):
            return b_[q][key] - a[q][key]

        summary = (f"registered {reg['seconds']:.3f} s ({reg['goodput_bps'] / 1e6:.0f} Mbit/s), unregistered "
                   f"{unreg['seconds']:.3f} s ({unreg['goodput_bps'] / 1e6:.0f} Mbit/s); switch port 3 during the "
                   f"registered transfer: queue 5 {delta(s0, s1, 5)} B, queue 0 {delta(s0, s1, 0)} B; during the "
                   f"unregistered one: queue 5 {delta(s1, s2, 5)} B, queue 0 {delta(s1, s2, 0)} B; bulk overall "
                   f"{bulk_res.mean_bps(1.0) / 1e6:.0f} Mbit/s; capture {seen}")
        print(summary)
        assert reg["registered"] and reg["acked"], f"registration failed: {reg}"
        assert not unreg["registered"] and unreg["acked"]
        # The registered flow crossed the switch in queue 5 (EF), the bulk in queue 0.
        assert delta(s0, s1, 5) >= nbytes, summary
        assert delta(s0, s1, 0) > 0 and delta(s1, s2, 0) > 0, summary
        assert delta(s1, s2, 5) < nbytes / 10, summary
        # Protected: most of the port, and well ahead of the same transfer unregistered, measured side by side.
        # Registered 0.95 x link on a quiet machine, 0.78-0.84 in loaded CI runs (the sender's TCP ramps while
        # the bulk fills the gaps: the port is work-conserving); unregistered 19-50 Mbit/s (one flow among five in
        # one FIFO queue).
        assert reg["goodput_bps"] >= 0.65 * link, summary
        assert unreg["goodput_bps"] <= 0.75 * link, f"the bulk did not contend at the switch port: {summary}"
        assert reg["goodput_bps"] >= 1.3 * unreg["goodput_bps"], summary  # 1.9-4.7x measured

        # Every flow's DSCP, as captured in host3: 46 for the registered one, 0 for each bulk stream.
        cap_flow = cap["flows"][0]
        cap_key = f"{cap_flow['src']}:{cap_flow['sport']}>{cap_flow['dst']}:{cap_flow['dport']}"
        assert cap["registered"], cap
        assert set(seen.get(cap_key, {})) == {46}, f"registered flow {cap_key}: DSCP counts {seen.get(cap_key)}"
        bulk_flows = {k: v for k, v in seen.items() if k.startswith(f"{h2.ip}:")}
        assert bulk_flows, f"no bulk packets captured: {seen}"
        for key, counts in bulk_flows.items():
            assert set(counts) == {0}, f"bulk flow {key}: DSCP counts {counts}"
        assert set(seen) <= {cap_key} | set(bulk_flows), f"unexpected flows captured: {seen}"


# --- pieces of the scenario, no privileges -------------------------------------------------------------------------

def test_agent_config_written_by_bench_is_valid(tmp_path):
    from bench.agents import agent_config, render_config
    from tensorlane.agent.config import load_config
    from testbed import Testbed

    tb = Testbed(hosts=3, rate=LINK, name="tw")  # not brought up: only names and rates
    fields = agent_config(tb, tb.host(2))
    path = tmp_path / "a.toml"
    path.write_text(render_config(fields))
    cfg = load_config(str(path))
    assert cfg.interfaces == ("eth0",) and cfg.link_rate_bps == tb.rate_bps == 100_000_000 and cfg.take_over_root
    assert cfg.socket == "/run/tensorlane/tw-h2/agent.sock" and cfg.state_dir == "/run/tensorlane/tw-h2"
    assert cfg.metrics_address == "127.0.0.1:9477"


def test_an_iperf3_client_that_aborts_is_a_crash_and_its_phase_runs_again():
    """An iperf3 client killed by a signal of its own with no JSON (iperf3 3.12 aborted once in its SIGINT handler,
    "Fatal glibc error: malloc assertion failure", and `make demo` failed) is a BulkCrash, not a measurement; one
    that exits with an error is a BulkError as before. step_under_bulk runs a phase that met a crash once more (and
    no more), counted in bulk_crashes; until 2026-11-28 the crash ended the demo (exit 2)."""
    from bench.bulk import BulkCrash, BulkError, IperfClient
    from bench.contention import Scenario

    class Local:
        ip = "127.0.0.1"
        name = "local"

        @staticmethod
        def popen(argv, **kw):  # (stands for iperf3: the script ignores its arguments)
            return subprocess.Popen(["sh", "-c", Local.script, "iperf3"], **kw)

    Local.script = "echo 'Fatal glibc error: malloc assertion failure' >&2; kill -ABRT $$"
    with pytest.raises(BulkCrash, match="exit -6"):
        IperfClient(Local, "127.0.0.1", seconds=1).result(timeout=10)
    Local.script = "echo 'iperf3: error - unable to connect' >&2; exit 1"
    with pytest.raises(BulkError) as e:
        IperfClient(Local, "127.0.0.1", seconds=1).result(timeout=10)
    assert not isinstance(e.value, BulkCrash)

    calls, lines = [], []
    sc = Scenario(tb=None, result={"workload": "allreduce"}, pairs=[], workdir="", iters=1, port=0,
                  progress=lines.append)

    def once(tag, sockets, linger_s):
        calls.append(tag)
        if len(calls) < 3:
            raise BulkCrash("iperf3 127.0.0.1->127.0.0.1:5301: output is not JSON: ''")
        return "done"
    sc._step_under_bulk = once
    with pytest.raises(BulkCrash):  # (a second crash in a row is not hidden)
        sc.step_under_bulk("fifo")
    assert calls == ["fifo", "fifo"] and sc.result["bulk_crashes"] == 1 and "running the phase again" in lines[0]
    assert sc.step_under_bulk("agent") == "done" and calls == ["fifo", "fifo", "agent"]


def test_iperf_json_parsing_and_windows():
    from bench.bulk import BulkError, parse_iperf_json

    doc = {"start": {}, "intervals": [
        {"sum": {"start": 0.0, "end": 0.5, "bits_per_second": 100e6}},
        {"sum": {"start": 0.5, "end": 1.0, "bits_per_second": 200e6}},
        {"sum": {"start": 1.0, "end": 2.0, "bits_per_second": 150e6}}],
        "end": {"sum_sent": {"bits_per_second": 160e6, "retransmits": 3}, "sum_received": {}},
        "error": "interrupt - the client has terminated"}
    r = parse_iperf_json(json.dumps(doc), src="a", dst="b", port=1, started_at=100.0)
    assert r.received_bps is None and r.bps == 160e6 and r.retransmits == 3
    assert r.mean_bps() == pytest.approx((50e6 + 100e6 + 150e6) / 2)
    assert r.mean_bps(since=0.5) == pytest.approx((100e6 + 150e6) / 1.5)
    assert r.mean_bps_wall(100.5, 101.0) == pytest.approx(200e6)
    with pytest.raises(BulkError):
        r.mean_bps(since=5)
    with pytest.raises(BulkError):
        parse_iperf_json("iperf3: error - unable to connect")


def test_table_and_verdicts():
    from bench.contention import format_table, passes

    res = {"uncontended_s": 0.44, "fifo_s": 2.2, "agent_s": 0.46, "bulk_after_ratio": 0.93,
           "bulk_after_bps": {"h1->h2": 186e6}, "agent_ratio": 0.46 / 0.44, "fifo_ratio": 5.0}
    assert passes(res) == {"agent_ratio": True, "fifo_ratio": True, "bulk_after_ratio": True}
    table = format_table(res)
    assert "FIFO" in table and "5.00x" in table and "1.05x" in table and "93% of link" in table
    assert passes({"agent_ratio": 1.2, "fifo_ratio": 1.5}) == {"agent_ratio": False, "fifo_ratio": False,
                                                               "bulk_after_ratio": None}


DEMO_RESULT = {"workload": "training", "profile": "resnet50", "rate": LINK, "link_bps": 100e6, "streams": 16,
               "uncontended_s": 0.55, "fifo_s": 0.60, "agent_s": 0.80, "fifo_ratio": 0.60 / 0.55,
               "agent_ratio": 0.80 / 0.55, "bulk_after_ratio": 0.5, "uncontended_times_s": [0.5, 0.55, 0.6],
               "fifo_times_s": [0.6, 0.6, 0.7], "agent_times_s": [0.7, 0.8, 0.9],
               "bulk_fifo_bps": {"h1->h2": 80e6, "h2->h1": 84e6}, "bulk_agent_bps": {"h1->h2": 60e6, "h2->h1": 62e6},
               "bulk_after_bps": {"h1->h2": 50e6, "h2->h1": 52e6}, "pass": {"agent_ratio": False}}


def test_demo_never_judges_and_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    """The demo exits 0 whenever the scenario ran, even when every target is missed; table, JSON and PNG."""
    from bench import contention, demo

    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return dict(DEMO_RESULT)

    monkeypatch.setattr(contention, "run", fake_run)
    monkeypatch.setattr(demo, "cannot_run", lambda: None)
    assert demo.main(["--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert seen["workload"] == "training" and seen["rate"] == demo.DEMO_RATE == "50mbit"
    assert seen["streams"] == demo.DEMO_STREAMS and seen["iters"] == demo.DEMO_ITERS
    assert "FIFO NICs under bulk" in out and "1.09x" in out and "1.45x" in out and "82 Mbit/s (82% of the link)" in out
    assert "target" not in out and "missed" not in out
    assert json.loads((tmp_path / "d.json").read_text())["fifo_s"] == 0.60
    assert f"plot written to {tmp_path / 'd.png'}" in out
    assert (tmp_path / "d.png").read_bytes().startswith(b"\x89PNG")


def test_demo_says_why_it_cannot_run(tmp_path, monkeypatch, capsys):
    """Non-zero with one clear line when the scenario cannot start (not root) or a step of it fails."""
    from bench import contention, demo
    from bench.workers import ScenarioError

    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    assert demo.main([]) == 2
    assert "run it as root" in capsys.readouterr().err

    def failing_run(**kw):
        raise ScenarioError("fifo: rank 0 on tdm-h1 exited 1")

    monkeypatch.setattr(demo, "cannot_run", lambda: None)
    monkeypatch.setattr(contention, "run", failing_run)
    assert demo.main(["--json", str(tmp_path / "d.json")]) == 1
    assert "could not run: ScenarioError: fifo: rank 0 on tdm-h1 exited 1" in capsys.readouterr().err
    assert not (tmp_path / "d.json").exists()


def test_contention_benchmark_judges(monkeypatch, capsys):
    """`python -m bench contention` keeps the targets: exit 1 when one is missed."""
    from bench import contention

    monkeypatch.setattr(contention.os, "geteuid", lambda: 0)
    monkeypatch.setattr(contention, "run", lambda **kw: dict(DEMO_RESULT))
    assert contention.main(["--quick"]) == 1
    assert "missed: agent_ratio" in capsys.readouterr().out


def test_demo_plot_goes_next_to_the_json():
    from bench.demo import plot_path

    assert [plot_path(None, None), plot_path("out/d.json", None), plot_path("out/d.json", "x.png")] == [
        "demo.png", "out/d.png", "x.png"]
