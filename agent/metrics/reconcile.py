"""The reconciler's counters: full passes, repaired drift, failed passes (``api.rec.stats``).

- ``tensorlane_reconcile_passes_total``: full passes (one every ``reconcile_interval_s``; a flat rate means the
  agent's main loop is stuck).
- ``tensorlane_reconcile_repairs_total``: map entries put back or removed because the kernel had drifted.
- ``tensorlane_reconcile_errors_total``: passes that failed (the agent keeps running and retries).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from tensorlane.agent.metrics.base import Source


class ReconcileSource(Source):
    name = "reconcile"

    def collect(self, scrape):
        st = self.api.rec.stats
        for name, value, text in (
                ("tensorlane_reconcile_passes", st.passes, "Full reconcile passes"),
                ("tensorlane_reconcile_repairs", st.repairs, "Kernel map entries repaired by reconcile passes"),
                ("tensorlane_reconcile_errors", st.errors, "Reconcile passes that failed")):
            fam = CounterMetricFamily(name, text, labels=["device"])
            fam.add_metric([scrape.device], value)
            yield fam
