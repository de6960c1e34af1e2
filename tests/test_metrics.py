"""The agent's metrics without a kernel: every source on a fake agent (the kernel's counters are stubbed), the
report op end to end, the shim's reporter, the HTTP endpoints, and the names linted by `promtool check metrics`.
The namespace and Prometheus tests are in test_metrics_prometheus.py."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import socketserver
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_security_netns import NOBODY, in_child

from tensorlane.agent import protocol
from tensorlane.agent.api import Api
from tensorlane.agent.config import from_dict
from tensorlane.agent.handover import FlowJournal
from tensorlane.agent.kernel import tcstats
from tensorlane.agent.kernel.qdisc import HtbBackend
from tensorlane.agent.metrics import Health, make_registry, names, start_metrics_server
from tensorlane.agent.metrics import base as metrics_base
from tensorlane.agent.metrics import flows as metrics_flows
from tensorlane.agent.metrics.api import BUCKETS
from tensorlane.agent.metrics.jobs import OTHER, JobReports
from tensorlane.agent.reconcile import Device, ReconcileStats
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey
from tensorlane.shim.report import Reporter
from tensorlane.shim.report import start as start_reporter

RATE_BPS = 200_000_000
L0, L1, L2, L3, DEFAULT = (0x7A10010 + i for i in range(5))


class FakeRec:
    """The parts of the Reconciler the api and the metrics use; no kernel."""

    def __init__(self, levels: int = 4):
        self.backend = HtbBackend(levels, RATE_BPS)
        self.stats = ReconcileStats()
        self.devices = [Device("eth0", 7, self.backend, "eth0")]
        self.interfaces = {"eth0": 7}

    def egress(self, keys, ipr=None) -> dict:
        return dict.fromkeys(keys, "eth0")

    def apply(self, table, added, moved, removed) -> None:
        pass

    def share_budget(self) -> float:
        return self.backend.share_budget()

    def link_bps(self) -> int | None:
        return getattr(self.backend, "rate", None)

    def set_shares(self, shares) -> bool:
        return self.backend.set_shares(shares)


class Kernel:
    """Stands in for the kernel's class counters and nftables marks (set ``classes`` / ``marks``)."""

    def __init__(self):
        self.classes = {cid: zero() for cid in (L0, L1, L2, L3, DEFAULT)}
        self.marks: dict[int, dict[str, int]] = {}
        self.reset = {"packets": 0, "bytes": 0}
        self.fail = False


def zero(**kw) -> dict:
    """An HTB class's counters as ``tcstats.class_stats`` has them, all zero but ``kw``."""
    return {"bytes": 0, "packets": 0, "drops": 0, "overlimits": 0, "requeues": 0, "backlog_bytes": 0,
            "backlog_packets": 0, "lends": 0, "borrows": 0, "tokens": 0.0, "ctokens": 0.0, **kw}


@pytest.fixture
def kernel(monkeypatch) -> Kernel:
    k = Kernel()

    def classes(self, device):
        if k.fail:
            raise OSError("netlink says no")
        return {cid: dict(v) for cid, v in k.classes.items()}

    monkeypatch.setattr(metrics_base.Scrape, "classes", classes)
    monkeypatch.setattr(metrics_flows, "marked_counters", lambda levels: k.marks)
    monkeypatch.setattr(metrics_flows, "reset_counters", lambda: k.reset)
    return k


def fake_api(levels: int = 4, **fields) -> Api:
    cfg = from_dict({"interface": "eth0", "link_rate": "200mbit", "levels": levels, "reconcile_interval_s": 1,
                     **fields})
    return Api(cfg, FlowTable(levels), FakeRec(levels), "htb")


def request(api: Api, **msg) -> dict:
    return json.loads(api.handle(json.dumps(msg).encode()))


def flow(i: int) -> dict:
    return {"proto": "tcp", "src": "198.18.0.1", "sport": 10000 + i, "dst": "198.18.0.2", "dport": 20000}


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label items): value}`` of one scrape."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = {k: str(v) for k, v in labels.items()}
    hits = [v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == x for k, x in want.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


# --- names ------------------------------------------------------------------------------------------------------

def test_exposition_passes_promtool_lint_and_has_no_reserved_labels(kernel):
    api = fake_api()
    request(api, op="register", job="job-a", level=0, flows=[flow(1)])
    request(api, op="report", job="job-a", session="s1", levels=[{"level": 0, "allreduces": 2, "bytes": 8,
                                                                       "comm_s": 0.25}])
    registry, _ = make_registry(api)
    text = generate_latest(registry)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (scripts/bootstrap)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), \
        (lint.stdout + lint.stderr).decode()
    exported = set()
    for fam in text_string_to_metric_families(text.decode()):
        exported.add(fam.name)
        assert fam.name.startswith(("tensorlane_", "process_", "python_")), fam.name
        for s in fam.samples:
            assert not {"job", "instance"} & set(s.labels), f"{s.name} uses a label Prometheus reserves"
    assert {"tensorlane_class_info", "tensorlane_class_sent_bytes", "tensorlane_class_inversion_bytes",
            "tensorlane_class_queue_delay_seconds", "tensorlane_registered_flows", "tensorlane_api_requests",
            "tensorlane_api_request_duration_seconds", "tensorlane_reconcile_errors", "tensorlane_backend_info",
            "tensorlane_build_info", "tensorlane_job_allreduce_seconds",
            "tensorlane_link_rate_bytes_per_second", "tensorlane_agent_connections_refused",
            "tensorlane_class_lent_packets", "tensorlane_class_borrowed_packets", "tensorlane_class_tokens_seconds",
            "tensorlane_class_ctokens_seconds", "tensorlane_class_guaranteed_rate_bytes_per_second",
            "tensorlane_class_min_share_rate_bytes_per_second", "process_cpu_seconds",
            "process_resident_memory_bytes"} <= exported


def test_every_exported_name_is_declared_once_in_the_names_module(kernel):
    declared = [m.name for m in names.ALL]
    assert len(declared) == len(set(declared)) and all(n.startswith("tensorlane_") for n in declared)
    registry, _ = make_registry(fake_api())
    exported = {fam.name for fam in registry.collect() if fam.name.startswith("tensorlane_")}  # as names.py has them
    assert len(exported) > 30 and exported <= set(declared), sorted(exported - set(declared))



def test_docs_metrics_table_is_the_names_module(kernel):
    """docs/metrics.md's table has a row for every metric of names.py and no other, with its labels (an info
    metric's row adds its info keys) and, for what a scrape exports, its type; the sources named there are the
    collector label's values."""
    import re
    from pathlib import Path

    from tensorlane.agent.metrics import SOURCES

    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    rows = {m[0]: (m[1], {x.strip() for x in m[2].split(",") if x.strip()})
            for m in re.findall(r"^\| `(tensorlane_[a-z_]+)` \| ([^|]+?) \|([^|]*)\|", doc, re.M)}
    declared = {n.name: n for n in names.ALL}
    base = {re.sub(r"_(total|info)$", "", r) if re.sub(r"_(total|info)$", "", r) in declared else r: r for r in rows}
    assert set(base) == set(declared), f"docs/metrics.md vs names.py: {sorted(set(base) ^ set(declared))}"
    for name, n in declared.items():
        kind, labels = rows[base[name]]
        assert labels == set(n.labels) or (kind == "info (1)" and labels > set(n.labels)), (name, labels, n.labels)
    api = fake_api(job_policy="shortest", job_share="auto")
    api.journal = FlowJournal(api.cfg, api.table)  # (the flow table file's series: the daemon always keeps one)
    registry, _ = make_registry(api)
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    api.jobs.observe({0}, 1.0)
    kinds = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "info": "info (1)"}
    typed = {fam.name: fam.type for fam in registry.collect() if fam.name in declared}
    assert len(typed) > 30
    for name, kind in typed.items():
        assert rows[base[name]][0] == kinds[kind], f"{name}: docs say {rows[base[name]][0]}, exported as {kind}"
        assert base[name] == name + {"counter": "_total", "info": "_info"}.get(kind, ""), base[name]
    assert all(f"`{cls.name}`" in doc for cls in SOURCES), [cls.name for cls in SOURCES if f"`{cls.name}`" not in doc]

# --- classes, contention ----------------------------------------------------------------------------------------

def test_class_counters_info_and_link_rate(kernel):
    api = fake_api()
    kernel.classes[L0] = zero(bytes=1000, packets=10, drops=1, overlimits=2, requeues=3, backlog_bytes=1514,
                              backlog_packets=1)
    registry, _ = make_registry(api)
    s = scrape(registry)
    assert value(s, "tensorlane_class_sent_bytes_total", **{"class": "7a1:10"}) == 1000
    assert value(s, "tensorlane_class_sent_packets_total", **{"class": "7a1:10"}) == 10
    assert value(s, "tensorlane_class_dropped_packets_total", **{"class": "7a1:10"}) == 1
    assert value(s, "tensorlane_class_overlimits_total", **{"class": "7a1:10"}) == 2
    assert value(s, "tensorlane_class_requeues_total", **{"class": "7a1:10"}) == 3
    assert value(s, "tensorlane_class_backlog_bytes", **{"class": "7a1:10"}) == 1514
    assert value(s, "tensorlane_class_backlog_packets", **{"class": "7a1:10"}) == 1
    kernel.classes[DEFAULT] = zero(packets=2**40, lends=7, borrows=293, tokens=-0.064, ctokens=0.001)
    s = scrape(registry)
    assert value(s, "tensorlane_class_sent_packets_total", **{"class": "7a1:14"}) == 2**40  # no 32-bit wrap
    assert value(s, "tensorlane_class_lent_packets_total", **{"class": "7a1:14"}) == 7
    assert value(s, "tensorlane_class_borrowed_packets_total", **{"class": "7a1:14"}) == 293
    assert value(s, "tensorlane_class_tokens_seconds", **{"class": "7a1:14"}) == -0.064
    assert value(s, "tensorlane_class_ctokens_seconds", **{"class": "7a1:14"}) == 0.001
    kernel.classes = {cid: {k: v for k, v in zero().items() if k not in tcstats.HTB_KEYS} for cid in kernel.classes}
    s = scrape(registry)  # prio classes: no HTB statistics, the other counters as before
    assert not [n for n, _ in s if "lends" in n or "borrows" in n or "tokens" in n]
    assert value(s, "tensorlane_class_sent_packets_total", **{"class": "7a1:14"}) == 0
    info = {dict(lab)["class"]: dict(lab) for (n, lab) in s if n == "tensorlane_class_info"}
    assert info["7a1:10"] == {"device": "eth0", "class": "7a1:10", "level": "0", "dscp": "46", "prio": "0"}
    assert info["7a1:14"]["level"] == "default" and info["7a1:14"]["dscp"] == "unchanged"
    assert len(info) == 5
    assert value(s, "tensorlane_link_rate_bytes_per_second", device="eth0") == RATE_BPS / 8
    assert value(s, "tensorlane_class_guaranteed_rate_bytes_per_second", **{"class": "7a1:14"}) == 100_000 / 8
    assert value(s, "tensorlane_backend_info", backend="htb", device="eth0") == 1
    assert value(s, "tensorlane_priority_levels") == 4


