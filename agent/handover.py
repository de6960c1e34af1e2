"""The flow table across a hand-over restart: the agent that hands over (SIGUSR2) writes it down, the next one
takes back every flow whose owner still holds its socket, through the same checks as a register.

Before (until 2026-11-28) a hand-over kept the kernel's marks for ``INHERIT_S`` (5 s) and no flow: a client that
registered once (``AgentClient.register``, not the shim, which registers again on its own) lost its flows' levels
at every planned restart (a config change, an upgrade), silently. Now the old agent writes each flow's job, level,
rank, run and owner (pid, the process's start time, uid, the fd the client named) to ``flows-handover.json`` in
``state_dir`` (root's, mode 0600), and the new agent, once it has taken its devices over, registers them again as
their owners would: the process must be the same one (its pid and start time; a pid taken by another process since
drops its flows), hold the socket (``not_owned``: one whose socket was closed in the gap is dropped), be of the same
user and still allowed by the new config (``allowed_users``, ``level_limits``, the per-user limits). A flow
registered without an ownership check (root or a ``trusted_users`` member with ``check_ownership``, or the agent
itself) is taken back where its user may still register it so. Levels beyond the new ``levels`` go to the least
urgent one, as the shim's do. The jobs' reported inputs (``report``: step bytes, compute time, ...) come along for
the jobs taken back, so an order by them holds through the restart. The file taken is kept (``TAKING_FILE``)
until the new agent's journal first writes, for one more try (so a second crash in a row loses nothing): a file of
another boot or network namespace, or of a newer format, is dropped with a warning (the shims register again).
Adoption runs before the agent serves: each owner's open files are read once for all its flows, and a group refused
``limit`` stops at its first flow so refused, so no owner makes it cost a request per flow; one user's owners are
read up to ``ADOPT_FILES_PER_USER`` open files in all.
The crash path (since 2026-11-28; before, a crash or SIGKILL lost the flow table): the agent keeps the same document
as it changes in ``flows.json`` (:class:`FlowJournal`: debounced, paced), and the next agent after a crash, with no
hand-over's file, takes it back through the same checks (:func:`adopt_after_crash`) once the agent that wrote it is
gone; the file is taken only as the agent wrote it (:func:`read_own_file`).
Usage: ``write_flows(cfg, table)`` at a hand-over; ``adopt_flows(cfg, api)``, else ``adopt_after_crash(cfg, api)``,
before serving; ``FlowJournal(cfg, table).tick()`` in the loop
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import pwd
import threading
import time
from pathlib import Path

from tensorlane.agent.files import read_own_file, write_atomically, write_json_atomically, writer_runs
from tensorlane.agent.ownership import MAX_OWNER_FDS, UndecidedPorts, netns_of, not_owned, not_owned_by_owners
from tensorlane.agent.peers import Peer, account_uid, proc_status, process_start
from tensorlane.agent.state import FlowEntry, FlowTable, job_id_base
from tensorlane.flows import FlowKey, TooManyFiles

log = logging.getLogger("tensorlane.agent")

FLOWS_FILE = "flows-handover.json"  # in state_dir (not agent-*.json: not a device's record)
FLOWS_FORMAT = 1
# register requests one user's flows may take at the start (neither root nor trusted_users, as the per-user
# limits): one job, level, rank and run each, so an honest process takes at most jobs x levels of them; a user whose
# 5,000 flows had a rank each made as many requests (1.8 s before the agent served, 18 s at max_flows_per_user);
# the rest are left out (``requests``)
ADOPT_REQUESTS_PER_USER = 2048
# open files of one user's owners (neither root nor trusted_users) that the start reads to find the sockets of
# flows registered without fds, all its processes together; the flows of its owners beyond are left out (``files``):
# a user whose 100 processes held 8,000 open files and one such flow each kept the next agent from serving for 25 s
# (a readlink each, about 31 us on this loaded host), and nothing bounded the processes (the sweep reads them by
# the fd its register found, at no cost). 65,536 are 8 processes at ``MAX_OWNER_FDS``.
ADOPT_FILES_PER_USER = 65_536
ADOPT_CHUNK = 512  # flows per register: 1,024 (the most a message may name) of IPv4 flows exceed its 64 KiB
CRASH_FILE = "flows.json"  # in state_dir: the flow table as it stands, for the next agent after a crash
# in state_dir: a flow table file an agent took (renamed, the crash path's or a hand-over's) and is taking back, until
# its journal's first write; the next agent takes it back once more (an agent killed while it took the flows back,
# or before its first write), then it is gone (an adoption that kills each agent does not keep them from starting)
TAKING_FILE = "flows-taking.json"
# the crash path's writes (FlowJournal): the first change not written waits JOURNAL_DEBOUNCE_S for the rest of its
# burst (a shim's registers come within milliseconds), and a write comes JOURNAL_MIN_GAP_S after the last one at
# the earliest, or JOURNAL_PACE times its duration (at most 1/JOURNAL_PACE, 5 %, of the agent's time spent writing)
JOURNAL_DEBOUNCE_S = 0.1
JOURNAL_MIN_GAP_S = 0.5
JOURNAL_PACE = 20
# a killed agent's flows registered without an owner process (root's, or trusted_users' without check_ownership:
# no process, start time or socket to check) are taken back only from a file that agent touched this recently (each
# reconcile pass): from an older one their 5-tuples may be another user's connections since (``stale``)
CRASH_OWNERLESS_S = 120.0
# the writes run in a thread (FlowJournal.tick): the loop looks whether one ended every JOURNAL_POLL_S while it runs;
# the writer lets the GIL go every JOURNAL_CHUNK flows it encodes and writes (json.dumps of a whole document holds it
# for the whole call: written as one part, 100,000 flows held requests up to 51 ms, in parts of 256 up to 19 ms)
JOURNAL_POLL_S = 0.02
JOURNAL_CHUNK = 256
JOURNAL_RETRY_S = 10.0  # after a failed write (the state_dir full or read-only): logged once until one succeeds


def flows_path(cfg) -> Path:
    return Path(cfg.state_dir) / FLOWS_FILE


def crash_path(cfg) -> Path:
    return Path(cfg.state_dir) / CRASH_FILE


def taking_path(cfg) -> Path:
    return Path(cfg.state_dir) / TAKING_FILE


class _Write:
    """One write of the journal's, run off the loop (:meth:`FlowJournal.tick`): what it writes, then how it went."""

    def __init__(self, now: float, changes: int):
        self.now = now  # the loop's monotonic time when it began (the pacing's)
        self.changes = changes  # table.changes it holds
        self.t0 = time.monotonic()
        self.error: BaseException | None = None
        self.secs = 0.0
        self.thread: threading.Thread | None = None


