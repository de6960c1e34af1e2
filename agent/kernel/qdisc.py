"""Qdisc backends: the egress queue tree that gives each priority level its own strict-priority queue.

Both backends classify by ``skb->priority``: the nftables level chain sets it to the level's class id, and the
qdisc puts the packet straight into that class (no tc filter). Unregistered traffic goes to the default class,
below every level.

- ``htb`` (works on every kernel that has HTB): one parent class at the link rate; one child class per level with a
  small guaranteed rate (``min_share`` of the link, at least ``min_rate``), ceil = link rate and HTB ``prio`` =
  level, so the most urgent backlogged class borrows first (priority) and any class may use the whole link when the
  others are idle (work-conserving). The guarantee keeps a lower class's TCP flows ACK-clocked while a higher class
  is busy, so they never sit idle in a retransmission timeout (then back off exponentially) when the link frees up.
  What keeps a flow out of a timeout is an absolute rate (packets per minimum RTO), so on a slow link the fraction
  is raised to ``min_rate``, within what the job shares and half the link leave to all classes. With
  ``min_share = 0`` the guarantee is tiny (link/1000, 8-100 kbit/s) and priority is strict. A job policy may raise
  the guarantee of some levels (``set_shares``: ``job_share`` split among the jobs, ``policies.jobs.job_shares``); the
  classes are changed in place. It shapes at the link rate, so the queue forms here and not in the NIC.
- ``prio`` (when the kernel has sch_prio): one band per level plus a default band; no shaping, relies on the NIC
  (with BQL) to keep its own ring short.

Usage: ``backend = make_backend("htb", cfg.levels, rate, cfg.queue_limit_packets, cfg.min_share, cfg.min_rate_bps);
backend.apply(ipr, ifindex)``
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

from tensorlane.agent.config import Config
from tensorlane.agent.kernel import snapshot
from tensorlane.agent.kernel.htbclass import ClassRates, change_classes

MAJOR = 0x7A1  # tensorlane's qdisc handle major ("7a1:"), recognisable in `tc qdisc show`
MTU_BYTES = 1514
TCA_CHAIN = 11

log = logging.getLogger("tensorlane.qdisc")


def handle(major: int, minor: int = 0) -> int:
    return (major << 16) | minor


def fmt_handle(h: int) -> str:
    """Format a tc handle as tc prints it. Usage: ``fmt_handle(0x7a10010) == "7a1:10"``"""
    return f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


@dataclass(frozen=True)
class ClassSpec:
    """One leaf class of the tree: where packets of a level (or the default class) wait."""

    level: int | None  # None for the default class
    classid: int
    prio: int
    leaf_handle: int


class HtbBackend:
    """Strict priority from HTB siblings (see module docstring)."""

    kind = "htb"

    def __init__(self, levels: int, link_rate_bps: int, queue_limit: int = Config.queue_limit_packets,
                 min_share: float = 0.0, min_rate: int = 0):
        if link_rate_bps is None:
            raise ValueError("the htb backend needs link_rate (the interface reports no speed)")
        self.levels = levels
        self.rate = link_rate_bps
        self.queue_limit = queue_limit
        self.min_share = min_share
        self.min_rate = min_rate  # bits/s: every class's guarantee at least this, where the link leaves room
        self.shares: dict[int, float] = {}  # level -> a larger guaranteed share of the link (the job policy's)
        self.root = handle(MAJOR)
        self.parent_class = handle(MAJOR, 1)
        self.classes = [ClassSpec(lvl, handle(MAJOR, 0x10 + lvl), lvl, handle(0x100 + lvl)) for lvl in range(levels)]
        self.default = ClassSpec(None, handle(MAJOR, 0x10 + levels), min(levels, 7), handle(0x100 + levels))
        # What the agent last set, as the kernel dumps it: class id -> (rate, ceil, quantum, prio), and the leaves'
        # pfifo limit. A pass that finds otherwise counts a change behind its back (:func:`_drifted`); empty until
        # the agent set them, and after a change that may have been half done.
        self.applied: dict[int, tuple[int, int, int, int]] = {}
        self.applied_limit: int | None = None

    def classid(self, level: int) -> int:
        return self.classes[level].classid

    def leaves(self) -> list[ClassSpec]:
        return [*self.classes, self.default]

    def _burst(self, rate_bps: int) -> int:
        return max(rate_bps // 8 // 1000, 4 * MTU_BYTES)  # 1 ms of the rate, at least a few packets

    def least(self) -> int:
        """Every leaf's guarantee before :meth:`floor` and the job parts: ``min_share`` of the link, or (0) a tiny
        one so that `prio` alone decides (TensorLights)."""
        if self.min_share > 0:
            return max(8_000, int(self.rate * self.min_share))
        return max(8_000, min(100_000, self.rate // 1000))

    def guaranteed(self, level: int | None) -> int:
        """A leaf's guaranteed rate in bits/s: :meth:`least`, with ``min_share`` raised to :meth:`floor`; a
        level's share from ``set_shares`` when that is larger."""
        base = max(self.least(), self.floor()) if self.min_share > 0 else self.least()
        return max(base, int(self.rate * self.shares.get(level, 0.0))) if level is not None else base

    def share_budget(self) -> float:
        """The share of the link that ``set_shares`` may hand out in all: what every leaf's :meth:`least` leaves.
        HTB lets a class send up to its guarantee without asking its parent, so guarantees that add up to more
        than the link send more than the link (the queue moves past the host). :meth:`floor` yields to the
        shares by itself. Usage: ``HtbBackend(4, 50_000_000, min_share=0.01).share_budget() == 0.95``"""
        return max(0.0, 1.0 - len(self.leaves()) * self.least() / self.rate)

    def floor(self) -> int:
        """``min_rate``, at most an equal part for every class of what the job shares leave, and of half the link:
        all guarantees together never exceed the link. Usage: ``HtbBackend(4, 50_000_000, min_share=0.01,
        min_rate=2_500_000).floor() == 2_500_000``"""
        free = min(0.5, 1.0 - sum(self.shares.values()))
        return max(0, min(self.min_rate, int(self.rate * free / len(self.leaves()))))

    def set_shares(self, shares: dict[int, float]) -> bool:
        """Set the levels' guaranteed shares (``{level: share}``; the others keep ``min_share``); whether that
        changed anything (then ``apply`` brings the classes to it, in place). Cheap when nothing changed: the
        agent asks after every request."""
        if shares == self.shares:
            return False
        shares = {int(lvl): float(v) for lvl, v in shares.items()}
        if any(not 0 <= lvl < self.levels or not 0.0 <= v < 1.0 for lvl, v in shares.items()):
            raise ValueError(f"shares {shares} outside levels 0..{self.levels - 1} or [0, 1)")
        if shares == self.shares:
            return False
        self.shares = shares
        return True

    def apply(self, ipr, index: int) -> list[str]:
        """Create the tree, or bring an existing one of ours to the desired parameters in place; one of ours with
        another class layout (adopted from an agent of another ``levels``) is made afresh (:meth:`stale_layout`).
        Returns what had to be made again (:func:`_put_back`: [] when the root and leaves were all there; the whole
        tree when it had another layout, a class someone added under ours)."""
        try:
            return self._apply(ipr, index)
        except BaseException:
            self.applied, self.applied_limit = {}, None  # (half done: the next pass sets all without comparing)
            raise

    def _apply(self, ipr, index: int) -> list[str]:
        """:meth:`apply`'s work; what it sets is kept in :attr:`applied`."""
        qdiscs = ipr.get_qdiscs(index=index)
        put_back = _put_back(qdiscs, self.root, [spec.leaf_handle for spec in self.leaves()], "htb")
        have = _drop_other_kind(ipr, index, {q["handle"]: q.get_attr("TCA_KIND") for q in qdiscs}, "htb")
        classes = []
        if have.get(self.root) == "htb":
            classes = ipr.get_classes(index=index)
            present = {c["handle"] for c in classes}  # a leaf class deleted (its leaf qdisc went with it: named above)
            if gone := [spec.classid for spec in self.leaves() if spec.classid not in present]:
                put_back.append(f"{len(gone)} classes ({', '.join(map(fmt_handle, gone))})")
        if not put_back:  # (a tree put back whole: its classes were made again, not changed)
            put_back = _drifted(classes, qdiscs, self.applied, self.applied_limit,
                                {spec.leaf_handle for spec in self.leaves()})
        if have.get(self.root) == "htb" and (why := self.stale_layout(ipr, index, qdiscs, classes)):
            log.warning("the tensorlane tree on device %d has %s: making it afresh", index, why)
            ipr.tc("del", "htb", index=index, handle=self.root)
            have = {}
            put_back = put_back or [f"its tree, made afresh (it had {why})"]  # (a class added under ours: counted)
        if have.get(self.root) != "htb":  # none, or another root put there behind the agent's back: ours again
            ipr.tc("replace", "htb", index=index, handle=self.root,
                   default=self.default.classid & 0xFFFF, r2q=10)
        burst = self._burst(self.rate)
        rate = self.rate // 8  # pyroute2 takes integer rates in bytes/s
        ipr.tc("replace-class", "htb", index=index, handle=self.parent_class, parent=self.root,
               rate=rate, ceil=rate, burst=burst, cburst=burst, quantum=4 * MTU_BYTES)
        self.applied[self.parent_class] = (rate, rate, 4 * MTU_BYTES, 0)
        limits = {q["handle"]: (q.get_attr("TCA_OPTIONS") or {}).get("limit") for q in qdiscs}
        for spec in self.leaves():
            self._leaf_class(ipr, index, spec)
            if have.get(spec.leaf_handle) != "pfifo" or limits.get(spec.leaf_handle) != self.queue_limit:
                ipr.tc("replace", "pfifo", index=index, handle=spec.leaf_handle, parent=spec.classid,
                       limit=self.queue_limit)
        self.applied_limit = self.queue_limit
        return put_back

    def stale_layout(self, ipr, index: int, qdiscs, classes=None) -> str:
        """What makes the HTB tree of ours on device ``index`` another layout than this backend's ("" when none):
        another default class, or leaf classes of ours beyond :meth:`leaves`. HTB cannot change its default in
        place, and unregistered traffic would go on to the old default (a level's class, when ``levels`` grew)."""
        root = next((q for q in qdiscs if q["parent"] == snapshot.TC_H_ROOT and q["handle"] == self.root), None)
        options = root.get_attr("TCA_OPTIONS") if root is not None else None
        default = ((options.get_attr("TCA_HTB_INIT") if options else None) or {}).get("defcls")
        if default is not None and default != self.default.classid & 0xFFFF:
            return f"default class {MAJOR:x}:{default:x}, not {fmt_handle(self.default.classid)}"
        ours = {spec.classid for spec in self.leaves()} | {self.parent_class}
        extra = sorted(c["handle"] for c in (ipr.get_classes(index=index) if classes is None else classes)
                       if c["handle"] >> 16 == MAJOR and c["handle"] not in ours)
        return f"classes {', '.join(map(fmt_handle, extra))} beyond its {self.levels} levels" if extra else ""

    def _leaf_rates(self, spec: ClassSpec) -> ClassRates:
        """A leaf's parameters: its guaranteed rate, the link as its ceiling, its prio (rates in bytes/s)."""
        floor = self.guaranteed(spec.level) // 8
        return ClassRates(spec.classid, floor, self.rate // 8, max(4 * MTU_BYTES, self._burst(floor * 8)),
                          self._burst(self.rate), 4 * MTU_BYTES, spec.prio)

    def _leaf_class(self, ipr, index: int, spec: ClassSpec) -> None:
        """Create a leaf class, or change it in place (:meth:`_leaf_rates`)."""
        c = self._leaf_rates(spec)
        ipr.tc("replace-class", "htb", index=index, handle=spec.classid, parent=self.parent_class,
               rate=c.rate, ceil=c.ceil, burst=c.burst, cburst=c.cburst, prio=c.prio, quantum=c.quantum)
        self.applied[spec.classid] = (c.rate, c.ceil, c.quantum, c.prio)

    def rates(self) -> dict[int, int]:
        """Every leaf's guaranteed rate in bits/s, by class id (what :meth:`change_rates` compares with)."""
        return {spec.classid: self.guaranteed(spec.level) for spec in self.leaves()}

    def rate_changes(self, before: dict[int, int]) -> list[ClassRates]:
        """The leaves whose guaranteed rate differs from ``before`` (:meth:`rates` before a :meth:`set_shares`),
        with what they must become."""
        return [self._leaf_rates(spec) for spec in self.leaves()
                if before.get(spec.classid) != self.guaranteed(spec.level)]

    def change_rates(self, ipr, index: int, before: dict[int, int]) -> int:
        """Change in place only :meth:`rate_changes`; the tree must exist. One netlink message per changed class,
        built without pyroute2's rate tables (``htbclass``), where :meth:`apply` makes a dump and one pyroute2
        request per class: the job policy's parts change several times a second. ``ipr`` is not used (the
        reconciler passes its handle). Returns how many changed."""
        changed = self.rate_changes(before)
        try:
            change_classes(index, self.parent_class, changed)
        except BaseException:
            self.applied = {}  # (some may have changed: the next pass sets all without comparing)
            raise
        self.applied.update((c.classid, (c.rate, c.ceil, c.quantum, c.prio)) for c in changed)
        return len(changed)

    def filter_parents(self) -> tuple[int, ...]:
        """Where a filter could classify packets in the tree: the root qdisc and the parent class."""
        return (self.root, self.parent_class)

    def owns(self, ipr, index: int) -> bool:
        """Whether the interface's root qdisc is one of ours (of either backend: :func:`owns_root`)."""
        return owns_root(ipr, index)


