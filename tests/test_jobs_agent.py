"""The agent's job policy (agent/jobs.py, docs/jobs.md): effective levels from the job order, in unit form (the
API on a recording reconciler) and against the real kernel (agents in a testbed of their own): static bands, a
rotation that moves flows in the nftables map at an epoch boundary, agreement of two agents that see different
jobs, and config errors that name their field."""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import time

import pytest

from tensorlane.agent.api import Api
from tensorlane.agent.config import ConfigError, from_dict
from tensorlane.agent.jobs import JobScheduler
from tensorlane.agent.kernel.qdisc import HtbBackend, PrioBackend
from tensorlane.agent.peers import Peer
from tensorlane.agent.reconcile import Device, ReconcileStats
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey
from tensorlane.policies.jobs import (
    AUTO_BUSY,
    AUTO_SHARES,
    AUTO_WINDOW_S,
    alternating_rotation_order,
    banded_level,
    hashed_rotation_order,
    job_bands,
    job_order,
    rotation_epoch,
)

pytestmark = pytest.mark.concurrent  # netns tests here run beside another file's (make test; pyproject markers)


class RecordingRec:
    """The parts of the Reconciler the api uses: records every change it would push to the kernel."""

    def __init__(self, levels: int = 4):
        self.backend = HtbBackend(levels, 200_000_000)
        self.stats = ReconcileStats()
        self.devices = [Device("eth0", 7, self.backend, "eth0")]
        self.interfaces = {"eth0": 7}
        self.ipr = None
        self.calls: list[tuple[list, list, list]] = []
        self.kernel: dict[FlowKey, int] = {}  # what the kernel's map would hold

    def apply(self, table, added, moved, removed) -> None:
        self.calls.append((list(added), list(moved), list(removed)))
        for k in (*removed, *moved):
            assert k in self.kernel, f"{k} deleted but not in the kernel"
            del self.kernel[k]
        for k in (*added, *moved):
            assert k not in self.kernel, f"{k} added twice"
            self.kernel[k] = table.effective_level(k)

    def share_budget(self) -> float:
        return self.backend.share_budget()

    def link_bps(self) -> int | None:
        return getattr(self.backend, "rate", None)

    def set_shares(self, shares) -> bool:
        """The classes' guarantees the job policy asks for (the backend keeps them, no kernel)."""
        return self.backend.set_shares(shares)

    def egress(self, keys, ipr=None) -> dict:
        return dict.fromkeys(keys, "eth0")

    def counters(self) -> dict:
        return {}


@pytest.fixture(autouse=True)
def _no_tc_counters(monkeypatch):
    """``status`` reads the tc class counters: none here (the agents of the namespace tests are processes)."""
    from tensorlane.agent.kernel import tcstats

    monkeypatch.setattr(tcstats, "class_stats", lambda ipr, ifindex: {})


def make_api(levels: int = 4, clock=None, **fields) -> tuple[Api, RecordingRec]:
    cfg = from_dict({"interface": "eth0", "link_rate": "200mbit", "levels": levels, **fields})
    rec = RecordingRec(levels)
    api = Api(cfg, FlowTable(levels), rec, "htb")
    if clock is not None:
        api.jobs.clock = clock
        api.jobs.update(api.table)
    return api, rec


def request(api: Api, peer=None, **msg) -> dict:
    reply = json.loads(api.handle(json.dumps(msg).encode(), peer))
    assert reply["ok"], reply
    return reply["result"]


def flow(port: int) -> dict:
    return {"proto": "tcp", "src": "198.18.0.1", "sport": port, "dst": "198.18.0.2", "dport": 29500}


def key(port: int) -> FlowKey:
    return FlowKey("tcp", "198.18.0.1", port, "198.18.0.2", 29500)


def listed(api: Api) -> dict[int, tuple[str, int, int]]:
    """``{sport: (job, effective level, requested level)}`` from the API's ``list``."""
    return {f["sport"]: (f["job"], f["level"], f["requested_level"]) for f in request(api, op="list")["flows"]}


# ---- unit: the API with a recording reconciler -----------------------------------------------------------------

def test_policy_none_keeps_the_requested_level():
    api, rec = make_api()
    r = request(api, op="register", job="a", level=2, flows=[flow(1)])
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    assert r["level"] == r["requested_level"] == 2 and r["dscp"] == 26 and r["class"] == "7a1:12"
    assert listed(api) == {1: ("a", 2, 2), 2: ("b", 0, 0)}
    assert rec.kernel == {key(1): 2, key(2): 0}
    assert request(api, op="status")["job_policy"] == {"policy": "none", "order": [], "changes": 0, "bands": {},
                                                       "job_share": 0.0, "job_share_among": "sending",
                                                       "job_sample_s": 0.05, "job_hold_s": 0.0, "sending": [],
                                                       "share_changes": 0, "level_shares": {}}


def test_two_runs_with_one_job_id_are_a_visible_conflict(caplog):
    api, rec = make_api(job_policy="rotate")
    first = request(api, op="register", job="none", level=0, flows=[flow(1)], run="run-a")
    again = request(api, op="register", job="none", level=0, flows=[flow(2)], run="run-a")  # the same run's rank
    assert "conflict" not in first and "conflict" not in again
    with caplog.at_level(logging.WARNING, logger="tensorlane.api"):
        other = request(api, op="register", job="none", level=0, flows=[flow(3)], run="run-b")
    assert "also used by another run on this host (2 runs)" in other["conflict"]
    assert "job id 'none' is used by 2 runs on this host (run-a, run-b)" in caplog.text
    assert request(api, op="status")["job_conflicts"] == {"none": ["run-a", "run-b"]}
    from tensorlane.cli import format_status  # docs/jobs.md: `tensorlane status` lists them
    assert ("\njob id conflict: none is used by 2 runs (run-a, run-b): the job policy treats them as one job; give "
            "each job its own id") in format_status(request(api, op="status"))
    request(api, op="register", job="solo", level=0, flows=[flow(4)])  # no run (an older client): no conflict
    request(api, op="unregister", job="none", flows=[flow(3)])
    assert request(api, op="status")["job_conflicts"] == {}  # run-b's flows gone: one run left
    assert "job id conflict" not in format_status(request(api, op="status"))
    with pytest.raises(AssertionError, match="bad_request"):
        request(api, op="register", job="x", level=0, flows=[flow(5)], run="no spaces")


def test_many_runs_under_one_job_id_do_not_grow_status_or_the_log(caplog):
    """One user registering each of its flows under a run token of its own (64 characters): status named every run,
    66 bytes a flow, so 16,000 such flows made root's status reply over the agent's 1 MiB of unread replies (its
    connection closed: ``tensorlane status`` failed), and the log line of each new run quoted them all (a megabyte
    every 10 s). Now at most ``SHOWN_RUNS`` are named, the others counted."""
    from tensorlane.agent.logs import RefusalLog
    from tensorlane.agent.state import SHOWN_RUNS
    from tensorlane.cli import format_status

    api, _ = make_api()
    api.refusal_log = RefusalLog(logging.getLogger("tensorlane.api"), 0.0)  # every line logged
    runs = [f"r{i:05d}".ljust(64, "x") for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="tensorlane.api"):
        for i, run in enumerate(runs):
            request(api, op="register", job="j", level=0, flows=[flow(1000 + i)], run=run)
    assert "is used by 40 runs" in caplog.records[-1].getMessage()
    st = request(api, op="status")
    assert st["job_conflicts"] == {"j": runs[:SHOWN_RUNS]} and st["job_conflict_runs"] == {"j": 40}
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)
    assert "job id conflict: j is used by 40 runs (" + ", ".join(runs[:SHOWN_RUNS]) + ", ...)" in format_status(st)


def test_static_bands_move_other_jobs_in_the_same_change():
    """j-b (priority 0) before j-a (priority 1): alone j-a has all 4 levels; with j-b it gets 2-3 and its flow
    moves in the same kernel change that adds j-b's; when j-b leaves it moves back."""
    api, rec = make_api(job_policy="static", job_priority={"j-b": 0, "j-a": 1})
    request(api, op="register", job="j-a", level=0, flows=[flow(1)])
    request(api, op="register", job="j-a", level=3, flows=[flow(3)])
    assert rec.kernel == {key(1): 0, key(3): 3}
    rec.calls.clear()
    r = request(api, op="register", job="j-b", level=1, flows=[flow(2)])
    assert r["level"] == 0 and r["requested_level"] == 1 and r["dscp"] == 46 and r["moved"] == 0
    assert rec.calls == [([key(2)], [key(1)], [])]  # one transaction; flow 3 stays at 3 (band 2-3, tensor 3)
    assert rec.kernel == {key(1): 2, key(2): 0, key(3): 3}
    assert listed(api) == {1: ("j-a", 2, 0), 2: ("j-b", 0, 1), 3: ("j-a", 3, 3)}
    st = request(api, op="status")
    assert st["job_policy"]["order"] == ["j-b", "j-a"]
    assert st["job_policy"]["bands"] == {"j-b": {"first_level": 0, "levels": 2}, "j-a": {"first_level": 2, "levels": 2}}
    assert {c["level"]: c.get("flows") for c in st["classes"]} == {0: 1, 1: 0, 2: 1, 3: 1, None: None}
    rec.calls.clear()
    request(api, op="unregister", job="j-b")
    assert rec.calls == [([], [key(1)], [key(2)])]  # flow 3 stays at level 3: not touched
    assert rec.kernel == {key(1): 0, key(3): 3}


def test_unlisted_jobs_go_after_listed_ones_and_share_a_band():
    api, rec = make_api(job_policy="static", job_priority={"prod": 0})
    for i, job in enumerate(("x", "y", "prod")):
        request(api, op="register", job=job, level=0, flows=[flow(10 + i)])
    assert rec.kernel == {key(12): 0, key(10): 2, key(11): 2}