class FlowJournal:
    """The flow table kept on disk as it changes (``flows.json`` in ``state_dir``, the hand-over's format:
    :func:`flows_doc`), so that the next agent after a crash or SIGKILL takes its flows back
    (:func:`adopt_after_crash`). Written whole (a temporary file, then a rename), debounced and paced
    (``JOURNAL_*``): the server loop asks :meth:`due_in` and calls :meth:`tick`, which takes the table as it stands
    (a copy of its dict: entries are tuples, replaced at a change, never changed in place) and encodes and writes it
    in a thread, a flow's JSON kept from one write to the next while its entry is the same, the GIL let go every
    ``JOURNAL_CHUNK`` flows, so a large table does not hold the loop's requests (until 2026-11-29 the loop built and
    wrote the document itself: 100,000 flows held every request 0.4-2.4 s a write). A write holds the table as it
    stood when it began; ``table.changes`` tells a change.
    Usage: ``j = FlowJournal(cfg, table, lambda: jobs.reported); j.tick()`` in the loop; ``j.remove()`` at a stop"""

    def __init__(self, cfg, table: FlowTable, reported=dict):
        self.path = crash_path(cfg)
        self.taking = taking_path(cfg)  # the file this agent took back, removed once its own is written
        self.table = table
        self.reported = reported  # () -> the jobs' reported inputs, written along
        self.written: int | None = None  # table.changes at the last write (None: none yet)
        self.since: float | None = None  # when the first change not written was seen (monotonic)
        self.next_at = 0.0  # the earliest next write (monotonic)
        self.starts: dict[int, int | None] = {}  # owner pid -> its start time (the writer's; flows_doc's cache)
        # the writer's: each flow's entry and JSON at the last write (no new object a flow whose entry is the same: the
        # collector's full passes came sooner with a tuple a flow, 60-90 ms each with 50,000 flows)
        self.entries: dict[FlowKey, FlowEntry] = {}
        self.texts: dict[FlowKey, str] = {}
        self.pending: _Write | None = None  # the write running in the background
        self.writes = 0  # writes that succeeded
        self.errors = 0  # writes that failed (``status``'s ``flow_table``, the metrics' ``flow_table`` source)
        self.last_s = 0.0  # the last write's duration (the thread's, from the copy of the table to the rename)
        self.error = ""  # why the last write failed ("": it succeeded, or none ran yet; :attr:`failing`)

    def due_in(self, now: float) -> float | None:
        """Seconds until the next write is due, or until the loop looks whether the one running ended (0: now), or
        None: nothing to write."""
        if self.pending is not None:
            return JOURNAL_POLL_S if self.pending.thread.is_alive() else 0.0
        if self.table.changes == self.written:
            return None
        if self.since is None:
            self.since = now
        return max(0.0, self.since + JOURNAL_DEBOUNCE_S - now, self.next_at - now)

    def tick(self, now: float | None = None) -> bool:
        """Take the outcome of a write that ended; start one in the background if one is due; whether one started."""
        now = time.monotonic() if now is None else now
        if self.pending is not None:
            if self.pending.thread.is_alive():
                return False
            self.wait()
        wait = self.due_in(now)
        if wait is None or wait > 0:
            return False
        job = _Write(now, self.table.changes)
        snapshot = self._snapshot()
        job.thread = threading.Thread(target=self._background, args=(job, snapshot), name="tensorlane-journal",
                                      daemon=True)  # (an agent killed mid-write leaves the temporary file only)
        self.pending = job
        job.thread.start()
        return True

    def wait(self) -> bool:
        """Wait for the write running in the background, if any, and take its outcome: whether it succeeded (True:
        none ran). A failure is logged (once until a write succeeds) and retried later."""
        job, self.pending = self.pending, None
        if job is None:
            return True
        job.thread.join()
        return self._finish(job)

    def flush(self) -> bool:
        """Write the table now if it changed since the last write (a hand-over stop)."""
        self.wait()
        return self.table.changes != self.written and self.write()

    def write(self, now: float | None = None) -> bool:
        """Write the table now, in this thread, once a write in the background ended (``now``: the loop's monotonic
        time, the pacing's); a failure is logged (once until a write succeeds) and retried later."""
        self.wait()
        job = _Write(time.monotonic() if now is None else now, self.table.changes)
        self._background(job, self._snapshot())
        return self._finish(job)

    def _snapshot(self) -> tuple:
        """The table as it stands, cheaply (C-level copies; the loop's part of a write): its flows, the keys
        draining, the owners, the reported inputs' JSON, the time. (A dict's copy: one object for the collector,
        not a tuple a flow.)"""
        table = self.table
        return (dict(table.flows), set(table.draining), set(table.by_pid), json.dumps(self.reported() or {}),
                time.time())

    def _background(self, job: _Write, snapshot: tuple) -> None:
        """Encode and write ``snapshot`` (:meth:`_snapshot`); the outcome in ``job`` (the writer thread's part)."""
        try:
            write_atomically(self.path, self._parts(*snapshot), 0o600)
        except BaseException as exc:  # (taken by the loop: wait)
            job.error = exc
        job.secs = time.monotonic() - job.t0

    def _parts(self, flows, draining, owners, reported: str, written_at: float):
        """The text of :func:`flows_doc`'s document as ``json.dumps`` writes it, in parts of ``JOURNAL_CHUNK``
        flows, a flow's JSON reused while its entry and owner's start time are the same; the GIL is let go between
        parts (``json.dumps`` of the whole document held it for the whole call)."""
        starts = self.starts
        for pid in [p for p in starts if p not in owners]:
            del starts[pid]  # (an owner without flows: its pid may be another process's by the next one)
        yield json.dumps(_doc_head(written_at))[:-1] + ', "flows": ['
        old_entry, old_text, chunk, sep = self.entries, self.texts, [], ""
        entry: dict[FlowKey, FlowEntry] = {}
        texts: dict[FlowKey, str] = {}
        # (no new object a flow whose JSON is kept: a copy of the table or new tuples each write made the
        # collector's full passes come sooner, 60 ms at 10,000)
        for key, e, start in _kept_flows(flows, draining, starts):
            text = old_text[key] if old_entry.get(key) is e else json.dumps(flow_record(key, e, start))
            entry[key], texts[key] = e, text
            chunk.append(text)
            if len(chunk) == JOURNAL_CHUNK:
                yield sep + ", ".join(chunk)
                chunk, sep = [], ", "
                time.sleep(0)  # (the loop's requests take the GIL here)
        if chunk:
            yield sep + ", ".join(chunk)
        self.entries, self.texts = entry, texts
        yield '], "reported": ' + reported + "}"

    def _finish(self, job: _Write) -> bool:
        """The loop's part after a write: the pacing, the taken file's removal, the failure's log."""
        self.last_s = job.secs
        if job.error is not None:
            first, self.errors = not self.failing, self.errors + 1
            self.error = str(job.error) or type(job.error).__name__
            self.next_at = job.now + JOURNAL_RETRY_S
            if not isinstance(job.error, OSError):  # (not written either: the loop logs it, as a reconcile error)
                raise job.error
            if first:
                log.error("cannot write the flow table to %s: %s (retried every %.0f s; an agent killed meanwhile "
                          "loses the flows of clients that do not register again)", self.path, job.error,
                          JOURNAL_RETRY_S)
            return False
        if self.failing:
            log.warning("the flow table is written to %s again", self.path)
        if self.written is None:
            with contextlib.suppress(OSError):
                self.taking.unlink()  # (this agent's own table on disk now)
        self.error = ""
        self.written, self.since, self.writes = job.changes, None, self.writes + 1
        self.next_at = job.now + max(JOURNAL_MIN_GAP_S, JOURNAL_PACE * job.secs)
        return True

    def describe(self) -> dict:
        """``status``'s ``flow_table``: the file, writes that succeeded and failed, and why the last one failed
        ("" when it succeeded, or none was due yet)."""
        return {"path": str(self.path), "writes": self.writes, "errors": self.errors, "failing": self.error}

    @property
    def failing(self) -> bool:
        """Whether the last write failed: the file holds an older table (or none)."""
        return bool(self.error)

    def touch(self) -> None:
        """Stamp the file as this agent's, alive now (each reconcile pass; ``CRASH_OWNERLESS_S``), while it holds the
        table: not while writes fail (``state_dir`` full or read-only), when the file is an older table whose flows
        without an owner may have been unregistered since and their 5-tuples be another user's connections by now
        (until 2026-11-28 the stale file was stamped fresh all the same, and a crash then took them back)."""
        if self.written is not None and not self.failing:
            with contextlib.suppress(OSError):  # (through no link: until 2026-11-29 a link there had its target's
                os.utime(self.path, follow_symlinks=False)  # time set, any file's; the link is refused when read)

    def remove(self) -> None:
        """Remove the file (a stop that restores: the flows' marks are gone with the agent's table), once a write
        running in the background ended (it would put the file back)."""
        with contextlib.suppress(Exception):
            self.wait()
        for path in (self.path, self.taking):
            with contextlib.suppress(OSError):
                path.unlink()


