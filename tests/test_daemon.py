"""The agent's life cycle without a kernel change (agent/daemon.py): the signals it answers. The take-over itself
runs in tests/test_agent_netns.py."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading

import pytest

from tensorlane.agent import daemon
from tensorlane.agent.peers import process_start

pytestmark = pytest.mark.concurrent  # netns tests here run beside another file's (make test; pyproject markers)


def pid_of_no_process() -> int:
    """A pid that names no process, now or later: pids are below ``kernel.pid_max``. (A child's that exited is not:
    under make test another root process may take it before the test looks, pids wrapping at 32,768 here, and a
    record without ``started`` then counts as a running agent's, as in dead_agents_record.)"""
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read())


def dead_agents_record(cfg, name: str, index: int, snap=None) -> dict:
    """Save the state file of device ``name`` (ifindex ``index``) as an agent that is gone left it (its pid and start
    time name no process: a child that exited); returns the record. The start time matters: a record without one
    counts as running where its pid is root's, and under make test (the unit tests beside the netns tests, as root)
    the exited child's pid was taken by another root process before the restore looked, once in a run (2026-11-29)."""
    from tensorlane.agent.kernel import snapshot
    from tensorlane.agent.peers import process_start

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(r, 1)
        os._exit(0)
    started = process_start(pid)
    os.write(w, b"x")
    os.waitpid(pid, 0)
    os.close(r)
    os.close(w)
    state = {"ifindex": index, "interface": name, "serves": name, "backend": "htb", "pid": pid, "started": started,
             "snapshot": (snap or snapshot.Snapshot(name, index)).to_json()}
    daemon._save_state(cfg, name, state)
    return state


def test_sighup_is_logged_and_neither_stops_nor_kills_the_agent(caplog):
    """SIGHUP (an operator's ``kill -HUP`` or ``systemctl kill -s HUP``, expecting a reload) killed the agent with
    its default action: no restore, and systemd does not restart a unit whose main process died of SIGHUP."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop, handover = daemon._stop_on_signals()
        with caplog.at_level(logging.WARNING, logger="tensorlane.agent"):
            os.kill(os.getpid(), signal.SIGHUP)
        assert not stop.is_set()
        assert "does not reload its configuration" in caplog.text
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and not handover.is_set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_sigusr2_hands_over_and_a_sigterm_after_it_still_restores():
    """SIGUSR2 is the hand-over stop of a planned restart (stop, leaving everything for the next agent); SIGTERM
    keeps its meaning, stop and restore, even after a SIGUSR2 (uninstall and ``systemctl stop`` rely on it), and a
    SIGUSR2 after a SIGTERM does not turn the restore into a hand-over. Before, SIGUSR2's default action killed the
    agent (its socket file and lock file left, nothing logged)."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    try:
        stop, handover = daemon._stop_on_signals()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.is_set() and handover.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and not handover.is_set()
        stop, handover = daemon._stop_on_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.is_set() and not handover.is_set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_second_agent_in_the_network_namespace_is_refused_naming_the_first():
    """Abstract Unix socket names are per network namespace, like the agent's nftables table: a second agent with
    another state_dir (which passes the state_dir lock) is refused before it changes anything, naming the pid that
    holds the lock; the name is free again once the first lets it go."""
    name = f"tensorlane-test-{os.getpid()}"  # not the agents' own name: an agent may run in this namespace
    first = daemon.lock_netns(name)
    try:
        for _ in range(70):  # every refused start: no queue of connections fills up and lets the 66th through
            with pytest.raises(daemon.StartupError, match=rf"another tensorlane agent \(pid {os.getpid()}\) runs in "
                                                          "this network namespace"):
                daemon.lock_netns(name)
    finally:
        first.close()
    daemon.lock_netns(name).close()


def test_a_link_rate_above_the_drivers_speed_is_logged_and_a_down_link_named(monkeypatch, caplog):
    """HTB shaping above what the NIC sends moves the queue into the NIC, where priority does not hold: logged at
    start. A NIC without a carrier reports no speed: the error says that its link is down, not only that the
    device reports no speed (a physical NIC, not a veth)."""
    from tensorlane.agent.config import ConfigError, from_dict
    from tensorlane.agent.kernel import detect
    from tensorlane.agent.kernel.links import Link

    eth0 = Link("eth0", 2)
    monkeypatch.setattr(detect, "interface_speed_bps", lambda name, kind="": 10**10)
    cfg = from_dict({"interface": "eth0", "link_rate": "25gbit"})
    with caplog.at_level(logging.WARNING, logger="tensorlane.agent"):
        assert daemon._device_rate(cfg, eth0, "eth0", "htb") == 25 * 10**9
    assert "above the speed its driver reports (10,000,000,000 bit/s)" in caplog.text
    caplog.clear()
    assert daemon._device_rate(from_dict({"interface": "eth0", "link_rate": "8gbit"}), eth0, "eth0", "htb") == 8e9
    assert daemon._device_rate(cfg, eth0, "eth0", "prio") == 25 * 10**9  # prio does not shape
    assert not caplog.text
    monkeypatch.setattr(detect, "interface_speed_bps", lambda name, kind="": None)
    monkeypatch.setattr(detect, "operstate", lambda name: "down")
    with pytest.raises(daemon.NotReady, match=r"eth0 reports no speed: its link is down \(a driver reports a speed "
                                              r"only with a carrier\); taken over once it is up, or set link_rate"):
        daemon._device_rate(from_dict({"interface": "eth0"}), eth0, "eth0", "htb")  # the agent starts without it
    monkeypatch.setattr(detect, "operstate", lambda name: "up")
    with pytest.raises(ConfigError, match=r"eth0: it reports no speed; set link_rate"):
        daemon._device_rate(from_dict({"interface": "eth0"}), eth0, "eth0", "htb")
    assert daemon._device_rate(from_dict({"interface": "eth0"}), eth0, "eth0", "prio") is None
    with pytest.raises(ConfigError, match=r"v0: its veth driver's speed is a placeholder; set link_rate"):
        daemon._device_rate(from_dict({"interface": "v0"}), Link("v0", 3, "veth"), "v0", "htb")


