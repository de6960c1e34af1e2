"""The reconciler's counters: full passes, repaired drift, failed passes (``api.rec.stats``).

- ``tensorlane_reconcile_passes_total``: full passes (one every ``reconcile_interval_s``; a flat rate means the
  agent's main loop is stuck).
- ``tensorlane_reconcile_repairs_total``: map entries put back or removed because the kernel had drifted.
- ``tensorlane_reconcile_errors_total``: passes that failed (the agent keeps running and retries).
- ``tensorlane_reconcile_stalled``: 1 while no pass was seen for ``3 x reconcile_interval_s`` (at least 15 s), as
  ``/healthz`` decides (``health.Health``): right for any interval, where a rate of the passes over a fixed window is
  0 between the passes of a long one.
"""
from __future__ import annotations

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source
from tensorlane.agent.metrics.health import Health


class ReconcileSource(Source):
    """The reconciler's pass, repair and error counters."""

    name = "reconcile"

    def __init__(self, api):
        """The stall test of ``/healthz`` (``Health`` reads the last pass's time from ``api.rec.stats``)."""
        super().__init__(api)
        self.health = Health(api)

    def collect(self, scrape):
        """One counter each, read from ``api.rec.stats``; whether the passes stalled."""
        st = self.api.rec.stats
        for metric, value in ((names.RECONCILE_PASSES, st.passes), (names.RECONCILE_REPAIRS, st.repairs),
                              (names.RECONCILE_ERRORS, st.errors)):
            fam = metric.counter()
            fam.add_metric([scrape.device], value)
            yield fam
        stalled = names.RECONCILE_STALLED.gauge()
        stalled.add_metric([scrape.device], float(self.health.check()[0] != 200))
        yield stalled
