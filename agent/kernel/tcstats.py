"""Per-class kernel counters of the managed interface, read from netlink at the moment of asking.

Bytes are the main counter (pyroute2 decodes 32-bit packet counters only). Usage:
``class_stats(ipr, ifindex)[classid]["bytes"]``
"""
from __future__ import annotations


def class_stats(ipr, index: int) -> dict[int, dict[str, int]]:
    """``{classid: {bytes, packets, drops, overlimits, requeues, backlog_bytes, backlog_packets}}``."""
    out: dict[int, dict[str, int]] = {}
    for msg in ipr.get_classes(index=index):
        stats2 = msg.get_attr("TCA_STATS2")
        basic = stats2.get_attr("TCA_STATS_BASIC") if stats2 else None
        queue = stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None
        out[msg["handle"]] = {
            "bytes": (basic or {}).get("bytes", 0), "packets": (basic or {}).get("packets", 0),
            "drops": (queue or {}).get("drops", 0), "overlimits": (queue or {}).get("overlimits", 0),
            "requeues": (queue or {}).get("requeues", 0), "backlog_bytes": (queue or {}).get("backlog", 0),
            "backlog_packets": (queue or {}).get("qlen", 0),
        }
    return out
