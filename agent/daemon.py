"""The agent's life cycle: check everything, record each queue device, take them over, serve, give them back.

Start-up refuses bad configuration before touching the kernel (agent/kernel/links.py finds the interfaces and the
devices that carry their queues). Each device's previous tc tree is saved to the state directory before it
changes, so that SIGTERM (or a restarted agent after SIGKILL) restores it. The
service manager is told when the agent is ready and, from each reconcile pass, that it is alive (agent/notify.py).
Usage: ``sys.exit(run(load_config(path)))``
"""
from __future__ import annotations

import contextlib
import errno
import gc
import grp
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from tensorlane.agent.api import Api
from tensorlane.agent.config import Config, ConfigError, others_may_write
from tensorlane.agent.files import read_own_file, write_json_atomically, writer_runs
from tensorlane.agent.handover import FlowJournal, adopt_after_crash, adopt_flows, flows_path, write_flows
from tensorlane.agent.kernel import detect, links, snapshot, sockdiag
from tensorlane.agent.kernel.qdisc import MAJOR, fmt_handle, handle, make_backend
from tensorlane.agent.notify import Notifier
from tensorlane.agent.ownership import listening_uids
from tensorlane.agent.peers import process_start
from tensorlane.agent.reconcile import Device, Reconciler
from tensorlane.agent.server import Server, socket_dir_problem
from tensorlane.agent.state import FlowTable
from tensorlane.units import fmt_rate

log = logging.getLogger("tensorlane.agent")


class StartupError(RuntimeError):
    """The agent cannot start; nothing on the host was changed."""


class NotReady(StartupError):
    """A device cannot be taken over yet (its link is down, so its driver reports no speed): the agent starts
    without it and retries each pass, as for an interface that appears later (:class:`HeldDevices`)."""


@dataclass
class Takeover:
    """A queue device the agent will manage: its tree's backend, the record of its previous tree, and whether
    that tree was left by a previous agent of ours (adopted: nothing to delete first)."""

    link: links.Link
    serves: str  # the managed interface whose queues it carries (itself, or its bond)
    backend: object
    snap: snapshot.Snapshot
    adopted: bool

    def device(self) -> Device:
        return Device(self.link.name, self.link.index, self.backend, self.serves, self.link.kind)


def state_path(cfg: Config, device: str) -> Path:
    """The state file of queue device ``device``: the record of the tree the agent replaced there."""
    return Path(cfg.state_dir) / f"agent-{device}.json"


def stranded_name(name: str, index: int) -> str:
    """The name under which the record of a device whose give-back failed is kept (``eth0:7``): no device can have
    it (``:`` is not allowed in an interface name), so a new device under the old name never overwrites it."""
    return f"{name}:{index}"


RECORD_FORMAT = 1  # the state files' ``format``; a record without one is of format 1 (written before 2026-11-28)


def _newer_format(state: dict) -> int | None:
    """The record's ``format`` where this agent cannot read it (a newer agent's, left by a hand-over or a crash
    before a downgrade), else None."""
    fmt = state.get("format", 1)
    return fmt if not isinstance(fmt, int) or fmt > RECORD_FORMAT else None


def _read_record(path: Path) -> object:
    """The JSON document of the device record ``path``, read only as the agent wrote it
    (:func:`read_own_file`: through no link, a plain file of the agent's user with one link, not group or other
    writable). Until 2026-11-29 records were read with ``read_text``, through any link: a link or another user's file
    planted there named the tree the agent adopted and restored as root, and a FIFO there kept the start waiting.
    Raises FileNotFoundError (no such file: not None, which is what a record of ``null`` holds), OSError (refused,
    with the reason, or unreadable) or ValueError (not JSON)."""
    got = read_own_file(path)
    if got is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    return json.loads(got[0])


