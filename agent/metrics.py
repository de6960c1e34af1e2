"""Prometheus metrics of the agent, read from the kernel at scrape time (no polling thread).

Usage: ``start_metrics_server("127.0.0.1:9477", api)``
"""
from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from pyroute2 import IPRoute

from agent.kernel import tcstats
from agent.kernel.qdisc import fmt_handle


class ClassCollector(Collector):
    """Per-class counters of the managed interface, and the flows registered per level."""

    def __init__(self, api):
        self.api = api

    def collect(self):
        api, dev = self.api, self.api.cfg.interface
        with IPRoute() as ipr:
            stats = tcstats.class_stats(ipr, api.rec.ifindex)
        info = InfoMetricFamily("tensorlane_class", "Level, DSCP and kernel class of each queue",
                                labels=["device", "class"])
        sent = CounterMetricFamily("tensorlane_class_sent_bytes", "Bytes sent by the class",
                                   labels=["device", "class"])
        drops = CounterMetricFamily("tensorlane_class_drops", "Packets dropped by the class",
                                    labels=["device", "class"])
        backlog = GaugeMetricFamily("tensorlane_class_backlog_bytes", "Bytes queued in the class",
                                    labels=["device", "class"])
        for spec in api.rec.backend.leaves():
            cls = fmt_handle(spec.classid)
            level = "default" if spec.level is None else str(spec.level)
            dscp = "" if spec.level is None else str(api.cfg.dscp[spec.level])
            info.add_metric([dev, cls], {"level": level, "dscp": dscp})
            s = stats.get(spec.classid, {})
            sent.add_metric([dev, cls], s.get("bytes", 0))
            drops.add_metric([dev, cls], s.get("drops", 0))
            backlog.add_metric([dev, cls], s.get("backlog_bytes", 0))
        flows = GaugeMetricFamily("tensorlane_flows_registered", "Flows registered, by level", labels=["level"])
        for level, keys in api.table.by_level().items():
            flows.add_metric([str(level)], len(keys))
        yield from (info, sent, drops, backlog, flows)


def start_metrics_server(address: str, api) -> CollectorRegistry:
    """Serve /metrics on ``address`` ("host:port") from a fresh registry with the agent's collectors."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry()
    registry.register(ClassCollector(api))
    start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    return registry
