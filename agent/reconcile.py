"""Make the kernel match the desired state: the qdisc tree of the backend and the nftables flow maps.

Incremental changes (a registration, or the flows a job-order change moves) go out as one nftables transaction; a
full pass compares the kernel's maps with the FlowTable and repairs any drift (run periodically and after any
failed change). The kernel gets each flow's *effective* level (``FlowTable.effective_level``: the level asked
for, or what the job policy makes of it).
Every queue device gets the same class layout (one backend kind, the same class ids), each at its own rate, so
one flow map serves every managed interface.
Usage: ``rec = Reconciler([Device("eth0", 2, backend)], dscp, {"eth0": 2}, ipr); rec.install()``
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

from tensorlane.agent.config import Config
from tensorlane.agent.kernel import links, qdisc, tcstats
from tensorlane.agent.kernel import nft as nftables
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey

log = logging.getLogger("tensorlane.reconcile")
EGRESS_TTL_S = 10.0  # a route lookup's answer is reused this long (routes rarely change; status and list are rare)
EGRESS_LOOKUPS = 256  # new route lookups per call at most (pyroute2: about 0.35 ms each)
EGRESS_CACHE_MAX = 65_536
INHERIT_S = 5.0  # a killed agent's marks kept this long by the next one: the shims re-register within 2 s
# A full pass lists the whole nftables table, which the agent's loop waits for (libnftables: about 1.2 s at 50,000
# flows on this 2-core machine): the flows' part of a pass runs only once this share of the time since the last
# one has passed, so that listing the marks takes at most 5 % of the agent's time, whoever filled the table (every
# pass with a few thousand flows: milliseconds each).
FLOW_CHECK_SHARE = 0.05
# A device's tree put back the same way again within this many seconds: a tool keeps changing it (a fight). Said
# once as such, then the put-back line is logged at most this often with how many were not (each is counted).
FIGHT_LOG_S = 60.0


class _Paced:
    """A listing of the whole nftables table, run again only once 1 / ``FLOW_CHECK_SHARE`` times its last duration
    has passed since it last ran; ``result`` keeps what the last run gave (``due``, then ``ran``)."""

    def __init__(self, result):
        self.at, self.took, self.result = -float("inf"), 0.0, result

    def due(self, now: float) -> bool:
        return now - self.at >= self.took / FLOW_CHECK_SHARE

    def ran(self, started: float, result) -> None:
        self.at, self.took, self.result = started, time.monotonic() - started, result

    def reset(self) -> None:
        """Due at once, whatever the last run cost."""
        self.at = -float("inf")


@dataclass
class ReconcileStats:
    passes: int = 0
    repairs: int = 0
    errors: int = 0
    last_error: str = ""
    last_pass_s: float | None = None  # time.monotonic() when the last full pass began (health.Health reads it)
    last_pass_failed: bool = False  # whether that pass failed


@dataclass(frozen=True)
class Device:
    """A device that carries queues: its name, index, the backend object of its tree and the managed interface
    it serves (itself, or the bond it is a member of)."""

    name: str
    index: int
    backend: object
    serves: str = ""
    kind: str = ""  # IFLA_INFO_KIND ("" for a NIC): a veth's driver speed is a placeholder (detect)


class Reconciler:
    """Owns the kernel objects of the managed interfaces: a queue tree per device, one nftables table."""

    def __init__(self, devices: list[Device], dscp: tuple[int, ...], interfaces: dict[str, int], ipr, nft=None,
                 ack_level: int | None = 0, layout=None,
                 reset_user_dscp: bool = Config.reset_user_dscp,
                 kernel_tcp_dscp: tuple[int, ...] = Config.kernel_tcp_dscp):
        """``devices`` carry the queues of ``interfaces`` (name -> index: what is matched as output interface);
        pure ACKs of less urgent levels go to ``ack_level``'s class (None: each flow's ACKs at its own level);
        ``layout``: a backend of the class layout, where no device is held yet (default: the first device's);
        ``reset_user_dscp``: users' unregistered packets leave with DSCP 0, and this host's TCP without a socket file
        unless its DSCP is one of ``kernel_tcp_dscp`` (``nftables.table_commands``)."""
        self.devices = list(devices)
        self.backend = layout or self.devices[0].backend  # the class layout, the same on every device
        self.dscp = dscp
        self.ack_level = ack_level
        self.reset_user_dscp = reset_user_dscp
        self.kernel_tcp_dscp = tuple(kernel_tcp_dscp)
        self.interfaces = dict(interfaces)
        self.ipr = ipr
        self.nft = nft or nftables.Nft()
        self.stats = ReconcileStats()
        self._shape: list[str] | None = None  # the table's chains and rules as listed after the last install
        self._failing = ""  # what the last pass failed on ("" : nothing)
        self._inherited: dict[FlowKey, nftables.Mark] = {}  # a killed agent's marks, kept until _inherit_until
        self._users: dict[FlowKey, int] = {}  # the socket user of each mark in a uflows map, as last put or listed
        self._inherit_until = 0.0
        self.shares: dict[int, float] = {}  # the job policy's guaranteed shares (set_shares), for a device taken later
        self._egress: dict[tuple[str, str], tuple[str, float]] = {}  # (src, dst) -> (interface, when looked up)
        self._backlog_sock: socket.socket | None = None  # the job policy's samples: one netlink socket, reused
        self._flows_paced = _Paced("")  # the flows' part of a pass; its result: what it failed on ("": nothing)
        self._counters_paced = _Paced({})  # counters()
        self._put_backs: dict[str, tuple[str, float, int, bool]] = {}  # device -> (what, when logged, not logged
        # since, whether the fight was said)

    def _table_commands(self) -> list[dict]:
        classids = [self.backend.classid(lvl) for lvl in range(self.backend.levels)]
        return nftables.table_commands(list(self.interfaces), classids, list(self.dscp), self.ack_level,
                                       self.reset_user_dscp, self.kernel_tcp_dscp)

    def _apply_trees(self) -> None:
        for dev in self.devices:
            dev.backend.apply(self.ipr, dev.index)

    def install(self) -> dict | None:
        """Create (or update in place) the qdisc trees and the nftables table, keeping registered elements.
        Returns the table as listed then."""
        self._apply_trees()
        return self._install_table()

    def _install_table(self) -> dict | None:
        """Create or update the nftables table (keeping the maps' elements); remember its shape as listed now, what
        each pass compares with. Returns the listing. A table that cannot be updated in place (a chain of its made
        again by someone at another hook, priority or type, perhaps dropping every packet) is made afresh in one
        transaction, its maps' elements gone: the reconcile pass adds them back."""
        try:
            self.nft.run(self._table_commands())
        except nftables.NftError as exc:
            log.warning("the nftables table cannot be updated in place (%s); making it afresh", exc)
            self.nft.run(nftables.delete_table_commands() + self._table_commands())
        listing = nftables.list_table(self.nft)
        if stale := nftables.stale_level_commands(listing, self.backend.levels):
            log.warning("removing the nftables chains of levels beyond the %d configured (a killed agent's); their "
                        "flows' marks move to level %d until they register again",
                        self.backend.levels, self.backend.levels - 1)
            self.nft.run(stale)
            listing = nftables.list_table(self.nft)
        self._shape = nftables.table_shape(listing)
        return listing

    def share_budget(self) -> float:
        """The share of the link the job parts may take in all on every device (``HtbBackend.share_budget``; 1.0
        for a backend without guarantees)."""
        return min((dev.backend.share_budget() for dev in self.devices), default=self.backend.share_budget())

    def link_bps(self) -> int | None:
        """The slowest managed device's link rate in bits/s (None where no backend knows one)."""
        return min((r for dev in self.devices if (r := getattr(dev.backend, "rate", None))), default=None)

    def set_shares(self, shares: dict[int, float]) -> bool:
        """Give the levels in ``shares`` that guaranteed share of each device's link (the job policy's
        ``job_share``; the other levels keep ``min_share``): the classes are changed in place. A failure is counted
        and logged, and the next full pass applies the trees again. Returns whether anything changed."""
        before = {dev.name: dev.backend.rates() for dev in self.devices if hasattr(dev.backend, "rates")}
        changed = [dev for dev in self.devices if dev.backend.set_shares(shares)]  # every device's, no short cut
        self.shares = dict(shares)
        if not changed:
            return False
        try:
            for dev in changed:  # only the classes whose rate moved (the tree is there: install made it)
                dev.backend.change_rates(self.ipr, dev.index, before[dev.name])
        except Exception as exc:  # noqa: BLE001 - the flows are marked either way; the pass repairs
            self.stats.errors += 1
            self.stats.last_error = f"guaranteed shares: {exc}"
            log.error("changing the guaranteed shares: %s", exc)
        return True

    @property
    def failing(self) -> str:
        """What the last full pass failed on ("" when it passed): ``stats.last_error`` keeps the last failure."""
        return self._failing

    def follow(self, devices: list[Device], interfaces: dict[str, int]) -> None:
        """The queue devices and the managed interfaces' indexes (0: absent) as they are now
        (``daemon.HeldDevices.follow``); the route lookups' answers are asked again."""
        self.devices = list(devices)
        if interfaces != self.interfaces:
            self.interfaces = dict(interfaces)
            self._egress.clear()

    def inherit(self, listing: dict | None, seconds: float = INHERIT_S) -> int:
        """Keep the flow marks a killed agent left in the table for ``seconds`` (while its shims register again: a
        pass would drop them at once, leaving the flows unmarked until then); a flow registered meanwhile replaces
        its old mark. ``listing``: the table as :meth:`install` listed it, before the first pass. Returns how many
        are kept."""
        self._inherited = nftables.parse_map_elements(listing)
        self._users = {k: uid for k, (_, uid) in self._inherited.items() if uid is not None}
        self._inherit_until = time.monotonic() + seconds
        if self._inherited:
            log.info("keeping %d flow marks a previous agent left for %.0f s, while their jobs register again",
                     len(self._inherited), seconds)
        return len(self._inherited)

    def end_inherit(self) -> None:
        """The flow table of an agent that handed over was taken back (agent/handover.py): every flow that keeps its
        level is registered, so the marks still kept are those of flows not taken back (a socket closed in the gap,
        an owner gone) and go at the next pass, not after ``INHERIT_S``: a connection another user opens with such a
        flow's 5-tuple no longer gets its level meanwhile."""
        self._inherit_until = time.monotonic()

    def _still_inherited(self) -> dict[FlowKey, nftables.Mark]:
        """The inherited marks still kept (none once ``_inherit_until`` has passed). Once their time is up, the
        flows' part of the next pass runs whatever its pacing (:data:`FLOW_CHECK_SHARE`), so that the marks nobody
        registered again go at the first pass after ``INHERIT_S``: before (until 2026-11-28) they waited for the
        pacing, 11.5 s after start with 2,850 marks here."""
        if self._inherited and time.monotonic() >= self._inherit_until:
            self._inherited = {}
            self._flows_paced.reset()
        return self._inherited

    def apply(self, table: FlowTable, added: list[FlowKey], moved: list[FlowKey], removed: list[FlowKey]) -> None:
        """Push one change to the kernel as a single transaction; fall back to a full pass if it fails.

        ``moved`` flows are in the kernel at their old level: they are deleted and re-added at their effective
        level in the same transaction, so no packet sees them unclassified.
        """
        inherited = self._still_inherited()
        replaced = [k for k in added if inherited.pop(k, None) is not None]  # a killed agent's mark: replaced
        users = self._users
        cmds = nftables.element_commands("delete", [(k, None, users.get(k)) for k in (*removed, *moved, *replaced)])
        marks = [(k, *table.mark(k)) for k in (*added, *moved)]
        cmds += nftables.element_commands("add", marks)
        if not cmds:
            return
        try:
            self.nft.run(cmds)
            for k in (*removed, *moved, *replaced):
                users.pop(k, None)
            users.update((k, uid) for k, _, uid in marks if uid is not None)
        except nftables.NftError as exc:
            log.warning("incremental update failed (%s); reconciling fully", exc)
            self._flows_paced.reset()  # the flows' part runs now, whatever it cost last time
            self.reconcile(table)

    def reconcile(self, table: FlowTable, problems: list[str] = ()) -> int:
        """Full pass: qdisc trees in place, table present, map elements equal to ``table``. Returns repairs. Each
        part is repaired on its own: a device whose tree cannot be (gone, or its root held by a qdisc that cannot be
        replaced) keeps neither the other devices' trees nor the flows' marks from being repaired. ``problems``
        found before the pass (a managed interface absent: ``daemon.HeldDevices.follow``) fail it too."""
        self.stats.passes += 1
        self.stats.last_pass_s = time.monotonic()
        failed = list(problems)
        repairs = 0
        for dev in self.devices:
            try:
                if put_back := dev.backend.apply(self.ipr, dev.index):
                    self._log_put_back(f"{dev.name}'s tree", f"reconcile: {dev.name}'s tree was changed behind the "
                                       f"agent's back: put back {'; '.join(put_back)}")
                    repairs += 1
                if found := qdisc.remove_filters(self.ipr, dev.index, dev.backend.filter_parents()):
                    self._log_put_back(f"{dev.name}'s filters", f"reconcile: removed foreign tc filters from "
                                       f"{dev.name}'s tree")  # (not how many: the same line while a tool adds them)
                    repairs += found
            except Exception as exc:  # noqa: BLE001 - counted and reported below, the agent keeps running
                failed.append(f"{dev.name}: {self._while_changed(dev, exc)}")
        self.stats.repairs += repairs
        repairs += self._reconcile_flows(table, failed)
        failing = "; ".join(failed)
        self.stats.last_pass_failed = bool(failed)
        if failed:
            self.stats.errors += 1
            self.stats.last_error = failing
            if failing != self._failing:  # logged when it starts or changes, not every pass (the counter counts)
                log.error("reconcile failed: %s (logged again when this changes)", failing)
        elif self._failing:
            log.warning("reconcile passes again (after: %s)", self._failing)
        self._failing = failing
        return repairs

    def _log_put_back(self, what: str, line: str) -> None:
        """Log a repair (``line``) of ``what`` (a device's tree, the nftables table). The same repair again within
        :data:`FIGHT_LOG_S` is a tool that keeps changing it (a network manager, a tuning script or a firewall
        reload in a loop): said once as such, then logged at most every :data:`FIGHT_LOG_S` with how many were not.
        Before (until 2026-11-28) every pass logged it, one line a pass for as long as the tool ran."""
        now = time.monotonic()
        last, when, quiet, fight = self._put_backs.get(what, ("", -FIGHT_LOG_S, 0, False))
        if line == last and now - when < FIGHT_LOG_S:
            if not fight:  # (said once for as long as the fight goes on, not again after each line a minute)
                log.error("%s, again: a tool on the host keeps changing %s, and each pass puts it back (on a tree, "
                          "what was queued is dropped each time); stop that tool or leave the interface out of the "
                          "agent's. Logged again once every %.0f s while it goes on (every one counted in "
                          "reconcile.repairs)", line, what, FIGHT_LOG_S)
            self._put_backs[what] = (line, when, quiet + 1, True)
            return
        going_on = bool(quiet) and line == last  # (the same again within the last line's minute: the fight goes on)
        more = f" (and {quiet} times more in the last {now - when:.0f} s)" if going_on else ""
        log.warning("%s%s", line, more)
        self._put_backs[what] = (line, now, 0, fight and going_on)

    def _while_changed(self, dev: Device, exc: Exception) -> str:
        """What a pass that failed on ``dev`` says: where the tree is no longer the agent's now (another tool
        replaced its root while the pass put it back: a request then finds no such parent, ENOENT), that, not only
        the kernel's bare answer (``(2, 'No such file or directory')``)."""
        try:
            ours = dev.backend.owns(self.ipr, dev.index)
        except Exception:  # noqa: BLE001 - (the device gone, say): the kernel's answer alone
            return str(exc)
        if ours:
            return str(exc)
        return f"its root qdisc was replaced while the pass put its tree back ({exc}); the next pass puts it back"

    def _reconcile_flows(self, table: FlowTable, failed: list[str]) -> int:
        """The nftables part of a full pass (the table, its chains and the map's elements); a failure is added to
        ``failed``. Skipped while less than 1 / ``FLOW_CHECK_SHARE`` times its last duration has passed since it
        last ran (a large table: :data:`FLOW_CHECK_SHARE`); a failed change runs it at once (:meth:`apply`), and so
        does the first pass after a killed agent's marks were kept for ``INHERIT_S`` (:meth:`_still_inherited`)."""
        started = time.monotonic()
        self._still_inherited()  # (a killed agent's marks whose time is up: due now, whatever the pacing)
        if not self._flows_paced.due(started):
            failed.extend(filter(None, [self._flows_paced.result]))  # not run again yet: its last outcome stands
            return 0
        failure = ""
        try:
            return self._check_flows(table)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the agent keeps running
            failure = f"nftables: {exc}"
            failed.append(failure)
            return 0
        finally:
            self._flows_paced.ran(started, failure)

    def _check_flows(self, table: FlowTable) -> int:
        """List the table, put its chains and rules back if they changed, and make the map's elements the flow
        table's; returns the repairs."""
        listing = nftables.list_table(self.nft)
        if listing is None or nftables.table_shape(listing) != self._shape:
            if listing is not None:
                self._log_put_back("the nftables table", "reconcile: the nftables table's chains or rules changed; "
                                   "putting them back")
            else:  # (before, only its flow entries were counted and logged, as if they alone had gone)
                self._log_put_back("the nftables table", "reconcile: the nftables table inet tensorlane is gone "
                                   "(deleted, or nft flush ruleset); making it again with its flows")
            self.stats.repairs += 1
            listing = self._install_table()
        have = nftables.parse_map_elements(listing)
        mark = table.mark
        want = {k: mark(k) for k in table.flows}
        inherited = self._still_inherited()
        stale = [k for k, m in have.items() if want.get(k) != m and not (k not in want and k in inherited)]
        missing = [k for k, m in want.items() if have.get(k) != m]
        cmds = nftables.element_commands("delete", [(k, None, have[k][1]) for k in stale])
        cmds += nftables.element_commands("add", [(k, *want[k]) for k in missing])
        gone = set(stale)
        now = {k: m for k, m in have.items() if k not in gone} | {k: want[k] for k in missing}
        if cmds:
            self.nft.run(cmds)
            self.stats.repairs += len(stale) + len(missing)
            log.info("reconcile: removed %d stale and added %d missing flow entries", len(stale), len(missing))
        self._users = {k: uid for k, (_, uid) in now.items() if uid is not None}
        return len(stale) + len(missing)

    def egress(self, keys, ipr=None) -> dict[FlowKey, str | None]:
        """The managed interface each flow leaves through (a route lookup per address pair, remembered for
        ``EGRESS_TTL_S``; "" for a flow routed elsewhere, which the agent does not mark; None for one not looked
        up yet: at most ``EGRESS_LOOKUPS`` new lookups per call, about 0.35 ms each, so that a client cannot stall
        the agent with many peers). ``ipr``: a netlink socket of the caller's thread."""
        now = time.monotonic()
        cache = self._egress
        stale = sorted({(k.src, k.dst) for k in keys} - {p for p, (_, t) in cache.items() if now - t < EGRESS_TTL_S})
        found = links.egress_of(ipr or self.ipr, stale[:EGRESS_LOOKUPS], {i: n for n, i in self.interfaces.items()})
        if len(cache) + len(found) > EGRESS_CACHE_MAX:
            for p in [p for p, (_, t) in cache.items() if now - t >= EGRESS_TTL_S] or list(cache):
                del cache[p]
        cache.update((p, (name, now)) for p, name in found.items())
        return {k: cache.get((k.src, k.dst), (None, 0.0))[0] for k in keys}

    def backlogged_levels(self) -> set[int]:
        """The levels whose class has packets queued on some device now (the job policy's sample of which jobs
        are sending: ``JobScheduler.observe``). One class dump per device, only the queue lengths read
        (``tcstats.class_backlogs``), on a netlink socket kept for the next sample (dropped after an error)."""
        level_of = {spec.classid: spec.level for spec in self.backend.leaves() if spec.level is not None}
        out: set[int] = set()
        if self._backlog_sock is None:
            self._backlog_sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        try:
            for dev in self.devices:
                for classid, queued in tcstats.class_backlogs(dev.index, self._backlog_sock).items():
                    if classid in level_of and queued > 0:
                        out.add(level_of[classid])
        except BaseException:
            self._close_backlog_sock()  # what is left unread on it is not the next sample's
            raise
        return out

    def _close_backlog_sock(self) -> None:
        if self._backlog_sock is not None:
            self._backlog_sock.close()
            self._backlog_sock = None

    def counters(self) -> dict[int, dict[str, int]]:
        """Per-level packet and byte counters of the marking chains (``status``). Listing them lists the whole table
        (libnftables' cache: about 1.2 s at 50,000 flows, while the agent's loop waits): the last answer is given
        again while it is younger than 1 / ``FLOW_CHECK_SHARE`` times the listing took, so that any user's
        ``status`` calls take at most that share of the agent's time."""
        started = time.monotonic()
        if self._counters_paced.due(started):
            self._counters_paced.ran(started, nftables.chain_counters(nftables.list_table(self.nft)))
        return self._counters_paced.result

    def teardown(self) -> None:
        """Remove the nftables table (the qdisc is restored by the daemon from its snapshot)."""
        self._close_backlog_sock()
        try:
            self.nft.run(nftables.delete_table_commands())
        except nftables.NftError as exc:  # (none to remove: a start that failed before making it, or flushed away)
            log.log(logging.DEBUG if "No such file or directory" in str(exc) else logging.WARNING,
                    "removing the nftables table: %s", exc)