def _load_state(cfg: Config, device: str) -> dict | None:
    """The state a previous agent left for ``device`` (None: none); a corrupt file, one that is not an agent's
    state, or one of a newer record format (its tree is neither adopted nor restored by this agent, which could
    misread it) stops the start (nothing changed)."""
    path = state_path(cfg, device)
    try:
        state = _read_record(path)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as exc:
        raise StartupError(f"state file {path} is corrupt or unreadable ({exc}); inspect it and remove it") from None
    if isinstance(state, dict) and (fmt := _newer_format(state)) is not None:
        raise StartupError(f"state file {path} is of record format {fmt!r}, newer than this agent's "
                           f"({RECORD_FORMAT}): a newer agent left {device} taken over (a hand-over or a crash before "
                           "a downgrade); this agent neither adopts nor restores it. Start the newer version again (a "
                           "stop with SIGTERM restores the host), then downgrade (docs/runbook.md#a-restart-that-does-"
                           "not-come-back)") from None
    try:
        if not isinstance(state, dict) or not isinstance(state.get("ifindex"), int):
            raise ValueError("no ifindex")
        snapshot.Snapshot.from_json(state["snapshot"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StartupError(f"state file {path} is not a tensorlane agent's state ({type(exc).__name__}: {exc}); "
                           "inspect it and remove it") from None
    return state


def _state_files(cfg: Config) -> list[tuple[str, Path]]:
    """``(device, path)`` of every state file in ``state_dir`` (:func:`state_path`'s), by device name."""
    return [(path.name[len("agent-"):-len(".json")], path) for path in sorted(Path(cfg.state_dir).glob("agent-*.json"))]


def _state_of_index(cfg: Config, index: int) -> dict | None:
    """The state a previous agent left for the device with ifindex ``index`` under any name (one renamed while no
    agent ran: two managed interfaces that swapped names), or None."""
    for device, _path in _state_files(cfg):
        with contextlib.suppress(StartupError):  # another device's corrupt file: its own check reports it
            state = _load_state(cfg, device)
            if state and state["ifindex"] == index:
                return state
    return None


def _save_state(cfg: Config, device: str, state: dict) -> None:
    """Write the state file atomically and durably (:func:`write_json_atomically`): after a power loss a
    ``state_dir`` on disk holds the old record or the new one, never an empty one."""
    write_json_atomically(state_path(cfg, device), state, 0o644)


# What the agent cannot start without, by capability bit: tc and nftables; the qdisc probe's throwaway namespace.
NEEDED_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def missing_capabilities(status: str | None = None) -> list[str]:
    """The capabilities of NEEDED_CAPS missing from this process's effective set (``CapEff`` of
    ``/proc/self/status``, or of ``status``). Usage: ``missing_capabilities("CapEff: 1000") == ["CAP_SYS_ADMIN"]``
    """
    if status is None:
        status = Path("/proc/self/status").read_text()
    eff = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0)
    return [name for name, bit in NEEDED_CAPS.items() if not eff >> bit & 1]


def check_privileges() -> None:
    """Refuse to start, before anything is made or changed, without the capabilities the agent needs."""
    missing = missing_capabilities()
    if missing:
        raise StartupError(f"the agent must run as root: this process lacks {' and '.join(missing)} (tc, nftables "
                           "and the qdisc probe's network namespace need them); nothing was changed")


STATE_LOCK = "agent.lock"  # the file in state_dir an agent holds its lock on (only the agent's user can open it)


def lock_state_dir(cfg: Config) -> int:
    """Hold a lock on ``state_dir`` for this agent's life (the returned descriptor): a second agent with the same
    ``state_dir`` (the same config run by hand beside the service) would adopt the running agent's trees, take its
    socket and fight its reconciler over every flow. Nothing changed on failure.

    The lock is on the file ``state_dir/agent.lock``, mode 0600, which only the agent's user can open (removed
    as the agent exits: :func:`unlock_state_dir`). It was on
    the directory itself, which any user who may read it (``/run/tensorlane`` is 0755) can open and lock as well: a
    user waiting in ``flock`` got the lock the moment the agent exited and kept every later agent from starting
    ("another tensorlane agent (pid unknown) runs")."""
    path = os.path.join(cfg.state_dir, STATE_LOCK)
    try:
        os.makedirs(cfg.state_dir, exist_ok=True)
        st = os.stat(cfg.state_dir)
        wrong = ([f"owned by uid {st.st_uid}"] if st.st_uid != os.geteuid() else []) + (
            ["writable by others"] if st.st_mode & 0o022 else [])
        if not wrong and (problem := others_may_write(cfg.state_dir)):  # (above it, or through another's link)
            wrong = [f"not safe from other users: {problem}"]
        if wrong:  # (another user could plant records, which the agent restores onto devices, or links it writes)
            raise StartupError(f"state_dir {cfg.state_dir} is {' and '.join(wrong)} (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}): the agent restores the trees its records there "
                               "describe and writes them as root, so only its own user may write there; make it the "
                               "agent user's, mode 0755")
        for _ in range(3):  # (a file the agent before removed as it exited, after we opened it: open it afresh)
            fd = _lock_file(cfg, path)
            if fd is not None:
                return fd
    except OSError as exc:
        raise StartupError(f"state_dir {cfg.state_dir} is not usable: {exc}") from None
    raise StartupError(f"{path} keeps being replaced: is another agent starting and stopping with this state_dir?")


def _lock_file(cfg: Config, path: str) -> int | None:
    """Open, check and lock ``path`` (:func:`lock_state_dir`); None when it was removed or replaced meanwhile."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StartupError(f"{path} is not a file of this agent's user (uid {st.st_uid}): someone else made it, "
                               f"and could hold the lock; remove it, and keep {cfg.state_dir} writable by root only")
        if st.st_nlink > 1:  # (a hard link to another file of root's: its mode would be changed below; until
            # 2026-11-29 it was, /etc/shadow's or any other root file's so linked made 0600)
            raise StartupError(f"{path} has {st.st_nlink} links: another file of root's is linked there; remove it "
                               f"(nothing was changed), and keep {cfg.state_dir} writable by root only")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # (no one else may open it: a reader could lock it too)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_file(fd, path):
            os.close(fd)
            return None
    except BlockingIOError:
        os.close(fd)
        pids = set()
        for _device, state in _state_files(cfg):
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
                pids.add(str(int(_read_record(state)["pid"])))
        raise StartupError(f"another tensorlane agent (pid {', '.join(sorted(pids)) or 'unknown'}) runs with "
                           f"state_dir {cfg.state_dir}; stop it first (two agents would fight over the same "
                           "devices)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def keep_state_dir_lock(cfg: Config, fd: int) -> tuple[int, str]:
    """The ``state_dir`` lock ``fd`` still held, or taken afresh where its file was removed while the agent ran
    (``rm -rf /run/tensorlane``): ``(fd to hold from now on, problem or "")``. Until 2026-11-27 the lock stayed on
    the removed file, and a second agent with the same ``state_dir`` (another network namespace's) could start."""
    path = os.path.join(cfg.state_dir, STATE_LOCK)
    if _same_file(fd, path):
        return fd, ""
    try:
        os.makedirs(cfg.state_dir, mode=0o755, exist_ok=True)
        new = _lock_file(cfg, path)
    except (OSError, StartupError) as exc:
        return fd, f"the state_dir lock {path} was removed and cannot be taken again: {exc}"
    if new is None:
        return fd, f"the state_dir lock {path} was removed and is being replaced meanwhile"
    os.close(fd)
    log.warning("the state_dir lock %s was removed while the agent ran: took it again", path)
    return new, ""


def unlock_state_dir(cfg: Config, fd: int) -> None:
    """Give the ``state_dir`` lock back, removing its file (nothing is left behind): removed while still held, so an
    agent that opened it meanwhile finds it gone once it has the lock, and opens a new one (:func:`_lock_file`)."""
    path = os.path.join(cfg.state_dir, STATE_LOCK)
    try:
        if _same_file(fd, path):
            os.unlink(path)
    except OSError as exc:  # (state_dir read-only by now): the file stays, harmless
        log.warning("cannot remove %s: %s", path, exc)
    finally:
        os.close(fd)


NETNS_LOCK = "tensorlane-agent"  # the abstract Unix socket an agent holds in its network namespace


def lock_netns(name: str = NETNS_LOCK) -> socket.socket | None:
    """Hold the abstract Unix socket ``name`` for this agent's life (the returned socket; the kernel frees it when
    the process ends, however): abstract names are per network namespace, like the agent's nftables table
    ``inet tensorlane``. A second agent in the namespace with another ``state_dir`` (one per NIC, or a copy of the
    service's config) passed the ``state_dir`` lock, and the two replaced each other's table every pass (dropping
    each other's flow marks) until one exited and deleted the other's. Nothing changed on failure.

    Abstract names have no permissions: any local user may take this one first. The kernel says who made the
    socket that holds it (sock_diag's ``UNIX_DIAG_UID``, fixed at ``socket()``: passing it on changes nothing).
    Root or this agent's user: an agent, the start is refused. Anyone else: a squatter, and this agent starts
    without the lock (one error logged) rather than be kept down by any local user. Returns None then."""
    for _ in range(3):  # (a holder that goes between the bind and the question: bind again)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind("\0" + name)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        try:
            held = sockdiag.unix_name_sockets(name)
        except OSError as exc:  # the kernel cannot tell (no unix_diag): refused, as a second agent would be
            raise StartupError(f"the abstract socket @{name} is held ({error}) and this kernel cannot tell by whom "
                               f"({exc}): another tensorlane agent may run in this network namespace") from None
        uids = [h.uid for h in held]
        if any(uid in (0, os.geteuid()) for uid in uids):
            holders = ", ".join(_socket_holders(held)) or "unknown"
            raise StartupError(f"another tensorlane agent (pid {holders}) runs in this network namespace ({error}); "
                               "one agent manages every interface of a namespace (interfaces = [...]): stop it first")
        if uids:
            log.error("the abstract socket @%s, which tells agents of this network namespace apart, is held by a "
                      "socket of uid %s (pid %s), not an agent's: starting without it (a second agent in this "
                      "namespace would not be refused)", name, ", ".join(map(str, sorted(set(uids)))),
                      ", ".join(_socket_holders(held)) or "unknown")
            return None
    raise StartupError(f"the abstract socket @{name} is held, by no socket the kernel lists ({error})")


def _socket_holders(held: list[sockdiag.UnixSocket]) -> list[str]:
    """The pids of the processes that hold the sockets ``held`` (``sockdiag.unix_name_sockets``: their inodes, then
    each process's descriptors); only when a start is refused."""
    links = {f"socket:[{h.inode}]" for h in held}
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in links for fd in (proc / "fd").iterdir()):
                    pids.append(proc.name)
    return sorted(pids, key=int)


def _choose_kind(cfg: Config) -> str:
    """The backend kind, one for every device (so that one flow map serves them all)."""
    try:
        return detect.choose_backend(cfg.backend, detect.probe_qdiscs(("prio", "htb")),
                                     cfg.link_rate_bps is not None)
    except ValueError as exc:
        raise ConfigError("backend", str(exc)) from None


def _device_rate(cfg: Config, link: links.Link, serves: str, kind: str) -> int | None:
    """Device ``link``'s rate: ``link_rate``, else the driver's speed (not a veth's or tun's placeholder). The htb
    backend needs one (an error naming why there is none); a ``link_rate`` above the driver's speed is logged: HTB
    then sends faster than the NIC, so the queue forms in the NIC's ring, below the agent's classes, and priority
    is lost there."""
    name = link.name
    configured, speed = cfg.rate_of(name, serves), detect.interface_speed_bps(name, link.kind)
    if kind == "htb" and configured and speed and configured > speed:
        log.warning("link_rate %s bit/s of %s is above the speed its driver reports (%s bit/s): the queue will form "
                    "in the NIC, below the agent's classes, where priority does not hold; set link_rate to the "
                    "link's real rate", f"{configured:,}", name, f"{speed:,}")
    if kind == "htb" and (configured or speed) is None:
        placeholder = link.kind in detect.PLACEHOLDER_SPEED_KINDS
        state = "" if placeholder else detect.operstate(name)
        if state not in ("up", "unknown", ""):
            raise NotReady(f"{name} reports no speed: its link is {state} (a driver reports a speed only with a "
                           "carrier); taken over once it is up, or set link_rate for the htb backend")
        said = f"its {link.kind} driver's speed is a placeholder" if placeholder else "it reports no speed"
        raise ConfigError("link_rate", f"{name}: {said}; set link_rate for the htb backend (one rate, or a table "
                                       f"such as link_rate = {{ {name} = \"25gbit\" }})")
    return configured or speed


def _backend(cfg: Config, kind: str, rate: int | None):
    """The ``kind`` backend of the configured levels, queues and guarantees, shaping to ``rate``."""
    return make_backend(kind, cfg.levels, rate, cfg.queue_limit_packets, cfg.min_share, cfg.min_rate_bps)


def _prepare_device(cfg: Config, ipr: IPRoute, link: links.Link, serves: str, kind: str) -> Takeover:
    """The checks of one queue device, no changes: its rate, a previous agent's tree to adopt, or the tree to
    record and whether it may be replaced."""
    backend = _backend(cfg, kind, _device_rate(cfg, link, serves, kind))
    previous = _load_state(cfg, link.name)
    if not (previous and previous.get("ifindex") == link.index):
        previous = _state_of_index(cfg, link.index) or previous  # renamed while no agent ran: its record, by index
    if previous and previous.get("ifindex") == link.index and backend.owns(ipr, link.index):
        log.warning("adopting the tree left by a previous agent on %s; keeping its record of the original",
                    link.name)
        return Takeover(link, serves, backend, snapshot.Snapshot.from_json(previous["snapshot"]), True)
    snap = snapshot.capture(ipr, link.name, link.index)
    if previous and previous.get("ifindex") == link.index and snap.root_is_default:
        # our tree is gone and nothing replaced it: the previous agent died while restoring (after deleting its
        # root, before re-creating the original), or someone removed its root. The record is the original still
        log.warning("state file %s records %s's original tree, and the device has no root qdisc of its own now: "
                    "keeping that record, to restore on exit", state_path(cfg, link.name), link.name)
        return Takeover(link, serves, backend, snapshot.Snapshot.from_json(previous["snapshot"]), False)
    if previous:
        log.warning("state file %s describes a tree that is gone; recording the interface afresh",
                    state_path(cfg, link.name))
    root = snap.root
    if backend.owns(ipr, link.index):
        raise StartupError(f"{link.name} has a tensorlane root qdisc but no state file in {cfg.state_dir}: "
                           "another agent may manage it; stop it or remove the qdisc")
    if not snap.root_is_default and not cfg.take_over_root:
        raise StartupError(f"{link.name} has a root qdisc '{root.kind}' (handle {fmt_handle(root.handle)}) "
                           "that tensorlane did not create; refusing to replace it (set take_over_root = true "
                           "to replace it and restore it on exit)")
    return Takeover(link, serves, backend, snap, False)


class HeldDevices:
    """The queue devices the agent holds, kept to its managed interfaces (by name) for its whole life.

    Every full pass reads the links. A device that left (deleted, moved to another network namespace, renamed, or
    out of its bond) is given back: its recorded tree restored where it is still here, its state file removed. One
    that came (the interface re-created or renamed back, a new bond member) is checked, recorded and taken over as
    at start-up, with the job policy's current guaranteed shares. What cannot be taken over (a foreign root without
    ``take_over_root``, no link rate) and a managed interface that is absent are reconcile errors, retried each pass.
    Usage: ``held = HeldDevices(cfg, kind, ["eth0"], rec); ...; problems = held.follow(ipr)``
    """

    def __init__(self, cfg: Config, kind: str, names: list[str], rec: Reconciler, lock: list[int] | None = None):
        self.cfg, self.kind, self.rec = cfg, kind, rec
        self.lock = lock  # [fd] of the state_dir lock (run() releases lock[0]): taken again if its file is removed
        self.names = list(names)  # the managed interfaces: as configured, or as the routes named them at start-up
        self.takeovers: list[Takeover] = []  # what is taken over now, in the order taken (restored in reverse)
        self.stranded: dict[int, Takeover] = {}  # by index: given back, but the restore failed (retried on exit)
        self.speeds: dict[int, int | None] = {}  # by index: the driver's speed at the last pass (_follow_speeds)

    def follow(self, ipr) -> list[str]:
        """Give back the devices that no longer carry a managed interface's queues, take over those that came;
        keep the reconciler's devices and interfaces to that. Returns the problems, one line each."""
        now = links.read_links(ipr)
        want: dict[tuple[str, int, str], links.Link] = {}
        index: dict[str, int] = {}
        problems = []
        for name in self.names:
            link = now.get(name)
            index[name] = link.index if link else 0  # 0: absent (no route lookup answers it)
            if link is None:
                problems.append(f"{name}: no such interface (deleted, renamed or moved to another network "
                                "namespace): its flows are not queued until it is back")
                continue
            try:
                want.update(((q.name, q.index, name), q) for q in links.queue_links(link, now))
            except links.LinkError as exc:
                problems.append(str(exc))
        held = {(t.link.name, t.link.index, t.serves): t for t in self.takeovers}
        try:
            for key in held.keys() - want.keys():
                self._give_back(ipr, held[key], now)
            for key in want.keys() - held.keys():
                problem = self._take(ipr, want[key], key[2])
                if problem:
                    problems.append(problem)
            self._follow_speeds()
            if self.lock is not None:  # (before the records: no other agent may take them up meanwhile)
                self.lock[0], problem = keep_state_dir_lock(self.cfg, self.lock[0])
                problems += [problem] if problem else []
            problems += self._records_again()
        finally:  # whatever failed: the pass applies trees to the devices held now, never to one given back
            devices = [t.device() for t in self.takeovers]
            if devices != self.rec.devices or index != self.rec.interfaces:
                self.rec.follow(devices, index)
        return problems

    def _records_again(self) -> list[str]:
        """Write again the state file of each device held whose file was removed while the agent ran (``rm -rf
        /run/tensorlane``, a tmpfiles clean-up): the record of its original tree, which only the agent's memory
        holds then. Before, an agent killed after that (SIGKILL, its watchdog) could not be started again, its
        tree taken for another agent's, and the original tree was lost for good. Returns the problems."""
        problems = []
        for t in self.takeovers:
            path = state_path(self.cfg, t.link.name)
            if path.exists():
                continue
            try:
                record(self.cfg, t)
            except OSError as exc:
                problems.append(f"{t.link.name}: its state file {path} was removed and cannot be written again: {exc}")
                continue
            self.rec.stats.repairs += 1
            log.warning("the state file %s was removed while the agent ran: wrote it again (the record of %s's "
                        "original tree, which a next agent needs)", path, t.link.name)
        return problems

    def _follow_speeds(self) -> None:
        """Follow the driver's speed of each device the htb backend shapes (a NIC that renegotiated, 25 to 10 Gbit/s
        after a cable or switch port change, or back): where no ``link_rate`` is configured for it, the tree is
        shaped to the new speed (the pass changes its classes in place; the job parts follow); a configured one
        above the new speed is logged, as at start. Before, the rate of start-up stayed: above the link the queue
        formed in the NIC, below the classes, where priority does not hold; below it the link was capped. A
        device that reports no speed now (no carrier) keeps its rate."""
        if self.kind != "htb":
            return
        for t in self.takeovers:
            speed = detect.interface_speed_bps(t.link.name, t.link.kind)
            last = self.speeds.get(t.link.index, speed)  # (the first look: start-up judged it already)
            self.speeds[t.link.index] = speed
            if speed is None or speed == last and speed == t.backend.rate:
                continue
            configured = self.cfg.rate_of(t.link.name, t.serves)
            if configured is None and speed != t.backend.rate:
                log.warning("%s's driver reports %s bit/s now, not %s: shaping its tree to that (no link_rate is "
                            "configured for it)", t.link.name, f"{speed:,}", f"{t.backend.rate:,}")
                t.backend.rate = speed
            elif configured and speed != last and configured > speed:
                log.warning("%s's driver reports %s bit/s now, below its link_rate %s bit/s: the queue will form in "
                            "the NIC, below the agent's classes, where priority does not hold; set link_rate to the "
                            "link's real rate", t.link.name, f"{speed:,}", f"{configured:,}")

    def _give_back(self, ipr, t: Takeover, now: dict[str, links.Link]) -> None:
        """``t``'s device no longer carries a managed interface's queues: its recorded tree back where the device
        is still here with the agent's root, its state file removed either way."""
        self.takeovers.remove(t)
        here = any(link.index == t.link.index for link in now.values())
        try:
            if here and _root_handle(ipr, t.link.index) in (handle(MAJOR), 0):  # ours, or a half-done restore's
                log.warning("%s (index %d) no longer carries %s's queues (renamed, or out of its bond): restoring "
                            "its tree", t.link.name, t.link.index, t.serves)
                restore_device(self.cfg, ipr, t.link.name, t.snap)
            else:
                log.warning("%s (index %d) is gone (deleted, or moved to another network namespace): its tree went "
                            "with it", t.link.name, t.link.index)
                state_path(self.cfg, t.link.name).unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001 - the record is kept, where no device overwrites it
            log.error("giving back %s failed: %s", t.link.name, exc)
            if here:
                self._strand(t)

    def _strand(self, t: Takeover) -> None:
        """Keep the record of ``t``, whose restore failed, under :func:`stranded_name` (a device that comes under
        its old name would overwrite it): restored on exit, found by its index if it comes back under a managed
        name (adopted with its record), or by the next agent."""
        kept = state_path(self.cfg, stranded_name(t.link.name, t.link.index))
        try:
            os.replace(state_path(self.cfg, t.link.name), kept)
        except OSError as exc:
            log.error("cannot keep the record of %s (index %d) as %s: %s", t.link.name, t.link.index, kept, exc)
            return
        self.stranded[t.link.index] = t
        log.error("%s (index %d) keeps tensorlane's tree; its record is %s, restored when the agent stops",
                  t.link.name, t.link.index, kept)

    def restore_stranded(self, ipr) -> None:
        """On exit: put back the trees of the devices whose give-back failed, where the agent's root is still
        there; a failure keeps the record for the next agent (:func:`restore_orphans`)."""
        for index, t in list(self.stranded.items()):
            name = stranded_name(t.link.name, index)
            try:
                root = _root_handle(ipr, index)
                if root in (handle(MAJOR), 0):  # ours, or the kernel's default (a restore that stopped half-way)
                    if not restore_device(self.cfg, ipr, name, t.snap):  # (else its error is logged)
                        log.info("restored %s (index %d), given back earlier", t.link.name, index)
                else:  # someone else's root there now: not ours to replace
                    state_path(self.cfg, name).unlink(missing_ok=True)
                del self.stranded[index]
            except Exception as exc:  # noqa: BLE001 - the record stays for the next agent
                log.error("restoring %s (index %d) failed again: %s (%s is kept)", t.link.name, index, exc,
                          state_path(self.cfg, name))

    def _take(self, ipr, link: links.Link, serves: str) -> str | None:
        """Check, record and take over ``link`` for ``serves`` (as at start-up); the problem, if it cannot be."""
        try:
            t = _prepare_device(self.cfg, ipr, link, serves, self.kind)
        except (StartupError, ConfigError) as exc:
            return f"{link.name}: {exc}"
        except Exception as exc:  # noqa: BLE001 - (netlink: EBUSY, ENOBUFS, the device gone meanwhile) nothing changed
            return f"{link.name}: reading its tree: {exc}"
        t.backend.set_shares(self.rec.shares)
        try:
            record(self.cfg, t)
        except OSError as exc:
            return f"{link.name}: cannot write its state file in {self.cfg.state_dir}: {exc}"
        self.takeovers.append(t)  # from here it is restored on exit, whatever happens next
        gone = self.stranded.pop(link.index, None)
        if gone is not None:  # back under a managed name: recorded under it now (adopted with that record)
            state_path(self.cfg, stranded_name(gone.link.name, link.index)).unlink(missing_ok=True)
        try:
            take_over(self.cfg, ipr, t)
        except Exception as exc:  # noqa: BLE001 - the reconcile pass applies the tree again
            return f"{link.name}: taking it over: {exc}"
        log.warning("took over %s (index %d), which carries %s's queues now (re-created, back in this namespace, "
                    "renamed to it, or joined its bond)", link.name, link.index, serves)
        return None


def check_metrics_address(cfg: Config) -> str:
    """``metrics_address`` must be free to listen on: checked before anything changes (the metrics server starts
    after the take-over, where a port in use stopped the agent with a traceback). A port held by another user (not
    root, not the agent's user: :func:`metrics_port_squatted`) does not stop the start: returned as the problem
    (the agent starts without its metrics and tries again each pass: :class:`Metrics`); "" when it is free."""
    if not cfg.metrics_address:
        return ""
    host, _, port = cfg.metrics_address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, addr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as exc:
        if problem := metrics_port_squatted(cfg, exc):
            return problem
        raise ConfigError("metrics_address", f"cannot listen on {cfg.metrics_address}: {exc}") from None
    return ""


def metrics_port_squatted(cfg: Config, exc: OSError) -> str:
    """Why the agent may start without its metrics ("" where it may not): ``metrics_address``'s port is in use
    (``exc``: EADDRINUSE) and no socket of root's or the agent user's listens on it. Any local user may bind an
    unprivileged port (9477) while no agent listens there, as in the gap of a restart (a hand-over's, which leaves
    every device taken over for the next agent): until 2026-11-28 that refused every later start for as long as
    the user held it, no agent running, the flow marks left as they were. A port root's or the agent user's socket
    listens on (another service, another agent) is a configuration error: the start is refused, as before."""
    if exc.errno != errno.EADDRINUSE:
        return ""
    port = int(cfg.metrics_address.rpartition(":")[2])
    try:
        uids = listening_uids(port)
    except OSError:  # (the tables unreadable: no listener known)
        uids = set()
    if uids & {0, os.geteuid()}:
        return ""
    held = f"uid {', '.join(map(str, sorted(uids)))}" if uids else "a socket of another user's that does not listen"
    return (f"cannot listen on metrics_address {cfg.metrics_address}: the port is held by {held}, not root's or the "
            "agent's: serving without metrics (no /metrics, no /healthz) and trying again each pass")


class Metrics:
    """The metrics server of ``metrics_address``: started at once, or, while another user holds its port
    (:func:`metrics_port_squatted`), at the first pass that finds it free. ``problem``: why it does not run."""

    def __init__(self, cfg: Config, api: Api):
        """Start the server (raises where the address cannot be listened on and no other user holds its port)."""
        self.cfg, self.api, self.server, self.problem = cfg, api, None, ""
        if cfg.metrics_address:
            self._start(at_start=True)

    def _start(self, at_start: bool = False) -> None:
        """Listen now; where the port is another user's, note why (logged once) and leave it for a later pass."""
        from tensorlane.agent.metrics import start_metrics_server
        try:
            self.server = start_metrics_server(self.cfg.metrics_address, self.api)
        except OSError as exc:
            squatted = metrics_port_squatted(self.cfg, exc)
            if at_start and not squatted:
                raise
            problem = squatted or f"cannot listen on {self.cfg.metrics_address}: {exc}"
            if problem != self.problem:
                log.error("%s", problem)
            self.problem = problem
            return
        if self.problem:
            log.warning("metrics_address %s is free again: serving /metrics and /healthz", self.cfg.metrics_address)
        self.problem = ""

    def retry(self) -> str:
        """Each pass: try again where the server does not run; why it still does not ("" when it runs)."""
        if self.server is None and self.cfg.metrics_address:
            self._start()
        return self.problem


def check_socket_group(cfg: Config) -> None:
    """``socket_group`` must name a group of this host (checked before anything changes, not at the socket's
    ``chown``, after the interfaces were taken over)."""
    if cfg.socket_group is not None:
        try:
            grp.getgrnam(cfg.socket_group)
        except KeyError:
            raise ConfigError("socket_group", f"no group {cfg.socket_group!r} on this host") from None


def _waiting_for(eg: links.Egress) -> str | None:
    """What a managed interface the agent cannot take over yet waits for (None: it is here, with its queues)."""
    if not eg.index:
        return "no such interface here now (the agent starts without it and takes it over when it appears)"
    if not eg.queues:
        return "a bond without members now (its members are taken over as they join)"
    return None


def host_notes(cfg: Config, ipr: IPRoute) -> list[str]:
    """What this host makes of ``cfg`` now, for ``--check-config``, which changes nothing and does not fail on it
    (it may differ at the agent's start: a bond or a route that comes up later): the interfaces it would manage,
    absent ones, a bond without members, an interface named twice through a bond, a ``socket_group`` not here, a
    ``link_rate`` table naming a device none of the managed queues are on, and per queue device a missing link rate
    or a root qdisc the agent may not replace (``_device_notes``)."""
    notes = []
    try:
        egress = links.resolve(ipr, cfg.interfaces, cfg.training_subnets, absent_ok=True)
    except links.LinkError as exc:
        notes.append(f"the agent would refuse to start here now: {exc}")
        egress = []
    for eg in egress:
        why = _waiting_for(eg)
        notes.append(f"{eg.name}: {why or 'here, queues on ' + ', '.join(q.name for q in eg.queues)}")
        for q in [] if why else eg.queues:
            notes += _device_notes(cfg, ipr, q, eg.name)
    known = {n for eg in egress for n in (eg.name, *(q.name for q in eg.queues))}
    if isinstance(cfg.link_rate_bps, dict) and egress and not any(_waiting_for(eg) for eg in egress):
        unused = sorted(set(cfg.link_rate_bps) - known)  # a typo: that device's queues took the driver's speed
        if unused:
            notes.append(f"link_rate names {', '.join(unused)}, which carries none of the managed queues here "
                         f"({', '.join(sorted(known))}): its rate is not used")
    try:
        check_socket_group(cfg)
    except ConfigError as exc:
        notes.append(f"the agent would refuse to start here now: {exc}")
    return notes


def _device_notes(cfg: Config, ipr: IPRoute, link: links.Link, serves: str) -> list[str]:
    """``host_notes`` of one queue device, read only: the link rate the htb backend needs, and a root qdisc of
    another's that the agent would refuse to replace without ``take_over_root`` (both stopped the start of an agent
    whose file ``--check-config`` had passed without a word)."""
    notes = []
    kind = cfg.backend if cfg.backend != "auto" else ("htb" if cfg.link_rate_bps is not None else None)
    try:
        _device_rate(cfg, link, serves, kind or "htb")
    except ConfigError as exc:
        notes.append("the agent would refuse to start here now" + (
            "" if kind else " where it picks the htb backend (backend = \"auto\" does on a kernel without the prio "
                            "qdisc)") + f": {exc}")
    except NotReady as exc:
        notes.append(str(exc))
    try:
        roots = [q for q in ipr.get_qdiscs(index=link.index) if q["parent"] == snapshot.TC_H_ROOT]
    except NetlinkError as exc:
        return [*notes, f"{link.name}: its qdiscs could not be read: {exc}"]
    root = roots[0] if roots else None
    if root is not None and root["handle"] and root["handle"] >> 16 != MAJOR and not cfg.take_over_root:
        notes.append(f"the agent would refuse to start here now: {link.name} has a root qdisc "
                     f"'{root.get_attr('TCA_KIND')}' (handle {fmt_handle(root['handle'])}) that tensorlane did not "
                     "create; set take_over_root = true to replace it and restore it on exit")
    return notes


def check_socket_path(cfg: Config) -> None:
    """``socket`` must be a path the agent can bind: its directory made (or there) and writable, and nothing there
    but a socket (a previous agent's, replaced at bind). Checked before anything changes: the bind came after the
    take-over, where a directory it could not make stopped the agent with a traceback and exit status 1, which a
    supervisor restarts, taking the devices over and giving them back every few seconds; and any file at the path
    was deleted."""
    directory = os.path.dirname(cfg.socket)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError("socket", f"cannot make the directory of {cfg.socket}: {exc}") from None
    try:
        st = os.lstat(cfg.socket)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError("socket", f"cannot use {cfg.socket}: {exc}") from None
    if st is not None and not stat.S_ISSOCK(st.st_mode):
        raise ConfigError("socket", f"{cfg.socket} exists and is not a socket; refusing to replace it")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError("socket", f"cannot create {cfg.socket}: its directory {directory} is not writable")
    if problem := socket_dir_problem(directory):
        raise ConfigError("socket", f"another user could replace {cfg.socket} with a socket of its own (every client "
                                    f"would talk to it): {problem}; make the directory root's or the agent user's, "
                                    "mode 0755")


def prepare(cfg: Config, ipr: IPRoute) -> tuple[str, list[links.Egress], list[Takeover]]:
    """All checks, no changes: the backend kind, the managed interfaces and a Takeover per queue device."""
    try:
        egress = links.resolve(ipr, cfg.interfaces, cfg.training_subnets, absent_ok=True)
    except links.LinkError as exc:
        raise ConfigError("interface" if len(cfg.interfaces) == 1 else "interfaces", str(exc)) from None
    kind = _choose_kind(cfg)
    check_socket_group(cfg)
    check_socket_path(cfg)
    if problem := check_metrics_address(cfg):
        log.error("%s", problem)
    plan = []
    for eg in egress:
        if why := _waiting_for(eg):
            log.warning("%s: %s; every pass fails naming it until then", eg.name, why)
        for q in eg.queues:
            try:
                plan.append(_prepare_device(cfg, ipr, q, eg.name, kind))
            except NotReady as exc:
                log.warning("%s; the agent starts without it and retries each pass", exc)
    return kind, egress, plan


def _index_here(index: int) -> bool:
    """Whether a device of this network namespace has ifindex ``index``."""
    try:
        socket.if_indextoname(index)
    except OSError:
        return False
    return True


def record(cfg: Config, t: Takeover) -> None:
    """Record ``t``'s previous tree in its state file (before anything on the device changes). A record of another
    device already under that name (two managed interfaces that swapped names while no agent ran: it is the only
    record of the other one until that one's is written) is first kept aside under :func:`stranded_name`, where
    :func:`drop_superseded` or the next agent finds it by its index; overwritten, a start stopped in between
    left that device's tree with no record."""
    previous = None
    with contextlib.suppress(StartupError):  # (a file that is not an agent's record: overwritten, as before)
        previous = _load_state(cfg, t.link.name)
    index = previous["ifindex"] if previous else t.link.index
    if index != t.link.index and _index_here(index):  # (a device gone: its tree went with it, nothing to keep)
        os.replace(state_path(cfg, t.link.name), state_path(cfg, stranded_name(t.link.name, index)))
    _save_state(cfg, t.link.name, {"format": RECORD_FORMAT, "ifindex": t.link.index, "interface": t.link.name,
                                   "serves": t.serves, "backend": t.backend.kind, "pid": os.getpid(),
                                   "started": process_start(os.getpid()), "snapshot": t.snap.to_json()})


def take_over(cfg: Config, ipr: IPRoute, t: Takeover) -> None:
    """Replace ``t``'s root qdisc with the backend's tree (its previous tree is recorded: :func:`record`); the
    backend replaces whatever root is there."""
    t.backend.apply(ipr, t.link.index)


INCOMPLETE = "incomplete-"  # the records of restores that did not bring the whole tree back (not agent-*.json)


def incomplete_path(cfg: Config, device: str) -> Path:
    """Where the record of ``device``'s tree is kept after a restore that did not bring all of it back
    (``incomplete-eth0-20261128T053000Z.json``): no agent restores or overwrites it; the operator reads and
    removes it (docs/runbook.md#a-restore-that-was-not-complete). The name is reserved (made empty, O_EXCL): a
    second one of the same device within the same second gets ``-2``, ``-3``, ... (before, the stamp alone: the
    second record replaced the first). Raises OSError where none can be made.
    Usage: ``os.replace(state_path(cfg, "eth0"), incomplete_path(cfg, "eth0"))``"""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(1, 1000):
        path = Path(cfg.state_dir) / f"{INCOMPLETE}{device}-{stamp}{f'-{n}' if n > 1 else ''}.json"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            continue
        return path
    raise OSError(errno.EEXIST, f"{INCOMPLETE}{device}-{stamp}-*.json: 999 of them")


def restore_device(cfg: Config, ipr: IPRoute, name: str, snap: snapshot.Snapshot) -> list[str]:
    """Put device ``name``'s recorded tree ``snap`` back and clear its state file. Returns what did not come back
    ([]: all of it, or the device is gone with its tree). Raises OSError,
    the state file kept (the only record of the original), when the device is here without the recorded root (a
    refused or lost netlink request: the agent's root not deleted, or the original's not made again). A restore
    that brought the root back but not all of the tree (a filter or class refused, a u32 table back under another
    id) keeps the record as :func:`incomplete_path` and logs an error naming what is missing: before (until
    2026-11-28) it only warned, said "restored" and removed the record, the rest of the operator's tree lost."""
    warnings = snapshot.restore(snap, ipr)  # (returned: what did not come back; [] when whole or the device gone)
    root = _root_handle(ipr, snap.ifindex)  # None: the device is gone, and its tree with it
    want = 0 if snap.root_is_default else snap.root.handle
    if root is not None and root != want:
        raise OSError(f"{name}'s root is {fmt_handle(root) if root else 'the default'}, not the recorded "
                      f"{fmt_handle(want) if want else 'default'} ({'; '.join(warnings) or 'no error reported'})")
    if warnings and root is not None:
        kept = None
        try:
            kept = incomplete_path(cfg, name)
            os.replace(state_path(cfg, name), kept)
        except OSError as exc:
            if kept is not None:
                with contextlib.suppress(OSError):
                    kept.unlink()  # (the empty name it reserved)
            kept = f"nowhere ({exc})"
        log.error("restore %s incomplete: %s; the record of its original tree is kept as %s (no agent restores it "
                  "again: compare it with `tc filter show dev %s`, put back what is missing, then remove it)",
                  name, "; ".join(warnings), kept, snap.ifname)
        return warnings
    for w in warnings:  # (the device is gone: nothing to keep)
        log.warning("restore %s: %s", name, w)
    try:
        state_path(cfg, name).unlink(missing_ok=True)
    except OSError as exc:  # (state_dir read-only): the device is restored; the next agent finds our tree gone
        log.warning("restore %s: cannot remove its state file: %s", name, exc)
    return []


def warn_incomplete(cfg: Config) -> list[Path]:
    """Log, at start, each record kept by a restore that was not complete (:func:`incomplete_path`): the agent
    neither restores it again (the same refusal would come back, and the operator may have repaired the tree by
    hand since) nor removes it. Returns their paths.
    Usage: ``warn_incomplete(cfg)``"""
    paths = sorted(Path(cfg.state_dir).glob(f"{INCOMPLETE}*.json"))
    for path in paths:
        log.warning("%s records an operator's tree that a restore did not bring back whole (see the error logged "
                    "then); the agent leaves it alone: put back what is missing by hand, then remove it", path)
    return paths


def _serve(cfg: Config, api: Api, held: HeldDevices, table: FlowTable, notifier: Notifier, managing: str,
           stop: threading.Event, metrics: Metrics | None = None) -> None:
    """Serve the API socket and reconcile every ``reconcile_interval_s`` until ``stop`` is set (SIGTERM/SIGINT:
    :func:`_stop_on_signals`), first following the managed interfaces' devices (:class:`HeldDevices`); readiness is
    told once the socket listens, and each reconcile pass feeds the watchdog (and starts ``metrics`` where another
    user held its port until then)."""
    rec = held.rec
    gc.collect()
    gc.freeze()  # what start-up allocated (pyroute2, scapy, prometheus) is never scanned again: no long pauses
    server = Server(api, cfg.socket, cfg.socket_mode, cfg.socket_group)
    log.info("listening on %s", cfg.socket)
    if notifier.watchdog_s is not None and notifier.watchdog_s < 2 * cfg.reconcile_interval_s:
        log.warning("the watchdog period (%.1f s) is less than twice reconcile_interval_s (%.1f s): a healthy agent "
                    "may be restarted", notifier.watchdog_s, cfg.reconcile_interval_s)
    notifier.ready(f"managing {managing}")

    def periodic() -> None:
        try:
            problems = held.follow(rec.ipr)
        except Exception as exc:  # noqa: BLE001 - (a netlink error reading the links) the pass goes on
            problems = [f"reading the links: {exc}"]
        if metrics is not None and (problem := metrics.retry()):  # (another user's on the port: tried each pass)
            problems = [*problems, problem]
        if api.jobs.follow_link(rec.share_budget(), rec.link_bps()):  # the devices held changed: the parts follow
            rec.set_shares(api.jobs.shares)
        rec.reconcile(table, problems)
        if api.journal is not None:
            api.journal.touch()  # (alive: a killed agent's flows without an owner are taken back from a fresh file)
        notifier.watchdog()

    try:
        server.serve(stop, cfg.reconcile_interval_s, periodic)
    finally:
        notifier.stopping()
        server.close()


HANDOVER_SIGNAL = signal.SIGUSR2  # stop for a restart: leave everything for the next agent (:func:`_stop_on_signals`)


def _stop_on_signals() -> tuple[threading.Event, threading.Event]:
    """``(stop, handover)``: events that SIGTERM and SIGINT (stop) and SIGUSR2 (both) set from now on. Installed
    before the first device is taken over: a SIGTERM while the agent is still starting (taking over, installing the
    table, starting the metrics server) then stops it through the same restore as later (with the default action it
    died there, leaving every device taken over until another agent started). SIGUSR2 is the hand-over stop of a
    planned restart (``tensorlane-agentctl restart``): the agent exits leaving its trees, nftables table, flow marks
    and records in place, as a killed agent does, and the next agent adopts them (:func:`_hand_over`). SIGTERM
    after SIGUSR2 still restores. SIGHUP, which asks many daemons to reload, is logged and otherwise ignored
    (:func:`_no_reload`)."""
    stop, handover = threading.Event(), threading.Event()

    def restore(*_) -> None:
        handover.clear()  # (a SIGTERM wins over an earlier SIGUSR2: uninstall and `systemctl stop` rely on it)
        stop.set()

    def hand_over(*_) -> None:
        if not stop.is_set():  # (a SIGTERM already taken: the restore goes on)
            handover.set()
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, restore)
    signal.signal(HANDOVER_SIGNAL, hand_over)
    signal.signal(signal.SIGHUP, _no_reload)
    return stop, handover


