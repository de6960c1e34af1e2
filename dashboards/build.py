"""Grafana dashboards of tensorlane, generated from this module (the source of truth; the JSON is committed too).

- ``tensorlane-fleet.json``: every host, every class, every training job: link share, backlog, priority
  inversion, top-class queueing delay, all-reduce time by job and level, flows, agent health.
- ``tensorlane-host.json``: one host (``$instance``) in detail.

Both follow the rules of Grafana's dashboard linter (grafana/dashboard-linter; tests/test_dashboards.py mirrors
them): every panel queries the data source chosen in the ``datasource`` variable (``${datasource}``), has a unit
and a description, and selects ``job=~"$job"`` and ``instance=~"$instance"``; ``job`` and ``instance`` are
multi-select query variables whose "All" is ``.+``; every rate uses ``$__rate_interval``; the dashboards are not
editable (they are provisioned from these files). The variables list only series of tensorlane's metrics, and
the queries of metrics every exporter has (``up``, ``process_*``) also require a scrape job named
``tensorlane*``, so "All" never reaches the other targets of a shared Prometheus. The fleet dashboard links to
the host dashboard (a dashboard link keeping the selection, and a data link on every per-host series).
Panels use the agent's metrics directly (docs/metrics.md), so they work without the recording rules of
``rules.yml``; those serve the alerts.

Usage: ``python -m dashboards.build`` (write the JSON files), ``python -m dashboards.build --check`` (exit 1 if
the committed JSON is stale). ``queries(dashboard)`` lists every panel's PromQL; ``expand(expr)`` substitutes
the Grafana variables so that Prometheus itself can evaluate a query (the tests do).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
# What ``expand`` puts in place of the Grafana variables (``All`` for the selectors, a rate window of a few
# scrape intervals: Grafana's $__rate_interval is at least 4 x the scrape interval).
TEST_VARIABLES = {"job": ".+", "instance": ".+", "training_job": ".+", "__rate_interval": "5s"}


def sel(*extra: str, jobs: bool = False) -> str:
    """The label selector every query uses: the dashboard's scrape job and instance(s), and ``extra``."""
    parts = ['job=~"$job"', 'instance=~"$instance"']
    if jobs:
        parts.append('training_job=~"$training_job"')
    return "{" + ", ".join([*parts, *extra]) + "}"


def with_level(expr: str) -> str:
    """Add the class's ``level`` label (from ``tensorlane_class_info``) to a per-class expression. The join
    ignores ``device``: a class id means the same level on every device of an agent, and agent-wide series
    (marks, flows) carry the agent's interfaces as ``device``, which no queue device has."""
    return (f"({expr}) * on (job, instance, class) group_left (level) "
            f"group by (job, instance, class, level) (tensorlane_class_info{sel()})")


RATE = "[$__rate_interval]"
TENSORLANE_JOBS = 'job=~"tensorlane.*"'  # the scrape jobs of tensorlane agents (docs/metrics.md)
DEFAULT = 'level="default"'
HOST_URL = "/d/tensorlane-host/tensorlane-host"
LEVEL0 = 'level="0"'
REGISTER = 'op="register"'


class Layout:
    """Places panels left to right, two per row of height 8; ``row(title)`` starts a collapsible-free row."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def add(self, title: str, unit: str, targets: list[tuple[str, str]], description: str, w: int = 12,
            stack: bool = False, min_zero: bool = True) -> None:
        """A time series panel of ``targets`` (``(expr, legend)``); series with an instance link to its host."""
        if self.x + w > 24:
            self.x, self.y = 0, self.y + 8
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 10, "showPoints": "never",
                  "spanNulls": False, "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        defaults = {"unit": unit, "custom": custom}
        if any("{{instance}}" in legend for _, legend in targets):
            defaults["links"] = [host_link("${__field.labels.instance}")]
        if min_zero:
            defaults["min"] = 0
        self.panels.append({
            "type": "timeseries", "title": title, "description": description, "id": self._id(),
            "datasource": DS, "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                         "range": True} for i, (expr, legend) in enumerate(targets)],
        })
        self.x += w
        if self.x >= 24:
            self.x, self.y = 0, self.y + 8


def host_link(instance: str) -> dict:
    """A Grafana data link to the host dashboard for ``instance`` (a value or a Grafana variable), keeping the
    time range, the data source and the scrape job selection."""
    keep = "${job:queryparam}&${datasource:queryparam}&${__url_time_range}"
    return {"title": f"Host {instance}", "targetBlank": False, "url": f"{HOST_URL}?var-instance={instance}&{keep}"}


def query_var(name: str, query: str) -> dict:
    """A multi-select Prometheus query variable whose "All" is ``.+`` (the linter's rule for job and instance)."""
    return {"name": name, "label": name.replace("_", " ").title(), "type": "query", "datasource": DS,
            "definition": query, "query": {"query": query, "refId": f"{name}-var"}, "refresh": 2, "sort": 1,
            "multi": True, "includeAll": True, "allValue": ".+", "current": {"text": "All", "value": "$__all"},
            "hide": 0, "regex": "", "options": []}


def _variables() -> list[dict]:
    """The data source, then ``job`` and ``instance`` (only tensorlane agents'), then ``training_job``."""
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        query_var("job", "label_values(tensorlane_build_info, job)"),
        query_var("instance", 'label_values(tensorlane_build_info{job=~"$job"}, instance)'),
        query_var("training_job", 'label_values(tensorlane_job_allreduces_total{job=~"$job"}, training_job)'),
    ]