def boot_id() -> str:
    """This boot's id (pids and start times mean nothing across a reboot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def netns_id() -> list[int]:
    """This agent's network namespace as the hand-over file writes it (``ownership.netns_of``, as a JSON list)."""
    return list(netns_of("self"))


def flows_doc(table: FlowTable, reported: dict | None = None, starts: dict[int, int | None] | None = None) -> dict:
    """The flow table file's document: ``table``'s flows (not those draining: their owners let go; not those whose
    owner is gone already: the sweep would drop them) and the jobs' ``reported`` inputs. ``starts`` caches each
    owner's start time (:func:`process_start`) from one document to the next (the journal's)."""
    starts = {} if starts is None else starts
    flows = [flow_record(key, e, start) for key, e, start in _kept_flows(table.flows, table.draining, starts)]
    return {**_doc_head(time.time()), "flows": flows, "reported": reported or {}}


def _doc_head(written_at: float) -> dict:
    """The flow table file's fields before its flows: the format, this boot, namespace and agent, the time."""
    return {"format": FLOWS_FORMAT, "boot_id": boot_id(), "netns": netns_id(), "agent_pid": os.getpid(),
            "agent_start": process_start(os.getpid()), "written_at": written_at}


def _kept_flows(flows: dict, draining, starts: dict[int, int | None]):
    """``(key, entry, its owner's start time)`` of the flows a flow table file holds: not those draining (their
    owners let go), nor those whose owner is gone already (the sweep would drop them). ``starts`` caches each
    owner's start time (:func:`process_start`)."""
    for key, e in flows.items():
        if key in draining:
            continue
        pid = e.pid
        if pid is not None and pid not in starts:
            starts[pid] = process_start(pid)
        start = starts.get(pid)
        if pid is not None and start is None:
            continue
        yield key, e, start


