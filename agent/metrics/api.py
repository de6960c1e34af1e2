"""The agent's API requests: how many, with which outcome, and how long they took (registration latency).

Fed by ``api.observers`` (called as ``observer(op, outcome, seconds)`` after every request, in the agent's main
thread) into prometheus_client instruments; read at scrape time. Labels are bounded: ``op`` is one of the
protocol's ops or ``invalid``, ``outcome`` is ``ok`` or one of the protocol's error codes. Outcomes the socket
server decides before a request is parsed (a refused connection, a rate-limited client) are counted with op
``connect``/``request`` and kept out of the histogram.

- ``tensorlane_api_requests_total{op,outcome}``
- ``tensorlane_api_request_duration_seconds{op}`` (histogram): from reading the request line to the reply,
  including the nftables transaction of a registration.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source, without_created
from tensorlane.agent.protocol import OPS

# The refusals of a registration (the protocol's error codes of ``register``), started at zero with each agent:
# the alert TensorlaneRegistrationsRefused takes increase() of each, which misses a series' first count.
REGISTER_REFUSALS = ("forbidden", "limit", "not_owner", "foreign_netns", "bad_level", "bad_flow", "bad_job")
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiSource(Source):
    """Requests by op and outcome, and their latency, counted as they happen."""

    name = "api"

    def __init__(self, api):
        """The instruments, every op at zero; subscribes to ``api.observers``."""
        super().__init__(api)
        self.requests = names.API_REQUESTS.instrument(Counter)
        self.duration = names.API_REQUEST_DURATION.instrument(Histogram, buckets=BUCKETS)
        for op in OPS:  # every op starts at zero, so that the first request is an increase Prometheus sees
            self.requests.labels(op, "ok")
            self.duration.labels(op)
        for outcome in REGISTER_REFUSALS:  # and so do the refusals the alert counts
            self.requests.labels("register", outcome)
        api.observers.append(self.observe)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        """Count one request (or an outcome decided by the server); time it if it was a request."""
        self.requests.labels(op, outcome).inc()
        if op in OPS or op == "invalid":
            self.duration.labels(op).observe(seconds)

    def collect(self, scrape):
        """The two instruments' families."""
        yield from without_created(self.requests)
        yield from without_created(self.duration)
