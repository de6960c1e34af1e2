"""Communication time per training job and level, as reported by the shims on this host (API op ``report``).

A shim process (``shim/report.py``) sends its cumulative per-level counters (all-reduce pieces completed, their
bytes, and the seconds from launch to completion summed over pieces) with a ``session`` id of its own. The agent
adds the increase since that session's previous report to per-(job, level) totals, so the exported counters
only grow, whatever the number of processes, their restarts, or a report sent twice. A session whose counters
went down (the process restarted with the same id) counts from zero.

- ``tensorlane_job_allreduces_total{training_job,level}``
- ``tensorlane_job_allreduce_bytes_total{training_job,level}``
- ``tensorlane_job_allreduce_seconds_total{training_job,level}``: rate(seconds) / rate(allreduces) is the mean
  time of one all-reduce piece; pieces of different levels overlap, so seconds can grow faster than wall time.
- ``tensorlane_job_step_bytes{training_job}``: the bytes one training step all-reduces, as last reported (a gauge;
  only for jobs whose shims send it).
- ``tensorlane_job_step_compute_seconds{training_job}``: the compute seconds of one training step (the step less the
  time its training thread waited for the shim's all-reduces, the median of a window of steps, agreed over the job's
  ranks), as last reported (a gauge; only for jobs whose shims send it).
- ``tensorlane_reporting_jobs``: jobs with a series now.

Cardinality: at most ``MAX_JOBS`` jobs have series (``MAX_JOBS_PER_USER`` started by one user that is not root);
reports of further jobs are added to ``training_job="_other"``. One such user keeps at most
``MAX_SESSIONS_PER_USER`` sessions. A job (and its sessions) with no report for ``JOB_TTL_S`` seconds is forgotten and
its series disappear. At most ``MAX_SESSIONS`` sessions are remembered (least recently reporting dropped).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import MAX_JOBS, MAX_JOBS_PER_USER, OTHER, Source

MAX_SESSIONS = 4096
# of one user that is not root: sessions (its least recent go first), so that no user evicts another user's sessions
# (whose next report would then count twice); its series: base.MAX_JOBS_PER_USER
MAX_SESSIONS_PER_USER = 512
JOB_TTL_S = 900.0
FIELDS = ("allreduces", "bytes", "comm_s")


class JobReports:
    """Per-(job, level) totals from cumulative per-session reports. Thread-safe (API thread writes, scrapes read).

    Usage: ``r = JobReports(); r.add("job-a", "s1", {0: (10, 4096, 0.5)}); r.snapshot()``
    """

    def __init__(self, max_jobs: int = MAX_JOBS, max_sessions: int = MAX_SESSIONS, ttl_s: float = JOB_TTL_S,
                 clock=time.monotonic):
        """Empty totals, with the bounds on jobs and sessions, the jobs' time to live and a clock."""
        self.max_jobs, self.max_sessions, self.ttl_s, self.clock = max_jobs, max_sessions, ttl_s, clock
        self._lock = threading.Lock()
        self._totals: dict[str, dict[int, list]] = {}  # job -> level -> [allreduces, bytes, comm_s]
        self._seen: dict[str, float] = {}  # job -> last report (monotonic)
        self._step: dict[str, int] = {}  # job -> bytes per training step, as last reported
        self._compute: dict[str, float] = {}  # job -> compute seconds per training step, as last reported
        self._sessions: OrderedDict[tuple[str, str], dict[int, tuple]] = OrderedDict()  # LRU
        self._started_by: dict[str, int] = {}  # job -> the user (not root) whose report made its series
        self._session_user: dict[tuple[str, str], int] = {}  # session -> its user (not root)

    def add(self, job: str, session: str, levels: dict[int, tuple[int, int, float]],
            step_bytes: int | None = None, compute_s: float | None = None, user: int | None = None) -> str:
        """Fold one report in (and its ``step_bytes`` and ``compute_s``, when sent); return the job it was counted
        under (``job`` or ``_other``). ``user``: the reporting user's uid when it is not root (its limits)."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            room = len(self._real_jobs()) < self.max_jobs and (
                user is None or sum(1 for u in self._started_by.values() if u == user) < MAX_JOBS_PER_USER)
            target = job if job in self._totals or room else OTHER
            if target == job and job not in self._totals and user is not None:
                self._started_by[job] = user
            if user is not None and (job, session) not in self._sessions:
                mine = [k for k in self._sessions if self._session_user.get(k) == user]  # least recent first
                for key in mine[:max(0, len(mine) - MAX_SESSIONS_PER_USER + 1)]:  # its own least recent go first
                    self._sessions.pop(key, None)
                    del self._session_user[key]
                self._session_user[(job, session)] = user
            last = self._sessions.pop((job, session), {})
            totals = self._totals.setdefault(target, {})
            for level, cur in levels.items():
                prev = last.get(level, (0, 0, 0.0))
                reset = any(c < p for c, p in zip(cur, prev, strict=True))
                delta = cur if reset else tuple(c - p for c, p in zip(cur, prev, strict=True))
                acc = totals.setdefault(level, [0, 0, 0.0])
                for i, d in enumerate(delta):
                    acc[i] += d
                last[level] = tuple(cur)
            self._sessions[(job, session)] = last
            while len(self._sessions) > self.max_sessions:
                gone, _ = self._sessions.popitem(last=False)
                self._session_user.pop(gone, None)
            self._seen[target] = now
            if step_bytes is not None and target != OTHER:
                self._step[target] = step_bytes
            if compute_s is not None and target != OTHER:
                self._compute[target] = compute_s
            return target

    def _real_jobs(self) -> list[str]:
        """The jobs with their own series (not ``_other``)."""
        return [j for j in self._totals if j != OTHER]

    def _expire(self, now: float) -> None:
        """Forget the jobs (and their sessions) without a report for ``ttl_s``."""
        for job in [j for j, t in self._seen.items() if now - t > self.ttl_s]:
            self._seen.pop(job, None)
            self._totals.pop(job, None)
            self._step.pop(job, None)
            self._compute.pop(job, None)
            self._started_by.pop(job, None)
            for key in [k for k in self._sessions if k[0] == job]:
                del self._sessions[key]
                self._session_user.pop(key, None)

    def snapshot(self) -> dict[str, dict[int, tuple[int, int, float]]]:
        """``{job: {level: (allreduces, bytes, comm_s)}}`` of the jobs with series now."""
        with self._lock:
            self._expire(self.clock())
            return {job: {lvl: tuple(v) for lvl, v in levels.items()} for job, levels in self._totals.items()}

    def step_bytes(self) -> dict[str, int]:
        """``{job: bytes per training step}`` of the jobs with series now whose shims sent it."""
        with self._lock:
            self._expire(self.clock())
            return dict(self._step)

    def compute_seconds(self) -> dict[str, float]:
        """``{job: compute seconds per training step}`` of the jobs with series now whose shims sent it."""
        with self._lock:
            self._expire(self.clock())
            return dict(self._compute)


class JobsSource(Source):
    """The shims' reported communication time, from ``api.reports`` (a JobReports)."""

    name = "jobs"

    def collect(self, scrape):
        """Per-(job, level) counters of the jobs with series now, and how many jobs."""
        reports = getattr(self.api, "reports", None)
        snap = reports.snapshot() if reports is not None else {}
        fams = [m.counter() for m in (names.JOB_ALLREDUCES, names.JOB_ALLREDUCE_BYTES, names.JOB_ALLREDUCE_SECONDS)]
        for job, levels in sorted(snap.items()):
            for level, values in sorted(levels.items()):
                for fam, value in zip(fams, values, strict=True):  # FIELDS: allreduces, bytes, comm_s
                    fam.add_metric([job, str(level)], value)
        yield from fams
        step = names.JOB_STEP_BYTES.gauge()
        for job, value in sorted((reports.step_bytes() if reports is not None else {}).items()):
            step.add_metric([job], value)
        yield step
        compute = names.JOB_STEP_COMPUTE_SECONDS.gauge()
        for job, value in sorted((reports.compute_seconds() if reports is not None else {}).items()):
            compute.add_metric([job], value)
        yield compute
        yield names.REPORTING_JOBS.gauge(len(snap))