def flow_record(key: FlowKey, e: FlowEntry, start: int | None) -> dict:
    """One flow of the flow table file: ``key``, its entry ``e`` and its owner's ``start`` time."""
    return {"flow": list(key), "job": e.job, "level": e.level, "rank": e.rank, "run": e.run, "pid": e.pid,
            "start": start, "uid": e.uid, "fd": None if e.fd_found else e.fd}


def write_flows(cfg, table: FlowTable, reported: dict | None = None) -> int:
    """Write ``table``'s flows and the jobs' ``reported`` inputs (``JobScheduler.reported``) for the next agent
    (:func:`flows_doc`); returns how many flows. A failure is logged: the next agent then takes back the flow table
    the crash path kept (:class:`FlowJournal`), as after a crash."""
    doc = flows_doc(table, reported)
    path = flows_path(cfg)
    try:
        write_json_atomically(path, doc, 0o600)
    except OSError as exc:
        log.error("handing over: cannot write the flow table to %s: %s (the next agent takes back the one kept for "
                  "a crash, %s, up to its last write)", path, exc, crash_path(cfg))
        return 0
    return len(doc["flows"])


def _read(path: Path, what: str, gone_writer: bool = False, keep: Path | None = None
          ) -> tuple[list[dict] | None, dict, float]:
    """The flows, reported inputs and age (seconds since it was last written or touched) of a flow table file
    (``what``: whose, for the log), after the file's checks (None: no file, or not one to take). A file taken is
    kept as ``keep`` (renamed: :data:`TAKING_FILE`) until this agent's journal first writes, so that an agent killed
    while it takes the flows back, or before that write, leaves them to the next one (until 2026-11-28 the file was
    removed once read, and a second crash in a row lost the table); ``keep`` None: removed (read once), as is a file
    not taken. With ``gone_writer`` (the crash path's), a file whose agent still runs (its pid and start time) is
    not taken, nor removed."""
    try:
        got = read_own_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read %s: %s (its flows are not taken back; their clients register again)", path, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None, {}, 0.0
    if got is None:
        return None, {}, 0.0
    raw, age = got[0], time.time() - got[1]
    try:
        doc = json.loads(raw)
        fmt, flows, reported = doc.get("format", 1), doc["flows"], doc.get("reported") or {}
        if not isinstance(flows, list) or not isinstance(reported, dict):
            raise TypeError("flows is not a list, or reported not an object")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s is not %s flow table, or was cut short (%s): its flows are not taken back (their clients "
                    "register again)", path, what, exc)
        with contextlib.suppress(OSError):
            path.unlink()
        return None, {}, age
    if gone_writer and _writer_runs(doc):
        log.warning("%s is the flow table of agent pid %s, which still runs: not taken back", path,
                    doc.get("agent_pid"))
        return None, {}, age
    taken = True
    if not isinstance(fmt, int) or fmt > FLOWS_FORMAT:
        log.warning("%s is of format %r, newer than this agent's (%d): its flows are not taken back (their clients "
                    "register again)", path, fmt, FLOWS_FORMAT)
        taken = False
    elif doc.get("boot_id") != boot_id() or doc.get("netns") != netns_id():
        log.warning("%s was written in another boot or network namespace: its flows are not taken back", path)
        taken = False
    with contextlib.suppress(OSError):
        if keep is None or not taken:
            path.unlink()
        else:
            os.replace(path, keep)
    return (flows, reported, age) if taken else (None, {}, age)