def _hand_over(cfg: Config, touched: list[Takeover], held: HeldDevices, table: FlowTable,
               reported: dict | None) -> None:
    """The hand-over stop (SIGUSR2): log what stays and leave it all as a killed agent would, the devices' trees,
    the nftables table with its flow marks and every record (stranded ones too), so that the next agent adopts the
    trees and keeps the marks for INHERIT_S; and write the flow table down, which it takes back (agent/handover.py;
    docs/agent.md, item 6). The lock and the socket are released by the caller as on any exit."""
    kept = [t.link.name for t in touched] + [stranded_name(t.link.name, i) for i, t in held.stranded.items()]
    flows = write_flows(cfg, table, reported)
    log.warning("handing over: leaving %s taken over, the nftables table and its flow marks in place for the next "
                "agent, which adopts them, and %d flows in %s for it to take back (if none starts, the records in "
                "the state directory let any later agent restore them; `tensorlane-agentctl stop` or SIGTERM to "
                "that agent)", ", ".join(kept) or "nothing", flows, flows_path(cfg))
    for handler in logging.getLogger().handlers:
        handler.flush()


def _no_reload(*_) -> None:
    """SIGHUP: the agent has no reload. Its default action killed the agent without restoring anything (the
    devices stayed taken over), and systemd counts death by SIGHUP as a clean exit, so it did not restart it."""
    log.warning("SIGHUP: the agent does not reload its configuration and keeps running with the one it started "
                "with; restart it to apply a change (docs/deploy.md#what-running-jobs-see)")


