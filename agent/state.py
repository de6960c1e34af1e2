"""The desired flow state, in one place: which flow belongs to which job, at which level.

Pure data, no I/O: the reconciler (agent/reconcile.py) makes the kernel match it. Each entry keeps the level the
client asked for (``FlowEntry.level``); the level the flow is given in the kernel (its *effective* level) is
derived from the entry by ``level_of`` -- the identity, unless a job policy is configured (agent/jobs.py sets
it; docs/jobs.md).
Usage: ``table = FlowTable(levels=4); added, moved = table.register("job-a", 0, flows); table.effective_level(k)``
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from tensorlane.agent.config import Config
from tensorlane.agent.protocol import ProtocolError
from tensorlane.flows import FlowKey

USER_JOB_MARK = "@"  # never in a job id a client names (protocol: letters, digits, "_.:-"): only the agent makes it

# Runs of one job id that ``status`` and the log name (the others are counted): one user registering each of its
# flows under a run token of its own made root's status reply, and the log line of each new run, grow by 66 bytes a
# flow (16,000 flows: over the agent's 1 MiB of unread replies, and root's status failed).
SHOWN_RUNS = 8


def user_job_id(job: str, user: str) -> str:
    """User ``user``'s own job under the id ``job`` when another user holds that id on this host: ``job@user``.
    No client can name it, so no one can take it first."""
    return f"{job}{USER_JOB_MARK}{user}"


def job_id_base(job: str) -> str:
    """The id a job was registered under: ``job`` itself, or the id of a user's own job (``user_job_id``)."""
    return job.split(USER_JOB_MARK, 1)[0]


class FlowEntry(NamedTuple):
    """What the agent knows about one registered flow (a tuple of atomic values: not tracked by the GC)."""

    job: str
    level: int
    rank: int | None = None
    pid: int | None = None  # the owning process, when ownership was checked: its exit removes the flow
    uid: int | None = None  # the registering user
    registered_at: float = 0.0
    floor: int = 0  # the most urgent level the registering user may use (level_limits): bounds the effective level
    run: str | None = None  # the run of the job that registered it (the shim's token): two runs = an id conflict
    fd: int | None = None  # the owner's fd that holds the flow's socket, when the client named it: the sweep checks it
    fd_found: bool = False  # ``fd`` found by the agent at the register, not named: not a promise of the client's
    skuid: int | None = None  # a UDP flow's packets get its level only from sockets this user made (None: any)


def requested_level(entry: FlowEntry) -> int:
    """The level the client asked for: the effective level when no job policy is configured."""
    return entry.level


