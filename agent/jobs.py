"""The agent's job policy: the effective level of every registered flow from its job's place in the job order.

The FlowTable keeps the level each client asked for; this module derives the level the kernel gets (docs/jobs.md):

- ``job_policy = "none"`` (default): the level asked for, nothing else;
- ``"static"``: jobs ordered by ``job_priority`` (TensorLights' static priority);
- ``"rotate"``: a fresh order every ``rotate_epoch_s`` of wall-clock time (TensorLights' rotation, by
  ``policies.jobs.hashed_rotation_order``);
- ``"alternate"``: like ``"rotate"``, but every two jobs swap places every epoch pair, in strict turn
  (``policies.jobs.alternating_rotation_order``);
- ``"intensity"``: by ``job_intensity``, most GPU-intensive first (Crux);
- ``"shortest"``: by the bytes one training step all-reduces, as the jobs' own shims report them (``step_bytes``
  of op ``report``), fewest first: the job whose communication phase is shortest goes first.
- ``"measured_intensity"``: by Crux's GPU intensity measured by the jobs themselves: the compute seconds of a
  training step (``compute_s`` of op ``report``, agreed over the job's ranks) per byte it all-reduces
  (``step_bytes``), most intense first.
- ``"slowdown"``: the job whose last steps ran furthest behind its ideal step first (``window_start`` and
  ``window_steps`` of op ``report``; the ideal step is ``compute_s`` plus ``tail_bytes`` at the link's rate); the
  order moves with the clock, so the server re-ranks every ``job_sample_s`` (``rerank_wanted``).

Under a policy, ``job_share`` of the link is guaranteed to the jobs in equal parts (``policies.jobs.job_shares``,
each part on its band's most urgent level; ``shares``), so that an order never leaves a job with less than its part
while it has bytes to send; 0 keeps the order strict (each level only ``min_share``). With three jobs or more and
``job_share_among = "sending"`` (the default) the parts follow the jobs that are sending: the server samples the
classes' backlog every ``job_sample_s`` (``observe``) and each of ``k`` jobs seen backlogged within ``job_hold_s``
(0: at the last sample) gets ``job_share / k``, as FIFO would give each about ``1/k`` (jobs that share a band count
once: the agent sees one queue); with two jobs the parts are the same either way. With ``job_share = "auto"`` the
server samples with two jobs or more, and the part is ``AUTO_SHARES[0]`` while the jobs leave the link idle at
times and ``AUTO_SHARES[1]`` while they keep it saturated (``policies.jobs.link_saturated`` over the last
``AUTO_WINDOW_S`` of samples). A part is one job's for root's, the agent's and ``trusted_users``' jobs; the jobs
of one ordinary user hold one part in all, and so do those of a tier limited by ``level_limits``
(``policies.jobs.tier_weights``), so that no user takes more of ``job_share`` by starting jobs.

The jobs this agent sees (those with flows in its table) get contiguous bands of levels in that order, most urgent
first (``policies.jobs.tiered_bands``; one ordinary user's jobs weigh one job in the cut, as in the parts), and a
flow's effective level is the level its client asked for compressed into its job's band, never above its user's
``level_limits`` (``policies.jobs.banded_level``). The order is a pure
function of the job ids, the wall-clock epoch number, the config and (``shortest``, ``measured_intensity``) the
jobs' reported inputs, which are the same on every rank of a job: agents need no coordination, and agents with
different job sets still agree on the relative order of every two jobs they share.

The scheduler caches the order and bands it last computed (derived state, never edited by anything else):
``update(table)`` recomputes them when the set of jobs or the epoch changed and returns the flows whose effective
level changed, which the caller pushes to the kernel in one transaction (agent/api.py; the server calls it at each
epoch boundary). Usage::

    sched = JobScheduler(cfg); table.level_of = sched.level_of
    moved = sched.update(table)          # after every change of the table, and at epoch boundaries
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque

from tensorlane.agent.peers import ordinary_uid
from tensorlane.agent.state import job_id_base
from tensorlane.flows import FlowKey
from tensorlane.policies.jobs import (
    AUTO_SHARES,
    AUTO_WINDOW_S,
    REPORTED,
    ROTATING,
    TIMED,
    banded_level,
    job_order,
    job_shares,
    link_saturated,
    rotation_epoch,
    tier_weights,
    tiered_bands,
)

log = logging.getLogger("tensorlane.jobs")


class JobScheduler:
    """Effective levels under the configured job policy; ``clock`` is wall-clock time (agents compare epochs)."""

    def __init__(self, cfg, clock=time.time, guarantees: bool = True, budget: float = 1.0,
                 link_bps: float | None = None):
        """``guarantees``: whether the backend gives classes guaranteed rates (htb; prio has none: no parts to
        follow, nothing sampled); ``budget``: the share of the link the parts may take in all
        (``Reconciler.share_budget``); ``link_bps``: the link's rate (``slowdown``'s ideal step: a step's last bucket
        at this rate; None: unknown, its compute time alone)."""
        self.policy = getattr(cfg, "job_policy", "none")
        self.levels = cfg.levels
        self.epoch_s = float(getattr(cfg, "rotate_epoch_s", 20.0))
        self.priority = dict(getattr(cfg, "job_priority", {}) or {})
        self.intensity = dict(getattr(cfg, "job_intensity", {}) or {})
        self.inputs = REPORTED.get(self.policy, ())  # what the order takes from the shims' reports
        self.timed = self.policy in TIMED  # the order moves with the clock: re-ranked every job_sample_s
        self.link_bps = link_bps
        self.reported: dict[str, dict[str, float]] = {}  # job -> {input: value} its shims reported (those inputs)
        configured = getattr(cfg, "job_share", 0.0)
        self.share_auto = configured == "auto"  # the part follows whether the jobs saturate the link
        self.job_share = AUTO_SHARES[0] if self.share_auto else float(configured)  # the part in force
        self.share_among = getattr(cfg, "job_share_among", "sending")
        self.sample_s = float(cfg.job_sample_s)  # how often the server samples the classes' backlog
        self.busy: deque[bool] = deque(maxlen=max(1, round(AUTO_WINDOW_S / self.sample_s)))  # "auto": the samples
        self.saturated = False  # "auto": the jobs keep the link saturated (the part is AUTO_SHARES[1])
        self.saturated_since: float | None = None  # monotonic time it became so (status: seconds saturated)
        self.saturated_s = 0.0  # seconds saturated before saturated_since (status)
        self.saturation_changes = 0  # how many times "auto" changed the part (status)
        self.hold_s = float(cfg.job_hold_s)  # a job counts as sending this long after its band's last backlog
        self.guarantees = guarantees
        self.budget = budget
        self.clock = clock
        self.enabled = self.policy != "none"
        self.jobs: frozenset[str] = frozenset()
        self.epoch: int | None = None
        self.order: tuple[str, ...] = ()
        self.keys: tuple = ()  # the reported inputs the order was computed from: ((job, ((input, value), ...)), ...)
        self.bands: dict[str, tuple[int, int]] = {}
        self.floors: dict[str, int] = {}  # job -> the most urgent level its users may ask for (its tier of bands)
        self.trusted = frozenset(getattr(cfg, "trusted_users", ()) or ())
        self.owners: dict[str, tuple] = {}  # job -> its ordinary users (not root, trusted): their jobs share a part
        self.weights: dict[str, float] = {}  # job -> its weight among the parts (policies.jobs.tier_weights)
        self.shares: dict[int, float] = {}  # level -> guaranteed share of the link (job_share among the jobs)
        self.backlogged_at: dict[str, float] = {}  # job -> when a sample last found it sending (monotonic)
        self.sending: frozenset[str] = frozenset()  # the jobs seen backlogged within hold_s (their parts: 1/k)
        self.share_changes = 0  # how many times the sending jobs changed the parts (status)
        self.changes = 0  # how many times the order or bands changed (status)

    # -- the derived level ------------------------------------------------------------------------------------
    def level_of(self, entry) -> int:
        """Effective level of a FlowEntry under the current bands (its requested level when disabled)."""
        band = self.bands.get(entry.job) if self.enabled else None
        if band is None:
            return entry.level
        return banded_level(band, entry.level, self.levels, entry.floor)

    def epoch_now(self, now: float | None = None) -> int | None:
        """The rotation epoch at wall-clock ``now`` (None unless the policy rotates)."""
        if self.policy not in ROTATING:
            return None
        return rotation_epoch(self.clock() if now is None else now, self.epoch_s)

    def seconds_to_next_epoch(self, now: float | None = None) -> float | None:
        """Seconds until the next epoch boundary (None unless the policy rotates)."""
        if self.policy not in ROTATING:
            return None
        now = self.clock() if now is None else now
        return max(0.0, (math.floor(now / self.epoch_s) + 1) * self.epoch_s - now)

    def epoch_due(self, now: float | None = None) -> bool:
        """Whether the epoch changed since the last ``update`` (cheap: one clock read)."""
        return self.policy in ROTATING and self.epoch_now(now) != self.epoch

    # -- reported inputs ----------------------------------------------------------------------------------------
    def report(self, job: str, **values) -> bool:
        """Take a job's reported inputs (``step_bytes=``, ``compute_s=``, ``tail_bytes=``, ``window_start=``,
        ``window_steps=``; None: not in this report) that the policy orders by; returns whether the order's input
        changed, i.e. whether ``update`` must run. Inputs the policy does not use are ignored."""
        taken = {k: v for k, v in values.items() if k in self.inputs and v is not None}
        now = self.reported.get(job, {})
        if not taken or all(now.get(k) == v for k, v in taken.items()):
            return False
        self.reported[job] = now | taken
        return True

    def _keys(self, jobs: frozenset[str]) -> tuple:
        """The reported inputs of the jobs present (empty unless the policy takes any)."""
        return tuple(sorted((j, tuple(sorted(self.reported[j].items()))) for j in jobs if j in self.reported))

    # -- recomputation ----------------------------------------------------------------------------------------
    def update(self, table, now: float | None = None) -> list[FlowKey]:
        """Recompute the order and bands if the jobs in ``table`` or the epoch changed; return the flows (of jobs
        that were already here) whose effective level changed -- they are in the kernel at their old level and
        must be moved. Flows of jobs new to this agent are not returned: the caller adds them anyway."""
        if not self.enabled:
            return []
        jobs = frozenset(table.by_job)
        epoch = self.epoch_now(now)
        for gone in [j for j in self.reported if j not in jobs]:  # bounded by the jobs present
            del self.reported[gone]
        keys = self._keys(jobs)
        floors = {job: table.job_floor(job) for job in jobs}
        owners = self._owners(table, jobs)
        if (jobs == self.jobs and epoch == self.epoch and keys == self.keys and floors == self.floors
                and owners == self.owners and self.bands and not self.timed):
            return []
        now_s = 0.0 if epoch is None else epoch * self.epoch_s
        if self.timed:
            now_s = self.clock() if now is None else now
        order, ranks = job_order(self.policy, sorted(jobs), now_s=now_s, epoch_s=self.epoch_s,
                                 **self._tables(jobs), link_bps=self.link_bps,
                                 **{name: self.inputs_of(name, keys) for name in self.inputs})
        bands = tiered_bands(order, self.levels, ranks, floors, owners)
        old = self.bands
        shifted: list[FlowKey] = []
        for job, band in bands.items():
            was = old.get(job)
            if was is None or was == band:
                continue
            for key in table.by_job.get(job, ()):
                e = table.flows[key]
                if banded_level(was, e.level, self.levels, e.floor) != banded_level(band, e.level, self.levels,
                                                                                   e.floor):
                    shifted.append(key)
        if order != self.order or bands != old:
            self.changes += 1
            if epoch != self.epoch and epoch is not None:
                log.info("epoch %d: job order %s", epoch, ", ".join(order) or "(no jobs)")
        self.jobs, self.epoch, self.order, self.bands, self.keys = jobs, epoch, order, bands, keys
        self.floors, self.owners, self.weights = floors, owners, tier_weights(floors, owners)
        self.sending = self.sending & jobs if self.follows_sending() else frozenset()
        if not self.sending:
            self.backlogged_at.clear()
        if len(bands) < 2:  # "auto": the samples of other jobs say nothing of the next ones
            self.busy.clear()
            self._saturate(False, time.monotonic())
        self.shares = job_shares(bands, self.job_share, self.sending, self.budget, self.weights)
        return sorted(shifted)

    def _owners(self, table, jobs) -> dict[str, tuple]:
        """The jobs held by ordinary users alone (neither root, the agent nor ``trusted_users``): job -> those
        users' uids. One user's jobs share one part of ``job_share`` (``policies.jobs.tier_weights``)."""
        out = {}
        for job in jobs:
            users = table.job_users(job)
            if users and all(ordinary_uid(u, self.trusted) for u in users):
                out[job] = tuple(sorted(users))
        return out

    def _tables(self, jobs) -> dict[str, dict]:
        """``job_priority`` and ``job_intensity`` for ``jobs``: a user's own job under an id another user holds
        (``state.user_job_id``) has the id's entries, as the job that holds the id does."""
        return {name: {job: table[job_id_base(job)] for job in jobs if job_id_base(job) in table}
                for name, table in (("priority", self.priority), ("intensity", self.intensity))}

    def rank_check(self) -> None:
        """Rank the jobs present with the inputs reported now, changing nothing: raises ``ValueError`` where the
        policy cannot rank them (``Api`` refuses such a report before it reorders anything)."""
        keys = self._keys(self.jobs)
        job_order(self.policy, sorted(self.jobs), now_s=self.clock(), epoch_s=self.epoch_s, **self._tables(self.jobs),
                  link_bps=self.link_bps,
                  **{name: self.inputs_of(name, keys) for name in self.inputs})

    def rerank_wanted(self) -> bool:
        """Whether the order must be recomputed every ``job_sample_s`` although nothing was reported: a policy
        whose order moves with the clock (``slowdown``) and two jobs or more."""
        return self.timed and len(self.bands) >= 2

    # -- the parts of the sending jobs ------------------------------------------------------------------------
    def follows_sending(self) -> bool:
        """Whether the parts follow the sending jobs now: a policy, a backend with guarantees, ``job_share > 0``,
        ``job_share_among = "sending"`` and three jobs or more (with two, ``1/k`` and ``1/n`` are the same part
        while both send)."""
        return (self.enabled and self.guarantees and self.job_share > 0 and self.share_among == "sending"
                and len(self.bands) >= 3)

    def samples_wanted(self) -> bool:
        """Whether the server samples the classes' backlog every ``job_sample_s``: the parts follow the sending
        jobs, or ``job_share = "auto"`` with two jobs or more and a backend with guarantees."""
        return self.follows_sending() or (self.enabled and self.guarantees and self.share_auto
                                          and len(self.bands) >= 2)

    def _saturate(self, saturated: bool, now: float) -> bool:
        """Set whether the jobs saturate the link (``"auto"``) and the part that follows; whether it changed."""
        if saturated == self.saturated:
            return False
        if saturated:
            self.saturated_since = now
        elif self.saturated_since is not None:
            self.saturated_s += max(0.0, now - self.saturated_since)
            self.saturated_since = None
        self.saturated = saturated
        self.job_share = min(AUTO_SHARES[saturated], self.budget)
        self.saturation_changes += 1
        log.info("job_share auto: the jobs %s the link: parts of %g", "saturate" if saturated else "leave room on",
                 self.job_share)
        return True

    def link_busy(self) -> float | None:
        """``"auto"``: the share of the last samples in which some job's class had bytes queued (None: none yet).
        Read on a copy: the metrics read it from their own thread while the server appends."""
        busy = list(self.busy)
        return sum(busy) / len(busy) if busy else None

    def observe(self, backlogged: set[int], now: float) -> bool:
        """Take one sample: ``backlogged`` are the levels whose class had packets queued on some device at
        monotonic time ``now``. Under ``job_share = "auto"`` the sample joins the window that tells whether the
        jobs saturate the link (every level is some job's). A job is found sending when one of its band's levels is
        backlogged (it wants more than it gets), and counts as sending while it was found so within ``hold_s`` (0:
        at this sample). Returns whether that changed ``shares`` (the caller applies them)."""
        resized = False
        if self.share_auto:
            self.busy.append(bool(backlogged))
            resized = self._saturate(link_saturated(self.busy, self.saturated, self.busy.maxlen), now)
        if not self.follows_sending():  # (update() already emptied the sending jobs then)
            return resized and self._reshare()
        for job, (first, width) in self.bands.items():
            if any(first <= lvl < first + width for lvl in backlogged):
                self.backlogged_at[job] = now
        for job in [j for j, t in self.backlogged_at.items() if j not in self.bands or now - t > self.hold_s]:
            del self.backlogged_at[job]
        sending = frozenset(self.backlogged_at)
        if sending == self.sending and not resized:
            return False
        self.sending = sending
        return self._reshare()

    def follow_link(self, budget: float, link_bps: float | None) -> bool:
        """The devices held changed (one taken over or given back, or the first one at last): the parts' budget
        (``Reconciler.share_budget``) and the link rate follow; whether the parts changed. Usage:
        ``if jobs.follow_link(rec.share_budget(), rec.link_bps()): rec.set_shares(jobs.shares)``"""
        if (budget, link_bps) == (self.budget, self.link_bps):
            return False
        self.budget, self.link_bps = budget, link_bps
        if self.share_auto:
            self.job_share = min(AUTO_SHARES[self.saturated], budget)
        return self.enabled and self._reshare()

    def _reshare(self) -> bool:
        """Recompute ``shares`` from the bands, the part in force and the sending jobs; whether they changed."""
        shares = job_shares(self.bands, self.job_share, self.sending, self.budget, self.weights)
        if shares == self.shares:
            return False
        self.shares = shares
        self.share_changes += 1
        return True

    def inputs_of(self, name: str, keys: tuple | None = None) -> dict:
        """One reported input (``step_bytes`` or ``compute_s``) of the jobs in the order in force (or in ``keys``):
        ``{job: value}``."""
        return {job: v[name] for job, values in (self.keys if keys is None else keys) if name in (v := dict(values))}

    def describe(self) -> dict:
        """What ``status`` shows: the policy, the epoch and the order and bands in force."""
        out = {"policy": self.policy, "order": list(self.order), "changes": self.changes,
               "bands": {job: {"first_level": b[0], "levels": b[1]} for job, b in self.bands.items()},
               "job_share": self.job_share if self.enabled else 0.0, "job_share_among": self.share_among,
               "job_sample_s": self.sample_s, "job_hold_s": self.hold_s,
               "sending": sorted(self.sending), "share_changes": self.share_changes,
               "level_shares": {str(lvl): round(v, 6) for lvl, v in sorted(self.shares.items())}}
        if self.share_auto:  # whether the jobs saturate the link, the share of busy samples, seconds saturated
            busy, since = self.link_busy(), self.saturated_since
            out |= {"job_share_auto": True, "saturated": self.saturated,
                    "link_busy": None if busy is None else round(busy, 3),
                    "saturation_changes": self.saturation_changes,
                    "saturated_s": round(self.saturated_s + (time.monotonic() - since if since else 0.0), 3)}
        for name in self.inputs:
            out[name] = self.inputs_of(name)
        if self.timed:  # each ranked job's slowdown now, as this agent ranks it (the order moves with it)
            order, ranks = job_order(self.policy, sorted(self.jobs), now_s=self.clock(), link_bps=self.link_bps,
                                     **{name: self.inputs_of(name) for name in self.inputs})
            out["slowdown"] = {job: round(-rank, 3) for job, rank in zip(order, ranks, strict=True)
                               if math.isfinite(rank)}
        if self.policy in ROTATING:
            out |= {"epoch_s": self.epoch_s, "epoch": self.epoch,
                    "next_epoch_in_s": round(self.seconds_to_next_epoch() or 0.0, 3)}
        return out
