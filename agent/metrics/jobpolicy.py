"""The job policy's state (``api.jobs``, agent/jobs.py, docs/jobs.md): the order of the jobs, the parts of the link
it guarantees them and, with ``job_share = "auto"``, whether the jobs saturate the link. Nothing under
``job_policy = "none"``.

- ``tensorlane_job_policy_info{device,policy}``: the job policy in force.
- ``tensorlane_job_first_level{device,training_job}``: the most urgent level of the job's band now (0: the job goes
  first on this host). At most ``MAX_JOBS`` jobs, the most urgent first, ``MAX_JOBS_PER_USER`` of one user's (the
  order moves, the set of series with it).
- ``tensorlane_job_order_changes_total{device}``: recomputations that changed the order or the bands.
- ``tensorlane_job_share_ratio{device}``: the share of the link guaranteed to the jobs together (``job_share``; with
  "auto" the part chosen now).
- ``tensorlane_job_share_changes_total{device}``: changes of the jobs' parts (jobs starting or stopping to send,
  "auto" changing the part).
- ``tensorlane_job_link_saturated{device}`` and ``tensorlane_job_link_busy_ratio{device}`` (``job_share = "auto"``
  only): 1 while the agent finds the jobs saturating the link; the share of its last samples in which some job's
  class held queued bytes (absent before the first sample).
"""
from __future__ import annotations

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import MAX_JOBS, Source, capped_users, kept_jobs


class JobPolicySource(Source):
    """The job scheduler's order, parts and (``job_share = "auto"``) saturation."""

    name = "job_policy"

    def collect(self, scrape):
        """Read from ``api.jobs`` (attributes the main thread replaces whole; the bands copied before use)."""
        jobs = self.api.jobs
        if not jobs.enabled:
            return
        dev = scrape.device
        info = names.JOB_POLICY.info()
        info.add_metric([dev], {"policy": jobs.policy})
        yield info
        first = names.JOB_FIRST_LEVEL.gauge()
        bands = sorted(dict(jobs.bands).items(), key=lambda kv: (kv[1][0], kv[0]))
        keep = kept_jobs([job for job, _ in bands], capped_users(self.api), MAX_JOBS)
        for job, (level, _) in bands:
            if job in keep:
                first.add_metric([dev, job], level)
        yield first
        for metric, value in ((names.JOB_ORDER_CHANGES, jobs.changes), (names.JOB_SHARE_CHANGES, jobs.share_changes)):
            fam = metric.counter()
            fam.add_metric([dev], value)
            yield fam
        share = names.JOB_SHARE.gauge()
        share.add_metric([dev], jobs.job_share)
        yield share
        if jobs.share_auto:
            saturated = names.JOB_LINK_SATURATED.gauge()
            saturated.add_metric([dev], int(jobs.saturated))
            yield saturated
            busy = jobs.link_busy()
            if busy is not None:
                fam = names.JOB_LINK_BUSY.gauge()
                fam.add_metric([dev], busy)
                yield fam
