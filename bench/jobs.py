"""Jobs sharing hosts: job completion time under FIFO, static job priority and rotation (TensorLights), with the
agent's job policy (agent/jobs.py, docs/jobs.md).

On one namespace testbed (2 hosts at 200 Mbit/s by default), N training jobs start together: each is plain DDP
(``bench.worker training --mode ddp``, gloo) over an emulated model, one rank per host, a fixed number of
iterations, its flows registered with the host's agent at level 0 under its own job id. Three phases, one after
another on the same testbed, each with fresh agents:

``fifo``    agents with ``job_policy = "none"``: every job's flows at level 0, one queue, FIFO between jobs;
``static``  ``job_policy = "static"``, ``job_priority`` job 0 first, then job 1, ... (TensorLights TLsOne);
``rotate``  ``job_policy = "rotate"``, a new job order every ``epoch_s`` of wall-clock time (TLsRR).

A job's completion time (JCT) is from the common start to the end of its slowest rank's last iteration: every
rank first sets up (imports, rendezvous, DDP's construction -- seconds on this machine -- and the registration of
its flows), then waits at a barrier of files across all jobs; all are released at one instant into their timed
iterations (``worker`` below), and the JCT is the slowest rank's ``spans_s`` (from that instant to the end of its
last iteration). Per job count the result holds
``fifo_avg_s``, ``static_avg_s``, ``rotate_avg_s``, ``*_worst_s``, per-job lists ``*_jct_s`` (job 0 first),
``rotate_vs_fifo_avg``, ``rotate_worst_vs_fifo_worst`` and ``pass``.

Target (the issue's): rotation's average JCT <= 0.75 x FIFO's, and no job worse than under FIFO. "No job worse"
is checked two ways and both are reported: per job (each job's rotate JCT <= the same job's FIFO JCT;
``pass.rotate_no_job_worse``, part of ``pass.all``) and worst case (``pass.rotate_worst_not_worse``).

Scale: each job's model is ``bench.models.balanced_scales(profile, rate, 2, comm_s)`` (all gradients' all-reduce
~``comm_s`` on the link alone), compute scaled to ``compute_ratio`` x that: communication-heavy, so that jobs
contend for the link. Rotation epoch: default 3 s, two or three iterations of a job (about 1.2-1.4 s each alone
here), so that a job run (12 iterations: 17-50 s) sees 6-18 epochs; TensorLights rotates every 20 s, on jobs that
run for hours. The quick mode (the smoke test) uses 4 iterations of a smaller model and 1 s epochs.

Usage: ``python -m bench.jobs --json out.json [--quick]`` (root: it builds network namespaces), or
``run(quick=True)`` from Python. The workers are ``python -m bench.jobs worker --ready F --go F -- TRAINING-ARGS``
(``bench.worker``'s ``training`` with a barrier across jobs before the timed iterations).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time

from bench.workers import (
    REPO_ROOT,
    ScenarioError,
    cli,
    needs_root,
    progress_printer,
    ratio,
    reap_workers,
    scratch_dir,
    show_figures,
    tail,
    text_table,
    wait_worker,
    worker_env,
)

PHASES = ("fifo", "static", "rotate")
OPTIONAL_PHASES = ("alone",)  # job 0 alone (agents, policy none): the JCT no sharing can beat
POLICY = {"fifo": "none", "static": "static", "rotate": "rotate", "alone": "none"}
TARGET_ROTATE_VS_FIFO_AVG = 0.75
DEFAULT_EPOCH_S = 3.0
QUICK_EPOCH_S = 1.0
DEFAULT_ITERS = 12
QUICK_ITERS = 4
START_DELAY_S = 0.5


# ---- the worker: set-up first, then a common start ------------------------------------------------------------

def _wait_for_go(ready: str, go: str, timeout: float) -> None:
    """Create ``ready``, wait (bounded) for ``go`` (it holds a wall-clock start time) and sleep until then."""
    with open(ready, "w") as fh:
        fh.write(repr(time.time()))
    deadline = time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {go} within {timeout:g} s")
        time.sleep(0.01)
    with open(go) as fh:
        start = float(fh.read())
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)


def worker(argv: list[str]) -> int:
    """``worker --ready FILE --go FILE [--timeout S] -- TRAINING-ARGS``: run
    ``bench.worker.training_main(TRAINING-ARGS)`` with one change: the job's first ``dist.barrier()`` (the one
    before its timed iterations, after rendezvous, DDP's set-up and the registration of its flows) is followed by a
    barrier across *all* jobs: create ``--ready``, wait (bounded) for ``--go`` and sleep until the start time written
    in it. Set-up (seconds for DDP on this machine) is then outside every job's completion time, and all jobs start
    their iterations at one instant."""
    p = argparse.ArgumentParser(prog="python -m bench.jobs worker")
    p.add_argument("--ready", required=True)
    p.add_argument("--go", required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("training", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rest = args.training[1:] if args.training[:1] == ["--"] else args.training
    import torch.distributed as dist

    from bench.worker import training_main

    real_barrier = dist.barrier
    first = [True]

    def barrier(*a, **kw):
        out = real_barrier(*a, **kw)
        if first[0]:
            first[0] = False
            _wait_for_go(args.ready, args.go, args.timeout)
        return out

    dist.barrier = barrier
    return training_main(rest)


# ---- one phase: N jobs at once -----------------------------------------------------------------------------------

def job_ids(n: int, name: str) -> list[str]:
    """The job ids of ``n`` jobs: ``NAME-j0`` ... (job 0 has the highest static priority)."""
    return [f"{name}-j{i}" for i in range(n)]


def _training_argv(tb, job: dict, rank: int, index: int, json_path: str, sockets, timeout: float) -> list[str]:
    """``bench.worker training`` arguments of ``job``'s rank ``rank`` on testbed host ``index`` (plain DDP, gloo,
    its flows registered at level 0 with the host's agent when ``sockets`` has one)."""
    host = tb.host(index)
    argv = ["--rank", str(rank), "--world", "2", "--master", f"{tb.host(1).ip}:{job['port']}",
            "--profile", job["profile"], "--mode", "ddp", "--iters", str(job["iters"]),
            "--warmup", str(job["warmup"]), "--param-scale", f"{job['param_scale']:g}",
            "--compute-scale", f"{job['compute_scale']:g}", "--job", job["id"],
            "--ifname", host.ifname, "--link-rate", str(int(tb.rate_bps)),
            "--json", json_path, "--timeout", str(int(timeout))]
    if sockets and index in sockets:
        argv += ["--agent-socket", sockets[index], "--ddp-level", "0"]
    return argv


