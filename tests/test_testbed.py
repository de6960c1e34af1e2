"""Tests of the namespace testbed (testbed/). The netns tests need root, iproute2 and iperf3: they fail, never skip.

Every testbed here uses a name of its own (tbt1..tbt12), so other sessions' testbeds ("tl", "ta", "tw"...) are
never touched; every test removes what it made in a finally block.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed import Testbed, TestbedError, down_by_name, main, parse_rate, records, topology

REPO = Path(__file__).resolve().parents[1]
RATE = "100mbit"  # at 200 Mbit/s two flows through 3 namespaces saturate some 2-core machines' softirq CPU: the
# switch can only order what the senders manage to send (EF got 131-151 of 200 Mbit/s there; at 100 it passes)
RATE_BPS = 100_000_000
EF = 46


@pytest.fixture
def netns_ok():
    """Fail (not skip) when the namespace tests cannot run here."""
    assert os.geteuid() == 0, "the netns tests need root"
    for tool in ("ip", "ss", "iperf3"):
        assert shutil.which(tool), f"the netns tests need {tool} on PATH"


def _ours(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix-`` (what a testbed named ``prefix`` could have left)."""
    try:
        return sorted(n for n in os.listdir(topology.NETNS_DIR) if n.startswith(prefix + "-"))
    except FileNotFoundError:
        return []


def _scrub(*names: str) -> None:
    """Last-resort cleanup of the test's own testbeds (by record) and of namespaces the test added by hand."""
    for name in names:
        down_by_name(name)
        for ns in _ours(name):
            subprocess.run(["ip", "netns", "del", ns], timeout=10, check=False)


@pytest.fixture
def make_testbed(netns_ok):
    """Factory ``make_testbed(name, hosts=..)`` -> a Testbed not yet up; all of them are torn down afterwards."""
    made: list[Testbed] = []

    def factory(name: str, **kw) -> Testbed:
        """A Testbed named ``name`` at RATE unless given, remembered for the teardown."""
        tb = Testbed(name=name, rate=kw.pop("rate", RATE), **kw)
        made.append(tb)
        return tb

    try:
        yield factory
    finally:
        for tb in made:
            tb.down()
        _scrub(*(tb.name for tb in made))


@pytest.fixture(scope="module")
def tb3():
    """One 3-host testbed "tbt6" at 200mbit shared by the traffic tests of this module."""
    assert os.geteuid() == 0, "the netns tests need root"
    tb = Testbed(hosts=3, rate=RATE, name="tbt6")
    try:
        yield tb.up()
    finally:
        tb.down()
        _scrub("tbt6")


def _env() -> dict[str, str]:
    """Environment in which ``python -m testbed.ping`` finds this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _wait_listening(host, port: int, timeout: float = 5.0) -> None:
    """Wait until a TCP socket listens on ``port`` inside ``host``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = host.run(["ss", "-Hltn", f"sport = :{port}"], timeout=5).stdout
        if out.strip():
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {host.name}:{port} after {timeout} s")


def _iperf_pairs(tb: Testbed, flows: list[tuple[int, int, int, list[str]]], seconds: int = 3) -> list[float]:
    """Run iperf3 flows ``(src, dst, port, extra client args)`` at the same time; received bit/s of each."""
    servers = [tb.host(dst).popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for _, dst, port, _ in flows]
    clients = []
    try:
        for _, dst, port, _ in flows:
            _wait_listening(tb.host(dst), port)
        clients = [tb.host(src).popen(["iperf3", "-c", tb.host(dst).ip, "-p", str(port), "-t", str(seconds), "-J",
                                       "--connect-timeout", "3000", *extra], stdout=subprocess.PIPE, text=True)
                   for src, dst, port, extra in flows]
        results = []
        for c in clients:
            out, _ = c.communicate(timeout=seconds + 15)
            data = json.loads(out)
            assert "error" not in data, data.get("error")
            results.append(data["end"]["sum_received"]["bits_per_second"])
        return results
    finally:
        for p in [*clients, *servers]:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