@pytest.mark.parametrize("policy", ["rotate", "alternate"])
def test_rotation_moves_every_changed_flow_at_an_epoch_boundary(policy):
    now = [0.0]
    api, rec = make_api(clock=lambda: now[0], job_policy=policy, rotate_epoch_s=2)
    rotation = hashed_rotation_order if policy == "rotate" else alternating_rotation_order
    epoch = next(e for e in range(1, 100) if rotation(["p", "q"], e) != rotation(["p", "q"], e - 1))
    now[0] = (epoch - 1) * 2.0 + 0.5
    assert api.reorder() == 0
    request(api, op="register", job="p", level=0, flows=[flow(1), flow(2)])
    request(api, op="register", job="q", level=0, flows=[flow(3)])
    first, second = rotation(["p", "q"], epoch - 1)
    port_of = {"p": [1, 2], "q": [3]}
    assert {rec.kernel[key(p)] for p in port_of[first]} == {0} and {rec.kernel[key(p)] for p in port_of[second]} == {2}
    assert not api.jobs.epoch_due() and api.jobs.seconds_to_next_epoch() == pytest.approx(1.5)
    now[0] = epoch * 2.0 + 0.01
    assert api.jobs.epoch_due()
    rec.calls.clear()
    assert api.reorder() == 3
    assert rec.calls == [([], [key(1), key(2), key(3)], [])]  # one transaction
    assert {rec.kernel[key(p)] for p in port_of[second]} == {0} and {rec.kernel[key(p)] for p in port_of[first]} == {2}
    assert not api.jobs.epoch_due() and api.reorder() == 0
    st = request(api, op="status")["job_policy"]
    assert st["policy"] == policy and st["epoch"] == epoch and st["order"] == [second, first]


def test_the_user_level_limit_bounds_the_effective_level():
    """nobody may use level 2 or less urgent: its jobs get bands of levels 2-3 only, among themselves, whatever the
    order says, so root's job keeps the band it has alone (levels 0-3); and adding jobs of nobody's moves none of
    root's flows (before tiers, nobody's job first in the order pushed root's to level 2)."""
    api, rec = make_api(job_policy="static", job_priority={"mine": 0, "mine2": 1}, level_limits={"*": 2},
                        check_ownership=False)
    nobody = Peer(os.getpid(), 65534, 65534)
    request(api, peer=nobody, op="register", job="mine", level=2, flows=[flow(1)])
    request(api, op="register", job="other", level=0, flows=[flow(2)])
    request(api, op="register", job="other", level=3, flows=[flow(3)])
    assert rec.kernel == {key(1): 3, key(2): 0, key(3): 3}  # mine: band 2-3 alone; other: 0-3
    assert listed(api)[1] == ("mine", 3, 2)
    request(api, peer=nobody, op="register", job="mine2", level=2, flows=[flow(4)])
    assert rec.kernel == {key(1): 2, key(2): 0, key(3): 3, key(4): 3}  # nobody's two jobs share 2-3; root's stay
    bands = request(api, op="status")["job_policy"]["bands"]
    assert bands["other"] == {"first_level": 0, "levels": 4} and bands["mine"] == {"first_level": 2, "levels": 1}


def test_intensity_policy_orders_by_configured_intensity():
    api, rec = make_api(job_policy="intensity", job_intensity={"light": 0.5, "heavy": 4.0})
    for i, job in enumerate(("light", "heavy", "unknown")):
        request(api, op="register", job=job, level=0, flows=[flow(20 + i)])
    assert rec.kernel == {key(21): 0, key(20): 1, key(22): 2}


def test_shortest_orders_by_the_jobs_reported_step_bytes():
    """``shortest``: jobs without a report share one band; a job's report of its step bytes (by the user who
    registered its flows, or root) moves the flows in one kernel change, fewest bytes first; another user's report
    for the job, a report of a job with no flows here, and a report under another policy change nothing."""
    api, rec = make_api(job_policy="shortest", check_ownership=False)  # made-up peers: no process or socket
    alice, bob = Peer(pid=1, uid=1000, gid=1000), Peer(pid=2, uid=1001, gid=1001)
    for port, job in ((1, "big"), (2, "small")):
        request(api, alice, op="register", job=job, level=0, flows=[flow(port)])
    assert rec.kernel == {key(1): 0, key(2): 0}  # no reports: one band for both
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    r = request(api, bob, op="report", job="small", session="s-bob", levels=levels, step_bytes=10)
    assert r["step_bytes"] == "ignored: the job has no flows registered on this host"  # (another user's job: as
    assert rec.kernel == {key(1): 0, key(2): 0}  # one without flows, its id in use not told)
    r = request(api, alice, op="report", job="ghost", session="s-g", levels=levels, step_bytes=10)
    assert r["step_bytes"] == "ignored: the job has no flows registered on this host"
    rec.calls.clear()
    assert request(api, alice, op="report", job="big", session="s1", levels=levels, step_bytes=9000)[
        "step_bytes"] == "taken"
    assert rec.calls == [([], [key(2)], [])] and rec.kernel == {key(1): 0, key(2): 2}  # reported before unreported
    rec.calls.clear()
    request(api, None, op="report", job="small", session="s2", levels=levels, step_bytes=3000)
    assert rec.calls == [([], sorted([key(1), key(2)]), [])] and rec.kernel == {key(1): 2, key(2): 0}
    rec.calls.clear()
    request(api, alice, op="report", job="small", session="s3", levels=levels, step_bytes=3000)  # the same again
    assert rec.calls == []
    st = request(api, op="status")["job_policy"]
    assert st["order"] == ["small", "big"] and st["step_bytes"] == {"big": 9000, "small": 3000}
    request(api, op="unregister", job="small")
    assert api.jobs.reported == {"big": {"step_bytes": 9000}}  # forgotten with the job's last flow
    other, _ = make_api(job_policy="static", job_priority={"a": 0})
    request(other, op="register", job="a", level=0, flows=[flow(1)])
    assert request(other, op="report", job="a", session="s", levels=levels, step_bytes=5)["step_bytes"] == (
        "unused: job_policy is 'static'")
    with pytest.raises(AssertionError, match="bad_request"):
        request(api, op="report", job="big", session="s", levels=levels, step_bytes=-1)


def test_measured_intensity_orders_by_reported_compute_per_byte():
    """``measured_intensity``: a job ranks once both its step bytes and its agreed compute time are in (in one
    report or two), most compute per byte first; ``compute_s`` alone, or under ``shortest``, is unused; a value
    refused by the protocol changes nothing."""
    api, rec = make_api(job_policy="measured_intensity", check_ownership=False)
    for port, job in ((1, "light"), (2, "heavy")):
        request(api, op="register", job=job, level=0, flows=[flow(port)])
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    r = request(api, op="report", job="light", session="s1", levels=levels, step_bytes=4 * 10**6, compute_s=0.2)
    assert r["step_bytes"] == r["compute_s"] == "taken" and rec.kernel == {key(1): 0, key(2): 2}
    request(api, op="report", job="heavy", session="s2", levels=levels, step_bytes=10**6)  # bytes alone: unranked
    assert rec.kernel == {key(1): 0, key(2): 2}
    rec.calls.clear()
    request(api, op="report", job="heavy", session="s2", levels=levels, compute_s=0.2)  # 4x the compute per byte
    assert rec.calls == [([], sorted([key(1), key(2)]), [])] and rec.kernel == {key(1): 2, key(2): 0}
    st = request(api, op="status")["job_policy"]
    assert st["order"] == ["heavy", "light"] and st["compute_s"] == {"heavy": 0.2, "light": 0.2}
    assert st["step_bytes"] == {"heavy": 10**6, "light": 4 * 10**6}
    for bad in (-1.0, math.inf, 1e9, "1"):
        with pytest.raises(AssertionError, match="bad_request"):
            request(api, op="report", job="heavy", session="s2", levels=levels, compute_s=bad)
    assert rec.kernel == {key(1): 2, key(2): 0}
    other, _ = make_api(job_policy="shortest")
    request(other, op="register", job="a", level=0, flows=[flow(1)])
    r = request(other, op="report", job="a", session="s", levels=levels, step_bytes=5, compute_s=0.1)
    assert r["step_bytes"] == "taken" and r["compute_s"] == "unused: job_policy is 'shortest'"


def test_slowdown_reranks_with_the_clock_and_the_jobs_windows():
    """``slowdown``: a job ranks once its compute time, step bytes and window are in; the job furthest behind its
    ideal step goes first, and the order moves with the clock alone (``rerank_wanted``: the server re-ranks every
    ``job_sample_s``): a job whose step runs long overtakes one whose window has just moved on. A window the
    protocol refuses changes nothing; under another policy the window is unused."""
    now = [1000.0]
    api, rec = make_api(job_policy="slowdown", check_ownership=False, clock=lambda: now[0])
    for port, job in ((1, "a"), (2, "b")):
        request(api, op="register", job=job, level=0, flows=[flow(port)])
    assert rec.kernel == {key(1): 0, key(2): 0}  # nothing reported: one band
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    # a 200 Mbit/s link: a last bucket of 2.5 MB takes 0.1 s, so each job's ideal step is 0.5 s
    r = request(api, op="report", job="a", session="s1", levels=levels, tail_bytes=2_500_000, compute_s=0.4,
                window_start=998.0, window_steps=4)
    assert r["window_start"] == r["window_steps"] == "taken" and rec.kernel == {key(1): 0, key(2): 2}
    r = request(api, op="report", job="b", session="s2", levels=levels, tail_bytes=2_500_000, compute_s=0.4,
                window_start=997.0, window_steps=4, step_bytes=9)  # b: 3 s over 2.5 s, a: 2 s over 2.5 s
    assert r["step_bytes"] == "unused: job_policy is 'slowdown'"  # the whole step's bytes are not waited for
    assert rec.kernel == {key(1): 2, key(2): 0} and api.jobs.rerank_wanted()
    request(api, op="report", job="b", session="s2", levels=levels, window_start=999.9, window_steps=4)
    assert rec.kernel == {key(1): 0, key(2): 2}  # b's window moved on: a is further behind now
    rec.calls.clear()
    assert api.reorder() == 0 and rec.calls == []  # the same moment: nothing moves
    now[0] = 1000.5  # a: 2.5 / 2.5, b: 0.6 / 2.5
    assert api.reorder() == 0
    request(api, op="report", job="a", session="s1", levels=levels, window_start=1000.4, window_steps=4)
    assert rec.kernel == {key(1): 2, key(2): 0}  # a's step ended: b first (0.6 against 0.1)
    now[0] = 1003.0  # no report: a's window 2.6 s, b's 3.1 s: the clock alone keeps b first
    assert api.reorder() == 0
    request(api, op="report", job="b", session="s2", levels=levels, window_start=1002.9, window_steps=4)
    assert rec.kernel == {key(1): 0, key(2): 2}
    changes = api.jobs.changes
    now[0] = 1010.0  # a: 9.6 / 2.5, b: 7.1 / 2.5; both long, the order holds
    assert api.reorder() == 0 and api.jobs.changes == changes
    st = request(api, op="status")["job_policy"]
    assert st["order"] == ["a", "b"] and st["window_start"] == {"a": 1000.4, "b": 1002.9}
    assert st["slowdown"] == {"a": round(9.6 / 2.5, 3), "b": round(7.1 / 2.5, 3)}
    from tensorlane.cli import format_status

    assert "order a (0.4 s compute/step, slowdown 3.84), b (" in format_status(
        request(api, op="status"))
    for bad in ({"window_steps": -1}, {"window_steps": 10**6}, {"window_start": math.inf}, {"window_start": "1"},
                {"tail_bytes": -1}, {"tail_bytes": 0.5}):
        with pytest.raises(AssertionError, match="bad_request"):
            request(api, op="report", job="a", session="s1", levels=levels, **bad)
    assert rec.kernel == {key(1): 0, key(2): 2}
    other, _ = make_api(job_policy="measured_intensity")
    request(other, op="register", job="a", level=0, flows=[flow(1)])
    r = request(other, op="report", job="a", session="s", levels=levels, compute_s=0.1, window_start=5.0,
                window_steps=1)
    assert r["compute_s"] == "taken" and r["window_start"] == "unused: job_policy is 'measured_intensity'"
    assert not other.jobs.rerank_wanted()


