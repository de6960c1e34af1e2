"""Traffic-control building blocks of the testbed, all through pyroute2 netlink on an open ``IPRoute``.

Two shapes are used (see docs/testbed.md):

* ``install_strict_priority``: the egress of a switch port. HTB root ``1:`` at RATE, one parent class ``1:1``
  (rate = ceil = RATE) and 8 leaf classes ``1:10``..``1:17``, one per switch queue q = DSCP >> 3. Leaf q has HTB
  ``prio`` 7 - q (HTB serves the lowest prio number first, so queue 7 goes first), a tiny guaranteed rate and
  ceil = RATE: once the guarantees are met, all spare bandwidth is lent by priority, which is strict priority.
  u32 filters match the top 3 bits of the IPv4 TOS byte; anything else (ARP, non-IP) falls into the HTB default
  class, queue 0. Each leaf is a ``pfifo`` of ``SWITCH_QUEUE_PACKETS`` packets.
* ``install_fifo``: the emulated NIC of a host. HTB root ``1:`` with a single default class ``1:10`` at RATE and a
  ``pfifo`` of ``HOST_QUEUE_PACKETS`` packets (the usual txqueuelen).
"""
from __future__ import annotations

import contextlib

from tensorlane.policies.levels import SWITCH_QUEUES  # the switch the DSCP table is made for

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
MTU = 1500
FRAME = MTU + 14  # what HTB charges for a full-size Ethernet frame (skb->len on a veth, no FCS)
SWITCH_QUEUE_PACKETS = 1000  # pfifo limit of each of the 8 queues of a switch port
HOST_QUEUE_PACKETS = 1000  # pfifo limit of a host NIC (like txqueuelen 1000)
FILTER_PRIO = 10

ROOT = 0x10000  # qdisc 1:
PARENT_CLASS = 0x10001  # class 1:1
LEAF_MINOR = 0x10  # queue q -> class 1:(0x10 + q), leaf pfifo (0x10 + q):


def leaf_class(queue: int) -> int:
    """HTB class handle (``1:1q`` in hex) of switch queue ``queue``; the host FIFO uses queue 0's, ``1:10``."""
    return (ROOT & 0xFFFF0000) | (LEAF_MINOR + queue)


def leaf_qdisc(queue: int) -> int:
    """Handle of the pfifo under the class of ``queue`` (``1q:`` in hex, e.g. ``15:`` for queue 5)."""
    return (LEAF_MINOR + queue) << 16


def burst_bytes(rate_bps: int) -> int:
    """HTB burst for a class of ``rate_bps``: 1 ms at that rate plus one full frame (HTB's usual rate/HZ + MTU)."""
    return rate_bps // 8 // 1000 + FRAME


