"""bench.jobs: the mixes' design (scales, communication fractions, fits_link, collides), the targets and the
retransmission-timeout reading by hand, the report's jobs rows from a synthetic ``mixes`` file, and a quick smoke
run on the namespace testbed (collide2: each job alone, FIFO and the three policies) that checks the JSON's shape;
no timing assertions (the 2-core machine is noisy: docs/jobs-measured.md has the figures of a full run)."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
from agent_clients import require_netns_tools

from bench import report
from bench.jobs import (
    AGENT_POLICY,
    COMPUTE_FACTOR,
    DEFAULT_MIXES,
    DEFAULT_PHASES,
    HELD_S,
    JOB_MODE,
    JOB_SHIM,
    MIXES,
    OPT_IN_POLICIES,
    PHASES,
    RECOMMENDED,
    TCPI_TOTAL_RTO,
    TCPI_TOTAL_RTO_TIME,
    _registered,
    _solo_for,
    _training_argv,
    agent_extra,
    format_table,
    mix_agent,
    mix_setup,
    mix_specs,
    mix_targets,
    policy_block,
    run_phase,
    tcp_info_rto,
)

JOB_KEYS = {"job", "jct_s", "fifo_jct_s", "solo_jct_s", "rto"}


def test_mixes_design():
    """Every job of a fitting mix communicates 30-60 % of its predicted solo iteration; collide2's two different
    profiles share one period and start; the staggered mixes do not collide; stagger4 and oversub2 exceed the link."""
    setups = {m: mix_setup(m, mix_specs(m, "tj", 200e6, 12), 2.0, None) for m in MIXES}
    assert set(DEFAULT_MIXES) < set(MIXES)
    assert [m for m, s in setups.items() if s["collides"]] == ["collide2", "oversub2", "collide2e", "collide3",
                                                               "collide2x"]
    assert {m for m, s in setups.items() if not s["fits_link"]} == {"stagger4", "oversub2"}
    for m, s in setups.items():
        per_host = {str(h): sum(j["comm_s"] / j["solo_iter_s"] for j in s["jobs"] if h in j["hosts"])
                    for h in s["hosts"]}
        assert s["link_loads"] == pytest.approx(per_host) and s["link_load"] == pytest.approx(max(per_host.values()))
        assert s["recommended"] == RECOMMENDED[s["kind"]] and all(len(j["hosts"]) == 2 for j in s["jobs"])
        assert s["fits_link"] == (s["link_load"] <= 1.0) and s["epoch_s"] >= 0.5
        if m != "oversub2":
            assert all(0.3 <= round(j["comm_fraction"], 2) <= 0.6 for j in s["jobs"]), (m, s["jobs"])
    c = setups["collide2"]["jobs"]
    assert c[0]["profile"] != c[1]["profile"] and c[0]["solo_iter_s"] == pytest.approx(c[1]["solo_iter_s"], rel=0.02)
    assert c[0]["comm_fraction"] > c[1]["comm_fraction"] + 0.1 and c[1]["intensity"] > c[0]["intensity"]
    # collide2x: the same case with communication that cannot overlap (one bucket, reduced after backward): the
    # predicted solo iteration is the emulated compute plus all of the communication; collide2's hides most of it
    for j in setups["collide2x"]["jobs"]:
        assert j["bucket_mb"] is not None
        assert j["solo_iter_s"] == pytest.approx(j["compute_s"] * COMPUTE_FACTOR + j["comm_s"], rel=0.05), j
    for j in c:
        assert j["bucket_mb"] is None and j["solo_iter_s"] < 0.9 * (j["compute_s"] * COMPUTE_FACTOR + j["comm_s"])
    assert len({j["offset_s"] for j in setups["stagger3"]["jobs"]}) == 3
    # spread4: four jobs on a ring of four hosts, every host (and link) carrying two of them, within the link,
    # where stagger4's four jobs on one link exceed it; every other mix runs on hosts 1 and 2
    sp = setups["spread4"]
    assert sp["hosts"] == [1, 2, 3, 4] and sp["fits_link"] and len(sp["jobs"]) == 4
    assert all(sum(h in j["hosts"] for j in sp["jobs"]) == 2 for h in sp["hosts"])
    assert setups["stagger4"]["hosts"] == [1, 2] and sp["link_load"] < setups["stagger4"]["link_load"] - 0.3
    # apart4: spread4's jobs with no link shared (its CPU control): one job per host, the same jobs
    ap = setups["apart4"]
    assert ap["hosts"] == list(range(1, 9)) and all(sum(h in j["hosts"] for j in ap["jobs"]) == 1 for h in ap["hosts"])
    assert [j["design"] for j in ap["jobs"]] == [j["design"] for j in sp["jobs"]]
    o = setups["oversub2"]["jobs"]
    assert o[0]["comm_s"] == pytest.approx(o[0]["compute_s"], rel=0.01) and o[0]["param_scale"] == o[1]["param_scale"]
    extra = agent_extra("intensity", mix_specs("collide2", "tj", 200e6, 4), 2.4, None)
    assert extra == {"job_policy": "intensity", "job_intensity": {"tj-collide2-j0": c[0]["intensity"],
                                                                   "tj-collide2-j1": c[1]["intensity"]}}
    assert agent_extra("static", mix_specs("collide2", "tj", 200e6, 4), 2.4, {"min_share": 0.0})["job_priority"] == {
        "tj-collide2-j0": 0, "tj-collide2-j1": 1}
    assert agent_extra("rotate", [], 2.4, {"min_share": 0.02}) == {"job_policy": "rotate", "rotate_epoch_s": 2.4,
                                                                   "min_share": 0.02}
    # job_share only where there is a job order: the agent refuses it with job_policy = "none"
    assert agent_extra("fifo", [], 2.4, {"job_share": 0.5, "min_share": 0.02}) == {"job_policy": "none",
                                                                                  "min_share": 0.02}
    assert agent_extra("alternate", [], 2.4, {"job_share": 0.5})["job_share"] == 0.5
    assert agent_extra("fifo", [], 2.4, {"job_share_among": "present"}) == {"job_policy": "none"}
    # static_present, intensity_present (opt-in): the order with the parts of the jobs present; the phase's own
    # setting wins over the run's
    present = agent_extra("static_present", [], 2.4, {"job_share": 0.8, "job_share_among": "sending"})
    assert present == {"job_policy": "static", "job_priority": {}, "job_share": 0.8, "job_share_among": "present"}
    assert AGENT_POLICY["intensity_present"] == "intensity" and "job_share_among" not in agent_extra("static", [], 1)
    # static_held, intensity_held (opt-in): the order with a job counted as sending for HELD_S; the sampling fields
    # never reach an agent that does not sample (no job order, or the parts of the jobs present)
    sampled = {"job_share": 0.8, "job_sample_s": 0.02, "job_hold_s": 0.0}
    assert agent_extra("intensity_held", [], 2.4, sampled) == {"job_policy": "intensity", "job_intensity": {},
                                                               "job_share": 0.8, "job_sample_s": 0.02,
                                                               "job_hold_s": HELD_S}
    # the run's held_s is every held phase's hold (shortest_held: shortest's order, its jobs on the shim)
    assert agent_extra("shortest_held", [], 2.4, sampled, held_s=0.1)["job_hold_s"] == 0.1
    assert AGENT_POLICY["shortest_held"] == "shortest" and JOB_MODE["shortest_held"] == JOB_MODE["shortest"]
    assert agent_extra("static", [], 2.4, sampled)["job_hold_s"] == 0.0
    # static_auto, shortest_auto (opt-in): the order with job_share "auto", over the mix's recommended part
    assert agent_extra("static_auto", [], 2.4, {"job_share": 0.95})["job_share"] == "auto"
    assert AGENT_POLICY["shortest_auto"] == "shortest" and JOB_MODE["shortest_auto"] == JOB_MODE["shortest"]
    assert JOB_SHIM["shortest_auto"] == JOB_SHIM["shortest"]
    assert agent_extra("fifo", [], 2.4, sampled) == {"job_policy": "none"}
    # job_share 0 (a strict order): the agent refuses the parts' fields, so a held phase runs without them
    strict = agent_extra("static_held", [], 2.4, {**sampled, "job_share": 0})
    assert strict == {"job_policy": "static", "job_priority": {}, "job_share": 0}
    assert agent_extra("static_present", [], 2.4, sampled) == {"job_policy": "static", "job_priority": {},
                                                               "job_share": 0.8, "job_share_among": "present"}
    # static_levels (opt-in): static's table, the jobs on the shim
    both = agent_extra("static_levels", mix_specs("collide2", "tj", 200e6, 4), 2.4, {"job_share": 0.5})
    assert both == {"job_policy": "static", "job_priority": {"tj-collide2-j0": 0, "tj-collide2-j1": 1},
                    "job_share": 0.5}
    assert JOB_MODE["static_levels"] == "shim_overlap" and set(OPT_IN_POLICIES).isdisjoint(DEFAULT_PHASES)
    assert JOB_MODE["intensity_hook"] == JOB_MODE["shortest"] and AGENT_POLICY["intensity_hook"] == "intensity"
    assert set(PHASES) == set(DEFAULT_PHASES) | set(OPT_IN_POLICIES)


def test_mix_agent_gives_oversubscribed_mixes_large_parts():
    """docs/jobs.md recommends job_share 0.95 where the jobs oversubscribe the link; what the run passes wins."""
    assert mix_agent("oversubscribed", {}) == {"job_share": 0.95}
    assert mix_agent("oversubscribed", {"job_share": 0.3, "min_share": 0.02}) == {"job_share": 0.3, "min_share": 0.02}
    assert mix_agent("colliding", {}) == {} and mix_agent("staggered", {"ack_priority": False}) == {
        "ack_priority": False}


def test_a_designed_bucket_reaches_the_worker():
    """A job whose design names a DDP bucket (MB of the full-size model) runs with ``--bucket-cap-mb`` of the
    emulated model (divided by its param_scale); a job without one keeps the worker's default."""
    host = SimpleNamespace(ip="198.18.0.1", ifname="eth0", name="h1")
    tb = SimpleNamespace(host=lambda i: host, rate_bps=100e6)
    x, plain = mix_specs("collide2x", "tj", 100e6, 4)[0], mix_specs("collide2", "tj", 100e6, 4)[0]
    argv = _training_argv(tb, {**x, "port": 29700}, 0, 1, "out.json", None, 60)
    assert float(argv[argv.index("--bucket-cap-mb") + 1]) == pytest.approx(x["bucket_mb"] / x["param_scale"], rel=1e-5)
    assert "--bucket-cap-mb" not in _training_argv(tb, {**plain, "port": 29700}, 0, 1, "out.json", None, 60)