def test_full_reconcile_and_status_use_effective_levels():
    table = FlowTable(4)
    sched = JobScheduler(from_dict({"interface": "eth0", "job_policy": "static", "job_priority": {"a": 0, "b": 1}}))
    table.level_of = sched.level_of
    table.register("b", 1, (key(1),))
    table.register("a", 3, (key(2),))
    sched.update(table)
    assert {k: table.effective_level(k) for k in table.flows} == {key(1): 2, key(2): 1}
    assert table.by_level() == {0: [], 1: [key(2)], 2: [key(1)], 3: []}
    assert table.flows[key(1)].level == 1  # the table keeps what the client asked for
    assert table.jobs() == {"a": 1, "b": 1}


@pytest.mark.parametrize("fields,field", [
    ({"job_policy": "fair"}, "job_policy"),
    ({"job_policy": 1}, "job_policy"),
    ({"job_policy": "rotate", "rotate_epoch_s": 0}, "rotate_epoch_s"),
    ({"job_policy": "rotate", "rotate_epoch_s": "20"}, "rotate_epoch_s"),
    ({"rotate_epoch_s": 5}, "rotate_epoch_s"),                                  # without rotation: a mistake
    ({"job_policy": "static", "job_priority": {"-bad": 1}}, "job_priority"),
    ({"job_policy": "static", "job_priority": {"a": 1.5}}, "job_priority"),
    ({"job_policy": "static", "job_priority": {"a": True}}, "job_priority"),
    ({"job_policy": "static", "job_priority": [1, 2]}, "job_priority"),
    ({"job_policy": "rotate", "job_priority": {"a": 1}}, "job_priority"),
    ({"job_policy": "intensity", "job_intensity": {"a": -1.0}}, "job_intensity"),
    ({"job_policy": "static", "job_intensity": {"a": 1.0}}, "job_intensity"),
    ({"job_share": 0.5}, "job_share"),                                          # without a job order: a mistake
    ({"job_policy": "static", "job_share": -0.1}, "job_share"),
    ({"job_policy": "static", "job_share": 0.96}, "job_share"),
    ({"job_policy": "static", "job_share": "0.5"}, "job_share"),
    ({"job_policy": "static", "job_share": float("nan")}, "job_share"),
    ({"job_policy": "static", "job_share_among": "all"}, "job_share_among"),
    ({"job_share_among": "present"}, "job_share_among"),                        # without a job order: a mistake
    ({"job_hold_s": 0.1}, "job_hold_s"),
    ({"job_policy": "static", "job_share_among": "present", "job_sample_s": 0.02}, "job_sample_s"),  # not sampled
    ({"job_policy": "static", "job_sample_s": 0.001}, "job_sample_s"),
    ({"job_policy": "static", "job_hold_s": -1}, "job_hold_s"),
    ({"job_policy": "static", "job_hold_s": 0.05}, "job_hold_s"),  # no longer than a sample: holds nothing
    ({"job_policy": "static", "job_sample_s": 0.02, "job_hold_s": 0.02}, "job_hold_s"),
    ({"job_policy": "static", "min_share": 0.1, "job_share": 0.6}, "job_share"),  # 5 classes x 0.1 + 0.6 > 1
    ({"job_policy": "static", "job_share": 0, "job_hold_s": 0.2}, "job_hold_s"),  # no parts: nothing to hold
    ({"job_policy": "static", "job_share": 0, "job_sample_s": 0.02}, "job_sample_s"),
    ({"job_policy": "static", "job_share": 0, "job_share_among": "present"}, "job_share_among"),
])
def test_bad_job_config_names_the_field(fields, field):
    with pytest.raises(ConfigError) as info:
        from_dict({"interface": "eth0", **fields})
    assert info.value.field == field and f"config field '{field}'" in str(info.value)


def test_good_job_config_defaults():
    cfg = from_dict({"interface": "eth0"})
    assert (cfg.job_policy, cfg.rotate_epoch_s, cfg.job_priority, cfg.job_intensity) == ("none", 20.0, {}, {})
    cfg = from_dict({"interface": "eth0", "job_policy": "rotate", "rotate_epoch_s": 2})
    assert cfg.rotate_epoch_s == 2.0
    cfg = from_dict({"interface": "eth0", "job_policy": "alternate", "rotate_epoch_s": 3})
    assert (cfg.job_policy, cfg.rotate_epoch_s, cfg.job_share) == ("alternate", 3.0, 0.2)
    assert from_dict({"interface": "eth0", "job_policy": "static", "job_share": 0.8}).job_share == 0.8
    # slowdown re-ranks every job_sample_s, parts or none
    cfg = from_dict({"interface": "eth0", "job_policy": "slowdown", "job_share": 0, "job_sample_s": 0.02})
    assert cfg.job_sample_s == 0.02


def test_job_share_guarantees_follow_the_set_of_jobs():
    """With ``job_share = 0.6`` each of n jobs is guaranteed 0.6 / n of the link on its band's first level while
    there are two or more; alone, or after the others leave, the classes are back at ``min_share``."""
    api, rec = make_api(job_policy="static", job_priority={"a": 0, "b": 1, "c": 2}, job_share=0.6)
    mbit, base = 1_000_000, rec.backend.guaranteed(None)  # the default class: min_share's guarantee
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    assert rec.backend.shares == {} and rec.backend.guaranteed(0) == base
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    assert rec.backend.shares == {0: 0.3, 2: 0.3}
    assert [rec.backend.guaranteed(lvl) for lvl in (0, 1, 2, 3, None)] == [60 * mbit, base, 60 * mbit, base, base]
    request(api, op="register", job="c", level=0, flows=[flow(3)])
    assert rec.backend.shares == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2})  # bands 0, 1, 2-3
    st = request(api, op="status")["job_policy"]
    assert st["job_share"] == 0.6 and st["level_shares"] == {"0": 0.2, "1": 0.2, "2": 0.2}
    request(api, op="unregister", job="b")
    request(api, op="unregister", job="c")
    assert rec.backend.shares == {} and rec.backend.guaranteed(0) == base


def test_the_parts_follow_the_link_when_the_devices_held_change():
    """An agent that started holding no device took its parts' budget from the class layout alone; when the
    devices held change (one taken over, given back) the budget and the link rate follow, and so do the parts:
    "auto"'s part stays within the new budget. Nothing changes while they stay the same."""
    api, rec = make_api(job_policy="static", job_priority={"a": 0, "b": 1}, job_share="auto")
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    before = dict(api.jobs.shares)
    assert before and not api.jobs.follow_link(api.jobs.budget, api.jobs.link_bps)  # unchanged: nothing
    assert api.jobs.follow_link(0.1, 10**8) and api.jobs.link_bps == 10**8  # a budget below the parts in force
    assert api.jobs.job_share <= 0.1 and sum(api.jobs.shares.values()) <= 0.1 + 1e-9, api.jobs.shares


def test_job_share_parts_follow_the_jobs_that_are_sending():
    """With three jobs or more (``job_share_among = "sending"``, the default) each of the k jobs whose band's
    classes the samples found backlogged within ``job_hold_s`` gets ``job_share / k``, the idle ones
    ``job_share / n``; with two jobs nothing is sampled (the parts are the same either way); ``"present"`` never
    samples."""
    HOLD_S = 0.3
    api, rec = make_api(job_policy="static", job_priority={"a": 0, "b": 1, "c": 2}, job_share=0.6, job_hold_s=HOLD_S,
                        job_sample_s=0.02)
    assert api.jobs.sample_s == 0.02 and api.jobs.describe()["job_hold_s"] == HOLD_S
    for i, job in enumerate("abc"):
        assert not api.jobs.samples_wanted()  # fewer than three jobs: nothing to sample
        request(api, op="register", job=job, level=0, flows=[flow(i + 1)])
    assert api.jobs.samples_wanted() and rec.backend.shares == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2})
    t = 100.0
    assert api.jobs.observe({0, 3}, t)  # a's level 0 and c's level 3 (band 2-3) backlogged
    assert rec.set_shares(api.jobs.shares) and rec.backend.shares == pytest.approx({0: 0.3, 1: 0.2, 2: 0.3})
    assert api.jobs.describe()["sending"] == ["a", "c"]
    assert not api.jobs.observe({0}, t + HOLD_S / 2)  # c still counts within HOLD_S
    assert api.jobs.observe({0}, t + HOLD_S * 1.5)  # c idle for longer: a alone sends, every job its 1/n
    assert api.jobs.shares == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2}) and api.jobs.describe()["sending"] == ["a"]
    assert not api.jobs.observe({0, 1, 2}, t + 1)  # all three send: 1/k = 1/n, the classes stay as they are
    assert api.jobs.describe()["sending"] == ["a", "b", "c"] and api.jobs.describe()["share_changes"] == 2
    request(api, op="unregister", job="b")  # two jobs left: no sampling, the parts of the jobs present
    assert not api.jobs.samples_wanted() and api.jobs.describe()["sending"] == []
    assert rec.backend.shares == pytest.approx({0: 0.3, 2: 0.3})
    present, _ = make_api(job_policy="static", job_share=0.6, job_share_among="present")
    for i, job in enumerate("abc"):
        request(present, op="register", job=job, level=0, flows=[flow(i + 1)])
    assert not present.jobs.samples_wanted() and present.jobs.describe()["job_share_among"] == "present"
    rec = RecordingRec()
    rec.backend = PrioBackend(4)  # no guarantees to give: the server never wakes to sample
    prio = Api(from_dict({"interface": "eth0", "job_policy": "static", "job_share": 0.6}), FlowTable(4), rec, "prio")
    for i, job in enumerate("abc"):
        request(prio, op="register", job=job, level=0, flows=[flow(i + 1)])
    assert len(prio.jobs.bands) == 3 and not prio.jobs.samples_wanted() and not prio.sample_sending(1.0)


