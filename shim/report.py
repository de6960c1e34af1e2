"""The shim's communication-time reports: sends a process's per-level all-reduce counters to the local agent,
which exports them as ``tensorlane_job_allreduce_seconds_total{training_job,level}`` and friends (docs/metrics.md).

Reports are cumulative (counts, bytes and seconds since the process attached) and carry a random ``session``
id, so a lost or repeated report changes nothing and several processes of one job on a host add up. Sending
happens in a daemon thread every ``interval_s``, at once when the agent link has registered the flows with a
new (restarted) agent, and once more at ``close()``; each attempt uses a fresh
connection with a short timeout. An absent agent is silent (the agent link already warns once), an agent that
does not know the ``report`` op (older) is not asked again. No torch here.

``shim.attach`` and ``shim.comm_state`` start one themselves (``attach(..., report_interval_s=5.0)``);
``start`` returns that one for a handle that has it, so that no process reports its counters twice.

Usage: ``reporter = shim.report.start(state)`` for a state made without one (``handle.reporter`` otherwise)
"""
from __future__ import annotations

import logging
import os
import threading
import uuid

from tensorlane.client import AgentClient, AgentError, AgentUnavailable

log = logging.getLogger("tensorlane.shim")
# the job-order inputs a report may carry, and their types (the agent takes those its job policy orders by)
INTERVAL_S = 5.0  # how often a reporter sends, unless ``attach(report_interval_s=)`` says otherwise
INPUTS = {"step_bytes": int, "compute_s": float, "tail_bytes": int, "window_start": float, "window_steps": int}


class Reporter:
    """Sends ``stats()`` (a list of ``{level, allreduces, bytes, comm_s}``) as op ``report`` for ``job``, with
    ``step_bytes()`` (the bytes of one training step's all-reduces), ``compute_s()`` (a step's compute seconds,
    agreed over the job's ranks), ``tail_bytes()`` (the bytes of a step's last bucket), ``window_start()`` and
    ``window_steps()`` (the wall-clock end of the step that begins the window of the last steps, and the steps
    ended since: ``shim.compute.StepWindow``) when given (0 or None: not known yet). An agent that refuses those
    fields (older than them) gets the counters alone from then on. ``stats()`` is read before the inputs of each
    report (``start`` reads the handle's stats once for both). ``step_ended()`` reports at once while the
    agent ranks jobs by their window (job policy ``slowdown``), and does nothing once the agent has said it does
    not. ``agent_levels()`` (the agent link's, from ``hello``): the agent's number of levels, where the
    counters of the shim's levels beyond them are added to its last level's, as their flows are registered there
    (None: unknown, sent as they are)."""

    def __init__(self, stats, socket_path: str, job: str, interval_s: float = INTERVAL_S, timeout_s: float = 0.25,
                 session: str | None = None, start: bool = True, step_bytes=None, compute_s=None,
                 tail_bytes=None, window_start=None, window_steps=None, agent_levels=None):
        self.stats = stats
        self.agent_levels = agent_levels
        self.inputs = {name: (read, INPUTS[name]) for name, read in (
            ("step_bytes", step_bytes), ("compute_s", compute_s), ("tail_bytes", tail_bytes),
            ("window_start", window_start), ("window_steps", window_steps))}
        self.per_step = window_start is not None  # until the agent says it takes no window_start
        self.counters_only = False  # the agent refused the inputs' fields
        self.socket_path = socket_path
        self.job = job
        self.timeout_s = timeout_s
        self.session = session or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.counters = {"sent": 0, "failures": 0, "refusals": 0}
        self.last_error = ""
        self.unsupported = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="tensorlane-report",
                                            daemon=True)
            self._thread.start()

    def report(self) -> bool:
        """Send one report now (bounded by ``timeout_s`` per step); never raises. Returns whether it was taken."""
        with self._lock:
            if self.unsupported:
                return False
            try:
                levels = fold_levels([{"level": int(s["level"]), "allreduces": int(s["allreduces"]),
                                       "bytes": int(s["bytes"]), "comm_s": float(s["comm_s"])} for s in self.stats()],
                                     self.agent_levels() if self.agent_levels is not None else None)
            except Exception as exc:  # noqa: BLE001 - reporting must never break training
                self.counters["failures"] += 1
                self.last_error = f"reading the shim's counters: {type(exc).__name__}: {exc}"
                return False
            if not levels:
                return False
            extra = {} if self.counters_only else self._inputs()
            try:
                with AgentClient(self.socket_path, timeout=self.timeout_s) as agent:
                    try:
                        reply = agent.request("report", job=self.job, session=self.session, levels=levels, **extra)
                        if str(reply.get("window_start", "taken")).startswith("unused"):
                            self.per_step = False  # the agent's policy does not rank by it: the interval will do
                    except AgentError as exc:
                        if not (extra and exc.code == "bad_request" and "unknown field" in str(exc)):
                            raise
                        self.counters_only, self.per_step = True, False  # an older agent: the counters alone
                        log.info("tensorlane: the agent at %s takes no %s: %s", self.socket_path,
                                 " or ".join(extra), exc)
                        agent.request("report", job=self.job, session=self.session, levels=levels)
            except AgentError as exc:
                self.counters["refusals"] += 1
                self.last_error = str(exc)
                if exc.code == "unknown_op":
                    self.unsupported = True
                    log.info("tensorlane: the agent at %s takes no communication-time reports", self.socket_path)
                return False
            except (AgentUnavailable, OSError, ValueError) as exc:
                self.counters["failures"] += 1
                self.last_error = str(exc)
                return False
            self.counters["sent"] += 1
            return True

    def _inputs(self) -> dict:
        """The job-order inputs known now (``step_bytes``, ``compute_s``), those above 0; never raises."""
        out = {}
        for name, (read, kind) in self.inputs.items():
            try:
                value = kind(read() or 0) if read is not None else 0
            except Exception:  # noqa: BLE001 - reporting must never break training
                value = 0
            if value > 0:
                out[name] = value
        return out

    def step_ended(self) -> None:
        """A training step ended: report now if the agent ranks jobs by their last steps (``slowdown``)."""
        if self.per_step:
            self._wake.set()

    def wake(self) -> None:
        """Report now rather than at the next interval (the step's bytes or compute time changed); never blocks."""
        self._wake.set()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.report()

    def stop(self) -> None:
        """Stop the thread without a last report (its job's flows are gone); never blocks. Usage: ``r.stop()``"""
        self._stop.set()
        self._wake.set()

    def close(self) -> bool:
        """Stop the thread and send a last report (bounded). Idempotent; returns whether the last one was taken."""
        first = not self._stop.is_set()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s * 4 + 1)
        return self.report() if first else False


