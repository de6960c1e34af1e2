"""Per-class kernel counters of the managed interface, read from netlink at the moment of asking.

The kernel reports a class's counters in ``TCA_STATS2``: ``TCA_STATS_BASIC`` (64-bit bytes, 32-bit packets),
``TCA_STATS_PKT64`` (the 64-bit packet count, sent only once it no longer fits in 32 bits; pyroute2 does not
decode it, so ``pkt64`` reads it from the attribute's bytes), ``TCA_STATS_QUEUE`` and, for HTB classes,
``TCA_STATS_APP`` = ``struct tc_htb_xstats {u32 lends, borrows, giants; s32 tokens, ctokens}`` (tokens in psched
ticks of 64 ns). Usage: ``class_stats(ipr, ifindex)[classid]["bytes"]``
"""
from __future__ import annotations

import struct

TCA_STATS_PKT64 = 8
PSCHED_TICK_S = 64e-9  # PSCHED_SHIFT = 6: one psched tick is 2**6 ns
HTB_KEYS = ("lends", "borrows", "tokens", "ctokens")


def pkt64(stats2) -> int | None:
    """The ``TCA_STATS_PKT64`` packet count inside a decoded ``TCA_STATS2`` attribute, or None when absent."""
    data, start = stats2.data, stats2.offset
    pos, end = start + 4, start + stats2.length
    while pos + 4 <= end:
        length, kind = struct.unpack_from("HH", data, pos)
        if length < 4:
            return None
        if kind & 0x3FFF == TCA_STATS_PKT64 and length >= 12:
            return struct.unpack_from("Q", data, pos + 4)[0]
        pos += (length + 3) & ~3
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