def test_job_share_auto_follows_whether_the_jobs_saturate_the_link():
    """``job_share = "auto"``: two jobs are enough to sample; the parts are AUTO_SHARES[0] until a window of
    samples finds the link busy at least AUTO_BUSY[1] of the time, then AUTO_SHARES[1], and back only below
    AUTO_BUSY[0] (a window busy in between keeps what it was); the classes follow; with fewer than two jobs the
    window starts again; status shows the state."""
    from tensorlane.cli import format_status

    api, rec = make_api(job_policy="static", job_priority={"a": 0, "b": 1}, job_share="auto", job_sample_s=0.05)
    window = api.jobs.busy.maxlen
    assert window == round(AUTO_WINDOW_S / 0.05) and api.jobs.job_share == AUTO_SHARES[0]
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    assert not api.jobs.samples_wanted()  # one job: its part is the whole link anyway
    request(api, op="register", job="b", level=0, flows=[flow(2)])
    assert api.jobs.samples_wanted() and rec.backend.shares == pytest.approx({0: 0.1, 2: 0.1})
    t, changed = 10.0, []
    for i in range(window):  # a full window, busy just under AUTO_BUSY[1]: not saturated
        busy = i >= window * (1 - AUTO_BUSY[1]) + 1
        changed.append(api.jobs.observe({0} if busy else set(), t + i * 0.05))
    assert not any(changed) and not api.jobs.saturated and api.jobs.link_busy() < AUTO_BUSY[1]
    for i in range(window):  # the link stays busy: saturated once the window is
        if api.jobs.observe({2}, t + 10 + i * 0.05):
            break
    assert api.jobs.saturated and api.jobs.job_share == AUTO_SHARES[1] and api.jobs.link_busy() >= AUTO_BUSY[1]
    assert rec.set_shares(api.jobs.shares) and rec.backend.shares == pytest.approx({0: 0.475, 2: 0.475})
    st = request(api, op="status")["job_policy"]
    assert (st["job_share"], st["job_share_auto"], st["saturated"], st["saturation_changes"]) == (0.95, True, True, 1)
    assert "job_share 0.95 auto, saturated (link busy 95 %) (level 0 47.5 %, level 2 47.5 %)" in format_status(
        request(api, op="status"))
    idle_after = None
    for i in range(window):  # the link idles now and then: saturated until the share drops below AUTO_BUSY[0]
        if api.jobs.observe(set() if i % 4 == 0 else {0}, t + 20 + i * 0.05):
            idle_after = i
            break
    assert idle_after is not None and not api.jobs.saturated and api.jobs.link_busy() < AUTO_BUSY[0]
    assert api.jobs.shares == pytest.approx({0: 0.1, 2: 0.1}) and api.jobs.saturation_changes == 2
    assert request(api, op="status")["job_policy"]["saturated_s"] > 0
    request(api, op="unregister", job="b")  # alone: nothing to sample, the window starts again
    assert not api.jobs.samples_wanted() and not api.jobs.busy and api.jobs.link_busy() is None
    fixed, _ = make_api(job_policy="static", job_share=0.6)
    assert not fixed.jobs.share_auto and "job_share_auto" not in fixed.jobs.describe()


def test_job_share_auto_in_the_config():
    """``job_share`` takes a fraction or "auto", and nothing else; "auto" only with a job policy, like a number."""
    assert from_dict({"interface": "eth0", "job_policy": "static", "job_share": "auto"}).job_share == "auto"
    for bad in ("0.5", "AUTO", "fifo"):
        with pytest.raises(ConfigError, match="job_share.*auto"):
            from_dict({"interface": "eth0", "job_policy": "static", "job_share": bad})
    with pytest.raises(ConfigError, match="job_share"):
        from_dict({"interface": "eth0", "job_share": "auto"})
    cfg = from_dict({"interface": "eth0", "job_policy": "static", "job_share": "auto", "job_share_among": "present",
                     "job_sample_s": 0.02})  # "auto" samples whatever the split
    assert cfg.job_sample_s == 0.02
    with pytest.raises(ConfigError, match="job_sample_s.*auto"):
        from_dict({"interface": "eth0", "job_policy": "static", "job_share_among": "present", "job_sample_s": 0.02})
    cfg = from_dict({"interface": "eth0", "job_policy": "slowdown", "job_share_among": "present",
                     "job_sample_s": 0.1})  # slowdown re-ranks every job_sample_s whatever the split
    assert cfg.job_sample_s == 0.1
    with pytest.raises(ConfigError, match="job_hold_s"):
        from_dict({"interface": "eth0", "job_policy": "static", "job_share": "auto", "job_share_among": "present",
                   "job_hold_s": 0.2})


def test_by_default_a_job_counts_as_sending_only_while_the_last_sample_found_it_so():
    """``job_hold_s`` 0 (the default): a job whose classes held no queue at the last sample no longer counts, so
    its part goes back to the idle one at once, and the jobs still sending get theirs."""
    api, _ = make_api(job_policy="static", job_priority={"a": 0, "b": 1, "c": 2}, job_share=0.6)
    for i, job in enumerate("abc"):
        request(api, op="register", job=job, level=0, flows=[flow(i + 1)])
    assert api.jobs.bands == {"a": (0, 1), "b": (1, 1), "c": (2, 2)} and api.jobs.hold_s == 0.0
    assert not api.jobs.observe({0, 1, 3}, 1.0)  # all three send: 1/k = 1/n, nothing to change
    assert api.jobs.describe()["sending"] == ["a", "b", "c"]
    assert api.jobs.observe({0, 3}, 1.05)  # b's queue emptied: a and c send
    assert api.jobs.describe()["sending"] == ["a", "c"] and api.jobs.shares == pytest.approx({0: 0.3, 1: 0.2, 2: 0.3})
    assert api.jobs.observe(set(), 1.1) and api.jobs.shares == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2})


def test_a_failed_sample_is_counted_and_changes_nothing(caplog):
    """The classes cannot be read (a device gone): the sample counts a reconcile error, logs it, and the parts stay;
    a sample that can be read gives the sending jobs their parts."""
    api, rec = make_api(job_policy="static", job_priority={"a": 0, "b": 1, "c": 2}, job_share=0.6)
    for i, job in enumerate("abc"):
        request(api, op="register", job=job, level=0, flows=[flow(i + 1)])

    def unreadable():
        raise OSError("no such device")

    rec.backlogged_levels = unreadable
    with caplog.at_level(logging.WARNING, logger="tensorlane.api"):
        assert not api.sample_sending(1.0)
    assert rec.stats.errors == 1 and "no such device" in rec.stats.last_error
    assert "sampling the classes' backlog: no such device" in caplog.text
    assert rec.backend.shares == pytest.approx({0: 0.2, 1: 0.2, 2: 0.2})
    rec.backlogged_levels = lambda: {0, 2}
    assert api.sample_sending(2.0) and rec.backend.shares == pytest.approx({0: 0.3, 1: 0.2, 2: 0.3})


def test_status_table_shows_the_job_order_and_parts():
    from tensorlane.cli import format_status

    assert "job policy" not in format_status(request(make_api()[0], op="status"))  # policy none: no line
    api, _ = make_api(job_policy="static", job_priority={"a": 0, "b": 1})
    assert format_status(request(api, op="status")).endswith("\njob policy static: order -; job_share 0.2")
    request(api, op="register", job="b", level=0, flows=[flow(1)])
    request(api, op="register", job="a", level=0, flows=[flow(2)])
    text = format_status(request(api, op="status"))
    assert "job policy static: order a, b; job_share 0.2 (level 0 10 %, level 2 10 %)" in text, text
    api, _ = make_api(job_policy="shortest")
    for port, job in ((1, "a"), (2, "b")):
        request(api, op="register", job=job, level=0, flows=[flow(port)])
    request(api, op="report", job="b", session="s", levels=[{"level": 0, "allreduces": 1, "bytes": 8, "comm_s": 0}],
            step_bytes=4096)
    text = format_status(request(api, op="status"))
    assert "job policy shortest: order b (4096 B/step), a; job_share 0.2" in text, text
    assert "\njob bands: b levels 0-1, a levels 2-3\n" in text, text  # docs/jobs.md: unreported jobs share a band
    request(api, op="register", job="c", level=0, flows=[flow(3)])
    text = format_status(request(api, op="status"))
    assert "\njob bands: b levels 0-1, a levels 2-3, c levels 2-3\n" in text, text
    api, _ = make_api(job_policy="measured_intensity")  # a 200 Mbit/s link: 2.5 MB take 0.1 s
    request(api, op="register", job="a", level=0, flows=[flow(1)])
    request(api, op="report", job="a", session="s", levels=[{"level": 0, "allreduces": 1, "bytes": 8, "comm_s": 0}],
            step_bytes=2_500_000, compute_s=0.15)
    text = format_status(request(api, op="status"))
    assert "order a (2500000 B/step, 0.15 s compute/step, intensity 1.5)" in text, text


# ---- against the kernel: agents in a testbed of their own --------------------------------------------------------

EPOCH_S = 1.0
TRUST = {"trusted_users": ["root"]}


def kernel_levels(host) -> dict[int, int]:
    """``{sport: level}`` of the agent's IPv4 flow map on ``host``, as the kernel holds it."""
    out = json.loads(host.run(["nft", "-j", "list", "map", "inet", "tensorlane", "flows4"]).stdout)
    m = next(i["map"] for i in out["nftables"] if "map" in i)
    return {e[0]["concat"][3]: int(e[1]["goto"]["target"][5:]) for e in m.get("elem", [])}


def map_handle(host) -> int:
    out = json.loads(host.run(["nft", "-j", "-a", "list", "map", "inet", "tensorlane", "flows4"]).stdout)
    return next(i["map"] for i in out["nftables"] if "map" in i)["handle"]


