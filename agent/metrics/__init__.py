"""Prometheus metrics of the agent, read from the kernel and the agent's state at scrape time (no polling thread).

Every ``tensorlane_*`` name, help text and label set is declared once, in ``agent/metrics/names.py``.
One small module per source of data, all of the same shape (``agent/metrics/base.py``): ``build``,
``classes`` (tc class counters), ``contention`` (priority inversion, queueing delay), ``flows`` (registered
flows, nftables marks), ``api`` (request outcomes and latency), ``connections`` (the socket server's refusals
by reason, open connections), ``reconcile``, ``flowtable`` (the writes of the flow table file the next agent
takes back after a crash), ``jobs`` (communication time reported by the shims), ``jobpolicy`` (the job order and
the jobs' parts of the link). Every scrape also reports, per source,
``tensorlane_scrape_collector_success`` and ``tensorlane_scrape_collector_duration_seconds``: a failing source does
not fail the scrape. The registry also has prometheus_client's standard collectors:
``process_*`` (memory, CPU, open files), ``python_info`` and ``python_gc_*``. Meanings: docs/metrics.md.

HTTP (one thread per request, started by ``start_metrics_server``): ``/metrics``; ``/healthz`` (200 while the
agent's main loop runs its reconcile passes, 503 when it has not for ``3 x reconcile_interval_s``, at least
15 s; JSON body).

Usage: ``server = start_metrics_server("127.0.0.1:9477", api)`` (``server.close()`` stops it).
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.registry import Collector, CollectorRegistry

from tensorlane.agent.kernel.sockdiag import SockDiag
from tensorlane.agent.logs import RefusalLog
from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.api import ApiSource
from tensorlane.agent.metrics.base import Scrape, Source
from tensorlane.agent.metrics.build import BuildSource
from tensorlane.agent.metrics.classes import ClassesSource
from tensorlane.agent.metrics.connections import ConnectionsSource
from tensorlane.agent.metrics.contention import ContentionSource
from tensorlane.agent.metrics.flows import FlowsSource
from tensorlane.agent.metrics.flowtable import FlowTableSource
from tensorlane.agent.metrics.health import Health
from tensorlane.agent.metrics.jobpolicy import JobPolicySource
from tensorlane.agent.metrics.jobs import JobReports, JobsSource
from tensorlane.agent.metrics.reconcile import ReconcileSource
from tensorlane.agent.peers import account_uid
from tensorlane.agent.ratelimit import TokenBucket

log = logging.getLogger("tensorlane.metrics")
SOURCES = (BuildSource, ClassesSource, ContentionSource, FlowsSource, ApiSource, ConnectionsSource, ReconcileSource,
           FlowTableSource, JobsSource, JobPolicySource)
__all__ = ["AgentCollector", "Health", "JobReports", "MetricsServer", "SOURCES", "Source", "make_registry",
           "start_metrics_server"]


class AgentCollector(Collector):
    """Runs every source on one shared Scrape; a source that raises is reported (success 0) and skipped."""

    def __init__(self, api, sources: list[Source]):
        """Collects ``sources`` (instances, already subscribed) for ``api``."""
        self.api = api
        self.sources = sources
        self._logged: set[str] = set()

    def collect(self):
        """Every source's families on one Scrape, then each source's success and duration."""
        scrape = Scrape(self.api)
        success, duration = names.SCRAPE_COLLECTOR_SUCCESS.gauge(), names.SCRAPE_COLLECTOR_DURATION.gauge()
        for src in self.sources:
            t0 = time.perf_counter()
            try:
                families = list(src.collect(scrape))
                ok = 1
            except Exception as exc:  # noqa: BLE001 - one broken source must not hide the others
                families, ok = [], 0
                if src.name not in self._logged:  # once per source, not once per scrape
                    self._logged.add(src.name)
                    log.warning("metrics source %s failed: %s: %s", src.name, type(exc).__name__, exc)
            yield from families
            success.add_metric([src.name], ok)
            duration.add_metric([src.name], time.perf_counter() - t0)
        yield success
        yield duration


def make_registry(api, sources=SOURCES) -> tuple[CollectorRegistry, AgentCollector]:
    """A fresh registry with the agent's collector (subscribes the api source to ``api.observers``) and
    prometheus_client's standard process, platform and garbage collector collectors."""
    registry = CollectorRegistry()
    collector = AgentCollector(api, [cls(api) for cls in sources])
    registry.register(collector)
    for standard in (ProcessCollector, PlatformCollector, GCCollector):
        standard(registry=registry)
    return registry, collector


def make_app(registry: CollectorRegistry, health: Health):
    """The WSGI app: /metrics, /healthz, and a tiny index at /."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        """Route one request."""
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path in ("/healthz", "/-/healthy"):
            code, body = health.check()
            start_response(f"{code} {'OK' if code == 200 else 'Service Unavailable'}",
                           [("Content-Type", "application/json")])
            return [json.dumps(body).encode() + b"\n"]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [b"<html><body><h1>tensorlane agent</h1><p><a href='/metrics'>/metrics</a> "
                    b"<a href='/healthz'>/healthz</a></p></body></html>\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app


class _Handler(WSGIRequestHandler):
    """The request handler, without an access log; a client silent for ``timeout`` seconds is dropped."""

    timeout = 10.0  # (a socket timeout for each read and write: an idle client does not keep its thread)

    def log_message(self, *args):
        """No access log on the agent's stderr."""