def test_a_shim_job_registers_under_the_jobs_own_id():
    """With the shim, a worker registers its flows under the job's id (``--shim-job``), the id a job order's table
    names; without it the worker would append its mode (``tj-collide2-j0-shim_overlap``), outside every table."""
    host = SimpleNamespace(ip="198.18.0.1", ifname="eth0", name="h1")
    tb = SimpleNamespace(host=lambda i: host, rate_bps=100e6)
    spec = {**mix_specs("collide2", "tj", 100e6, 4)[0], "port": 29700}
    for mode, shim in (("shim_overlap", {"levels": 4}), ("shim", JOB_SHIM["shortest"])):
        argv = _training_argv(tb, {**spec, "mode": mode, **shim}, 0, 1, "out.json", None, 60)
        assert argv[argv.index("--shim-job") + 1] == spec["id"] == "tj-collide2-j0"
        assert argv[argv.index("--levels") + 1] == str(shim["levels"])
        assert argv[argv.index("--policy") + 1] == "layer_order" if mode == "shim" else "--policy" not in argv
    assert "--shim-job" not in _training_argv(tb, spec, 0, 1, "out.json", None, 60)
    # shortest: one level, no partition (layer_order, not the planner): plain DDP's all-reduces, one per bucket
    assert JOB_MODE["shortest"] == "shim" and AGENT_POLICY["shortest"] == "shortest"
    assert JOB_SHIM["shortest"] == JOB_SHIM["intensity_hook"] == {"levels": 1, "shim_policy": "layer_order"}