def _writer_runs(doc: dict) -> bool:
    """Whether the agent that wrote a flow table file still runs (:func:`writer_runs`, the rule a device's record is
    judged by): its pid holds the same process (its start time); a file without a start time is taken; never this
    agent."""
    pid, start = doc.get("agent_pid"), doc.get("agent_start")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, int):
        return False
    return writer_runs(pid, start, unstamped_root=False)


def _peer(uid: int, pid: int, start: int | None, pidfd: int | None) -> tuple[Peer | None, str]:
    """The owner of flows as a register's peer, or None and why not: the same process (``pid`` and ``start``) of
    the same user, with its groups now; for flows registered without a process, the user itself."""
    if pidfd is None:  # (no owner process: the user, as its own account has it)
        try:
            pw = pwd.getpwuid(uid)
            gids = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
            gid = pw.pw_gid
        except KeyError:
            gid, gids = uid, ()
        return Peer(os.getpid(), uid, gid, gids), ""
    if process_start(pid) != start:
        return None, "owner_gone"
    try:
        fields = proc_status(pid)
        euid, egid = int(fields["Uid"].split()[1]), int(fields["Gid"].split()[1])
        gids = tuple(int(g) for g in fields.get("Groups", "").split())
    except (OSError, KeyError, ValueError, IndexError):
        return None, "owner_gone"
    if account_uid(euid) != uid:
        return None, "owner_changed_user"
    return Peer(pid, uid, egid, gids, pidfd=pidfd), ""


def adopt_flows(cfg, api) -> dict[str, int] | None:
    """Register again, through ``api``, the flows a hand-over left (:func:`write_flows`); returns counts
    ``{"adopted": n, reason: n, ...}`` and logs them (None: no hand-over's table was read). The crash path's file is
    then stale (the hand-over's is the later): removed. See :func:`_adopt`."""
    flows, reported, age = _read(flows_path(cfg), "a hand-over's", keep=taking_path(cfg))
    if flows is None:
        return None
    with contextlib.suppress(OSError):
        crash_path(cfg).unlink()
    flows, stale = _without_stale(flows, age)
    return _adopting(cfg, api, flows, reported, "the agent that handed over", stale, _when(age) if stale else "")


