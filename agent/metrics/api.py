"""The agent's API requests: how many, with which outcome, and how long they took (registration latency).

Fed by ``api.observers`` (called as ``observer(op, outcome, seconds)`` after every request, in the agent's main
thread); read at scrape time. Labels are bounded: ``op`` is one of the protocol's ops or ``invalid``,
``outcome`` is ``ok`` or one of the protocol's error codes. Outcomes the socket server decides before a request
is parsed (a refused connection, a rate-limited client) are counted with op ``connect``/``request`` and kept out
of the histogram.

- ``tensorlane_api_requests_total{op,outcome}``
- ``tensorlane_api_request_duration_seconds{op}`` (histogram): from reading the request line to the reply,
  including the nftables transaction of a registration.
"""
from __future__ import annotations

import bisect
import threading

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from tensorlane.agent.metrics.base import Source
from tensorlane.agent.protocol import OPS

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ApiSource(Source):
    name = "api"

    def __init__(self, api):
        super().__init__(api)
        self._lock = threading.Lock()
        # Every op starts at zero (ok, and a histogram), so that the first request is an increase Prometheus sees.
        self._requests: dict[tuple[str, str], int] = {(op, "ok"): 0 for op in OPS}
        self._hist: dict[str, list] = {op: [[0] * (len(BUCKETS) + 1), 0.0] for op in OPS}  # op -> [counts, sum]
        api.observers.append(self.observe)

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self._requests[(op, outcome)] = self._requests.get((op, outcome), 0) + 1
            if op not in OPS and op != "invalid":
                return
            h = self._hist.setdefault(op, [[0] * (len(BUCKETS) + 1), 0.0])
            h[0][bisect.bisect_left(BUCKETS, seconds)] += 1
            h[1] += seconds

    def collect(self, scrape):
        with self._lock:
            requests = dict(self._requests)
            hist = {op: (list(counts), total) for op, (counts, total) in self._hist.items()}
        fam = CounterMetricFamily("tensorlane_api_requests", "Requests to the agent's API, by op and outcome "
                                  "(ok or the error code)", labels=["op", "outcome"])
        for (op, outcome), n in sorted(requests.items()):
            fam.add_metric([op, outcome], n)
        yield fam
        dur = HistogramMetricFamily("tensorlane_api_request_duration_seconds",
                                    "Time to answer an API request (a registration includes its nftables "
                                    "transaction)", labels=["op"])
        for op, (counts, total) in sorted(hist.items()):
            cum, buckets = 0, []
            for bound, n in zip((*map(str, BUCKETS), "+Inf"), counts):
                cum += n
                buckets.append((bound, cum))
            dur.add_metric([op], buckets, total)
        yield dur
