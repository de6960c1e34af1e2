"""The agent's health as ``/healthz`` answers it and ``tensorlane_reconcile_stalled`` exports it: whether the main loop
still runs its reconcile passes (a stalled count means it is stuck; ``/metrics`` answers from its own thread).

Usage: ``code, body = Health(api).check()``
"""
from __future__ import annotations

import time


class Health:
    """``check()`` -> (HTTP status, body): unhealthy when no reconcile pass began within ``stall_after_s``. It keeps
    nothing of its own: every instance (``/healthz``'s, the gauge's) answers from ``api.rec.stats`` alike."""

    def __init__(self, api, stall_after_s: float | None = None, clock=time.monotonic):
        """Watch ``api.rec.stats``; stalled after ``stall_after_s`` (default: 3 x reconcile_interval_s, at least
        15 s). ``clock``: the reconciler's (``time.monotonic``); before the first pass, idle counts from here."""
        self.api = api
        self.stall_after_s = stall_after_s or max(15.0, 3 * float(api.cfg.reconcile_interval_s))
        self.clock = clock
        self._started = clock()

    def check(self) -> tuple[int, dict]:
        """(200 or 503, the JSON body): whether a reconcile pass began within ``stall_after_s``."""
        st, now = self.api.rec.stats, self.clock()
        last = st.last_pass_s if st.last_pass_s is not None else self._started
        idle = max(0.0, now - last)
        body = {"status": "ok", "interfaces": list(self.api.rec.interfaces), "backend": self.api.backend,
                "seconds_since_reconcile": round(idle, 3), "last_reconcile_failed": st.last_pass_failed,
                "flows": len(self.api.table.flows)}
        if idle > self.stall_after_s:
            body["status"] = "stalled"
            return 503, body
        return 200, body