def test_a_job_rendezvous_at_its_first_host():
    """A spread4 job on hosts 2 and 3 meets at host 2 (its rank 0), whichever host the rank runs on."""
    hosts = {i: SimpleNamespace(ip=f"198.18.0.{i}", ifname="eth0", name=f"h{i}") for i in range(1, 5)}
    tb = SimpleNamespace(host=hosts.__getitem__, rate_bps=50e6)
    j1 = mix_specs("spread4", "tj", 50e6, 4)[1]
    assert j1["hosts"] == (2, 3)
    for rank, index in enumerate(j1["hosts"]):
        argv = _training_argv(tb, {**j1, "port": 29701}, rank, index, "out.json", None, 60)
        assert argv[argv.index("--master") + 1] == "198.18.0.2:29701"


def test_release_waits_for_the_default_groups_barrier(monkeypatch, tmp_path):
    """A job is released at its barrier before the timed iterations (the default group's), after its set-up: the
    shim's barriers on its level groups, during ``attach``, pass through. (Until 2026-11-24 the first barrier of any
    group released the job, so that a shim job's set-up and warm-up ran after the release.)"""
    import torch.distributed as dist

    import bench.jobs
    import bench.worker

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: calls.append(("barrier", kw.get("group"))))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: None)
    monkeypatch.setattr(bench.jobs, "_wait_for_go", lambda ready, go, timeout: calls.append(("go", None)))

    def training_main(argv):
        dist.barrier(group="level-0")  # the shim's, in attach
        dist.barrier(group="level-1")
        calls.append(("warm-up", None))
        dist.barrier()  # the timed iterations' barrier
        dist.barrier()
        return 0

    monkeypatch.setattr(bench.worker, "training_main", training_main)
    monkeypatch.setattr(bench.worker, "write_result", bench.worker.write_result)  # worker() wraps it: undone below
    try:
        assert bench.jobs.worker(["--ready", str(tmp_path / "r"), "--go", str(tmp_path / "g"), "--",
                                  "--master", "198.18.0.1:29700"]) == 0
    finally:
        monkeypatch.undo()
    assert calls == [("barrier", "level-0"), ("barrier", "level-1"), ("warm-up", None), ("barrier", None),
                     ("go", None), ("barrier", None)]