def test_a_start_that_changed_nothing_leaves_the_nftables_table(monkeypatch, tmp_path):
    """The first state file cannot be written (``state_dir`` read-only): the start stops before any device is
    changed, and the nftables table stays too. Before, the failed start deleted the table (a killed agent's: the
    marks that kept its flows prioritised while their shims registered again) and logged a warning when there was
    none."""
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel.links import Egress, Link
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import Reconciler

    link = Link("eth0", 2)
    plan = [daemon.Takeover(link, "eth0", HtbBackend(2, 10**9), None, True)]
    calls = []
    monkeypatch.setattr(daemon, "prepare", lambda cfg, ipr: ("htb", [Egress("eth0", 2, (link,))], plan))
    monkeypatch.setattr(daemon, "restore_orphans", lambda cfg, ipr, plan: [])
    monkeypatch.setattr(daemon, "record", lambda cfg, t: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    monkeypatch.setattr(Reconciler, "teardown", lambda self: calls.append("teardown"))
    monkeypatch.setattr(daemon, "restore_device", lambda *a: calls.append("restore"))
    with pytest.raises(daemon.StartupError, match="cannot write the state file of eth0 .* nothing was changed"):
        daemon._run(Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path)))
    assert calls == []


@pytest.mark.netns  # root: a holder of another user
def test_a_squatter_on_the_namespace_lock_does_not_keep_the_agent_down(caplog):
    """Abstract socket names have no permissions: a user (nobody) who takes the agents' name first does not stop
    an agent from starting; the agent starts without the lock and says so (one error naming the pid)."""
    name = f"tensorlane-test-sq-{os.getpid()}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.bind("\0" + name)
            os.write(w, b"1")
            signal.alarm(30)  # killed by the parent long before
            signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
        with caplog.at_level(logging.ERROR, logger="tensorlane.agent"):
            assert daemon.lock_netns(name) is None
        assert f"held by a socket of uid 65534 (pid {pid}), not an agent's" in caplog.text
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    daemon.lock_netns(name).close()  # free again once the squatter is gone


