"""Who is on the other end of the agent's socket, and what they may do.

The kernel tells the peer's pid, uid and gid (SO_PEERCRED) and its groups (SO_PEERGROUPS), as they were at
connect(); a pidfd of the peer (SO_PEERPIDFD) tells whether the pid still names that process while its /proc
entries are read (``Peer.pinned``): a peer that exited, its pid taken by another process, is never judged by that
other process's sockets or namespace. Access is granted to root, to ``allowed_users`` and
to members of ``allowed_groups``; ``level_limits`` caps the most urgent level a user or group may use ("@group"
keys name groups, "*" everyone); ``trusted_users`` may register flows of sockets they do not own (an operator's
tool). Usage: ``peer = credentials(conn); policy.check_access(peer)``
"""
from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import signal
import socket
import struct
import time
from dataclasses import dataclass, field

from tensorlane.agent.protocol import ProtocolError

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5


NAME_TTL_S = 10.0  # a uid's name is looked up again after this long (users renamed or added meanwhile)
_names: dict[int, tuple[str, float]] = {}  # uid -> (name, when looked up)


def user_name(uid: int) -> str:
    """The name of ``uid`` (its number when it has none), remembered for ``NAME_TTL_S``: every connection asks it
    (access, limits, log lines), and the passwd lookup was a quarter of the agent's work while one user connected
    and closed in a loop, refused ``user_limit`` 25,000 times a second."""
    return _remembered(_names, uid, _look_up_name)


def _look_up_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _remembered(cache: dict, uid: int, look_up):
    """``look_up(uid)``, remembered in ``cache`` for ``NAME_TTL_S`` (bounded: cleared at 4096 uids, which are many
    only on odd hosts)."""
    now = time.monotonic()
    hit = cache.get(uid)
    if hit is not None and now - hit[1] < NAME_TTL_S:
        return hit[0]
    value = look_up(uid)
    if len(cache) >= 4096:
        cache.clear()
    cache[uid] = (value, now)
    return value


_account_groups: dict[int, tuple[frozenset[str], float]] = {}  # uid -> (its groups' names, when looked up)


def account_groups(uid: int) -> frozenset[str]:
    """The names of the groups user ``uid`` is in by the account database (its passwd entry's group and the group
    file's members; none for a uid without an entry), remembered for ``NAME_TTL_S`` as ``user_name``'s."""
    return _remembered(_account_groups, uid, _look_up_groups)


def _look_up_groups(uid: int) -> frozenset[str]:
    try:
        entry = pwd.getpwuid(uid)
        gids = os.getgrouplist(entry.pw_name, entry.pw_gid)
    except (KeyError, OSError):
        gids = []
    return frozenset(group_names(gids))


def group_names(gids) -> set[str]:
    """The names of the groups ``gids`` (a group without an entry: its number)."""
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            names.add(str(g))
    return names


def ordinary_uid(uid: int | None, trusted: frozenset[str] | tuple[str, ...]) -> bool:
    """Whether ``uid`` is an ordinary user, capped per user (its jobs' parts of ``job_share``, its metric series):
    neither root, nor the agent itself (None), nor one of ``trusted`` (``trusted_users``)."""
    return uid not in (None, 0) and user_name(uid) not in trusted


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    gids: tuple[int, ...] | None = None  # supplementary groups at connect() (None: unknown, read from /proc)
    sock: socket.socket | None = field(default=None, compare=False, repr=False)  # the connection, for its pidfd
    pidfd: int | None = field(default=None, compare=False, repr=False)  # or a pidfd of the process (no connection)

    @property
    def user(self) -> str:
        return user_name(self.uid)

    def groups(self) -> set[str]:
        """Names of the peer's groups: primary and supplementary, as the kernel recorded them at connect() (from
        /proc where it cannot tell, while the process is alive)."""
        gids = {self.gid, *(self.gids or ())}
        if self.gids is None:  # (more than 256 groups, or no SO_PEERGROUPS): read while the peer is pinned
            try:
                with self.pinned():
                    gids.update(int(g) for g in proc_status(self.pid).get("Groups", "").split())
            except OSError:  # (ProcessLookupError too) gone: its primary group only
                gids = {self.gid}
        return group_names(gids)

    @contextlib.contextmanager
    def pinned(self):
        """Read the peer's /proc entries (its namespace, its sockets) inside this block: it raises
        ProcessLookupError when the process that connected has exited by the end of it (its pid may name another
        process since). Through a pidfd of the peer (SO_PEERPIDFD, or ``pidfd``: a flow's owner taken back after a
        hand-over, agent/handover.py); a kernel without it: the pid alone."""
        fd = None
        if self.sock is None and self.pidfd is not None:
            fd = os.dup(self.pidfd)
        elif self.sock is not None:
            try:
                fd = self.sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            except OSError as exc:  # ESRCH, or EINVAL (kernels 6.5-6.15): the peer has exited
                if exc.errno in (errno.ESRCH, errno.EINVAL):
                    raise ProcessLookupError(self.pid) from None
        try:
            yield
            if fd is not None:
                with contextlib.suppress(PermissionError):  # (an agent that is not root): it is alive
                    signal.pidfd_send_signal(fd, 0)
        finally:
            if fd is not None:
                os.close(fd)