def settled(read, epoch_s: float = EPOCH_S, margin: float = 0.25, timeout: float = 10.0):
    """``(epoch, read())`` taken well inside one epoch (at least ``margin`` s after its boundary, so that every
    agent has switched, and ended before the next)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.time()
        into = now % epoch_s
        if into < margin or into > epoch_s - margin:
            time.sleep(max(0.01, (margin - into) % epoch_s))
            continue
        e0 = rotation_epoch(now, epoch_s)
        value = read()
        if rotation_epoch(time.time(), epoch_s) == e0:
            return e0, value
    raise AssertionError("no settled reading within the timeout")


def expected(jobs_ports: dict[str, list[int]], epoch: int, levels: int, requested: int = 0) -> dict[int, int]:
    order, ranks = job_order("rotate", sorted(jobs_ports), now_s=epoch * EPOCH_S, epoch_s=EPOCH_S)
    bands = job_bands(order, levels, ranks)
    return {p: banded_level(bands[j], requested, levels) for j, ports in jobs_ports.items() for p in ports}


@pytest.fixture(scope="module")
def tb():
    from testbed import Testbed

    with Testbed(hosts=2, rate="100mbit", name="tjag") as bed:
        yield bed


def _flow(src, sport, dst, dport=9000) -> dict:
    return {"proto": "udp", "src": src.ip, "sport": sport, "dst": dst.ip, "dport": dport}


@pytest.mark.netns
def test_rotation_moves_flows_in_the_kernel_map_in_place(tb):
    from bench.agents import running_agents

    h1, h2 = tb.host(1), tb.host(2)
    jobs = {"job-a": [7001, 7002], "job-b": [7003]}
    cfg = {"job_policy": "rotate", "rotate_epoch_s": EPOCH_S, **TRUST}
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra=cfg) as agents:
        with agents[1].client() as agent:
            for job, ports in jobs.items():
                agent.register(job, 0, [_flow(h1, p, h2) for p in ports])
            handle = map_handle(h1)
            qdisc = h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
            seen_orders = set()
            for _ in range(12):  # 12 settled readings: with probability 1 - 2^-11 the order changes
                epoch, (levels, flows) = settled(lambda: (kernel_levels(h1), agent.list()["flows"]))
                assert levels == expected(jobs, epoch, 4), epoch
                assert {f["sport"]: f["level"] for f in flows} == levels
                assert all(f["requested_level"] == 0 for f in flows)
                seen_orders.add(tuple(sorted(levels.items())))
                if len(seen_orders) == 2:
                    break
                time.sleep(EPOCH_S * 0.6)
            st = agent.status()
        assert map_handle(h1) == handle  # the same map: elements moved in place
        assert h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout == qdisc
    assert len(seen_orders) == 2, "the order never changed in 12 epochs"
    assert st["job_policy"]["policy"] == "rotate" and st["job_policy"]["epoch_s"] == EPOCH_S
    assert sorted(st["job_policy"]["order"]) == ["job-a", "job-b"]


@pytest.mark.netns
def test_two_agents_with_different_jobs_agree_on_shared_jobs(tb):
    """Host 1 sees jobs a, b, c; host 2 sees b, c, d. Every epoch, both kernels order b and c alike."""
    from bench.agents import running_agents

    h1, h2 = tb.host(1), tb.host(2)
    on1 = {"a": [7101], "b": [7102], "c": [7103]}
    on2 = {"b": [7202], "c": [7203], "d": [7204]}
    cfg = {"job_policy": "rotate", "rotate_epoch_s": EPOCH_S, **TRUST}
    with running_agents(tb, levels=4, backend="htb", config_extra=cfg) as agents:
        for host, other, jobs in ((h1, h2, on1), (h2, h1, on2)):
            with agents[host.index].client() as agent:
                for job, ports in jobs.items():
                    agent.register(job, 0, [_flow(host, p, other) for p in ports])
        for _ in range(4):
            epoch, (k1, k2) = settled(lambda: (kernel_levels(h1), kernel_levels(h2)))
            assert k1 == expected(on1, epoch, 4) and k2 == expected(on2, epoch, 4), epoch
            b_first = hashed_rotation_order(["b", "c"], epoch)[0] == "b"
            # b before c on both hosts, or c before b on both: never inverted
            assert (k1[7102] < k1[7103]) == b_first and (k2[7202] < k2[7203]) == b_first
            time.sleep(EPOCH_S * 0.6)


@pytest.mark.netns
def test_slowdown_reorders_the_kernel_map_as_the_clock_moves(tb):
    """A real agent under ``slowdown``: with no report after the first two, the server's loop re-ranks the jobs as
    their windows age, and the kernel's map follows. Job a has ended 4 steps of 0.5 s in 2 s (ranked 0.8 + 0.4 e
    at e seconds later), job b's window has just begun with an ideal step of 1 s (ranked e): a first until about
    1.3 s, b first after."""
    from bench.agents import running_agents

    h1, h2 = tb.host(1), tb.host(2)
    levels = [{"level": 0, "allreduces": 1, "bytes": 8, "comm_s": 0.0}]
    with running_agents(tb, levels=4, hosts=[1], backend="htb", config_extra={"job_policy": "slowdown", **TRUST}
                        ) as agents:
        with agents[1].client() as agent:
            agent.register("job-a", 0, [_flow(h1, 7301, h2)])
            agent.register("job-b", 0, [_flow(h1, 7302, h2)])
            t0 = time.time()
            agent.request("report", job="job-a", session="sa", levels=levels, tail_bytes=0, compute_s=0.5,
                          window_start=t0 - 2.0, window_steps=4)
            agent.request("report", job="job-b", session="sb", levels=levels, tail_bytes=0, compute_s=1.0,
                          window_start=t0, window_steps=0)
            first = kernel_levels(h1)
            assert time.time() - t0 < 0.8, "too slow to read the order before the crossing"
            assert first == {7301: 0, 7302: 2}, first
            deadline = time.monotonic() + 10
            while kernel_levels(h1) != {7301: 2, 7302: 0} and time.monotonic() < deadline:
                time.sleep(0.1)
            crossed = time.time() - t0
            assert kernel_levels(h1) == {7301: 2, 7302: 0} and 1.2 < crossed < 2.0, crossed
            st = agent.status()["job_policy"]
        assert st["policy"] == "slowdown" and st["order"] == ["job-b", "job-a"] and st["changes"] >= 2


@pytest.mark.netns
@pytest.mark.parametrize("extra,field", [({"job_policy": "fair"}, "job_policy"),
                                         ({"job_policy": "static", "job_priority": {"-x": 1}}, "job_priority")])
def test_agent_refuses_bad_job_config_before_the_kernel(tb, extra, field, tmp_path):
    from bench.agents import AgentStartError, running_agents

    h1 = tb.host(1)
    before = h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    with pytest.raises(AgentStartError, match=f"config field '{field}'"):
        with running_agents(tb, hosts=[1], config_extra=extra, workdir=str(tmp_path)):
            pass
    assert h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout == before
    assert "tensorlane" not in h1.run(["nft", "list", "tables"]).stdout


def test_a_report_that_underflows_the_intensity_is_ranked_and_the_agent_keeps_serving():
    """``measured_intensity``: a tiny compute time over a huge byte count once made ``log(0)`` in the ranking, and
    every later request of anyone answered ``internal`` (and an owner's exit killed the agent). Ranked now, and
    the agent goes on serving; every report stays within what a user may do with their own job."""
    api, rec = make_api(job_policy="measured_intensity", check_ownership=False)
    alice = Peer(pid=1, uid=1000, gid=1000)
    request(api, alice, op="register", job="odd", level=0, flows=[flow(1)])
    request(api, op="register", job="prod", level=0, flows=[flow(2)])
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    for compute_s, step_bytes in ((1e-310, 10**18), (5e-324, 2**63 - 1), (86400.0, 1)):
        r = request(api, alice, op="report", job="odd", session="s1", levels=levels, step_bytes=step_bytes,
                    compute_s=compute_s)
        assert r["compute_s"] == "taken"
    request(api, op="register", job="later", level=1, flows=[flow(3)])  # the agent still registers flows
    assert request(api, op="unregister", job="later")["removed"] == 1
    assert request(api, alice, op="unregister", job="odd")["removed"] == 1 and set(rec.kernel) == {key(2)}


def test_a_user_cannot_join_another_users_job_id():
    """A job id in use by one user's flows on this host is not joined by another user: the second could report the
    job's inputs (reorder it) or hold a flow under its id. Until 2026-11-27 it was refused (``forbidden``), so a
    user who took an id first (every id a job will use is on its command line) kept the owner's flows out of the
    queues. Now the second user's flows go under its own job ``ID@USER``, which no client can name (no one takes it
    first), with the id's configured priority; its reports count for that job only. Root and trusted users may
    join; a free id, or one whose flows are all the user's own, is taken as before."""
    api, rec = make_api(job_policy="static", job_priority={"prod": 0, "other": 1}, check_ownership=False,
                        trusted_users=["ops"])
    alice, bob = Peer(pid=1, uid=1000, gid=1000), Peer(pid=2, uid=1001, gid=1001)
    request(api, alice, op="register", job="prod", level=0, flows=[flow(1)])
    request(api, alice, op="register", job="prod", level=1, flows=[flow(2)])  # the same user: as before
    own = f"prod@{bob.user}"
    r = request(api, bob, op="register", job="prod", level=0, flows=[flow(3)])
    assert r["job"] == own and "in use by another user" in r["conflict"]
    assert api.table.jobs() == {"prod": 2, own: 1} and set(rec.kernel) == {key(1), key(2), key(3)}
    assert api.jobs._tables({own})["priority"] == {own: 0}  # the id's priority, as the job that holds it
    assert request(api, bob, op="register", job="prod", level=1, flows=[flow(4)])["job"] == own  # stays its own
    reply = json.loads(api.handle(json.dumps({"op": "register", "job": own, "level": 0,
                                              "flows": [flow(5)]}).encode(), alice))
    assert reply["error"]["code"] == "bad_job"  # no client names a user's own job
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    r = request(api, bob, op="report", job="prod", session="s-bob", levels=levels, step_bytes=1)
    assert r["job"] == own and r["counted_as"] is not None  # bob's own job's series, not alice's
    assert own in api.reports.snapshot() and "prod" not in api.reports.snapshot()
    r = request(api, bob, op="report", job="nothing-here", session="s-bob", levels=levels)
    assert r["counted_as"] is None  # no series for a job with no flows of bob's
    assert "nothing-here" not in api.reports.snapshot()
    assert [f["job"] for f in request(api, bob, op="list", job="prod")["flows"]] == [own, own]
    assert request(api, bob, op="unregister", job="prod")["removed"] == 2  # its own job's, not alice's
    assert api.table.jobs() == {"prod": 2} and set(rec.kernel) == {key(1), key(2)}
    request(api, op="register", job="prod", level=0, flows=[flow(6)])  # root may join
    r = request(api, alice, op="report", job="prod", session="s-alice", levels=levels, step_bytes=5)
    assert r["counted_as"] is None  # prod is no longer alice's alone
    assert request(api, alice, op="register", job="prod", level=0, flows=[flow(7)])["job"] == f"prod@{alice.user}"