def test_solo_phases_run_each_job_alone(monkeypatch, tmp_path):
    """Both solo phases (plain DDP and with the shim) release one job after the other, each alone; every other
    phase releases the jobs together. (Until 2026-11-23 ``solo_shim`` ran a mix's jobs at once.)"""
    import bench.agents
    import bench.jobs

    seen, ran, warmups = {}, {}, {}

    @contextlib.contextmanager
    def agents(tb, **kw):
        yield {i: SimpleNamespace(socket=f"/run/a{i}", status=lambda: {"job_policy": {}}, cpu_s=lambda: 0.5)
               for i in kw["hosts"]}

    def run_jobs(tb, specs, sockets, workdir, tag, timeout, sequential=False):
        seen[tag] = sequential
        ran[tag] = {(s["mode"], s["levels"], s.get("shim_policy")) for s in specs}
        warmups[tag] = {s["warmup"] for s in specs}
        return {s["id"]: {"start": 0.0, "results": []} for s in specs}

    monkeypatch.setattr(bench.agents, "running_agents", agents)
    monkeypatch.setattr(bench.jobs, "run_jobs", run_jobs)
    monkeypatch.setattr(bench.jobs, "tcp_counters", lambda host: {})
    monkeypatch.setattr(bench.jobs, "job_figures", lambda run: {"registered": True})
    tb = SimpleNamespace(host=lambda i: f"h{i}")
    specs = mix_specs("stagger2", "tj", 50e6, 4)
    for phase in PHASES:
        run_phase(tb, phase, specs, phase, str(tmp_path), 4, 3.0)
    assert seen == {p: p in ("solo", "solo_shim") for p in PHASES}
    # what every job of a phase runs: plain DDP, the shim's overlap on the run's levels, or shortest's hook mode
    assert ran["fifo"] == {("ddp", 4, None)} and ran["levels"] == ran["solo_shim"] == {("shim_overlap", 4, None)}
    assert ran["shortest"] == ran["measured_intensity"] == {("shim", 1, "layer_order")}
    # measured_intensity's jobs warm up until their ranks' first agreement on a step's compute time is in
    assert warmups["measured_intensity"] == {4} and warmups["shortest"] == {1}