def proc_status(pid: int | str) -> dict[str, str]:
    """The fields of ``/proc/PID/status`` ("self": this process) by name, each its text after the colon: a reader
    for every caller of the file. Raises OSError (ProcessLookupError too) where the process is gone.
    Usage: ``proc_status(pid)["Uid"].split()[1]`` (its effective uid)"""
    with open(f"/proc/{pid}/status") as fh:
        return {name: text.strip() for name, colon, text in (line.partition(":") for line in fh) if colon}


def process_start(pid: int) -> int | None:
    """Process ``pid``'s start time (``/proc/PID/stat``'s 22nd field, clock ticks after boot), None when it does not
    run: with its pid, it names one process for the machine's uptime (a pid alone is given again once freed).
    Usage: ``process_start(os.getpid()) > 0``"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat_line = fh.read()
        return int(stat_line.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def peer_groups(conn: socket.socket) -> tuple[int, ...] | None:
    """The peer's supplementary groups at connect() (SO_PEERGROUPS), or None where the kernel cannot tell or they
    are more than 256 (Python's getsockopt takes at most 1024 bytes: ``Peer.groups`` then reads /proc, pinned)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError:  # (ERANGE: more than 256)
        return None
    return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])


SUBUID = "/etc/subuid"  # USER:FIRST:COUNT: the uids a user may run processes as (newuidmap: rootless containers)
_subuids: tuple = (None, [])  # (SUBUID's stat when read, its ranges)


def subuid_ranges(path: str) -> list[tuple[int, int, int]]:
    """``(first, end, owner uid)`` of each subordinate uid range in ``path`` (USER a name or a uid; lines that name
    no user are skipped); [] where it cannot be read."""
    try:
        with open(path) as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        name, first, count = ([*line.strip().split(":"), "", ""])[:3]
        try:
            owner = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
            out.append((int(first), int(first) + int(count), owner))
        except (KeyError, ValueError):
            continue
    return out


def account_uid(uid: int) -> int:
    """``uid``, or the user whose subordinate range (``SUBUID``) holds it where ``uid`` is no user of its own (no
    passwd entry; never root or the agent's user, nor a uid of their ranges): a user runs processes as any uid of
    its range (``newuidmap``, and ``newgidmap`` keeps its own group, so an ``allowed_groups`` member stays allowed),
    and each of those 65,536 uids had a user's limits of its own (connections, requests, flows, jobs): one user
    multiplied them all."""
    global _subuids
    if uid in (0, os.geteuid()) or user_name(uid) != str(uid):
        return uid
    try:
        st = os.stat(SUBUID)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    if stamp != _subuids[0]:
        _subuids = (stamp, subuid_ranges(SUBUID) if stamp else [])
    owner = next((owner for first, end, owner in _subuids[1] if first <= uid < end), uid)
    # (never root or the agent's user: their ranges are the uids of containers they start, whose processes are not
    # theirs to trust; root's is common, "root:1000000:1000000000" with LXD, and such a process was given root's
    # rights here: any flow, any level, no ownership check)
    return uid if owner in (0, os.geteuid()) else owner


def credentials(conn: socket.socket) -> Peer:
    """The connecting process's pid, uid, gid and groups as the kernel recorded them at connect(); a uid of a user's
    subordinate range is that user's (:func:`account_uid`)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, account_uid(uid), gid, gids=peer_groups(conn), sock=conn)


@dataclass(frozen=True)
class AccessPolicy:
    """The access rules of the config (see docs/agent.md, "Security")."""

    allowed_users: frozenset[str] = frozenset()
    allowed_groups: frozenset[str] = frozenset()
    level_limits: dict = field(default_factory=dict)  # "user" | "@group" | "*" -> most urgent level allowed
    trusted_users: frozenset[str] = frozenset()
    check_ownership: bool = True

    def allowed(self, peer: Peer) -> bool:
        if peer.uid == 0 or peer.uid == os.geteuid():
            return True
        return peer.user in self.allowed_users or bool(peer.groups() & self.allowed_groups)

    def most_urgent_level(self, peer: Peer) -> int:
        """The smallest level number ``peer`` may register at (0 for root unless limited by name). A group's key
        holds for the user's groups in the account database as well as for the process's (``account_groups``): a
        process may leave its groups (``newgidmap`` and ``setgroups`` in a user namespace of its own), and a member
        of a limited group then matched no key (until 2026-11-29), the ``"*"`` limit or none holding for it."""
        groups = peer.groups()
        if any(k.startswith("@") for k in self.level_limits):
            groups |= account_groups(peer.uid)
        limits = [self.level_limits[k] for k in (peer.user, *(f"@{g}" for g in groups))
                  if k in self.level_limits]
        if limits:
            return min(limits)
        return 0 if peer.uid == 0 else self.level_limits.get("*", 0)

    def check_level(self, peer: Peer, level: int) -> None:
        floor = self.most_urgent_level(peer)
        if level < floor:
            raise ProtocolError("forbidden", f"user {peer.user} may register at level {floor} or less urgent, "
                                             f"not {level}")

    def privileged(self, peer: Peer) -> bool:
        """Root or one of ``trusted_users``: no per-user limits or job ownership, and every user's flows listed."""
        return peer.uid == 0 or peer.user in self.trusted_users

    def must_own(self, peer: Peer) -> bool:
        return self.check_ownership and peer.user not in self.trusted_users