def _dashboard(uid: str, title: str, description: str, panels: list[dict], links: list[dict]) -> dict:
    """The dashboard around ``panels``: provisioned, so not editable in Grafana."""
    return {
        "uid": uid, "title": title, "description": description, "tags": ["tensorlane"], "editable": False,
        "schemaVersion": 39, "version": 1, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "timezone": "", "graphTooltip": 1, "links": links, "annotations": {"list": []},
        "templating": {"list": _variables()}, "panels": panels,
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
    }


# --- the expressions both dashboards use ------------------------------------------------------------------

def link_share() -> str:
    return (f"{with_level(f'rate(tensorlane_class_sent_bytes_total{sel()}{RATE})')}\n"
            f"/ on (job, instance, device) group_left () tensorlane_link_rate_bytes_per_second{sel()}")


def backlog() -> str:
    return with_level(f"tensorlane_class_backlog_bytes{sel()}")


def inversion_share() -> str:
    return (f"sum by (job, instance, device) (rate(tensorlane_class_inversion_bytes_total{sel()}{RATE}))\n"
            f"/ on (job, instance, device) tensorlane_link_rate_bytes_per_second{sel()}")


def top_class_delay() -> str:
    return (f"tensorlane_class_queue_delay_seconds{sel()}\n"
            f"* on (job, instance, device, class) group_left () tensorlane_class_info{sel(LEVEL0)}")


def allreduce_mean(by: str) -> str:
    return (f"sum by ({by}) (rate(tensorlane_job_allreduce_seconds_total{sel(jobs=True)}{RATE}))\n"
            f"/ sum by ({by}) (rate(tensorlane_job_allreduces_total{sel(jobs=True)}{RATE}))")


def borrowed() -> str:
    """Packets per second each class sent on tokens borrowed from the link (above its own tiny HTB rate)."""
    return with_level(f"rate(tensorlane_class_borrowed_packets_total{sel()}{RATE})")


def default_waiting() -> str:
    """Times per second HTB held the default class back (overlimits): unregistered traffic waiting."""
    return (f"rate(tensorlane_class_overlimits_total{sel()}{RATE})\n"
            f"* on (job, instance, device, class) group_left (level) tensorlane_class_info{sel(DEFAULT)}")


def link(title: str, url: str, tooltip: str) -> dict:
    """A dashboard link to ``url`` that keeps the time range and the variables (data source, job, instance)."""
    return {"title": title, "type": "link", "url": url, "tooltip": tooltip, "icon": "dashboard",
            "includeVars": True, "keepTime": True, "asDropdown": False, "targetBlank": False, "tags": []}


def register_latency(q: float) -> str:
    return (f"histogram_quantile({q}, sum by (le) (rate(tensorlane_api_request_duration_seconds_bucket"
            f"{sel(REGISTER)}{RATE})))")


# --- dashboards ---------------------------------------------------------------------------------------------


