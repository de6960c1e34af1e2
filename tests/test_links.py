"""Which interfaces the agent manages and where their queues go (agent/kernel/links.py), on netlink messages as
pyroute2 decodes them. This kernel has no bonding, team or VLAN driver, so the bond case is tested here on the
messages a bond and its members produce; the plain case also runs for real (tests/test_multi_nic.py)."""
from __future__ import annotations

import pytest

from tensorlane.agent.kernel.links import LinkError, queue_links, read_links, resolve, routed_interfaces


class Msg(dict):
    """A decoded netlink message: header fields as items, attributes through ``get_attr``."""

    def __init__(self, attrs: dict, **fields):
        super().__init__(fields)
        self.attrs = attrs

    def get_attr(self, name):
        return self.attrs.get(name)


def link_msg(index: int, name: str, kind: str = "", master: int | None = None) -> Msg:
    info = Msg({"IFLA_INFO_KIND": kind}) if kind else None
    return Msg({"IFLA_IFNAME": name, "IFLA_LINKINFO": info, "IFLA_MASTER": master}, index=index)


def route(dst: str | None, dst_len: int, oif: int | None = None, hops: tuple[int, ...] = (), family: int = 2,
          rtype: int = 1) -> Msg:
    return Msg({"RTA_DST": dst, "RTA_OIF": oif, "RTA_MULTIPATH": [{"oif": h} for h in hops] or None},
               family=family, dst_len=dst_len, type=rtype)


class FakeIPRoute:
    def __init__(self, links, routes=()):
        self.links, self.routes = links, list(routes)

    def get_links(self):
        return self.links

    def get_routes(self):
        return self.routes


HOST = [link_msg(1, "lo"), link_msg(2, "eth0"), link_msg(3, "eth1"), link_msg(4, "eth2", master=6),
        link_msg(5, "eth3", master=6), link_msg(6, "bond0", "bond"), link_msg(7, "br0", "bridge"),
        link_msg(8, "bond1", "bond")]
LINKS = read_links(FakeIPRoute(HOST))


def test_a_bond_queues_on_its_members_a_nic_on_itself():
    assert [q.name for q in queue_links(LINKS["bond0"], LINKS)] == ["eth2", "eth3"]
    assert [q.name for q in queue_links(LINKS["eth0"], LINKS)] == ["eth0"]
    assert [q.name for q in queue_links(LINKS["br0"], LINKS)] == ["br0"]  # a bridge queues on itself
    with pytest.raises(LinkError, match="bond1 is a bond with no members"):
        queue_links(LINKS["bond1"], LINKS)


def test_resolve_names_and_refuses_what_cannot_be_managed():
    ipr = FakeIPRoute(HOST)
    egress = resolve(ipr, ("eth0", "bond0"), ())
    assert [(e.name, e.index, [q.name for q in e.queues]) for e in egress] == [
        ("eth0", 2, ["eth0"]), ("bond0", 6, ["eth2", "eth3"])]
    with pytest.raises(LinkError, match="no interface named 'eth9'"):
        resolve(ipr, ("eth0", "eth9"), ())
    absent = resolve(ipr, ("eth0", "eth9"), (), absent_ok=True)  # the agent's start: followed by name from then on
    assert [(e.name, e.index, e.queues) for e in absent][1] == ("eth9", 0, ())
    assert [(e.name, e.index, e.queues) for e in resolve(ipr, ("bond1",), (), absent_ok=True)] == [("bond1", 8, ())]
    with pytest.raises(LinkError, match="eth2 carries the queues of both bond0 and eth2"):
        resolve(ipr, ("bond0", "eth2"), ())