class Attr:
    """A decoded netlink attribute as pyroute2 gives it: its message buffer, offset, length and decoded parts."""

    def __init__(self, data: bytes, attrs: dict):
        self.data, self.offset, self.length, self.attrs = data, 0, len(data), attrs

    def get_attr(self, name):
        return self.attrs.get(name)


def stats2(*nested: tuple[int, bytes]) -> bytes:
    """A TCA_STATS2 attribute's bytes holding the ``(type, payload)`` attributes, each padded to 4 bytes."""
    body = b"".join(struct.pack("HH", 4 + len(p), t) + p + bytes(-len(p) % 4) for t, p in nested)
    return struct.pack("HH", 4 + len(body), 7) + body


def test_tcstats_prefers_the_64_bit_packet_count_and_decodes_htb_xstats():
    basic = struct.pack("QI", 5 * 2**32, 7) + bytes(4)
    htb = {"lends": 1, "borrows": 2, "giants": 0, "tokens": 1000, "ctokens": -500}
    queue = {"qlen": 1, "backlog": 1514, "drops": 3, "requeues": 0, "overlimits": 4}
    big = Attr(stats2((1, basic), (6, b""), (8, struct.pack("Q", 2**32 + 7)), (4, bytes(20))),
               {"TCA_STATS_BASIC": {"bytes": 5 * 2**32, "packets": 7}, "TCA_STATS_QUEUE": queue,
                "TCA_STATS_APP": htb})
    got = tcstats.decode(big)
    assert got["packets"] == 2**32 + 7 and got["bytes"] == 5 * 2**32
    assert (got["lends"], got["borrows"]) == (1, 2)
    assert got["tokens"] == pytest.approx(64e-6) and got["ctokens"] == pytest.approx(-32e-6)
    assert (got["drops"], got["overlimits"], got["backlog_bytes"], got["backlog_packets"]) == (3, 4, 1514, 1)
    small = Attr(stats2((1, basic)), {"TCA_STATS_BASIC": {"bytes": 10, "packets": 7}})  # prio: no xstats, no PKT64
    got = tcstats.decode(small)
    assert got["packets"] == 7 and not set(tcstats.HTB_KEYS) & set(got)
    assert tcstats.decode(None)["packets"] == 0


def test_inversion_counts_lower_class_bytes_only_while_an_urgent_class_stays_backlogged(kernel):
    api = fake_api()
    registry, _ = make_registry(api)
    def inv(s, cid):
        return value(s, "tensorlane_class_inversion_bytes_total", **{"class": f"7a1:{cid - 0x7A10000:x}"})

    s = scrape(registry)
    assert all(inv(s, c) == 0 for c in (L0, L1, L2, L3, DEFAULT))
    # level 0 backlogged at this scrape only: the default class's bytes since the last scrape do not count
    kernel.classes[L0]["backlog_bytes"] = 3000
    kernel.classes[DEFAULT]["bytes"] += 1000
    s = scrape(registry)
    assert inv(s, DEFAULT) == 0
    # level 0 backlogged at both scrapes: the default class and level 2 sent while it waited
    kernel.classes[DEFAULT]["bytes"] += 500
    kernel.classes[L2]["bytes"] += 200
    kernel.classes[L0]["bytes"] += 9000  # the top class itself never counts
    s = scrape(registry)
    assert (inv(s, DEFAULT), inv(s, L2), inv(s, L0)) == (500, 200, 0)
    # level 0 drained; level 1 backlogged at two scrapes: only classes below level 1 count
    kernel.classes[L0]["backlog_bytes"] = 0
    kernel.classes[L1]["backlog_bytes"] = 1500
    scrape(registry)
    kernel.classes[L0]["bytes"] += 100
    kernel.classes[L1]["bytes"] += 100
    kernel.classes[DEFAULT]["bytes"] += 50
    s = scrape(registry)
    assert (inv(s, L0), inv(s, L1), inv(s, DEFAULT)) == (0, 0, 550)


def test_inversion_leaves_out_a_job_share_guarantee():
    """Under a job policy a lower job's level is guaranteed its part of ``job_share``: what it sends within that
    rate while a more urgent class waits is by design, and only the bytes beyond it count."""
    from tensorlane.agent.metrics.contention import ContentionSource, _beyond_min_share

    backend = HtbBackend(4, RATE_BPS, min_share=0.01)
    backend.set_shares({0: 0.1, 2: 0.1})  # two jobs, job_share 0.2: 20 Mbit/s = 2.5 MB/s each, beyond 2 Mbit/s
    allowed = _beyond_min_share(backend, backend.leaves())
    assert allowed == {L0: 2_250_000.0, L2: 2_250_000.0}  # bytes/s beyond min_share
    src = ContentionSource(fake_api())
    leaves = backend.leaves()
    stats = {c.classid: {"bytes": 0, "backlog_bytes": 0} for c in leaves}
    stats[L0]["backlog_bytes"] = 9000  # level 0 stays backlogged
    src.observe(leaves, stats, "eth0", when=10.0, allowed_Bps=allowed)
    stats = {c: dict(v) for c, v in stats.items()}
    stats[L2]["bytes"] = 3_000_000   # 1 s: 2.25 MB within the guarantee, 0.75 MB beyond it
    stats[DEFAULT]["bytes"] = 1_000  # no guarantee beyond min_share: counts whole
    got = src.observe(leaves, stats, "eth0", when=11.0, allowed_Bps=allowed)
    assert (got.get(L2), got.get(DEFAULT)) == (750_000, 1_000)
    stats = {c: dict(v) for c, v in stats.items()}
    stats[L2]["bytes"] += 2_000_000  # within the guarantee over the next second: nothing more
    got = src.observe(leaves, stats, "eth0", when=12.0, allowed_Bps=allowed)
    assert got.get(L2) == 750_000


def test_inversion_leaves_out_min_rates_raise():
    """``min_rate`` raises every class's guarantee on a slow link (2.5 Mbit/s of 50: 5 % each instead of
    ``min_share``'s 1 %): that raise is by design, as a job's part is; until 2026-11-27 it was counted, and four
    lower classes at their guarantee made 20 % of the link against TensorlanePriorityInversion's 8 %."""
    from tensorlane.agent.metrics.contention import _beyond_min_share

    backend = HtbBackend(4, 50_000_000, min_share=0.01, min_rate=2_500_000)
    assert backend.guaranteed(3) == backend.guaranteed(None) == 2_500_000 and backend.least() == 500_000
    allowed = _beyond_min_share(backend, backend.leaves())
    assert allowed == {c.classid: 250_000.0 for c in backend.leaves()}  # 2 Mbit/s each beyond min_share's 0.5