class FlowTable:
    """Registered flows keyed by 5-tuple; every change is validated before anything is modified."""

    def __init__(self, levels: int, max_flows: int = Config.max_flows,
                 level_of: Callable[[FlowEntry], int] = requested_level):
        self.levels = levels
        self.max_flows = max_flows
        self.flows: dict[FlowKey, FlowEntry] = {}
        self.by_pid: dict[int, set[FlowKey]] = {}
        self.by_job: dict[str, set[FlowKey]] = {}
        self.runs: dict[str, dict[str, int]] = {}  # job -> run -> flows (flows registered with a run only)
        self.of_user: dict[int | None, dict[str, int]] = {}  # uid -> job -> its flows (per-user limits)
        self.floors: dict[str, dict[int, int]] = {}  # job -> floor -> its flows (the job's tier: agent/jobs.py)
        self.users: dict[str, dict[int | None, int]] = {}  # job -> uid -> its flows (who may speak for the job)
        self.level_of = level_of  # entry -> effective level (a job policy replaces it: agent/jobs.py)
        # flows whose owner let go of the socket while the kernel still sends what was written to it (``drain``):
        # key -> monotonic deadline, oldest first; no longer in ``by_pid``
        self.draining: dict[FlowKey, float] = {}
        self.changes = 0  # counts the changes of ``flows`` and ``draining``: the crash path's file follows it

    def effective_level(self, key: FlowKey) -> int:
        """The level flow ``key`` gets in the kernel (``level_of`` of its entry)."""
        return self.level_of(self.flows[key])

    def mark(self, key: FlowKey) -> tuple[int, int | None]:
        """What the kernel's maps hold for flow ``key``: its effective level, and for a UDP flow the user whose
        sockets' packets alone get it (``meta skuid``; None: any packet of the 5-tuple, TCP's and those of
        registers that checked no socket). The one desired state the reconciler makes the maps equal to."""
        entry = self.flows[key]
        return self.level_of(entry), entry.skuid if key.proto == "udp" else None

    def register(self, job: str, level: int, flows: tuple[FlowKey, ...], rank: int | None = None,
                 pid: int | None = None, uid: int | None = None, floor: int = 0,
                 run: str | None = None, fds: Mapping[FlowKey, int] | None = None, see_all: bool = True,
                 fds_found: bool = False,
                 skuids: Mapping[FlowKey, int] | None = None) -> tuple[list[FlowKey], list[FlowKey]]:
        """Add ``flows`` for ``job`` at ``level`` (moving the job's own flows that are at another level).

        ``floor``: the most urgent level the registering user may use; a job policy never puts the flows above
        it. ``run``: the run of the job registering (see ``conflicts``). ``fds``: each flow's fd in process ``pid``
        (kept with the flow for the sweep; ``fds_found``: found by the agent, the client named none). ``skuids``:
        the user whose sockets alone send each UDP flow's packets at its level (``mark``). ``see_all``: a
        refusal may name another user's job (root, trusted users); else it says "another user's job" (``_job_of``).
        Returns (added, moved). Raises ProtocolError, changing nothing, when the level is out of range, a flow belongs
        to another job, or the table would overflow.
        """
        if not 0 <= level < self.levels:
            raise ProtocolError("bad_level", f"level {level} out of range 0..{self.levels - 1}")
        added, moved = [], []
        for key in flows:
            cur = self.flows.get(key)
            if cur is None:
                added.append(key)
            elif cur.job != job:
                raise ProtocolError("conflict", f"flow {key} is registered by {self._job_of(cur, uid, see_all)}")
            elif cur.level != level or cur.floor != floor or (skuids or {}).get(key) != cur.skuid:
                moved.append(key)
        if len(self.flows) + len(added) > self.max_flows:
            raise ProtocolError("limit", f"registering {len(added)} flows would exceed {self.max_flows}")
        now = time.time()
        self.changes += 1
        for key in flows:
            self._forget_owner(key)
            self.flows[key] = FlowEntry(job, level, rank, pid, uid, now, floor, run,
                                        fds.get(key) if fds is not None and pid is not None else None, fds_found,
                                        (skuids or {}).get(key))
            self.by_job.setdefault(job, set()).add(key)
            mine = self.of_user.setdefault(uid, {})
            mine[job] = mine.get(job, 0) + 1
            tiers = self.floors.setdefault(job, {})
            tiers[floor] = tiers.get(floor, 0) + 1
            users = self.users.setdefault(job, {})
            users[uid] = users.get(uid, 0) + 1
            if run is not None:
                runs = self.runs.setdefault(job, {})
                runs[run] = runs.get(run, 0) + 1
            if pid is not None:
                self.by_pid.setdefault(pid, set()).add(key)
        return added, moved

    def _forget_owner(self, key: FlowKey) -> None:
        """Drop ``key`` from the indexes (by owner process, by job); the caller then removes or replaces it."""
        old = self.flows.get(key)
        if old is None:
            return
        keys = self.by_job.get(old.job)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.by_job[old.job]
        for index, outer, inner in ((self.of_user, old.uid, old.job), (self.floors, old.job, old.floor),
                                    (self.users, old.job, old.uid)):
            counts = index[outer]
            counts[inner] -= 1
            if not counts[inner]:
                del counts[inner]
                if not counts:
                    del index[outer]
        if old.run is not None:
            runs = self.runs[old.job]
            runs[old.run] -= 1
            if not runs[old.run]:
                del runs[old.run]
                if not runs:
                    del self.runs[old.job]
        self.draining.pop(key, None)
        if old.pid is not None:
            self._leave_pid(key, old.pid)

    def _leave_pid(self, key: FlowKey, pid: int) -> None:
        """Drop ``key`` from process ``pid``'s flows (``by_pid``)."""
        keys = self.by_pid.get(pid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.by_pid[pid]

    def job_floor(self, job: str) -> int:
        """The most urgent level any of ``job``'s registering users may use (its tier under a job policy)."""
        return min(self.floors[job])

    def job_users(self, job: str) -> set[int | None]:
        """The users (uids; None: the agent itself) that registered ``job``'s flows on this host."""
        return set(self.users.get(job, ()))

    def user_flows(self, uid: int | None) -> int:
        """How many flows user ``uid`` registered."""
        return sum(self.of_user.get(uid, {}).values())

    def user_jobs(self, uid: int | None) -> set[str]:
        """The jobs in which user ``uid`` registered flows."""
        return set(self.of_user.get(uid, ()))

    def drain(self, keys: list[FlowKey], until: float) -> None:
        """Keep ``keys`` (registered flows whose owner closed the socket or exited) at their level until ``until``
        or until ``drop``: the kernel still sends what was written before the close. They no longer count as
        their process's (``by_pid``); they stay their job's and their user's."""
        self.changes += bool(keys)
        for key in keys:
            entry = self.flows[key]
            if entry.pid is not None:
                self._leave_pid(key, entry.pid)
                self.flows[key] = entry._replace(pid=None, fd=None, fd_found=False)
            self.draining.pop(key, None)  # (re-inserted: the oldest stay first)
            self.draining[key] = until

    def drop(self, keys: list[FlowKey]) -> list[FlowKey]:
        """Remove ``keys`` whatever their job (their sockets are gone); return those that were present."""
        gone = [k for k in keys if k in self.flows]
        self.changes += bool(gone)
        for key in gone:
            self._forget_owner(key)
            del self.flows[key]
        return gone

    @staticmethod
    def _job_of(entry: FlowEntry, uid: int | None, see_all: bool) -> str:
        """How a refusal to ``uid`` names ``entry``'s job: by its id to root, trusted users (``see_all``) and the
        user that registered the flow; to other users "another user's job" (``status`` names no other user's job to
        them either: an unregister naming each 5-tuple of ``/proc/net/tcp`` told every flow's job id)."""
        return f"job {entry.job!r}" if see_all or entry.uid == uid else "another user's job"

    def unregister(self, job: str, flows: tuple[FlowKey, ...] = (), uid: int | None = None,
                   see_all: bool = True) -> list[FlowKey]:
        """Remove the given flows of ``job`` (all of its flows when ``flows`` is empty); return those removed.

        Raises ProtocolError, changing nothing, if a named flow belongs to another job, or (``uid`` given, not
        root) was registered by another user. Unless ``see_all`` (root, trusted users), a job in which ``uid``
        holds no flow is answered as one without flows (nothing removed): whether another user's job of that id
        exists is not told, and a flow of another user's is refused ``forbidden`` without naming its job.
        """
        if not flows:
            gone = sorted(self.by_job.get(job, ()))
            if not see_all and gone and uid not in self.users.get(job, {}):
                return []
        else:
            gone = []
            for key in flows:
                cur = self.flows.get(key)
                if cur is not None and not see_all and cur.uid not in (None, uid):
                    raise ProtocolError("forbidden", f"flow {key} was registered by another user")
                if cur is not None and cur.job != job:
                    raise ProtocolError("conflict", f"flow {key} is registered by {self._job_of(cur, uid, see_all)}")
                if cur is not None:
                    gone.append(key)
        if uid not in (None, 0):
            for key in gone:
                if self.flows[key].uid not in (None, uid):
                    raise ProtocolError("forbidden", f"flow {key} was registered by another user")
        self.changes += bool(gone)
        for key in gone:
            self._forget_owner(key)
            del self.flows[key]
        return gone

    def by_level(self) -> dict[int, list[FlowKey]]:
        """Flows grouped by effective level (every level present, possibly empty)."""
        out: dict[int, list[FlowKey]] = {lvl: [] for lvl in range(self.levels)}
        for key, entry in self.flows.items():
            out[self.level_of(entry)].append(key)
        return out

    def conflicts(self) -> dict[str, list[str]]:
        """Job ids that two or more runs use on this host now (two jobs that picked the same id, e.g. the same
        ``--rdzv-id``): ``{job: [runs]}``, at most ``SHOWN_RUNS`` of each job's runs (the first by name; how many
        there are: ``conflict_runs``). The agent treats them as one job, so this must be visible."""
        return {job: sorted(runs)[:SHOWN_RUNS] for job, runs in self.runs.items() if len(runs) > 1}

    def conflict_runs(self) -> dict[str, int]:
        """How many runs each job id of ``conflicts`` has."""
        return {job: len(runs) for job, runs in self.runs.items() if len(runs) > 1}

    def jobs(self) -> dict[str, int]:
        """Number of flows per job."""
        return {job: len(keys) for job, keys in self.by_job.items()}
