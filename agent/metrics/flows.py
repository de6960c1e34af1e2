"""Registered flows (the agent's FlowTable) and what the nftables marking chains counted.

- ``tensorlane_registered_flows{device,class,training_job}``: flows registered now. At most ``MAX_JOBS``
  training jobs get their own series (those with the most flows, at most ``MAX_JOBS_PER_USER`` of one user that is
  neither root nor trusted); the others are summed under
  ``training_job="_other"`` (a job id must start with a letter or digit, so no real job has that name).
  The label is ``training_job``, not ``job``, which Prometheus reserves for the scrape job.
- ``tensorlane_registered_jobs{device}``: jobs with at least one flow (not capped).
- ``tensorlane_job_id_conflicts{device}``: job ids used by two or more runs (the shim's ``run`` token) now.
- ``tensorlane_agent_handover_flows_total{outcome}``: the flows a hand-over's table (agent/handover.py) named,
  taken back at this agent's start (``adopted``) or not, by reason (``owner_gone``, ``not_owner``, ...): set once
  before the agent serves; ``adopted`` 0 and no other series after a start without a hand-over. The registers that
  took them back are not in ``tensorlane_api_requests_total`` (no client asked them).
- ``tensorlane_class_marked_bytes_total`` / ``_packets_total{device,class}``: what each level's nftables chain
  marked (set DSCP and class); the default class has none. Read through a libnftables context of this scrape's
  own (the agent's context belongs to its main thread).
- ``tensorlane_unregistered_dscp_reset_packets_total{device}``: packets of users' unregistered traffic that
  carried a DSCP of their own and left with 0 (``reset_user_dscp``): a user marking its bulk traffic; also this
  host's TCP with no socket file (sent after ``close()``, MPTCP subflows, the kernel's resets, and the kernel's own
  TCP clients root gave a DSCP not in ``kernel_tcp_dscp``, such as NVMe/TCP: a steady rise, not tails).
"""
from __future__ import annotations

from collections.abc import Callable

from tensorlane.agent.kernel import nft as nftables
from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import MAX_JOBS, OTHER, Source, capped_users, class_label, kept_jobs


def cap_jobs(counts: dict[tuple[str, str], int], max_jobs: int = MAX_JOBS,
             users_of: Callable[[str], set] = lambda job: set()) -> dict[tuple[str, str], int]:
    """``{(class, job): n}`` with all but the ``max_jobs`` largest jobs folded into job ``_other``, at most
    ``MAX_JOBS_PER_USER`` of one user's (``users_of``: see ``base.kept_jobs``)."""
    per_job: dict[str, int] = {}
    for (_, job), n in counts.items():
        per_job[job] = per_job.get(job, 0) + n
    keep = kept_jobs(sorted(per_job, key=lambda j: (-per_job[j], j)), users_of, max_jobs)
    out: dict[tuple[str, str], int] = {}
    for (cls, job), n in counts.items():
        key = (cls, job if job in keep else OTHER)
        out[key] = out.get(key, 0) + n
    return out


def _chains(names: list[str]) -> dict:
    """The table's chains ``names`` as one ``list`` JSON answer, listed chain by chain (listing the table would
    dump every map element)."""
    nft = nftables.Nft()
    try:
        items = []
        for name in names:
            listing = nft.run([{"list": {"chain": {"family": nftables.FAMILY, "table": nftables.TABLE,
                                                   "name": name}}}])
            items += (listing or {}).get("nftables", [])
        return {"nftables": items}
    finally:
        nft.close()


def marked_counters(levels: list[int]) -> dict[int, dict[str, int]]:
    """Counters of the level chains."""
    return nftables.chain_counters(_chains([nftables.level_chain(level) for level in levels]))


def reset_counters() -> dict[str, int]:
    """Packets and bytes of users' unregistered traffic, and of this host's TCP without a socket file, whose DSCP the
    ``egress`` and ``sockless`` chains reset (``reset_user_dscp``)."""
    return nftables.reset_counters(_chains(["egress", nftables.SOCKLESS_CHAIN]))


class FlowsSource(Source):
    """The FlowTable's flows and jobs, and the nftables chains' marking counters."""

    name = "flows"

    def collect(self, scrape):
        """Flows by class and job (capped), jobs, a hand-over's flows taken back, and the bytes and packets marked
        per level."""
        dev = scrape.device
        leaves = scrape.leaves()
        by_level = {spec.level: class_label(spec) for spec in leaves if spec.level is not None}
        entries = list(self.api.table.flows.values())  # copy: the main thread changes the table
        counts: dict[tuple[str, str], int] = {}
        level_of = self.api.table.level_of  # the effective level (a job policy may move a job's flows)
        for e in entries:
            lvl = level_of(e)
            key = (by_level.get(lvl, str(lvl)), e.job)
            counts[key] = counts.get(key, 0) + 1
        flows = names.REGISTERED_FLOWS.gauge()
        for (cls, job), n in sorted(cap_jobs(counts, users_of=capped_users(self.api, entries)).items()):
            flows.add_metric([dev, cls, job], n)
        yield flows
        jobs = names.REGISTERED_JOBS.gauge()
        jobs.add_metric([dev], len({e.job for e in entries}))
        yield jobs
        conflicts = names.JOB_ID_CONFLICTS.gauge()  # FlowTable.conflicts(), counted on a copy (main thread writes)
        conflicts.add_metric([dev], sum(len(r) > 1 for r in list(self.api.table.runs.values())))
        yield conflicts
        taken = names.HANDOVER_FLOWS.counter()
        for outcome, n in sorted({"adopted": 0, **self.api.taken_back}.items()):
            taken.add_metric([outcome], n)
        yield taken

        marks = marked_counters(sorted(by_level))
        mb, mp = names.CLASS_MARKED_BYTES.counter(), names.CLASS_MARKED_PACKETS.counter()
        for level, cls in sorted(by_level.items()):
            c = marks.get(level, {})
            mb.add_metric([dev, cls], c.get("bytes", 0))
            mp.add_metric([dev, cls], c.get("packets", 0))
        yield mb
        yield mp
        reset = names.DSCP_RESET_PACKETS.counter()
        reset.add_metric([dev], reset_counters()["packets"])
        yield reset
