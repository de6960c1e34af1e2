"""What is running: the agent's version, the kernel backend it uses, how many levels, since when.

- ``tensorlane_build_info{version,python_version}`` (1)
- ``tensorlane_backend_info{device,backend}`` (1): ``htb`` or ``prio``
- ``tensorlane_priority_levels{device}``: the configured number of levels (the default class is extra)
- ``tensorlane_agent_start_time_seconds``: Unix time the agent started serving
"""
from __future__ import annotations

import platform

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from tensorlane.agent.metrics.base import Source


class BuildSource(Source):
    name = "build"

    def collect(self, scrape):
        from tensorlane.agent.api import VERSION

        api, dev = self.api, scrape.device
        build = InfoMetricFamily("tensorlane_build", "Version of the running agent")
        build.add_metric([], {"version": VERSION, "python_version": platform.python_version()})
        yield build
        backend = InfoMetricFamily("tensorlane_backend", "Kernel queueing backend in use", labels=["device"])
        backend.add_metric([dev], {"backend": api.backend})
        yield backend
        levels = GaugeMetricFamily("tensorlane_priority_levels", "Priority levels the agent manages",
                                   labels=["device"])
        levels.add_metric([dev], api.cfg.levels)
        yield levels
        yield GaugeMetricFamily("tensorlane_agent_start_time_seconds", "Unix time the agent started serving",
                                value=api.started)
