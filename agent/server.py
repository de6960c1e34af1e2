"""The agent's Unix-socket server: one thread, non-blocking sockets, a selector.

One request is handled at a time, so the FlowTable and the kernel are only changed from this thread (pyroute2's
synchronous API cannot run inside an asyncio loop, hence no asyncio). What a hostile or broken client can do is
bounded: the kernel names every peer (SO_PEERCRED) and only allowed users get an answer; each connection has a
request rate limit, a line-length limit and a cap on unanswered output.

No user locks the others out (docs/agent.md, "Fairness"): each unprivileged uid has a connection cap
(``max_connections_per_user``) and a request rate shared by all its connections (``requests_per_user_per_s``, a
token bucket: a uid whose bucket is empty is not served, and its connections not read, until it refills, so its
excess costs the agent nothing); of the ``max_connections`` in total, ``reserved_connections`` are kept for root,
the agent's own user and ``trusted_users``; a connection without a request for ``idle_timeout_s`` is closed (the
connections are kept in order of their last request, so the check costs one look at the oldest). Complete request
lines are queued per uid and served round-robin across uids, one request per uid per round, with a look at the
sockets at least every ``WORK_SLICE_S`` of work: a user pipelining many requests delays another user's request by
at most one of its own. Refusals are counted (``api.record``: op ``connect``, ``request`` or ``connection``, the
reason as outcome) and logged at most once per reason per ``LOG_EVERY_S``, with the number left out since the
last line.

Processes that registered flows of their own sockets are watched with a pidfd (at most ``MAX_WATCHED``): when one
exits its flows go at once, and a sweep every ``SWEEP_S`` removes flows whose sockets were closed (or whose
unwatched owner exited). With ``job_policy = "rotate"`` (or
``"alternate"``) the loop also wakes at each epoch boundary of the wall clock and moves the flows whose effective
level the new job order changes, in one nftables transaction (agent/jobs.py).
Usage: ``Server(api, "/run/tensorlane/agent.sock", 0o660).serve(stop, 5.0, periodic)``
"""
from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import resource
import selectors
import socket
import stat
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tensorlane.agent import protocol
from tensorlane.agent.api import Api
from tensorlane.agent.config import others_may_write
from tensorlane.agent.logs import RefusalLog  # noqa: F401  (re-exported: agent.server.RefusalLog)
from tensorlane.agent.metrics.connections import REFUSALS  # what the server refuses, as the metrics count it
from tensorlane.agent.peers import Peer, credentials
from tensorlane.agent.ratelimit import TokenBucket

log = logging.getLogger("tensorlane.server")
SWEEP_S = 0.5
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


@dataclass
class _User:
    """An unprivileged uid: its open connections and its request bucket (kept a while after its last
    connection closes, so that reconnecting does not refill it)."""

    bucket: TokenBucket
    conns: int = 0


@dataclass(eq=False)
class _Conn:
    """One client connection: its peer, its request bucket and idle clock, its buffers and selector state."""

    sock: socket.socket
    peer: Peer
    bucket: TokenBucket
    user: _User | None  # None: root, the agent's user or a trusted user (no per-user limits, may use the reserve)
    last: float = field(default_factory=time.monotonic)  # last request (or the connect): the idle clock
    inbuf: bytes = b""
    outbuf: bytes = b""
    events: int = 0       # what the selector watches now (0: not registered)
    queued: bool = False  # has complete request lines waiting in Server.ready (not read further meanwhile)
    paused: bool = False  # a piece of a line read with its uid's bucket empty: not read until it has a token again
    closed: bool = False