def test_interfaces_routed_to_the_training_subnets():
    routes = [
        route(None, 0, oif=2),                      # default route via eth0
        route("198.18.0.0", 24, oif=3),             # rail 1
        route("198.19.0.0", 24, hops=(6, 3)),       # rail 2: multipath over bond0 and eth1
        route("127.0.0.0", 8, oif=1),               # loopback never counts
        route("198.18.0.1", 32, oif=3, rtype=2),    # a local route: not unicast
        route("fd00::", 8, oif=2, family=10),
    ]
    assert routed_interfaces(routes, ("198.18.0.0/15",), LINKS) == ["eth1", "bond0"]
    assert routed_interfaces(routes, ("10.0.0.0/8",), LINKS) == ["eth0"]  # only the default route covers it
    assert routed_interfaces(routes, ("fd00:1::/32",), LINKS) == ["eth0"]
    assert routed_interfaces(routes, ("127.0.0.0/8",), LINKS) == []
    ipr = FakeIPRoute(HOST, routes)
    assert [e.name for e in resolve(ipr, (), ("198.19.0.0/16",))] == ["eth1", "bond0"]
    with pytest.raises(LinkError, match="no interface has a route to the training subnets 172.16.0.0/12"):
        resolve(FakeIPRoute(HOST, routes[1:]), (), ("172.16.0.0/12",))


class RouteCounter:
    """Answers ``route("get", dst=...)`` with interface 2 for 198.18.*, 3 otherwise; counts the lookups."""

    def __init__(self):
        self.lookups = 0

    def route(self, cmd, dst, src):
        self.lookups += 1
        return [Msg({"RTA_OIF": 2 if dst.startswith("198.18.") else 3})]


def test_egress_lookups_are_bounded_per_call_and_remembered():
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import EGRESS_LOOKUPS, Device, Reconciler
    from tensorlane.flows import FlowKey

    ipr = RouteCounter()
    rec = Reconciler([Device("eth0", 2, HtbBackend(2, 10**9), "eth0")], (46, 26), {"eth0": 2}, ipr, nft=object())
    keys = [FlowKey("tcp", "198.18.0.1", 1000 + i, f"198.18.{i // 250}.{i % 250 + 1}", 29500) for i in range(300)]
    keys.append(FlowKey("tcp", "198.18.0.1", 999, "10.0.0.1", 29500))  # routed through an unmanaged interface
    first = rec.egress(keys)
    assert ipr.lookups == EGRESS_LOOKUPS  # the rest waits for the next call: no client stalls the agent
    assert list(first.values()).count(None) == len(keys) - EGRESS_LOOKUPS  # None: not looked up yet
    second = rec.egress(keys)
    assert ipr.lookups == len(keys) and second[keys[-1]] == "" and second[keys[0]] == "eth0"
    rec.egress(keys)
    assert ipr.lookups == len(keys)  # remembered: no new lookup within EGRESS_TTL_S