def _start_ranks(tb, jobs: list[dict], sockets, workdir: str, tag: str, go: str, timeout: float,
                 ready_timeout: float, procs: list) -> None:
    """Start both ranks of every job (hosts 1 and 2) as ``worker`` processes; append to ``procs`` one
    ``(job id, rank, host, json path, ready path, log, proc)`` per rank, as each starts."""
    for job in jobs:
        for rank, index in enumerate((1, 2)):
            host = tb.host(index)
            base = os.path.join(workdir, f"{tag}-{job['id']}-r{rank}")
            argv = [sys.executable, "-m", "bench.jobs", "worker", "--ready", base + ".ready", "--go", go,
                    "--timeout", str(int(ready_timeout + 30)), "--",
                    *_training_argv(tb, job, rank, index, base + ".json", sockets, timeout)]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base + ".ready")
            log = open(base + ".log", "wb")  # noqa: SIM115 (closed by run_jobs)
            procs.append((job["id"], rank, host, base + ".json", base + ".ready", log,
                          host.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=worker_env(), cwd=REPO_ROOT)))


def _await_ready(procs: list, tag: str, ready_timeout: float) -> None:
    """Wait (bounded) until every worker has created its ready file; ScenarioError if one exits first."""
    deadline = time.monotonic() + ready_timeout
    while not all(os.path.exists(p[4]) for p in procs):
        for jid, rank, host, _, _, log, proc in procs:
            if proc.poll() is not None:
                raise ScenarioError(f"{tag}: {jid} rank {rank} on {host.name} exited {proc.returncode} before "
                                    "the common start (worker() holds each job at its first dist.barrier(), "
                                    f"the one bench.worker training calls before its timed iterations); log:\n"
                                    f"{tail(log.name)}")
        if time.monotonic() > deadline:
            raise ScenarioError(f"{tag}: workers not ready after {ready_timeout:g} s (set-up)")
        time.sleep(0.05)


def _release(go: str) -> float:
    """Write the common start (``START_DELAY_S`` from now, wall clock) into ``go`` atomically; return it."""
    start = time.time() + START_DELAY_S
    tmp = go + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(repr(start))
    os.replace(tmp, go)
    return start