def test_tcp_info_rto():
    info = bytearray(256)
    info[TCPI_TOTAL_RTO:TCPI_TOTAL_RTO + 2] = (7).to_bytes(2, "little")
    info[TCPI_TOTAL_RTO_TIME:TCPI_TOTAL_RTO_TIME + 4] = (1234).to_bytes(4, "little")
    assert tcp_info_rto(bytes(info)) == (7, 1234)
    assert tcp_info_rto(bytes(info[:241])) == (None, None)        # an older kernel's shorter struct
    assert tcp_info_rto(bytes(info[:242])) == (7, None)


def _phase(jcts, rto=0):
    return {"jobs": [{"jct_s": j, "end_s": j + 1, "median_iter_s": j / 10, "rto": rto, "rto_time_ms": 0,
                      "rto_sockets": 2} for j in jcts], "tcp": {"TCPTimeouts": 0}, "order_changes": 1}


def _mix(fits: bool, collides: bool, jcts: dict, solo=(8.0, 9.0)) -> dict:
    ids = ["a", "b"]
    fifo = jcts["fifo"]
    pols = {p: policy_block(ids, [_phase(v)], fifo, list(solo)) for p, v in jcts.items()}
    return {"fits_link": fits, "collides": collides, "recommended": "static", "policies": pols}


def test_targets_by_hand():
    """Fitting and colliding: static within 1.02 x FIFO and 1.15 x solo per job, 0.8 x FIFO on average."""
    m = _mix(True, True, {"fifo": [10.0, 10.0], "static": [8.5, 7.5], "rotate": [11.0, 9.0]})
    t = {x["name"]: x for x in mix_targets(m)}
    assert set(t) == {"fits_vs_fifo", "fits_vs_solo", "collide_avg_vs_fifo"}
    assert t["fits_vs_fifo"]["value"] == pytest.approx(0.85) and t["fits_vs_fifo"]["met"]
    assert t["fits_vs_solo"]["value"] == pytest.approx(8.5 / 8) and t["fits_vs_solo"]["met"]
    assert t["collide_avg_vs_fifo"]["value"] == pytest.approx(0.8) and t["collide_avg_vs_fifo"]["met"]
    b = m["policies"]["rotate"]
    assert b["jobs"][0]["vs_fifo"] == pytest.approx(1.1) and b["max_vs_fifo"] == pytest.approx(1.1)
    assert set(b["jobs"][0]) >= JOB_KEYS and m["policies"]["fifo"]["jobs"][1]["vs_fifo"] == 1.0
    # staggered, fitting: one job 3 % worse than FIFO misses; no colliding target
    t = mix_targets(_mix(True, False, {"fifo": [10.0, 10.0], "static": [10.3, 9.0]}, solo=(9.5, 9.0)))
    assert [(x["name"], x["met"]) for x in t] == [("fits_vs_fifo", False), ("fits_vs_solo", True)]
    # oversubscribed (colliding or not): only "no job above 1.05 x FIFO under any policy"
    t = mix_targets(_mix(False, True, {"fifo": [10.0, 10.0], "static": [7.0, 10.4], "rotate": [10.6, 9.0]}))
    assert [(x["name"], x["met"]) for x in t] == [("oversub_vs_fifo", False)]
    assert t[0]["value"] == pytest.approx(1.06)
    # FIFO's A/A control is no policy: its spread is shown, not judged
    t = mix_targets(_mix(False, True, {"fifo": [10.0, 10.0], "fifo_control": [10.9, 9.5], "static": [7.0, 10.4]}))
    assert t[0]["value"] == pytest.approx(1.04) and t[0]["met"]
    # no FIFO or solo measured: nothing to judge
    m = {"fits_link": True, "collides": True, "recommended": "static",
         "policies": {"static": policy_block(["a", "b"], [_phase([1.0, 1.0])], None, None)}}
    assert [x["met"] for x in mix_targets(m)] == [None, None, None]


