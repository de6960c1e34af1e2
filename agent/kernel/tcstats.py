"""Per-class kernel counters of the managed interface, read from netlink at the moment of asking.

The kernel reports a class's counters in ``TCA_STATS2``: ``TCA_STATS_BASIC`` (64-bit bytes, 32-bit packets),
``TCA_STATS_PKT64`` (the 64-bit packet count, sent only once it no longer fits in 32 bits; pyroute2 does not
decode it, so ``pkt64`` reads it from the attribute's bytes), ``TCA_STATS_QUEUE`` and, for HTB classes,
``TCA_STATS_APP`` = ``struct tc_htb_xstats {u32 lends, borrows, giants; s32 tokens, ctokens}`` (tokens in psched
ticks of 64 ns). Usage: ``class_stats(ipr, ifindex)[classid]["bytes"]``

``class_backlogs`` reads only the queue lengths, from the dump's bytes: the job policy's sample of which jobs are
sending runs it 20 times a second, where decoding every attribute would cost several times more CPU.
"""
from __future__ import annotations

import os
import socket
import struct

from tensorlane.agent.kernel.netlink import (
    MAX_RECVS,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HDR,
    RTM_GETTCLASS,
    RTM_NEWTCLASS,
    attrs,
    messages,
)

TCA_STATS_PKT64 = 8
TCA_STATS2, TCA_STATS_QUEUE = 7, 3
TCMSG = struct.Struct("=BBHiIII")  # family, pad, pad, ifindex, handle, parent, info
PSCHED_TICK_S = 64e-9  # PSCHED_SHIFT = 6: one psched tick is 2**6 ns
HTB_KEYS = ("lends", "borrows", "tokens", "ctokens")


def pkt64(stats2) -> int | None:
    """The ``TCA_STATS_PKT64`` packet count inside a decoded ``TCA_STATS2`` attribute, or None when absent."""
    start = stats2.offset
    for kind, vstart, vend in attrs(stats2.data, start + 4, start + stats2.length):
        if kind == TCA_STATS_PKT64 and vend - vstart >= 8:
            return struct.unpack_from("Q", stats2.data, vstart)[0]
    return None


def htb_xstats(stats2) -> dict[str, float]:
    """``{lends, borrows, tokens, ctokens}`` of an HTB class (tokens in seconds), ``{}`` for other classes."""
    app = stats2.get_attr("TCA_STATS_APP")
    if not isinstance(app, dict) or "lends" not in app:  # prio classes send no xstats
        return {}
    return {"lends": app["lends"], "borrows": app["borrows"], "tokens": app["tokens"] * PSCHED_TICK_S,
            "ctokens": app["ctokens"] * PSCHED_TICK_S}


def decode(stats2) -> dict[str, float]:
    """One class's counters from its ``TCA_STATS2`` attribute (None: all zero); packets 64-bit when present."""
    basic = (stats2.get_attr("TCA_STATS_BASIC") if stats2 else None) or {}
    queue = (stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None) or {}
    packets = pkt64(stats2) if stats2 else None
    out = {
        "bytes": basic.get("bytes", 0), "packets": basic.get("packets", 0) if packets is None else packets,
        "drops": queue.get("drops", 0), "overlimits": queue.get("overlimits", 0),
        "requeues": queue.get("requeues", 0), "backlog_bytes": queue.get("backlog", 0),
        "backlog_packets": queue.get("qlen", 0),
    }
    return out | (htb_xstats(stats2) if stats2 else {})


def class_stats(ipr, index: int) -> dict[int, dict[str, float]]:
    """``{classid: {bytes, packets, drops, overlimits, requeues, backlog_bytes, backlog_packets}}``, and for HTB
    classes ``lends``, ``borrows`` (32-bit kernel counters), ``tokens``, ``ctokens`` (seconds)."""
    return {msg["handle"]: decode(msg.get_attr("TCA_STATS2")) for msg in ipr.get_classes(index=index)}


def _qlen(data: bytes, pos: int, end: int) -> int:
    """``qlen`` of ``TCA_STATS2``/``TCA_STATS_QUEUE`` among the class message's attributes in ``data[pos:end]``
    (``struct gnet_stats_queue {u32 qlen, backlog, drops, requeues, overlimits}``), 0 where absent."""
    for kind, start, stop in attrs(data, pos, end):
        if kind == TCA_STATS2:
            for inner, istart, istop in attrs(data, start, stop):
                if inner == TCA_STATS_QUEUE and istop - istart >= 4:
                    return struct.unpack_from("=I", data, istart)[0]
    return 0


def class_backlogs(index: int, sock: socket.socket | None = None) -> dict[int, int]:
    """``{classid: packets queued}`` of every class of interface ``index`` in this process's network namespace:
    one netlink dump, only ``TCA_STATS_QUEUE``'s ``qlen`` read (the ``backlog_packets`` of :func:`class_stats`).
    ``sock``: an open ``NETLINK_ROUTE`` socket to reuse. Raises OSError when the kernel refuses the dump."""
    own = sock is None
    sock = sock or socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        seq = int.from_bytes(os.urandom(4), "little")
        body = TCMSG.pack(socket.AF_UNSPEC, 0, 0, index, 0, 0, 0)
        sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), RTM_GETTCLASS, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
        out: dict[int, int] = {}
        what = f"class dump of interface {index}"
        for kind, mseq, data, pos, length in messages(sock, what):
            if mseq != seq:
                continue
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                code = struct.unpack_from("=i", data, pos + NLMSG_HDR.size)[0]
                if code:
                    raise OSError(-code, f"{what}: {os.strerror(-code)}")
            elif kind == RTM_NEWTCLASS and length >= NLMSG_HDR.size + TCMSG.size:
                _, _, _, ifindex, handle, _, _ = TCMSG.unpack_from(data, pos + NLMSG_HDR.size)
                if ifindex == index:
                    out[handle] = _qlen(data, pos + NLMSG_HDR.size + TCMSG.size, pos + length)
        raise OSError(f"{what}: no end after {MAX_RECVS} datagrams")
    finally:
        if own:
            sock.close()