class PrioBackend:
    """One prio band per level plus a default band (see module docstring)."""

    kind = "prio"

    def __init__(self, levels: int, link_rate_bps: int | None = None, queue_limit: int = Config.queue_limit_packets,
                 min_share: float = 0.0, min_rate: int = 0):
        self.levels = levels  # min_share, min_rate: sch_prio is strict, it has no guarantee to give (ets would)
        self.queue_limit = queue_limit
        self.root = handle(MAJOR)
        # sch_prio maps skb->priority MAJOR:minor straight to band minor-1.
        self.classes = [ClassSpec(lvl, handle(MAJOR, lvl + 1), lvl, handle(0x100 + lvl)) for lvl in range(levels)]
        self.default = ClassSpec(None, handle(MAJOR, levels + 1), levels, handle(0x100 + levels))

    def classid(self, level: int) -> int:
        return self.classes[level].classid

    def leaves(self) -> list[ClassSpec]:
        return [*self.classes, self.default]

    def set_shares(self, shares: dict[int, float]) -> bool:
        """sch_prio has no guarantee to give: nothing changes."""
        return False

    def share_budget(self) -> float:
        """sch_prio has no guarantee to give, none to keep within the link."""
        return 1.0

    def apply(self, ipr, index: int) -> list[str]:
        """Create the tree or bring ours to the desired parameters; returns what had to be made again."""
        qdiscs = ipr.get_qdiscs(index=index)
        put_back = _put_back(qdiscs, self.root, [spec.leaf_handle for spec in self.leaves()], "prio")
        have = _drop_other_kind(ipr, index, {q["handle"]: q.get_attr("TCA_KIND") for q in qdiscs}, "prio")
        bands = self.levels + 1
        # Unclassified traffic, whatever its TOS, goes to the default (last) band.
        opts = {"bands": bands, "priomap": [self.levels] * 16}
        ipr.tc("replace", "prio", index=index, handle=self.root,  # (another root there: ours again)
               **opts)
        for spec in self.leaves():
            if have.get(spec.leaf_handle) != "pfifo":
                ipr.tc("replace", "pfifo", index=index, handle=spec.leaf_handle, parent=spec.classid,
                       limit=self.queue_limit)
        return put_back

    def filter_parents(self) -> tuple[int, ...]:
        """Where a filter could classify packets in the tree: the root qdisc."""
        return (self.root,)

    def owns(self, ipr, index: int) -> bool:
        """Whether the interface's root qdisc is one of ours (of either backend: :func:`owns_root`)."""
        return owns_root(ipr, index)