def fold_levels(levels: list[dict], agent_levels: int | None) -> list[dict]:
    """``levels`` (``{level, allreduces, bytes, comm_s}``, cumulative) with those at or beyond ``agent_levels`` added
    into level ``agent_levels - 1``, where the agent link registers their flows (None: unchanged)."""
    if not agent_levels:
        return levels
    out: dict[int, dict] = {}
    for s in levels:
        lvl = min(s["level"], agent_levels - 1)
        if lvl in out:
            into = out[lvl]
            out[lvl] = {"level": lvl, "allreduces": into["allreduces"] + s["allreduces"],
                        "bytes": into["bytes"] + s["bytes"], "comm_s": into["comm_s"] + s["comm_s"]}
        else:
            out[lvl] = dict(s, level=lvl)
    return [out[lvl] for lvl in sorted(out)]


def start(handle, interval_s: float = INTERVAL_S, timeout_s: float = 0.25) -> Reporter | None:
    """A Reporter for a ``shim.attach`` handle (its agent socket and job id); None when the shim is disabled. A
    handle whose shim already reports (``attach`` starts a reporter) gets that one: two would count twice."""
    if getattr(handle, "disabled", False) or getattr(handle, "link", None) is None:
        return None
    existing = getattr(handle, "reporter", None)
    if existing is not None:
        return existing
    link = handle.link
    seen: dict = {}  # the handle's stats for the report under way: read once, with the counters (read first)

    def levels() -> list:
        seen.clear()
        seen.update(handle.stats())
        return seen["levels"]

    inputs = {name: (lambda name=name: seen.get(name)) for name in INPUTS}
    reporter = Reporter(levels, link.socket_path, link.job, interval_s=interval_s, timeout_s=timeout_s,
                        agent_levels=lambda: link.agent_levels, **inputs)
    link.on_registered = reporter.wake  # a new agent (restarted) gets the job's counters and inputs at once
    return reporter
