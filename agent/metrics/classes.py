"""tc class counters of the managed interface: one series per leaf class (one per level, and the default class).

Level, DSCP and HTB prio are labels of ``tensorlane_class_info`` only; join them where needed
(``* on (instance, device, class) group_left (level) tensorlane_class_info``). Packet counters are the kernel's
32-bit ones (pyroute2 decodes no 64-bit packet counter): they wrap after 2^32 packets, which Prometheus' rate()
treats as a counter reset. Byte counters are 64-bit.
"""
from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
)

from tensorlane.agent.metrics.base import (
    Source,
    class_label,
    level_label,
    link_rate_bps,
)

COUNTERS = (  # (metric base name, tcstats key, help)
    ("tensorlane_class_sent_bytes", "bytes", "Bytes sent by the class"),
    ("tensorlane_class_sent_packets", "packets", "Packets sent by the class (32-bit kernel counter)"),
    ("tensorlane_class_dropped_packets", "drops", "Packets dropped by the class's queue"),
    ("tensorlane_class_overlimits", "overlimits", "Times the class was throttled by its rate (HTB overlimits)"),
    ("tensorlane_class_requeues", "requeues", "Packets requeued by the class"),
)
GAUGES = (
    ("tensorlane_class_backlog_bytes", "backlog_bytes", "Bytes queued in the class now"),
    ("tensorlane_class_backlog_packets", "backlog_packets", "Packets queued in the class now"),
)
LABELS = ["device", "class"]


class ClassesSource(Source):
    name = "classes"

    def collect(self, scrape):
        api, dev = self.api, scrape.device
        stats = scrape.classes()
        info = InfoMetricFamily("tensorlane_class", "Level, DSCP and HTB/prio priority of each queue of the agent",
                                labels=LABELS)
        counters = [(CounterMetricFamily(n, h, labels=LABELS), k) for n, k, h in COUNTERS]
        gauges = [(GaugeMetricFamily(n, h, labels=LABELS), k) for n, k, h in GAUGES]
        for spec in scrape.leaves():
            cls = class_label(spec)
            dscp = "unchanged" if spec.level is None else str(api.cfg.dscp[spec.level])
            info.add_metric([dev, cls], {"level": level_label(spec), "dscp": dscp, "prio": str(spec.prio)})
            s = stats.get(spec.classid)
            if s is None:  # the class is missing (drift): no counters, the reconciler puts it back
                continue
            for fam, key in (*counters, *gauges):
                fam.add_metric([dev, cls], s.get(key, 0))
        yield info
        for fam, _ in (*counters, *gauges):
            yield fam
        rate = link_rate_bps(api)
        if rate:
            link = GaugeMetricFamily("tensorlane_link_rate_bytes_per_second",
                                     "Rate the agent's queues are served at (htb: the configured link_rate)",
                                     labels=["device"])
            link.add_metric([dev], rate / 8)
            yield link
