"""Contention between the agent's classes, estimated at scrape time from the kernel's class counters.

- ``tensorlane_class_inversion_bytes_total{device,class}``: priority inversion, estimated. At each scrape, for
  each class C, the bytes C sent since the previous scrape are added if some more urgent class U (lower prio)
  had a non-zero backlog both at the previous scrape and at this one. A backlogged U should leave C nothing but
  its HTB guarantee (``min_share`` of the link, 1 % by default, at least ``min_rate``), so this counter growing by
  more than that means lower-priority bytes went out while urgent bytes waited. A class's guarantee beyond
  ``min_share``'s (``min_rate``'s raise on a slow link, a job's part of ``job_share`` under a job policy:
  docs/jobs.md) is by design too, and is not counted: C's bytes count
  only beyond that rate over the interval. It is an estimate from two instants, not
  a measurement: U's queue may have drained and refilled between the scrapes (counted although there was no
  inversion), or been backlogged only between them (missed). It gets sharper with shorter scrape intervals;
  several Prometheus servers scraping the same agent make the intervals shorter, not wrong. HTB's own
  guarantee to each class (by design) is included: ``min_share``'s own part of it, which the next series gives.
- ``tensorlane_class_min_share_rate_bytes_per_second{device,class}``: that included part, in bytes/s: HTB's
  guarantee from ``min_share`` alone (:meth:`HtbBackend.least`); 0 on the prio backend, which guarantees nothing and
  subtracts nothing. TensorlanePriorityInversion's threshold adds the lower classes' sum of it (dashboards/rules.yml),
  so the alert fires on inversion beyond what the configuration guarantees, whatever ``min_share`` is.
- ``tensorlane_class_queue_delay_seconds{device,class}``: the queueing delay a packet entering C now would see
  if nothing more urgent arrived: (backlog of C and of every more urgent class) / link rate. Exact for the top
  class under strict priority (up to the packet on the wire and the lower classes' tiny guarantees); a lower
  bound for the others. Absent when the link rate is unknown.
"""
from __future__ import annotations

import threading
import time

from tensorlane.agent.metrics import names
from tensorlane.agent.metrics.base import Source, class_label, link_rate_bps


class ContentionSource(Source):
    """Priority inversion and queueing delay, estimated from the class counters of successive scrapes."""

    name = "contention"

    def __init__(self, api):
        """No scrape seen yet: the first one only records the counters."""
        super().__init__(api)
        self._lock = threading.Lock()
        # device -> (monotonic time, {classid: (bytes, backlog_bytes)}) of its previous reading
        self._prev: dict[str, tuple[float, dict[int, tuple[int, int]]]] = {}
        self._inversion: dict[str, dict[int, int]] = {}

    def observe(self, leaves, stats: dict[int, dict[str, int]], device: str = "", when: float | None = None,
                allowed_Bps: dict[int, float] | None = None) -> dict[int, int]:
        """Fold one reading of ``device``'s class counters, taken at monotonic time ``when``, into its inversion
        totals; return them (classid -> bytes). ``allowed_Bps``: per class, a guaranteed rate in bytes/s beyond
        ``min_share`` whose bytes are by design (not counted)."""
        when = time.monotonic() if when is None else when
        allowed_Bps = allowed_Bps or {}
        now = {s.classid: (stats[s.classid]["bytes"], stats[s.classid]["backlog_bytes"])
               for s in leaves if s.classid in stats}
        with self._lock:
            then, prev = self._prev.get(device, (when, None))
            inversion = self._inversion.setdefault(device, {})
            if prev is not None:
                for spec in leaves:
                    if spec.classid not in now or spec.classid not in prev:
                        continue
                    urgent_waiting = any(
                        u.prio < spec.prio and prev.get(u.classid, (0, 0))[1] > 0 and now.get(u.classid, (0, 0))[1] > 0
                        for u in leaves)
                    sent = now[spec.classid][0] - prev[spec.classid][0]
                    sent -= int(allowed_Bps.get(spec.classid, 0.0) * max(0.0, when - then))
                    if urgent_waiting and sent > 0:
                        inversion[spec.classid] = inversion.get(spec.classid, 0) + sent
            self._prev[device] = (when, now)
            return dict(inversion)

    def collect(self, scrape):
        """The inversion totals (updated with this scrape) and the queueing delay of each class of each queue
        device."""
        leaves = scrape.leaves()
        inversion = names.CLASS_INVERSION_BYTES.counter()
        included = names.CLASS_MIN_SHARE_RATE.gauge()
        delay = names.CLASS_QUEUE_DELAY.gauge()
        for device in scrape.devices:
            dev, stats = device.name, scrape.classes(device.name)
            totals = self.observe(leaves, stats, dev, scrape.monotonic, _beyond_min_share(device.backend, leaves))
            base = min_share_Bps(device.backend)
            for spec in leaves:
                inversion.add_metric([dev, class_label(spec)], totals.get(spec.classid, 0))
                included.add_metric([dev, class_label(spec)], base)
            rate = link_rate_bps(self.api, device)
            ahead = 0
            for spec in leaves if rate else ():  # most urgent first; none when the rate is unknown
                ahead += stats.get(spec.classid, {}).get("backlog_bytes", 0)
                delay.add_metric([dev, class_label(spec)], ahead * 8 / rate)
        yield inversion
        yield included
        if delay.samples:
            yield delay


def min_share_Bps(backend) -> float:
    """The rate in bytes/s every leaf is guaranteed by ``min_share`` alone (:meth:`HtbBackend.least`): what
    :func:`_beyond_min_share` leaves in the inversion counter. 0 for a backend with no guarantees (prio).
    Usage: ``min_share_Bps(HtbBackend(4, 200_000_000, min_share=0.03)) == 750_000.0``"""
    least = getattr(backend, "least", None)
    return least() / 8 if least is not None else 0.0


def _beyond_min_share(backend, leaves) -> dict[int, float]:
    """Per class, its guaranteed rate beyond ``min_share``'s own (``min_rate``'s raise and the job policy's part of
    ``job_share``, both by design), in bytes/s. Until 2026-11-27 ``min_rate``'s raise was counted: 4 lower classes
    at 2.5 Mbit/s of a 50 Mbit/s link made 20 %, and TensorlanePriorityInversion (8 %) fired on a healthy host."""
    guaranteed = getattr(backend, "guaranteed", None)
    if guaranteed is None:  # a backend with no guarantees (prio)
        return {}
    base = min_share_Bps(backend)
    beyond = {s.classid: guaranteed(s.level) / 8 - base for s in leaves}
    return {classid: Bps for classid, Bps in beyond.items() if Bps > 0}