def _root_handle(ipr: IPRoute, index: int) -> int | None:
    """The handle of the device's root qdisc (0: the kernel's default), or None when the device is gone. Raises
    NetlinkError where a dump fails (ENOBUFS, EBUSY) and the device is here: taken for gone, its record was
    dropped and the agent's tree left on it for good."""
    try:
        qdiscs = ipr.get_qdiscs(index=index)
    except NetlinkError:
        if _gone(ipr, index):
            return None
        raise
    if not qdiscs:  # gone, or here and down with the kernel's noop root, which the dump leaves out
        return None if _gone(ipr, index) else 0
    return next((q["handle"] for q in qdiscs if q["parent"] == snapshot.TC_H_ROOT), 0)


def _gone(ipr: IPRoute, index: int) -> bool:
    """Whether no device has ifindex ``index`` (the kernel answers ENODEV); another error is raised."""
    try:
        ipr.link("get", index=index)
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return True
        raise
    return False


def _link_name(ipr: IPRoute, index: int) -> str | None:
    """The name of the device with ifindex ``index``, or None when there is none (another error is raised)."""
    try:
        return ipr.link("get", index=index)[0].get_attr("IFLA_IFNAME")
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return None
        raise
    except IndexError:
        return None


def restore_orphans(cfg: Config, ipr: IPRoute, plan: list[Takeover]) -> list[str]:
    """Restore the devices a previous agent of ours left taken over (killed) that this agent will not hold: one
    this configuration no longer manages (removing an interface from the config never leaves it taken over), or
    one renamed away while no agent ran (another device has its name now). The device is found by its recorded
    index, whatever its name. A state file whose agent still runs (another agent sharing ``state_dir``) is left
    alone. Returns the devices restored (their recorded names)."""
    mine = {t.link.index: t.link.name for t in plan}
    restored = []
    for name, path, state, index in _records_not_running(cfg):
        if (fmt := _newer_format(state)) is not None:  # (a newer agent's: not ours to read; left as it is)
            log.error("state file %s is of record format %r, newer than this agent's (%d): its device is left as "
                      "that agent left it", path, fmt, RECORD_FORMAT)
            continue
        try:
            snap = snapshot.Snapshot.from_json(state["snapshot"])
        except (ValueError, KeyError, TypeError):
            continue  # not an agent's record: left as it is
        if index in mine:  # a device the plan holds (its record adopted): recorded again under its name, then this
            continue       # record goes (drop_superseded), not before: a failed write would have lost the only one
        try:
            root = _root_handle(ipr, index)
            # ours; or the default root a restore stopped half-way at, on the device recorded (its name: an index
            # can be another device's now, one moved in from another namespace keeps its index)
            if root == handle(MAJOR) or (root == 0 and _link_name(ipr, index) == state.get("interface")):
                log.warning("%s (index %d) was left taken over by an agent that is gone, and no configured interface "
                            "is it now (no longer configured, or renamed): restoring it", name, index)
                restore_device(cfg, ipr, name, snap)
                restored.append(name)
        except Exception as exc:  # noqa: BLE001 - its record stays, for the next agent (nothing else changed)
            log.error("restoring %s (index %d) failed: %s (its state file is kept)", name, index, exc)
            continue
        path.unlink(missing_ok=True)
    return restored


