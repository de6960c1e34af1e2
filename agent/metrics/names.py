"""Every metric the agent exports under ``tensorlane_``: its name, help text and labels, declared once here.

The sources (``agent/metrics/*.py``) make their families (filled at scrape time) and instruments (prometheus_client
``Counter``/``Histogram``, filled as requests happen) from these declarations. Names are written as
prometheus_client takes them: a counter without its ``_total`` and an info metric without its ``_info`` (the
library appends both). Meanings, types and label values: docs/metrics.md. The standard ``process_*`` and
``python_*`` metrics come from prometheus_client's own collectors (``make_registry``).

Usage: ``fam = names.REGISTERED_JOBS.gauge(); fam.add_metric(["eth0"], 3)``
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

DEVICE = ("device",)
DEVICE_CLASS = ("device", "class")
JOB_LEVEL = ("training_job", "level")
JOB = ("training_job",)


@dataclass(frozen=True)
class Name:
    """One metric: ``name`` (without ``_total``/``_info``), ``help`` and its ``labels``."""

    name: str
    help: str
    labels: tuple[str, ...] = ()

    def counter(self, value: float | None = None) -> CounterMetricFamily:
        """A counter family to fill at scrape time; ``value`` for a metric without labels."""
        return CounterMetricFamily(self.name, self.help, value, None if value is not None else list(self.labels))

    def gauge(self, value: float | None = None) -> GaugeMetricFamily:
        """A gauge family to fill at scrape time; ``value`` for a metric without labels."""
        return GaugeMetricFamily(self.name, self.help, value, None if value is not None else list(self.labels))

    def info(self) -> InfoMetricFamily:
        """An info family (``<name>_info`` = 1); its ``add_metric`` takes the label values and the info dict."""
        return InfoMetricFamily(self.name, self.help, labels=list(self.labels))

    def instrument(self, kind, **kwargs):
        """A prometheus_client instrument (``Counter``, ``Histogram``) of no registry: a source collects it."""
        return kind(self.name, self.help, self.labels, registry=None, **kwargs)


# build.py
BUILD = Name("tensorlane_build", "Version of the running agent")  # info: version, python_version
BACKEND = Name("tensorlane_backend", "Kernel queueing backend in use", DEVICE)  # info: backend
PRIORITY_LEVELS = Name("tensorlane_priority_levels", "Priority levels the agent manages", DEVICE)
AGENT_START_TIME = Name("tensorlane_agent_start_time_seconds", "Unix time the agent started serving")

# classes.py (info: level, dscp, prio)
CLASS = Name("tensorlane_class", "Level, DSCP and HTB/prio priority of each queue of the agent", DEVICE_CLASS)
CLASS_SENT_BYTES = Name("tensorlane_class_sent_bytes", "Bytes sent by the class", DEVICE_CLASS)
CLASS_SENT_PACKETS = Name("tensorlane_class_sent_packets", "Packets sent by the class (64-bit when the kernel "
                          "reports TCA_STATS_PKT64)", DEVICE_CLASS)
CLASS_DROPPED_PACKETS = Name("tensorlane_class_dropped_packets", "Packets dropped by the class's queue",
                             DEVICE_CLASS)
CLASS_OVERLIMITS = Name("tensorlane_class_overlimits", "Times the class was throttled by its rate (HTB overlimits)",
                        DEVICE_CLASS)
CLASS_REQUEUES = Name("tensorlane_class_requeues", "Packets requeued by the class", DEVICE_CLASS)
CLASS_BACKLOG_BYTES = Name("tensorlane_class_backlog_bytes", "Bytes queued in the class now", DEVICE_CLASS)
CLASS_BACKLOG_PACKETS = Name("tensorlane_class_backlog_packets", "Packets queued in the class now", DEVICE_CLASS)
CLASS_LENDS = Name("tensorlane_class_lent_packets",
                   "Packets the HTB class sent within its own rate (HTB lends, 32-bit kernel counter)", DEVICE_CLASS)
CLASS_BORROWS = Name("tensorlane_class_borrowed_packets",
                     "Packets the HTB class sent with tokens borrowed from its parent, above its own rate "
                     "(HTB borrows, 32-bit kernel counter)", DEVICE_CLASS)
CLASS_TOKENS = Name("tensorlane_class_tokens_seconds",
                    "Time the HTB class may still send at its rate before it must borrow (negative: in debt)",
                    DEVICE_CLASS)
CLASS_CTOKENS = Name("tensorlane_class_ctokens_seconds",
                     "Time the HTB class may still send at its ceil before it must wait (negative: in debt)",
                     DEVICE_CLASS)
CLASS_GUARANTEED_RATE = Name("tensorlane_class_guaranteed_rate_bytes_per_second",
                             "Rate the HTB class keeps while more urgent classes are busy (min_share, at least "
                             "min_rate, or a job's part of job_share under a job policy)", DEVICE_CLASS)
LINK_RATE = Name("tensorlane_link_rate_bytes_per_second",
                 "Rate the agent's queues are served at (htb: the configured link_rate)", DEVICE)

# contention.py
CLASS_INVERSION_BYTES = Name(
    "tensorlane_class_inversion_bytes",
    "Bytes the class sent between two scrapes at both of which a more urgent class had a backlog "
    "(priority inversion estimate, see docs/metrics.md)", DEVICE_CLASS)
CLASS_MIN_SHARE_RATE = Name(
    "tensorlane_class_min_share_rate_bytes_per_second",
    "Rate the class is guaranteed by min_share alone (htb: min_share of the link, at least 8 kbit/s, or min_share 0's "
    "tiny one; before min_rate's raise and a job's part; prio: 0, no guarantee): the part of the class's bytes "
    "the inversion counter includes by design", DEVICE_CLASS)
CLASS_QUEUE_DELAY = Name(
    "tensorlane_class_queue_delay_seconds",
    "Queueing delay a packet entering the class now would see: backlog of this and more urgent classes "
    "over the link rate (exact for the top class, a lower bound below it)", DEVICE_CLASS)

# flows.py
REGISTERED_FLOWS = Name("tensorlane_registered_flows", "Flows registered with the agent now",
                        ("device", "class", "training_job"))
REGISTERED_JOBS = Name("tensorlane_registered_jobs", "Training jobs with at least one registered flow", DEVICE)
JOB_ID_CONFLICTS = Name("tensorlane_job_id_conflicts",
                        "Job ids that two or more runs (different jobs) use on this host now", DEVICE)
CLASS_MARKED_BYTES = Name("tensorlane_class_marked_bytes",
                          "Bytes marked (DSCP and class) by the level's nftables chain", DEVICE_CLASS)
CLASS_MARKED_PACKETS = Name("tensorlane_class_marked_packets",
                            "Packets marked (DSCP and class) by the level's nftables chain", DEVICE_CLASS)
DSCP_RESET_PACKETS = Name("tensorlane_unregistered_dscp_reset_packets",
                          "Packets of users' unregistered traffic (and this host's TCP with no socket file, its DSCP "
                          "not in kernel_tcp_dscp) that set a DSCP of their own and left with 0 (reset_user_dscp)",
                          DEVICE)
HANDOVER_FLOWS = Name("tensorlane_agent_handover_flows",
                      "Flows of the hand-over's flow table this agent took back at its start (outcome adopted) or "
                      "not, by reason", ("outcome",))

# api.py
API_REQUESTS = Name("tensorlane_api_requests", "Requests to the agent's API, by op and outcome (ok or the error code)",
                    ("op", "outcome"))
API_REQUEST_DURATION = Name("tensorlane_api_request_duration_seconds",
                            "Time to answer an API request (a registration includes its nftables transaction)",
                            ("op",))

# connections.py
CONNECTIONS_REFUSED = Name("tensorlane_agent_connections_refused",
                           "Connections refused or closed and requests refused by the socket server's limits, "
                           "by reason", ("reason",))
CONNECTIONS = Name("tensorlane_agent_connections",
                   "Open API connections, privileged (root, the agent's user, trusted_users) or not", ("kind",))
USERS_AT_CONNECTION_LIMIT = Name("tensorlane_agent_users_at_connection_limit",
                                 "Users holding max_connections_per_user connections now")
CONNECTION_LIMIT = Name("tensorlane_agent_connection_limit", "The socket server's connection limits (configuration)",
                        ("limit",))

# reconcile.py
RECONCILE_PASSES = Name("tensorlane_reconcile_passes", "Full reconcile passes", DEVICE)
RECONCILE_REPAIRS = Name("tensorlane_reconcile_repairs", "Kernel map entries repaired by reconcile passes", DEVICE)
RECONCILE_ERRORS = Name("tensorlane_reconcile_errors", "Reconcile passes that failed", DEVICE)
RECONCILE_STALLED = Name("tensorlane_reconcile_stalled",
                         "1 while no reconcile pass was seen for 3 x reconcile_interval_s, at least 15 s (the main "
                         "loop is stuck: /healthz answers 503)", DEVICE)

# flowtable.py
FLOW_TABLE_WRITES = Name("tensorlane_flow_table_writes",
                         "Writes of the flow table file (flows.json in state_dir, what the next agent after a crash "
                         "takes back) that succeeded")
FLOW_TABLE_WRITE_ERRORS = Name("tensorlane_flow_table_write_errors",
                               "Writes of the flow table file that failed (state_dir full or read-only)")
FLOW_TABLE_WRITE_FAILING = Name("tensorlane_flow_table_write_failing",
                                "1 while the last write of the flow table file failed: the file holds an older table, "
                                "and an agent killed meanwhile loses the flows registered since")

# jobs.py
JOB_ALLREDUCES = Name("tensorlane_job_allreduces",
                      "All-reduce pieces completed, reported by the job's shims on this host", JOB_LEVEL)
JOB_ALLREDUCE_BYTES = Name("tensorlane_job_allreduce_bytes",
                           "Bytes all-reduced, reported by the job's shims on this host", JOB_LEVEL)
JOB_ALLREDUCE_SECONDS = Name("tensorlane_job_allreduce_seconds",
                             "Seconds from launch to completion, summed over all-reduce pieces, reported by the "
                             "job's shims on this host", JOB_LEVEL)
JOB_STEP_BYTES = Name("tensorlane_job_step_bytes",
                      "Bytes one training step all-reduces, as the job's shims on this host last reported it "
                      "(what job_policy shortest orders jobs by)", JOB)
JOB_STEP_COMPUTE_SECONDS = Name("tensorlane_job_step_compute_seconds",
                                "Compute seconds of one training step, agreed over the job's ranks, as its shims on "
                                "this host last reported it (with the step bytes, what job_policy measured_intensity "
                                "orders jobs by)", JOB)
REPORTING_JOBS = Name("tensorlane_reporting_jobs", "Training jobs whose shims reported here recently")

# jobpolicy.py
DEVICE_JOB = ("device", "training_job")
JOB_POLICY = Name("tensorlane_job_policy", "The job policy the agent orders the jobs by", DEVICE)  # info: policy
JOB_FIRST_LEVEL = Name("tensorlane_job_first_level",
                       "The most urgent level of the job's band of levels now (0: the job goes first here)",
                       DEVICE_JOB)
JOB_ORDER_CHANGES = Name("tensorlane_job_order_changes", "Recomputations that changed the job order or the bands",
                         DEVICE)
JOB_SHARE = Name("tensorlane_job_share_ratio", "Share of the link guaranteed to the jobs together (job_share; with "
                 "job_share auto, the part chosen now)", DEVICE)
JOB_SHARE_CHANGES = Name("tensorlane_job_share_changes", "Changes of the jobs' guaranteed parts of the link", DEVICE)
JOB_LINK_SATURATED = Name("tensorlane_job_link_saturated",
                          "Whether the jobs keep the link saturated, as job_share auto finds (1) or not (0)", DEVICE)
JOB_LINK_BUSY = Name("tensorlane_job_link_busy_ratio",
                     "Share of the agent's last samples in which some job's class held queued bytes (job_share auto)",
                     DEVICE)

# __init__.py (AgentCollector: one series per source)
SCRAPE_COLLECTOR_SUCCESS = Name("tensorlane_scrape_collector_success",
                                "Whether the metrics source succeeded in this scrape", ("collector",))
SCRAPE_COLLECTOR_DURATION = Name("tensorlane_scrape_collector_duration_seconds",
                                 "Time the metrics source took in this scrape", ("collector",))

ALL = tuple(v for v in list(globals().values()) if isinstance(v, Name))
