"""The shape every metrics source has, and the per-scrape context the sources share.

A *source* is one small class per source of data (like node_exporter's collectors): ``name`` (the ``collector``
label of ``tensorlane_scrape_collector_success``) and ``collect(scrape)``, which reads its data at that moment
and yields prometheus_client metric families. No source runs a thread or polls: everything is read when
Prometheus scrapes. A *Scrape* is made per request to /metrics and caches what several sources read (the
kernel's class counters), so one scrape reads the kernel once.

Threads: sources run in the metrics HTTP server's threads while the agent's main thread changes ``api.table``;
they copy what they iterate (``list(d.items())``) and never use the main thread's netlink or nftables handles.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric
from pyroute2 import IPRoute

from tensorlane.agent.kernel import tcstats
from tensorlane.agent.kernel.qdisc import fmt_handle
from tensorlane.agent.peers import ordinary_uid

# the training_job series a source keeps at most; the others are folded into the job OTHER (flows, job reports, the
# job policy: one cap, so that the three agree on which jobs have series of their own)
MAX_JOBS = 32
OTHER = "_other"
# of those, the jobs of one user that is neither root nor in trusted_users: one user's 32 jobs (max_jobs_per_user)
# with more flows than the others' took every series of tensorlane_registered_flows, every other user's job summed
# as _other (until 2026-11-28)
MAX_JOBS_PER_USER = 8


def kept_jobs(ranked: Iterable[str], users_of: Callable[[str], set], max_jobs: int = MAX_JOBS,
              per_user: int = MAX_JOBS_PER_USER) -> set[str]:
    """The jobs of ``ranked`` (best first) that keep series of their own: the first ``max_jobs``, skipping a job of
    a user (``users_of(job)``: the uids that hold it that count, none for root's or a trusted user's) once that user
    has ``per_user`` kept."""
    kept: set[str] = set()
    held: dict = {}
    for job in ranked:
        if len(kept) >= max_jobs:
            break
        users = users_of(job)
        if any(held.get(u, 0) >= per_user for u in users):
            continue
        for u in users:
            held[u] = held.get(u, 0) + 1
        kept.add(job)
    return kept


def capped_users(api, entries: Iterable | None = None) -> Callable[[str], set]:
    """``users_of`` for ``kept_jobs`` from the flow table's ``entries`` (a copy: the main thread changes the table;
    default ``api``'s now): a job's users other than root, the agent and ``trusted_users`` (not capped per user)."""
    trusted = api.policy.trusted_users
    users: dict[str, set] = {}
    for e in list(api.table.flows.values()) if entries is None else entries:
        if ordinary_uid(e.uid, trusted):
            users.setdefault(e.job, set()).add(e.uid)
    return lambda job: users.get(job, set())


def link_rate_bps(api, device) -> int | None:
    """The rate the agent shapes ``device`` (a reconcile Device) to (htb), else its configured or driver-reported
    link rate; None if unknown."""
    rate = getattr(device.backend, "rate", None) or api.cfg.rate_of(device.name, device.serves)
    if rate:
        return int(rate)
    from tensorlane.agent.kernel import detect

    return detect.interface_speed_bps(device.name, device.kind)


def class_label(spec) -> str:
    """The ``class`` label of a leaf: the tc class id as tc prints it (``7a1:10``)."""
    return fmt_handle(spec.classid)


def level_label(spec) -> str:
    """The ``level`` label of a leaf: its level, or ``default`` for the default class."""
    return "default" if spec.level is None else str(spec.level)


class Scrape:
    """What one scrape reads, read at most once: ``classes(device)`` (kernel counters per class id), ``leaves()``.

    ``device`` is the label of the agent-wide series (flows, jobs, marks, reconciling): the managed interfaces'
    names joined by "," (one interface: its name). Per-device series are labelled with each queue device.
    """

    def __init__(self, api):
        """A scrape of ``api``'s devices, at this moment; nothing is read yet."""
        self.api = api
        self.device = ",".join(api.rec.interfaces)
        self.devices = list(api.rec.devices)
        self.monotonic = time.monotonic()
        self._classes: dict[str, dict[int, dict[str, int]]] | None = None
        self._leaves: list | None = None

    def leaves(self) -> list:
        """The backend's leaf classes (ClassSpec: level, classid, prio), most urgent first (the same on every
        device)."""
        if self._leaves is None:
            self._leaves = sorted(self.api.rec.backend.leaves(), key=lambda s: s.prio)
        return self._leaves

    def classes(self, device: str) -> dict[int, dict[str, int]]:
        """``{classid: {bytes, packets, drops, overlimits, requeues, backlog_bytes, backlog_packets}}`` of the
        queue device named ``device``.

        A fresh netlink socket in this thread (pyroute2's sync IPRoute is not shared across threads); the
        agent runs in the host's network namespace, so this is the managed devices' namespace.
        """
        if self._classes is None:
            with IPRoute() as ipr:
                self._classes = {d.name: tcstats.class_stats(ipr, d.index) for d in self.devices}
        return self._classes.get(device, {})


def without_created(instrument) -> Iterable[Metric]:
    """The families of a prometheus_client instrument (Counter, Histogram) without their ``_created`` samples,
    which the text format would export as one more gauge series each."""
    for fam in instrument.collect():
        fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
        yield fam


class Source:
    """Base of every metrics source: override ``name`` and ``collect``."""

    name = "source"

    def __init__(self, api):
        """A source reading ``api`` (the agent's Api: config, table, reconciler)."""
        self.api = api

    def collect(self, scrape: Scrape) -> Iterable[Metric]:  # pragma: no cover - abstract
        """The source's metric families, read now (through ``scrape``'s shared readings)."""
        raise NotImplementedError