def run_jobs(tb, jobs: list[dict], sockets: dict[int, str] | None, workdir: str, tag: str, timeout: float,
             ready_timeout: float = 240.0) -> dict:
    """Start every rank of every job in ``jobs`` (dicts: id, profile, param_scale, compute_scale, iters, warmup,
    port), release them at one instant, wait for all (bounded) and return ``{start, jct_s: {id: s}, results}``.

    Raises ScenarioError with the failing worker's log; every worker still running is killed on the way out.
    """
    import json

    go = os.path.join(workdir, f"{tag}.go")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(go)
    procs: list = []  # (job id, rank, host, json path, ready path, log, proc)
    try:
        _start_ranks(tb, jobs, sockets, workdir, tag, go, timeout, ready_timeout, procs)
        _await_ready(procs, tag, ready_timeout)
        start = _release(go)
        deadline = time.monotonic() + START_DELAY_S + timeout
        for jid, rank, host, _, _, log, proc in procs:
            wait_worker(proc, deadline, timeout, f"{tag}: {jid} rank {rank} on {host.name}", log.name)
        results: dict[str, list[dict]] = {}
        for jid, _, _, out, _, _, _ in procs:
            with open(out) as fh:
                results.setdefault(jid, []).append(json.load(fh))
        # every rank was released at ``start`` into its timed iterations: the job ends with its slowest rank
        jct = {jid: max(r["modes"]["ddp"]["spans_s"][0] for r in rs) for jid, rs in results.items()}
        end = {jid: max(r["end_time"] for r in rs) - start for jid, rs in results.items()}
        return {"start": start, "jct_s": jct, "end_s": end, "results": results}
    finally:
        reap_workers((log, proc) for *_, log, proc in procs)


def tcp_counters(host) -> dict[str, int]:
    """The host namespace's TCP retransmitted segments and retransmission timeouts (kernel counters)."""
    out = {}
    for path, table, names in (("/proc/net/snmp", "Tcp:", ("RetransSegs",)),
                               ("/proc/net/netstat", "TcpExt:", ("TCPTimeouts",))):
        lines = [ln.split() for ln in host.run(["cat", path]).stdout.splitlines() if ln.startswith(table)]
        if len(lines) >= 2:
            row = dict(zip(lines[0][1:], lines[1][1:], strict=False))
            out.update({n: int(row[n]) for n in names if n in row})
    return out


def run_phase(tb, phase: str, specs: list[dict], tag: str, workdir: str, levels: int, epoch_s: float) -> dict:
    """One phase: fresh agents with the phase's job policy on both hosts, the jobs of ``specs`` (only the first
    for ``alone``) started together; returns per-job lists (``specs`` order) ``jct_s``, ``end_s``,
    ``median_iter_s``, the hosts' TCP counters over the phase (``tcp``) and the agent's ``order_changes``."""
    from bench.agents import running_agents

    specs = specs[:1] if phase == "alone" else specs
    ids = [s["id"] for s in specs]
    extra: dict = {"job_policy": POLICY[phase]}
    if phase == "static":
        extra["job_priority"] = {jid: i for i, jid in enumerate(ids)}
    if phase == "rotate":
        extra["rotate_epoch_s"] = epoch_s
    adir = os.path.join(workdir, f"agents-{tag}")
    timeout = 120 + 6 * len(specs) * max(s["iters"] * max(s["comm_s"], s["compute_s"]) for s in specs)
    tcp0 = [tcp_counters(h) for h in tb.hosts]
    with running_agents(tb, levels=levels, workdir=adir, config_extra=extra) as agents:
        r = run_jobs(tb, specs, {i: a.socket for i, a in agents.items()}, workdir, tag, timeout)
        status = agents[1].status()
    tcp1 = [tcp_counters(h) for h in tb.hosts]
    unregistered = [f"{jid} rank {x['rank']}" for jid in ids for x in r["results"][jid] if not x.get("ddp_registered")]
    if unregistered:
        raise ScenarioError(f"{tag}: flows not registered with the agents: {', '.join(unregistered)}")
    return {"jct_s": [r["jct_s"][j] for j in ids], "end_s": [r["end_s"][j] for j in ids],
            "median_iter_s": [max(x["modes"]["ddp"]["median_s"] for x in r["results"][j]) for j in ids],
            "tcp": {k: sum(b.get(k, 0) - a.get(k, 0) for a, b in zip(tcp0, tcp1, strict=True)) for k in tcp1[0]},
            "order_changes": status["job_policy"].get("changes")}


