"""The flow table kept on disk for the next agent after a crash (``api.journal``, agent/handover.py
``FlowJournal``: ``flows.json`` in ``state_dir``). While its writes fail (``state_dir`` full or read-only) the file
holds an older table, and an agent killed meanwhile loses the flows of clients that do not register again; the
agent logs it once and retries every ``JOURNAL_RETRY_S``. Nothing without a journal (a test's agent: the daemon
always keeps one).

- ``tensorlane_flow_table_writes_total``: writes that succeeded (one after each burst of changes, paced).
- ``tensorlane_flow_table_write_errors_total``: writes that failed (one per retry while they fail).
- ``tensorlane_flow_table_write_failing``: 1 while the last write failed, 0 once one succeeds (alert
  ``TensorlaneFlowTableNotWritten``).
"""
from __future__ import annotations

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source


class FlowTableSource(Source):
    """The journal's writes, failed writes and whether the last one failed."""

    name = "flow_table"

    def collect(self, scrape):
        """Read from ``api.journal`` (ints and a flag the main thread sets after each write)."""
        journal = self.api.journal
        if journal is None:
            return
        yield names.FLOW_TABLE_WRITES.counter(journal.writes)
        yield names.FLOW_TABLE_WRITE_ERRORS.counter(journal.errors)
        yield names.FLOW_TABLE_WRITE_FAILING.gauge(float(journal.failing))