def raise_fd_limit(need: int) -> int:
    """Raise this process's open-file limit to ``need`` if it is lower (the hard limit too, as root); returns the
    soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    for limits in ((need, max(need, hard) if hard != resource.RLIM_INFINITY else hard),
                   (min(need, hard), hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return limits[0]
        except (ValueError, OSError):
            continue
    return soft


def socket_dir_problem(directory: str) -> str:
    """Why another user could replace the agent's socket in ``directory`` ("" when none can: ``others_may_write``):
    such a user could unlink the agent's socket and bind a listener of its own there at any time, and every shim
    would register with it, their flows unmarked (a socket in a world-writable place such as ``/tmp/tensorlane``, made
    first by a local user). Before, the agent bound its socket there."""
    return others_may_write(directory)


class Server:
    """Serves ``api`` on a Unix socket until told to stop."""

    MAX_PENDING_OUTPUT = 1 << 20
    WORK_SLICE_S = 0.002  # at most this much request handling between two looks at the sockets
    ACCEPT_BATCH = 64     # connections accepted per wake-up
    IDLE_BATCH = 256      # idle connections closed per pass (more: the next pass, at once)
    MAX_WATCHED = 512     # owner processes watched with a pidfd (the others' flows go at the next sweep)
    # A request of an unprivileged user takes one token of its bucket, and one more per BYTES_PER_TOKEN of its line:
    # the agent's work grows with the flows a request names (a register of 600 UDP flows of one socket, unchanged,
    # took 31 ms), and one user re-sending it at its 200 requests a second kept root's `status` waiting (p50 2.4 ->
    # 23 ms, p99 12 -> 114 ms). A hello is one token; a 64 KiB register, 64.
    BYTES_PER_TOKEN = 1024
    # ... and one more per WORK_PER_TOKEN_S of the agent's time spent answering it: a user's `status` (the kernel's
    # class counters read, 6.4 ms here) at its 200 requests a second kept the agent's loop busy, and root's `hello`
    # waited 10 ms at p50 (0.27 ms without), 87 ms at p99. Now one user has at most about a tenth of the loop. The
    # time is the agent thread's CPU time (time.thread_time: the kernel's work in its syscalls included), not the
    # wall clock: on a loaded host (3 busy processes on 2 cores) a 6.4 ms status took 27 ms of wall time at p50, and
    # charged so (until 2026-11-28) the 8 ranks of a job attaching at once were held past the shim's 0.5 s timeout.
    WORK_PER_TOKEN_S = 0.0005
    LOG_EVERY_S = 10.0

    def __init__(self, api: Api, path: str, mode: int, group: str | None = None):
        """Bind the socket at ``path`` (``mode``, ``group``) with the limits of ``api.cfg``; raises the open-file
        limit to fit them."""
        cfg = api.cfg
        self.api = api
        self.path = path
        self.rate = cfg.rate_limit_per_s
        self.user_rate = cfg.requests_per_user_per_s
        self.max_conns = cfg.max_connections
        self.reserved = cfg.reserved_connections
        self.per_user = cfg.max_connections_per_user
        self.idle_s = cfg.idle_timeout_s
        self.trusted = frozenset(cfg.trusted_users)
        self.euid = os.geteuid()
        fds = raise_fd_limit(self.max_conns + 1024)  # pidfds, netlink and metrics sockets besides the clients
        if fds != resource.RLIM_INFINITY and fds < self.max_conns + 64:
            log.warning("open-file limit %d is below max_connections = %d: connections beyond it wait in the "
                        "listen backlog", fds, self.max_conns)
        self._mode, self._gid = mode, None if group is None else grp.getgrnam(group).gr_gid
        self._path_problem = ""  # what _check_path last found wrong with the socket file ("" when it is ours)
        self.sel = selectors.DefaultSelector()
        self._listen()
        self.listen_again: float | None = None  # out of file descriptors: accept again at this time
        self.conns: OrderedDict[socket.socket, _Conn] = OrderedDict()  # least recently active first
        self.users: dict[int, _User] = {}  # unprivileged uids with connections (or a bucket still refilling)
        self.ready: OrderedDict[int, deque[_Conn]] = OrderedDict()  # uid -> connections with a request waiting
        self.held: dict[int, deque[_Conn]] = {}  # the same, of uids whose request bucket is empty ...
        self.held_until: dict[int, float] = {}   # ... until it has a token again
        self.paused: dict[int, tuple[float, list[_Conn]]] = {}  # uid -> (until, its connections not read meanwhile)
        self.privileged_open = 0
        self.refusals = api.refusal_log  # one bounded log for the server's and the API's refusals
        self.watched: dict[int, int] = {}  # pid -> pidfd
        api.server = self  # read by the metrics (agent/metrics/connections.py), from their threads

    def _listen(self) -> None:
        """Bind a listener at ``self.path`` (its directory made where missing, refused where another user could
        replace the socket: :func:`socket_dir_problem`) and watch it for connections."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if problem := socket_dir_problem(os.path.dirname(self.path)):
            raise OSError(errno.EPERM, f"another user could replace the socket: {problem}")
        sock = self._bind(self.path, self._mode, self._gid)
        self._inode = os.lstat(self.path).st_ino  # what close() removes: this socket, not a file put there since
        sock.listen(socket.SOMAXCONN)  # (a full backlog refuses connect() with EAGAIN, root's too)
        sock.setblocking(False)
        self.listener = sock
        self.sel.register(sock, READ, ("listen", None))

    def _check_path(self) -> None:
        """Bind the socket again where its file was removed (``rm -rf /run/tensorlane``, a tmpfiles clean-up):
        the listener went on accepting on a path no client could reach, and nothing said so (every shim refused
        "no agent", the agent healthy). A file of someone else's put there is left alone and reported."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            problem = self._bind_again()
        except OSError as exc:
            problem = f"cannot look at the socket file {self.path}: {exc}"
        else:
            problem = "" if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode else (
                f"{self.path} was replaced by a file that is not the agent's socket: left as it is, clients cannot "
                "reach the agent; remove it and the agent binds its socket again")
        if problem:
            stats = self.api.rec.stats
            stats.errors += 1
            stats.last_error = problem
            if problem != self._path_problem:
                log.error("%s", problem)
        elif self._path_problem:
            log.warning("the socket file %s is the agent's again", self.path)
        self._path_problem = problem

    def _bind_again(self) -> str:
        """A new listener at the removed socket file's path; what went wrong ("" when it listens)."""
        old = self.listener
        try:
            self._listen()
        except OSError as exc:
            return f"the socket file {self.path} was removed and cannot be made again: {exc}"
        if self.listen_again is None:  # (else not watched: out of file descriptors a moment ago)
            self.sel.unregister(old)
        self.listen_again = None
        old.close()
        self.api.rec.stats.repairs += 1
        log.warning("the socket file %s was removed: bound it again (clients reach the agent again)", self.path)
        return ""

    @staticmethod
    def _bind(path: str, mode: int, gid: int | None) -> socket.socket:
        """A Unix socket bound at ``path``, made with ``mode`` (and group ``gid``) by the bind itself: a stale
        socket there is replaced; anything else is refused, not deleted. Before, a ``chmod`` and ``chown`` of the
        path after the bind followed a symbolic link put there meanwhile (a socket directory others may write to):
        root changed the mode of a file of the link's choosing; and any file at the path was deleted."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise OSError(errno.EEXIST, f"{path} exists and is not a socket: not removed; remove it or choose "
                                            "another socket path")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~mode)  # (the agent's one thread here: the metrics threads create no files)
        try:
            sock.bind(path)
            if gid is not None:
                os.chown(path, -1, gid, follow_symlinks=False)  # (a link put there since: the link's, not its target's)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        return sock

    def serve(self, stop: threading.Event, every_s: float, periodic) -> None:
        """Serve until ``stop`` is set, calling ``periodic()`` every ``every_s`` seconds."""
        next_tick = time.monotonic() + every_s
        next_sweep = time.monotonic() + SWEEP_S
        next_sample = time.monotonic()
        jobs = self.api.jobs
        while not stop.is_set():
            now = time.monotonic()
            if self.ready:
                timeout = 0.0
            else:
                to_epoch = jobs.seconds_to_next_epoch()
                timeout = min(0.2, next_tick - now, next_sweep - now, 1.0 if to_epoch is None else to_epoch + 0.001)
                if self.conns:
                    timeout = min(timeout, next(iter(self.conns.values())).last + self.idle_s - now)
                if self.listen_again is not None:
                    timeout = min(timeout, self.listen_again - now)
                if self.held_until:
                    timeout = min(timeout, min(self.held_until.values()) - now)
                if self.paused:
                    timeout = min(timeout, min(until for until, _ in self.paused.values()) - now)
                if self.api.reorder_at is not None:
                    timeout = min(timeout, self.api.reorder_at - now)
                if jobs.samples_wanted() or jobs.rerank_wanted():
                    timeout = min(timeout, next_sample - now)
                if self.api.journal is not None and (due := self.api.journal.due_in(now)) is not None:
                    timeout = min(timeout, due)  # (the flow table's file for a crash: debounced, paced)
            for key, events in self.sel.select(max(0.0, timeout)):
                kind, data = key.data
                if kind == "listen":
                    self._accept()
                elif kind == "pid":
                    self._owner_exited(data)
                else:
                    self._io(data, events)
            if self.held_until:
                self._release_held(time.monotonic())
            if self.paused:
                self._resume_paused(time.monotonic())
            self._work()
            if self.api.journal is not None:
                self._guarded("writing the flow table", self.api.journal.tick)
            if jobs.epoch_due():  # a new rotation epoch: a new job order
                self._guarded("reordering the jobs", self.api.reorder)
            if self.api.reorder_at is not None and time.monotonic() >= self.api.reorder_at:  # a report's, held back
                self._guarded("reordering the jobs", self.api.reorder)
            now = time.monotonic()
            if now >= next_sample:
                if jobs.rerank_wanted():  # an order that moves with the clock (slowdown)
                    self._guarded("reordering the jobs", self.api.reorder)
                if jobs.samples_wanted():  # which jobs are sending (their parts), whether they saturate the link
                    self._guarded("sampling the jobs", self.api.sample_sending, now)
                next_sample = now + jobs.sample_s
            self._close_idle(now)
            if self.listen_again is not None and now >= self.listen_again:
                self.listen_again = None
                self.sel.register(self.listener, READ, ("listen", None))
            if now >= next_sweep:
                self._guarded("removing the flows of closed sockets", self.api.sweep)
                self._guarded("checking the socket file", self._check_path)
                self._watch_owners()
                self._forget_users(now)
                self.refusals.flush()
                next_sweep = now + SWEEP_S
            if now >= next_tick:
                periodic()
                next_tick = time.monotonic() + every_s

    # -- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        """Accept up to ACCEPT_BATCH waiting connections; at the open-file limit, stop listening for 0.1 s."""
        for _ in range(self.ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Nothing to refuse with: stop accepting for a moment rather than spin on a readable listener.
                    self.sel.unregister(self.listener)
                    self.listen_again = time.monotonic() + 0.1
                    self.refusals.note("fd_limit", logging.WARNING, "cannot accept connections: %s", exc)
                return
            self._admit(sock)

    def may_use_reserve(self, peer: Peer) -> bool:
        """Root, the agent's own user and ``trusted_users``: no per-user limits, and the reserved connections."""
        return peer.uid in (0, self.euid) or (bool(self.trusted) and peer.user in self.trusted)

    def _admit(self, sock: socket.socket) -> None:
        """Admit a new connection, or refuse it (busy, forbidden, user_limit) with an error line."""
        try:
            peer = credentials(sock)
        except OSError:
            sock.close()
            return
        privileged = self.may_use_reserve(peer)
        total = len(self.conns)
        if total >= self.max_conns or (not privileged and total >= self.max_conns - self.reserved):
            return self._refuse(sock, peer, "busy", f"the agent has {total} connections (max_connections = "
                                f"{self.max_conns}, of which {self.reserved} are kept for root and trusted users)")
        if not self.api.policy.allowed(peer):
            return self._refuse(sock, peer, "forbidden", f"user {peer.user} is not allowed to use this agent (its "
                                "config's allowed_users and allowed_groups name who may, root aside)")
        user = None
        if not privileged:
            user = self.users.get(peer.uid)
            if user is None:
                user = self.users[peer.uid] = _User(TokenBucket(self.user_rate))
            if user.conns >= self.per_user:
                return self._refuse(sock, peer, "user_limit", f"user {peer.user} already has {user.conns} "
                                    f"connections to the agent (max_connections_per_user = {self.per_user}); "
                                    "close some")
            user.conns += 1
        else:
            self.privileged_open += 1
        sock.setblocking(False)
        conn = _Conn(sock, peer, TokenBucket(self.rate), user)
        self.conns[sock] = conn
        self._watch(conn)

    def _refuse(self, sock: socket.socket, peer: Peer, code: str, message: str) -> None:
        """Count and log the refusal, send its error line if the socket takes it, close."""
        self._count(code, logging.WARNING, "refused connection from pid %d uid %d: %s: %s", peer.pid, peer.uid, code,
                    message)
        try:
            sock.setblocking(False)
            sock.send(protocol.error(None, code, message))
        except OSError:
            pass
        sock.close()

    def _count(self, reason: str, level: int, msg: str, *args) -> None:
        """Record a refusal for the metrics (``REFUSALS``) and note it in the rate-limited log."""
        self.api.record(REFUSALS[reason], reason)
        self.refusals.note(reason, level, msg, *args)

    def _close(self, conn: _Conn) -> None:
        """Close ``conn`` once: unregister it and give its slot back."""
        if conn.closed:
            return
        conn.closed = True
        if conn.events:
            self.sel.unregister(conn.sock)
        self.conns.pop(conn.sock, None)
        if conn.user is not None:
            conn.user.conns -= 1
        else:
            self.privileged_open -= 1
        conn.sock.close()

    def _close_idle(self, now: float) -> None:
        """Close the connections without a request for ``idle_timeout_s``: the oldest first, at most
        ``IDLE_BATCH`` per pass (the loop comes back at once while more are due)."""
        cutoff = now - self.idle_s
        for _ in range(self.IDLE_BATCH):
            if not self.conns:
                return
            conn = next(iter(self.conns.values()))
            if conn.last > cutoff:
                return
            self._count("idle_closed", logging.INFO, "closed idle connection of pid %d uid %d after %.1f s",
                        conn.peer.pid, conn.peer.uid, now - conn.last)
            if not conn.outbuf:  # tell a client that reads why; one that does not read just sees the close
                with contextlib.suppress(OSError):
                    conn.sock.send(protocol.error(None, "idle_timeout", f"no request for {self.idle_s:g} s "
                                                  "(idle_timeout_s): connection closed"))
            self._close(conn)

    def _forget_users(self, now: float) -> None:
        """Drop uids without connections whose request bucket has refilled (a new one would be the same)."""
        for uid, user in list(self.users.items()):
            if user.conns == 0 and user.bucket.full(now):
                del self.users[uid]

    def _watch(self, conn: _Conn) -> None:
        """Watch for what ``conn`` needs: more input unless it has requests waiting, output while it has any."""
        want = (0 if conn.queued or conn.paused else READ) | (WRITE if conn.outbuf else 0)
        if want == conn.events or conn.closed:
            return
        if not conn.events:
            self.sel.register(conn.sock, want, ("conn", conn))
        elif not want:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, want, ("conn", conn))
        conn.events = want

    def _io(self, conn: _Conn, events: int) -> None:
        """Write what is pending, read what arrived; queue complete request lines."""
        if events & WRITE:
            self._flush(conn)
        if events & READ and not conn.closed and not conn.queued:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                return self._close(conn)
            if data == b"":
                return self._close(conn)
            if data:
                conn.inbuf += data
                if b"\n" in data:
                    self._touch(conn)
                    self._queue(conn)
                elif len(conn.inbuf) > protocol.MAX_MESSAGE_BYTES:
                    return self._too_large(conn)
                elif conn.user is not None:
                    self._charge_piece(conn)
        self._watch(conn)

    def _charge_piece(self, conn: _Conn) -> None:
        """A read of ``conn`` (an unprivileged user's) ended no request line: it takes a token of its uid's bucket,
        as a request does (the bucket may go below zero), and while the bucket has less than one the connection is
        not read. Before, such pieces cost the user nothing: one user sending a byte at a time on its 64
        connections, reconnecting after each 64 KiB (``too_large``), had the agent read it without bound, past
        ``requests_per_user_per_s`` (the agent's loop 3 to 5 times as busy as under a flood of whole requests held
        back; root's ``hello`` p50 0.4 -> 1.4-2.6 ms here)."""
        bucket, now = conn.user.bucket, time.monotonic()
        if bucket.charge(1, now) >= 1:
            return
        conn.paused = True
        uid = conn.peer.uid
        until = now + bucket.wait_s()
        before, conns = self.paused.get(uid, (until, []))
        conns.append(conn)
        self.paused[uid] = (max(before, until), conns)
        self._count("user_rate_limited", logging.WARNING, "held back the connections of uid %d (%s): more than %g "
                    "reads of requests or pieces of requests per second (requests_per_user_per_s)", uid,
                    conn.peer.user, self.user_rate)

    def _resume_paused(self, now: float) -> None:
        """Read again the connections paused (``_charge_piece``) of the uids whose bucket has a token by now."""
        for uid, (until, conns) in list(self.paused.items()):
            if now >= until:
                del self.paused[uid]
                for conn in conns:
                    conn.paused = False
                    self._watch(conn)

    def _queue(self, conn: _Conn) -> None:
        """Put ``conn`` in its uid's queue of connections with requests (held if the uid is held)."""
        conn.queued = True
        uid = conn.peer.uid
        if uid in self.held:
            self.held[uid].append(conn)
        else:
            self.ready.setdefault(uid, deque()).append(conn)

    def _release_held(self, now: float) -> None:
        """Move the uids whose bucket has a token again back to the ready queues."""
        for uid, until in list(self.held_until.items()):
            if now >= until:
                del self.held_until[uid]
                self.ready[uid] = self.held.pop(uid)

    def _touch(self, conn: _Conn) -> None:
        """Restart ``conn``'s idle clock (the connections are kept oldest-first)."""
        conn.last = time.monotonic()
        self.conns.move_to_end(conn.sock)

    def _too_large(self, conn: _Conn) -> None:
        """A request line over MAX_MESSAGE_BYTES: count it, answer ``too_large`` and close."""
        self._count("too_large", logging.WARNING, "closed connection of pid %d uid %d: a message over %d bytes",
                    conn.peer.pid, conn.peer.uid, protocol.MAX_MESSAGE_BYTES)
        conn.outbuf += protocol.error(None, "too_large", f"message exceeds {protocol.MAX_MESSAGE_BYTES} bytes")
        conn.inbuf = b""
        self._flush(conn)
        self._close(conn)

    def _work(self) -> None:
        """Answer waiting requests: one per uid per round, round after round, for at most ``WORK_SLICE_S``."""
        deadline = time.monotonic() + self.WORK_SLICE_S
        while self.ready:
            for uid in list(self.ready):
                queue = self.ready[uid]
                conn = queue[0]
                if not conn.closed and conn.user is not None and not conn.user.bucket.take():
                    self._hold(uid, conn)
                    continue
                queue.popleft()
                if not queue:
                    del self.ready[uid]
                if conn.closed:
                    continue
                self._answer_one(conn)
                if conn.closed:
                    continue
                if b"\n" in conn.inbuf:
                    self._queue(conn)
                    continue
                conn.queued = False
                if len(conn.inbuf) > protocol.MAX_MESSAGE_BYTES:
                    self._too_large(conn)
                else:
                    self._watch(conn)
            if time.monotonic() >= deadline:
                return

    def _hold(self, uid: int, conn: _Conn) -> None:
        """The uid's bucket is empty: its waiting requests (and connections: not read meanwhile) wait until it has a
        token again. The request is counted, not refused: a client over its rate only waits."""
        self.held[uid] = self.ready.pop(uid)
        self.held_until[uid] = time.monotonic() + conn.user.bucket.wait_s()
        self._count("user_rate_limited", logging.WARNING, "held back requests of uid %d (%s): more than %g "
                    "requests per second from its connections (requests_per_user_per_s)", conn.peer.uid,
                    conn.peer.user, self.user_rate)

    def _answer_one(self, conn: _Conn) -> None:
        """Answer ``conn``'s first request line, or refuse it when the connection is over ``rate_limit_per_s``."""
        line, conn.inbuf = conn.inbuf.split(b"\n", 1)
        if len(line) > protocol.MAX_MESSAGE_BYTES:  # (a long line read with its newline in one chunk)
            return self._too_large(conn)
        self._touch(conn)
        if conn.bucket.take():
            t0 = time.thread_time()  # (CPU time: the wait for a core on a loaded host is not the user's doing)
            conn.outbuf += self.api.handle(line, conn.peer)
            work = time.thread_time() - t0
            if conn.user is not None:  # (its size, after the token _work took: the next request waits for them; the
                # open files a register without fds had read, Api.cost; the agent's CPU time it took)
                conn.user.bucket.tokens -= (len(line) // self.BYTES_PER_TOKEN + self.api.cost
                                            + int(work / self.WORK_PER_TOKEN_S))
        else:
            self._count("rate_limited", logging.WARNING, "rate-limited pid %d uid %d: more than %g requests per "
                        "second on one connection", conn.peer.pid, conn.peer.uid, self.rate)
            conn.outbuf += protocol.error(None, "rate_limited", f"more than {self.rate:g} requests per second")
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what the socket takes; close a client with more than MAX_PENDING_OUTPUT unread."""
        if conn.closed:
            return
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(conn)
        if len(conn.outbuf) > self.MAX_PENDING_OUTPUT:  # a client that does not read its replies
            self._count("unread_output", logging.WARNING, "closed connection of pid %d uid %d: over %d bytes of "
                        "replies unread", conn.peer.pid, conn.peer.uid, self.MAX_PENDING_OUTPUT)
            return self._close(conn)
        self._watch(conn)

    def connection_counts(self) -> dict:
        """Open connections and limits now, for the metrics (read from another thread: plain reads only)."""
        users = list(self.users.values())
        return {"privileged": self.privileged_open, "user": sum(u.conns for u in users),
                "users_at_limit": sum(u.conns >= self.per_user for u in users),
                "max_connections": self.max_conns, "reserved_connections": self.reserved,
                "max_connections_per_user": self.per_user}

    # -- owners of registered flows ---------------------------------------------------------------------
    def _watch_owners(self) -> None:
        """Watch up to ``MAX_WATCHED`` processes that own flows (pidfd: readable when it exits); forget the others.
        Owners left unwatched (more of them, or no file descriptor to spare) lose their flows at the next sweep
        instead of at once: a user who registers from many processes cannot take the agent's open files."""
        owners = set(self.api.table.by_pid)
        for pid in set(self.watched) - owners:
            self._unwatch(pid)
        for pid in owners - set(self.watched):
            if len(self.watched) >= self.MAX_WATCHED:
                return
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._guarded("removing an exited process's flows", self.api.drop_owner, pid)
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOMEM: the sweep removes the flows once the process is gone
                self.refusals.note("pidfd", logging.WARNING, "cannot watch the processes that own flows: %s; their "
                                   "flows go at the next sweep once they exit", exc)
                return
            self.watched[pid] = fd
            self.sel.register(fd, READ, ("pid", pid))

    def _unwatch(self, pid: int) -> None:
        """Stop watching the owner ``pid`` (close its pidfd)."""
        fd = self.watched.pop(pid)
        self.sel.unregister(fd)
        os.close(fd)

    def _owner_exited(self, pid: int) -> None:
        """The owner ``pid`` exited: drop its flows."""
        self._unwatch(pid)
        self._guarded("removing an exited process's flows", self.api.drop_owner, pid)

    def _guarded(self, what: str, fn, *args) -> None:
        """Run the loop's own work ``fn(*args)``; an unexpected error is counted as a reconcile error and logged
        (bounded), and the agent goes on serving: the next full reconcile pass brings the kernel to the table."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the agent must stay up and keep the flows it holds
            stats = self.api.rec.stats
            stats.errors += 1
            stats.last_error = f"{what}: {type(exc).__name__}: {exc}"
            self.refusals.note(f"loop {what}", logging.ERROR, "%s failed: %s: %s", what, type(exc).__name__, exc)

    def close(self) -> None:
        """Close every connection and the listener, remove the socket file, flush the refusal log."""
        self.refusals.flush(force=True)
        for conn in list(self.conns.values()):
            self._close(conn)
        for pid in list(self.watched):
            self._unwatch(pid)
        self.sel.close()
        self.listener.close()
        try:
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode:
                os.unlink(self.path)
            else:
                log.warning("%s is no longer the agent's socket (replaced since the start): left as it is", self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # (a read-only directory by now: the exit goes on, the restore is not held up)
            log.warning("cannot remove the socket file %s: %s", self.path, exc)