def _cut_off(request: socket.socket) -> None:
    """End a request that outlived its deadline: its thread's next read or write fails, and the slot is free."""
    with contextlib.suppress(OSError):  # (already gone)
        request.shutdown(socket.SHUT_RDWR)


def _remote_peer(host: str) -> tuple:
    """A remote client as a peer: its IPv4 address (a v4-mapped IPv6 one too), or its IPv6 /64. A host is given a
    /64 and may send from any address of it (privacy addresses, or many on purpose), so by address one remote host
    held every slot, 4 requests per address."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])  # (a link-local address's scope is no part of the peer)
    except ValueError:
        return ("address", host)
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.version == 4:
        return ("address", str(addr))
    return ("address", str(ipaddress.ip_network((int(addr) >> 64 << 64, 64))))


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One daemon thread per request, at most ``MAX_CLIENTS`` at once and ``MAX_PER_PEER`` of one peer (beyond, a
    connection is closed at once); the address may be reused at once.

    Any local user can connect to the metrics address. Unbounded, every idle connection held a thread and a file
    descriptor of the agent for ever: some thousand of them took the agent's open files, and its API socket then
    accepted no one, root included. A client error (a reset, a timeout) is logged at most once per 10 s, not as a
    traceback on stderr per connection."""

    daemon_threads = True
    block_on_close = False  # (close() does not wait for clients that are slow to go)
    allow_reuse_address = True
    MAX_CLIENTS = 16
    # A request's whole life, reading it and writing the answer: a client that sends a byte every few seconds
    # passes each read's timeout, and 16 of them held every slot (scrapes and /healthz refused) for as long as
    # they liked. Prometheus' own scrape timeout is 10 s by default.
    REQUEST_DEADLINE_S = 15.0
    # A peer is the user that made the client's socket when it is a socket of this host (sock_diag; whatever
    # address of 127.0.0.0/8 it connects from), else the client's address. With the slots alone, one local user's
    # 16 connections, each cut off at its deadline and opened again, held every slot: every scrape refused.
    MAX_PER_PEER = 4
    # A peer's requests a second, with a burst (a token bucket; beyond, a connection is closed at once, before a
    # thread or a render): one local user scraping in 4 loops made the agent render 130 scrapes a second, a core of
    # the host's 2 (root's API p50 2.6 -> 6.6 ms, another user's scrape 12 -> 39 ms). Prometheus scrapes every few
    # seconds. Root (the agent's user) is not limited.
    REQUESTS_PER_PEER_PER_S = 2.0
    REQUEST_BURST = 8
    MAX_BUCKETS = 1024  # peers' buckets kept (beyond, the refilled ones are dropped)

    def server_activate(self):
        """Listen, and make the slots of the concurrent clients."""
        super().server_activate()
        self.slots = threading.BoundedSemaphore(self.MAX_CLIENTS)
        self.refusals = RefusalLog(log, 10.0)
        self.lock = threading.Lock()  # (the refusal log and the deadlines are used from the clients' threads)
        self.deadlines: dict = {}  # request socket -> when it is cut off
        self.peers: dict = {}  # request socket -> its peer (``_peer``)
        self.held: dict = {}  # peer -> its requests served now
        self.buckets: dict = {}  # peer -> its TokenBucket: ``_take_token``
        self.diag = SockDiag()  # (used by the accepting thread only)
        self.closed = threading.Event()
        threading.Thread(target=self._reap, name="tensorlane-metrics-reaper", daemon=True).start()

    def server_close(self):
        """Close the listener; the reaper ends (none where the listener could not be made)."""
        if hasattr(self, "closed"):
            self.closed.set()
            self.diag.close()
        super().server_close()

    def _peer(self, request, client_address) -> tuple:
        """Who connects: ``("uid", UID)`` when the client's socket is one of this host's (the kernel names the user
        that made it; a uid of a user's subordinate range is that user's, as at the API: :func:`account_uid`), else
        ``("address", ADDRESS)`` (``_remote_peer``). Until 2026-11-28 the metrics server mapped uids by a copy of
        its own that counted a uid of root's range (LXD's containers) as root: not rate limited, and its
        connections took root's ``MAX_PER_PEER``."""
        host, port = client_address[:2]
        try:
            here = request.getsockname()
            # (a link-local address has a scope, the interface: looked up on it, else the client's socket, bound to
            # it, was not found and a local user was the remote peer fe80::/64 too, 4 requests more)
            scope = client_address[3] if len(client_address) > 3 else 0
            found = self.diag.tcp(host.split("%", 1)[0], port, here[0].split("%", 1)[0], here[1], scope)
        except (OSError, ValueError):  # no sock_diag, or an address it cannot take (an IPv6 scope): by address
            found = None
        return _remote_peer(host) if found is None else ("uid", account_uid(found.uid))

    def process_request(self, request, client_address):
        """Serve ``request`` in a thread if its peer holds fewer than ``MAX_PER_PEER`` and a slot is free, else
        close it (counted in the log)."""
        peer = self._peer(request, client_address)
        if not self._take_token(peer):
            self._note("metrics peer rate", logging.WARNING, "closed a metrics connection from %s (%s %s): over %g "
                       "requests a second", client_address[0], *peer, self.REQUESTS_PER_PEER_PER_S)
            self.shutdown_request(request)
            return
        with self.lock:
            mine = self.held.get(peer, 0) < self.MAX_PER_PEER
            if mine:
                self.held[peer] = self.held.get(peer, 0) + 1
        if not mine:
            self._note("metrics peer busy", logging.WARNING, "closed a metrics connection from %s (%s %s): it has %d "
                       "requests served already", client_address[0], *peer, self.MAX_PER_PEER)
            self.shutdown_request(request)
            return
        if not self.slots.acquire(blocking=False):
            self._release_peer(peer)
            self._note("metrics busy", logging.WARNING, "closed a metrics connection from %s: %d clients are served "
                       "already", client_address[0], self.MAX_CLIENTS)
            self.shutdown_request(request)
            return
        with self.lock:
            self.peers[request] = peer
        try:
            super().process_request(request, client_address)
        except RuntimeError as exc:  # (no thread could start): the slot is free again
            self._done(request)
            self._note("metrics thread", logging.WARNING, "cannot serve a metrics request: %s", exc)
            self.shutdown_request(request)

    def _take_token(self, peer) -> bool:
        """One request from ``peer``'s bucket (False when it is empty); root's requests are not counted."""
        if peer == ("uid", 0):
            return True
        now = time.monotonic()
        with self.lock:
            bucket = self.buckets.get(peer)
            if bucket is None:
                bucket = self.buckets[peer] = TokenBucket(self.REQUESTS_PER_PEER_PER_S, self.REQUEST_BURST, now)
            taken = bucket.take(now)
            if len(self.buckets) > self.MAX_BUCKETS:
                full = self.REQUEST_BURST / self.REQUESTS_PER_PEER_PER_S
                self.buckets = {p: b for p, b in self.buckets.items() if now - b.stamp < full}
        return taken

    def process_request_thread(self, request, client_address):
        """Serve (cut off after ``REQUEST_DEADLINE_S``: :meth:`_reap`), then free the slot and the peer's."""
        with self.lock:
            self.deadlines[request] = time.monotonic() + self.REQUEST_DEADLINE_S
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request) -> None:
        """``request`` is over: its slot and its peer's part are free."""
        with self.lock:
            self.deadlines.pop(request, None)
            peer = self.peers.pop(request, None)
        if peer is not None:
            self._release_peer(peer)
        self.slots.release()

    def _release_peer(self, peer) -> None:
        """One request of ``peer`` is over (or was refused after it was counted)."""
        with self.lock:
            left = self.held.pop(peer) - 1
            if left:
                self.held[peer] = left

    def _reap(self) -> None:
        """One thread for the server's life: every 0.5 s, end the requests past their deadline (their thread's next
        read or write fails, and the slot is free)."""
        while not self.closed.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [r for r, at in self.deadlines.items() if at <= now]
            for request in late:
                _cut_off(request)

    def handle_error(self, request, client_address):
        """A client that reset, timed out or sent garbage: one bounded log line, no traceback."""
        exc = sys.exc_info()[1]
        self._note("metrics client error", logging.INFO, "metrics request from %s failed: %s: %s", client_address[0],
                   type(exc).__name__, exc)

    def _note(self, reason: str, level: int, msg: str, *args) -> None:
        """Log through the bounded refusal log (noted from the clients' threads too)."""
        with self.lock:
            self.refusals.note(reason, level, msg, *args)


class MetricsServer:
    """The running HTTP server: ``registry``, ``collector``, ``health``, ``address``, ``close()``."""

    def __init__(self, address: str, api, sources=SOURCES):
        """Bind ``address`` (IPv4, ``[IPv6]`` or a host name) and serve in a daemon thread."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        self.registry, self.collector = make_registry(api, sources)
        self.health = Health(api)
        server_cls = _ThreadingServer
        try:
            if ipaddress.ip_address(host).version == 6:
                server_cls = type("_ThreadingServer6", (_ThreadingServer,), {"address_family": socket.AF_INET6})
        except ValueError:  # a host name
            pass
        self.httpd = make_server(host, int(port), make_app(self.registry, self.health), server_cls,
                                 handler_class=_Handler)
        self.address = f"[{host}]:{self.httpd.server_port}" if ":" in host else f"{host}:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tensorlane-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and close the socket (waits up to 5 s for the thread)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(address: str, api) -> MetricsServer:
    """Serve /metrics and /healthz on ``address`` ("host:port", "[v6]:port"; port 0 picks one) in a thread."""
    server = MetricsServer(address, api)
    log.info("metrics on http://%s/metrics", server.address)
    return server