def drop_superseded(cfg: Config, t: Takeover) -> None:
    """Remove the records of ``t``'s device under other names (renamed while no agent ran, or a stranded one's:
    adopted with that record), once its own is written (:func:`record`). A running agent's are left alone."""
    for name, path, _state, index in _records_not_running(cfg):
        if name != t.link.name and index == t.link.index:
            path.unlink(missing_ok=True)


def _records_not_running(cfg: Config) -> list[tuple[str, Path, dict, int]]:
    """``(device, path, record, ifindex)`` of each state file whose agent is this one or gone, not another running
    agent's (one sharing ``state_dir``); a file without a pid or unreadable is left out (not ours to judge), and one
    that is not the agent's own (:func:`_read_record`) is left out with a warning."""
    out = []
    for name, path in _state_files(cfg):
        try:
            state = _read_record(path)
            pid, index = int(state["pid"]), int(state["ifindex"])
        except FileNotFoundError:  # (gone since it was listed)
            continue
        except OSError as exc:
            log.warning("state file %s is not read: %s; it is left as it is (inspect it and remove it)", path, exc)
            continue
        except (ValueError, KeyError, TypeError):
            continue
        started = state.get("started")
        # a record without ``started`` (written before 2026-11-28) counts as running where its pid is root's: until
        # 2026-11-28 any live pid did, and a user's process holding a dead agent's freed pid kept its device taken
        # over, a device dropped from the config shaped by the agent's tree, for as long as that process lived
        if not writer_runs(pid, started if isinstance(started, int) and not isinstance(started, bool) else None,
                           unstamped_root=True):
            out.append((name, path, state, index))
    return out


