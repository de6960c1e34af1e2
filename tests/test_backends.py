"""Backend choice and the prio backend. This kernel has no sch_prio, so the prio backend's netlink calls go to a
recording stand-in; its nftables side (which tc class each level's packets are sent to) runs for real."""
import subprocess
import sys
import uuid

import pytest

from tensorlane.agent.kernel import detect
from tensorlane.agent.kernel.qdisc import HtbBackend, PrioBackend, fmt_handle


class RecordingIPRoute:
    """Stands in for pyroute2's IPRoute where the kernel lacks the qdisc; records every tc call."""

    def __init__(self):
        self.calls = []
        self.qdiscs = {}

    def tc(self, command, kind=None, index=None, handle=None, **kw):
        self.calls.append((command, kind, handle, kw))
        if command in ("add", "replace"):
            self.qdiscs[handle] = kind

    def get_qdiscs(self, index=None):
        class Msg(dict):
            def get_attr(self, name):
                return self["kind"] if name == "TCA_KIND" else None
        return [Msg(handle=h, kind=k, parent=0xFFFFFFFF if h == 0x7A10000 else 0) for h, k in self.qdiscs.items()]


def test_choose_backend():
    assert detect.choose_backend("auto", {"prio", "htb"}, link_rate_given=False) == "prio"
    assert detect.choose_backend("auto", {"prio", "htb"}, link_rate_given=True) == "htb"
    assert detect.choose_backend("auto", {"htb"}, link_rate_given=False) == "htb"
    with pytest.raises(ValueError, match="'prio' is not supported by this kernel"):
        detect.choose_backend("prio", {"htb"}, link_rate_given=False)


@pytest.mark.netns
def test_probe_finds_what_this_kernel_has():
    found = detect.probe_qdiscs(("prio", "htb", "pfifo"))
    assert {"htb", "pfifo"} <= found  # the brief's measured facts for these machines; prio is absent here


@pytest.mark.netns
def test_probe_removes_namespaces_of_dead_probers():
    """A probe namespace left by an agent killed while probing goes at the next probe; a live one's stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID now names no process
    stale, live = f"{detect.PROBE_PREFIX}{dead.pid}", f"{detect.PROBE_PREFIX}1"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    try:
        detect.probe_qdiscs(("pfifo",))
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
        assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_prio_backend_requests():
    ipr, backend = RecordingIPRoute(), PrioBackend(levels=3)
    backend.apply(ipr, 7)
    root = ipr.calls[0]
    assert root[:3] == ("add", "prio", 0x7A10000) and root[3] == {"bands": 4, "priomap": [3] * 16}
    leaves = [(c[1], c[3]["parent"]) for c in ipr.calls[1:]]
    assert leaves == [("pfifo", 0x7A10001), ("pfifo", 0x7A10002), ("pfifo", 0x7A10003), ("pfifo", 0x7A10004)]
    assert [fmt_handle(backend.classid(lvl)) for lvl in range(3)] == ["7a1:1", "7a1:2", "7a1:3"]
    assert backend.owns(ipr, 7)
    ipr.calls.clear()
    backend.apply(ipr, 7)  # in place: the root is replaced, not added again; leaves already there
    assert [c[0] for c in ipr.calls] == ["replace"]


def test_htb_backend_classes():
    b = HtbBackend(levels=2, link_rate_bps=10**9)
    assert [fmt_handle(s.classid) for s in b.leaves()] == ["7a1:10", "7a1:11", "7a1:12"]
    assert [s.prio for s in b.leaves()] == [0, 1, 2]
    with pytest.raises(ValueError, match="link_rate"):
        HtbBackend(levels=2, link_rate_bps=None)


def test_htb_change_rates_touches_only_the_classes_whose_rate_moved():
    """The job policy's parts change several times a second: one request per class whose guarantee moved, no dump,
    no root or parent request; with ``min_rate`` the floor of every class moves with the parts."""
    ipr, b = RecordingIPRoute(), HtbBackend(levels=4, link_rate_bps=100_000_000, min_share=0.01)
    before = b.rates()
    b.set_shares({0: 0.3, 2: 0.3})
    assert b.change_rates(ipr, 7, before) == 2
    assert [(c[0], fmt_handle(c[2]), c[3]["rate"] * 8) for c in ipr.calls] == [
        ("replace-class", "7a1:10", 30_000_000), ("replace-class", "7a1:12", 30_000_000)]
    ipr.calls.clear()
    before = b.rates()
    b.set_shares({0: 0.45, 2: 0.3})
    assert b.change_rates(ipr, 7, before) == 1 and fmt_handle(ipr.calls[0][2]) == "7a1:10"
    floored = HtbBackend(levels=4, link_rate_bps=50_000_000, min_share=0.01, min_rate=2_500_000)
    before = floored.rates()
    floored.set_shares({0: 0.6, 2: 0.3})  # 10 % left for 5 classes: every floor drops to 1 Mbit/s
    assert floored.change_rates(RecordingIPRoute(), 7, before) == 5


def test_htb_guarantee_is_min_share_raised_to_min_rate_within_what_the_link_leaves():
    slow = HtbBackend(levels=4, link_rate_bps=50_000_000, min_share=0.01, min_rate=2_500_000)
    assert slow.guaranteed(None) == slow.guaranteed(3) == 2_500_000  # 1 % of 50 Mbit/s is only 0.5 Mbit/s
    fast = HtbBackend(levels=4, link_rate_bps=10**10, min_share=0.01, min_rate=2_500_000)
    assert fast.guaranteed(None) == 10**8  # the fraction is the larger
    assert HtbBackend(levels=4, link_rate_bps=50_000_000, min_share=0.0, min_rate=2_500_000).guaranteed(1) == 50_000
    assert HtbBackend(levels=4, link_rate_bps=50_000_000, min_share=0.01).guaranteed(None) == 500_000  # no floor
    tiny = HtbBackend(levels=4, link_rate_bps=10_000_000, min_share=0.01, min_rate=2_500_000)
    assert tiny.guaranteed(None) == 1_000_000  # half of a 10 Mbit/s link over its 5 classes
    slow.set_shares({0: 0.4, 2: 0.4})  # job shares: the floor takes only an equal part of what they leave
    assert slow.guaranteed(0) == slow.guaranteed(2) == 20_000_000
    assert sum(slow.guaranteed(s.level) for s in slow.leaves()) <= 50_000_000
    assert slow.guaranteed(1) == slow.guaranteed(None) >= 0.01 * 50_000_000


@pytest.mark.netns
def test_prio_backend_nftables_side_for_real():
    ns = f"tlp{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        code = (
            "from tests.test_backends import RecordingIPRoute\n"
            "from tensorlane.agent.kernel.qdisc import PrioBackend\n"
            "from tensorlane.agent.reconcile import Device, Reconciler\n"
            "from tensorlane.agent.state import FlowTable\nfrom tensorlane.flows import FlowKey\n"
            "import json\nfrom tensorlane.agent.kernel.nft import list_table\n"
            "rec = Reconciler([Device('lo', 1, PrioBackend(3))], (46, 34, 26), {'lo': 1}, RecordingIPRoute())\n"
            "rec.install(); t = FlowTable(3)\n"
            "k = FlowKey('tcp', '198.18.0.1', 1, '198.18.0.2', 2); t.register('j', 2, (k,))\n"
            "rec.apply(t, [k], [], []); print(json.dumps(list_table(rec.nft)))\n"
        )
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                              code], check=True, capture_output=True, text=True, timeout=30).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=True)
    assert '"value": "7a1:3"' in out and '"value": "af31"' in out and '"target": "level2"' in out
