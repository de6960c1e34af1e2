"""tc class counters of each queue device: one series per device and leaf class (one per level, and the default
class); ``device`` is where the queue is (a bond's members, not the bond).

Level, DSCP and HTB prio are labels of ``tensorlane_class_info`` only; join them where needed
(``* on (instance, device, class) group_left (level) tensorlane_class_info``). Byte and packet counters are
64-bit (``agent/kernel/tcstats.py`` decodes ``TCA_STATS_PKT64``). HTB classes add their lend/borrow counters (the
kernel's 32-bit ones: a wrap is a counter reset to rate()) and token buckets, and the rate each class is
guaranteed (the agent's own setting: ``min_share``, or a job's part of ``job_share``); prio classes have none.
"""
from __future__ import annotations

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source, class_label, level_label, link_rate_bps

COUNTERS = (  # (metric, tcstats key)
    (names.CLASS_SENT_BYTES, "bytes"),
    (names.CLASS_SENT_PACKETS, "packets"),
    (names.CLASS_DROPPED_PACKETS, "drops"),
    (names.CLASS_OVERLIMITS, "overlimits"),
    (names.CLASS_REQUEUES, "requeues"),
    (names.CLASS_LENDS, "lends"),
    (names.CLASS_BORROWS, "borrows"),
)
GAUGES = (
    (names.CLASS_BACKLOG_BYTES, "backlog_bytes"),
    (names.CLASS_BACKLOG_PACKETS, "backlog_packets"),
    (names.CLASS_TOKENS, "tokens"),
    (names.CLASS_CTOKENS, "ctokens"),
)


class ClassesSource(Source):
    """The kernel's counters of every leaf class, their info and the link rate."""

    name = "classes"

    def collect(self, scrape):
        """Info of every leaf class of every queue device; its counters, backlog and HTB statistics unless the
        class is missing in the kernel (drift); each device's link rate."""
        api = self.api
        info = names.CLASS.info()
        counters = [(metric.counter(), key) for metric, key in COUNTERS]
        gauges = [(metric.gauge(), key) for metric, key in GAUGES]
        link = names.LINK_RATE.gauge()
        guaranteed = names.CLASS_GUARANTEED_RATE.gauge()
        for device in scrape.devices:
            dev, stats = device.name, scrape.classes(device.name)
            rate_of = getattr(device.backend, "guaranteed", None)  # htb only
            for spec in scrape.leaves():
                cls = class_label(spec)
                dscp = "unchanged" if spec.level is None else str(api.cfg.dscp[spec.level])
                info.add_metric([dev, cls], {"level": level_label(spec), "dscp": dscp, "prio": str(spec.prio)})
                if rate_of is not None:
                    guaranteed.add_metric([dev, cls], rate_of(spec.level) / 8)
                s = stats.get(spec.classid)
                if s is None:  # the class is missing (drift): no counters, the reconciler puts it back
                    continue
                for fam, key in (*counters, *gauges):
                    if key in s:  # HTB's lends/borrows/tokens exist for HTB classes only
                        fam.add_metric([dev, cls], s[key])
            rate = link_rate_bps(api, device)
            if rate:
                link.add_metric([dev], rate / 8)
        yield info
        for fam, _ in (*counters, *gauges):
            yield fam
        if link.samples:
            yield link
        if guaranteed.samples:
            yield guaranteed