def test_shim_jobs_are_judged_against_the_faster_solo():
    """The ``levels`` phase runs every job with the shim: its solo JCT is the smaller of the job alone with plain
    DDP and alone with the shim; the plain-DDP policies keep plain DDP's. A shim rank counts as registered only
    when its agent link registered and never failed."""
    solo = {"jobs": [{"jct_s": 10.0}, {"jct_s": 20.0}]}
    shim = {"jobs": [{"jct_s": 9.0}, {"jct_s": 21.0}]}
    assert _solo_for("levels", solo, shim) == [9.0, 20.0]
    assert _solo_for("static", solo, shim) == [10.0, 20.0] and _solo_for("levels", solo, None) == [10.0, 20.0]
    assert _solo_for("levels", None, shim) == [9.0, 21.0] and _solo_for("fifo", None, shim) is None
    assert _solo_for("static_levels", solo, shim) == [9.0, 20.0]
    assert JOB_MODE["levels"] == JOB_MODE["solo_shim"] == "shim_overlap" and "fifo" not in JOB_MODE

    def shim_result(**agent):
        return {"modes": {"shim_overlap": {"shim_stats": {"agent": agent}}}}

    assert _registered(shim_result(registrations=4, failures=0, refusals=0), "shim_overlap")
    assert not _registered(shim_result(registrations=4, failures=1, refusals=0), "shim_overlap")
    assert not _registered(shim_result(connected=False), "shim_overlap")
    assert _registered({"ddp_registered": True}, "ddp") and not _registered({}, "ddp")