def adopt_after_crash(cfg, api) -> dict[str, int] | None:
    """Register again, through ``api``, the flows of the flow table a killed agent kept (:class:`FlowJournal`), as
    :func:`adopt_flows` does a hand-over's, with the same checks; None: no such table was read (none, its agent still
    runs, cut short, another boot's). Its flows registered in the last moments before the crash (the journal's
    debounce) are not in it: the caller keeps the kernel's marks for ``INHERIT_S`` all the same."""
    whose = "the killed agent kept in its file"
    flows, reported, age = _read(crash_path(cfg), "a killed agent's", gone_writer=True, keep=taking_path(cfg))
    if flows is None and not crash_path(cfg).exists():  # (none, or not one to take: removed; a live agent's: kept)
        # (an agent killed while it took this one back, or before its first write: taken back once more, the last)
        flows, reported, age = _read(taking_path(cfg), "a killed agent's", gone_writer=True)
        whose = "the killed agent kept in its file (the last try: the agent before this one was killed taking them)"
    if flows is None:
        return None
    flows, stale = _without_stale(flows, age)
    return _adopting(cfg, api, flows, reported, whose, stale, _when(age))


def _when(age: float) -> str:
    """How old a flow table file is, for the log: ``age`` seconds (wall clock) before this start, or unknown where it
    is stamped after now (the clock went back since it was written or touched)."""
    if age < 0.0:
        return f", stamped {-age:.0f} s after this start (the clock went back since: its age is unknown)"
    return f", {age:.0f} s before this start"


def _without_stale(flows: list, age: float) -> tuple[list, dict[str, int]]:
    """``flows`` less those registered without an owner process when the file is older than ``CRASH_OWNERLESS_S``
    (their 5-tuples may be another user's connections since), and their count (``stale``). A hand-over's file too:
    one whose next agent did not start (a start that failed, an operator back an hour later) is as old as a dead
    agent's (until 2026-11-28 its flows without an owner were taken back at any age). A file stamped after now (``age``
    below 0: the wall clock stepped back since) is of unknown age and counts as old: until 2026-11-29 its negative age
    passed as fresh, and a killed agent's flows without an owner were taken back from a file hours old."""
    if 0.0 <= age <= CRASH_OWNERLESS_S:  # (below 0: stamped after now, the clock went back since; its age unknown)
        return flows, {}
    kept = [f for f in flows if not isinstance(f, dict) or f.get("pid") is not None]
    return kept, ({"stale": len(flows) - len(kept)} if len(kept) < len(flows) else {})


def _adopting(cfg, api, *args) -> dict[str, int]:
    """:func:`_adopt` of a file kept as :data:`TAKING_FILE` until this agent's journal first writes; a failure
    removes it (a file that fails every start would keep the agent from ever starting)."""
    try:
        return _adopt(cfg, api, *args)
    except Exception:
        with contextlib.suppress(OSError):
            taking_path(cfg).unlink()
        raise


