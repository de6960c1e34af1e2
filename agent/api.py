"""The agent's request handlers (protocol in docs/protocol.md; the socket server is agent/server.py).

Handlers validate first (format, access rights, ownership of the flows' sockets in the agent's own network
namespace: agent/ownership.py), then change the FlowTable, then the kernel: a refused request changes nothing.
With a job policy (agent/jobs.py) a change of the set of jobs can move other jobs' flows too: they go to the
kernel in the same transaction as the request's own.
Usage: ``api = Api(cfg, table, rec, "htb"); api.handle(line, peer)``
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import logging
import math
import time
import uuid

from tensorlane import __version__ as VERSION  # package metadata (pyproject.toml)
from tensorlane.agent import protocol
from tensorlane.agent.jobs import JobScheduler
from tensorlane.agent.kernel.qdisc import fmt_handle
from tensorlane.agent.logs import RefusalLog
from tensorlane.agent.metrics.jobs import JobReports
from tensorlane.agent.ownership import (
    MAX_OWNER_FDS,
    UDP_PORT_DUMPS,
    NotLocal,
    SharedPort,
    UndecidedPorts,
    netns_of,
    not_owned,
    not_owned_by_owners,
    socket_users,
    still_sending,
)
from tensorlane.agent.peers import AccessPolicy, Peer, user_name
from tensorlane.agent.protocol import ProtocolError
from tensorlane.agent.state import SHOWN_RUNS, job_id_base, user_job_id
from tensorlane.client import LIST_PAGE
from tensorlane.flows import FlowKey, TooManyFiles
from tensorlane.policies.jobs import REPORTED_INPUTS

log = logging.getLogger("tensorlane.api")
SWEEP_OWNERS = 512  # owner processes whose sockets one sweep reads (/proc/PID/fd each); the next sweep goes on
# A TCP flow whose owner closed its socket (or exited) keeps its level while the kernel still sends what was written
# before the close (``ownership.still_sending``), at most this long; a sweep looks up at most DRAIN_CHECKS of them.
# A register without ``fds`` reads the client's open files (a readlink each, about 11 us here): it takes one token
# more of its user's request bucket (agent/server.py) per FILES_PER_TOKEN of them. Before, one user re-registering a
# flow in a loop from a process with 8,150 open files kept the agent's loop busy 90 ms a request, and root's ``hello``
# waited 138 ms at p50 (0.4 ms without), 344 ms at p99.
FILES_PER_TOKEN = 16
DRAIN_MAX_S = 60.0
DRAIN_CHECKS = 1024
# How ``status`` names another user's job to a user that is neither root nor trusted (numbered from 1): no job id
# can look like it (ids start alphanumeric and have no spaces).
OTHER_JOB = "(another user's job {})"
REPORT_REORDER_S = 2.0  # one user's reports reorder the jobs at most this often; a later change waits (reorder_at)


class Api:
    """Dispatches parsed requests; tells ``observers`` (the metrics) each request's outcome and duration."""

    def __init__(self, cfg, table, reconciler, backend: str):
        """An api over ``table`` and ``reconciler`` (the kernel), configured by ``cfg``."""
        self.cfg = cfg
        self.table = table
        self.rec = reconciler
        self.backend = backend
        self.started = time.time()
        self.instance = uuid.uuid4().hex  # lets clients notice a restarted agent and register again
        # Called as observer(op, outcome, seconds) after every request (metrics subscribe here).
        self.observers: list = []
        self.reports = JobReports()  # communication time reported by the shims (op "report"), for the metrics
        self.policy = AccessPolicy(frozenset(cfg.allowed_users), frozenset(cfg.allowed_groups),
                                   dict(cfg.level_limits), frozenset(cfg.trusted_users), cfg.check_ownership)
        self.jobs = JobScheduler(cfg, guarantees=reconciler.backend.kind == "htb", budget=reconciler.share_budget(),
                                 link_bps=reconciler.link_bps())  # the job order (docs/jobs.md)
        self.refusal_log = RefusalLog(log, 10.0)  # shared with the socket server (agent/server.py)
        self.netns = netns_of("self")  # the network namespace this agent manages: ownership is decided in it
        self._swept_to = -1  # the last owner pid the previous sweep read: the next one goes on after it
        self._reordered_by: dict[int, float] = {}  # uid -> when its reports last reordered the jobs (monotonic)
        self.reorder_at: float | None = None  # when a reorder a report asked for is due (the server's loop runs it)
        self.cost = 0  # tokens the last request takes beyond its own (``FILES_PER_TOKEN``): the server charges them
        self.journal = None  # the flow table kept on disk for the next agent after a crash (handover.FlowJournal)
        self.taken_back: dict[str, int] = {}  # a hand-over's flows taken back at the start, or not by reason (handover)
        table.level_of = self.jobs.level_of
        self.jobs.update(table)
        reconciler.set_shares(self.jobs.shares)

    def handle(self, line: bytes, peer: Peer | None = None) -> bytes:
        """Answer one request line from ``peer`` (None: the agent itself) with one reply line; never raises."""
        t0 = time.perf_counter()
        self.cost = 0
        rid, op = None, "invalid"
        try:
            req = protocol.parse_request(line)
            rid, op = req.id, req.op
            if req.job is not None and peer is not None and not self.policy.privileged(peer):
                req = dataclasses.replace(req, job=self._users_job(req, peer))
            reply = protocol.ok(rid, getattr(self, f"_op_{req.op}")(req, peer))
            outcome = "ok"
        except ProtocolError as exc:
            reply, outcome = protocol.error(rid, exc.code, str(exc)), exc.code
            who = f"pid {peer.pid} uid {peer.uid}" if peer else "agent"
            self.refusal_log.note(f"request {exc.code}", logging.INFO, "refused %s from %s: %s: %.200s", op, who,
                                  exc.code, exc)  # clipped: the message can quote 64 KiB of the client's input
        except Exception as exc:  # noqa: BLE001 - the agent must answer and stay up
            log.exception("internal error in %s", op)
            reply, outcome = protocol.error(rid, "internal", f"{type(exc).__name__}: {exc}"), "internal"
        elapsed = time.perf_counter() - t0
        for observe in self.observers:
            observe(op, outcome, elapsed)
        return reply

    def record(self, op: str, outcome: str) -> None:
        """Count an outcome decided outside ``handle`` (e.g. a connection refused by the server)."""
        for observe in self.observers:
            observe(op, outcome, 0.0)

    def _op_hello(self, req, peer) -> dict:
        """Who answers: version, managed interfaces, levels, and an id of this agent's run."""
        return {"version": VERSION, "interfaces": list(self.rec.interfaces), "levels": self.cfg.levels,
                "instance": self.instance}

    def _push(self, added: list, moved: list, removed: list) -> None:
        """Send one change of the table to the kernel, with the flows of other jobs that the job policy moved
        because the set of jobs changed (one transaction)."""
        shifted = self.jobs.update(self.table)
        if shifted:
            mine = set(added) | set(moved)
            moved = moved + [k for k in shifted if k not in mine]
        self.rec.apply(self.table, added, moved, removed)
        self.rec.set_shares(self.jobs.shares)  # the jobs' guarantees follow the set of jobs (classes in place)

    def reorder(self) -> int:
        """At an epoch boundary (the server's timer), when a job's reported inputs changed (``shortest``,
        ``measured_intensity``, ``slowdown``), or every ``job_sample_s`` under an order that moves with the clock
        (``slowdown``): recompute the job order and move the flows whose effective level changed, in one
        transaction. Returns how many moved."""
        self.reorder_at = None  # (the order is recomputed from every input reported so far)
        shifted = self.jobs.update(self.table)
        if shifted:
            self.rec.apply(self.table, [], shifted, [])
            self.record("job_order", "moved")
            # (slowdown moves jobs several times a second: its changes are counted in status, not logged; reported
            # inputs can move an order as often as reports come: at most a line every few seconds)
            if self.jobs.timed:
                log.debug("job order changed: moved %d flows", len(shifted))
            else:
                self.refusal_log.note("job order changed", logging.INFO, "job order changed: moved %d flows",
                                      len(shifted))
        self.rec.set_shares(self.jobs.shares)  # ties can join or split bands (reported inputs): the parts follow
        return len(shifted)

    def _op_register(self, req, peer) -> dict:
        """Register flows at a level, after the access, namespace and ownership checks."""
        pid = uid = None
        floor = 0
        found: dict[FlowKey, int] = {}  # (no fds named: the fd found holding each flow's socket, for the sweep)
        skuids: dict[FlowKey, int] = {}  # each UDP flow's socket user: only its sockets' packets get the level
        if peer is not None:
            self.policy.check_level(peer, req.level)
            floor = self.policy.most_urgent_level(peer) if self.jobs.enabled else 0
            uid = peer.uid
            must_own = self.policy.must_own(peer)
            foreign = []
            if must_own or (self.policy.check_ownership and peer.uid != 0):
                try:
                    with peer.pinned():  # the pid names the process that connected throughout (not one reusing it)
                        self._check_netns(peer)  # trusted users too, except root (it can enter any namespace)
                        if must_own:
                            fds = dict(zip(req.flows, req.fds, strict=True)) if req.fds is not None else None
                            files: list[int] = []
                            try:
                                foreign = not_owned(peer.pid, req.flows, fds=fds,
                                                    uid=None if peer.uid == 0 else peer.uid, found=found, files=files,
                                                    exclusive=True)
                                skuids = self._socket_users(peer, req.flows, fds if fds is not None else found)
                            finally:
                                self.cost = sum(files) // FILES_PER_TOKEN
                except ProcessLookupError:
                    raise ProtocolError("not_owner", f"process {peer.pid} is gone") from None
                except TooManyFiles as exc:  # (reading them all stalled the agent: seconds at a million)
                    raise ProtocolError("limit", f"{exc.strerror}: the agent reads at most {MAX_OWNER_FDS} open "
                                        "files of a process to find its sockets; name each flow's fd in the "
                                        "register (field fds: then only those are read), or use a process with "
                                        "fewer") from None
                except NotLocal as exc:  # (a wildcard socket owns flows from any source by the UDP rule)
                    raise ProtocolError("not_owner", f"flow {exc.args[0]}'s source {exc.args[0].src} is no address of "
                                        "this host (in this agent's network namespace): a socket of this host sends "
                                        "no datagram from it, and the flow would match packets the host forwards "
                                        "for others") from None
                except SharedPort as exc:  # (SO_REUSEADDR: any user may bind a port so shared)
                    raise ProtocolError("not_owner", f"flow {exc.args[0]}'s source port is shared with another user's "
                                        f"socket (user {user_name(exc.args[1])}, SO_REUSEADDR) that owns the flow too: "
                                        "their packets cannot be told apart, so neither user's register may give "
                                        "them a level; bind a port no other user's socket shares") from None
                except UndecidedPorts as exc:
                    raise ProtocolError("limit", f"UDP flows of {exc.args[0]} source ports were not judged: another "
                                        "socket answers for their addresses, so each port's sockets need a look, "
                                        f"and the agent takes at most {UDP_PORT_DUMPS} looks in one request (one "
                                        "per port and address family: an IPv4 flow's port takes two, its IPv4 "
                                        "and dual-stack IPv6 sockets): register them in several requests") from None
            if foreign:
                what = (f"fd {dict(zip(req.flows, req.fds, strict=True))[foreign[0]]} of process {peer.pid} does not "
                        "hold its socket" if req.fds is not None else f"not a socket of process {peer.pid}")
                what += "" if peer.uid == 0 else f" made by user {peer.user}"
                raise ProtocolError("not_owner", f"flow {foreign[0]} is {what} in this agent's network namespace"
                                    + (f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""))
            if must_own:
                pid = peer.pid
            elif not self.policy.privileged(peer):  # check_ownership = false: no socket was checked
                skuids = self._unchecked_socket_users(peer, req)
            if not self.policy.privileged(peer):
                self._check_user_limits(req, peer)
        had = set(self.table.runs.get(req.job, ()))
        users = self.table.job_users(req.job)
        if users and uid not in users:  # root (or a trusted user) joins a user's job: inputs that user reported
            self.jobs.reported.pop(req.job, None)  # are theirs alone, dropped (_push reorders)
        added, moved = self.table.register(req.job, req.level, req.flows, req.rank, pid=pid, uid=uid, floor=floor,
                                           run=req.run,
                                           fds=dict(zip(req.flows, req.fds, strict=True)) if req.fds else
                                           found or None, fds_found=not req.fds,
                                           see_all=peer is None or self.policy.privileged(peer), skuids=skuids)
        self._push(added, moved, [])
        level = self.table.effective_level(req.flows[0])  # one job, one requested level: one effective level
        reply = {"job": req.job, "level": level, "requested_level": req.level, "added": len(added),
                 "moved": len(moved), "unchanged": len(req.flows) - len(added) - len(moved),
                 "dscp": self.cfg.dscp[level], "class": fmt_handle(self.rec.backend.classid(level))}
        runs = self.table.runs.get(req.job, {})
        if len(runs) > 1:
            if req.run not in had:  # a new run joined a job id already in use: log once per run
                shown = ", ".join(sorted(runs)[:SHOWN_RUNS]) + (", ..." if len(runs) > SHOWN_RUNS else "")
                self.record("job_id_conflict", "seen")
                self.refusal_log.note("job id conflict", logging.WARNING,
                                      "job id %r is used by %d runs on this host (%s): the agent treats them as "
                                      "one job; give each job its own id", req.job, len(runs), shown)
            reply["conflict"] = (f"job id {req.job!r} is also used by another run on this host ({len(runs)} runs): "
                                 "the agent treats them as one job (one band, one order); give each job its own id "
                                 "(TENSORLANE_JOB, or torchrun --rdzv-id)")
        elif req.job != job_id_base(req.job):
            reply["conflict"] = (f"job id {job_id_base(req.job)!r} is in use by another user on this host: this "
                                 f"job's flows are registered as its own job {req.job!r}, at their levels; give this "
                                 "job its own id (TENSORLANE_JOB, or torchrun --rdzv-id)")
        return reply

    @staticmethod
    def _socket_users(peer, flows, fds: dict[FlowKey, int]) -> dict[FlowKey, int]:
        """The user each UDP flow of ``flows`` is marked for (``FlowTable.mark``): the maker of the socket its fd
        holds (``ownership.socket_users``: the user or a uid of its subordinate range), else, for a user other than
        root, the user itself; root's flows whose socket was not found are marked for any socket (not in the map).
        Linux lets two users' sockets share a UDP port (SO_REUSEADDR, both set), and their datagrams carry the same
        5-tuple: keyed by the socket's user, a flow registered before another user's socket joined its port gives
        that user's datagrams no level (until 2026-11-28 it did)."""
        udp = [k for k in flows if k.proto == "udp"]
        if not udp:
            return {}
        found = socket_users(peer.pid, {k: fds[k] for k in udp if k in fds}, None if peer.uid == 0 else peer.uid)
        if peer.uid != 0:
            found.update((k, peer.uid) for k in udp if k not in found)
        return found

    def _unchecked_socket_users(self, peer, req) -> dict[FlowKey, int]:
        """The user each UDP flow of a register that no socket check judged (``check_ownership = false``) is marked
        for, for a user that is neither root nor in ``trusted_users``: the maker of the socket at the flow's named fd
        where it is the user or a uid of its subordinate range, else the user itself. Its register claims its own
        traffic: keyed so, the flow gives another user's socket bound to that 5-tuple (SO_REUSEADDR, or a port the
        user named without holding it) no level. Until 2026-11-29 such a flow was keyed by its 5-tuple alone, and a
        user gave any socket's datagrams of it the level of its choice (docs/agent.md, threat model)."""
        udp = [k for k in req.flows if k.proto == "udp"]
        if not udp:
            return {}
        if req.fds is not None and (peer.sock is not None or peer.pidfd is not None):  # (a live client: its fds)
            fds = dict(zip(req.flows, req.fds, strict=True))
            try:
                with peer.pinned():
                    return self._socket_users(peer, udp, fds)
            except ProcessLookupError:
                pass
        return {k: peer.uid for k in udp}

    def _users_job(self, req, peer) -> str:
        """The job a user's request is about: the id it names, or the user's own job under that id
        (``state.user_job_id``: ``ID@USER``) once another user held the id on this host when the user first
        registered under it. So a user who takes a job id first (every id a job will use is on its command line,
        ``--rdzv-id``) no longer keeps its owner's flows out of the queues: they go under the owner's own job, at
        their levels, with the id's configured priority or intensity; a log line and the reply say so. No user
        (not root, not trusted) joins a job id whose flows are another user's, so a job's place in the order, its
        reported inputs and its flows on this host are one user's (until 2026-11-27 a separate check refused such a
        join, ``forbidden``; this mapping made it unreachable).

        The user's own job is found by the user's uid among the jobs it holds flows in, not by its name: a name
        lookup that fails for a while (the uid then) would otherwise start a second job for the same run. An
        unregister that names flows the user still holds under the id itself (registered before another user
        joined it) is about those."""
        base = req.job
        own = next((job for job in sorted(self.table.user_jobs(peer.uid)) if job != base and job_id_base(job) == base),
                   None)
        if own is not None:
            if req.op == "unregister" and req.flows and all(
                    (e := self.table.flows.get(k)) is not None and e.job == base for k in req.flows):
                return base
            return own
        if req.op == "register" and self.table.job_users(base) - {peer.uid}:
            own = user_job_id(base, peer.user)
            if self.table.job_users(own) - {peer.uid}:  # another uid of the same name holds it: its uid too (a
                own = user_job_id(base, f"{peer.user}:{peer.uid}")  # name has no ":"), not a join of its job
            self.refusal_log.note("job id taken", logging.WARNING, "job id %r is in use by another user on this host: "
                                  "%s's flows are registered under %r", base, peer.user, own)
            return own
        return base

    def _check_user_limits(self, req, peer) -> None:
        """A user (not root, not trusted) holds at most ``max_flows_per_user`` flows and ``max_jobs_per_user`` jobs
        on this host: no user fills the table for the others, or takes more bands and parts by starting jobs."""
        new = sum(1 for k in req.flows if k not in self.table.flows)
        room = self.cfg.max_flows - math.ceil(self.cfg.reserved_flow_share * self.cfg.max_flows)
        if len(self.table.flows) + new > room:
            raise ProtocolError("limit", f"{len(self.table.flows)} flows registered: {new} more would exceed the "
                                         f"{room} that users other than root may fill (reserved_flow_share)")
        have = self.table.user_flows(peer.uid)
        if have + new > self.cfg.max_flows_per_user:
            raise ProtocolError("limit", f"user {peer.user} holds {have} flows; {new} more would exceed "
                                         f"max_flows_per_user = {self.cfg.max_flows_per_user}")
        jobs = self.table.user_jobs(peer.uid)
        if req.job not in jobs and len(jobs) >= self.cfg.max_jobs_per_user:
            raise ProtocolError("limit", f"user {peer.user} has flows in {len(jobs)} jobs on this host: another "
                                         f"would exceed max_jobs_per_user = {self.cfg.max_jobs_per_user}")

    def _check_netns(self, peer) -> None:
        """Refuse a client whose network namespace is not the one this agent manages: its addresses and ports
        name flows of another network, which the agent neither sees nor marks."""
        try:
            theirs = netns_of(peer.pid)
        except ProcessLookupError:
            raise ProtocolError("not_owner", f"process {peer.pid} is gone") from None
        except OSError as exc:  # cannot tell (e.g. the agent is not root): refuse rather than guess
            raise ProtocolError("foreign_netns", f"cannot read the network namespace of process {peer.pid}: "
                                                 f"{exc}") from None
        if theirs != self.netns:
            raise ProtocolError(
                "foreign_netns",
                f"process {peer.pid} is in network namespace net:[{theirs[1]}], not the one this agent manages "
                f"(net:[{self.netns[1]}]): its flows are not this host's. Containers and pods with host networking "
                "are plain clients; those with their own network namespace are refused")

    def _op_unregister(self, req, peer) -> dict:
        """Unregister a job's flows (all of them when none are named); another user's flows are refused."""
        removed = self.table.unregister(req.job, req.flows, uid=None if peer is None else peer.uid,
                                        see_all=peer is None or self.policy.privileged(peer))
        self._push([], [], removed)
        return {"job": req.job, "removed": len(removed)}

    def _op_report(self, req, peer) -> dict:
        """Fold a shim's cumulative per-level counters into the job's metrics."""
        bad = [lvl for lvl, *_ in req.counters if lvl >= self.cfg.levels]
        if bad:
            raise ProtocolError("bad_level", f"level {bad[0]} out of range 0..{self.cfg.levels - 1}")
        why = self._may_report(req.job, peer)
        counted_as = None
        if why is None:  # a user's reports count for their own jobs only: no one fills or skews another's series
            counted_as = self.reports.add(req.job, req.session, {lvl: tuple(c) for lvl, *c in req.counters},
                                          req.step_bytes, req.compute_s,
                                          user=None if peer is None or peer.uid == 0 else peer.uid)
        reply = {"job": req.job, "levels": len(req.counters), "counted_as": counted_as}
        sent = {k: getattr(req, k) for k in REPORTED_INPUTS if getattr(req, k) is not None}
        return reply | self._take_inputs(req.job, sent, why, peer)

    def _may_report(self, job: str, peer) -> str | None:
        """Whether ``peer`` may speak for ``job`` (None) or why not: the agent itself and root may; a user only for a
        job whose flows on this host are all theirs (so that no user reorders or counts for another user's job)."""
        if peer is None or peer.uid == 0:
            return None
        owners = self.table.job_users(job)
        if not owners or (peer.uid not in owners and not self.policy.privileged(peer)):
            return "ignored: the job has no flows registered on this host"  # (another user's: as one without, the
            # same words, so that a report does not tell whether a job id is in use, which status does not either)
        if owners != {peer.uid}:
            return "ignored: only the user who registered the job's flows may report for it"
        return None

    def _take_inputs(self, job: str, sent: dict, refused: str | None, peer=None) -> dict[str, str]:
        """Take a report's measured inputs (``step_bytes``, ``compute_s``, ...) into the job order when the policy
        orders by them and the reporter may speak for the job (``refused`` is None; else why not:
        ``_may_report``). Returns what became of each input sent: ``taken``, ``unused: ...`` (the policy does not
        order by it) or ``ignored: ...``."""
        used = self.jobs.inputs
        unused = f"unused: job_policy is {self.jobs.policy!r}"
        if not any(name in used for name in sent):
            return dict.fromkeys(sent, unused)
        if refused is not None:
            why = refused
        elif job not in self.table.by_job:
            why = "ignored: the job has no flows registered on this host"
        else:
            why = "taken"
            before = dict(self.jobs.reported.get(job, {}))
            if self.jobs.report(job, **sent):
                try:
                    self.jobs.rank_check()
                except ValueError as exc:  # values the order cannot rank: refused, the job's inputs as they were
                    self.jobs.reported[job] = before
                    raise ProtocolError("bad_request", f"the reported inputs cannot be ranked: {exc}") from None
                self._reorder_for(peer)
        return {name: why if name in used else unused for name in sent}

    def _reorder_for(self, peer) -> None:
        """A report of ``peer``'s changed the order's inputs: reorder now, unless that user's reports reordered the
        jobs less than ``REPORT_REORDER_S`` ago; then at that time (``reorder_at``: the server's loop). Root and the
        agent reorder at once. A user flipping its job's inputs at every report (200 requests/s) moved every flow of
        the jobs ranked between at each one; it now costs at most one reorder every ``REPORT_REORDER_S``."""
        uid = None if peer is None or peer.uid == 0 else peer.uid
        now = time.monotonic()
        if uid is not None:
            last = self._reordered_by.get(uid)
            if last is not None and now - last < REPORT_REORDER_S:
                due = last + REPORT_REORDER_S
                self.reorder_at = due if self.reorder_at is None else min(self.reorder_at, due)
                return
            if len(self._reordered_by) >= 4096:  # bounded: the users whose stamp still holds back a reorder stay
                self._reordered_by = {u: t for u, t in self._reordered_by.items() if now - t < REPORT_REORDER_S}
            self._reordered_by[uid] = now
        self.reorder()

    def _op_list(self, req, peer) -> dict:
        """The registered flows (of one job, if given), with their effective levels and the managed interface
        each leaves through now ("" when it is routed through none: such a flow is not prioritised); at most
        ``LIST_PAGE`` of them in the flows' order, from after ``req.after``, and the last one as ``next`` when more
        follow (a reply of the whole table went over the unread-output limit, and its connection was closed). A
        user that is neither root nor trusted sees only the flows it registered, found through the job index: a
        request costs what the user's own flows do, never a walk of the whole table, and names no other user's
        jobs."""
        table, level_of = self.table, self.table.level_of
        uid = None if peer is None or self.policy.privileged(peer) else peer.uid
        if req.job is not None:  # (a user's: only a job it holds flows in; another's, root's with 100,000 flows,
            # cost a walk of them all per request, 50 ms, to list nothing)
            keys = table.by_job.get(req.job, ()) if uid is None or req.job in table.of_user.get(uid, ()) else ()
        elif uid is not None:
            keys = [k for job in table.user_jobs(uid) for k in table.by_job[job]]
        else:
            keys = table.flows
        after = req.after
        page = heapq.nsmallest(LIST_PAGE + 1, (k for k in keys if (uid is None or table.flows[k].uid == uid)
                                               and (after is None or k > after)))
        more = len(page) > LIST_PAGE
        chosen = [(k, table.flows[k]) for k in page[:LIST_PAGE]]
        egress = self.rec.egress([k for k, _ in chosen])
        flows = [{**k.as_dict(), "job": e.job, "level": level_of(e), "requested_level": e.level, "rank": e.rank,
                  "interface": egress[k]} for k, e in chosen]
        return {"flows": flows, "next": chosen[-1][0].as_dict() if more else None}

    def _op_status(self, req, peer) -> dict:
        """The agent; per managed interface its queue devices and flows; per device its classes' kernel
        counters; per level those counters summed over the devices, with flows and marks; jobs; reconciling."""
        from tensorlane.agent.kernel import (
            tcstats,  # local: status is rare, keep the hot path lean
        )

        devices = [{"device": d.name, "serves": d.serves, "link_rate_bps": getattr(d.backend, "rate", None),
                    "classes": self._device_classes(tcstats.class_stats(self.rec.ipr, d.index))}
                   for d in self.rec.devices]
        rates = [d["link_rate_bps"] for d in devices]
        st = {
            "version": VERSION, "interfaces": self._interfaces(), "backend": self.backend,
            "link_rate_bps": sum(rates) if rates and all(rates) else None,  # (no device held: None)
            "uptime_s": round(time.time() - self.started, 3),
            "flows": len(self.table.flows), "draining_flows": len(self.table.draining),
            "jobs": self.table.jobs(), "job_policy": self.jobs.describe(),
            "job_conflicts": self.table.conflicts(), "job_conflict_runs": self.table.conflict_runs(),
            "min_share": getattr(self.rec.backend, "min_share", 0.0),
            "min_rate_bps": getattr(self.rec.backend, "min_rate", 0),
            "ack_priority": getattr(self.rec, "ack_level", None) is not None,
            "classes": self._levels(devices), "devices": devices,
            "reconcile": {"passes": self.rec.stats.passes, "repairs": self.rec.stats.repairs,
                          "errors": self.rec.stats.errors, "last_error": self.rec.stats.last_error,
                          "failing": getattr(self.rec, "failing", "")},
            # the flow table kept on disk for the next agent after a crash (None: no journal, a test's agent)
            "flow_table": None if self.journal is None else self.journal.describe(),
            "unnamed_jobs": 0,
        }
        return st if peer is None or self.policy.privileged(peer) else self._unnamed_others(st, peer.uid)

    def _unnamed_others(self, st: dict, uid: int) -> dict:
        """``status`` as a user that is neither root nor trusted sees it (as its ``list``, it names no other user's
        jobs): every job id in ``st`` that ``uid`` holds no flow in becomes a placeholder ``OTHER_JOB`` numbered
        by the job's place in the order (then the table's), and those jobs' run tokens are left out
        (``job_conflicts`` lists none; ``job_conflict_runs`` still counts them). Counts, the order's length, the
        bands, the parts, the reported inputs and the kernel counters stay: the user sees that other jobs exist
        and where its own are placed. ``unnamed_jobs``: how many were replaced. The one place status is
        filtered."""
        mine = self.table.user_jobs(uid)
        others: dict[str, str] = {}

        def name(job: str) -> str:
            if job in mine:
                return job
            if job not in others:
                others[job] = OTHER_JOB.format(len(others) + 1)
            return others[job]

        jp = st["job_policy"]
        for job in itertools.chain(jp["order"], st["jobs"]):
            name(job)  # (numbered: most urgent first, then the table's order)
        number = {job: i for i, job in enumerate(others)}
        st["jobs"] = {name(j): n for j, n in sorted(st["jobs"].items(), key=lambda item: (
            item[0] in number, number.get(item[0], 0), item[0]))}  # its own jobs by id, then the others by number
        jp["order"] = [name(j) for j in jp["order"]]
        jp["bands"] = {name(j): band for j, band in jp["bands"].items()}
        jp["sending"] = sorted(name(j) for j in jp["sending"])
        for field in (*REPORTED_INPUTS, "slowdown"):
            if field in jp:
                jp[field] = {name(j): v for j, v in jp[field].items()}
        st["job_conflicts"] = {name(j): runs if j in mine else [] for j, runs in st["job_conflicts"].items()}
        st["job_conflict_runs"] = {name(j): n for j, n in st["job_conflict_runs"].items()}
        st["unnamed_jobs"] = len(others)
        return st

    def _device_classes(self, stats: dict[int, dict]) -> list[dict]:
        """One device's leaf classes with their kernel counters."""
        return [{"level": spec.level, "class": fmt_handle(spec.classid), "prio": spec.prio,
                 **stats.get(spec.classid, {})} for spec in self.rec.backend.leaves()]

    def _interfaces(self) -> list[dict]:
        """Each managed interface, whether it is here (``present``: not deleted, renamed or moved away), the devices
        that carry its queues and how many flows leave through it now;
        flows routed through none of them are counted under the name "", those not looked up yet (many peers:
        ``Reconciler.egress``) under null."""
        egress = self.rec.egress(list(self.table.flows))
        counts: dict[str | None, int] = {}
        for name in egress.values():
            counts[name] = counts.get(name, 0) + 1
        out = [{"name": name, "present": bool(index), "queues": [d.name for d in self.rec.devices if d.serves == name],
                "flows": counts.get(name, 0)} for name, index in self.rec.interfaces.items()]
        out += [{"name": name, "queues": [], "flows": counts[name]} for name in ("", None) if counts.get(name)]
        return out

    def _levels(self, devices: list[dict]) -> list[dict]:
        """Per leaf class: its counters summed over the devices (token buckets only with one device), the
        level's DSCP, registered flows and what its nftables chain marked."""
        marks = self.rec.counters()
        by_level = self.table.by_level()
        levels = []
        for i, spec in enumerate(self.rec.backend.leaves()):
            rows = [d["classes"][i] for d in devices]
            entry = dict(rows[0]) if len(rows) == 1 else {
                "level": spec.level, "class": fmt_handle(spec.classid), "prio": spec.prio,  # (no device: all gone)
                **{k: sum(r.get(k, 0) for r in rows) for k in _summed_keys(rows)}}
            if spec.level is not None:
                entry |= {"dscp": self.cfg.dscp[spec.level], "flows": len(by_level[spec.level]),
                          "marked_bytes": marks.get(spec.level, {}).get("bytes", 0),
                          "marked_packets": marks.get(spec.level, {}).get("packets", 0)}
            levels.append(entry)
        return levels

    def drop_owner(self, pid: int) -> int:
        """The process ``pid`` exited: remove the flows it owned, but for those whose kernel socket still sends
        (``_let_go``). Returns how many went."""
        gone = self._let_go(sorted(self.table.by_pid.get(pid, ())))
        if gone:
            self._push([], [], gone)
            self.record("owner_exit", "removed")
            self.refusal_log.note("owner exited", logging.INFO, "process %d exited: removed its %d flows", pid,
                                  len(gone))  # bounded: a user can start and end processes at will
        return len(gone)

    def _let_go(self, keys: list[FlowKey]) -> list[FlowKey]:
        """Flows whose owner let go of the socket (closed it, or exited): those whose kernel socket still sends
        what was written before the close keep their level until it is done (``DRAIN_MAX_S`` at most: ``sweep``),
        so that a transfer's last megabytes are not sent unclassified; the others are removed. Returns those."""
        sending = set(still_sending(keys, self._uid_of))
        if sending:
            self.table.drain([k for k in keys if k in sending], time.monotonic() + DRAIN_MAX_S)
        return self.table.drop([k for k in keys if k not in sending])

    def _found_elsewhere(self, keys: list[FlowKey]) -> list[FlowKey]:
        """``keys`` (flows whose owner no longer holds their socket at the fd checked) less those whose fd the agent
        found at the register (the client named none) and whose owner holds the socket at another fd now (moved by
        ``dup2``, the first of two fds closed): their owner's open files are read again (once: the fd found then is
        kept). Until 2026-11-28 they were removed, as flows whose client named the fd are. At most ``MAX_OWNER_FDS``
        open files are read so in a pass (a user moving its sockets to other fds each pass cannot make every sweep
        read all of its processes' files): the flows of the owners beyond wait for a later pass."""
        by_pid: dict[int, list[FlowKey]] = {}
        for k in keys:
            entry = self.table.flows.get(k)
            if entry is not None and entry.fd_found and entry.fd is not None and entry.pid is not None:
                by_pid.setdefault(entry.pid, []).append(k)
        kept: set[FlowKey] = set()
        files: list[int] = []
        for pid, flows in by_pid.items():
            if sum(files) >= MAX_OWNER_FDS:
                kept.update(flows)  # (judged at a later pass)
                continue
            found: dict[FlowKey, int] = {}
            try:  # (only the user's own sockets, as at the register: not another user's put in the process)
                foreign = set(not_owned(pid, flows, found=found, files=files, uid=self._made_by(flows[0])))
            except (OSError, TooManyFiles, UndecidedPorts):  # (as a sweep that cannot tell: the flows go)
                continue
            for k in flows:
                if k not in foreign:
                    kept.add(k)
                    if (e := self.table.flows[k]).fd != found.get(k):  # (None: all read each sweep)
                        self.table.flows[k] = e._replace(fd=found.get(k))
                        self.table.changes += 1
        return [k for k in keys if k not in kept]

    def _fd_of(self, key: FlowKey) -> int | None:
        """The owner's fd that holds flow ``key``'s socket, when its register named it."""
        return self.table.flows[key].fd

    def _made_by(self, key: FlowKey) -> int | None:
        """The user whose sockets alone hold flow ``key`` (its registering user's, as its register checked: ``uid``
        of ``not_owned``); None for root's flows (any socket)."""
        uid = self.table.flows[key].uid
        return None if uid == 0 else uid

    def _uid_of(self, key: FlowKey) -> int | None:
        """The user that registered flow ``key``."""
        return self.table.flows[key].uid

    def _drained(self) -> list[FlowKey]:
        """Draining flows whose kernel socket is done sending, or that drained ``DRAIN_MAX_S``: removed from the
        table; returns them. At most ``DRAIN_CHECKS`` are looked up per call, the longest draining first (those
        still sending go to the back)."""
        draining = self.table.draining
        now = time.monotonic()
        turn = list(itertools.islice(draining, DRAIN_CHECKS))
        sending = set(still_sending([k for k in turn if draining[k] > now], self._uid_of))
        for key in turn:
            if key in sending:
                draining[key] = draining.pop(key)
        return self.table.drop([k for k in turn if k not in sending])

    def sample_sending(self, now: float) -> bool:
        """Under a job policy with three jobs or more (two with ``job_share = "auto"``): sample which levels' classes
        are backlogged and give the sending jobs their parts, or (``"auto"``) the part that follows whether the jobs
        saturate the link (``JobScheduler.observe``; the server calls this every ``job_sample_s``). Returns
        whether the classes changed. A failure to read the classes is counted like the reconciler's other errors,
        logged at most every few seconds, and changes nothing."""
        if not self.jobs.samples_wanted():  # (never under the prio backend: it has no guarantees to follow)
            return False
        try:
            backlogged = self.rec.backlogged_levels()
        except Exception as exc:  # noqa: BLE001 - a missed sample only leaves the parts as they are
            self.rec.stats.errors += 1
            self.rec.stats.last_error = f"sampling the classes' backlog: {exc}"
            self.refusal_log.note("sampling", logging.WARNING, "sampling the classes' backlog: %s", exc)  # bounded
            return False
        return self.jobs.observe(backlogged, now) and self.rec.set_shares(self.jobs.shares)

    def sweep(self) -> int:
        """Remove flows whose owners no longer hold their sockets in the agent's network namespace (closed, or the
        process moved to another namespace and holds only a look-alike there). The namespace's socket tables are
        read once per pass. A pass reads at most ``SWEEP_OWNERS`` owners, in pid order from after the last pass's:
        a user who registers from thousands of processes makes the sweep take turns, not stall the agent's loop (an
        owner's exit is seen at once through its pidfd, ``Server.MAX_WATCHED``). A closed socket's flow that the
        kernel still sends keeps its level until it is done (``_let_go``). Returns how many flows went."""
        gone = self._drained() if self.table.draining else []
        example = ""  # (one flow judged closed, for the log line)
        by_pid = self.table.by_pid
        if by_pid:
            pids = sorted(by_pid)
            start = bisect.bisect_right(pids, self._swept_to)
            turn = (pids[start:] + pids[:start])[:SWEEP_OWNERS]
            self._swept_to = turn[-1]
            owners = {pid: list(by_pid[pid]) for pid in turn}  # (unsorted: sorting 50,000 flows cost 50 ms)
            read: list[int] = []  # (the owners judged: at most SWEEP_FDS open files are read per pass)
            closed = self._found_elsewhere(not_owned_by_owners(owners, read, self._fd_of, self._made_by))
            if closed:
                k, e = closed[0], self.table.flows[closed[0]]
                example = f"{k.proto} {k.src}:{k.sport} > {k.dst}:{k.dport} of job {e.job!r}, process {e.pid}, " \
                          f"fd {e.fd}"
            gone += self._let_go(closed)
            self._swept_to = read[-1] if read else self._swept_to
        if gone:
            self._push([], [], gone)
            self.record("socket_closed", "removed")
            self.refusal_log.note("sockets closed", logging.INFO, "removed %d flows whose sockets were closed%s",
                                  len(gone), f" ({example})" if example else "")  # bounded: a user can close at will
        return len(gone)


def _summed_keys(rows: list[dict]) -> list[str]:
    """The counters of class rows that add up over devices (token buckets do not)."""
    keys = {k for r in rows for k in r} - {"level", "class", "prio", "tokens", "ctokens"}
    return sorted(keys)