def test_report_rows_from_mixes():
    """bench.report's jobs rows: the colliding mix's average first (the README's headline), per fitting mix its
    largest per-job ratios, per oversubscribed mix the largest ratio over every policy."""
    mixes = [dict(_mix(True, True, {"fifo": [10.0, 10.0], "static": [7.0, 8.0], "rotate": [9.0, 9.0],
                                     "intensity": [8.0, 9.0]}), name="collide2"),
             dict(_mix(False, True, {"fifo": [20.0, 20.0], "static": [15.0, 21.5]}), name="oversub2")]
    for m in mixes:
        m["targets"] = mix_targets(m)
    d = {"mixes": mixes, "recommended": "static", "iters": 12, "reps": 1, "min_share": 0.01, "hosts": 2,
         "rate": "200mbit"}
    rows = report.rows_jobs(d)
    head = rows[0]
    assert head.figure.startswith("colliding mix (collide2): average JCT, static vs FIFO")
    assert (head.ours, head.ratio, head.target, head.result) == ("7.50 s", "0.75", "<= 0.80", "met")
    figures = {r.figure: r for r in rows}
    r = figures["collide2: largest per-job JCT, static vs FIFO"]
    assert r.ratio == "0.80" and r.result == "met"
    r = figures["oversub2 (oversubscribed): largest per-job JCT vs FIFO, any policy"]
    assert r.ratio == "1.07" and r.result == "**missed** by 0.02" and r.alternatives.startswith("static, job 1:")
    r = figures["oversub2 (oversubscribed): average JCT, static vs FIFO"]
    assert r.ratio == "0.91" and r.target == "none (informational)"
    # "any policy" is every phase in the file: the bench's own target counts them all, the report must too
    mixes[1]["policies"]["measured_intensity"] = {"jobs": [{"jct_s": 20.0, "fifo_jct_s": 20.0},
                                                           {"jct_s": 23.0, "fifo_jct_s": 20.0}]}
    mixes[1]["policies"]["a_future_phase"] = {"jobs": [{"jct_s": 24.0, "fifo_jct_s": 20.0}]}
    r = {r.figure: r for r in report.rows_jobs(d)}["oversub2 (oversubscribed): largest per-job JCT vs FIFO, any policy"]
    assert r.ratio == "1.20" and r.alternatives.startswith("a_future_phase, job 0:")
    del mixes[1]["policies"]["a_future_phase"]
    r = {r.figure: r for r in report.rows_jobs(d)}["oversub2 (oversubscribed): largest per-job JCT vs FIFO, any policy"]
    assert r.ratio == "1.15" and r.alternatives.startswith("measured_intensity, job 1:")
    assert "min_share 0.01" in report.describe_setup("jobs", d)
    assert report.describe_setup("jobs", d).startswith("2 hosts at 200 Mbit/s")   # mixes without hosts: 2 each
    mixes.append({"name": "spread4", "hosts": [1, 2, 3, 4]})
    assert report.describe_setup("jobs", dict(d, hosts=4)).startswith("2 hosts (4: spread4) at 200 Mbit/s")
    assert report.rows_jobs({"mixes": []})[0].figure == "no mix in the file"


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_jobs_quick_smoke():
    require_netns_tools()
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.jobs import run

    lines = []
    # the default phases but rotate, alternate, intensity and shortest, which differ from static or
    # measured_intensity only in the agents' policy (their orders: the unit tests above; rotate moving flows in the
    # kernel's map: tests/test_jobs_agent.py; intensity's table and shortest's step bytes: measured_intensity's
    # order and reports are checked against them below), solo_shim (the bench's second solo baseline) and levels
    # (the shim's levels without a job policy: the phases' specs are checked above): 4 phases and about 90 s less
    # (make test stays within its 20 minutes)
    phases = tuple(p for p in DEFAULT_PHASES
                   if p not in ("rotate", "alternate", "intensity", "shortest", "solo_shim", "levels"))
    result = run(quick=True, name="tj2", progress=lines.append, port_base=29950, policies=phases)
    assert result["quick"] and result["iters"] == 4 and result["elapsed_s"] > 0 and result["machine"]["cpus"]
    assert result["min_share"] == 0.01 and result["min_share_passed"] is False
    assert result["job_share"] == 0.2 and result["job_share_passed"] is False
    assert [m["name"] for m in result["mixes"]] == ["collide2"]
    mix = result["mixes"][0]
    assert mix["fits_link"] is True and mix["collides"] is True and mix["recommended"] == "static"
    assert set(mix["policies"]) == set(phases) - {"solo"} and result["policies"] == list(phases)
    ids = [j["job"] for j in mix["jobs"]]
    assert ids == ["tj2-collide2-j0", "tj2-collide2-j1"]
    solo = [j["jct_s"] for j in mix["solo"]["jobs"]]
    assert mix["solo_shim"] is None
    fifo = [j["jct_s"] for j in mix["policies"]["fifo"]["jobs"]]
    for name, block in mix["policies"].items():
        assert [j["job"] for j in block["jobs"]] == ids
        for j, f, s in zip(block["jobs"], fifo, solo, strict=True):  # (no solo_shim: shim phases judged on solo)
            assert set(j) >= JOB_KEYS, (name, j)
            assert isinstance(j["jct_s"], float) and math.isfinite(j["jct_s"]) and j["jct_s"] > 0, (name, j)
            assert j["fifo_jct_s"] == f and j["solo_jct_s"] == s
            assert j["vs_fifo"] == pytest.approx(j["jct_s"] / f) and j["vs_solo"] == pytest.approx(j["jct_s"] / s)
            # this kernel (6.18) reports tcpi_total_rto: an integer, read from each rank's connection(s)
            assert isinstance(j["rto"], int) and j["rto"] >= 0 and j["rto_sockets"] >= 2, (name, j)
            assert j["end_s"] >= j["jct_s"] * 0.99   # the end of the process comes after the last iteration
            # the ranks' threads on a CPU and in its run queue over the timed span (this kernel has schedstat)
            assert 0 < j["cpu_s"] < 2 * j["jct_s"] and j["cpu_wait_s"] >= 0, (name, j)
        assert block["tcp"][0].keys() == {"RetransSegs", "TCPTimeouts", "TCPSACKReorder", "TCPDSACKRecv",
                                          "TCPDSACKUndo"}
    assert mix["policies"]["fifo"]["order_changes"] == [0]
    assert mix["policies"]["static"]["share_changes"] == [0]  # two jobs: their parts are not sampled
    assert all(0 < c < 60 for b in mix["policies"].values() for c in b["agent_cpu_s"])  # the agents' CPU seconds
    assert all(mix["policies"][p]["order_changes"][0] >= 1
               for p in ("static", "measured_intensity"))
    # measured_intensity: the jobs' agreed compute times and step bytes give the order of intensity's table (each
    # job's designed compute / communication, the intensity phase's job_intensity), with no table
    # (the step bytes the shims reported, which shortest orders by, are the gradients' bytes exactly)
    seen = mix["policies"]["measured_intensity"]["orders"][0]
    assert seen["step_bytes"] == {j["job"]: j["gradient_bytes"] for j in mix["jobs"]}, seen
    assert set(seen["compute_s"]) == set(ids) and all(v > 0 for v in seen["compute_s"].values()), seen
    assert seen["order"] == sorted(ids, key=lambda j: -next(x["intensity"] for x in mix["jobs"] if x["job"] == j))
    assert mix["policies"]["static"]["orders"][0]["order"] == ids and mix["policies"]["fifo"]["orders"] == [None]
    assert {t["name"] for t in mix["targets"]} == {"fits_vs_fifo", "fits_vs_solo", "collide_avg_vs_fifo"}
    assert all(isinstance(t["met"], bool) for t in mix["targets"]) and result["pass"] == {"collide2": mix["pass"]}
    table = format_table(result)
    assert "fifo" in table and "intensity" in table and "solo" in table and lines