def owns_root(ipr, index: int) -> bool:
    """Whether device ``index``'s root qdisc is tensorlane's (handle ``7a1:``), of either backend's kind: an agent
    killed with the other backend (``backend = "auto"`` picks htb once ``link_rate`` is set) left it, and its state
    file records the original. Taken for a foreign root, it was recorded as the original over that record."""
    return any(q["parent"] == snapshot.TC_H_ROOT and q["handle"] == handle(MAJOR) for q in ipr.get_qdiscs(index=index))


def _put_back(qdiscs, root: int, leaves: list[int], kind: str) -> list[str]:
    """What :meth:`apply` will make again on a device whose qdiscs are ``qdiscs`` (a dump): its root, where
    another qdisc (or the kernel's default) is the root now, and leaf qdiscs that are gone. A full pass logs and
    counts these: before, a ``tc qdisc replace ... root`` or a deleted leaf was put back and nothing said so."""
    top = next((q for q in qdiscs if q["parent"] == snapshot.TC_H_ROOT), None)
    if top is None or top["handle"] != root or top.get_attr("TCA_KIND") != kind:
        what = "the default" if top is None or not top["handle"] else (
            f"{top.get_attr('TCA_KIND')} {fmt_handle(top['handle'])}")
        return [f"its root qdisc ({what} was the root)"]
    gone = [h for h in leaves if h not in {q["handle"] for q in qdiscs}]
    return [f"{len(gone)} leaf qdiscs ({', '.join(map(fmt_handle, gone))})"] if gone else []