def _adopt(cfg, api, flows: list, reported: dict, whose: str, left: dict[str, int] | None = None,
           when: str = "") -> dict[str, int]:
    """Register again the ``flows`` of a flow table file; returns counts ``{"adopted": n, reason: n, ...}`` and
    logs them (``whose``: the table's, ``when`` its age, for the log; ``left``: flows left out before, by reason).
    Each owner's flows go
    in requests of one job, level, rank and run, checked as its own would be, after one look at its open files for
    the sockets it no longer holds (:func:`_not_held`); a request still refused is split until the flows at fault
    are found, a flow refused ``limit`` ends its group, and a user takes at most ``ADOPT_REQUESTS_PER_USER``."""
    counts: collections.Counter = collections.Counter(left or {})  # flows by outcome: "adopted", or why not
    requests: collections.Counter = collections.Counter()  # registers made, by user (None: privileged)
    if not flows and not counts:
        return {}
    groups: dict[tuple, list[dict]] = {}
    for f in flows:
        try:
            key = FlowKey(*f["flow"])
            group = (f["pid"], f["start"], f["uid"], job_id_base(f["job"]), f["job"] != job_id_base(f["job"]),
                     min(int(f["level"]), cfg.levels - 1), f["rank"], f["run"], f["fd"] is not None)
            hash(group)
        except (KeyError, TypeError, ValueError):
            counts["unreadable"] += 1
            continue
        groups.setdefault(group, []).append({"flow": key.as_dict(), "fd": f["fd"], "job": f["job"]})
    taken: dict[str, set[str]] = {}  # the job each flow was under -> the jobs it is under now
    judged: dict[tuple, set[FlowKey]] = {}  # (pid, start, uid) -> its flows whose socket it no longer holds
    found: dict[FlowKey, int] = {}  # the fd found holding each of those it holds, that the client named none of
    files: collections.Counter = collections.Counter()  # open files read, by user (ADOPT_FILES_PER_USER)
    unread: set[tuple] = set()  # owners not judged: their user's open files were read up to the bound

    def judge(owner: tuple, peer: Peer) -> None:
        """Note in ``judged`` the flows of ``owner`` whose sockets it no longer holds, all its groups at once (all
        of them, in ``unread``, once its user's ``ADOPT_FILES_PER_USER`` open files were read)."""
        owner_groups = [g for g in groups if g[:3] == owner]
        user = None if api.policy.privileged(peer) else peer.uid
        if user is not None and files[user] >= ADOPT_FILES_PER_USER:
            unread.add(owner)
            judged[owner] = {FlowKey(**i["flow"]) for g in owner_groups for i in groups[g]}
            return
        read: list[int] = []
        judged[owner] = _not_held(peer, owner_groups, groups, found, read)
        files[user] += sum(read)

    for group in sorted(groups, key=lambda g: (g[4], str(g))):  # jobs under their own id first, then users' own
        pid, start, uid, job, _mapped, level, rank, run, named = group
        if uid is not None and requests[account_uid(uid)] >= ADOPT_REQUESTS_PER_USER:  # (its registers spent:
            counts["requests"] += len(groups[group])  # before a look at its process, 0.3 ms a group: 50,000 groups
            continue  # of one user, a rank each, kept the agent from serving 16 s with the registers bounded)
        pidfd = None
        if pid is not None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                counts["owner_gone"] += len(groups[group])
                continue
        try:
            peer, why = (None, "") if uid is None else _peer(uid, pid, start, pidfd)
            if why:
                counts[why] += len(groups[group])
                continue
            if peer is not None and not api.policy.allowed(peer):
                counts["not_allowed"] += len(groups[group])
                continue
            items = groups[group]
            owner = (pid, start, uid) if pid is not None and api.policy.must_own(peer) else None
            if owner is not None and owner not in judged and not named:  # (at once: the fds found make it cheaper)
                judge(owner, peer)
            keys = [FlowKey(**i["flow"]) for i in items]
            by_fd = not named and bool(keys) and all(k in found for k in keys)  # (its fds found: named, then marked
            if by_fd:  # found again, as the register marks those it finds: a client's word was never given)
                items = [i | {"fd": found[k]} for i, k in zip(items, keys, strict=True)]
            stop: list[str] = []
            for i in range(0, len(items), ADOPT_CHUNK):
                chunk = items[i:i + ADOPT_CHUNK]
                if owner is not None and owner not in judged:  # (fds named: judged once a register is refused)
                    if _register(api, peer, job, level, rank, run, named, chunk, counts, requests, stop, taken,
                                 split=False):
                        continue
                    judge(owner, peer)
                if owner is not None:
                    kept = [c for c in chunk if FlowKey(**c["flow"]) not in judged[owner]]
                    if len(kept) < len(chunk):
                        counts["files" if owner in unread else "not_owner"] += len(chunk) - len(kept)
                    chunk = kept
                if chunk:
                    _register(api, peer, job, level, rank, run, named or by_fd, chunk, counts, requests, stop, taken)
            if by_fd:
                for k in keys:
                    if (e := api.table.flows.get(k)) is not None and e.pid == pid and e.fd == found[k]:
                        api.table.flows[k] = e._replace(fd_found=True)
        finally:
            if pidfd is not None:
                os.close(pidfd)
    _take_reported(api, reported, taken)
    adopted = counts.pop("adopted", 0)
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
    log.warning("took back %d of the %d flows %s%s%s", adopted, len(flows) + sum((left or {}).values()), whose, when,
                f" (not taken back: {dropped})" if dropped else "")
    api.taken_back = {"adopted": adopted, **counts}  # (tensorlane_agent_handover_flows_total: not the requests')
    return dict(api.taken_back)