def test_a_users_own_job_is_found_by_uid_and_its_flows_under_the_id_can_be_unregistered(monkeypatch):
    """A user's own job ``ID@USER`` is found by its uid, not its name: a name lookup that failed for a while (the
    uid then) started a second job for the same run, in another band. And a user whose flows are under the id itself
    (registered before root joined it) and under its own job unregisters the former by naming them: the request
    meant its own job, where they are not (``conflict``), so they stayed until their sockets closed."""
    import tensorlane.agent.peers as peers

    api, rec = make_api(job_policy="static", job_priority={"prod": 0}, check_ownership=False)
    alice = Peer(pid=1, uid=1000, gid=1000)
    names = {1000: "alice"}
    monkeypatch.setattr(peers, "user_name", lambda uid: names.get(uid, str(uid)))
    request(api, alice, op="register", job="prod", level=0, flows=[flow(1), flow(2)])
    request(api, op="register", job="prod", level=0, flows=[flow(3)])  # root joins alice's job
    assert request(api, alice, op="register", job="prod", level=1, flows=[flow(4)])["job"] == "prod@alice"
    names.clear()  # the name lookup fails now: the uid
    assert request(api, alice, op="register", job="prod", level=1, flows=[flow(5)])["job"] == "prod@alice"
    assert api.table.jobs() == {"prod": 3, "prod@alice": 2}
    r = request(api, alice, op="unregister", job="prod", flows=[flow(1)])
    assert r == {"job": "prod", "removed": 1}  # the flow under the id itself, named
    assert request(api, alice, op="unregister", job="prod")["removed"] == 2  # no flows named: its own job's
    assert api.table.jobs() == {"prod": 2} and set(rec.kernel) == {key(2), key(3)}


def test_two_users_of_one_name_do_not_share_an_own_job(monkeypatch):
    """Two uids with one name (a local and a directory entry of one login, or a uid with no entry, named by its
    number, beside a user of that name) made the same own job ``ID@USER``: the second joined the first's job, so its
    flows and reports were another user's (reports then ``ignored`` for both, and an unregister of the job refused
    for both). Now the second's own job names its uid too (``ID@USER:UID``, a name no passwd entry has)."""
    import tensorlane.agent.peers as peers

    api, rec = make_api(job_policy="static", job_priority={"prod": 0}, check_ownership=False)
    owner, first, second = (Peer(pid=p, uid=u, gid=u) for p, u in ((1, 1000), (2, 1001), (3, 1002)))
    monkeypatch.setattr(peers, "user_name", lambda uid: {1000: "carol", 1001: "alice", 1002: "alice"}[uid])
    request(api, owner, op="register", job="prod", level=0, flows=[flow(1)])
    assert request(api, first, op="register", job="prod", level=0, flows=[flow(2)])["job"] == "prod@alice"
    r = request(api, second, op="register", job="prod", level=0, flows=[flow(3)])
    assert r["job"] == "prod@alice:1002" and api.table.job_users("prod@alice") == {1001}, r
    assert request(api, second, op="register", job="prod", level=1, flows=[flow(4)])["job"] == "prod@alice:1002"
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    assert request(api, first, op="report", job="prod", session="s1", levels=levels)["counted_as"] is not None
    assert request(api, second, op="unregister", job="prod")["removed"] == 2
    assert api.table.jobs() == {"prod": 1, "prod@alice": 1} and set(rec.kernel) == {key(1), key(2)}


def test_bad_flow_types_and_deep_json_are_clear_errors():
    api, _rec = make_api()
    for line, code in ((json.dumps({"op": "register", "job": "j", "level": 0, "flows": [dict(flow(1), proto=[])]}),
                        "bad_flow"),
                       (json.dumps({"op": "register", "job": "j", "level": 0, "flows": [dict(flow(1), proto={})]}),
                        "bad_flow"),
                       ("[" * 100_000 + "]" * 100_000, "bad_json"),
                       (json.dumps({"op": "register", "job": "j" * 63 + "\n", "level": 0, "flows": [flow(1)]}),
                        "bad_job")):
        reply = json.loads(api.handle(line.encode()[:65_000] if line.startswith("[") else line.encode()))
        assert not reply["ok"] and reply["error"]["code"] == code, (line[:80], reply)
    assert api.table.flows == {}


def test_a_user_holds_at_most_its_flows_and_jobs():
    """``max_flows_per_user`` and ``max_jobs_per_user`` bound a user that is neither root nor trusted (``limit``,
    nothing changed); re-registering flows it holds is no new flow; root and trusted users are not bounded."""
    api, rec = make_api(job_policy="static", check_ownership=False, max_flows_per_user=4, max_jobs_per_user=2,
                        trusted_users=["ops"])
    alice = Peer(pid=1, uid=1000, gid=1000)
    request(api, alice, op="register", job="a", level=0, flows=[flow(1), flow(2)])
    request(api, alice, op="register", job="b", level=0, flows=[flow(3)])
    for job, ports, what in (("c", [4], "max_jobs_per_user = 2"), ("a", [5, 6], "max_flows_per_user = 4")):
        reply = json.loads(api.handle(json.dumps({"op": "register", "job": job, "level": 0,
                                                  "flows": [flow(p) for p in ports]}).encode(), alice))
        assert reply["error"]["code"] == "limit" and what in reply["error"]["message"], reply
    assert set(rec.kernel) == {key(1), key(2), key(3)}
    request(api, alice, op="register", job="a", level=1, flows=[flow(1)])  # held already: moved, not new
    request(api, alice, op="unregister", job="b")
    request(api, alice, op="register", job="c", level=0, flows=[flow(4)])  # a job freed: room again
    for port in range(10, 20):
        request(api, op="register", job=f"root{port}", level=0, flows=[flow(port)])
    assert api.table.user_flows(1000) == 3 and api.table.user_jobs(1000) == {"a", "c"}


def test_config_values_that_would_fail_after_the_takeover_are_config_errors():
    from tensorlane.agent.daemon import check_socket_group

    with pytest.raises(ConfigError, match="socket_group"):
        check_socket_group(from_dict({"interface": "eth0", "socket_group": "no-such-group-tl"}))
    check_socket_group(from_dict({"interface": "eth0", "socket_group": "root"}))
    for bad in ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:9477\n"):
        with pytest.raises(ConfigError, match="metrics_address"):
            from_dict({"interface": "eth0", "metrics_address": bad})


def test_the_servers_own_work_failing_is_counted_and_the_loop_goes_on():
    """The server loop's own work (reordering, sampling, dropping an exited owner's flows) that raises is counted as
    a reconcile error and logged (bounded), and does not end the agent: before, one such error left the serve loop,
    and the agent restored the interfaces and exited with every flow lost."""
    import types

    from tensorlane.agent.server import Server

    api, rec = make_api()
    fake = types.SimpleNamespace(api=api, refusals=api.refusal_log)

    def boom(*_args):
        raise RuntimeError("no")
    Server._guarded(fake, "reordering the jobs", boom)
    Server._guarded(fake, "removing an exited process's flows", boom, 42)
    assert rec.stats.errors == 2 and rec.stats.last_error == "removing an exited process's flows: RuntimeError: no"


def test_a_limited_users_jobs_share_one_part_and_its_inputs_go_when_root_joins():
    """Under a job policy with parts, the jobs of a user limited by level_limits hold one job's part in all, however
    many they are (32 jobs took root's level-0 part from 0.45 to 0.03 of the link); and step bytes that user reported
    for a job id before root joined it are dropped then (they ranked root's flows last)."""
    api, rec = make_api(job_policy="shortest", job_share=0.9, job_share_among="present", check_ownership=False,
                        level_limits={"*": 2})
    mal = Peer(pid=1, uid=1000, gid=1000)
    request(api, op="register", job="prod", level=0, flows=[flow(1)])
    request(api, op="register", job="prod2", level=0, flows=[flow(2)])
    request(api, mal, op="register", job="m0", level=2, flows=[flow(10)])
    one = api.jobs.shares[0]
    for i in range(1, 20):
        request(api, mal, op="register", job=f"m{i}", level=2, flows=[flow(10 + i)])
    assert api.jobs.shares[0] == pytest.approx(one) and one == pytest.approx(2 * 0.9 / 3)  # prod, prod2: a tie
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    request(api, mal, op="register", job="squat", level=2, flows=[flow(40)])
    assert request(api, mal, op="report", job="squat", session="s", levels=levels, step_bytes=2**62)["step_bytes"] \
        == "taken"
    request(api, op="register", job="squat", level=0, flows=[flow(41)])
    assert "squat" not in api.jobs.reported and "squat" not in api.jobs.inputs_of("step_bytes")


def test_an_ordinary_users_jobs_share_one_part_with_no_level_limits(monkeypatch):
    """With no ``level_limits`` every user is in root's tier; still, the jobs of a user that is neither root nor
    trusted hold one job's part of ``job_share`` in all, split among them: two jobs of user mal beside root's job and
    user bob's leave those 0.3 each of ``job_share`` 0.9 (before: 0.225, a part per job), and 20 jobs weigh one job
    in all (before, 20 parts of 22: root's job 0.041). Root's and a trusted user's jobs keep one part each. The order
    is the policy's, as before; mal's jobs weigh one job in the bands' cut too: root's job keeps level 0 and bob's
    level 1, each alone in its class, and mal's 20 jobs take levels 2-3 (before, bands were cut by the number of
    jobs: prod, b, m0 and m1 shared level 0's class, and level 0's part was 0.63)."""
    from tensorlane.agent import peers

    names = {1000: "mal", 1001: "bob", 1002: "ops"}
    monkeypatch.setattr(peers, "user_name", lambda uid: names.get(uid, str(uid)))
    api, rec = make_api(job_policy="static", job_share=0.9, job_share_among="present", check_ownership=False,
                        trusted_users=["ops"],
                        job_priority={"prod": 0, "b": 1, **{f"m{i}": 2 + i for i in range(20)}, "t1": 30, "t2": 31})
    mal, bob, ops = (Peer(pid=1, uid=uid, gid=uid) for uid in names)
    request(api, op="register", job="prod", level=0, flows=[flow(1)])
    request(api, bob, op="register", job="b", level=0, flows=[flow(2)])
    for i in range(2):
        request(api, mal, op="register", job=f"m{i}", level=0, flows=[flow(10 + i)])
    assert api.jobs.shares == pytest.approx({0: 0.3, 1: 0.3, 2: 0.15, 3: 0.15})
    for i in range(2, 20):
        request(api, mal, op="register", job=f"m{i}", level=0, flows=[flow(10 + i)])
    assert api.jobs.order == ("prod", "b", *(f"m{i}" for i in range(20)))  # the policy's order, as before
    weights = api.jobs.weights
    assert weights["prod"] == weights["b"] == 1.0 and sum(weights[f"m{i}"] for i in range(20)) == pytest.approx(1)
    assert api.jobs.bands["prod"] == (0, 1) and api.jobs.bands["b"] == (1, 1)
    assert [api.jobs.bands[f"m{i}"] for i in range(20)] == [(2, 1)] * 10 + [(3, 1)] * 10
    assert [rec.kernel[key(p)] for p in (1, 2, 10, 11, 29)] == [0, 1, 2, 2, 3]  # prod, b, m0, m1, m19: no move
    assert api.jobs.shares == pytest.approx({0: 0.3, 1: 0.3, 2: 0.15, 3: 0.15})  # as with two of mal's jobs
    request(api, ops, op="register", job="t1", level=0, flows=[flow(40)])
    request(api, ops, op="register", job="t2", level=0, flows=[flow(41)])
    assert api.jobs.weights["t1"] == api.jobs.weights["t2"] == api.jobs.weights["prod"] == 1.0
    request(api, op="register", job="m0", level=0, flows=[flow(50)])  # root joins one of mal's jobs: a part of its own
    assert api.jobs.weights["m0"] == 1.0 and api.jobs.weights["m1"] == pytest.approx(1 / 19)