def _class_params(msg) -> tuple[int, int, int, int] | None:
    """A dumped HTB class's (rate, ceil, quantum, prio), rates in bytes/s (the 64-bit ones where the kernel sends
    them); None for a class that is not HTB's."""
    options = msg.get_attr("TCA_OPTIONS")
    parms = options.get_attr("TCA_HTB_PARMS") if options else None
    if not parms:
        return None
    rate = options.get_attr("TCA_HTB_RATE64") or parms["rate"]
    ceil = options.get_attr("TCA_HTB_CEIL64") or parms["ceil"]
    return rate, ceil, parms["quantum"], parms["prio"]


def _drifted(classes, qdiscs, applied: dict[int, tuple[int, int, int, int]], limit: int | None,
             leaves: set[int]) -> list[str]:
    """What someone changed in place in a tree of ours since the agent set it (``applied``, ``limit``): classes whose
    rate, ceil, quantum or prio differ (``tc class change ... classid 7a1:10 htb rate 8kbit ceil 1mbit``), leaf
    pfifos (handles ``leaves``) of another limit. :meth:`HtbBackend.apply` sets them again each pass; until
    2026-11-28 it did so and nothing said so (``repairs`` 0, no log line), though a tool fought the agent every
    pass."""
    out = []
    if changed := [c["handle"] for c in classes if c["handle"] in applied
                   and _class_params(c) not in (None, applied[c["handle"]])]:
        out.append(f"the rate, ceil, quantum or prio of {', '.join(map(fmt_handle, sorted(changed)))}")
    if limit is not None and (other := sorted(q["handle"] for q in qdiscs if q["handle"] in leaves
                                              and q.get_attr("TCA_KIND") == "pfifo"
                                              and (q.get_attr("TCA_OPTIONS") or {}).get("limit") != limit)):
        out.append(f"the limit of leaf qdiscs {', '.join(map(fmt_handle, other))}")
    return out


