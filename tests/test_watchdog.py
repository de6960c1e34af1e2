"""Supervision of the agent: sd_notify messages on a real datagram socket, journald priorities, the systemd unit
(``systemd-analyze verify``), and the no-systemd watchdog of tensorlane-agentctl restarting a stalled (SIGSTOP)
agent in a testbed namespace, with the interface's tree the agent's while it runs and restored after the stop."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from agent_clients import tc_dump

from bench.agents import agent_config, render_config
from tensorlane.agent import notify
from tensorlane.agent.logs import JournalFormatter, journal_prefix, stderr_is_journal, syslog_priority

pytestmark = pytest.mark.concurrent  # netns tests here run beside another file's (make test; pyproject markers)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO_ROOT, "ansible", "roles", "tensorlane", "templates")
DEFAULTS = os.path.join(REPO_ROOT, "ansible", "roles", "tensorlane", "defaults", "main.yml")
VENV = os.path.dirname(os.path.dirname(sys.executable))
ANSIBLE = os.path.join(VENV, "bin", "ansible")


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _datagram_socket(address) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_notify_ready_watchdog_and_stopping_on_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    heartbeat = tmp_path / "agent.heartbeat"
    clock = FakeClock()
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid()),
           notify.HEARTBEAT_ENV: str(heartbeat)}
    with _datagram_socket(path) as sock:
        n = notify.Notifier(env, clock=clock)
        assert n.watchdog_s == 4.0
        n.ready("managing eth0")
        assert sock.recv(4096) == b"READY=1\nSTATUS=managing eth0"
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert heartbeat.exists()
        clock.now += 1.0
        n.watchdog()  # less than half the period since the last: no message, but the heartbeat is touched
        clock.now += 1.0
        n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
        n.stopping()
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=restoring the interface"
    assert heartbeat.read_text() == "stopping\n"


def test_notify_abstract_address_and_absent_manager(tmp_path):
    name = f"tensorlane-test-{os.getpid()}"
    with _datagram_socket("\0" + name) as sock:
        n = notify.Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
        assert n.watchdog_s is None  # the watchdog is meant for another process
        assert n.send("READY=1")
        assert sock.recv(4096) == b"READY=1"
    quiet = notify.Notifier({})
    assert not quiet.send("READY=1") and quiet.watchdog_s is None
    quiet.ready()
    quiet.watchdog()
    quiet.stopping()  # nothing to tell, nothing raised
    gone = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert not gone.send("READY=1") and gone.failed


def test_a_failed_notify_names_the_socket_it_was_given(tmp_path, caplog, monkeypatch):
    """The warning of a notification that failed named ``$NOTIFY_SOCKET`` of the process's environment, not the one
    the notifier was given (``Notifier(env)``), and so named none, or another socket, where they differ."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    missing = str(tmp_path / "missing.sock")
    with caplog.at_level(logging.WARNING, logger="tensorlane"):
        assert not notify.Notifier({"NOTIFY_SOCKET": missing}).send("READY=1")
    assert f"cannot notify the service manager at {missing}:" in caplog.text, caplog.text


