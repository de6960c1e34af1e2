"""The desired flow state, in one place: which flow belongs to which job, at which level.

Pure data, no I/O: the reconciler (agent/reconcile.py) makes the kernel match it.
Usage: ``table = FlowTable(levels=4); added, moved = table.register("job-a", 0, flows)``
"""
from __future__ import annotations

import time
from typing import NamedTuple

from agent.protocol import FlowKey, ProtocolError


class FlowEntry(NamedTuple):
    """What the agent knows about one registered flow (a tuple of atomic values: not tracked by the GC)."""

    job: str
    level: int
    rank: int | None = None
    pid: int | None = None  # the owning process, when ownership was checked: its exit removes the flow
    uid: int | None = None  # the registering user
    registered_at: float = 0.0


class FlowTable:
    """Registered flows keyed by 5-tuple; every change is validated before anything is modified."""

    def __init__(self, levels: int, max_flows: int = 100_000):
        self.levels = levels
        self.max_flows = max_flows
        self.flows: dict[FlowKey, FlowEntry] = {}
        self.by_pid: dict[int, set[FlowKey]] = {}

    def register(self, job: str, level: int, flows: tuple[FlowKey, ...], rank: int | None = None,
                 pid: int | None = None, uid: int | None = None) -> tuple[list[FlowKey], list[FlowKey]]:
        """Add ``flows`` for ``job`` at ``level`` (moving the job's own flows that are at another level).

        Returns (added, moved). Raises ProtocolError, changing nothing, when the level is out of range, a flow
        belongs to another job, or the table would overflow.
        """
        if not 0 <= level < self.levels:
            raise ProtocolError("bad_level", f"level {level} out of range 0..{self.levels - 1}")
        added, moved = [], []
        for key in flows:
            cur = self.flows.get(key)
            if cur is None:
                added.append(key)
            elif cur.job != job:
                raise ProtocolError("conflict", f"flow {key} is registered by job {cur.job!r}")
            elif cur.level != level:
                moved.append(key)
        if len(self.flows) + len(added) > self.max_flows:
            raise ProtocolError("limit", f"registering {len(added)} flows would exceed {self.max_flows}")
        now = time.time()
        for key in flows:
            self._forget_owner(key)
            self.flows[key] = FlowEntry(job, level, rank, pid, uid, now)
            if pid is not None:
                self.by_pid.setdefault(pid, set()).add(key)
        return added, moved

    def _forget_owner(self, key: FlowKey) -> None:
        old = self.flows.get(key)
        if old is not None and old.pid is not None:
            keys = self.by_pid.get(old.pid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_pid[old.pid]

    def drop_pid(self, pid: int) -> list[FlowKey]:
        """Remove every flow owned by process ``pid`` (it exited); return them."""
        gone = sorted(self.by_pid.pop(pid, ()))
        for key in gone:
            del self.flows[key]
        return gone

    def drop(self, keys: list[FlowKey]) -> list[FlowKey]:
        """Remove ``keys`` whatever their job (their sockets are gone); return those that were present."""
        gone = [k for k in keys if k in self.flows]
        for key in gone:
            self._forget_owner(key)
            del self.flows[key]
        return gone

    def unregister(self, job: str, flows: tuple[FlowKey, ...] = (), uid: int | None = None) -> list[FlowKey]:
        """Remove the given flows of ``job`` (all of its flows when ``flows`` is empty); return those removed.

        Raises ProtocolError, changing nothing, if a named flow belongs to another job, or (``uid`` given, not
        root) was registered by another user.
        """
        if not flows:
            gone = [k for k, e in self.flows.items() if e.job == job]
        else:
            gone = []
            for key in flows:
                cur = self.flows.get(key)
                if cur is not None and cur.job != job:
                    raise ProtocolError("conflict", f"flow {key} is registered by job {cur.job!r}")
                if cur is not None:
                    gone.append(key)
        if uid not in (None, 0):
            for key in gone:
                if self.flows[key].uid not in (None, uid):
                    raise ProtocolError("forbidden", f"flow {key} was registered by another user")
        for key in gone:
            self._forget_owner(key)
            del self.flows[key]
        return gone

    def by_level(self) -> dict[int, list[FlowKey]]:
        """Flows grouped by level (every level present, possibly empty)."""
        out: dict[int, list[FlowKey]] = {lvl: [] for lvl in range(self.levels)}
        for key, entry in self.flows.items():
            out[entry.level].append(key)
        return out

    def jobs(self) -> dict[str, int]:
        """Number of flows per job."""
        out: dict[str, int] = {}
        for entry in self.flows.values():
            out[entry.job] = out.get(entry.job, 0) + 1
        return out