# -- inputs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{"hosts": 0}, {"hosts": 65}, {"hosts": "3"}, {"rate": "fast"}, {"rate": "10kbit"},
                                {"rate": "20gbit"}, {"name": "TL"}, {"name": "toolongname"}, {"name": "t-1"},
                                {"name": ""}, {"segments": 0}, {"segments": 3}, {"segments": True},
                                {"segments": "2"}])
def test_invalid_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        Testbed(**kw)


def test_parse_rate_and_addressing():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("1.5Gbit") == 1_500_000_000
    assert parse_rate("5000kbit") == 5_000_000
    tb = Testbed(hosts=3, name="tbt0")
    assert [h.name for h in tb.hosts] == ["tbt0-h1", "tbt0-h2", "tbt0-h3"]
    assert tb.host(3).ip == "198.18.0.3" and tb.host(1).ifname == "eth0" and tb.switch_ns == "tbt0-sw"
    assert tb.rate_bps == 200_000_000
    with pytest.raises(TestbedError):
        tb.host(4)
    assert tb.segments == 1 and tb.host(1).segments == 1 and tb.host(1).address(0) == "198.18.0.1"
    with pytest.raises(TestbedError):
        tb.host(1).address(1)


def test_two_segment_addressing():
    tb = Testbed(hosts=3, name="tbt0", segments=2)
    h = tb.host(3)
    assert h.segments == 2 and h.ip == h.address(0) == "198.18.0.3" and h.address(1) == "198.19.0.3"
    assert h.ifname == h.interface(0) == "eth0" and h.interface(1) == "eth1"
    assert tb.switch_port(3) == "p3" and tb.switch_port(3, segment=1) == "p3s1"
    for bad in (2, -1, True):
        with pytest.raises(TestbedError):
            h.address(bad)
        with pytest.raises(TestbedError):
            tb.switch_port(3, segment=bad)


# -- life cycle ---------------------------------------------------------------------------------------------------


@pytest.mark.netns
def test_up_down_leaves_nothing(make_testbed):
    tb = make_testbed("tbt1", hosts=2)
    other = make_testbed("tbt7", hosts=2)  # same addresses and port names, another name: no collision
    tb.up()
    other.up()
    assert _ours("tbt1") == ["tbt1-h1", "tbt1-h2", "tbt1-sw"]
    assert sorted(records.read_record("tbt1")["netns"]) == ["tbt1-h1", "tbt1-h2", "tbt1-sw"]
    out = tb.host(1).run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
    assert "198.18.0.1/24" in out
    assert tb.host(1).run(["ip", "route", "show", "default"]).stdout.strip() == ""
    tb.down()
    assert _ours("tbt1") == [] and records.read_record("tbt1") is None
    assert len(_ours("tbt7")) == 3
    tb.down()  # twice is fine
    other.down()
    assert _ours("tbt7") == []


@pytest.mark.netns
def test_up_refuses_an_existing_namespace(make_testbed):
    subprocess.run(["ip", "netns", "add", "tbt2-h2"], check=True, timeout=10)
    try:
        tb = make_testbed("tbt2", hosts=2)
        with pytest.raises(TestbedError, match="tbt2-h2"):
            tb.up()
        assert _ours("tbt2") == ["tbt2-h2"]  # made nothing, and left the stranger alone
        tb.down()
        assert down_by_name("tbt2") == []
        assert _ours("tbt2") == ["tbt2-h2"]
    finally:
        subprocess.run(["ip", "netns", "del", "tbt2-h2"], timeout=10, check=False)


@pytest.mark.netns
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_error_mid_build_removes_what_was_made(make_testbed, monkeypatch, exc):
    real = Testbed._add_host

    def failing(self, host):
        """Wire host 1, then fail on host 2 (all namespaces exist by then)."""
        if host.index == 2:
            assert len(_ours("tbt3")) == 4  # all namespaces exist by now
            raise exc
        real(self, host)

    monkeypatch.setattr(Testbed, "_add_host", failing)
    tb = make_testbed("tbt3", hosts=3)
    with pytest.raises(type(exc)):
        tb.up()
    assert _ours("tbt3") == [] and records.read_record("tbt3") is None