def passes(fig: dict) -> dict:
    """The targets of one job count: rotation's average <= 0.75 x FIFO's; no job worse than FIFO, per job (each
    job's rotate JCT <= its own FIFO JCT) and worst case (the worst rotate JCT <= the worst FIFO JCT); ``all`` is
    the average and the per-job check. None where a figure is missing."""
    f, r = fig.get("fifo_jct_s"), fig.get("rotate_jct_s")
    if not f or not r:
        return {"rotate_avg": None, "rotate_no_job_worse": None, "rotate_worst_not_worse": None, "all": None}
    avg = fig["rotate_avg_s"] <= TARGET_ROTATE_VS_FIFO_AVG * fig["fifo_avg_s"]
    per_job = all(x <= y for x, y in zip(r, f, strict=False))
    worst = fig["rotate_worst_s"] <= fig["fifo_worst_s"]
    return {"rotate_avg": avg, "rotate_no_job_worse": per_job, "rotate_worst_not_worse": worst,
            "all": avg and per_job}


def summarise(fig: dict, phases=PHASES) -> dict:
    """Add averages, worst cases and ratios to ``fig`` (which holds ``PHASE_jct_s`` lists); returns ``fig``."""
    for phase in phases:
        jct = fig.get(f"{phase}_jct_s")
        if jct:
            fig[f"{phase}_avg_s"] = statistics.fmean(jct)
            fig[f"{phase}_worst_s"] = max(jct)
    fig["rotate_vs_fifo_avg"] = ratio(fig.get("rotate_avg_s"), fig.get("fifo_avg_s"))
    fig["rotate_worst_vs_fifo_worst"] = ratio(fig.get("rotate_worst_s"), fig.get("fifo_worst_s"))
    fig["static_vs_fifo_avg"] = ratio(fig.get("static_avg_s"), fig.get("fifo_avg_s"))
    fig["static_worst_vs_fifo_worst"] = ratio(fig.get("static_worst_s"), fig.get("fifo_worst_s"))
    if fig.get("fifo_jct_s") and fig.get("rotate_jct_s"):
        fig["rotate_vs_fifo_per_job"] = [r / f for r, f in zip(fig["rotate_jct_s"], fig["fifo_jct_s"], strict=False)]
    fig["pass"] = passes(fig)
    return fig


def machine() -> dict:
    """What the figures were measured on."""
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as fh:
        mem = round(int(fh.readline().split()[1]) / 2**20, 1)
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "mem_gib": mem, "loadavg": list(os.getloadavg())}


def job_specs(n: int, name: str, profiles, link_bps: float, comm_target: float, compute_ratio: float, iters: int,
              warmup: int) -> list[dict]:
    """The ``n`` jobs of one job count: job i gets profile i mod k, scaled so that its all-reduce of all gradients
    takes ~``comm_target`` s on the link alone, compute ``compute_ratio`` x that (``bench.models``)."""
    from bench.models import balanced_scales, compute_s, gradient_bytes
    from bench.models import comm_s as comm_time

    specs = []
    for i, jid in enumerate(job_ids(n, name)):
        prof = profiles[i % len(profiles)]
        ps, cs = balanced_scales(prof, link_bps, 2, comm_target)
        cs = round(cs * compute_ratio, 4)
        specs.append({"id": jid, "profile": prof, "param_scale": ps, "compute_scale": cs, "iters": iters,
                      "warmup": warmup, "gradient_bytes": gradient_bytes(prof, ps),
                      "comm_s": comm_time(prof, 2, link_bps, ps), "compute_s": compute_s(prof, cs)})
    return specs


def _count_figures(specs: list[dict], iters: int) -> dict:
    """The figures of one job count before any phase ran: the jobs, their models and the two bounds."""
    models = [{k: s[k] for k in ("profile", "param_scale", "compute_scale", "gradient_bytes", "comm_s", "compute_s")}
              for s in specs]
    return {"jobs": [s["id"] for s in specs], "models": models,
            "link_bound_s": iters * sum(s["comm_s"] for s in specs),
            "alone_bound_s": iters * max(max(s["comm_s"], s["compute_s"]) for s in specs)}