@pytest.mark.netns  # root: a network namespace of its own
def test_a_down_device_with_the_noop_root_is_here_not_gone():
    """The kernel's dump leaves a down device's noop root out: such a device is here with the default root (a
    restore that stopped half-way is finished on it), not gone (its record dropped). In a fresh namespace ``lo``
    is down with noop."""
    import subprocess
    import sys

    code = ("from pyroute2 import IPRoute; from tensorlane.agent import daemon\n"
            "with IPRoute() as ipr: print(daemon._root_handle(ipr, 1), daemon._root_handle(ipr, 99999))")
    out = subprocess.run(["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.split() == ["0", "None"], out


@pytest.mark.netns  # root: a network namespace of its own
def test_a_killed_agents_record_on_a_default_root_is_restored_only_on_the_device_it_names(tmp_path):
    """A record whose device shows the default root (a restore that stopped half-way) is restored by the next
    agent where the device at its index still has the recorded name; one naming another device (an index taken
    by a device moved in from another namespace) is dropped, nothing done to that device. In a fresh namespace,
    on ``lo`` (index 1, noop root), with records of a dead agent."""
    import json

    gone = pid_of_no_process()  # the records' agent is gone
    for name, iface in (("lo", "lo"), ("eth7:1", "eth7")):
        (tmp_path / f"agent-{name}.json").write_text(json.dumps({
            "ifindex": 1, "interface": iface, "serves": iface, "backend": "htb", "pid": gone,
            "snapshot": {"ifname": iface, "ifindex": 1, "objects": []}}))
    out = _restore_orphans_in_a_fresh_netns(tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "['lo']", out
    assert list(tmp_path.glob("agent-*.json")) == []  # both records gone: one restored, one not its device's


def _restore_orphans_in_a_fresh_netns(state_dir):
    """``daemon.restore_orphans`` with no device planned, over the records in ``state_dir``, in a network namespace of
    its own (its ``lo`` is the recorded device): the finished process, whose stdout is the list restored."""
    import subprocess
    import sys

    code = ("import sys; from pyroute2 import IPRoute; from tensorlane.agent import daemon\n"
            "from tensorlane.agent.config import Config\n"
            "cfg = Config(interfaces=('eth0',), link_rate_bps=10**9, state_dir=sys.argv[1])\n"
            "with IPRoute() as ipr: print(daemon.restore_orphans(cfg, ipr, []))")
    return subprocess.run(["unshare", "-n", sys.executable, "-c", code, str(state_dir)], capture_output=True,
                          text=True, timeout=30)


@pytest.mark.netns  # root: a network namespace of its own
def test_a_dead_agents_pid_held_by_another_users_process_does_not_keep_its_device_taken_over(tmp_path):
    """A hand-over restart frees the old agent's pid, and any local user may fork until one of its processes holds
    it. The next agent restores a device the config no longer manages whatever process has the recorded pid now:
    another user's (a record without ``started``, written before 2026-11-28) or any other process than the one that
    wrote it (``started`` differs). The record of an agent that does run (its pid and start time) is left alone.
    Before, every record whose pid named a live process was taken for a running agent's and left: the device stayed
    taken over for as long as that user's process lived. On ``lo`` of a fresh namespace, as above."""
    import json
    import subprocess

    def user_sleeps():
        os.setgid(65534)
        os.setuid(65534)

    squatter = subprocess.Popen(["sleep", "60"], preexec_fn=user_sleeps)  # "nobody", holding the freed pid
    running = subprocess.Popen(["sleep", "60"])  # the agent's own user: a running agent's record, if started matches
    try:
        started = process_start(running.pid)
        cases = [({"pid": squatter.pid}, "['lo']"), ({"pid": running.pid, "started": started + 1}, "['lo']"),
                 ({"pid": running.pid, "started": started}, "[]")]
        for fields, restored in cases:
            (tmp_path / "agent-lo.json").write_text(json.dumps({
                "ifindex": 1, "interface": "lo", "serves": "lo", "backend": "htb", **fields,
                "snapshot": {"ifname": "lo", "ifindex": 1, "objects": []}}))
            out = _restore_orphans_in_a_fresh_netns(tmp_path)
            assert out.returncode == 0 and out.stdout.strip() == restored, (fields, out)
            assert (tmp_path / "agent-lo.json").exists() == (restored == "[]")
    finally:
        for proc in (squatter, running):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("left", [0, 0x7A10000], ids=["original-not-made", "ours-not-deleted"])
def test_a_restore_that_did_not_put_the_root_back_keeps_the_record(monkeypatch, tmp_path, caplog, left):
    """The device's recorded root (a tbf 1:) is not back after the restore: a request refused or lost on the way
    (ENOBUFS, EBUSY), so the device keeps the kernel's default root, or the agent's, whose deletion the restore
    does not check. The state file, the only record of the original, is kept (the caller strands it, or leaves
    it to the next agent). Before, it was removed and ``restored`` logged: on veths in a namespace the tbf was lost
    for good, or (the agent's root left) the next agent refused to start, its tree with no record. A record that
    an agent's start-up finds for a device it does not manage stays too, and the start goes on."""
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel import snapshot

    root = snapshot.TcObject("qdisc", 0x10000, snapshot.TC_H_ROOT, 0, [], "tbf")
    snap = snapshot.Snapshot("tlx", 7, [root])
    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    roots, works = {7: left}, []

    def restore(snap, ipr):
        if works:
            roots[7] = 0x10000
            return []
        return ["restoring qdisc tbf 0x10000: ENOBUFS"]

    monkeypatch.setattr(snapshot, "restore", restore)
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: roots.get(index))
    monkeypatch.setattr(daemon, "_link_name", lambda ipr, index: "tlx")
    state = dead_agents_record(cfg, "tlx", 7, snap)
    with pytest.raises(OSError, match=r"tlx's root is .*, not the recorded 1: \(restoring qdisc tbf 0x10000: ENOBUFS"):
        daemon.restore_device(cfg, None, "tlx", snap)
    assert daemon.state_path(cfg, "tlx").exists()
    with caplog.at_level(logging.ERROR, logger="tensorlane.agent"):
        assert daemon.restore_orphans(cfg, None, []) == []
    assert "restoring tlx (index 7) failed" in caplog.text and daemon.state_path(cfg, "tlx").exists()
    works.append(True)  # put back now: the record goes
    assert daemon.restore_orphans(cfg, None, []) == ["tlx"] and not daemon.state_path(cfg, "tlx").exists()
    daemon._save_state(cfg, "tlx", state)
    roots.clear()  # the device is gone, its tree with it: nothing to keep
    daemon.restore_device(cfg, None, "tlx", snap)
    assert not daemon.state_path(cfg, "tlx").exists()


@pytest.mark.netns  # root: a network namespace of its own
def test_a_restore_that_did_not_bring_every_filter_back_keeps_the_record_and_says_so(tmp_path):
    """An operator's HTB with u32 filters at prios 1 and 3, prio 2's deleted before the agent started: the u32
    root tables 800: and 802: (the gap is 801:). The kernel gives a restored root table the next free id, so prio
    3's table comes back as 801: and its key (ht 802:) is refused, EINVAL. The restore keeps the record as
    ``incomplete-tl0-*.json`` and logs an error naming what is missing and where the record is; no later start
    reads it as a record to adopt or restore (not ``agent-*.json``), each one warns about it. Before, it warned
    ``restore tl0: ... EINVAL``, removed the record and the operator's prio 3 filter was gone for good."""
    import subprocess
    import sys

    out = subprocess.run(["unshare", "-n", sys.executable, "-c", INCOMPLETE_RESTORE, str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    kept = [p.name for p in tmp_path.glob("incomplete-tl0-*.json")]
    assert len(kept) == 1 and not (tmp_path / "agent-tl0.json").exists(), (kept, out.stderr)
    assert out.returncode == 0, out.stderr
    assert "restore tl0 incomplete" in out.stderr and "not back: filter u32 802:0:800 at 1: prio 3" in out.stderr
    assert f"kept as {tmp_path / kept[0]}" in out.stderr, out.stderr
    assert out.stdout.split() == ["[]", kept[0]], out  # a later start: no record of its own, one warned about
    assert "records an operator's tree that a restore did not bring back whole" in out.stderr


INCOMPLETE_RESTORE = r"""
import logging, subprocess, sys
from pyroute2 import IPRoute
from tensorlane.agent import daemon
from tensorlane.agent.config import Config
from tensorlane.agent.kernel import snapshot

logging.basicConfig(level=logging.WARNING)
sh = lambda c: subprocess.run(c, shell=True, check=True, capture_output=True)
sh("ip link add tl0 type veth peer name tl1 && ip link set tl1 up && ip link set tl0 up")
for c in ("qdisc add dev tl0 root handle 1: htb default 20",
          "class add dev tl0 parent 1: classid 1:1 htb rate 50mbit",
          "filter add dev tl0 parent 1: prio 1 protocol ip u32 match ip dport 22 0xffff flowid 1:1",
          "filter add dev tl0 parent 1: prio 2 protocol ip u32 match ip dport 23 0xffff flowid 1:1",
          "filter add dev tl0 parent 1: prio 3 protocol ip u32 match ip dport 24 0xffff flowid 1:1",
          "filter del dev tl0 parent 1: prio 2"):
    sh(f"tc {c}")
cfg = Config(interfaces=("tl0",), link_rate_bps=10**9, take_over_root=True, state_dir=sys.argv[1])
with IPRoute() as ipr:
    index = ipr.link_lookup(ifname="tl0")[0]
    snap = snapshot.capture(ipr, "tl0", index)
    daemon._save_state(cfg, "tl0", {"ifindex": index, "interface": "tl0", "serves": "tl0", "backend": "htb",
                                    "pid": 1, "snapshot": snap.to_json()})
    sh("tc qdisc replace dev tl0 root handle 7a1: htb default 14")
    missed = daemon.restore_device(cfg, ipr, "tl0", snap)
assert any("802:0:800" in m for m in missed), missed
print(daemon._state_files(cfg), *[p.name for p in daemon.warn_incomplete(cfg)])
"""


def test_a_failed_dump_is_not_taken_for_a_device_gone(monkeypatch, tmp_path, caplog):
    """A qdisc dump that fails (ENOBUFS) on a device that is here raises; ENODEV alone says it is gone. Before,
    any error read as gone: a give-back removed the record and left the agent's tree on the device (shown on
    veths in a namespace, ENOBUFS injected once: the renamed device kept 7a1: after the agent's exit, its tbf lost
    for good), and the next agent's start dropped a killed agent's record the same way."""
    from pyroute2.netlink.exceptions import NetlinkError

    from tensorlane.agent.config import Config

    class Ipr:
        def __init__(self, qdiscs, link_error=None):
            self.qdiscs, self.link_error = qdiscs, link_error

        def get_qdiscs(self, index):
            if isinstance(self.qdiscs, Exception):
                raise self.qdiscs
            return self.qdiscs

        def link(self, cmd, index):
            if self.link_error:
                raise NetlinkError(self.link_error, os.strerror(self.link_error))
            return [{"index": index}]

    busy = NetlinkError(105, "No buffer space available")
    with pytest.raises(NetlinkError, match="No buffer space"):
        daemon._root_handle(Ipr(busy), 7)
    assert daemon._root_handle(Ipr(busy, link_error=19), 7) is None  # ENODEV: gone
    assert daemon._root_handle(Ipr(()), 7) == 0  # here, down, with the noop root the dump leaves out
    assert daemon._root_handle(Ipr((), link_error=19), 7) is None
    with pytest.raises(NetlinkError):
        daemon._root_handle(Ipr((), link_error=105), 7)

    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    dead_agents_record(cfg, "tlx", 7)
    with caplog.at_level(logging.ERROR, logger="tensorlane.agent"):
        assert daemon.restore_orphans(cfg, Ipr(busy), []) == []
    assert "restoring tlx (index 7) failed" in caplog.text and daemon.state_path(cfg, "tlx").exists()
    assert daemon.restore_orphans(cfg, Ipr(busy, link_error=19), []) == []  # gone: its record goes
    assert not daemon.state_path(cfg, "tlx").exists()


def test_a_record_adopted_under_an_old_name_stays_until_the_new_one_is_written(monkeypatch, tmp_path):
    """eth0 was renamed from old0 while no agent ran: the start adopts old0's record. Its state file cannot be
    written (ENOSPC): the old record stays (the start changed nothing); written, the old one goes. Before,
    restore_orphans removed it before the write: on veths in a namespace the failed start left the adopted tree
    with no record, and every later agent refused to start ('a tensorlane root qdisc but no state file'), the
    original lost."""
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel import snapshot
    from tensorlane.agent.kernel.links import Egress, Link
    from tensorlane.agent.kernel.qdisc import HtbBackend

    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    dead_agents_record(cfg, "old0", 2)
    link = Link("eth0", 2)
    plan = [daemon.Takeover(link, "eth0", HtbBackend(2, 10**9), snapshot.Snapshot("old0", 2), True)]
    record = daemon.record
    monkeypatch.setattr(daemon, "prepare", lambda cfg, ipr: ("htb", [Egress("eth0", 2, (link,))], plan))
    monkeypatch.setattr(daemon, "record", lambda cfg, t: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(daemon.StartupError, match="cannot write the state file of eth0"):
        daemon._run(cfg)
    assert [p.name for p in tmp_path.glob("agent-*.json")] == ["agent-old0.json"]
    record(cfg, plan[0])
    daemon.drop_superseded(cfg, plan[0])
    assert [p.name for p in tmp_path.glob("agent-*.json")] == ["agent-eth0.json"]


def test_a_reader_of_state_dir_cannot_hold_the_agents_lock(tmp_path):
    """The state_dir lock was a flock on the directory, which any user who may read it (/run/tensorlane is 0755)
    can open and lock too: one waiting in flock got it the moment the agent exited, and no agent started again
    ("another tensorlane agent (pid unknown)"). The lock is on ``agent.lock`` now, mode 0600: the directory's
    flock stops nothing; a second agent is still refused; a lock file that is a link or not the agent's is refused."""
    import fcntl

    from tensorlane.agent.config import Config

    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path / "state"))
    os.makedirs(cfg.state_dir)
    squat = os.open(cfg.state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(squat, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what any reader of the directory could do
        fd = daemon.lock_state_dir(cfg)
    finally:
        os.close(squat)
    try:
        st = os.stat(os.path.join(cfg.state_dir, daemon.STATE_LOCK))
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        with pytest.raises(daemon.StartupError, match="another tensorlane agent"):
            daemon.lock_state_dir(cfg)
    finally:
        os.close(fd)
    daemon.unlock_state_dir(cfg, daemon.lock_state_dir(cfg))  # free again
    lock = os.path.join(cfg.state_dir, daemon.STATE_LOCK)
    assert not os.path.exists(lock)  # removed as the agent exits: nothing left behind
    fd = daemon.lock_state_dir(cfg)
    os.unlink(lock)  # (as an agent that exits does) while another opened it: that one locks the new file
    other = daemon.lock_state_dir(cfg)
    assert os.fstat(other).st_ino == os.stat(lock).st_ino
    os.close(fd)
    daemon.unlock_state_dir(cfg, other)
    os.symlink(str(tmp_path / "elsewhere"), lock)
    with pytest.raises(daemon.StartupError, match="not usable"):
        daemon.lock_state_dir(cfg)
    assert not (tmp_path / "elsewhere").exists()
    if os.geteuid() == 0:
        os.unlink(lock)
        with open(lock, "w"):
            pass
        os.chown(lock, 65534, 65534)
        with pytest.raises(daemon.StartupError, match="not a file of this agent's user"):
            daemon.lock_state_dir(cfg)


def test_a_state_dir_others_may_write_is_refused(tmp_path):
    """The agent restores the trees its records in ``state_dir`` describe, and writes them there as root: a
    directory others may write to (or another user's) let any user plant a record or a link. Refused at start,
    before anything changes, naming what is wrong."""
    from tensorlane.agent.config import Config

    state = tmp_path / "state"
    state.mkdir()
    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(state))
    for mode in (0o777, 0o1777, 0o775):
        state.chmod(mode)
        with pytest.raises(daemon.StartupError, match="is writable by others"):
            daemon.lock_state_dir(cfg)
    state.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(state, 65534, 65534)
        with pytest.raises(daemon.StartupError, match="owned by uid 65534"):
            daemon.lock_state_dir(cfg)
        os.chown(state, 0, 0)
        shared = tmp_path / "shared"  # a sticky directory, like /tmp
        shared.mkdir()
        shared.chmod(0o1777)
        link = shared / "tl-state"  # another user's link to root's directory: it may point it elsewhere later
        link.symlink_to(state)
        os.lchown(link, 65534, 65534)
        with pytest.raises(daemon.StartupError, match="a symbolic link owned by uid 65534"):
            daemon.lock_state_dir(dataclasses.replace(cfg, state_dir=str(link)))
    os.close(daemon.lock_state_dir(cfg))


def test_swapped_names_keep_both_records_until_both_are_written(monkeypatch, tmp_path):
    """eth0 and eth1 swapped names while no agent ran (docs/agent.md: each adopted with the record of its index):
    agent-eth0.json records index 2 (now eth1), agent-eth1.json index 3 (now eth0). Writing eth0's record
    (index 3) overwrites agent-eth0.json, the only record of index 2, and drop_superseded then removes
    agent-eth1.json; a start that stops before eth1's record is written (ENOSPC here; a crash the same) must
    still leave a record of index 2, whose device keeps the killed agent's tree."""
    import json

    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel import snapshot
    from tensorlane.agent.kernel.links import Egress, Link
    from tensorlane.agent.kernel.qdisc import HtbBackend

    cfg = Config(interfaces=("eth0", "eth1"), link_rate_bps=10**9, state_dir=str(tmp_path))
    for name, index in (("eth0", 2), ("eth1", 3)):
        dead_agents_record(cfg, name, index)
    monkeypatch.setattr(daemon, "_index_here", lambda index: True)  # both devices are here (a record of a device
    eth0, eth1 = Link("eth0", 3), Link("eth1", 2)                   # gone is overwritten: its tree went with it)
    plan = [daemon.Takeover(eth0, "eth0", HtbBackend(2, 10**9), snapshot.Snapshot("eth1", 3), True),
            daemon.Takeover(eth1, "eth1", HtbBackend(2, 10**9), snapshot.Snapshot("eth0", 2), True)]
    record = daemon.record

    def failing_record(cfg, t):
        if t.link.name == "eth1":
            raise OSError(28, "No space left on device")
        record(cfg, t)

    class Rec:
        def __init__(self, *a, **k):
            pass

        def teardown(self):
            pass

    monkeypatch.setattr(daemon, "prepare", lambda cfg, ipr: ("htb", [Egress("eth0", 3, (eth0,)),
                                                                     Egress("eth1", 2, (eth1,))], plan))
    monkeypatch.setattr(daemon, "record", failing_record)
    monkeypatch.setattr(daemon, "take_over", lambda cfg, ipr, t: None)  # (nothing touches a device here)
    monkeypatch.setattr(daemon, "Reconciler", Rec)
    monkeypatch.setattr(daemon, "restore_device", lambda cfg, ipr, name, snap: daemon.state_path(cfg, name).unlink())
    monkeypatch.setattr(daemon, "_stop_on_signals", lambda: (None, threading.Event()))
    with pytest.raises(daemon.StartupError, match="cannot write the state file of eth1"):
        daemon._run(cfg)
    indexes = sorted(json.loads(p.read_text())["ifindex"] for p in tmp_path.glob("agent-*.json"))
    assert 2 in indexes, indexes  # eth1 (index 2) still has the killed agent's tree: its record must stay


def test_a_nic_that_renegotiates_its_speed_is_shaped_to_it(monkeypatch, caplog):
    """A NIC shaped to its driver's speed (no ``link_rate``) that renegotiates (25 Gbit/s to 10 after a cable or
    switch port change, or back): the next pass shapes its tree to the new speed, and logs it. Before, the rate
    of start-up stayed for the agent's life: above the link the queue formed in the NIC, below the classes, where
    priority does not hold, silently; below it the link was capped. A configured ``link_rate`` stays, and one
    above the new speed is logged once; no speed (no carrier) keeps the rate."""
    from tensorlane.agent.config import from_dict
    from tensorlane.agent.kernel import detect
    from tensorlane.agent.kernel.links import Link
    from tensorlane.agent.kernel.qdisc import HtbBackend

    speed = {"eth0": 25 * 10**9, "eth1": 25 * 10**9}
    monkeypatch.setattr(detect, "interface_speed_bps", lambda name, kind="": speed[name])
    cfg = from_dict({"interfaces": ["eth0", "eth1"], "link_rate": {"eth1": "25gbit"}})
    held = daemon.HeldDevices(cfg, "htb", ["eth0", "eth1"], rec=None)
    held.takeovers = [daemon.Takeover(Link(name, i), name, HtbBackend(4, 25 * 10**9, min_share=0.01), None, False)
                      for i, name in ((2, "eth0"), (3, "eth1"))]
    eth0, eth1 = (t.backend for t in held.takeovers)
    with caplog.at_level(logging.WARNING, logger="tensorlane.agent"):
        held._follow_speeds()
        assert eth0.rate == eth1.rate == 25 * 10**9 and not caplog.text
        speed.update(eth0=10**10, eth1=10**10)
        for _ in range(3):
            held._follow_speeds()
        assert eth0.rate == 10**10 and eth0.guaranteed(0) == 10**8  # 1 % of the new speed
        assert eth1.rate == 25 * 10**9  # configured
        assert caplog.text.count("eth0's driver reports 10,000,000,000 bit/s now, not 25,000,000,000") == 1
        assert caplog.text.count("eth1's driver reports 10,000,000,000 bit/s now, below its link_rate") == 1
        speed["eth0"] = None
        held._follow_speeds()
        assert eth0.rate == 10**10
        speed["eth0"] = 25 * 10**9
        held._follow_speeds()
        assert eth0.rate == 25 * 10**9


def test_two_incomplete_records_of_one_device_within_one_second_are_both_kept(tmp_path):
    """``incomplete_path`` had one-second resolution: a second incomplete restore of the same device within the same
    second replaced the first record (os.replace). Each name is now reserved, the next one numbered."""
    cfg = daemon.Config(state_dir=str(tmp_path))
    first, second = daemon.incomplete_path(cfg, "tl0"), daemon.incomplete_path(cfg, "tl0")
    assert first != second and sorted(tmp_path.glob("incomplete-tl0-*.json")) == sorted([first, second])


def test_the_state_file_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
    """A ``state_dir`` on disk (not the default ``/run``): the record and the directory entry reach the disk, so a
    power loss leaves the old record or the new one, never an empty file (the agent restores the host from it)."""
    cfg = daemon.Config(interfaces=("tl0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    daemon._save_state(cfg, "tl0", {"ifindex": 7})
    path = daemon.state_path(cfg, "tl0")
    assert synced == [str(path.with_suffix(".tmp")), str(tmp_path)]
    assert os.path.exists(path) and not os.path.exists(path.with_suffix(".tmp"))


def test_a_record_of_a_newer_format_is_neither_adopted_nor_restored(tmp_path, monkeypatch, caplog):
    """A record a newer agent left (a hand-over or a crash, then a downgrade): this agent refuses to start on its
    device, naming the file and what to do, and leaves it (and the device) alone as an orphan; records it writes
    carry its own format. Before, any record that parsed was adopted or restored, whatever wrote it."""
    from tensorlane.agent.config import Config

    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    state = dead_agents_record(cfg, "tlx", 7)
    daemon._save_state(cfg, "tlx", {**state, "format": daemon.RECORD_FORMAT + 1})
    with pytest.raises(daemon.StartupError, match=r"agent-tlx.json is of record format 2, newer than this agent's"):
        daemon._load_state(cfg, "tlx")
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: pytest.fail("a newer record was acted on"))
    with caplog.at_level(logging.ERROR, logger="tensorlane.agent"):
        assert daemon.restore_orphans(cfg, None, []) == []
    assert "newer than this agent's" in caplog.text and daemon.state_path(cfg, "tlx").exists()
    daemon._save_state(cfg, "tlx", state)  # (no format: one written before 2026-11-28, read as format 1)
    assert daemon._load_state(cfg, "tlx")["ifindex"] == 7


def test_a_metrics_port_root_listens_on_stops_the_start_another_users_does_not():
    """``metrics_address``'s port in use: where root's (or the agent user's) socket listens there (another service,
    another agent) the start is refused as a configuration error, as before; where only another user's does (any
    user may bind 9477 while no agent listens: a restart's gap), the agent starts without its metrics (the problem
    returned and logged; tried again each pass: ``tests/test_agent_netns.py::test_another_users_socket_on_the_metrics_
    port_after_a_hand_over_does_not_keep_the_agent_down``). A free port: no problem."""
    import subprocess
    import sys

    from tensorlane.agent.config import ConfigError, from_dict

    root = socket.socket()
    root.bind(("127.0.0.1", 0))
    root.listen()
    port = root.getsockname()[1]
    with pytest.raises(ConfigError, match="metrics_address"):
        daemon.check_metrics_address(from_dict({"interface": "eth0", "metrics_address": f"127.0.0.1:{port}"}))
    root.close()
    code = ("import os, socket, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
            "sys.stdin.readline()")
    user = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(user.stdout.readline())
        cfg = from_dict({"interface": "eth0", "metrics_address": f"127.0.0.1:{port}"})
        assert "held by uid 65534" in daemon.check_metrics_address(cfg)
    finally:
        user.stdin.close()
        user.wait(timeout=10)
    assert daemon.check_metrics_address(cfg) == ""


@pytest.mark.parametrize("why", ["symbolic link", "2 links", "uid 65534"])
def test_a_device_record_not_the_agents_own_is_refused_and_left_alone(tmp_path, monkeypatch, caplog, why):
    """A device's record is read only as the agent wrote it (``files.read_own_file``, the flow table files' reader):
    not through a symbolic link, not a hard link (a root file linked in from elsewhere), not another user's file
    (root: chown). The start on its device is refused naming it (as for a corrupt record), an orphan's is logged and
    left as it is, a running agent's pid is not taken from it, and nothing else changes. Until 2026-11-29 each was
    read with ``read_text``: the planted record's tree was adopted and, at the stop, restored as root."""
    import json

    from tensorlane.agent.config import Config

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(state_dir))
    record = dead_agents_record(cfg, "tlx", 7) | {"pid": 4242}
    path = daemon.state_path(cfg, "tlx")
    path.unlink()
    planted = tmp_path / "planted.json"  # a well-formed record, outside state_dir
    planted.write_text(json.dumps(record))
    if why == "symbolic link":
        path.symlink_to(planted)
    elif why == "2 links":
        os.link(planted, path)
    else:
        path.write_text(json.dumps(record))
        os.chown(path, 65534, 65534)
    before = (os.lstat(path).st_ino, planted.read_text())
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: pytest.fail("a planted record was acted on"))
    with pytest.raises(daemon.StartupError, match=f"agent-tlx.json is corrupt or unreadable .*{why}"):
        daemon._load_state(cfg, "tlx")
    assert daemon._state_of_index(cfg, 7) is None
    with caplog.at_level(logging.WARNING, logger="tensorlane.agent"):
        assert daemon.restore_orphans(cfg, None, []) == []
    assert "agent-tlx.json is not read: " in caplog.text and why in caplog.text
    held = daemon.lock_state_dir(cfg)
    try:  # (another agent holds the lock: the pid named is not the planted record's)
        with pytest.raises(daemon.StartupError, match=r"another tensorlane agent \(pid unknown\)"):
            daemon.lock_state_dir(cfg)
    finally:
        daemon.unlock_state_dir(cfg, held)
    assert (os.lstat(path).st_ino, planted.read_text()) == before  # (nothing changed)
    path.unlink()
    daemon._save_state(cfg, "tlx", record)  # the agent's own: read as before
    assert daemon._load_state(cfg, "tlx")["ifindex"] == 7


def test_a_hard_link_at_the_lock_file_is_refused_and_its_file_left_unchanged(tmp_path):
    """``state_dir/agent.lock`` a hard link to another file of root's (planted while ``state_dir`` was writable):
    the start is refused naming it, and the other file's mode is left as it is. Until 2026-11-29 the agent took the
    lock on it and made it mode 0600 (``/etc/shadow`` so linked lost its group's read)."""
    from tensorlane.agent.config import Config

    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path / "state"))
    os.makedirs(cfg.state_dir)
    other = tmp_path / "other"
    other.write_text("root's\n")
    other.chmod(0o644)
    os.link(other, os.path.join(cfg.state_dir, daemon.STATE_LOCK))
    with pytest.raises(daemon.StartupError, match="agent.lock has 2 links"):
        daemon.lock_state_dir(cfg)
    assert other.stat().st_mode & 0o777 == 0o644 and other.read_text() == "root's\n"


def test_a_writer_still_runs_by_the_same_rule_for_records_and_flow_tables(tmp_path):
    """Whether the agent that wrote a device's record or a flow table file still runs (``files.writer_runs``, one
    rule since 2026-11-29, two functions before): its pid holds the process of its start time; never this agent;
    a record without ``started`` counts as running where the pid is root's (records before 2026-11-28), a flow
    table file without ``agent_start`` as not running (taken). The outcomes are those of the two functions before."""
    import json
    import subprocess

    from tensorlane.agent import handover
    from tensorlane.agent.config import Config

    def nobody():
        os.setgid(65534)
        os.setuid(65534)

    gone = pid_of_no_process()
    root_proc = subprocess.Popen(["sleep", "60"])
    user_proc = subprocess.Popen(["sleep", "60"], preexec_fn=nobody if os.geteuid() == 0 else None)
    try:
        root, user, me = root_proc.pid, user_proc.pid, os.getpid()
        rs, us, ms = process_start(root), process_start(user), process_start(me)
        user_unstamped = os.geteuid() != 0  # (not root: "another user's" process is the agent user's own)
        # (pid, start or None, runs by a record, runs by a flow table file)
        cases = [(root, rs, True, True), (root, rs + 1, False, False), (root, None, True, False),
                 (user, us, True, True), (user, None, user_unstamped, False), (gone, None, False, False),
                 (gone, rs, False, False), (me, ms, False, False), (me, None, False, False)]
        cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
        for n, (pid, start, _, _) in enumerate(cases):
            rec = {"ifindex": n + 1, "pid": pid, "snapshot": {"ifname": f"d{n}", "ifindex": n + 1, "objects": []}}
            (tmp_path / f"agent-d{n}.json").write_text(json.dumps(rec | ({} if start is None else {"started": start})))
        not_running = {index for _, _, _, index in daemon._records_not_running(cfg)}
        assert [n + 1 not in not_running for n in range(len(cases))] == [c[2] for c in cases]
        flows = [handover._writer_runs({"agent_pid": pid, **({} if start is None else {"agent_start": start})})
                 for pid, start, _, _ in cases]
        assert flows == [c[3] for c in cases]
        # what each file's own format allows: a record's pid as a string, a boolean ``started`` (no start time:
        # root's pid counts); a flow table's pid must be a number, not a boolean
        (tmp_path / "agent-d0.json").write_text(json.dumps({"ifindex": 1, "pid": str(root), "started": True}))
        assert 1 not in {index for _, _, _, index in daemon._records_not_running(cfg)}
        assert not handover._writer_runs({"agent_pid": str(root), "agent_start": rs})
        assert not handover._writer_runs({"agent_pid": True, "agent_start": process_start(1)})
    finally:
        for proc in (root_proc, user_proc):
            proc.kill()
            proc.wait()
