"""The socket server's fairness limits at work: what it refused or closed, by reason, and who holds connections.

Fed by ``api.observers`` like the api source: the server records each refusal as ``api.record(op, reason)`` with
op ``connect``, ``request`` or ``connection`` (``REFUSALS`` below, which the server uses); every reason starts
at zero. The open connections are read from the server (``api.server``) at scrape time; without a server (a fake
api) they are left out.

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

from prometheus_client import Counter

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source, without_created

# What the socket server (agent/server.py) refuses or closes, as reason -> op of ``api.record(op, reason)``.
# Declared here, not in the server, so that the metrics do not import the server (which imports the api).
REFUSALS = {
    "busy": "connect",               # max_connections reached (or all but the reserve, for other users)
    "forbidden": "connect",          # the peer is not allowed to use the agent
    "user_limit": "connect",         # the peer's uid holds max_connections_per_user connections
    "rate_limited": "request",       # more than rate_limit_per_s requests on one connection
    "user_rate_limited": "request",  # held back (not refused): its uid's requests_per_user_per_s were used up
    "too_large": "request",          # a line over protocol.MAX_MESSAGE_BYTES (the connection is closed)
    "idle_closed": "connection",     # no request for idle_timeout_s
    "unread_output": "connection",   # more than MAX_PENDING_OUTPUT of replies the client does not read
}
REASONS = {(op, reason): reason for reason, op in REFUSALS.items()}  # (op, outcome) of api.record -> reason label
LIMITS = ("max_connections", "reserved_connections", "max_connections_per_user")


class ConnectionsSource(Source):
    """The socket server's refusals by reason (counted as they happen) and its connections now."""

    name = "connections"

    def __init__(self, api):
        """The refusal counter, every reason at zero; subscribes to ``api.observers``."""
        super().__init__(api)
        self.refused = names.CONNECTIONS_REFUSED.instrument(Counter)
        for reason in REFUSALS:  # every reason starts at zero
            self.refused.labels(reason)
        api.observers.append(self.observe)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        """Count the outcomes that are refusals of the server (``REASONS``)."""
        reason = REASONS.get((op, outcome))
        if reason is not None:
            self.refused.labels(reason).inc()

    def collect(self, scrape):
        """Refusals; with a server, its open connections, users at their limit and the limits."""
        yield from without_created(self.refused)
        server = getattr(self.api, "server", None)
        if server is None:
            return
        counts = server.connection_counts()
        conns = names.CONNECTIONS.gauge()
        conns.add_metric(["privileged"], counts["privileged"])
        conns.add_metric(["user"], counts["user"])
        yield conns
        yield names.USERS_AT_CONNECTION_LIMIT.gauge(counts["users_at_limit"])
        limits = names.CONNECTION_LIMIT.gauge()
        for name in LIMITS:
            limits.add_metric([name], counts[name])
        yield limits