def _describe(egress: list[links.Egress]) -> str:
    """``eth0, bond0 (queues on eth2, eth3)``: the managed interfaces for the log."""
    return ", ".join(f"{eg.name} (absent)" if not eg.index else eg.name if [q.name for q in eg.queues] == [eg.name]
                     else f"{eg.name} (queues on {', '.join(q.name for q in eg.queues)})" for eg in egress)


def _rates(plan: list[Takeover]) -> str:
    """``, eth0 shaped to 200mbit``: each device's shaping rate for the log (nothing for the prio backend)."""
    shaped = [f"{t.link.name} shaped to {fmt_rate(t.backend.rate)}" for t in plan if getattr(t.backend, "rate", None)]
    return "".join(f", {s}" for s in shaped)


def run(cfg: Config) -> int:
    """Run the agent in the foreground until SIGTERM/SIGINT. Returns the process exit status.

    Every device is checked before any is changed; devices are taken over one by one, and every device touched
    is restored on the way out, whatever stopped the agent.
    """
    check_privileges()
    lock = [lock_state_dir(cfg)]  # (HeldDevices may take it afresh: keep_state_dir_lock)
    try:
        with lock_netns() or contextlib.nullcontext():
            return _run(cfg, lock)
    finally:
        unlock_state_dir(cfg, lock[0])