def guaranteed_bps(rate_bps: int) -> int:
    """The tiny rate each switch queue is guaranteed before strict priority applies: 0.1% of the port, >= 8 kbit."""
    return max(rate_bps // 1000, 8000)


def _htb_class(ipr, index: int, handle: int, parent: int, rate_bps: int, ceil_bps: int, prio: int) -> None:
    """Add one HTB class with explicit burst/cburst/quantum (pyroute2 takes rates in bytes per second)."""
    ipr.tc(
        "add-class", "htb", index=index, handle=handle, parent=parent,
        rate=rate_bps // 8, ceil=ceil_bps // 8,
        burst=burst_bytes(rate_bps), cburst=burst_bytes(ceil_bps),
        quantum=FRAME, prio=prio,
    )


def install_strict_priority(ipr, index: int, rate_bps: int, ipv6: bool = False) -> None:
    """Replace the egress root of link ``index`` by the 8-queue strict-priority switch port described above
    (``ipv6``: IPv6 packets queued by their traffic class too)."""
    _delete_root(ipr, index)
    ipr.tc("add", "htb", index=index, handle=ROOT, default=LEAF_MINOR)
    _htb_class(ipr, index, PARENT_CLASS, ROOT, rate_bps, rate_bps, prio=0)
    low = guaranteed_bps(rate_bps)
    for queue in range(SWITCH_QUEUES):
        _htb_class(ipr, index, leaf_class(queue), PARENT_CLASS, low, rate_bps, prio=SWITCH_QUEUES - 1 - queue)
        ipr.tc("add", "pfifo", index=index, handle=leaf_qdisc(queue), parent=leaf_class(queue),
               limit=SWITCH_QUEUE_PACKETS)
    for queue in range(1, SWITCH_QUEUES):
        add_tos_filter(ipr, index, queue)
        if ipv6:
            add_tclass_filter(ipr, index, queue)


def add_tos_filter(ipr, index: int, queue: int) -> None:
    """u32 filter: IPv4 packets whose DS field has ``DSCP >> 3 == queue`` go to the class of ``queue``.

    The key is a 32-bit word at IP header offset 0 (version/IHL, TOS, total length); the mask keeps the top 3 bits
    of the TOS byte, which are DSCP >> 3 (the class selector). Queue 0 needs no filter: it is the default class.
    pyroute2 packs this key as ``0xq0000000/0xe0000000 at 1`` (an unaligned offset, which the kernel accepts; `tc
    filter show` prints it so). ``protocol`` must be ETH_P_IP (0x0800): pyroute2's docs show ``socket.AF_INET``,
    which is 2 and would never match an IPv4 frame.
    """
    value = (queue << 5) << 16
    ipr.tc(
        "add-filter", "u32", index=index, parent=ROOT, prio=FILTER_PRIO, protocol=ETH_P_IP,
        target=leaf_class(queue), keys=[f"0x{value:08x}/0x00e00000+0"],
    )


def add_tclass_filter(ipr, index: int, queue: int) -> None:
    """u32 filter: IPv6 packets whose traffic class has ``DSCP >> 3 == queue`` go to the class of ``queue``. The
    traffic class is bits 4-11 of the header's first word (after the version), so its top 3 bits are the word's
    bits 27-25. At its own prio (``FILTER_PRIO + 1``): one prio holds filters of one protocol."""
    ipr.tc(
        "add-filter", "u32", index=index, parent=ROOT, prio=FILTER_PRIO + 1, protocol=ETH_P_IPV6,
        target=leaf_class(queue), keys=[f"0x{queue << 25:08x}/0x0e000000+0"],
    )


def install_fifo(ipr, index: int, rate_bps: int) -> None:
    """Replace the egress root of link ``index`` by an HTB at ``rate_bps`` with one FIFO class (a plain NIC)."""
    _delete_root(ipr, index)
    ipr.tc("add", "htb", index=index, handle=ROOT, default=LEAF_MINOR)
    _htb_class(ipr, index, leaf_class(0), ROOT, rate_bps, rate_bps, prio=0)
    ipr.tc("add", "pfifo", index=index, handle=leaf_qdisc(0), parent=leaf_class(0), limit=HOST_QUEUE_PACKETS)


def _delete_root(ipr, index: int) -> None:
    """Delete the root qdisc of link ``index`` if it has one that can be deleted (a fresh veth has noqueue)."""
    with contextlib.suppress(Exception):  # ENOENT/EINVAL on the default qdisc: nothing to delete
        ipr.tc("del", index=index, parent=0xFFFFFFFF)


def queue_stats(ipr, index: int) -> dict[int, dict[str, int]]:
    """Per switch queue 0..7 of link ``index``: bytes, packets, drops, backlog (bytes) and qlen (packets) now.

    Bytes and packets are the HTB leaf class counters (what the queue sent); drops, backlog and qlen come from the
    leaf pfifo (tail drops when the queue is full). Queues without a class read as zeros.
    """
    stats = {q: {"bytes": 0, "packets": 0, "drops": 0, "backlog": 0, "qlen": 0} for q in range(SWITCH_QUEUES)}
    by_class = {leaf_class(q): q for q in range(SWITCH_QUEUES)}
    by_qdisc = {leaf_qdisc(q): q for q in range(SWITCH_QUEUES)}
    for msg in ipr.get_classes(index=index):
        queue = by_class.get(msg["handle"])
        if queue is not None:
            st2 = msg.get_attr("TCA_STATS2")
            basic = st2.get_attr("TCA_STATS_BASIC") if st2 is not None else None
            if basic:
                stats[queue]["bytes"] = int(basic["bytes"])
                stats[queue]["packets"] = int(basic["packets"])
    for msg in ipr.get_qdiscs(index=index):
        queue = by_qdisc.get(msg["handle"])
        st2 = msg.get_attr("TCA_STATS2")
        qstats = st2.get_attr("TCA_STATS_QUEUE") if st2 is not None else None
        if queue is not None and qstats:
            stats[queue]["drops"] = int(qstats["drops"])
            stats[queue]["backlog"] = int(qstats["backlog"])
            stats[queue]["qlen"] = int(qstats["qlen"])
    return stats


__all__ = [
    "ETH_P_IP", "SWITCH_QUEUES", "SWITCH_QUEUE_PACKETS", "HOST_QUEUE_PACKETS", "leaf_class", "leaf_qdisc",
    "burst_bytes", "guaranteed_bps", "install_strict_priority", "install_fifo", "add_tos_filter", "add_tclass_filter",
    "queue_stats",
]