def test_a_bonds_members_are_followed_as_they_leave_and_join(monkeypatch, tmp_path):
    """The agent holds a bond's members (its queues): a member that leaves the bond gets its own tree back, one
    that joins is taken over with the job policy's current shares, and a bond left with no members is a problem
    of the pass (bonds cannot be made on this kernel: the links are netlink messages, the kernel calls recorded)."""
    from tensorlane.agent import daemon
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import Reconciler

    calls = []

    def prepare(cfg, ipr, link, serves, kind):
        return daemon.Takeover(link, serves, HtbBackend(2, 10**9), None, False)

    def record(cfg, t):  # (the state file is written, as the real one does: a later pass finds it there)
        calls.append(("record", t.link.name))
        daemon.state_path(cfg, t.link.name).write_text("{}")

    monkeypatch.setattr(daemon, "_prepare_device", prepare)
    monkeypatch.setattr(daemon, "record", record)
    monkeypatch.setattr(daemon, "take_over", lambda cfg, ipr, t: calls.append(("take", t.link.name, t.backend.shares)))
    monkeypatch.setattr(daemon, "restore_device", lambda cfg, ipr, name, snap: calls.append(("restore", name)))
    monkeypatch.setattr(HtbBackend, "owns", lambda self, ipr, index: True)
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: 0x7A10000)  # the agent's root on each
    cfg = Config(interfaces=("bond0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    links = read_links(FakeIPRoute(HOST))
    start = [prepare(cfg, None, q, "bond0", "htb") for q in queue_links(links["bond0"], links)]
    for t in start:  # recorded when the agent took them over at its start
        daemon.state_path(cfg, t.link.name).write_text("{}")
    rec = Reconciler([t.device() for t in start], (46, 26), {"bond0": 6}, FakeIPRoute(HOST), nft=object())
    rec.shares = {0: 0.4}
    held = daemon.HeldDevices(cfg, "htb", ["bond0"], rec)
    held.takeovers.extend(start)
    assert held.follow(FakeIPRoute(HOST)) == [] and calls == []  # nothing moved: nothing done
    moved = [link_msg(1, "lo"), link_msg(4, "eth2", master=6), link_msg(5, "eth3"), link_msg(6, "bond0", "bond"),
             link_msg(9, "eth4", master=6)]
    assert held.follow(FakeIPRoute(moved)) == []
    assert calls == [("restore", "eth3"), ("record", "eth4"), ("take", "eth4", {0: 0.4})]
    assert [(d.name, d.index, d.serves) for d in rec.devices] == [("eth2", 4, "bond0"), ("eth4", 9, "bond0")]
    calls.clear()
    alone = [link_msg(1, "lo"), link_msg(4, "eth2"), link_msg(5, "eth3"), link_msg(6, "bond0", "bond")]
    assert held.follow(FakeIPRoute(alone)) == ["bond0 is a bond with no members: its traffic has no queue to manage"]
    assert calls == [("restore", "eth2")] and rec.devices == []  # eth4 is gone: nothing to restore on it


def test_a_take_over_that_raises_does_not_keep_a_given_back_device_in_the_reconcilers_hands(monkeypatch, tmp_path):
    """In one pass eth0 is renamed away (given back: its tree restored, its record removed) and eth1 comes, whose
    tree cannot be read (a netlink error: EBUSY, ENOBUFS, the device gone meanwhile). The pass reports eth1 and
    the reconciler no longer holds the renamed device. Before, the error left ``follow`` before the reconciler
    was told: the pass put the agent's tree back on the renamed device, which was never restored (shown on veths
    in a namespace: its tbf root lost for good)."""
    from pyroute2.netlink.exceptions import NetlinkError

    from tensorlane.agent import daemon
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import Reconciler

    calls = []

    def prepare(cfg, ipr, link, serves, kind):
        if link.name == "eth1":
            raise NetlinkError(16, "Device or resource busy")
        return daemon.Takeover(link, serves, HtbBackend(2, 10**9), None, False)

    monkeypatch.setattr(daemon, "_prepare_device", prepare)
    monkeypatch.setattr(daemon, "record", lambda cfg, t: calls.append(("record", t.link.name)))
    monkeypatch.setattr(daemon, "take_over", lambda cfg, ipr, t: calls.append(("take", t.link.name)))
    monkeypatch.setattr(daemon, "restore_device", lambda cfg, ipr, name, snap: calls.append(("restore", name)))
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: 0x7A10000)
    cfg = Config(interfaces=("eth0", "eth1"), link_rate_bps=10**9, state_dir=str(tmp_path))
    first = [link_msg(1, "lo"), link_msg(2, "eth0")]
    start = prepare(cfg, None, read_links(FakeIPRoute(first))["eth0"], "eth0", "htb")
    rec = Reconciler([start.device()], (46, 26), {"eth0": 2, "eth1": 0}, FakeIPRoute(first), nft=object())
    held = daemon.HeldDevices(cfg, "htb", ["eth0", "eth1"], rec)
    held.takeovers.append(start)
    problems = held.follow(FakeIPRoute([link_msg(1, "lo"), link_msg(2, "old0"), link_msg(3, "eth1")]))
    assert calls == [("restore", "eth0")] and held.takeovers == []
    assert problems[-1] == "eth1: reading its tree: (16, 'Device or resource busy')", problems
    assert rec.devices == [] and rec.interfaces == {"eth0": 0, "eth1": 3}


def test_a_device_whose_give_back_failed_keeps_its_record_where_no_new_device_overwrites_it(monkeypatch, tmp_path):
    """eth0 is renamed away and a new eth0 comes while the old device's restore fails: the old record is kept as
    ``agent-eth0:2.json`` (no device can have that name), found by its index, dropped once the device is held
    again under a managed name, and otherwise restored on exit (the kernel calls recorded, the files real)."""
    import json

    from tensorlane.agent import daemon
    from tensorlane.agent.config import Config
    from tensorlane.agent.kernel import snapshot
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import Reconciler

    calls, failing = [], [True]

    def prepare(cfg, ipr, link, serves, kind):
        return daemon.Takeover(link, serves, HtbBackend(2, 10**9), snapshot.Snapshot(link.name, link.index), False)

    def restore(snap, ipr):
        calls.append(("restore", snap.ifindex))
        if failing[0]:
            raise OSError("EBUSY")
        return []

    monkeypatch.setattr(daemon, "_prepare_device", prepare)
    monkeypatch.setattr(daemon, "take_over", lambda cfg, ipr, t: calls.append(("take", t.link.index)))
    monkeypatch.setattr(snapshot, "restore", restore)
    monkeypatch.setattr(HtbBackend, "owns", lambda self, ipr, index: True)
    roots = {2: 0x7A10000}  # the device's root qdisc handle: the agent's
    monkeypatch.setattr(daemon, "_root_handle", lambda ipr, index: roots.get(index))
    cfg = Config(interfaces=("eth0",), link_rate_bps=10**9, state_dir=str(tmp_path))
    first = [link_msg(1, "lo"), link_msg(2, "eth0")]
    start = prepare(cfg, None, read_links(FakeIPRoute(first))["eth0"], "eth0", "htb")
    daemon.record(cfg, start)
    rec = Reconciler([start.device()], (46, 26), {"eth0": 2}, FakeIPRoute(first), nft=object())
    held = daemon.HeldDevices(cfg, "htb", ["eth0"], rec)
    held.takeovers.append(start)

    def recorded() -> dict:
        return {p.name: json.loads(p.read_text())["ifindex"] for p in sorted(tmp_path.glob("agent-*.json"))}

    swapped = [link_msg(1, "lo"), link_msg(2, "old0"), link_msg(9, "eth0")]
    assert held.follow(FakeIPRoute(swapped)) == []
    assert calls == [("restore", 2), ("take", 9)] and list(held.stranded) == [2]
    assert recorded() == {"agent-eth0.json": 9, "agent-eth0:2.json": 2}  # the new eth0's record beside the old one
    assert daemon._state_of_index(cfg, 2)["ifindex"] == 2  # what a next agent's start-up finds by index
    back = [link_msg(1, "lo"), link_msg(2, "eth0")]  # the new one deleted, the old one renamed back
    assert held.follow(FakeIPRoute(back)) == [] and held.stranded == {}
    assert recorded() == {"agent-eth0.json": 2}
    calls.clear()
    assert held.follow(FakeIPRoute(swapped)) == [] and list(held.stranded) == [2]  # fails again
    failing[0] = False
    roots[2] = 0  # the failed restore stopped half-way: the kernel's default root, the record the only original
    held.restore_stranded(FakeIPRoute(swapped))  # on exit
    assert calls == [("restore", 2), ("take", 9), ("restore", 2)] and held.stranded == {}
    assert recorded() == {"agent-eth0.json": 9}


def test_a_large_tables_listing_is_kept_to_a_share_of_the_agents_time(monkeypatch):
    """The flows' part of a full pass lists the whole nftables table, which the agent's loop waits for (1.2 s at
    50,000 flows here, measured in a namespace): it runs again only once 1 / FLOW_CHECK_SHARE times its last
    duration has passed, and at once after a failed change; a failure it found stands while it waits. Before
    (until 2026-11-27) every pass listed: one user's 50,000 flows of one UDP socket stalled every request 1.5 s in
    every 5."""
    from tensorlane.agent import reconcile
    from tensorlane.agent.kernel import nft as nftables
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.state import FlowTable
    from tensorlane.flows import FlowKey

    clock = [1000.0]
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: clock[0])

    class SlowNft:
        lists, fail, fail_change = 0, False, False

        def run(self, commands):
            if "element" in commands[0].get("add", {}) and SlowNft.fail_change:
                SlowNft.fail_change = False
                raise nftables.NftError("netlink: Error: busy")
            if "list" in commands[0]:
                SlowNft.lists += 1
                clock[0] += 1.0  # the listing takes 1 s
                if SlowNft.fail:
                    raise nftables.NftError("netlink: Error: busy")
            return None  # the table is not there: each listing installs it

    rec = reconcile.Reconciler([], (46, 26), {}, None, nft=SlowNft(), layout=HtbBackend(2, 10**9))
    table = FlowTable(2)
    assert rec.reconcile(table) == 0 and SlowNft.lists == 2  # listed, installed, listed again
    took = 2.0  # both listings
    for _ in range(3):  # passes within took / FLOW_CHECK_SHARE: nothing listed
        clock[0] += 5.0
        rec.reconcile(table)
    assert SlowNft.lists == 2 and rec.failing == ""
    clock[0] += took / reconcile.FLOW_CHECK_SHARE
    rec.reconcile(table)
    assert SlowNft.lists == 4
    SlowNft.fail = True
    clock[0] += 10 * took / reconcile.FLOW_CHECK_SHARE
    rec.reconcile(table)
    assert SlowNft.lists == 5 and rec.failing == "nftables: netlink: Error: busy"
    clock[0] += 5.0
    rec.reconcile(table)  # not listed again yet: its failure stands
    assert SlowNft.lists == 5 and rec.failing == "nftables: netlink: Error: busy"
    SlowNft.fail = False
    rec.apply(table, [], [], [])  # nothing to change: nothing run
    assert SlowNft.lists == 5
    key = FlowKey("udp", "198.18.0.1", 1000, "198.18.0.2", 2000)
    table.register("j", 0, (key,))
    SlowNft.fail_change = True  # the incremental change fails: the full pass lists at once
    rec.apply(table, [key], [], [])
    assert SlowNft.lists == 7  # listed, installed, listed again


