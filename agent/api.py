"""The agent's request handlers and Unix-socket server (protocol in docs/protocol.md).

Handlers validate first, then change the FlowTable, then the kernel: a refused request changes nothing.
Usage: ``api = Api(cfg, table, reconciler, backend="htb"); reply = api.handle(line)``
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
import uuid

from agent import protocol
from agent.kernel.qdisc import fmt_handle
from agent.protocol import ProtocolError

log = logging.getLogger("tensorlane.api")
VERSION = "0.1.0"


class Api:
    """Dispatches parsed requests; keeps per-outcome counters for the metrics."""

    def __init__(self, cfg, table, reconciler, backend: str):
        self.cfg = cfg
        self.table = table
        self.rec = reconciler
        self.backend = backend
        self.started = time.time()
        self.instance = uuid.uuid4().hex  # lets clients notice a restarted agent and register again
        self.outcomes: dict[tuple[str, str], int] = {}
        self.latencies: list[float] = []
        # Called as observer(op, outcome, seconds) after every request (metrics subscribe here).
        self.observers: list = []

    def handle(self, line: bytes) -> bytes:
        """Answer one request line with one reply line; never raises."""
        t0 = time.perf_counter()
        rid, op = None, "invalid"
        try:
            req = protocol.parse_request(line)
            rid, op = req.id, req.op
            reply = protocol.ok(rid, getattr(self, f"_op_{req.op}")(req))
            outcome = "ok"
        except ProtocolError as exc:
            reply, outcome = protocol.error(rid, exc.code, str(exc)), exc.code
            log.info("refused %s: %s: %s", op, exc.code, exc)
        except Exception as exc:  # noqa: BLE001 - the agent must answer and stay up
            log.exception("internal error in %s", op)
            reply, outcome = protocol.error(rid, "internal", f"{type(exc).__name__}: {exc}"), "internal"
        self.outcomes[(op, outcome)] = self.outcomes.get((op, outcome), 0) + 1
        elapsed = time.perf_counter() - t0
        if op in ("register", "unregister"):
            self.latencies.append(elapsed)
            del self.latencies[:-10_000]
        for observe in self.observers:
            observe(op, outcome, elapsed)
        return reply

    def _op_hello(self, req) -> dict:
        return {"version": VERSION, "interface": self.cfg.interface, "levels": self.cfg.levels,
                "instance": self.instance}

    def _op_register(self, req) -> dict:
        added, moved = self.table.register(req.job, req.level, req.flows, req.rank)
        self.rec.apply(self.table, added, moved, [])
        return {"job": req.job, "level": req.level, "added": len(added), "moved": len(moved),
                "unchanged": len(req.flows) - len(added) - len(moved),
                "dscp": self.cfg.dscp[req.level], "class": fmt_handle(self.rec.backend.classid(req.level))}

    def _op_unregister(self, req) -> dict:
        removed = self.table.unregister(req.job, req.flows)
        self.rec.apply(self.table, [], [], removed)
        return {"job": req.job, "removed": len(removed)}

    def _op_list(self, req) -> dict:
        flows = [{**k.as_dict(), "job": e.job, "level": e.level, "rank": e.rank}
                 for k, e in sorted(self.table.flows.items()) if req.job is None or e.job == req.job]
        return {"flows": flows}

    def _op_status(self, req) -> dict:
        from agent.kernel import tcstats  # local: status is rare, keep the hot path lean

        classes = tcstats.class_stats(self.rec.ipr, self.rec.ifindex)
        marks = self.rec.counters()
        by_level = self.table.by_level()
        levels = []
        for spec in self.rec.backend.leaves():
            stats = classes.get(spec.classid, {})
            entry = {"level": spec.level, "class": fmt_handle(spec.classid), "prio": spec.prio, **stats}
            if spec.level is not None:
                entry |= {"dscp": self.cfg.dscp[spec.level], "flows": len(by_level[spec.level]),
                          "marked_bytes": marks.get(spec.level, {}).get("bytes", 0),
                          "marked_packets": marks.get(spec.level, {}).get("packets", 0)}
            levels.append(entry)
        return {
            "version": VERSION, "interface": self.cfg.interface, "backend": self.backend,
            "link_rate_bps": self.rec.backend.__dict__.get("rate"), "uptime_s": round(time.time() - self.started, 3),
            "flows": len(self.table.flows), "jobs": self.table.jobs(), "classes": levels,
            "reconcile": {"passes": self.rec.stats.passes, "repairs": self.rec.stats.repairs,
                          "errors": self.rec.stats.errors, "last_error": self.rec.stats.last_error},
        }


class Server:
    """A single-threaded Unix-socket server (selectors): one request is handled at a time, so the FlowTable and
    the kernel are only ever changed from this thread. pyroute2's synchronous API cannot run inside an asyncio
    loop, hence no asyncio here. Slow or hostile clients cannot stall it: sockets are non-blocking and a
    connection whose unanswered output grows too large is closed.
    """

    MAX_CLIENTS = 1024
    MAX_PENDING_OUTPUT = 1 << 20

    def __init__(self, api: Api, path: str, mode: int):
        self.api = api
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, mode)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.conns: dict[socket.socket, list[bytes]] = {}  # socket -> [input buffer, output buffer]

    def serve(self, stop: threading.Event, every_s: float, periodic) -> None:
        """Serve until ``stop`` is set, calling ``periodic()`` every ``every_s`` seconds."""
        next_tick = time.monotonic() + every_s
        while not stop.is_set():
            timeout = max(0.0, min(0.2, next_tick - time.monotonic()))
            for key, events in self.sel.select(timeout):
                if key.data is None:
                    self._accept()
                else:
                    self._service(key.fileobj, events)
            if time.monotonic() >= next_tick:
                periodic()
                next_tick = time.monotonic() + every_s

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if len(self.conns) >= self.MAX_CLIENTS:
            conn.close()
            return
        conn.setblocking(False)
        self.conns[conn] = [b"", b""]
        self.sel.register(conn, selectors.EVENT_READ, "client")

    def _close(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.conns.pop(conn, None)
        conn.close()

    def _service(self, conn: socket.socket, events: int) -> None:
        bufs = self.conns.get(conn)
        if bufs is None:
            return
        if events & selectors.EVENT_READ:
            try:
                data = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                return self._close(conn)
            if data == b"":
                return self._close(conn)
            if data:
                bufs[0] += data
                while b"\n" in bufs[0]:
                    line, bufs[0] = bufs[0].split(b"\n", 1)
                    bufs[1] += self.api.handle(line)
                if len(bufs[0]) > protocol.MAX_MESSAGE_BYTES:
                    bufs[1] += protocol.error(None, "too_large",
                                              f"message exceeds {protocol.MAX_MESSAGE_BYTES} bytes")
                    bufs[0] = b""
                    self._flush(conn, bufs)
                    return self._close(conn)
        self._flush(conn, bufs)

    def _flush(self, conn: socket.socket, bufs: list[bytes]) -> None:
        if bufs[1]:
            try:
                sent = conn.send(bufs[1])
                bufs[1] = bufs[1][sent:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                return self._close(conn)
        if len(bufs[1]) > self.MAX_PENDING_OUTPUT:
            return self._close(conn)
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if bufs[1] else 0)
        if self.sel.get_key(conn).events != want:
            self.sel.modify(conn, want, "client")

    def close(self) -> None:
        for conn in list(self.conns):
            self._close(conn)
        self.sel.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