@pytest.mark.netns
def test_cli_up_list_down_removes_only_what_the_record_lists(netns_ok, capsys):
    try:
        assert main(["up", "--hosts", "2", "--rate", RATE, "--name", "tbt4"]) == 0
        assert "198.18.0.2/24" in capsys.readouterr().out
        assert main(["up", "--hosts", "2", "--name", "tbt4"]) == 1  # refuses: exists
        assert "tbt4-sw already exists" in capsys.readouterr().err
        subprocess.run(["ip", "netns", "add", "tbt4-h9"], check=True, timeout=10)  # not recorded
        assert main(["list"]) == 0
        assert "tbt4: 2 hosts" in capsys.readouterr().out
        assert main(["down", "--name", "tbt4"]) == 0
        assert _ours("tbt4") == ["tbt4-h9"]
        assert main(["down", "--name", "tbt4"]) == 0  # nothing recorded any more: nothing to do
    finally:
        _scrub("tbt4")


@pytest.mark.netns
def test_down_all_spares_testbeds_of_running_processes(netns_ok):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        records.write_record("tbt8", {"name": "tbt8", "pid": sleeper.pid, "netns": []})
        assert topology._creator_alive("tbt8") == sleeper.pid  # `down --all` skips it
        sleeper.kill()
        sleeper.wait(timeout=10)
        assert topology._creator_alive("tbt8") is None  # builder gone: `down --all` removes it
        assert down_by_name("tbt8") == [] and records.read_record("tbt8") is None
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=10)
        records.remove_record("tbt8")


def test_a_builder_is_named_by_pid_and_start_time():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        start = records.process_start(sleeper.pid)
        assert isinstance(start, int)
        assert records.builder_alive({"pid": sleeper.pid, "pid_start": start}) == sleeper.pid
        assert records.builder_alive({"pid": sleeper.pid, "pid_start": start + 1}) is None  # a reused pid
        assert records.builder_alive({"pid": sleeper.pid}) == sleeper.pid  # an older record: by pid alone
        assert records.builder_alive({"pid": os.getpid()}) is None  # this process is not "another builder"
        assert records.builder_alive({"pid": True}) is None and records.builder_alive({}) is None
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert records.builder_alive({"pid": sleeper.pid, "pid_start": start}) is None


_BUILDER = ("import sys, time; from testbed import Testbed; "
            "Testbed(hosts=2, rate='100mbit', name=sys.argv[1]).up(); print('up', flush=True); time.sleep(60)")


def _builder(name: str) -> subprocess.Popen:
    """A process that builds testbed ``name`` (2 hosts), says ``up`` and sleeps without tearing it down."""
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, name], env=_env(), stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # bounded: the build ends or fails within seconds, and the pipe closes with it
    assert line.strip() == "up", f"the builder of {name} did not come up (exit {proc.poll()})"
    return proc


@pytest.mark.netns
def test_a_testbed_left_by_a_killed_builder_is_removed_by_the_next_up(make_testbed, capfd):
    proc = _builder("tbt11")
    try:
        old = records.read_record("tbt11")
        assert old["detached"] is False and old["pid"] == proc.pid
        tb = make_testbed("tbt11", hosts=2)
        with pytest.raises(TestbedError, match=f"testbed tbt11 is in use by running process {proc.pid}"):
            tb.up()  # its builder runs: not taken
        assert len(_ours("tbt11")) == 3
        proc.kill()  # as a killed test run: no teardown
        proc.wait(timeout=10)
        assert len(_ours("tbt11")) == 3
        tb.up()
        err = capfd.readouterr().err
        assert f"testbed tbt11: removed tbt11-h1, tbt11-h2, tbt11-sw, left by process {proc.pid}" in err
        new = records.read_record("tbt11")
        assert new["pid"] == os.getpid() and new["token"] != old["token"]
        _ping(tb, 1, tb.host(2).ip)
        tb.down()
        assert _ours("tbt11") == [] and records.read_record("tbt11") is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.netns