def test_a_killed_agents_marks_go_at_the_first_pass_after_inherit_s_whatever_the_pacing(monkeypatch):
    """The marks a killed agent left, kept for INHERIT_S while the shims register again, go at the first pass after
    that, even where the table's listing is slow enough that the pacing would wait longer (0.5 s a listing: 10 s).
    Before (until 2026-11-28) they waited for the pacing: 2,850 marks of a SIGKILLed agent went 11.5 s after the
    next agent's start, not at its pass after 5 s as docs/agent.md says."""
    from tensorlane.agent import reconcile
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.state import FlowTable

    clock = [1000.0]
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: clock[0])
    left = [[{"concat": ["198.18.0.1", "198.18.0.2", "tcp", 40000 + i, 29500]}, {"goto": {"target": "level1"}}]
            for i in range(300)]
    deleted = []

    class SlowNft:
        def run(self, commands):
            if "list" in commands[0]:
                clock[0] += 0.5  # the listing of a large table
                return {"nftables": [{"map": {"family": "inet", "table": "tensorlane", "name": "flows4",
                                              "elem": list(left)}}]}
            for c in commands:
                if "element" in c.get("delete", {}):
                    deleted.extend(c["delete"]["element"]["elem"])
                    left.clear()
            return None

    rec = reconcile.Reconciler([], (46, 26), {}, None, nft=SlowNft(), layout=HtbBackend(2, 10**9))
    table = FlowTable(2)
    assert rec.inherit(rec.install()) == 300
    rec.reconcile(table)  # at start: kept
    assert deleted == [] and len(left) == 300
    clock[0] += reconcile.INHERIT_S  # the next pass (reconcile_interval_s: 5 s) is past INHERIT_S
    rec.reconcile(table)
    assert len(deleted) == 300 and left == [], "the marks nobody registered again are still there"