def _take_reported(api, reported: dict, taken: dict[str, set[str]]) -> None:
    """Give the jobs taken back the inputs their shims had reported (the order by them, at once, not after the
    shims' next report), under the job their flows are under now (``taken``): a user's own job ``ID@USER`` is
    ``ID`` once the user who held ``ID`` was not taken back, and took that user's inputs (its order by another
    user's step bytes) while its own were dropped. Inputs of a job none of whose flows were taken back, or that
    the order cannot rank, are left out."""
    for was, inputs in sorted(reported.items()):
        now = taken.get(was, set())
        if len(now) != 1 or not isinstance(inputs, dict):
            continue
        job = next(iter(now))
        sent = {k: v for k, v in inputs.items() if k in api.jobs.inputs and isinstance(v, (int, float))}
        if sent:
            with contextlib.suppress(Exception):  # noqa: BLE001 - (bad_request: not rankable) the next report
                api._take_inputs(job, sent, None)


def _not_held(peer, owner_groups: list[tuple], groups: dict[tuple, list[dict]],
              found: dict[FlowKey, int], files: list[int] | None = None) -> set[FlowKey]:
    """The flows of one owner (``peer``: its process, pinned) whose sockets it no longer holds, in one look at its
    open files for all of them: before, each refused register was split in halves down to the flows at fault, every
    request reading the process's open files again, and an owner that closed half of its 2,000 sockets in the gap
    kept the next agent from serving for 28 s (4,000 requests; 10,000 flows: over 5 minutes). ``found`` gets the fd
    that holds each held flow's socket where the client named none (``not_owned``): the registers then name it, and
    read no other open file (each read them all: 10,000 flows over 4 owners took 1.7-2 s, 0.3-0.4 s so). Flows
    whose ports could not all be looked at (``UndecidedPorts``), or of an owner of too many open files, are judged
    as the sweep judges owners (``not_owned_by_owners``). A flow judged held goes through the register's own check.
    ``files`` gets how many open files were read."""
    fd_of = {FlowKey(**i["flow"]): i["fd"] for g in owner_groups for i in groups[g]}
    user = None if peer.uid == 0 else peer.uid
    unnamed = [k for k, fd in fd_of.items() if fd is None]
    mine: dict[FlowKey, int] = {}
    try:
        with peer.pinned():
            try:
                gone = set(not_owned(peer.pid, unnamed, uid=user, found=mine, files=files)) if unnamed else set()
            except (UndecidedPorts, TooManyFiles):
                if files is not None:
                    files.append(MAX_OWNER_FDS)  # (listed up to the bound, or read, before it was refused)
                return set(not_owned_by_owners({peer.pid: list(fd_of)}, fd_of=fd_of.get, uid_of=lambda k: user))
            named = [k for k, fd in fd_of.items() if fd is not None]
            gone |= set(not_owned_by_owners({peer.pid: named}, fd_of=fd_of.get, uid_of=lambda k: user))
            found.update(mine)
            return gone
    except (ProcessLookupError, OSError):
        return set(fd_of)


def _register(api, peer, job, level, rank, run, named, items, counts, requests: collections.Counter, stop: list[str],
              taken: dict[str, set[str]], depth: int = 0, split: bool = True) -> bool:
    """One register of ``items`` as ``peer``, whether it was taken; a refusal splits them in halves (at most log2 of
    the group deep), or with ``split`` False, is left to the caller (not counted). ``counts`` gets the flows by
    outcome, ``requests`` the registers made by user.
    Once one flow alone is refused ``limit`` (the user's or the table's, which only fill), the rest of its group
    (``stop``) is counted so without a request: each would cost the register's ownership check."""
    if stop:
        counts[stop[0]] += len(items)
        return False
    user = None if peer is None or api.policy.privileged(peer) else peer.uid  # (no per-user limits: none here)
    if user is not None and requests[user] >= ADOPT_REQUESTS_PER_USER:
        counts["requests"] += len(items)
        return False
    requests[user] += 1
    req = {"op": "register", "id": "handover", "job": job, "level": level, "flows": [i["flow"] for i in items]}
    if rank is not None:
        req["rank"] = rank
    if run is not None:
        req["run"] = run
    if named:
        req["fds"] = [i["fd"] for i in items]
    reply = json.loads(api.handle(json.dumps(req).encode(), peer))
    if reply["ok"]:
        counts["adopted"] += len(items)
        for i in items:
            taken.setdefault(i["job"], set()).add(reply["result"]["job"])
        return True
    if not split:
        return False
    if len(items) == 1 or depth > 20:
        counts[reply["error"]["code"]] += len(items)
        if reply["error"]["code"] == "limit":
            stop.append("limit")
        return False
    half = len(items) // 2
    _register(api, peer, job, level, rank, run, named, items[:half], counts, requests, stop, taken, depth + 1)
    _register(api, peer, job, level, rank, run, named, items[half:], counts, requests, stop, taken, depth + 1)
    return False