def run_count(tb, specs: list[dict], phases, reps: int, workdir: str, levels: int, epoch_s: float, ports,
              progress) -> dict:
    """Every phase ``reps`` times (order rotating per repetition) for the jobs of ``specs``, each phase on fresh
    ports (``ports``: an iterator); returns the job count's figures, summarised."""
    n = len(specs)
    fig = _count_figures(specs, specs[0]["iters"])
    per_rep: dict[str, list[list[float]]] = {p: [] for p in phases}
    for rep in range(reps):
        k = rep % len(phases)
        for phase in list(phases[k:]) + list(phases[:k]):
            for spec in specs:
                spec["port"] = next(ports)
            ph = run_phase(tb, phase, specs, f"n{n}-{phase}-{rep}", workdir, levels, epoch_s)
            per_rep[phase].append(ph["jct_s"])
            for key in ("end_s", "median_iter_s", "tcp", "order_changes"):
                fig.setdefault(f"{phase}_{key}", []).append(ph[key])
            jct = ph["jct_s"]
            progress(f"  {phase:6s} JCT " + ", ".join(f"{j:.1f}" for j in jct) + f" s (avg "
                     f"{statistics.fmean(jct):.1f}, worst {max(jct):.1f}); TCP retransmission "
                     f"timeouts {ph['tcp'].get('TCPTimeouts')}, retransmitted segments "
                     f"{ph['tcp'].get('RetransSegs')}")
    for phase in phases:
        fig[f"{phase}_jct_s"] = [statistics.fmean(col) for col in zip(*per_rep[phase], strict=True)]
        if reps > 1:
            fig[f"{phase}_jct_reps_s"] = per_rep[phase]
    return summarise(fig, phases)


def _check(jobs_counts, phases) -> None:
    """ValueError unless ``phases`` is a non-empty subset of the known phases and every job count is positive."""
    unknown = set(phases) - set(PHASES) - set(OPTIONAL_PHASES)
    if unknown or not phases:
        raise ValueError(f"phases must be a subset of {', '.join(PHASES + OPTIONAL_PHASES)}, not {phases!r}")
    if not jobs_counts or any(n < 1 for n in jobs_counts):
        raise ValueError(f"jobs_counts must be positive numbers of jobs, not {jobs_counts!r}")


def run(jobs_counts=(2, 4), quick: bool = False, name: str = "tj", rate: str = "200mbit", iters: int | None = None,
        warmup: int = 0, profiles=("resnet50",), comm_s: float | None = None, compute_ratio: float = 1.0,
        epoch_s: float | None = None, levels: int = 4, phases=PHASES, reps: int = 1, progress=print,
        port_base: int = 29700, workdir: str | None = None) -> dict:
    """Run the benchmark on a fresh 2-host testbed ``name``; return ``{"runs": {"2": figures, "4": ...}, ...}``.

    ``reps`` > 1 repeats every phase (phase order rotating from one repetition to the next) and takes each job's
    mean JCT over the repetitions. Usage: ``run(jobs_counts=(2,), quick=True)``
    """
    from testbed import Testbed

    _check(jobs_counts, phases)
    iters = iters or (QUICK_ITERS if quick else DEFAULT_ITERS)
    epoch_s = epoch_s or (QUICK_EPOCH_S if quick else DEFAULT_EPOCH_S)
    comm_target = comm_s or (0.3 if quick else 0.75)
    progress = progress or (lambda *a, **k: None)
    result: dict = {"rate": rate, "hosts": 2, "ranks_per_job": 2, "iters": iters, "warmup": warmup, "reps": reps,
                    "profiles": list(profiles), "comm_s_target": comm_target, "compute_ratio": compute_ratio,
                    "epoch_s": epoch_s, "levels": levels, "phases": list(phases), "quick": quick,
                    "jobs_counts": list(jobs_counts), "machine": machine(), "runs": {},
                    "targets": {"rotate_vs_fifo_avg_max": TARGET_ROTATE_VS_FIFO_AVG, "rotate_no_job_worse": True}}
    t_start = time.monotonic()
    progress(f"testbed {name}: 2 hosts at {rate}; {', '.join(map(str, jobs_counts))} jobs of {iters} iterations "
             f"({', '.join(profiles)}, comm ~{comm_target:g} s, compute x{compute_ratio:g}); phases "
             f"{', '.join(phases)}; rotation epoch {epoch_s:g} s")
    ports = itertools.count(port_base + 1)
    with scratch_dir(workdir, "tensorlane-jobs-") as workdir, Testbed(hosts=2, rate=rate, name=name) as tb:
        result["link_bps"] = tb.rate_bps
        for n in jobs_counts:
            specs = job_specs(n, name, profiles, tb.rate_bps, comm_target, compute_ratio, iters, warmup)
            progress(f"{n} jobs: each {specs[0]['gradient_bytes'] / 1e6:.1f} MB of gradients per iteration "
                     f"({specs[0]['comm_s']:.2f} s on the link), compute {specs[0]['compute_s']:.2f} s; all "
                     f"jobs' bytes need {iters * sum(s['comm_s'] for s in specs):.1f} s of the link")
            fig = result["runs"][str(n)] = run_count(tb, specs, phases, reps, workdir, levels, epoch_s, ports,
                                                     progress)
            progress(f"{n} jobs: rotate/FIFO avg {_fmt(fig.get('rotate_vs_fifo_avg'))}, worst "
                     f"{_fmt(fig.get('rotate_worst_vs_fifo_worst'))}; static/FIFO avg "
                     f"{_fmt(fig.get('static_vs_fifo_avg'))}; pass {fig['pass']['all']}")
    result["elapsed_s"] = time.monotonic() - t_start
    result["pass"] = {k: f["pass"] for k, f in result["runs"].items()}
    return result


