"""The reconciler's counters: full passes, repaired drift, failed passes (``api.rec.stats``).

- ``tensorlane_reconcile_passes_total``: full passes (one every ``reconcile_interval_s``; a flat rate means the
  agent's main loop is stuck).
- ``tensorlane_reconcile_repairs_total``: map entries put back or removed because the kernel had drifted.
- ``tensorlane_reconcile_errors_total``: passes that failed (the agent keeps running and retries).
"""
from __future__ import annotations

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source


class ReconcileSource(Source):
    """The reconciler's pass, repair and error counters."""

    name = "reconcile"

    def collect(self, scrape):
        """One counter each, read from ``api.rec.stats``."""
        st = self.api.rec.stats
        for metric, value in ((names.RECONCILE_PASSES, st.passes), (names.RECONCILE_REPAIRS, st.repairs),
                              (names.RECONCILE_ERRORS, st.errors)):
            fam = metric.counter()
            fam.add_metric([scrape.device], value)
            yield fam