def test_statuss_marking_counters_are_listed_within_a_share_of_the_agents_time(monkeypatch):
    """``status`` reads the chains' counters by listing the table, as slow as the pass's listing with many flows
    (any user may ask): an answer is given again while younger than 1 / FLOW_CHECK_SHARE times its listing took."""
    from tensorlane.agent import reconcile
    from tensorlane.agent.kernel.qdisc import HtbBackend

    clock = [1000.0]
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: clock[0])
    listed = []

    class SlowNft:
        def run(self, commands):
            listed.append(1)
            clock[0] += 0.5
            return {"nftables": [{"rule": {"chain": "level0", "expr": [{"counter": {"packets": len(listed),
                                                                                    "bytes": 1}}]}}]}

    rec = reconcile.Reconciler([], (46, 26), {}, None, nft=SlowNft(), layout=HtbBackend(2, 10**9))
    assert rec.counters() == {0: {"packets": 1, "bytes": 1}}
    clock[0] += 5.0
    assert rec.counters() == {0: {"packets": 1, "bytes": 1}} and len(listed) == 1  # within 10 s of it
    clock[0] += 0.5 / reconcile.FLOW_CHECK_SHARE
    assert rec.counters() == {0: {"packets": 2, "bytes": 1}}


class FoughtBackend:
    """A tree another tool replaces before every pass (its root, ``tc qdisc replace ... root tbf``), or, with
    ``racing``, while the pass puts it back: the agent's request then finds no parent (ENOENT)."""

    kind = "htb"
    rate = 10**9

    def __init__(self):
        self.racing = False

    def apply(self, ipr, index):
        from pyroute2.netlink.exceptions import NetlinkError

        if self.racing:
            raise NetlinkError(2, "No such file or directory")
        return ["its root qdisc (tbf 1: was the root)"]

    def owns(self, ipr, index):
        return not self.racing

    def filter_parents(self):
        return ()