def _fmt(v) -> str:
    """A ratio with two decimals, "-" for None."""
    return "-" if v is None else f"{v:.2f}"


def format_table(result: dict) -> str:
    """One row per job count: average and worst JCT per phase, rotation's ratios and the targets."""
    head = ("jobs", "FIFO avg/worst", "static avg/worst", "rotate avg/worst", "rotate/FIFO avg", "rotate/FIFO worst",
            "no job worse")
    rows = [head]

    def pair(f, phase):
        a, w = f.get(f"{phase}_avg_s"), f.get(f"{phase}_worst_s")
        return "-" if a is None else f"{a:.1f} / {w:.1f} s"

    for n, f in result["runs"].items():
        p = f["pass"]
        ok = {True: " ok", False: " MISS", None: ""}
        rows.append((n, pair(f, "fifo"), pair(f, "static"), pair(f, "rotate"),
                     _fmt(f.get("rotate_vs_fifo_avg")) + ok[p["rotate_avg"]],
                     _fmt(f.get("rotate_worst_vs_fifo_worst")) + ok[p["rotate_worst_not_worse"]],
                     {True: "yes", False: "no", None: "-"}[p["rotate_no_job_worse"]]))
    lines = text_table(rows)
    lines.append(f"targets: rotate avg <= {TARGET_ROTATE_VS_FIFO_AVG:.2f}x FIFO avg; no job's rotate JCT above its "
                 f"FIFO JCT (per job; worst case shown too)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m bench jobs [--quick] [--json FILE] ...`` (or ``worker ...``): run, print the table."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--quick", action="store_true", help="few iterations, a small model (the smoke test)")
    p.add_argument("--jobs", default="2,4", help="comma-separated job counts (default 2,4)")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--iters", type=int, default=None,
                   help=f"iterations per job (default {DEFAULT_ITERS}, quick {QUICK_ITERS})")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--profiles", default="resnet50", help="comma-separated; job i gets profile i mod k")
    p.add_argument("--comm-s", type=float, default=None,
                   help="seconds of one job's all-reduce of all gradients on the link (default 0.75, quick 0.3)")
    p.add_argument("--compute-ratio", type=float, default=1.0, help="compute per iteration / communication")
    p.add_argument("--epoch-s", type=float, default=None,
                   help=f"rotation epoch of the rotate phase (default {DEFAULT_EPOCH_S:g} s, quick "
                        f"{QUICK_EPOCH_S:g} s)")
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--reps", type=int, default=1, help="repetitions of every phase (mean JCT per job)")
    p.add_argument("--name", default="tj", help="testbed name (namespaces NAME-h1, NAME-h2, NAME-sw)")
    args = p.parse_args(argv)
    if needs_root("the jobs benchmark"):
        return 2
    result = run(jobs_counts=tuple(int(x) for x in args.jobs.split(",") if x), quick=args.quick, name=args.name,
                 rate=args.rate, iters=args.iters, warmup=args.warmup,
                 profiles=tuple(x for x in args.profiles.split(",") if x), comm_s=args.comm_s,
                 compute_ratio=args.compute_ratio, epoch_s=args.epoch_s, levels=args.levels,
                 phases=tuple(x for x in args.phases.split(",") if x), reps=args.reps, progress=progress_printer())
    show_figures(format_table(result), result, args.json)
    return 0 if all(f["pass"]["all"] is not False for f in result["runs"].values()) else 1


if __name__ == "__main__":
    cli(main)