@pytest.mark.netns
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_jobs_spread4_on_four_hosts():
    """spread4 on a real 4-host testbed (quick: 3 iterations, half periods): every job's two ranks meet at its first
    host and register with the agents of its own two hosts (run_phase refuses a phase with unregistered flows). One
    phase, static (its agents order the jobs they see): solo (its four jobs one after the other, 30 s here) and
    fifo (the same ranks and registrations without an order, 17 s) are the smoke test's above, on two hosts."""
    require_netns_tools()
    import torch  # noqa: F401  (required: a missing torch fails the test)

    from bench.jobs import run

    result = run(mixes=("spread4",), quick=True, iters=3, name="tj4", policies=("static",),
                 progress=None, port_base=29980)
    assert result["hosts"] == 4 and [m["name"] for m in result["mixes"]] == ["spread4"]
    mix = result["mixes"][0]
    assert mix["hosts"] == [1, 2, 3, 4] and set(mix["link_loads"]) == {"1", "2", "3", "4"} and mix["fits_link"]
    assert [tuple(j["hosts"]) for j in mix["jobs"]] == [(1, 2), (2, 3), (3, 4), (4, 1)]
    assert set(mix["policies"]) == {"static"} and mix["solo"] is None
    for block in mix["policies"].values():
        assert all(math.isfinite(j["jct_s"]) and j["jct_s"] > 0 for j in block["jobs"]), block
    assert mix["policies"]["static"]["order_changes"][0] >= 1   # host 1's agent saw its jobs arrive in order


def _commands_naming(word: str) -> list[str]:
    """The command lines of running processes that contain ``word``."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if word in cmd and "pytest" not in cmd:
                found.append(cmd)
    return found


@pytest.mark.netns
@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", [("bench", "jobs"), ("bench.jobs",)], ids=["bench-jobs", "bench.jobs"])
def test_sigterm_mid_run_removes_the_testbed_agents_and_workers(command):
    """``python -m bench jobs`` (and the module itself, ``python -m bench.jobs``, which is also its workers' entry)
    stopped by SIGTERM (``kill``, ``timeout``) in the middle of a phase exits 143 after its clean-up: no namespace,
    agent, worker or scratch directory of its testbed is left (before, all were; for the module, until
    2026-11-25)."""
    import glob
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from bench.workers import REPO_ROOT, repo_env
    from testbed import down_by_name

    require_netns_tools()
    scratch = os.path.join(tempfile.gettempdir(), "tensorlane-jobs-*")
    kept = set(glob.glob(scratch))
    cmd = [sys.executable, "-m", *command, "--quick", "--name", "tjt", "--policies", "fifo"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not _commands_naming("tjt-collide2-j1"):  # the phase's last workers started: mid-phase
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
            time.sleep(0.1)
        assert _commands_naming("tjt-h1.toml"), "no agent of the testbed runs"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, (out[-2000:], err[-2000:])
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert "tjt-" not in netns, netns
        assert not _commands_naming("tjt-"), _commands_naming("tjt-")
        assert set(glob.glob(scratch)) <= kept, set(glob.glob(scratch)) - kept  # its scratch directory too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        down_by_name("tjt")