def test_a_tool_that_keeps_changing_the_tree_is_said_once_and_a_race_with_it_is_named(caplog):
    """Twenty passes that each put back a root another tool replaced again: every one is counted, but logged once,
    then once as a fight (the nftables table alike: test_agent_faults_netns) (before, one warning a pass for as long
    as the tool ran). A pass whose requests found the root replaced meanwhile names that, not only the kernel's
    bare "(2, 'No such file or directory')"."""
    from tensorlane.agent.reconcile import Device, Reconciler

    backend = FoughtBackend()
    rec = Reconciler([Device("eth0", 2, backend, "eth0")], (46, 26), {"eth0": 2}, FakeIPRoute(HOST), nft=object())
    rec._reconcile_flows = lambda table, failed: 0
    with caplog.at_level("WARNING", logger="tensorlane.reconcile"):
        for _ in range(20):
            rec.reconcile(None)
    assert rec.stats.repairs == 20
    assert caplog.text.count("put back its root qdisc (tbf 1: was the root)") == 2, caplog.text
    assert caplog.text.count("a tool on the host keeps changing eth0's tree") == 1
    backend.racing = True
    rec.reconcile(None)
    assert rec.stats.last_error.startswith("eth0: its root qdisc was replaced while the pass put its tree back"), \
        rec.stats.last_error


def test_removing_a_table_that_is_not_there_is_no_warning(caplog):
    """A start that failed before the table was made (or a table flushed away) has nothing to remove at teardown:
    no warning that reads as a second failure; any other refusal still warns."""
    import logging

    from tensorlane.agent.kernel import nft as nftables
    from tensorlane.agent.kernel.qdisc import HtbBackend
    from tensorlane.agent.reconcile import Device, Reconciler

    class Refusing:
        def __init__(self, message):
            self.message = message

        def run(self, commands):
            raise nftables.NftError(self.message)

    for message, warned in (("Error: Could not process rule: No such file or directory", False),
                            ("Error: Could not process rule: Operation not permitted", True)):
        rec = Reconciler([Device("eth0", 2, HtbBackend(2, 10**9), "eth0")], (46, 26), {"eth0": 2}, RouteCounter(),
                         nft=Refusing(message))
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tensorlane.reconcile"):
            rec.teardown()
        assert any(r.levelno == logging.WARNING for r in caplog.records) is warned
        assert "removing the nftables table" in caplog.text


def test_a_fight_is_said_once_then_logged_once_a_minute(caplog, monkeypatch):
    """A tool fighting the agent for five minutes, a pass a second: the fight is said once (an error), then one line
    a minute with the count (FIGHT_LOG_S), as docs/agent.md says; until 2026-11-28 the error was said again after
    each of those lines (two lines a minute, the error each minute)."""
    from tensorlane.agent import reconcile
    from tensorlane.agent.reconcile import Device, Reconciler

    now = [1000.0]
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: now[0])
    rec = Reconciler([Device("eth0", 2, FoughtBackend(), "eth0")], (46, 26), {"eth0": 2}, FakeIPRoute(HOST),
                     nft=object())
    rec._reconcile_flows = lambda table, failed: 0
    with caplog.at_level("WARNING", logger="tensorlane.reconcile"):
        for _ in range(300):
            rec.reconcile(None)
            now[0] += 1.0
    assert rec.stats.repairs == 300
    assert caplog.text.count("a tool on the host keeps changing eth0's tree") == 1, caplog.text
    lines = [r for r in caplog.records if "put back its root qdisc" in r.getMessage()]
    assert len(lines) <= 1 + 1 + 300 // reconcile.FIGHT_LOG_S + 1, [r.getMessage() for r in lines]