def borrowing_panel(lay, who: str) -> None:
    """The panel that shows priority at work in HTB: each level borrowing while the default class waits."""
    lay.add("HTB borrowing by level, default class waiting", "pps",
            [(borrowed(), f"{who}{{{{device}}}} level {{{{level}}}} borrowed"),
             (default_waiting(), f"{who}{{{{device}}}} default class held back")],
            "Packets per second each class sent on tokens borrowed from the link (HTB borrows: every level's "
            "own rate is tiny, so a busy level borrows nearly all it sends), and times per second HTB held the "
            "default class back (overlimits) while the levels took the link.")


def process_panels(lay, who: str) -> None:
    """The agent's own CPU and memory (prometheus_client's ``process_*`` metrics)."""
    lay.add("Agent CPU", "percentunit", [(f"rate(process_cpu_seconds_total{sel(TENSORLANE_JOBS)}{RATE})", f"{who}cpu")],
            "CPU time the agent process used per second (1 = one core).")
    lay.add("Agent memory", "bytes", [(f"process_resident_memory_bytes{sel(TENSORLANE_JOBS)}", f"{who}resident")],
            "Resident memory of the agent process.")


def training_job_panels(lay, reporters: str) -> None:
    """The "Training jobs" row both dashboards share; ``reporters`` says whose shim reports it shows."""
    lay.row("Training jobs")
    lay.add("All-reduce time by job and level", "s",
            [(allreduce_mean("training_job, level"), "{{training_job}} level {{level}}")],
            f"Mean time from launch to completion of one all-reduce piece, reported by {reporters}.")
    lay.add("All-reduce throughput by job and level", "Bps",
            [(f"sum by (training_job, level) (rate(tensorlane_job_allreduce_bytes_total{sel(jobs=True)}{RATE}))",
              "{{training_job}} level {{level}}")],
            f"Bytes all-reduced per second, reported by {reporters}.")
    lay.add("Bytes per training step by job", "bytes",
            [(f"max by (training_job) (tensorlane_job_step_bytes{sel(jobs=True)})", "{{training_job}}")],
            f"The bytes one training step all-reduces, reported by {reporters}: what job_policy \"shortest\" "
            "orders jobs by (fewest first).")
    lay.add("Compute seconds per training step by job", "s",
            [(f"max by (training_job) (tensorlane_job_step_compute_seconds{sel(jobs=True)})", "{{training_job}}")],
            f"A training step's compute time (the step less its waits for the all-reduces), agreed over the job's "
            f"ranks, reported by {reporters}: with the bytes per step, what job_policy \"measured_intensity\" "
            "orders jobs by (most compute per byte first).")


def job_policy_panels(lay) -> None:
    """The job policy's order and parts (empty under ``job_policy = "none"``)."""
    lay.add("Job order: first level by job", "short",
            [(f"min by (training_job) (tensorlane_job_first_level{sel()})", "{{training_job}}")],
            "The most urgent level of each job's band under the agent's job policy: 0 goes first on this host "
            "(docs/jobs.md). A line that moves is an order that moves (rotate, alternate, slowdown).")
    lay.add("Jobs' guaranteed part of the link", "percentunit",
            [(f"tensorlane_job_share_ratio{sel()}", "job_share {{device}}"),
             (f"tensorlane_job_link_busy_ratio{sel()}", "link busy (job_share auto) {{device}}"),
             (f"tensorlane_job_link_saturated{sel()}", "saturated (job_share auto) {{device}}")],
            "The share of the link the jobs are guaranteed together (job_share); with job_share auto, the share of "
            "recent samples in which some job's class held queued bytes, and whether the agent finds the jobs "
            "saturating the link (1: large parts, near FIFO's shares; 0: small parts, the order interleaves them).")


