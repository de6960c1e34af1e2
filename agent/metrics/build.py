"""What is running: the agent's version, the kernel backend it uses, how many levels, since when.

- ``tensorlane_build_info{version,python_version}`` (1)
- ``tensorlane_backend_info{device,backend}`` (1): ``htb`` or ``prio``
- ``tensorlane_priority_levels{device}``: the configured number of levels (the default class is extra)
- ``tensorlane_agent_start_time_seconds``: Unix time the agent started serving
"""
from __future__ import annotations

import platform

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source


class BuildSource(Source):
    """Version, backend, levels and start time of the agent."""

    name = "build"

    def collect(self, scrape):
        """The agent's info and configuration gauges (no kernel reads)."""
        from tensorlane.agent.api import VERSION

        api = self.api
        build = names.BUILD.info()
        build.add_metric([], {"version": VERSION, "python_version": platform.python_version()})
        yield build
        backend, levels = names.BACKEND.info(), names.PRIORITY_LEVELS.gauge()
        for device in scrape.devices:  # one series per queue device
            backend.add_metric([device.name], {"backend": api.backend})
            levels.add_metric([device.name], api.cfg.levels)
        yield backend
        yield levels
        yield names.AGENT_START_TIME.gauge(api.started)
