"""The agent's health as ``/healthz`` answers it and ``tensorlane_reconcile_stalled`` exports it: whether the main loop
still runs its reconcile passes (a stalled count means it is stuck; ``/metrics`` answers from its own thread).

Usage: ``code, body = Health(api).check()``
"""
from __future__ import annotations

import threading
import time


class Health:
    """``check()`` -> (HTTP status, body): unhealthy when the reconcile pass count stopped moving."""

    def __init__(self, api, stall_after_s: float | None = None, clock=time.monotonic):
        """Watch ``api.rec.stats``; stalled after ``stall_after_s`` (default: 3 x reconcile_interval_s, at least
        15 s)."""
        self.api = api
        self.stall_after_s = stall_after_s or max(15.0, 3 * float(api.cfg.reconcile_interval_s))
        self.clock = clock
        self._lock = threading.Lock()
        self._passes = api.rec.stats.passes
        self._errors = api.rec.stats.errors
        self._changed = clock()
        self._last_failed = False

    def check(self) -> tuple[int, dict]:
        """(200 or 503, the JSON body): whether a reconcile pass was seen within ``stall_after_s``."""
        st, now = self.api.rec.stats, self.clock()
        with self._lock:
            if st.passes != self._passes:
                self._last_failed = st.errors != self._errors
                self._passes, self._errors, self._changed = st.passes, st.errors, now
            idle = now - self._changed
            body = {"status": "ok", "interfaces": list(self.api.rec.interfaces), "backend": self.api.backend,
                    "seconds_since_reconcile": round(idle, 3), "last_reconcile_failed": self._last_failed,
                    "flows": len(self.api.table.flows)}
        if idle > self.stall_after_s:
            body["status"] = "stalled"
            return 503, body
        return 200, body
