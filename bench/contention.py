"""The contention scenario of the demo: data-parallel work between two hosts, alone, under bulk traffic with
plain FIFO NICs, and under the same bulk with tensorlane's agents, in one run on one namespace testbed.

Two workloads: ``allreduce`` (``python -m bench contention``: a bare gloo all-reduce, ``bench.allreduce``) and
``training`` (``python -m bench.demo``: a real training loop through the shim, ``bench.training`` in mode
``shim_overlap``: an emulated ResNet-50 trained by DDP with ``shim.attach(ddp, optimizer, levels=4)``). With
``training`` the figures are median iteration times; in the phases without agents the shim finds no agent,
warns once and trains unprioritised, which is exactly what a job sees on a host without tensorlane.

Phases (all on the same testbed, one after another):

1. ``uncontended``: host1 <-> host2 all-reduce, nothing else on the links.
2. ``fifo``: the same while iperf3 bulk saturates the same links (host1 -> host2 and host2 -> host1, several
   streams each); every NIC is the testbed's FIFO, so the all-reduce shares the queues with the bulk.
3. ``agent``: an agent on every host, the same bulk (never registered: the lowest, default class), and the
   all-reduce workers register their flows at level 0. After the workers exit the bulk keeps running for a
   few seconds with the agents still up: ``bulk_after_ratio`` is the bulk's throughput then, relative to the link
   (the agent must be work-conserving).

Targets (the issue's): agent median <= 1.10 x uncontended, FIFO median >= 2 x uncontended in the same run, bulk
>= 80 % of the link once training stops.

Usage: ``python -m bench.contention --json out.json [--quick]`` (root: it builds network namespaces), or
``run(quick=True)`` from Python; ``python -m bench.demo`` and ``python -m bench contention`` call ``main``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench.bulk import bulk
from bench.workers import ScenarioError, machine_info, progress_printer, run_workers, show_figures, text_table

TARGET_AGENT_RATIO = 1.10
TARGET_FIFO_RATIO = 2.0
TARGET_BULK_AFTER = 0.80
PHASES = ("uncontended", "fifo", "agent")
WORKLOADS = ("allreduce", "training")
TRAINING_PROFILE = "resnet50"


def run_allreduce(tb, ranks: list[int], port: int, size_mb: float, iters: int, workdir: str, tag: str,
                  warmup: int = 1, sockets: dict[int, str] | None = None, job: str = "demo", level: int = 0,
                  timeout: float = 150.0) -> dict:
    """Run one ``bench.allreduce`` worker per host in ``ranks`` (host indexes, rank order) and wait (bounded).

    Returns rank 0's result (its ``times_s`` are the per-iteration maxima over ranks) with ``flows_by_rank``.
    """
    master = f"{tb.host(ranks[0]).ip}:{port}"

    def argv_of(rank: int, host, out: str) -> list[str]:
        argv = [sys.executable, "-m", "bench.allreduce", "--rank", str(rank), "--world", str(len(ranks)),
                "--master", master, "--size-mb", f"{size_mb:g}", "--iters", str(iters), "--warmup", str(warmup),
                "--ifname", host.ifname, "--json", out, "--timeout", str(int(timeout))]
        if sockets and host.index in sockets:
            argv += ["--agent-socket", sockets[host.index], "--job", job, "--level", str(level)]
        return argv

    results = run_workers(tb, ranks, argv_of, workdir, tag, timeout)
    res = results[0]
    res["flows_by_rank"] = [r["flows"] for r in results]
    res["registered_by_rank"] = [r["registered"] for r in results]
    res["agent_errors"] = [r["agent_error"] for r in results if r["agent_error"]]
    return res


def run_shim_training(tb, ranks: list[int], port: int, iters: int, workdir: str, tag: str, warmup: int = 1,
                      sockets: dict[int, str] | None = None, job: str = "demo", profile: str = TRAINING_PROFILE,
                      comm_s: float | None = None, timeout: float = 240.0) -> dict:
    """Train ``profile`` (emulated, ``bench.models``) through the shim (overlap, 4 levels) on the hosts in ``ranks``.

    Without ``sockets`` every rank is pointed at a socket where no agent listens. Returns rank 0's result
    (``times_s``: per-iteration maxima over ranks, ``median_s``) with the shim's statistics (``shim_stats``).
    """
    from bench.models import DEFAULT_COMM_S, balanced_scales
    from bench.priority import run_training

    ps, cs = balanced_scales(profile, tb.rate_bps, len(ranks), comm_s or DEFAULT_COMM_S)
    if not sockets:
        sockets = {tb.host(i).index: os.path.join(workdir, "no-agent.sock") for i in ranks}
    r = run_training(tb, ranks, port, profile, "shim_overlap", iters, warmup, ps, cs, workdir, tag, levels=4,
                     sockets=sockets, job=job, timeout=timeout,
                     extra=["--shim-bucket-cap-mb", f"{5.0 / ps:g}"])
    m = r["modes"]["shim_overlap"]
    return {"times_s": m["times_s"], "median_s": m["median_s"], "shim_stats": m.get("shim_stats"),
            "param_scale": ps, "compute_scale": cs, "lower_bound_s": r.get("lower_bound_s")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run(hosts: int = 3, rate: str = "200mbit", size_mb: float = 10, iters: int | None = None, progress=print,
        quick: bool = False, name: str = "tw", streams: int = 4, phases=PHASES, settle_s: float = 2.0,
        after_s: float | None = None, port_base: int = 29500, workdir: str | None = None,
        workload: str = "allreduce", profile: str = TRAINING_PROFILE) -> dict:
    """Run the scenario on a fresh testbed ``name`` and return the figures (see the module docstring).

    ``workload``: ``allreduce`` (a bare all-reduce of ``size_mb``) or ``training`` (``profile`` trained through the
    shim; ``size_mb`` unused). Keys: ``uncontended_s``, ``fifo_s``, ``agent_s`` (median seconds of one all-reduce
    or one training iteration), ``agent_ratio`` and
    ``fifo_ratio`` (over uncontended), ``bulk_after_ratio`` (bulk throughput / link after training stopped, the
    lowest over the bulk directions), per-iteration lists ``*_times_s``, bulk throughputs, flows, targets.
    """
    from testbed import Testbed

    if hosts < 2:
        raise ValueError("the scenario needs at least 2 hosts")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, not {workload!r}")
    training = workload == "training"
    iters = iters or ((4 if quick else 8) if training else (6 if quick else 10))
    after_s = after_s if after_s is not None else (3.0 if quick else 4.0)
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tensorlane-contention-")
    progress = progress or (lambda *a, **k: None)
    pairs = [(1, 2, streams), (2, 1, streams)]
    result: dict = {"hosts": hosts, "rate": rate, "workload": workload, "iters": iters, "streams": streams,
                    "bulk_pairs": pairs, "quick": quick, "targets": {
                        "agent_ratio_max": TARGET_AGENT_RATIO, "fifo_ratio_min": TARGET_FIFO_RATIO,
                        "bulk_after_ratio_min": TARGET_BULK_AFTER}}
    t_start = time.monotonic()
    if training:
        result["profile"] = profile
        what = f"{profile} (emulated) trained through the shim host1<->host2"
    else:
        result["size_mb"] = size_mb
        what = f"all-reduce of {size_mb:g} MiB host1<->host2"
    progress(f"testbed {name}: {hosts} hosts at {rate}; {what}, "
             f"{iters} timed iterations per phase; bulk {', '.join(f'h{a}->h{b} x{s}' for a, b, s in pairs)}")
    try:
        with Testbed(hosts=hosts, rate=rate, name=name) as tb:
            link = tb.rate_bps
            result["link_bps"] = link
            port = port_base

            def allreduce(tag, sockets=None):
                nonlocal port
                port += 1
                if training:
                    r = run_shim_training(tb, [1, 2], port, iters, workdir, tag, sockets=sockets,
                                          profile=profile, comm_s=0.4 if quick else None)
                    result[f"{tag}_shim_stats"] = r["shim_stats"]
                    result.setdefault("lower_bound_s", r["lower_bound_s"])
                    result.setdefault("param_scale", r["param_scale"])
                    result.setdefault("compute_scale", r["compute_scale"])
                else:
                    r = run_allreduce(tb, [1, 2], port, size_mb, iters, workdir, tag, sockets=sockets)
                result[f"{tag}_times_s"] = r["times_s"]
                result[f"{tag}_s"] = r["median_s"]
                return r

            def bulk_rates(results, t0, t1=None):
                return {f"h{a}->h{b}": res.mean_bps_wall(t0, t1) for (a, b, _), res in zip(pairs, results)}

            if "uncontended" in phases:
                progress(f"phase 1/3 uncontended: {workload} alone")
                r = allreduce("uncontended")
                progress(f"  uncontended median {r['median_s'] * 1000:.0f} ms")

            if "fifo" in phases:
                progress(f"phase 2/3 fifo: {workload} under bulk, FIFO NICs (bulk ramps up for {settle_s:g} s)")
                with bulk(tb, pairs, seconds=300) as b:
                    time.sleep(settle_s)
                    t0 = time.time()
                    r = allreduce("fifo")
                    t1 = time.time()
                    if not b.alive():
                        raise ScenarioError(f"fifo: bulk traffic ended before the {workload} did")
                    results = b.stop()
                result["bulk_fifo_bps"] = bulk_rates(results, t0 + 0.5, t1)
                progress(f"  fifo median {r['median_s'] * 1000:.0f} ms; bulk meanwhile "
                         f"{_fmt_rates(result['bulk_fifo_bps'])}")

            if "agent" in phases:
                from bench.agents import running_agents

                progress("phase 3/3 agent: agents on every host, same bulk, "
                         + ("the shim registers its flows at levels 0-3" if training
                            else "all-reduce flows registered at level 0"))
                agents_dir = os.path.join(workdir, "agents")
                os.makedirs(agents_dir, exist_ok=True)
                with running_agents(tb, workdir=agents_dir) as agents:
                    sockets = {i: a.socket for i, a in agents.items()}
                    with bulk(tb, pairs, seconds=300) as b:
                        time.sleep(settle_s)
                        t0 = time.time()
                        r = allreduce("agent", sockets=sockets)
                        t_end = time.time()
                        if training:
                            agent_stats = (r["shim_stats"] or {}).get("agent", {})
                            result["agent_registered"] = [bool(agent_stats.get("registrations"))]
                            result["agent_flows"] = (r["shim_stats"] or {}).get("flows")
                        else:
                            result["agent_flows"] = r["flows_by_rank"]
                            result["agent_registered"] = r["registered_by_rank"]
                        if not all(result["agent_registered"]):
                            progress(f"  WARNING: flows not registered: {r.get('agent_errors') or r.get('shim_stats')}")
                        progress(f"  agent median {r['median_s'] * 1000:.0f} ms; training stopped, bulk alone "
                                 f"for {after_s + 1:g} s")
                        time.sleep(1.0 + after_s)
                        if not b.alive():
                            raise ScenarioError("agent: bulk traffic ended early")
                        results = b.stop()
                    result["bulk_agent_bps"] = bulk_rates(results, t0 + 0.5, t_end)
                    result["bulk_after_bps"] = bulk_rates(results, t_end + 1.0)
                    result["bulk_after_ratio"] = min(result["bulk_after_bps"].values()) / link
                    progress(f"  bulk during training {_fmt_rates(result['bulk_agent_bps'])}; after "
                             f"{_fmt_rates(result['bulk_after_bps'])} = {result['bulk_after_ratio']:.0%} of the link")
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    result["agent_ratio"] = _ratio(result.get("agent_s"), result.get("uncontended_s"))
    result["fifo_ratio"] = _ratio(result.get("fifo_s"), result.get("uncontended_s"))
    result["elapsed_s"] = time.monotonic() - t_start
    result["machine"] = machine_info()
    result["pass"] = passes(result)
    return result


def _fmt_rates(rates: dict) -> str:
    return ", ".join(f"{k} {v / 1e6:.0f} Mbit/s" for k, v in rates.items())


def passes(result: dict) -> dict:
    """Which targets a result meets (None where the phase was not run)."""
    ar, fr, ba = result.get("agent_ratio"), result.get("fifo_ratio"), result.get("bulk_after_ratio")
    return {
        "agent_ratio": None if ar is None else ar <= TARGET_AGENT_RATIO,
        "fifo_ratio": None if fr is None else fr >= TARGET_FIFO_RATIO,
        "bulk_after_ratio": None if ba is None else ba >= TARGET_BULK_AFTER,
    }


def format_table(result: dict) -> str:
    """The small end-of-run table: median all-reduce time per phase, ratio to uncontended, target."""
    rows = [("phase", "median", "vs uncontended", "target")]
    unc = result.get("uncontended_s")
    for phase, target in (("uncontended", ""), ("fifo", f">= {TARGET_FIFO_RATIO:.2f}x"),
                          ("agent", f"<= {TARGET_AGENT_RATIO:.2f}x")):
        med = result.get(f"{phase}_s")
        if med is None:
            continue
        ratio = "1.00x" if phase == "uncontended" else (f"{med / unc:.2f}x" if unc else "-")
        rows.append((phase if phase != "fifo" else "FIFO", f"{med * 1000:.0f} ms", ratio, target))
    if result.get("bulk_after_ratio") is not None:
        rows.append(("bulk after training", f"{min(result['bulk_after_bps'].values()) / 1e6:.0f} Mbit/s",
                     f"{result['bulk_after_ratio']:.0%} of link", f">= {TARGET_BULK_AFTER:.0%}"))
    lines = text_table(rows)
    verdict = result.get("pass") or passes(result)
    met = [k for k, v in verdict.items() if v is True]
    missed = [k for k, v in verdict.items() if v is False]
    lines.append(f"targets met: {', '.join(met) or 'none'}" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tensorlane {demo,bench contention}", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--quick", action="store_true", help="fewer iterations (what the tests run)")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--size-mb", type=float, default=10.0)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--streams", type=int, default=4, help="iperf3 streams per bulk direction")
    p.add_argument("--name", default="tw", help="testbed name (namespaces NAME-h1.., NAME-sw)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--workload", choices=WORKLOADS, default="allreduce",
                   help="a bare all-reduce, or a training loop through the shim (what `python -m bench.demo` runs)")
    p.add_argument("--profile", default=TRAINING_PROFILE, help="the emulated model of --workload training")
    args = p.parse_args(argv)
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if unknown := set(phases) - set(PHASES):
        p.error(f"unknown phase(s) {sorted(unknown)}")
    if os.geteuid() != 0:
        print("tensorlane: the contention scenario builds network namespaces: run it as root", file=sys.stderr)
        return 2
    progress = progress_printer()

    result = run(hosts=args.hosts, rate=args.rate, size_mb=args.size_mb, iters=args.iters, progress=progress,
                 quick=args.quick, name=args.name, streams=args.streams, phases=phases, workload=args.workload,
                 profile=args.profile)
    show_figures(format_table(result), result, args.json)
    return 0 if all(v is not False for v in result["pass"].values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
