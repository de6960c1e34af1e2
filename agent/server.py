"""The agent's Unix-socket server: one thread, non-blocking sockets, a selector.

One request is handled at a time, so the FlowTable and the kernel are only changed from this thread (pyroute2's
synchronous API cannot run inside an asyncio loop, hence no asyncio). What a hostile or broken client can do is
bounded: the kernel names every peer (SO_PEERCRED) and only allowed users get an answer; each connection has a
request rate limit, a line-length limit and a cap on unanswered output; connections are capped in number.
Processes that registered flows of their own sockets are watched with a pidfd: when one exits its flows go at
once, and a sweep every ``SWEEP_S`` removes flows whose sockets were closed. With ``job_policy = "rotate"`` the
loop also wakes at each epoch boundary of the wall clock and moves the flows whose effective level the new job
order changes, in one nftables transaction (agent/jobs.py).
Usage: ``Server(api, "/run/tensorlane/agent.sock", 0o660).serve(stop, 5.0, periodic)``
"""
from __future__ import annotations

import grp
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from agent import protocol
from agent.api import Api
from agent.peers import Peer, credentials

log = logging.getLogger("tensorlane.server")
SWEEP_S = 0.5


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    tokens: float
    stamp: float = field(default_factory=time.monotonic)
    inbuf: bytes = b""
    outbuf: bytes = b""


class Server:
    """Serves ``api`` on a Unix socket until told to stop."""

    MAX_CLIENTS = 1024
    MAX_PENDING_OUTPUT = 1 << 20

    def __init__(self, api: Api, path: str, mode: int, group: str | None = None):
        self.api = api
        self.path = path
        self.rate = api.cfg.rate_limit_per_s
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        if group is not None:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        os.chmod(path, mode)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, ("listen", None))
        self.conns: dict[socket.socket, _Conn] = {}
        self.watched: dict[int, int] = {}  # pid -> pidfd

    def serve(self, stop: threading.Event, every_s: float, periodic) -> None:
        """Serve until ``stop`` is set, calling ``periodic()`` every ``every_s`` seconds."""
        next_tick = time.monotonic() + every_s
        next_sweep = time.monotonic() + SWEEP_S
        jobs = self.api.jobs
        while not stop.is_set():
            to_epoch = jobs.seconds_to_next_epoch()
            timeout = max(0.0, min(0.2, next_tick - time.monotonic(), next_sweep - time.monotonic(),
                                   1.0 if to_epoch is None else to_epoch + 0.001))
            for key, events in self.sel.select(timeout):
                kind, data = key.data
                if kind == "listen":
                    self._accept()
                elif kind == "pid":
                    self._owner_exited(data)
                else:
                    self._service(data, events)
            if jobs.epoch_due():  # a new rotation epoch: a new job order
                self.api.rotate()
            now = time.monotonic()
            if now >= next_sweep:
                self.api.sweep()
                self._watch_owners()
                next_sweep = now + SWEEP_S
            if now >= next_tick:
                periodic()
                next_tick = time.monotonic() + every_s

    # -- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        peer = credentials(sock)
        if len(self.conns) >= self.MAX_CLIENTS:
            self._refuse(sock, peer, "busy", f"too many connections ({self.MAX_CLIENTS})")
            return
        if not self.api.policy.allowed(peer):
            self._refuse(sock, peer, "forbidden", f"user {peer.user} is not allowed to use this agent")
            return
        sock.setblocking(False)
        conn = _Conn(sock, peer, tokens=self.rate)
        self.conns[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))

    def _refuse(self, sock: socket.socket, peer: Peer, code: str, message: str) -> None:
        log.warning("refused connection from pid %d uid %d: %s", peer.pid, peer.uid, message)
        self.api.record("connect", code)
        try:
            sock.setblocking(False)
            sock.send(protocol.error(None, code, message))
        except OSError:
            pass
        sock.close()

    def _close(self, conn: _Conn) -> None:
        self.sel.unregister(conn.sock)
        self.conns.pop(conn.sock, None)
        conn.sock.close()

    def _allow_request(self, conn: _Conn) -> bool:
        now = time.monotonic()
        conn.tokens = min(self.rate, conn.tokens + (now - conn.stamp) * self.rate)
        conn.stamp = now
        if conn.tokens < 1:
            return False
        conn.tokens -= 1
        return True

    def _service(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_READ:
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
                while b"\n" in conn.inbuf:
                    line, conn.inbuf = conn.inbuf.split(b"\n", 1)
                    if self._allow_request(conn):
                        conn.outbuf += self.api.handle(line, conn.peer)
                    else:
                        self.api.record("request", "rate_limited")
                        conn.outbuf += protocol.error(None, "rate_limited",
                                                      f"more than {self.rate:g} requests per second")
                if len(conn.inbuf) > protocol.MAX_MESSAGE_BYTES:
                    self.api.record("request", "too_large")
                    conn.outbuf += protocol.error(None, "too_large",
                                                  f"message exceeds {protocol.MAX_MESSAGE_BYTES} bytes")
                    conn.inbuf = b""
                    self._flush(conn)
                    return self._close(conn)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(conn)
        if len(conn.outbuf) > self.MAX_PENDING_OUTPUT:  # a client that does not read its replies
            return self._close(conn)
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if self.sel.get_key(conn.sock).events != want:
            self.sel.modify(conn.sock, want, ("conn", conn))

    # -- owners of registered flows ---------------------------------------------------------------------
    def _watch_owners(self) -> None:
        """Watch every process that owns flows (pidfd: readable when it exits); forget the others."""
        owners = set(self.api.table.by_pid)
        for pid in owners - set(self.watched):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.api.drop_owner(pid)
                continue
            self.watched[pid] = fd
            self.sel.register(fd, selectors.EVENT_READ, ("pid", pid))
        for pid in set(self.watched) - owners:
            self._unwatch(pid)

    def _unwatch(self, pid: int) -> None:
        fd = self.watched.pop(pid)
        self.sel.unregister(fd)
        os.close(fd)

    def _owner_exited(self, pid: int) -> None:
        self._unwatch(pid)
        self.api.drop_owner(pid)

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        for pid in list(self.watched):
            self._unwatch(pid)
        self.sel.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