def test_journal_priorities(tmp_path):
    assert [syslog_priority(lv) for lv in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO,
                                           logging.DEBUG)] == [2, 3, 4, 6, 7]
    record = logging.LogRecord("tensorlane.agent", logging.WARNING, __file__, 1, "one\ntwo %d", (2,), None)
    assert JournalFormatter("%(levelname)s %(name)s: %(message)s").format(record) == \
        "<4>WARNING tensorlane.agent: one\n<4>two 2"
    with open(tmp_path / "stream", "w") as stream:
        st = os.fstat(stream.fileno())
        assert stderr_is_journal(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not stderr_is_journal(stream, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not stderr_is_journal(stream, {})
        assert journal_prefix(logging.ERROR, stream) == ("<3>" if stderr_is_journal(stream) else "")


def render(template: str, dest: str, mode: str = "0755", **overrides) -> str:
    """Render a template of the role with its defaults and ``overrides`` (ansible's template module, locally)."""
    extra = {"ansible_python_interpreter": sys.executable, **overrides}
    subprocess.run([ANSIBLE, "localhost", "-c", "local", "-i", "localhost,", "-m", "ansible.builtin.template",
                    "-a", f"src={os.path.join(TEMPLATES, template)} dest={dest} mode={mode}", "-e", f"@{DEFAULTS}",
                    "-e", json.dumps(extra)], check=True, capture_output=True, text=True, timeout=120)
    return dest


def test_unit_passes_systemd_analyze_verify(tmp_path):
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: scripts/bootstrap installs the systemd package"
    unit = render("tensorlane-agent.service.j2", str(tmp_path / "tensorlane-agent.service"), mode="0644",
                  tensorlane_venv=VENV, tensorlane_config_file=str(tmp_path / "agent.toml"),
                  tensorlane_socket_group="root")
    with open(unit) as fh:
        text = fh.read()
    for line in ("Type=notify", "WatchdogSec=30", "LimitNOFILE=3072", "TimeoutStartSec=30", "RestartSec=5"):
        assert f"\n{line}\n" in text, text
    proc = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tensorlane-agent.service" not in proc.stderr, proc.stderr  # no warning about the unit itself


# --- the no-systemd watchdog in a testbed namespace ------------------------------------------------------------
def nft_tables(host) -> str:
    """The namespace's nftables tables."""
    return host.run(["nft", "list", "tables"]).stdout


WATCHDOG_S = 3
RESTART_PAUSE_S = 1


def _read_pid(path: str) -> int | None:
    try:
        return int(open(path).read().strip())
    except (OSError, ValueError):
        return None


def _wait(what, timeout: float, step: float = 0.1):
    """Poll ``what()`` until it returns something true, at most ``timeout`` s; returns it (or the last falsy)."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


def _serves(host, socket_path: str, pidfile: str, old_pid: int):
    """The agent's new pid once a new agent answers ``status``, else None."""
    pid = _read_pid(pidfile)
    if pid is None or pid == old_pid:
        return None
    ok = host.run([os.path.join(VENV, "bin", "tensorlane"), "status", "--socket", socket_path], check=False,
                  timeout=10).returncode == 0
    return pid if ok else None


@pytest.mark.netns
def test_agentctl_watchdog_restarts_a_stalled_agent():
    from testbed import Testbed

    workdir = tempfile.mkdtemp(prefix="tensorlane-twd-")
    run_dir = os.path.join(workdir, "run")
    paths = {"ctl": os.path.join(workdir, "tensorlane-agentctl"), "config": os.path.join(workdir, "agent.toml"),
             "socket": os.path.join(run_dir, "agent.sock"), "pid": os.path.join(run_dir, "agent.pid"),
             "log": os.path.join(workdir, "agent.log")}
    try:
        with Testbed(hosts=1, rate="100mbit", name="twd") as tb:
            h1 = tb.host(1)
            h1.run(["ip", "link", "set", "lo", "up"], timeout=10)
            with open(paths["config"], "w") as fh:
                fh.write(render_config(agent_config(tb, h1, socket=paths["socket"], state_dir=run_dir,
                                                    reconcile_interval_s=0.5)))
            render("tensorlane-agentctl.j2", paths["ctl"], tensorlane_venv=VENV, tensorlane_config_file=paths["config"],
                   tensorlane_run_dir=run_dir, tensorlane_log_file=paths["log"], tensorlane_watchdog_s=WATCHDOG_S,
                   tensorlane_restart_pause_s=RESTART_PAUSE_S, tensorlane_start_timeout_s=20,
                   tensorlane_stop_timeout_s=20)
            before, tables_before = tc_dump(h1), nft_tables(h1)
            try:
                _stall_and_recover(h1, paths)
                assert "tensorlane" in nft_tables(h1)
            finally:
                stop = h1.run([paths["ctl"], "stop"], check=False, timeout=60)
            assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr + _log(paths)
            assert tc_dump(h1) == before and nft_tables(h1) == tables_before, _log(paths)
            assert not os.path.exists(os.path.join(run_dir, "agent-eth0.json"))
            assert h1.run([paths["ctl"], "status"], check=False, timeout=10).returncode == 3
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_agentctl_retries_a_refused_start_until_stop(tmp_path):
    """An agent that refuses its start (exit status 2) is started again by the supervisor every
    ``tensorlane_restart_pause_s``, as systemd's ``Restart=on-failure`` does (some refusals pass later at boot);
    ``start`` still fails at once with the log's tail, and ``stop`` ends the retries. Until 2026-11-27 the
    supervisor ended on exit status 2 where systemd retried. The refusal here is the config's (nothing is
    touched)."""
    run_dir = tmp_path / "run"
    paths = {"ctl": str(tmp_path / "tensorlane-agentctl"), "config": str(tmp_path / "agent.toml"),
             "log": str(tmp_path / "agent.log")}
    with open(paths["config"], "w") as fh:
        fh.write('interface = "tl-none0"\nlevels = 9\n')  # refused: levels out of range
    render("tensorlane-agentctl.j2", paths["ctl"], tensorlane_venv=VENV, tensorlane_config_file=paths["config"],
           tensorlane_run_dir=str(run_dir), tensorlane_log_file=paths["log"], tensorlane_watchdog_s=WATCHDOG_S,
           tensorlane_restart_pause_s=RESTART_PAUSE_S, tensorlane_start_timeout_s=20, tensorlane_stop_timeout_s=20)
    try:
        start = subprocess.run([paths["ctl"], "start"], capture_output=True, text=True, timeout=60)
        assert start.returncode == 1, start.stdout + start.stderr
        assert "starts it again every 1 s" in start.stderr and "config field 'levels'" in start.stderr, start.stderr

        def launches() -> int:
            return open(paths["log"]).read().count(" agent --config ")

        assert _wait(lambda: launches() >= 3, 15), _log(paths)  # retried after each refusal
    finally:
        stop = subprocess.run([paths["ctl"], "stop"], capture_output=True, text=True, timeout=60)
    # "stopped" where stop met an agent just started again (it exits 2 on its own or takes SIGTERM)
    assert stop.returncode == 0 and ("not running" in stop.stdout or "stopped" in stop.stdout), stop.stdout
    seen = launches()
    time.sleep(2 * RESTART_PAUSE_S + 0.5)
    assert launches() == seen, _log(paths)  # stop ended the retries
    assert not (run_dir / "agentctl-supervisor.pid").exists()


def _log(paths: dict) -> str:
    try:
        return "\nlog:\n" + open(paths["log"]).read()[-4000:]
    except OSError:
        return ""


def _stall_and_recover(host, paths: dict) -> None:
    """Start the agent under the supervisor, SIGSTOP it, and check the watchdog replaces it in time with the same
    tree on the interface."""
    start = host.run([paths["ctl"], "start"], check=False, timeout=60)
    assert start.returncode == 0 and "started" in start.stdout, start.stdout + start.stderr + _log(paths)
    old = _read_pid(paths["pid"])
    # Its first heartbeat (the supervisor's launch removed the file): the watchdog times the stall from it (before
    # the first one, from the launch plus the start timeout)
    heartbeat = os.path.join(os.path.dirname(paths["pid"]), "agent.heartbeat")
    assert _wait(lambda: os.path.exists(heartbeat), 10), "no heartbeat within 10 s" + _log(paths)
    during = tc_dump(host)
    assert "qdisc htb 7a1: root" in during, during
    os.kill(old, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # The heartbeat is read with one-second resolution and polled every 0.5 s: allow 2.5 s beyond the timeout.
        gone = _wait(lambda: not os.path.exists(f"/proc/{old}"), WATCHDOG_S + 2.5)
        killed_after = time.monotonic() - stopped_at
        assert gone, f"the stalled agent {old} still exists {killed_after:.1f} s after SIGSTOP" + _log(paths)
        new = _wait(lambda: _serves(host, paths["socket"], paths["pid"], old), 30, step=0.2)
        back_after = time.monotonic() - stopped_at
        assert new, f"no new agent answers {back_after:.1f} s after SIGSTOP" + _log(paths)
    finally:
        if os.path.exists(f"/proc/{old}"):
            os.kill(old, signal.SIGCONT)
    assert tc_dump(host) == during, _log(paths)  # the new agent adopted the tree: the interface is as it was
    with open(paths["log"]) as fh:
        log = fh.read()
    assert f"watchdog: no heartbeat from pid {old}" in log and "adopting the tree" in log, log[-4000:]
    print(f"stalled agent killed {killed_after:.1f} s after SIGSTOP (watchdog {WATCHDOG_S} s), a new agent "
          f"answered after {back_after:.1f} s")


# --- the hand-over restart (SIGUSR2) of tensorlane-agentctl in a testbed namespace -----------------------------
HANDOVER_TESTBED = os.environ.get("TENSORLANE_TESTBED_NAME", "tho")  # (a prefix of the run's own, if it needs one)


def _watch(host, done, samples: list) -> None:
    """Until ``done`` is set (bounded: 60 s), sample eth0's root qdisc and whether flow 9811's mark is in the
    agent's map: ``(seconds since the first sample, root line, marked)``."""
    script = "tc qdisc show dev eth0 | grep ' root'; nft list map inet tensorlane flows4 2>/dev/null | grep -c 9811"
    t0 = time.monotonic()
    while not done.is_set() and time.monotonic() - t0 < 60:
        out = host.run(["sh", "-c", script], check=False, timeout=10).stdout.splitlines()
        root = next((line for line in out if " root" in line), "")
        samples.append((time.monotonic() - t0, root, out[-1:] == ["1"]))


@contextlib.contextmanager
def _agentctl_agent(workdir: str, venv: str):
    """A testbed ``tho`` of 2 hosts with an agent on host 1 started by ``tensorlane-agentctl`` (rendered for the
    agent in ``venv``) and a flow of host 1 (UDP 9811 -> 9810) registered at level 0; yields ``(h1, paths, ctl)``
    (``ctl``: the script's template values but the venv, to render it again). On the way out ``stop`` must restore
    eth0's tree and the nftables tables as they were, and leave no record."""
    from tensorlane.client import AgentClient
    from testbed import Testbed

    run_dir = os.path.join(workdir, "run")
    paths = {"ctl": os.path.join(workdir, "tensorlane-agentctl"), "config": os.path.join(workdir, "agent.toml"),
             "socket": os.path.join(run_dir, "agent.sock"), "pid": os.path.join(run_dir, "agent.pid"),
             "log": os.path.join(workdir, "agent.log")}
    ctl = dict(tensorlane_config_file=paths["config"], tensorlane_run_dir=run_dir, tensorlane_log_file=paths["log"],
               tensorlane_watchdog_s=0, tensorlane_restart_pause_s=RESTART_PAUSE_S, tensorlane_start_timeout_s=20,
               tensorlane_stop_timeout_s=20)
    with Testbed(hosts=2, rate="100mbit", name=HANDOVER_TESTBED) as tb:
        h1, h2 = tb.host(1), tb.host(2)
        h1.run(["ip", "link", "set", "lo", "up"], timeout=10)
        with open(paths["config"], "w") as fh:
            fh.write(render_config(agent_config(tb, h1, socket=paths["socket"], state_dir=run_dir,
                                                reconcile_interval_s=0.2, trusted_users=["root"])))
        render("tensorlane-agentctl.j2", paths["ctl"], tensorlane_venv=venv, **ctl)
        before, tables_before = tc_dump(h1), nft_tables(h1)
        try:
            start = h1.run([paths["ctl"], "start"], check=False, timeout=60)
            assert start.returncode == 0, start.stdout + start.stderr + _log(paths)
            with AgentClient(paths["socket"], timeout=5) as agent:
                agent.register("job-h", 0, [{"proto": "udp", "src": h1.ip, "sport": 9811, "dst": h2.ip,
                                             "dport": 9810}])
            yield h1, paths, ctl
        finally:
            stop = h1.run([paths["ctl"], "stop"], check=False, timeout=60)
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout + stop.stderr + _log(paths)
        assert tc_dump(h1) == before and nft_tables(h1) == tables_before, _log(paths)
        assert not [f for f in os.listdir(run_dir) if f.endswith(".json")]


def _runs(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie has exited (the agentctl's children are reparented to this container's
    pid 1, which reaps them when it gets to it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sampled_restart(h1, paths) -> tuple[subprocess.CompletedProcess, list]:
    """``tensorlane-agentctl restart`` on ``h1`` while :func:`_watch` samples eth0's root and flow 9811's mark (from
    3 samples before it to 0.3 s after): ``(its result, the samples)``."""
    samples: list = []
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(h1, done, samples), daemon=True)
    watcher.start()
    _wait(lambda: len(samples) >= 3, 10)
    restart = h1.run([paths["ctl"], "restart"], check=False, timeout=60)
    time.sleep(0.3)
    done.set()
    watcher.join(15)
    return restart, samples


@pytest.mark.netns
def test_agentctl_restart_hands_over_without_a_gap_and_stop_still_restores():
    """``tensorlane-agentctl restart`` (SIGUSR2: the hand-over stop): the agent's root qdisc (7a1:) is on eth0 at
    every sample of the restart, never the original nor absent, and a registered flow's mark is never missing; the
    new agent adopts the tree and keeps the mark. ``stop`` (SIGTERM) after it still restores the original tree and
    removes the table. Until 2026-11-28 restart was stop (SIGTERM: restore) then start: the original root came back
    and the marks were gone for 0.3-0.85 s."""
    workdir = tempfile.mkdtemp(prefix="tensorlane-tho-")
    try:
        with _agentctl_agent(workdir, VENV) as (h1, paths, _ctl):
            old = _read_pid(paths["pid"])
            during = tc_dump(h1)
            restart, samples = _sampled_restart(h1, paths)
            assert restart.returncode == 0 and "handed over" in restart.stdout and "started" in restart.stdout, \
                restart.stdout + restart.stderr + _log(paths)
            assert _read_pid(paths["pid"]) != old
            assert len(samples) >= 6, samples
            gaps = [s for s in samples if "qdisc htb 7a1: root" not in s[1] or not s[2]]
            assert not gaps, f"{len(gaps)} of {len(samples)} samples without the agent's root or the mark: " \
                             f"{gaps[:5]}" + _log(paths)
            assert tc_dump(h1) == during, _log(paths)  # adopted as it was: nothing made again
            with open(paths["log"]) as fh:
                log = fh.read()
            assert "handing over" in log and "adopting the tree" in log and "keeping 1 flow marks" in log, \
                log[-4000:]
            assert "restored eth0" not in log, log[-4000:]
            print(f"hand-over restart: {len(samples)} samples over {samples[-1][0]:.2f} s, none without the "
                  "agent's root or the flow's mark")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


OLD_AGENT = '''"""The current agent with SIGUSR2 at its default action: an agent from before the hand-over."""
import signal
import sys

from tensorlane.agent import daemon
from tensorlane.cli import main

_stop_on_signals = daemon._stop_on_signals


def _old():
    events = _stop_on_signals()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    return events


daemon._stop_on_signals = _old
sys.exit(main())
'''


@pytest.mark.netns
def test_agentctl_restart_of_an_agent_without_the_hand_over_restores_instead_of_killing_it():
    """The first upgrade of a fleet: the running agent is of a version without the hand-over (no SIGUSR2 handler,
    simulated here by the current agent with SIGUSR2 at its default action, in its own venv directory), the new
    ``tensorlane-agentctl`` is rendered, then ``restart``. The script reads that the agent does not catch SIGUSR2
    (SigCgt) and stops it with SIGTERM (it restores eth0 and removes its table), then starts the new agent, which
    takes eth0 over afresh. Until 2026-11-28 it sent SIGUSR2, whose default action killed the old agent without its
    restore (the new agent adopted the tree left as a crash leaves it)."""
    workdir = tempfile.mkdtemp(prefix="tensorlane-tho-")
    old_venv = os.path.join(workdir, "old-venv")
    os.makedirs(os.path.join(old_venv, "bin"))
    with open(os.path.join(old_venv, "old_agent.py"), "w") as fh:
        fh.write(OLD_AGENT)
    wrapper = os.path.join(old_venv, "bin", "tensorlane")
    with open(wrapper, "w") as fh:
        fh.write(f'#!/bin/sh\nexec {sys.executable} {old_venv}/old_agent.py "$@"\n')
    os.chmod(wrapper, 0o755)
    try:
        with _agentctl_agent(workdir, old_venv) as (h1, paths, ctl):
            old = _read_pid(paths["pid"])
            render("tensorlane-agentctl.j2", paths["ctl"], tensorlane_venv=VENV, **ctl)  # the upgrade
            restart, samples = _sampled_restart(h1, paths)
            with open(paths["log"]) as fh:
                log = fh.read()
            gaps = [s for s in samples if "qdisc htb 7a1: root" not in s[1] or not s[2]]
            print(f"restart of an agent without the hand-over: {restart.stdout.strip()!r}; {len(gaps)} of "
                  f"{len(samples)} samples without the agent's root or the mark: {gaps[:3]}")
            assert restart.returncode == 0 and "started" in restart.stdout, restart.stdout + restart.stderr + log
            assert "does not catch SIGUSR2" in restart.stdout and "handed over" not in restart.stdout, \
                restart.stdout + log[-4000:]
            assert f"the agent (pid {old}) failed" not in log and "restored eth0" in log, log[-4000:]
            new = _read_pid(paths["pid"])
            assert new != old and not _runs(old), log[-4000:]
            assert h1.run([os.path.join(VENV, "bin", "tensorlane"), "status", "--socket", paths["socket"]],
                          check=False, timeout=10).returncode == 0, log[-4000:]
            assert "qdisc htb 7a1: root" in tc_dump(h1), log[-4000:]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