def test_users_leave_root_its_reserve_of_flows():
    """Users that are neither root nor trusted fill at most max_flows less reserved_flow_share of it together; root
    can always register (before, two users at their caps filled the table and root was refused ``limit``)."""
    api, rec = make_api(check_ownership=False, max_flows=10, reserved_flow_share=0.2, max_flows_per_user=10)
    alice, bob = Peer(pid=1, uid=1000, gid=1000), Peer(pid=2, uid=1001, gid=1001)
    request(api, alice, op="register", job="a", level=0, flows=[flow(p) for p in range(1, 5)])
    request(api, bob, op="register", job="b", level=0, flows=[flow(p) for p in range(5, 9)])
    reply = json.loads(api.handle(json.dumps({"op": "register", "job": "b", "level": 0,
                                              "flows": [flow(9)]}).encode(), bob))
    assert reply["error"]["code"] == "limit" and "reserved_flow_share" in reply["error"]["message"]
    request(api, op="register", job="root", level=0, flows=[flow(9), flow(10)])
    assert len(rec.kernel) == 10


def test_a_users_list_shows_its_own_flows_and_never_walks_the_table():
    """``list`` from a user that is neither root nor trusted returns only the flows it registered (of one job, if
    named), found through the job index: its cost grows with the user's flows, not the table's. Before, every list
    sorted the whole table (0.1 s at 100,000 flows even for a job with none, 0.44 s and a 15 MB reply without
    one), so one user at its 200 requests/s kept the agent's only thread busy; and it named every user's jobs."""
    api, _rec = make_api(check_ownership=False, trusted_users=["ops"])
    alice, bob = Peer(pid=1, uid=1000, gid=1000), Peer(pid=2, uid=1001, gid=1001)
    request(api, alice, op="register", job="a", level=1, flows=[flow(1), flow(2)])
    request(api, bob, op="register", job="b", level=1, flows=[flow(3)])
    request(api, op="register", job="a", level=1, flows=[flow(4)])  # root joins alice's job
    for first in (100, 600):
        request(api, op="register", job="root-job", level=0, flows=[flow(p) for p in range(first, first + 500)])

    class NoScan(dict):
        def items(self):
            raise AssertionError("list walked the whole table")

        __iter__ = values = items

    everything = api.table.flows
    api.table.flows = NoScan(everything)
    assert [f["sport"] for f in request(api, alice, op="list")["flows"]] == [1, 2]
    assert [f["sport"] for f in request(api, alice, op="list", job="a")["flows"]] == [1, 2]
    assert request(api, alice, op="list", job="b")["flows"] == [] == request(api, bob, op="list", job="x")["flows"]
    assert [(f["job"], f["sport"]) for f in request(api, bob, op="list")["flows"]] == [("b", 3)]
    assert [f["sport"] for f in request(api, op="list", job="a")["flows"]] == [1, 2, 4]  # root: every flow
    api.table.flows = everything
    assert len(request(api, op="list")["flows"]) == 1004
    assert len(request(api, Peer(pid=3, uid=0, gid=0), op="list")["flows"]) == 1004


def test_a_users_status_names_no_other_users_jobs_or_runs(monkeypatch):
    """``status`` from a user that is neither root nor trusted names none of another user's job ids or run tokens
    (until 2026-11-28 it named every user's, while ``list`` named only the user's own): they are placeholders
    ``(another user's job N)``, numbered by the order; its own jobs, with their runs, keep their ids. The counts,
    the order's length, the bands' shape, the reported inputs and the counters stay. Root and trusted users see
    every id, as before."""
    import tensorlane.agent.peers as peers
    from tensorlane.cli import format_status

    names = {1000: "alice", 1001: "bob", 1002: "ops"}
    monkeypatch.setattr(peers, "user_name", lambda uid: names.get(uid, str(uid)))
    api, _rec = make_api(job_policy="shortest", check_ownership=False, trusted_users=["ops"])
    alice, bob, ops = (Peer(pid=p, uid=u, gid=u) for p, u in ((1, 1000), (2, 1001), (3, 1002)))
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    request(api, alice, op="register", job="alice-job", level=1, flows=[flow(1)], run="alice-run-1")
    request(api, alice, op="register", job="alice-job", level=1, flows=[flow(2)], run="alice-run-2")
    request(api, alice, op="report", job="alice-job", session="s-a", levels=levels, step_bytes=300)
    for port, run in ((3, "bob-run-1"), (4, "bob-run-2"), (5, "bob-run-3")):
        request(api, bob, op="register", job="bob-secret", level=0, flows=[flow(port)], run=run)
    request(api, bob, op="report", job="bob-secret", session="s-b", levels=levels, step_bytes=100)
    request(api, op="register", job="root-job", level=0, flows=[flow(6), flow(7)], run="root-run")
    # bob takes alice's id: its flows go under its own job alice-job@bob, which names alice's id: hidden too
    assert request(api, bob, op="register", job="alice-job", level=0, flows=[flow(8)])["job"] == "alice-job@bob"
    hidden = ("bob-secret", "bob-run", "root-job", "root-run", "alice-job@bob")  # (root-run: one run, never shown)

    full = request(api, op="status")
    assert full["unnamed_jobs"] == 0 and full["job_policy"]["order"][0] == "bob-secret"
    for root in (None, Peer(pid=4, uid=0, gid=0), ops):  # the agent itself, root, a trusted user: everything
        st = request(api, root, op="status")
        text = json.dumps(st) + format_status(st)
        assert all(name in text for name in ("bob-secret", "bob-run-1", "root-job", "alice-job@bob", "alice-run-1"))
        assert st["jobs"] == full["jobs"] and st["job_conflicts"] == full["job_conflicts"]

    st = request(api, alice, op="status")
    text = json.dumps(st) + format_status(st)
    assert not [name for name in hidden if name in text], text
    assert "alice-run-1" in text and "alice-run-2" in text  # its own job's runs
    other = [f"(another user's job {i})" for i in (1, 2, 3)]
    jp, fj = st["job_policy"], full["job_policy"]
    assert st["unnamed_jobs"] == 3 and sorted(st["jobs"]) == sorted(["alice-job", *other])
    others_in_order = [j for j in fj["order"] if j != "alice-job"]  # (numbered in the order: flows counted)
    assert list(st["jobs"].values()) == [full["jobs"][j] for j in ["alice-job", *others_in_order]]
    assert len(jp["order"]) == len(fj["order"]) == 4 and jp["order"][0] == other[0]  # bob's job first: fewest bytes
    assert jp["order"].index("alice-job") == fj["order"].index("alice-job")
    assert [jp["bands"][j] for j in jp["order"]] == [fj["bands"][j] for j in fj["order"]]
    assert jp["step_bytes"] == {other[0]: 100, "alice-job": 300}
    assert st["job_conflicts"] == {"alice-job": ["alice-run-1", "alice-run-2"], other[0]: []}
    assert st["job_conflict_runs"] == {"alice-job": 2, other[0]: 3}
    assert st["classes"] == full["classes"] and st["flows"] == full["flows"] == 8
    assert "\n(another user's job 1): 3 flows" in text and "job alice-job: 2 flows" in text
    assert "job id conflict: (another user's job 1) is used by 3 runs: the job policy treats them as one job\n" in text
    assert "3 jobs of other users shown unnamed" in text
    assert "bob-secret" not in json.dumps(request(api, alice, op="status"))  # (a reply is built afresh each time)


def test_a_users_list_of_another_users_job_does_not_walk_it():
    """``list`` with ``job`` naming a job in which the user holds no flows (root's, with 100,000 flows) walked all
    of that job's flows to list none of them: 50 ms per request, at the user's 200 requests/s the agent's only
    thread. Now it answers at once, without looking at them; root still lists every flow of any job."""
    api, _rec = make_api(check_ownership=False)
    alice = Peer(pid=1, uid=1000, gid=1000)
    request(api, alice, op="register", job="a", level=1, flows=[flow(1)])
    request(api, op="register", job="root-job", level=0, flows=[flow(p) for p in range(100, 600)])

    class NoWalk(set):
        def __iter__(self):
            raise AssertionError("list walked another user's job")

    walked = api.table.by_job["root-job"]
    api.table.by_job["root-job"] = NoWalk(walked)
    assert request(api, alice, op="list", job="root-job") == {"flows": [], "next": None}
    assert [f["sport"] for f in request(api, alice, op="list", job="a")["flows"]] == [1]
    api.table.by_job["root-job"] = walked
    assert len(request(api, op="list", job="root-job")["flows"]) == 500


def test_a_refused_request_logs_a_short_line_whatever_it_carried(caplog):
    """The refusal log writes one line per reason every 10 s, each with the error's message; a message quotes the
    client's input (an op, a job id or a field name of up to 64 KiB), so each line is clipped: one user could
    otherwise write 64 KiB per reason every 10 s (several GB a day). The reply keeps the whole message."""
    api, _rec = make_api()
    alice = Peer(pid=1, uid=1000, gid=1000)
    big = "x" * 60_000
    with caplog.at_level(logging.INFO, logger="tensorlane.api"):
        for msg in ({"op": big}, {"op": "register", "job": big, "level": 0, "flows": [flow(1)]},
                    {"op": "hello", big: 1}):
            reply = json.loads(api.handle(json.dumps(msg).encode(), alice))
            assert not reply["ok"] and big in reply["error"]["message"]
    lines = [r.getMessage() for r in caplog.records if r.name == "tensorlane.api"]
    assert len(lines) == 3 and all(len(line) < 500 for line in lines), [len(line) for line in lines]