def fleet() -> dict:
    lay = Layout()
    lay.row("Links")
    lay.add("Link share by host and class", "percentunit",
            [(link_share(), "{{instance}} {{device}} level {{level}}")],
            "Bytes each class sent per second over the link rate the agent shapes to.")
    lay.add("Backlog by host and class", "bytes", [(backlog(), "{{instance}} {{device}} level {{level}}")],
            "Bytes waiting in each class's queue at scrape time.")
    lay.add("Priority inversion (share of link)", "percentunit",
            [(inversion_share(), "{{instance}} {{device}}")],
            "Bytes lower classes sent while a more urgent class had a backlog at two consecutive scrapes, over the "
            "link rate (an estimate, see docs/metrics.md; each class's min_share is included, a job's part of "
            "job_share is not).")
    lay.add("Top-class queueing delay", "s", [(top_class_delay(), "{{instance}} {{device}}")],
            "Backlog of the level-0 class over the link rate: the wait of a level-0 packet entering now.")
    training_job_panels(lay, "the shims (all hosts)")
    lay.add("Registered flows by job", "short",
            [(f"sum by (training_job) (tensorlane_registered_flows{sel()})", "{{training_job}}")],
            "Flows registered with the agents, all hosts (at most 32 jobs per host; the rest is _other).")
    lay.add("Drops by host and class", "pps",
            [(with_level(f"rate(tensorlane_class_dropped_packets_total{sel()}{RATE})"),
              "{{instance}} {{device}} level {{level}}")],
            "Packets dropped by each class's queue (tail drop).")
    borrowing_panel(lay, "{{instance}} ")
    lay.row("Agents")
    lay.add("Agents up", "short", [(f"up{sel(TENSORLANE_JOBS)}", "{{instance}}")],
            "1 when Prometheus scraped the agent's /metrics (scrape jobs named tensorlane* only).")
    lay.add("Registration latency", "s", [(register_latency(0.5), "p50"), (register_latency(0.99), "p99")],
            "Time the agents took to answer register requests (including the nftables transaction).")
    lay.add("API requests by op and outcome", "reqps",
            [(f"sum by (op, outcome) (rate(tensorlane_api_requests_total{sel()}{RATE}))", "{{op}} {{outcome}}")],
            "Requests to the agents' API; outcomes other than ok are refusals (error codes).")
    lay.add("Reconcile passes and errors", "ops",
            [(f"sum by (job, instance) (rate(tensorlane_reconcile_passes_total{sel()}{RATE}))", "{{instance}} passes"),
             (f"sum by (job, instance) (rate(tensorlane_reconcile_errors_total{sel()}{RATE}))", "{{instance}} errors")],
            "Full reconcile passes per second (flat at zero: the agent's main loop is stuck) and failed passes.")
    process_panels(lay, "{{instance}} ")
    return _dashboard("tensorlane-fleet", "tensorlane / fleet",
                      "Network priority of data-parallel training across hosts (tensorlane agents).", lay.panels,
                      [link("Host detail", HOST_URL, "The selected hosts in detail (tensorlane / host)")])