def _run(cfg: Config, lock: list[int] | None = None) -> int:
    with IPRoute() as ipr:
        kind, egress, plan = prepare(cfg, ipr)
        table = FlowTable(cfg.levels, cfg.max_flows)
        layout = plan[0].backend if plan else _backend(cfg, kind, 10**9)  # the class layout (no device yet: any rate)
        rec = Reconciler([t.device() for t in plan], cfg.dscp, {eg.name: eg.index for eg in egress}, ipr,
                         ack_level=0 if cfg.ack_priority else None, layout=layout,
                         reset_user_dscp=cfg.reset_user_dscp, kernel_tcp_dscp=cfg.kernel_tcp_dscp)
        restore_orphans(cfg, ipr, plan)
        warn_incomplete(cfg)
        held = HeldDevices(cfg, kind, [eg.name for eg in egress], rec, lock)
        touched = held.takeovers  # every device taken over, at start-up or later, is restored on the way out
        installed = False  # the nftables table made (or a killed agent's adopted): deleted on the way out
        api = None
        stop, handover = _stop_on_signals()
        try:
            for t in plan:
                try:
                    record(cfg, t)  # a failure here changed nothing on this device: not restored
                except OSError as exc:
                    raise StartupError(f"cannot write the state file of {t.link.name} in {cfg.state_dir}: {exc}; "
                                       "nothing was changed on it") from None
                drop_superseded(cfg, t)
                touched.append(t)
                take_over(cfg, ipr, t)
            installed = True
            rec.inherit(rec.install())  # a killed agent's marks stay while its jobs register again
            rec.reconcile(table)
            log.info("managing %s with the %s backend: %d levels, DSCP %s%s", _describe(egress), kind, cfg.levels,
                     list(cfg.dscp), _rates(plan))
            api = Api(cfg, table, rec, kind)
            if adopt_flows(cfg, api) is not None:  # a hand-over's flows, their owners checked as at a register:
                rec.end_inherit()  # the marks of those not taken back go at the first pass, not after INHERIT_S
            else:  # a killed agent's, as its file has them: the marks stay INHERIT_S (its last changes not in it)
                adopt_after_crash(cfg, api)
            api.journal = FlowJournal(cfg, table, lambda: api.jobs.reported)
            metrics = Metrics(cfg, api)
            _serve(cfg, api, held, table, Notifier(), _describe(egress), stop, metrics)
        finally:
            if handover.is_set():  # (SIGUSR2: a planned restart; the next agent adopts everything)
                if api is not None and api.journal is not None:
                    api.journal.flush()  # (the next agent's fallback, should the hand-over's file fail)
                _hand_over(cfg, touched, held, table, api.jobs.reported if api is not None else None)
            else:
                if api is not None and api.journal is not None:
                    api.journal.remove()  # (the flows' marks go with the table: no agent takes them back)
                if installed or touched:  # else nothing was changed: a killed agent's table (its flows' marks) stays
                    rec.teardown()  # (touched: devices held now; a device that left since is no longer in it)
                restored = []
                for t in reversed(list(touched)):
                    try:  # one device that cannot be restored does not keep the others taken over
                        missed = restore_device(cfg, ipr, t.link.name, t.snap)
                        restored.append(f"{t.link.name} (not complete: see the error above)" if missed else t.link.name)
                    except Exception as exc:  # noqa: BLE001
                        log.error("restoring %s failed: %s (its state file, if kept, lets the next agent finish)",
                                  t.link.name, exc)
                held.restore_stranded(ipr)
                log.info("restored %s", ", ".join(restored) or "nothing")
    return 0