def test_the_min_share_rate_is_what_the_inversion_counter_includes_and_0_on_prio(kernel):
    """``tensorlane_class_min_share_rate_bytes_per_second``: per class, the part of its guarantee the inversion counter
    includes (``min_share``'s alone, ``min_rate``'s raise left out), which TensorlanePriorityInversion adds to its
    threshold; 0 on the prio backend, which guarantees nothing. Until 2026-11-29 the alert's threshold was a fixed
    8 %, and with ``min_share = 0.03`` four lower classes at their guarantees (12 %) fired it on a healthy host."""
    from tensorlane.agent.kernel.qdisc import PrioBackend
    from tensorlane.agent.metrics.contention import ContentionSource, _beyond_min_share, min_share_Bps

    api = fake_api(min_share=0.03)
    api.rec.backend = HtbBackend(4, RATE_BPS, min_share=0.03, min_rate=10_000_000)  # the raise: 10 of 6 Mbit/s
    api.rec.devices = [Device("eth0", 7, api.rec.backend, "eth0")]
    registry, _ = make_registry(api)
    s = scrape(registry)
    for cid in (L0, L1, L2, L3, DEFAULT):
        rate = value(s, "tensorlane_class_min_share_rate_bytes_per_second", **{"class": f"7a1:{cid - 0x7A10000:x}"})
        assert rate == 0.03 * RATE_BPS / 8 == 750_000
        assert value(s, "tensorlane_class_guaranteed_rate_bytes_per_second",
                     **{"class": f"7a1:{cid - 0x7A10000:x}"}) == 1_250_000  # min_rate's raise: not in the counter
    # a lower class sending its whole guarantee for 1 s while level 0 waits: the counter grows by the gauge
    backend, leaves = api.rec.backend, api.rec.backend.leaves()
    src = ContentionSource(api)
    stats = {c.classid: {"bytes": 0, "backlog_bytes": 9000 if c.classid == L0 else 0} for c in leaves}
    src.observe(leaves, stats, "eth0", when=1.0, allowed_Bps=_beyond_min_share(backend, leaves))
    stats[L3] = {"bytes": backend.guaranteed(3) // 8, "backlog_bytes": 0}
    got = src.observe(leaves, stats, "eth0", when=2.0, allowed_Bps=_beyond_min_share(backend, leaves))
    assert got[L3] == min_share_Bps(backend) == 750_000
    prio = PrioBackend(4)
    api.rec.backend = prio
    api.rec.devices = [Device("eth0", 7, prio, "eth0")]
    registry, _ = make_registry(api)
    s = scrape(registry)
    assert min_share_Bps(prio) == 0 and _beyond_min_share(prio, prio.leaves()) == {}
    assert {lab: v for (n, lab), v in s.items() if n == "tensorlane_class_min_share_rate_bytes_per_second"} == \
        {(("class", f"7a1:{i}"), ("device", "eth0")): 0.0 for i in range(1, 6)}


def static_two_jobs(job_share, registered=("job-a", "job-b")):
    """An api under ``job_policy = "static"`` (job-a first) with ``job_share``, its registry, and one flow of each job
    of ``registered`` registered in that order."""
    api = fake_api(job_policy="static", job_share=job_share, job_priority={"job-a": 0, "job-b": 1})
    registry, _ = make_registry(api)
    for i, job in enumerate(registered):
        request(api, op="register", job=job, level=0, flows=[flow(i)])
    return api, registry


def test_guaranteed_rate_shows_the_jobs_parts(kernel):
    """Under a job policy the first level of each job's band is guaranteed its part of ``job_share``."""
    api, registry = static_two_jobs(0.5)
    s = scrape(registry)
    rates = {c: value(s, "tensorlane_class_guaranteed_rate_bytes_per_second", **{"class": f"7a1:{c}"})
             for c in (10, 11, 12, 13, 14)}
    assert rates == {10: 0.25 * RATE_BPS / 8, 11: 12_500, 12: 0.25 * RATE_BPS / 8, 13: 12_500, 14: 12_500}
    request(api, op="unregister", job="job-b")
    s = scrape(registry)
    assert value(s, "tensorlane_class_guaranteed_rate_bytes_per_second", **{"class": "7a1:10"}) == 12_500


def test_job_policy_order_parts_and_saturation(kernel):
    """The job policy's source: the policy, each job's first level (its place in the order), the part in force and,
    with ``job_share = "auto"``, whether the jobs saturate the link; nothing under policy none."""
    assert not [n for n, _ in scrape(make_registry(fake_api())[0]) if n.startswith("tensorlane_job_policy")]
    api, registry = static_two_jobs("auto", registered=("job-b", "job-a"))
    s = scrape(registry)
    assert value(s, "tensorlane_job_policy_info", policy="static", device="eth0") == 1
    assert value(s, "tensorlane_job_first_level", training_job="job-a") == 0
    assert value(s, "tensorlane_job_first_level", training_job="job-b") == 2
    assert value(s, "tensorlane_job_order_changes_total") == 2 and value(s, "tensorlane_job_share_ratio") == 0.2
    assert value(s, "tensorlane_job_link_saturated") == 0
    assert not [n for n, _ in s if n == "tensorlane_job_link_busy_ratio"]  # no sample yet
    for i in range(api.jobs.busy.maxlen):  # the link busy at every sample: saturated
        api.jobs.observe({0}, 1.0 + i * api.jobs.sample_s)
    s = scrape(registry)
    assert value(s, "tensorlane_job_link_saturated") == 1 and value(s, "tensorlane_job_link_busy_ratio") == 1.0
    assert value(s, "tensorlane_job_share_ratio") == 0.95 and value(s, "tensorlane_job_share_changes_total") >= 1
    assert value(s, "tensorlane_scrape_collector_success", collector="job_policy") == 1


def test_queue_delay_is_backlog_ahead_over_link_rate(kernel):
    api = fake_api()
    kernel.classes[L0]["backlog_bytes"] = 25_000      # 1 ms at 25 MB/s
    kernel.classes[L2]["backlog_bytes"] = 50_000
    kernel.classes[DEFAULT]["backlog_bytes"] = 1_000_000
    registry, _ = make_registry(api)
    s = scrape(registry)

    def delay(c):
        return value(s, "tensorlane_class_queue_delay_seconds", **{"class": c})

    assert delay("7a1:10") == pytest.approx(0.001)
    assert delay("7a1:11") == pytest.approx(0.001)
    assert delay("7a1:12") == pytest.approx(0.003)
    assert delay("7a1:14") == pytest.approx(0.043)


def test_a_failing_source_is_reported_and_the_others_still_answer(kernel):
    api = fake_api()
    kernel.fail = True
    registry, _ = make_registry(api)
    s = scrape(registry)
    assert value(s, "tensorlane_scrape_collector_success", collector="classes") == 0
    assert value(s, "tensorlane_scrape_collector_success", collector="contention") == 0
    assert value(s, "tensorlane_scrape_collector_success", collector="reconcile") == 1
    assert value(s, "tensorlane_reconcile_passes_total") == 0
    assert not [n for n, _ in s if n.startswith("tensorlane_class_sent")]


# --- flows, api, reconcile --------------------------------------------------------------------------------------

def test_flows_by_class_and_job_capped_with_the_rest_summed(kernel):
    api = fake_api()
    for j in range(40):
        n = 1 if j >= 32 else 2
        assert request(api, op="register", job=f"job{j:02d}", level=j % 2,
                       flows=[flow(100 * j + i) for i in range(n)])["ok"]
    kernel.marks = {0: {"bytes": 1234, "packets": 5}}
    kernel.reset = {"packets": 7, "bytes": 700}
    registry, _ = make_registry(api)
    s = scrape(registry)
    assert value(s, "tensorlane_unregistered_dscp_reset_packets_total") == 7
    flows = {(dict(lab)["class"], dict(lab)["training_job"]): v
             for (n, lab), v in s.items() if n == "tensorlane_registered_flows"}
    assert len({job for _, job in flows}) == 33                           # 32 jobs and _other
    assert flows[("7a1:10", OTHER)] + flows[("7a1:11", OTHER)] == 8       # the 8 one-flow jobs
    assert sum(flows.values()) == 32 * 2 + 8
    assert value(s, "tensorlane_registered_jobs") == 40
    assert value(s, "tensorlane_class_marked_bytes_total", **{"class": "7a1:10"}) == 1234
    assert value(s, "tensorlane_class_marked_packets_total", **{"class": "7a1:11"}) == 0


def test_one_users_jobs_do_not_take_every_job_series(kernel):
    """A user that is neither root nor trusted keeps at most MAX_JOBS_PER_USER jobs with series of their own in
    tensorlane_registered_flows and tensorlane_job_first_level: until 2026-11-28 one user's 32 jobs (its
    max_jobs_per_user), a few more flows each than another user's job (one unconnected UDP socket owns a flow to
    every destination), took all 32 series and every other user's job was summed as _other."""
    for policy in ("none", "static"):
        api = fake_api(job_policy=policy, trusted_users=["root"])
        registry, _ = make_registry(api)
        api.table.register("victim", 1, tuple(FlowKey(*protocol.parse_flow(flow(i))) for i in range(8)), uid=1)
        for j in range(32):
            keys = tuple(FlowKey(*protocol.parse_flow(flow(1000 + 100 * j + i))) for i in range(9))
            api.table.register(f"junk{j:02d}", 2, keys, uid=NOBODY)
        api.table.register("roots", 0, (FlowKey(*protocol.parse_flow(flow(9000))),), uid=0)
        api.jobs.update(api.table)
        s = scrape(registry)
        flows = {dict(lab)["training_job"] for (n, lab), _ in s.items() if n == "tensorlane_registered_flows"}
        assert "victim" in flows and "roots" in flows, policy
        assert len([j for j in flows if j.startswith("junk")]) == metrics_base.MAX_JOBS_PER_USER
        assert value(s, "tensorlane_registered_flows", training_job=OTHER) == 9 * (32 - metrics_base.MAX_JOBS_PER_USER)
        if policy != "none":
            first = {dict(lab)["training_job"] for (n, lab), _ in s.items() if n == "tensorlane_job_first_level"}
            assert "victim" in first and "roots" in first
            assert len([j for j in first if j.startswith("junk")]) == metrics_base.MAX_JOBS_PER_USER


def test_request_outcomes_and_latency_histogram(kernel):
    api = fake_api()
    registry, _ = make_registry(api)
    assert request(api, op="register", job="a", level=0, flows=[flow(1)])["ok"]
    assert not request(api, op="register", job="a", level=9, flows=[flow(2)])["ok"]
    assert not request(api, op="register", job="b", level=0, flows=[flow(1)])["ok"]  # a's flow
    api.handle(b"{not json")
    s = scrape(registry)
    assert value(s, "tensorlane_api_requests_total", op="register", outcome="ok") == 1
    assert value(s, "tensorlane_api_requests_total", op="register", outcome="bad_level") == 1
    assert value(s, "tensorlane_api_requests_total", op="register", outcome="conflict") == 1
    assert value(s, "tensorlane_api_requests_total", op="invalid", outcome="bad_json") == 1
    assert value(s, "tensorlane_api_request_duration_seconds_count", op="register") == 3
    assert value(s, "tensorlane_api_request_duration_seconds_bucket", op="register", le="+Inf") == 3
    assert 0 < value(s, "tensorlane_api_request_duration_seconds_sum", op="register") < 1
    buckets = sorted((float(dict(lab)["le"]), v) for (n, lab), v in s.items()
                     if n == "tensorlane_api_request_duration_seconds_bucket" and dict(lab)["op"] == "register")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)       # cumulative
    assert [b for b, _ in buckets] == [*BUCKETS, float("inf")]             # 100 us ... 2.5 s
    assert value(s, "tensorlane_api_request_duration_seconds_count", op="unregister") == 0  # every op from zero
    assert not [n for n, _ in s if n.endswith("_created")]                 # no extra series per instrument


def test_reconcile_counters(kernel):
    api = fake_api()
    api.rec.stats.passes, api.rec.stats.repairs, api.rec.stats.errors = 7, 3, 2
    s = scrape(make_registry(api)[0])
    assert value(s, "tensorlane_reconcile_passes_total") == 7
    assert value(s, "tensorlane_reconcile_repairs_total") == 3
    assert value(s, "tensorlane_reconcile_errors_total") == 2


# --- the report op and the job counters ------------------------------------------------------------------------

def report_msg(**kw) -> dict:
    msg = {"op": "report", "job": "job-a", "session": "s1",
           "levels": [{"level": 0, "allreduces": 4, "bytes": 4096, "comm_s": 0.5}]}
    msg.update(kw)
    return msg