def host() -> dict:
    lay = Layout()
    lay.row("Queues")
    lay.add("Throughput by class", "Bps",
            [(with_level(f"rate(tensorlane_class_sent_bytes_total{sel()}{RATE})"), "{{device}} level {{level}}")],
            "Bytes sent per second by each class.", stack=True)
    lay.add("Link share by class", "percentunit", [(link_share(), "{{device}} level {{level}}")],
            "Each class's bytes per second over its device's link rate (not stacked: a host's devices each have a "
            "link of their own).")
    lay.add("Backlog by class", "bytes", [(backlog(), "{{device}} level {{level}}")],
            "Bytes waiting in each class's queue at scrape time.")
    lay.add("Queueing delay by class", "s",
            [(with_level(f"tensorlane_class_queue_delay_seconds{sel()}"), "{{device}} level {{level}}")],
            "Backlog of the class and every more urgent class over the link rate (exact for level 0, a lower "
            "bound below).")
    lay.add("Priority inversion by class", "Bps",
            [(with_level(f"rate(tensorlane_class_inversion_bytes_total{sel()}{RATE})"),
              "{{device}} level {{level}}")],
            "Bytes per second the class sent while a more urgent class had a backlog (estimate, docs/metrics.md).")
    lay.add("Guaranteed share by class", "percentunit",
            [(f"{with_level(f'tensorlane_class_guaranteed_rate_bytes_per_second{sel()}')}\n"
              f"/ on (job, instance, device) group_left () tensorlane_link_rate_bytes_per_second{sel()}",
              "{{device}} level {{level}}")],
            "The share of the link each class keeps while more urgent classes are busy: min_share, or under a job "
            "policy a job's part of job_share on its band's first level (docs/jobs.md).")
    lay.add("Drops and overlimits by class", "pps",
            [(with_level(f"rate(tensorlane_class_dropped_packets_total{sel()}{RATE})"),
              "drops {{device}} level {{level}}"),
             (with_level(f"rate(tensorlane_class_overlimits_total{sel()}{RATE})"),
              "overlimits {{device}} level {{level}}")],
            "Packets dropped by the class's queue; times HTB throttled the class.")
    borrowing_panel(lay, "")
    lay.add("HTB tokens by class", "s",
            [(with_level(f"tensorlane_class_tokens_seconds{sel()}"), "tokens {{device}} level {{level}}"),
             (with_level(f"tensorlane_class_ctokens_seconds{sel()}"), "ctokens {{device}} level {{level}}")],
            "Time each class may still send at its rate (tokens) and at its ceil (ctokens) before it must "
            "borrow or wait; below zero the class is in debt.", min_zero=False)
    lay.add("Marked bytes by class", "Bps",
            [(with_level(f"rate(tensorlane_class_marked_bytes_total{sel()}{RATE})"), "{{device}} level {{level}}")],
            "Bytes of registered flows the level's nftables chain marked (DSCP and class).")
    lay.add("DSCP reset on unregistered traffic", "pps",
            [(f"rate(tensorlane_unregistered_dscp_reset_packets_total{sel()}{RATE})", "{{device}}")],
            "Packets that left the managed interfaces with DSCP 0 instead of a DSCP of their own (reset_user_dscp): "
            "a user's unregistered traffic, the tails of closed connections, and this host's TCP without a socket "
            "file. A steady rate is likely a kernel TCP client root gave a DSCP (NVMe/TCP's --tos): list its DSCP in "
            "kernel_tcp_dscp (docs/agent.md).")
    lay.add("Registered flows by class and job", "short",
            [(with_level(f"tensorlane_registered_flows{sel()}"), "{{training_job}} level {{level}}")],
            "Flows registered now.")
    training_job_panels(lay, "this host's shims")
    job_policy_panels(lay)
    lay.row("Agent")
    lay.add("Registration latency", "s",
            [(register_latency(0.5), "p50"), (register_latency(0.9), "p90"), (register_latency(0.99), "p99")],
            "Time the agent took to answer register requests (including the nftables transaction).")
    lay.add("API requests by op and outcome", "reqps",
            [(f"sum by (op, outcome) (rate(tensorlane_api_requests_total{sel()}{RATE}))", "{{op}} {{outcome}}")],
            "Requests to the agent's API; outcomes other than ok are refusals (error codes).")
    lay.add("Reconcile", "ops",
            [(f"rate(tensorlane_reconcile_passes_total{sel()}{RATE})", "passes"),
             (f"rate(tensorlane_reconcile_repairs_total{sel()}{RATE})", "repairs"),
             (f"rate(tensorlane_reconcile_errors_total{sel()}{RATE})", "errors")],
            "Full reconcile passes, repaired kernel entries and failed passes per second.")
    lay.add("Metrics sources", "bool",
            [(f"tensorlane_scrape_collector_success{sel()}", "{{collector}}")],
            "Whether each metrics source of the agent succeeded in the last scrape.", min_zero=False)
    lay.add("Flow table file not written", "bool",
            [(f"tensorlane_flow_table_write_failing{sel()}", "write failing")],
            "1 while the agent cannot write its flow table file (flows.json in state_dir: full or read-only; it "
            "retries every 10 s): the file holds an older table, and an agent killed meanwhile loses the flows "
            "registered since (alert TensorlaneFlowTableNotWritten, docs/runbook.md).", min_zero=False)
    process_panels(lay, "{{instance}} ")
    return _dashboard("tensorlane-host", "tensorlane / host",
                      "One host's tensorlane agent: queues, contention, jobs, agent health.", lay.panels,
                      [link("Fleet", "/d/tensorlane-fleet/tensorlane-fleet", "Every host (tensorlane / fleet)")])


DASHBOARDS = {"tensorlane-fleet.json": fleet, "tensorlane-host.json": host}


def render(dashboard: dict) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data (rows excluded)."""
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` of every target of every panel."""
    return [(p["title"], t["refId"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def expand(expr: str, variables: dict[str, str] | None = None) -> str:
    """Substitute Grafana variables (``$name``, ``${name}``) with ``variables`` (default TEST_VARIABLES)."""
    values = TEST_VARIABLES if variables is None else variables

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed JSON file differs from the code")
    p.add_argument("--out", default=str(HERE), help="directory to write to (default: dashboards/)")
    args = p.parse_args(argv)
    stale = []
    for name, make in DASHBOARDS.items():
        path, text = Path(args.out) / name, render(make())
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}: run python -m dashboards.build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
