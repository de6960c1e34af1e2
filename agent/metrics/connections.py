"""The socket server's fairness limits at work: what it refused or closed, by reason, and who holds connections.

Fed by ``api.observers`` like the api source: the server records each refusal as ``api.record(op, reason)`` with
op ``connect``, ``request`` or ``connection`` (agent/server.py, ``REFUSALS``); every reason starts at zero. The
open connections are read from the server (``api.server``) at scrape time; without a server (a fake api) they
are left out.

- ``tensorlane_agent_connections_refused_total{reason}``: connections refused (``busy``, ``user_limit``,
  ``forbidden``), requests refused by a rate limit (``rate_limited`` per connection, ``user_rate_limited`` per
  uid), connections closed (``idle_closed``, ``too_large``, ``unread_output``)
- ``tensorlane_agent_connections{kind}``: open now; ``kind`` is ``privileged`` (root, the agent's user,
  ``trusted_users``: they may use the reserve) or ``user``
- ``tensorlane_agent_users_at_connection_limit``: uids holding ``max_connections_per_user`` connections now
- ``tensorlane_agent_connection_limit{limit}``: ``max_connections``, ``reserved_connections``,
  ``max_connections_per_user`` (the configuration)
"""
from __future__ import annotations

import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tensorlane.agent.metrics.base import Source

# (op, outcome) of api.record -> reason label; the same table as agent/server.py's REFUSALS (kept here so that the
# metrics do not import the server).
REASONS = {
    ("connect", "busy"): "busy", ("connect", "forbidden"): "forbidden", ("connect", "user_limit"): "user_limit",
    ("request", "rate_limited"): "rate_limited", ("request", "user_rate_limited"): "user_rate_limited",
    ("request", "too_large"): "too_large", ("connection", "idle_closed"): "idle_closed",
    ("connection", "unread_output"): "unread_output",
}


class ConnectionsSource(Source):
    name = "connections"

    def __init__(self, api):
        super().__init__(api)
        self._lock = threading.Lock()
        self._refused = {reason: 0 for reason in REASONS.values()}
        api.observers.append(self.observe)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        reason = REASONS.get((op, outcome))
        if reason is not None:
            with self._lock:
                self._refused[reason] += 1

    def collect(self, scrape):
        with self._lock:
            refused = dict(self._refused)
        fam = CounterMetricFamily("tensorlane_agent_connections_refused",
                                  "Connections refused or closed and requests refused by the socket server's "
                                  "limits, by reason", labels=["reason"])
        for reason, n in sorted(refused.items()):
            fam.add_metric([reason], n)
        yield fam
        server = getattr(self.api, "server", None)
        if server is None:
            return
        counts = server.connection_counts()
        conns = GaugeMetricFamily("tensorlane_agent_connections", "Open API connections, privileged (root, the "
                                  "agent's user, trusted_users) or not", labels=["kind"])
        conns.add_metric(["privileged"], counts["privileged"])
        conns.add_metric(["user"], counts["user"])
        yield conns
        yield GaugeMetricFamily("tensorlane_agent_users_at_connection_limit",
                                "Users holding max_connections_per_user connections now",
                                value=counts["users_at_limit"])
        limits = GaugeMetricFamily("tensorlane_agent_connection_limit", "The socket server's connection limits "
                                   "(configuration)", labels=["limit"])
        for name in ("max_connections", "reserved_connections", "max_connections_per_user"):
            limits.add_metric([name], counts[name])
        yield limits