def _drop_other_kind(ipr, index: int, have: dict[int, str], kind: str) -> dict[int, str]:
    """Delete device ``index``'s tensorlane root of another kind than ``kind`` (the other backend's, adopted): the
    kernel cannot change a qdisc's kind in place (EINVAL). Returns ``have`` (handle -> kind), emptied then."""
    other = have.get(handle(MAJOR))
    if other is None or other == kind:
        return have
    log.warning("the tensorlane root on device %d is %s, not %s: making it afresh", index, other, kind)
    ipr.tc("del", index=index, parent=snapshot.TC_H_ROOT)
    return {}


def _chain(msg) -> int:
    """A dumped filter's chain (TCA_CHAIN, which pyroute2 does not parse; 0 where the kernel leaves it out)."""
    attr = next((bytes.fromhex(h) for t, h in snapshot.tc_object("filter", msg).attrs if t == TCA_CHAIN), b"")
    return struct.unpack_from("=I", attr, 4)[0] if len(attr) >= 8 else 0


def remove_filters(ipr, index: int, parents: tuple[int, ...]) -> int:
    """Delete every tc filter attached at ``parents`` (the agent's qdisc and inner classes) of device ``index``:
    the agent attaches none (packets are classified by ``skb->priority``), so one there is foreign and would
    classify packets past the marks. Only chain 0 counts: the qdisc classifies with it, and a filter of another
    chain is reached only from a chain 0 filter's ``goto chain``, deleted here (the deletion does not reach it: it
    was counted and logged as a repair every pass). Returns how many parents had some (one dump each when none)."""
    found = 0
    for parent in parents:
        if any(_chain(m) == 0 for m in ipr.get_filters(index=index, parent=parent)):
            ipr.tc("del-filter", index=index, parent=parent)  # prio 0: every filter of that parent's chain 0
            found += 1
    return found


def make_backend(kind: str, levels: int, link_rate_bps: int | None, queue_limit: int, min_share: float,
                 min_rate: int):
    """Return the backend object for ``kind`` ("htb" or "prio"), every setting given (the agent's defaults are
    Config's; a backend made directly, in a test or a benchmark, has no guarantee: ``min_share`` and ``min_rate`` 0).
    """
    if kind == "htb":
        return HtbBackend(levels, link_rate_bps, queue_limit, min_share, min_rate)
    if kind == "prio":
        return PrioBackend(levels, link_rate_bps, queue_limit, min_share, min_rate)
    raise ValueError(f"unknown backend {kind!r}")