@pytest.mark.parametrize("change, code", [
    ({"job": None}, "bad_job"),
    ({"session": ""}, "bad_request"),
    ({"session": "-x"}, "bad_request"),
    ({"levels": []}, "bad_request"),
    ({"levels": "0"}, "bad_request"),
    ({"levels": [{"level": 0, "allreduces": 1, "bytes": 1}]}, "bad_request"),            # comm_s missing
    ({"levels": [{"level": 0, "allreduces": -1, "bytes": 1, "comm_s": 0}]}, "bad_request"),
    ({"levels": [{"level": 0, "allreduces": 1.5, "bytes": 1, "comm_s": 0}]}, "bad_request"),
    ({"levels": [{"level": 0, "allreduces": True, "bytes": 1, "comm_s": 0}]}, "bad_request"),
    ({"levels": [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": float("nan")}]}, "bad_request"),
    ({"levels": [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0, "x": 1}]}, "bad_request"),
    ({"levels": [{"level": -1, "allreduces": 1, "bytes": 1, "comm_s": 0}]}, "bad_level"),
    ({"levels": [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0}] * 2}, "bad_request"),
    ({"levels": [{"level": i, "allreduces": 1, "bytes": 1, "comm_s": 0} for i in range(17)]}, "bad_request"),
    ({"flows": []}, "bad_request"),
])
def test_report_requests_are_validated(change, code):
    msg = report_msg(**change)
    msg = {k: v for k, v in msg.items() if v is not None}
    with pytest.raises(protocol.ProtocolError) as err:
        protocol.parse_request(json.dumps(msg).encode())
    assert err.value.code == code


def test_report_op_feeds_the_job_counters(kernel):
    api = fake_api(levels=3)
    registry, _ = make_registry(api)
    reply = request(api, **report_msg())
    assert reply["ok"] and reply["result"] == {"job": "job-a", "levels": 1, "counted_as": "job-a"}
    bad = request(api, **report_msg(levels=[{"level": 3, "allreduces": 1, "bytes": 1, "comm_s": 0}]))
    assert bad["error"]["code"] == "bad_level"
    request(api, **report_msg(levels=[{"level": 0, "allreduces": 6, "bytes": 6144, "comm_s": 0.75},
                                      {"level": 2, "allreduces": 1, "bytes": 10, "comm_s": 0.125}]))
    request(api, **report_msg(session="s2", step_bytes=8192, compute_s=0.25))  # a second process of the job here
    s = scrape(registry)
    assert value(s, "tensorlane_job_step_bytes", training_job="job-a") == 8192
    assert value(s, "tensorlane_job_step_compute_seconds", training_job="job-a") == 0.25
    assert value(s, "tensorlane_job_allreduces_total", training_job="job-a", level=0) == 10
    assert value(s, "tensorlane_job_allreduce_bytes_total", training_job="job-a", level=0) == 10240
    assert value(s, "tensorlane_job_allreduce_seconds_total", training_job="job-a", level=0) == 1.25
    assert value(s, "tensorlane_job_allreduce_seconds_total", training_job="job-a", level=2) == 0.125
    assert value(s, "tensorlane_reporting_jobs") == 1
    assert value(s, "tensorlane_api_requests_total", op="report", outcome="ok") == 3


def test_job_reports_are_idempotent_survive_restarts_and_are_bounded():
    now = [0.0]
    r = JobReports(max_jobs=2, max_sessions=3, ttl_s=100, clock=lambda: now[0])
    r.add("a", "s1", {0: (2, 20, 1.0)})
    r.add("a", "s1", {0: (2, 20, 1.0)})                 # sent twice: counted once
    r.add("a", "s1", {0: (5, 50, 2.5)})
    assert r.snapshot() == {"a": {0: (5, 50, 2.5)}}
    r.add("a", "s1", {0: (1, 10, 0.5)})                 # the counters went down: a restart, counted from zero
    assert r.snapshot()["a"][0] == (6, 60, 3.0)
    assert r.add("b", "s2", {1: (1, 1, 1.0)}) == "b"
    assert r.add("c", "s3", {0: (4, 4, 4.0)}) == OTHER  # over max_jobs
    assert r.add("d", "s4", {0: (1, 1, 1.0)}, step_bytes=7) == OTHER  # no step bytes for _other
    r.add("a", "s1", {0: (6, 60, 3.0)}, step_bytes=4096, compute_s=0.5)
    assert r.step_bytes() == {"a": 4096} and r.compute_seconds() == {"a": 0.5}
    snap = r.snapshot()
    assert set(snap) == {"a", "b", OTHER} and snap[OTHER][0] == (5, 5, 5.0)
    now[0] = 50
    r.add("b", "s2", {1: (2, 2, 2.0)})
    now[0] = 120                                        # a and _other silent for more than ttl: forgotten
    assert set(r.snapshot()) == {"b"} and r.step_bytes() == {} == r.compute_seconds()  # forgotten with a's series
    assert r.add("e", "s5", {0: (1, 1, 1.0)}) == "e"    # a slot is free again
    assert len(r._sessions) <= 3


# --- the shim's reporter ----------------------------------------------------------------------------------------

class ApiOverSocket:
    """A Unix-socket server that answers each line with ``api.handle`` (the agent's server, without a kernel)."""

    def __init__(self, path: str, api: Api):
        handle = api.handle

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    self.wfile.write(handle(line.rstrip(b"\n")))

        self.server = socketserver.ThreadingUnixStreamServer(path, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_reporter_is_silent_and_quick_without_an_agent(tmp_path, caplog):
    rep = Reporter(lambda: [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0.1}],
                   str(tmp_path / "absent.sock"), "job-a", interval_s=0.05, timeout_s=30.0)
    deadline = time.monotonic() + 30  # (not a fixed 0.3 s: the thread may get no CPU for that long on a busy machine)
    while rep.counters["failures"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    assert rep.close() is False
    assert time.monotonic() - t0 < 10.0  # an absent agent fails at once: nothing waits for the 30 s timeout
    assert rep.counters["failures"] >= 2 and rep.counters["sent"] == 0
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_reporter_sends_cumulative_counters_and_a_last_report_at_close(tmp_path, kernel):
    api = fake_api(levels=2)
    server = ApiOverSocket(str(tmp_path / "agent.sock"), api)
    counters = {"n": 0}

    def stats():
        counters["n"] += 1
        return [{"level": 0, "allreduces": counters["n"], "bytes": 100 * counters["n"], "comm_s": 0.5},
                {"level": 1, "allreduces": 1, "bytes": 10, "comm_s": 0.25}]

    try:
        rep = Reporter(stats, str(tmp_path / "agent.sock"), "job-r", interval_s=0.05, timeout_s=5.0)
        deadline = time.monotonic() + 5
        while rep.counters["sent"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rep.close() is True
        assert rep.close() is False  # idempotent
        n = counters["n"]
        snap = api.reports.snapshot()["job-r"]
        assert snap[0] == (n, 100 * n, 0.5) and snap[1] == (1, 10, 0.25)
    finally:
        server.close()


def recording_server(api: Api, tmp_path) -> tuple[list, ApiOverSocket]:
    """``api`` served on ``tmp_path/agent.sock``, every request it handles appended (decoded) to the list."""
    sent = []
    handle = api.handle
    api.handle = lambda line, peer=None: (sent.append(json.loads(line)), handle(line, peer))[1]
    return sent, ApiOverSocket(str(tmp_path / "agent.sock"), api)


def test_reporter_sends_step_bytes_at_once_when_woken(tmp_path, kernel):
    """The shim wakes its reporter when a step's bytes change: the report goes out without waiting for the
    interval, with ``step_bytes``; 0 (not known yet) is left out."""
    api = fake_api(levels=2)
    step = {"bytes": 0}
    sent, server = recording_server(api, tmp_path)
    try:
        rep = Reporter(lambda: [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0.1}],
                       str(tmp_path / "agent.sock"), "job-w", interval_s=60, timeout_s=5.0,
                       step_bytes=lambda: step["bytes"])
        assert rep.report() and "step_bytes" not in sent[-1]
        step["bytes"] = 4096
        rep.wake()
        deadline = time.monotonic() + 5
        while rep.counters["sent"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rep.counters["sent"] == 2 and sent[-1]["step_bytes"] == 4096
        rep.close()
    finally:
        server.close()


@pytest.mark.parametrize("policy", ["slowdown", "none"])
def test_reporter_sends_each_step_while_the_agent_ranks_by_the_window(tmp_path, kernel, policy):
    """Under ``slowdown`` each ``step_ended()`` sends a report at once with the window of the last steps; an agent
    that answers that it does not use the window (another policy) gets reports at the interval only."""
    api = fake_api(levels=2, job_policy=policy)
    request(api, op="register", job="job-s", level=0, flows=[flow(1)])
    window = {"start": 0.0, "steps": 0}
    sent, server = recording_server(api, tmp_path)
    try:
        rep = Reporter(lambda: [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0.1}],
                       str(tmp_path / "agent.sock"), "job-s", interval_s=60, timeout_s=5.0,
                       step_bytes=lambda: 4096, compute_s=lambda: 0.5, window_start=lambda: window["start"],
                       window_steps=lambda: window["steps"])
        assert rep.report() and "window_start" not in sent[-1]  # (no window yet: two steps must end first)
        for step in range(1, 4):
            window.update(start=time.time() - step, steps=step)
            rep.step_ended()
            deadline = time.monotonic() + 5
            while rep.per_step and rep.counters["sent"] < step + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
        if policy == "slowdown":
            assert rep.per_step and rep.counters["sent"] == 4 and sent[-1]["window_steps"] == 3
            assert api.jobs.reported["job-s"]["window_steps"] == 3
        else:  # the first window sent was answered "unused": no more reports until the interval
            assert not rep.per_step and rep.counters["sent"] == 2 and sent[-1]["window_steps"] == 1
        rep.close()
    finally:
        server.close()


def test_reporter_sends_counters_alone_to_an_agent_without_the_inputs(tmp_path):
    """An agent older than ``step_bytes`` and ``compute_s`` refuses them as unknown fields: the reporter sends the
    counters alone, then and from then on, so the job's metrics go on."""
    sent = []

    class OldApi:
        def handle(self, line):
            msg = json.loads(line)
            sent.append(msg)
            if set(msg) - {"op", "id", "job", "session", "levels"}:
                return protocol.error(msg.get("id"), "bad_request", "unknown field 'compute_s' for op report")
            return protocol.ok(msg.get("id"), {"job": msg["job"]})

    server = ApiOverSocket(str(tmp_path / "agent.sock"), OldApi())
    try:
        rep = Reporter(lambda: [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0.1}],
                       str(tmp_path / "agent.sock"), "job-a", start=False, step_bytes=lambda: 64,
                       compute_s=lambda: 0.5, timeout_s=10.0)  # (the default 0.25 s: a failure on a stalled CPU)
        assert rep.report() and rep.counters_only and "compute_s" in sent[0] and "compute_s" not in sent[1]
        assert rep.report() and len(sent) == 3 and "step_bytes" not in sent[2]
    finally:
        server.close()


def test_reporter_stops_asking_an_agent_without_the_report_op(tmp_path):
    class OldApi:
        def handle(self, line):
            return protocol.error(1, "unknown_op", "unknown op 'report'")

    server = ApiOverSocket(str(tmp_path / "agent.sock"), OldApi())
    try:
        rep = Reporter(lambda: [{"level": 0, "allreduces": 1, "bytes": 1, "comm_s": 0.1}],
                       str(tmp_path / "agent.sock"), "job-a", start=False, timeout_s=10.0)  # (not the 0.25 s default)
        assert rep.report() is False and rep.unsupported, rep.last_error
        assert rep.report() is False and rep.counters["refusals"] == 1
    finally:
        server.close()


def test_start_reporter_from_a_shim_handle(tmp_path):
    class Link:
        socket_path, job = str(tmp_path / "none.sock"), "job-h"

    class Handle:
        disabled, link, reads = False, Link(), 0

        def stats(self):
            self.reads += 1
            return {"levels": [{"level": 0, "allreduces": 3, "bytes": 12, "comm_s": 0.1}], "step_bytes": 64,
                    "compute_s": 0.5, "tail_bytes": 16, "window_start": 100.0, "window_steps": 4}

    class Disabled:
        disabled = True

    assert start_reporter(Disabled()) is None
    handle = Handle()
    rep = start_reporter(handle, interval_s=60, timeout_s=0.1)
    try:
        assert rep.job == "job-h" and rep.socket_path == Link.socket_path
        assert rep.report() is False and rep.counters["failures"] == 1
        assert handle.reads == 1  # one read of the handle's stats per report, the inputs included
        assert rep._inputs() == {"step_bytes": 64, "compute_s": 0.5, "tail_bytes": 16, "window_start": 100.0,
                                 "window_steps": 4}
    finally:
        rep.close()


# --- HTTP -------------------------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_server_serves_metrics_and_health(kernel):
    api = fake_api()
    server = start_metrics_server("127.0.0.1:0", api)
    try:
        base = f"http://{server.address}"
        code, body = get(base + "/metrics")
        assert code == 200 and b"tensorlane_class_sent_bytes_total" in body
        exported = {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
        assert {"process_resident_memory_bytes", "process_virtual_memory_bytes", "process_cpu_seconds_total",
                "process_start_time_seconds", "process_open_fds", "process_max_fds", "python_info",
                "python_gc_collections_total"} <= exported  # prometheus_client's standard collectors
        code, body = get(base + "/healthz")
        assert code == 200 and json.loads(body)["status"] == "ok"
        assert get(base + "/nope")[0] == 404
        assert get(base + "/")[0] == 200
    finally:
        server.close()


def test_http_server_bounds_idle_and_broken_clients(kernel, monkeypatch, capfd):
    """Any local user can connect to the metrics address: idle connections held a thread and a file descriptor
    each, for ever (some thousand took the agent's open files, and its API socket then accepted no one), and each
    reset connection printed a traceback. Now at most MAX_CLIENTS are served at once, the rest closed at once; a
    silent client goes after the handler's timeout; resets are logged, bounded, without tracebacks."""

    from tensorlane.agent import metrics

    monkeypatch.setattr(metrics._ThreadingServer, "MAX_CLIENTS", 3, raising=False)
    monkeypatch.setattr(metrics._Handler, "timeout", 0.5)
    server = start_metrics_server("127.0.0.1:0", fake_api())
    host, port = server.httpd.server_address
    threads = threading.active_count()
    idle = []
    try:
        for _ in range(20):
            s = socket.create_connection((host, port), timeout=5)
            idle.append(s)
        time.sleep(0.2)
        assert threading.active_count() <= threads + 3  # (before: one thread per connection)
        closed = sum(s.recv(1) == b"" for s in idle[3:])
        assert closed == 17  # refused at once
        t0 = time.monotonic()
        assert all(s.recv(1) == b"" for s in idle[:3])  # the silent ones: dropped after the timeout
        assert time.monotonic() - t0 < 3
        for _ in range(10):  # a request line cut short by a reset
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(b"GET /metr")
                time.sleep(0.01)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.3)
        assert get(f"http://{server.address}/metrics")[0] == 200  # served again
        # clients that each send a byte within every read's timeout: cut off at the request's deadline
        monkeypatch.setattr(metrics._ThreadingServer, "REQUEST_DEADLINE_S", 1.5, raising=False)
        slow = [socket.create_connection((host, port), timeout=5) for _ in range(3)]
        idle.extend(slow)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5:
            for s in slow:
                with contextlib.suppress(OSError):
                    s.sendall(b"G")
            time.sleep(0.3)
        assert get(f"http://{server.address}/metrics")[0] == 200  # (before: every slot held for as long as they sent)
        assert "Traceback" not in capfd.readouterr().err
    finally:
        for s in idle:
            s.close()
        server.close()


def test_one_local_user_cannot_take_every_metrics_slot(kernel, monkeypatch):
    """A local user opened 16 idle connections (each cut off at its deadline, then opened again) and every scrape
    was refused. Now one peer holds at most MAX_PER_PEER requests: a local one is the user that made the socket
    (sock_diag), whatever address of 127.0.0.0/8 it connects from, a remote one its IPv4 address or IPv6 /64; another
    user's scrape (Prometheus') is served."""
    import os

    from tensorlane.agent import metrics

    monkeypatch.setattr(metrics._Handler, "timeout", 5.0)
    server = start_metrics_server("127.0.0.1:0", fake_api())
    host, port = server.httpd.server_address
    cap = metrics._ThreadingServer.MAX_PER_PEER
    idle = []
    try:
        for i in range(cap + 6):  # root, from 127.0.0.2 ... 127.0.0.11
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((f"127.0.0.{2 + i}", 0))
            s.settimeout(5)
            s.connect((host, port))
            idle.append(s)
        time.sleep(0.3)
        refused = []
        for s in idle:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                refused.append(s.recv(1) == b"")  # closed at once; the served ones wait (BlockingIOError)
        assert sum(refused) == 6, refused
        # another user (nobody), as Prometheus would be: served beside the idle ones
        status, pid = in_child(lambda: get(f"http://{server.address}/metrics")[0], uid=NOBODY)
        assert os.waitpid(pid, 0)[1] == 0 and status == 200, status
        # a client whose socket is not this host's is its address (a loopback connection stands for both)
        with socket.create_server(("127.0.0.1", 0)) as lst, socket.create_connection(lst.getsockname()) as a, \
                lst.accept()[0] as b:
            assert server.httpd._peer(b, ("198.51.100.7", 40000)) == ("address", "198.51.100.7")
            assert server.httpd._peer(b, ("::ffff:198.51.100.7", 40000)) == ("address", "198.51.100.7")
            for remote in ("2001:db8:1:2::7", "2001:db8:1:2:ab:cd:ef:1", "2001:db8:1:2::8"):
                # an IPv6 client by its /64: one host may send from any address of it
                assert server.httpd._peer(b, (remote, 40000, 0, 0)) == ("address", "2001:db8:1:2::/64")
            assert server.httpd._peer(b, ("fe80::1%eth0", 40000, 0, 2)) == ("address", "fe80::/64")
            assert server.httpd._peer(b, a.getsockname()) == ("uid", os.geteuid())
    finally:
        for s in idle:
            s.close()
        server.close()


def scrapes_in_a_row(url: str, count: int = 40) -> list:
    """``[served, seconds]``: how many of ``count`` scrapes of ``url`` made one after another were answered 200, and
    how long they took (the rest were closed unanswered)."""
    t0, served = time.monotonic(), 0
    for _ in range(count):
        with contextlib.suppress(OSError):
            served += get(url)[0] == 200
    return [served, time.monotonic() - t0]


def test_one_local_user_scraping_in_a_loop_is_limited_to_its_rate(kernel):
    """A local user scraping in loops made the agent render 130 scrapes a second, a core of the host (root's API
    p50 2.6 -> 6.6 ms). Now a peer gets REQUEST_BURST requests, then REQUESTS_PER_PEER_PER_S (beyond, the connection
    is closed unanswered); another user's scrape and root's are served."""
    from tensorlane.agent import metrics

    server = start_metrics_server("127.0.0.1:0", fake_api())
    burst, rate = (getattr(metrics._ThreadingServer, name, 8) for name in ("REQUEST_BURST", "REQUESTS_PER_PEER_PER_S"))
    url = f"http://{server.address}/metrics"

    try:
        (served, took), pid = in_child(lambda: scrapes_in_a_row(url), uid=NOBODY)
        assert os.waitpid(pid, 0)[1] == 0
        assert served <= burst + rate * took + 1, (served, took)
        status, pid = in_child(lambda: get(url)[0], uid=1)  # another user (daemon), as Prometheus would be
        assert os.waitpid(pid, 0)[1] == 0 and status == 200, status
        assert all(get(url)[0] == 200 for _ in range(2 * burst))  # root: not limited
    finally:
        server.close()


LINK_LOCAL_PEER = """
import json, os, socket, subprocess
from wsgiref.simple_server import WSGIRequestHandler
from tensorlane.agent import metrics
for cmd in (["link", "add", "tlm0", "type", "veth", "peer", "name", "tlm1"], ["link", "set", "tlm0", "up"],
            ["link", "set", "tlm1", "up"], ["link", "set", "lo", "up"],
            ["addr", "add", "fe80::1/64", "dev", "tlm0", "nodad"]):
    subprocess.run(["ip", *cmd], check=True)
server = type("Six", (metrics._ThreadingServer,), {"address_family": socket.AF_INET6})(("::", 0), WSGIRequestHandler)
try:
    with socket.create_connection(("fe80::1%tlm0", server.server_address[1]), timeout=5) as c:
        b, addr = server.socket.accept()
        with b:
            print(json.dumps([list(server._peer(b, addr)), os.geteuid()]))
finally:
    server.server_close()
"""


@pytest.mark.netns  # root: a network namespace of its own, with a veth
def test_a_local_client_on_a_link_local_address_is_its_user_not_the_links_prefix():
    """A local user connecting to the metrics address through a link-local address (``fe80::1%eth0``) was not
    looked up (the address's scope stopped the sock_diag request) and counted as the remote peer ``fe80::/64``:
    4 more requests beside its 4 as its user, so two users held all 16 slots (and one held every link-local
    client's 4). Now the lookup takes the scope's interface, and the client is its user."""
    import subprocess
    import sys

    out = subprocess.run(["unshare", "-n", sys.executable, "-c", LINK_LOCAL_PEER], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out
    peer, uid = json.loads(out.stdout)
    assert peer == ["uid", uid], out.stdout


def test_a_users_subordinate_uids_count_as_that_user_at_the_metrics_address(kernel, monkeypatch, tmp_path):
    """A user with a subordinate uid range (``/etc/subuid``, the default for rootless containers) runs processes
    as any of those uids through ``newuidmap``: each uid was a peer of its own, so one user held every slot (16
    uids, one idle connection each) and Prometheus' scrapes were refused. Now a uid of a user's subordinate range
    counts as that user: the fifth connection of the range is refused."""
    import os

    from tensorlane.agent import metrics, peers

    subuid = tmp_path / "subuid"
    subuid.write_text("4242:100000:65536\n")
    monkeypatch.setattr(peers, "SUBUID", str(subuid))
    monkeypatch.setattr(metrics._Handler, "timeout", 5.0)
    server = start_metrics_server("127.0.0.1:0", fake_api())
    host, port = server.httpd.server_address
    cap = metrics._ThreadingServer.MAX_PER_PEER
    hold_r, hold_w = os.pipe()
    children, refused = [], []
    try:
        for i in range(cap + 1):  # one connection each from 100000 ... 100004, all held at once
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.close(r)
                    os.close(hold_w)
                    os.setgroups([])
                    os.setgid(100000 + i)
                    os.setuid(100000 + i)
                    s = socket.create_connection((host, port), timeout=5)
                    time.sleep(0.3)
                    s.setblocking(False)
                    try:
                        closed = s.recv(1) == b""
                    except BlockingIOError:
                        closed = False
                    os.write(w, b"1" if closed else b"0")
                    os.close(w)
                    os.read(hold_r, 1)  # held until the parent is done
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            children.append(pid)
            with os.fdopen(r) as fh:
                refused.append(fh.read() == "1")
        assert refused == [False] * cap + [True], refused
    finally:
        os.close(hold_w)
        os.close(hold_r)
        for pid in children:
            os.waitpid(pid, 0)
        server.close()


def test_a_uid_of_roots_subordinate_range_is_not_root_at_the_metrics_address(kernel, monkeypatch, tmp_path):
    """Root's ``/etc/subuid`` range (LXD's ``root:1000000:1000000000``) holds the uids of the containers root starts.
    The metrics server counted such a uid as root (a copy of its own of the API's mapping, left behind when the API's
    stopped doing so): a container process scraped in a loop at any rate (40 of 40 served here) and its connections
    took root's 4. Now it is a peer of its own, as at the API (``peers.account_uid``): limited to its rate."""
    from tensorlane.agent import metrics, peers

    subuid = tmp_path / "subuid"
    subuid.write_text("root:300000:65536\n")
    monkeypatch.setattr(peers, "SUBUID", str(subuid))
    server = start_metrics_server("127.0.0.1:0", fake_api())
    burst, rate = metrics._ThreadingServer.REQUEST_BURST, metrics._ThreadingServer.REQUESTS_PER_PEER_PER_S
    url = f"http://{server.address}/metrics"

    try:
        (served, took), pid = in_child(lambda: scrapes_in_a_row(url), uid=300005)
        assert os.waitpid(pid, 0)[1] == 0
        assert served <= burst + rate * took + 1, (served, took)
    finally:
        server.close()


def passes(api, at: float, failed: bool = False) -> None:
    """A full reconcile pass beginning at ``at`` (the reconciler's clock), as ``Reconciler.reconcile`` counts it."""
    st = api.rec.stats
    st.passes, st.last_pass_s, st.last_pass_failed = st.passes + 1, at, failed


def test_health_turns_503_when_reconcile_passes_stop():
    api = fake_api()
    now = [0.0]
    health = Health(api, stall_after_s=15, clock=lambda: now[0])
    for t in (5, 10, 15, 20):
        now[0] = t
        passes(api, t)
        assert health.check()[0] == 200
    passes(api, 21, failed=True)
    code, body = health.check()
    assert code == 200 and body["last_reconcile_failed"] is True
    now[0] = 37
    code, body = health.check()
    assert code == 503 and body["status"] == "stalled" and body["seconds_since_reconcile"] == 16


def test_reconcile_stalled_gauge_says_what_healthz_says_whatever_the_interval():
    """``tensorlane_reconcile_stalled`` (what TensorlaneReconcileStalled alerts on) is 1 exactly when ``/healthz``
    would answer 503: no pass seen for 3 x ``reconcile_interval_s``. With an interval of an hour a healthy agent
    passes every hour and is never stalled (a 5-minute rate of the passes, the rule before, was 0 between them).
    Both answer from the pass's own time, not from when they were last asked: the gauge scraped 30 minutes after a
    pass says stalled when ``/healthz`` does (until 2026-11-27 each noticed a pass only when asked)."""
    api = fake_api(reconcile_interval_s=3600)
    registry, collector = make_registry(api)
    source = next(src for src in collector.sources if src.name == "reconcile")
    now = [0.0]
    source.health = Health(api, clock=lambda: now[0])
    healthz = Health(api, clock=lambda: now[0])
    assert source.health.stall_after_s == 3 * 3600
    for t in range(0, 4 * 3600, 3600):  # a pass an hour, scraped between
        passes(api, t)
        now[0] = t + 1800
        assert value(scrape(registry), "tensorlane_reconcile_stalled") == 0
    now[0] = 3 * 3600 + 3 * 3600 + 1  # no pass for three intervals after the last (at 3 h)
    assert value(scrape(registry), "tensorlane_reconcile_stalled") == 1 and healthz.check()[0] == 503
    now[0] -= 2  # a second earlier than three intervals: neither says stalled, though the gauge was asked last
    assert healthz.check()[0] == 200 and value(scrape(registry), "tensorlane_reconcile_stalled") == 0


def test_metrics_address_in_use_is_an_error():
    api = fake_api()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(OSError):
            start_metrics_server(f"127.0.0.1:{s.getsockname()[1]}", api)


def test_report_parser_raises_only_protocol_errors():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
    entry = st.fixed_dictionaries({}, optional={k: values for k in ("level", "allreduces", "bytes", "comm_s")})
    msg = st.fixed_dictionaries({"op": st.just("report")}, optional={
        "job": values | st.just("job-a"), "session": values | st.just("s1"),
        "levels": values | st.lists(entry, max_size=3)})

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(msg)
    def check(m):
        try:
            req = protocol.parse_request(json.dumps(m).encode())
        except protocol.ProtocolError:
            return
        assert req.op == "report" and req.session and req.counters

    check()


# --- the socket server's fairness limits (agent/server.py; with real users: test_fairness_netns.py) ---------------

def test_refusals_are_counted_by_reason_every_reason_from_zero(kernel):
    from tensorlane.agent.metrics.connections import REASONS
    from tensorlane.agent.server import REFUSALS

    assert {(op, reason): reason for reason, op in REFUSALS.items()} == REASONS  # the two tables agree
    api = fake_api()
    registry, _ = make_registry(api)
    s = scrape(registry)
    assert {dict(lab)["reason"] for (n, lab) in s if n == "tensorlane_agent_connections_refused_total"} == \
        set(REFUSALS)
    assert all(value(s, "tensorlane_agent_connections_refused_total", reason=r) == 0 for r in REFUSALS)
    assert not any(n == "tensorlane_agent_connections" for n, _ in s)  # no server, no open connections
    for op, outcome in (("connect", "user_limit"), ("connect", "user_limit"), ("connection", "idle_closed"),
                        ("request", "user_rate_limited"), ("register", "forbidden")):  # the last: not a refusal
        api.record(op, outcome)
    s = scrape(registry)
    assert value(s, "tensorlane_agent_connections_refused_total", reason="user_limit") == 2
    assert value(s, "tensorlane_agent_connections_refused_total", reason="idle_closed") == 1
    assert value(s, "tensorlane_agent_connections_refused_total", reason="user_rate_limited") == 1
    assert value(s, "tensorlane_agent_connections_refused_total", reason="forbidden") == 0


def test_refusal_log_writes_one_line_per_reason_per_period_and_counts_the_rest(caplog):
    import logging

    from tensorlane.agent.server import RefusalLog

    now = [0.0]
    rl = RefusalLog(logging.getLogger("tensorlane.server"), every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tensorlane.server"):
        for i in range(1000):  # 100 s of refusals of two reasons, 10 a second each
            now[0] = i / 10
            rl.note("busy", logging.WARNING, "refused %d", i)
            rl.note("user_limit", logging.WARNING, "refused %d", i)
        rl.flush()
        now[0] = 200.0
        rl.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == rl.lines == 22, lines  # 10 per reason in 100 s, then a summary of the last 10 s each
    assert lines[0] == "refused 0" and lines[2] == "refused 100 (and 99 more busy since the last such line)"
    assert lines[-1] == "99 more user_limit since the last such line, 110.0 s ago (one line per 10 s)"


@pytest.fixture
def served(tmp_path):
    """A real Server on a socket in tmp_path with the fake api, in a thread; every client counts as an ordinary
    user (the test runs as root, which the server would otherwise treat as privileged)."""
    from tensorlane.agent.server import Server

    started = []

    def start(**limits):
        cfg = from_dict({"interface": "eth0", "link_rate": "200mbit", "reconcile_interval_s": 1, **limits})
        api = Api(cfg, FlowTable(4), FakeRec(4), "htb")
        registry, _ = make_registry(api)
        server = Server(api, str(tmp_path / "agent.sock"), 0o600)
        server.may_use_reserve = lambda peer: False
        stop = threading.Event()
        thread = threading.Thread(target=server.serve, args=(stop, 60.0, lambda: None), daemon=True)
        thread.start()
        started.append((stop, thread, server))
        return server, registry

    yield start
    for stop, thread, server in started:
        stop.set()
        thread.join(timeout=5)
        server.close()


def connect(path: str) -> tuple[socket.socket, dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    with contextlib.suppress(BrokenPipeError):  # refused: the reply is waiting
        s.sendall(b'{"op":"hello"}\n')
    return s, json.loads(s.makefile("rb").readline())


def test_server_caps_a_user_holds_its_excess_requests_and_closes_idle_connections(kernel, served, caplog):
    server, registry = served(max_connections=16, reserved_connections=4, max_connections_per_user=5,
                              requests_per_user_per_s=50, idle_timeout_s=1)
    socks = []
    try:
        replies = []
        for _ in range(8):
            s, reply = connect(server.path)
            socks.append(s)
            replies.append(reply.get("error", {}).get("code", "ok"))
        assert replies == ["ok"] * 5 + ["user_limit"] * 3
        s = scrape(registry)
        assert value(s, "tensorlane_agent_connections", kind="user") == 5
        assert value(s, "tensorlane_agent_users_at_connection_limit") == 1
        assert value(s, "tensorlane_agent_connection_limit", limit="max_connections_per_user") == 5
        # 150 pipelined requests at 50/s (45 left in the bucket after the 5 hellos): all answered, none refused,
        # the excess held back for about 2 s
        t0 = time.monotonic()
        socks[0].sendall(b'{"op":"hello"}\n' * 150)
        reader = socks[0].makefile("rb")
        codes = [json.loads(reader.readline()).get("error", {}).get("code", "ok") for _ in range(150)]
        took = time.monotonic() - t0
        assert codes == ["ok"] * 150 and 1.7 < took < 10, took  # (2.1 s at the rate; the bound above: a stalled CPU)
        # idle: the other four went quiet at the start; socks[0] after its last reply
        t0 = time.monotonic()
        notice = json.loads(reader.readline())
        assert notice["error"]["code"] == "idle_timeout" and reader.readline() == b""
        assert 0.8 < time.monotonic() - t0 < 4.5  # (1 s; never closed: the socket's 5 s timeout raises)
        s = scrape(registry)
        assert value(s, "tensorlane_agent_connections_refused_total", reason="user_limit") == 3
        assert value(s, "tensorlane_agent_connections_refused_total", reason="idle_closed") == 5
        assert value(s, "tensorlane_agent_connections_refused_total", reason="user_rate_limited") > 0
        assert value(s, "tensorlane_agent_connections_refused_total", reason="rate_limited") == 0
        assert value(s, "tensorlane_agent_connections", kind="user") == 0
        refusal_lines = [r for r in caplog.records if r.name == "tensorlane.server"]
        assert len(refusal_lines) <= 3, [r.getMessage() for r in refusal_lines]  # one per reason
    finally:
        for s in socks:
            s.close()


def test_a_users_large_requests_take_its_bucket_by_their_size(kernel, served):
    """A request takes one token of its user's bucket per BYTES_PER_TOKEN of its line besides its own: one user
    re-sending a register of 600 flows (31 ms of the agent's work each) at 200 requests a second kept root's
    `status` waiting (p99 12 -> 114 ms). 10 lines of 32 KiB at 50 requests a second now take seconds; before, 0.1 s.
    They are held back, not refused."""
    server, _ = served(requests_per_user_per_s=50)
    line = b'{"op":"hello"}' + b" " * (32 * 1024 - 15) + b"\n"  # (JSON allows the trailing blanks)
    s, reply = connect(server.path)
    try:
        assert reply["ok"], reply
        t0 = time.monotonic()
        sender = threading.Thread(target=s.sendall, args=(line * 10,), daemon=True)
        sender.start()
        reader = s.makefile("rb")
        codes = [json.loads(reader.readline()).get("error", {}).get("code", "ok") for _ in range(10)]
        took = time.monotonic() - t0
        assert codes == ["ok"] * 10 and 3.0 < took < 30, (codes, took)  # (the upper bound: a stalled CPU's room)
        sender.join(timeout=5)
    finally:
        s.close()


def test_owner_processes_cannot_take_the_agents_open_files(tmp_path, monkeypatch):
    """Each process that owns flows is watched with a pidfd, at most ``MAX_WATCHED`` of them: a user who registers
    from many processes (one socket and one request each) leaves the rest to the sweep. Before, every owner took a
    pidfd; past the open-file limit pidfd_open raised EMFILE out of the server's loop and the agent stopped."""
    import errno
    import os

    from tensorlane.agent import server as server_mod
    from tensorlane.flows import FlowKey

    cfg = from_dict({"interface": "eth0", "link_rate": "200mbit", "reconcile_interval_s": 1})
    api = Api(cfg, FlowTable(4), FakeRec(4), "htb")
    server = server_mod.Server(api, str(tmp_path / "agent.sock"), 0o600)
    monkeypatch.setattr(server_mod.Server, "MAX_WATCHED", 3)
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    try:
        for i, kid in enumerate(kids):
            api.table.register(f"job-{i}", 1, (FlowKey("tcp", "198.18.0.1", 1000 + i, "198.18.0.2", 80),),
                               pid=kid.pid, uid=1000)
        server._watch_owners()
        assert len(server.watched) == 3 and len(api.table.flows) == 5
        server._unwatch(next(iter(server.watched)))

        def no_fds(pid):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(os, "pidfd_open", no_fds)
        server._watch_owners()  # no file descriptor left: the owners wait for the sweep, the loop goes on
        assert len(server.watched) == 2 and len(api.table.flows) == 5
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
        server.close()


def test_a_user_the_agent_does_not_allow_is_told_which_settings_decide(tmp_path, monkeypatch):
    """A training job run as a member of ``socket_group`` whom ``allowed_groups`` leaves out (the socket lets it
    connect, the peer check refuses it): the refusal names the two settings. Until 2026-11-29 it said only "user
    h19xu is not allowed to use this agent" (seen on the testbed, in the shim's warning and ``tensorlane status``)."""
    from tensorlane.agent import peers
    from tensorlane.agent import server as server_mod

    cfg = from_dict({"interface": "eth0", "link_rate": "200mbit"})
    server = server_mod.Server(Api(cfg, FlowTable(4), FakeRec(4), "htb"), str(tmp_path / "agent.sock"), 0o600)
    monkeypatch.setattr(peers.AccessPolicy, "allowed", lambda self, peer: False)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server._admit(mine)
        reply = json.loads(theirs.makefile("rb").readline())
    finally:
        theirs.close()
        server.close()
    assert reply["error"]["code"] == "forbidden", reply
    assert "not allowed to use this agent" in reply["error"]["message"], reply
    assert "allowed_users and allowed_groups" in reply["error"]["message"], reply


def test_one_user_cannot_fill_the_job_series_or_evict_other_users_sessions():
    """A user that is not root starts at most MAX_JOBS_PER_USER series (further jobs count as _other) and keeps at
    most MAX_SESSIONS_PER_USER sessions, evicting its own least recent: another user's next cumulative report is
    not counted twice."""
    from tensorlane.agent.metrics import jobs as jm

    r = JobReports()
    for i in range(jm.MAX_JOBS_PER_USER + 5):
        r.add(f"mal-{i}", "s", {0: (1, 10, 0.1)}, user=1000)
    assert sum(1 for j in r.snapshot() if j.startswith("mal-")) == jm.MAX_JOBS_PER_USER
    assert r.add("victim", "v1", {0: (1, 1000, 0.1)}, user=1001) == "victim"
    for i in range(jm.MAX_SESSIONS_PER_USER + 100):
        r.add("mal-0", f"s{i}", {0: (1, 1, 0.0)}, user=1000)
    r.add("victim", "v1", {0: (1, 1000, 0.1)}, user=1001)  # the same cumulative counters again
    assert r.snapshot()["victim"][0][1] == 1000
    assert sum(1 for (job, _s) in r._sessions if job == "mal-0") <= jm.MAX_SESSIONS_PER_USER


def test_list_of_a_table_over_a_megabyte_comes_in_pages(kernel, served):
    """``AgentClient.list`` of 9,000 flows (a reply of about 1.4 MB) through a real server: the agent answers
    ``LIST_PAGE`` flows at a time, each page after the last one's flow, and the client gathers them all, in order.
    Before, the whole table went out in one reply, over the 1 MiB of unread output a connection may hold: the agent
    closed the connection, and ``tensorlane verify`` failed on any host past about 7,000 flows."""
    from tensorlane.client import LIST_PAGE, AgentClient

    server, _registry = served()
    keys = [{"proto": "tcp", "src": "198.18.0.1", "sport": 1 + i % 60000, "dst": f"198.18.{1 + i // 60000}.2",
             "dport": 29500} for i in range(9000)]
    for i in range(0, len(keys), 1000):
        server.api.table.register("a-job-with-a-rather-long-name", 1, tuple(FlowKey(**k) for k in keys[i:i + 1000]))
    # (each page within 30 s: make test runs this file at idle priority beside the netns tests, and the default
    # 2 s timed out there once, on 2026-11-29; what the test shows is the paging, not a time)
    with AgentClient(server.path, timeout=30.0) as agent:
        flows = agent.list()["flows"]
        one = agent.request("list")
    assert len(flows) == 9000 and len(one["flows"]) == LIST_PAGE and one["next"] == {
        k: flows[LIST_PAGE - 1][k] for k in ("proto", "src", "sport", "dst", "dport")}
    got = [FlowKey(**{k: f[k] for k in ("proto", "src", "sport", "dst", "dport")}) for f in flows]
    assert got == sorted(FlowKey(**k) for k in keys)


def test_a_line_over_the_limit_is_refused_and_its_connection_closed_with_or_without_its_newline(kernel, served):
    """A request line over 64 KiB gets ``too_large`` and its connection is closed, as docs/protocol.md says, also when
    the newline came with the rest of the line (before, such a line was answered and the connection kept)."""
    server, _registry = served()
    for tail in (b"", b"\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(server.path)
            s.sendall(b"x" * (70 * 1024) + tail)
            got = b""
            for _ in range(100):  # until the agent closes the connection (bounded)
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        assert [json.loads(line)["error"]["code"] for line in got.splitlines()] == ["too_large"], (tail, got[:200])


def test_the_server_runs_a_reorder_a_report_held_back_when_it_is_due(kernel, served):
    """``Api.reorder_at`` (a user's report changed the job order's inputs within ``REPORT_REORDER_S`` of its last
    reorder): the server's loop wakes for it and reorders, with no request to wake it."""
    server, _registry = served()
    done = threading.Event()
    real = server.api.reorder

    def reorder():
        done.set()
        return real()

    server.api.reorder = reorder
    server.api.reorder_at = time.monotonic() + 0.3
    assert done.wait(5) and server.api.reorder_at is None


def test_the_api_socket_is_made_with_its_mode_and_follows_no_link(monkeypatch, tmp_path):
    """The socket file gets ``socket_mode`` (and ``socket_group``) from the bind itself. Before, the server bound,
    then ran chown and chmod on the path, which follow a symbolic link someone put there meanwhile (a socket
    directory others may write to): root gave the link's target the socket's mode. Here the link is put there
    at the chown, the moment a racing user would need; the target keeps its mode. A file at the path that is not a
    socket is refused, not deleted; a stale socket is replaced."""
    import os
    import stat

    from tensorlane.agent import server as server_mod

    cfg = from_dict({"interface": "eth0", "link_rate": "200mbit", "reconcile_interval_s": 1})
    api = Api(cfg, FlowTable(4), FakeRec(4), "htb")
    path, target = tmp_path / "agent.sock", tmp_path / "precious"
    target.write_text("x")
    target.chmod(0o600)
    real_chown = os.chown

    def racing_chown(p, uid, gid, **kw):
        os.replace(str(tmp_path / "link"), p)  # the user's link takes the socket's place
        return real_chown(p, uid, gid, **kw)

    os.symlink(str(target), str(tmp_path / "link"))
    monkeypatch.setattr(os, "chown", racing_chown)
    server = server_mod.Server(api, str(path), 0o666, group="root")
    server.close()
    monkeypatch.setattr(os, "chown", real_chown)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert path.is_symlink()  # not the agent's socket any more: close() left it (the next start refuses it)
    path.unlink()

    server = server_mod.Server(api, str(path), 0o660)
    assert stat.S_ISSOCK(path.lstat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o660
    server.listener.close()  # (the socket file stays: stale)
    server = server_mod.Server(api, str(path), 0o600)  # a stale socket is replaced
    server.close()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="is not a socket"):
        server_mod.Server(api, str(path), 0o600)
    assert path.read_text() == "not a socket"
    path.unlink()
    server = server_mod.Server(api, str(path), 0o600)
    path.unlink()
    path.write_text("put here since")  # the agent's socket replaced while it ran: close() leaves the new file
    server.close()
    assert path.read_text() == "put here since"


def test_a_removed_socket_file_is_bound_again_and_a_foreign_one_reported(served, tmp_path, caplog):
    """The API socket's file removed while the agent runs (``rm -rf /run/tensorlane``, a tmpfiles clean-up): the
    agent binds it again within a sweep, with its mode, and says so. Before, the listener went on accepting on a
    path no client could reach: every shim got "no agent" and nothing said why. A file of someone else's put there
    instead is left alone, counted as an error and logged once; removed, the socket comes back."""
    import logging
    import os
    import stat

    def wait_until(check, seconds):
        deadline = time.monotonic() + seconds
        while not check():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)

    server, _registry = served()
    path = tmp_path / "agent.sock"
    before = path.lstat().st_ino
    with caplog.at_level(logging.WARNING, logger="tensorlane.server"):
        os.unlink(path)
        wait_until(lambda: path.exists(), 5)
        assert path.lstat().st_ino != before and stat.S_IMODE(path.lstat().st_mode) == 0o600
        _sock, reply = connect(str(path))
        assert reply["ok"], reply
        assert "was removed: bound it again" in caplog.text
        assert server.api.rec.stats.repairs == 1 and server.api.rec.stats.errors == 0
        os.unlink(path)
        path.write_text("someone else's")
        wait_until(lambda: server.api.rec.stats.errors >= 2, 5)
        assert path.read_text() == "someone else's"
        assert caplog.text.count("not the agent's socket") == 1
        assert "not the agent's socket" in server.api.rec.stats.last_error
        path.unlink()
        wait_until(lambda: path.exists() and stat.S_ISSOCK(path.lstat().st_mode), 5)
        _sock, reply = connect(str(path))
        assert reply["ok"], reply


def test_pieces_of_requests_take_the_users_bucket_too(kernel, served):
    """A read that ends no request line takes a token of its user's bucket, and the user's connections are not read
    while the bucket is empty. Before, only whole lines did: one user sending a byte at a time on its connections
    (reconnecting after each 64 KiB) had the agent read each piece at once, without bound (its loop 3-5 times as
    busy as under a flood of whole requests held back, root's hello p50 0.4 -> 1.4-2.6 ms); here about 6,000
    reads in 2 s where 50 requests a second allow 150."""
    server, registry = served(requests_per_user_per_s=50)
    reads = []
    io = server._io
    server._io = lambda conn, events: (reads.append(events), io(conn, events))[1]
    socks = []
    try:
        for _ in range(4):
            s, reply = connect(server.path)
            assert reply["ok"], reply
            s.setblocking(False)
            socks.append(s)
        reads.clear()
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for s in socks:
                with contextlib.suppress(BlockingIOError):
                    s.send(b" ")
            time.sleep(0.001)
        assert len(reads) <= 50 * 2 + 50 + 20, len(reads)  # the rate over 2 s, a second's burst, some slack
        assert value(scrape(registry), "tensorlane_agent_connections_refused_total", reason="user_rate_limited") > 0
        s = socks[0]
        s.setblocking(True)
        s.sendall(b'{"op":"hello"}\n')  # the pieces were blanks: the line is a request, answered once there is a token
        reply = json.loads(s.makefile("rb").readline())
        assert reply["ok"], reply
    finally:
        for s in socks:
            s.close()


def test_a_register_without_fds_takes_a_token_per_16_open_files_read(kernel, served):
    """A register that names no fds has the agent read all of the client's open files (up to MAX_OWNER_FDS, a
    readlink each): it takes one token more of the user's bucket per ``FILES_PER_TOKEN`` files read. Before, it took
    one whatever the files: one user re-registering a flow in a loop from a process with 8,150 open files kept the
    agent's loop busy 90 ms a request, root's hello p50 0.4 -> 138 ms (p99 344 ms; since, 0.3 and 2.3 ms)."""
    from tensorlane.agent.api import FILES_PER_TOKEN

    server, _ = served(requests_per_user_per_s=50)
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(1600)]
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    peer = srv.accept()[0]
    s, reply = connect(server.path)
    try:
        assert reply["ok"], reply
        a, b = c.getsockname(), c.getpeername()
        line = json.dumps({"op": "register", "job": "j", "level": 1, "flows": [
            {"proto": "tcp", "src": a[0], "sport": a[1], "dst": b[0], "dport": b[1]}]}).encode() + b"\n"
        reader = s.makefile("rb")
        s.sendall(line)
        assert json.loads(reader.readline())["ok"]
        t0 = time.monotonic()
        s.sendall(line)  # waits for the tokens the first one's 1,600 files took (100) beyond the bucket's 50
        assert json.loads(reader.readline())["ok"]
        took = time.monotonic() - t0
        assert (1600 // FILES_PER_TOKEN - 50) / 50 - 0.2 < took < 30, took  # (before: at once)
    finally:
        for fd in extra:
            os.close(fd)
        for sock in (s, c, peer, srv):
            sock.close()


def ten_hellos_each_after(served, work) -> tuple[float, float]:
    """Seconds an agent granting 50 requests a second to a user takes to answer 10 hellos sent at once on one
    connection, its loop running ``work()`` before each answer, and how many times it held the user's requests back
    (``user_rate_limited``)."""
    server, registry = served(requests_per_user_per_s=50)
    handle = server.api.handle

    def after_work(line, peer):
        work()
        return handle(line, peer)

    server.api.handle = after_work
    s, reply = connect(server.path)
    try:
        assert reply["ok"], reply
        t0 = time.monotonic()
        s.sendall(b'{"op":"hello"}\n' * 10)
        reader = s.makefile("rb")
        assert all(json.loads(reader.readline())["ok"] for _ in range(10))
        took = time.monotonic() - t0
        return took, value(scrape(registry), "tensorlane_agent_connections_refused_total", reason="user_rate_limited")
    finally:
        s.close()


def test_a_request_takes_a_token_per_half_millisecond_of_the_agents_work(kernel, served):
    """A request takes one token more of its user's bucket per ``WORK_PER_TOKEN_S`` (0.5 ms) of the agent's time
    spent answering it. Before, a `status` (6.4 ms here, the kernel's class counters read) took one: one user asking
    it in a loop at its 200 requests a second kept the agent's loop busy, root's hello p50 0.27 -> 10 ms, p99 4 ->
    87 ms. Here each request costs 10 ms: 10 of them at 50 a second take seconds, not 0.1 s."""

    def busy():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.010:  # the agent's CPU (a sleep costs nothing: the test below)
            pass

    took, held = ten_hellos_each_after(served, busy)
    assert held and 1.5 < took < 30, (took, held)  # 10 x (1 + 20) tokens beyond the bucket's 50, at 50/s: ~3.2 s


def test_a_jobs_ranks_attaching_on_a_loaded_host_are_not_held_past_the_shims_timeout(kernel, served):
    """The work a request is charged for is the agent's CPU time on it, not the wall-clock time its loop took: on a
    loaded host the loop waits for a core between its own pieces of work, and that wait is not the user's doing.
    Measured here with three busy processes on the two cores: a 6.4 ms `status` (its CPU time) took 27 ms of wall
    time at p50, 42 ms at p90. Charged by wall time (until 2026-11-28), the 8 ranks of one job attaching at once
    (``hello`` and ``status`` each, the shim's AgentLink) took 8 x 56-86 tokens of the user's 200, and the last ranks
    were held past the shim's 0.5 s timeout: "training continues without network priority". Here a `status` is 6 ms
    of CPU and 24 ms of waiting (a sleep stands for the wait): no rank is held back (``user_rate_limited``: charged
    by wall time, 8 x about 62 tokens of 200 held some). The clients wait up to 10 s, not the shim's 0.5 s: what
    is checked is the charge, which the machine's load does not change (with 0.5 s, the test's own server thread
    starved at idle priority beside make test's namespace tests timed ranks out, 2026-11-29)."""
    from tensorlane.client import AgentClient, AgentError, AgentUnavailable

    server, registry = served()  # (requests_per_user_per_s: the default, 200)
    handle = server.api.handle

    def loaded(line, peer):
        if b'"status"' in line:
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.006:  # the agent's work
                pass
            time.sleep(0.024)  # its loop waiting for a core
            line = b'{"op":"hello"}\n'  # (the fake reconciler has no kernel counters: answered as a hello)
        return handle(line, peer)

    server.api.handle = loaded
    failures = []

    def rank():
        try:
            with AgentClient(server.path, timeout=10.0) as agent:
                agent.request("hello")
                agent.request("status")
        except (AgentUnavailable, AgentError) as exc:
            failures.append(str(exc))

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not failures, failures
    held = value(scrape(registry), "tensorlane_agent_connections_refused_total", reason="user_rate_limited")
    assert not held, held


def test_a_request_is_charged_its_cpu_time_not_the_time_it_slept(kernel, served):
    """A request whose answer took 10 ms of the agent's CPU is charged 20 tokens more (``WORK_PER_TOKEN_S``); one
    that spent 10 ms waiting (the loop without a core) none: 10 of them at 50 a second are answered at once."""
    took, held = ten_hellos_each_after(served, lambda: time.sleep(0.010))
    assert not held and took < 10, (took, held)  # (about 0.1 s: the bound is for a stalled CPU; held: the charge)


def test_a_hand_overs_flows_taken_back_are_counted_by_outcome_not_as_requests(kernel, tmp_path):
    """``tensorlane_agent_handover_flows_total{outcome}``: the flows of a hand-over's table taken back at the start
    (``adopted``) or not, by reason; the registers that took them back are no client's requests (the metrics are
    made after them, as the daemon does). Without a hand-over: ``adopted`` 0, no other outcome."""
    import os

    from tensorlane.agent import handover
    from tensorlane.agent.peers import process_start

    api = fake_api(state_dir=str(tmp_path))
    registry, _ = make_registry(api)
    assert value(scrape(registry), "tensorlane_agent_handover_flows_total", outcome="adopted") == 0
    mine = {"job": "a", "level": 1, "rank": None, "run": None, "fd": None}
    flows = [{"flow": ["tcp", "198.18.0.1", 10001, "198.18.0.2", 20000], "pid": None, "start": None, "uid": None},
             {"flow": ["tcp", "198.18.0.1", 10002, "198.18.0.2", 20000], "pid": os.getpid(),
              "start": process_start(os.getpid()) + 1, "uid": 0}]
    (tmp_path / handover.FLOWS_FILE).write_text(json.dumps({
        "format": 1, "boot_id": handover.boot_id(), "netns": handover.netns_id(), "flows": [mine | f for f in flows]}))
    api = fake_api(state_dir=str(tmp_path))
    assert handover.adopt_flows(api.cfg, api) == {"adopted": 1, "owner_gone": 1}
    registry, _ = make_registry(api)
    samples = scrape(registry)
    assert value(samples, "tensorlane_agent_handover_flows_total", outcome="adopted") == 1
    assert value(samples, "tensorlane_agent_handover_flows_total", outcome="owner_gone") == 1
    assert value(samples, "tensorlane_api_requests_total", op="register", outcome="ok") == 0