def test_a_detached_testbed_outlives_its_builder_and_is_not_taken(make_testbed, capsys):
    try:
        assert main(["up", "--hosts", "2", "--rate", RATE, "--name", "tbt12"]) == 0
        capsys.readouterr()
        rec = records.read_record("tbt12")
        assert rec["detached"] is True
        records.write_record("tbt12", {**rec, "pid": 2**22 + 1})  # its builder (the CLI) has ended: no such pid
        with pytest.raises(TestbedError, match="tbt12-sw already exists; not touching it"):
            make_testbed("tbt12", hosts=2).up()
        assert len(_ours("tbt12")) == 3
        assert main(["down", "--name", "tbt12"]) == 0
        assert _ours("tbt12") == []
    finally:
        _scrub("tbt12")


@pytest.mark.netns
def test_cli_sigint_during_up_cleans_up(netns_ok):
    cmd = [sys.executable, "-m", "testbed", "up", "--hosts", "64", "--name", "tbt9"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len((records.read_record("tbt9") or {}).get("netns", [])) < 10:  # mid-build
            assert proc.poll() is None and time.monotonic() < deadline, "up ended or stalled before the signal"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert _ours("tbt9") == [] and records.read_record("tbt9") is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _scrub("tbt9")


@pytest.mark.netns
def test_cli_up_two_segments(netns_ok, capsys):
    try:
        assert main(["up", "--hosts", "2", "--segments", "2", "--rate", RATE, "--name", "tbt10"]) == 0
        out = capsys.readouterr().out
        assert "198.18.0.2/24" in out and "198.19.0.2/24" in out and "p2s1" in out, out
        assert records.read_record("tbt10")["segments"] == 2
        assert main(["list"]) == 0
        assert "tbt10: 2 hosts, 2 segments" in capsys.readouterr().out
        assert main(["down", "--name", "tbt10"]) == 0
        assert _ours("tbt10") == [] and records.read_record("tbt10") is None
    finally:
        _scrub("tbt10")


# -- traffic ------------------------------------------------------------------------------------------------------


def _link(host, ifname: str) -> dict:
    """``ip -d -s -j link show dev ifname`` inside ``host``, as a dict (details and counters)."""
    return json.loads(host.run(["ip", "-d", "-s", "-j", "link", "show", "dev", ifname]).stdout)[0]


def _switch_links(tb: Testbed, *args: str) -> str:
    """``ip -o link show ARGS`` in the switch namespace of ``tb``."""
    return subprocess.run(["ip", "-n", tb.switch_ns, "-o", "link", "show", *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout


def _ping(tb: Testbed, src: int, dst: str, count: int = 3) -> None:
    """``count`` echoes from host ``src`` to address ``dst``, every one answered."""
    out = tb.host(src).run([sys.executable, "-m", "testbed.ping", dst, "-c", str(count), "-W", "2", "-i", "0.05"],
                           env=_env(), timeout=20)
    assert f"{count} received" in out.stdout, out.stdout


def _port_packets(tb: Testbed, i: int, segment: int) -> int:
    """Packets the switch port toward host ``i`` on ``segment`` has sent, all queues."""
    return sum(q["packets"] for q in tb.switch_port_stats(i, segment=segment).values())


@pytest.mark.netns
def test_two_segments_each_address_through_its_own_nic(make_testbed):
    tb = make_testbed("tbt5", hosts=2, segments=2).up()
    h1, h2 = tb.host(1), tb.host(2)
    assert "198.19.0.2/24" in h2.run(["ip", "-o", "-4", "addr", "show", "dev", "eth1"]).stdout
    on_br1 = _switch_links(tb, "master", "br1")
    assert "p1s1@" in on_br1 and "p2s1@" in on_br1 and "p1@" not in on_br1
    assert "htb" in subprocess.run(["tc", "-n", tb.switch_ns, "qdisc", "show", "dev", "p2s1"], capture_output=True,
                                   text=True, timeout=10, check=True).stdout
    for ifname in ("eth0", "eth1"):
        link = _link(h1, ifname)
        assert link["gso_max_segs"] == 1 and "htb" in h1.run(["tc", "qdisc", "show", "dev", ifname]).stdout
    for segment in (0, 1):
        count = 5
        tx = [_link(h1, f"eth{s}")["stats64"]["tx"]["packets"] for s in (0, 1)]
        port = [_port_packets(tb, 2, s) for s in (0, 1)]
        _ping(tb, 1, h2.address(segment), count)
        tx = [_link(h1, f"eth{s}")["stats64"]["tx"]["packets"] - tx[s] for s in (0, 1)]
        port = [_port_packets(tb, 2, s) - port[s] for s in (0, 1)]
        other = 1 - segment
        assert tx[segment] >= count and tx[other] < count, (segment, tx)  # host1 sent on the NIC of that segment
        assert port[segment] >= count and port[other] < count, (segment, port)  # through that segment's port
    tb.down()
    assert _ours("tbt5") == [] and records.read_record("tbt5") is None




@pytest.mark.netns
def test_ping_between_hosts(tb3):
    before = tb3.switch_port_stats(2)
    for src, dst in [(1, 2), (2, 3), (3, 1)]:
        out = tb3.host(src).run([sys.executable, "-m", "testbed.ping", tb3.host(dst).ip, "-c", "2", "-W", "2"],
                                env=_env(), timeout=20)
        assert "2 received" in out.stdout
    out = tb3.host(1).run([sys.executable, "-m", "testbed.ping", tb3.host(2).ip, "-c", "2", "--dscp", str(EF)],
                          env=_env(), timeout=20)
    assert "2 received" in out.stdout
    after = tb3.switch_port_stats(2)
    sent = {q: after[q]["packets"] - before[q]["packets"] for q in range(8)}
    assert sent[0] >= 2 and sent[5] == 2, sent  # ARP and plain ICMP in queue 0, the EF echo requests in queue 5


@pytest.mark.netns
def test_one_segment_has_no_second_nic(tb3):
    h = tb3.host(1)
    assert h.run(["ip", "link", "show", "dev", "eth1"], check=False).returncode != 0
    links = _switch_links(tb3)
    assert "br0" in links and "br1" not in links and "p1s1" not in links
    with pytest.raises(TestbedError):
        tb3.switch_port_stats(1, segment=1)


@pytest.mark.netns
def test_link_reaches_rate(tb3):
    """One TCP flow fills the shaped link. Other load on a 2-core machine can only slow a run, never lift it above
    the shaper, so a second run is taken when the first falls short and the faster one is judged."""
    runs = []
    for port in (5301, 5302):
        (bps,) = _iperf_pairs(tb3, [(1, 2, port, [])])
        runs.append(bps)
        assert bps <= 1.05 * RATE_BPS, f"{bps / 1e6:.1f} Mbit/s at {RATE}: above the shaped rate"
        if bps >= 0.85 * RATE_BPS:
            break
    assert max(runs) >= 0.85 * RATE_BPS, f"{[round(b / 1e6, 1) for b in runs]} Mbit/s at {RATE}"


@pytest.mark.netns
def test_switch_strict_priority(tb3):
    before = tb3.switch_port_stats(3)
    ef_bps, be_bps = _iperf_pairs(tb3, [(1, 3, 5401, ["--dscp", str(EF)]), (2, 3, 5402, [])])
    after = tb3.switch_port_stats(3)
    sent = {q: after[q]["bytes"] - before[q]["bytes"] for q in range(8)}
    # Strict priority: EF takes (nearly) all of what crosses the port, best effort the crumbs. What crosses in
    # all depends on the machine's CPU at the moment (85-190 Mbit/s seen for 2 x 100 offered), so the shares are
    # asserted, and the absolute rates loosely.
    got = f"EF got {ef_bps / 1e6:.1f} Mbit/s, best effort {be_bps / 1e6:.1f}"
    assert ef_bps > 0.6 * RATE_BPS, got
    assert ef_bps > 0.85 * (ef_bps + be_bps), got
    assert be_bps < 0.15 * RATE_BPS, got
    assert sent[5] > 0.6 * RATE_BPS / 8 * 3 * 0.9, sent  # EF -> queue 5
    assert sent[0] > 0, sent  # best effort -> queue 0
    assert sent[5] > 5 * sent[0], sent