def test_a_user_flipping_its_reports_reorders_the_jobs_at_most_every_few_seconds(monkeypatch):
    """Under ``shortest`` a user alternating its job's ``step_bytes`` at every report moved every flow of the
    jobs ranked between (another user's) at each one, up to 200 times a second. Now one user's reports reorder
    at most every ``REPORT_REORDER_S``: the inputs are taken at once, the reorder waits until then (``reorder_at``,
    run by the server's loop) and follows the last report. Root's reports still reorder at once."""
    from tensorlane.agent import api as api_mod

    clock = [1000.0]
    monkeypatch.setattr(api_mod.time, "monotonic", lambda: clock[0])
    api, rec = make_api(job_policy="shortest", check_ownership=False)
    mallory, victim = Peer(pid=1, uid=1000, gid=1000), Peer(pid=2, uid=1001, gid=1001)
    request(api, victim, op="register", job="v", level=0, flows=[flow(p) for p in range(1, 50)])
    request(api, mallory, op="register", job="m", level=0, flows=[flow(99)])
    levels = [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]
    request(api, victim, op="report", job="v", session="sv", levels=levels, step_bytes=5000)
    rec.calls.clear()
    for i in range(100):  # within the same instant: only the first reorders
        r = request(api, mallory, op="report", job="m", session="sm", levels=levels, step_bytes=10**9 if i % 2 else 1)
        assert r["step_bytes"] == "taken"
    assert len(rec.calls) == 1 and list(api.jobs.order) == ["m", "v"]  # the first report's reorder
    assert api.reorder_at == 1000.0 + api_mod.REPORT_REORDER_S
    assert api.jobs.reported["m"] == {"step_bytes": 10**9}  # taken, the reorder held back
    urgent = rec.kernel[key(99)]
    clock[0] += api_mod.REPORT_REORDER_S
    api.reorder()  # what the server's loop does at reorder_at
    assert api.reorder_at is None and list(api.jobs.order) == ["v", "m"] and rec.kernel[key(99)] > urgent
    request(api, None, op="report", job="v", session="sr", levels=levels, step_bytes=10**10)  # root: at once
    assert list(api.jobs.order) == ["m", "v"] and rec.kernel[key(99)] == urgent


def test_the_sweep_reads_a_bounded_turn_of_owners_and_comes_round_to_all(monkeypatch):
    """A user registering from thousands of processes: each sweep (every 0.5 s) reads at most ``SWEEP_OWNERS``
    owners' ``/proc/PID/fd``, in pid order from after the last sweep's, so every owner is read within a few sweeps
    and none stalls the agent's loop. Before, every sweep read every owner (seconds with tens of thousands)."""
    from tensorlane.agent import api as api_mod

    api, _rec = make_api(check_ownership=False)
    n = 2 * api_mod.SWEEP_OWNERS + 10
    for pid in range(100, 100 + n):
        api.table.register("many", 1, (key(pid),), pid=pid, uid=1000)
    turns = []
    monkeypatch.setattr(api_mod, "not_owned_by_owners",
                        lambda owners, read=None, fd_of=None, uid_of=None: turns.append(sorted(owners)) or [])
    for _ in range(4):
        assert api.sweep() == 0
    assert [len(t) for t in turns] == [api_mod.SWEEP_OWNERS] * 4
    assert turns[0][0] == 100 and sorted(set().union(*turns[:3])) == list(range(100, 100 + n))  # all in 3 sweeps
    wrapped = api_mod.SWEEP_OWNERS - 10  # the third sweep read the last 10 pids, then came round to the first
    assert turns[3] == list(range(100 + wrapped, 100 + wrapped + api_mod.SWEEP_OWNERS))


def test_a_closed_flow_keeps_its_level_only_while_its_own_users_socket_sends():
    """A flow whose socket was closed keeps its level while the kernel still sends its queued bytes (``_let_go``,
    ``_drained``). That was looked up by the flow's addresses alone: another user who made a socket of the same
    addresses (the victim's closed while draining, the address pair free again) and closed it with bytes queued
    kept the victim's flow registered, its own bytes at the victim's level, until the deadline. Now only a socket
    of the user that registered the flow keeps it."""
    import os

    lst = socket.create_server(("127.0.0.1", 0))
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user (nobody): its socket closed with bytes queued that no one reads (FIN_WAIT1)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # (made as nobody: the socket is its)
            s.connect(lst.getsockname())
            s.setblocking(False)
            try:
                while True:
                    s.send(b"x" * 65536)
            except BlockingIOError:
                pass
            os.write(w, str(s.getsockname()[1]).encode())
            s.close()
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as fh:
        sport = int(fh.read())
    os.waitpid(pid, 0)
    try:
        theirs = FlowKey("tcp", "127.0.0.1", sport, "127.0.0.1", lst.getsockname()[1])
        api, _rec = make_api(check_ownership=False)
        api.table.register("victim", 0, (theirs,), pid=12345, uid=1000)  # a flow of user 1000 with those addresses
        assert api._let_go([theirs]) == [theirs] and not api.table.draining  # not 1000's socket: removed
        api.table.register("victim", 0, (theirs,), pid=12345, uid=65534)  # its own user's: it drains
        assert api._let_go([theirs]) == [] and list(api.table.draining) == [theirs]
        api.table.unregister("victim")
        api.table.register("victim", 0, (theirs,), pid=12345, uid=1000)
        api.table.drain([theirs], time.monotonic() + 60)  # 1000's closed socket drained, then nobody's took over
        assert api._drained() == [theirs] and theirs not in api.table.flows
    finally:
        lst.close()


def test_a_socket_path_the_agent_cannot_bind_is_a_config_error_before_the_takeover(tmp_path):
    """Checked in prepare(), before any device changes: before, the bind came after the take-over, so a directory it
    could not make ended the agent with a traceback (exit status 1: a supervisor restarted it, taking the devices
    over and back every few seconds), and a file at the socket's path was deleted."""
    from tensorlane.agent.daemon import check_socket_path

    afile = tmp_path / "not-a-socket"
    afile.write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(afile)}))
    assert afile.read_text() == "keep me"
    with pytest.raises(ConfigError, match="cannot make the directory"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(afile / "sub" / "agent.sock")}))
    check_socket_path(from_dict({"interface": "eth0", "socket": str(tmp_path / "new" / "agent.sock")}))
    old = socket.socket(socket.AF_UNIX)
    old.bind(str(tmp_path / "old.sock"))  # a previous agent's socket: replaced at bind, as before
    check_socket_path(from_dict({"interface": "eth0", "socket": str(tmp_path / "old.sock")}))
    old.close()


def test_a_socket_directory_another_user_could_write_is_refused(tmp_path):
    """A socket directory owned by another user (one made first in a world-writable place, ``/tmp/tensorlane``) or
    writable by others without the sticky bit: that user could unlink the agent's socket and bind its own, and every
    shim would register with it, their flows unmarked. Before, the agent bound its socket there and started; now the
    start is refused naming the field, and a socket removed while the agent runs is not bound again there."""
    from tensorlane.agent.daemon import check_socket_path
    from tensorlane.agent.server import socket_dir_problem

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)  # nobody made it first
    with pytest.raises(ConfigError, match="socket.*another user could replace.*owned by uid 65534"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(theirs / "agent.sock")}))
    assert not (theirs / "agent.sock").exists()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(shared / "agent.sock")}))
    with pytest.raises(ConfigError, match="owned by uid 65534"):  # a directory above it: renamed away by its owner
        check_socket_path(from_dict({"interface": "eth0", "socket": str(theirs / "sub" / "agent.sock")}))
    shared.chmod(0o1777)  # sticky, like /tmp: no one else may unlink the agent's socket
    check_socket_path(from_dict({"interface": "eth0", "socket": str(shared / "agent.sock")}))
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    link = shared / "tl"  # another user's link, in a sticky directory, to root's directory: it may replace the link
    link.symlink_to(ours)
    os.lchown(link, 65534, 65534)
    with pytest.raises(ConfigError, match="a symbolic link owned by uid 65534"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(link / "agent.sock")}))
    roots = tmp_path / "roots"  # root's link to that link: neither the path as written nor the resolved one has it
    roots.symlink_to(link)
    with pytest.raises(ConfigError, match="a symbolic link owned by uid 65534"):
        check_socket_path(from_dict({"interface": "eth0", "socket": str(roots / "agent.sock")}))
    assert socket_dir_problem(str(tmp_path)) == ""


def test_no_refusal_names_another_users_job_to_a_user():
    """``status`` names no other user's job to a user (neither root nor trusted), but refusals did: an unregister
    naming another user's 5-tuple (any user reads them all in /proc/net/tcp; an unregister needs no socket) was
    refused ``conflict: ... is registered by job 'secret-run'``, a register likewise, an unregister of a guessed id
    ``forbidden`` (a report ``ignored: only the user who registered ...``) only where that id was in use. Now the
    refusal says "another user's job", and a job the user holds no flow in is answered as one without flows."""
    api, _ = make_api(check_ownership=False, allowed_users=["nobody", "daemon"], trusted_users=["bin"],
                      job_policy="shortest")
    alice, bob, ops = Peer(1, 65534, 65534), Peer(2, 1, 1), Peer(3, 2, 2)  # (uid 2: bin)

    def ask(peer, **msg):
        return json.loads(api.handle(json.dumps(msg).encode(), peer))

    request(api, alice, op="register", job="secret-run", level=2, flows=[flow(1)])
    for msg in ({"op": "unregister", "job": "x", "flows": [flow(1)]}, {"op": "register", "job": "x", "level": 2,
                                                                       "flows": [flow(1)]}):
        reply = ask(bob, **msg)
        assert reply["error"]["code"] in ("forbidden", "conflict") and "secret" not in json.dumps(reply), reply
    assert ask(bob, op="unregister", job="secret-run")["result"]["removed"] == 0  # (as for an id not in use)
    report = {"op": "report", "session": "s", "step_bytes": 10,
              "levels": [{"level": 0, "allreduces": 1, "bytes": 10, "comm_s": 0.1}]}
    assert ask(bob, **report, job="secret-run")["result"]["step_bytes"] == \
        ask(bob, **report, job="no-such-run")["result"]["step_bytes"]
    assert set(api.table.flows) == {key(1)}
    for peer in (alice, ops, None):  # its own user, trusted users and root are told
        assert "secret-run" in ask(peer, op="register", job="x", level=2, flows=[flow(1)])["error"]["message"]
