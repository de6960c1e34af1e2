"""The contention scenario of the demo: data-parallel work between two hosts, alone, under bulk traffic with
plain FIFO NICs, and under the same bulk with tensorlane's agents, in one run on one namespace testbed.

Two workloads: ``allreduce`` (``python -m bench contention``: a bare gloo all-reduce, ``bench.worker allreduce``)
and ``training`` (``python -m bench.demo``: a real training loop through the shim, ``bench.worker training`` in
mode ``shim_overlap``: an emulated ResNet-50 trained by DDP with ``shim.attach(ddp, optimizer, levels=4)``). With
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
>= 80 % of the link once training stops. ``python -m bench contention`` exits 1 when one is missed; the demo
(``bench.demo``) runs the same scenario with its own defaults and never judges.

Usage: ``python -m bench contention --json out.json [--quick]`` (root: it builds network namespaces), or
``run(quick=True)`` from Python.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

from bench.bulk import BulkCrash, bulk
from bench.workers import (
    ScenarioError,
    machine_info,
    needs_root,
    progress_printer,
    ratio,
    run_workers,
    show_figures,
    text_table,
)

TARGET_AGENT_RATIO = 1.10
TARGET_FIFO_RATIO = 2.0
TARGET_BULK_AFTER = 0.80
PHASES = ("uncontended", "fifo", "agent")
WORKLOADS = ("allreduce", "training")
TRAINING_PROFILE = "resnet50"


def run_allreduce(tb, ranks: list[int], port: int, size_mb: float, iters: int, workdir: str, tag: str,
                  warmup: int = 1, sockets: dict[int, str] | None = None, job: str = "demo", level: int = 0,
                  timeout: float = 150.0) -> dict:
    """Run one ``bench.worker allreduce`` worker per host in ``ranks`` (host indexes, rank order) and wait (bounded).

    Returns rank 0's result (its ``times_s`` are the per-iteration maxima over ranks) with ``flows_by_rank``.
    """
    master = f"{tb.host(ranks[0]).ip}:{port}"

    def argv_of(rank: int, host, out: str) -> list[str]:
        argv = [sys.executable, "-m", "bench.worker", "allreduce", "--rank", str(rank), "--world", str(len(ranks)),
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


@dataclasses.dataclass
class Scenario:
    """One run's state: the testbed, what to run on it, the figures so far (``result``) and the last port used."""

    tb: object
    result: dict
    pairs: list
    workdir: str
    iters: int
    port: int
    progress: Callable[[str], None]
    settle_s: float = 2.0
    after_s: float = 4.0
    size_mb: float = 10.0
    comm_s: float | None = None

    @property
    def workload(self) -> str:
        return self.result["workload"]

    def step(self, tag: str, sockets: dict[int, str] | None = None) -> dict:
        """Run the workload host1<->host2 on a fresh port; record ``{tag}_s`` and ``{tag}_times_s``."""
        self.port += 1
        if self.workload == "training":
            r = run_shim_training(self.tb, [1, 2], self.port, self.iters, self.workdir, tag, sockets=sockets,
                                  profile=self.result["profile"], comm_s=self.comm_s)
            self.result[f"{tag}_shim_stats"] = r["shim_stats"]
            for key in ("lower_bound_s", "param_scale", "compute_scale"):
                self.result.setdefault(key, r[key])
        else:
            r = run_allreduce(self.tb, [1, 2], self.port, self.size_mb, self.iters, self.workdir, tag,
                              sockets=sockets)
        self.result[f"{tag}_times_s"] = r["times_s"]
        self.result[f"{tag}_s"] = r["median_s"]
        return r

    def bulk_rates(self, results, t0: float, t1: float | None = None) -> dict:
        """Each bulk direction's mean throughput (bit/s) between wall-clock times ``t0`` and ``t1``."""
        return {f"h{a}->h{b}": res.mean_bps_wall(t0, t1) for (a, b, _), res in zip(self.pairs, results, strict=True)}

    def step_under_bulk(self, tag: str, sockets: dict[int, str] | None = None, linger_s: float = 0.0):
        """Start the bulk, let it ramp up, run :meth:`step`; keep the bulk ``linger_s`` more seconds alone.

        Returns ``(step result, bulk results, t0, t1)`` (``t0``, ``t1``: wall-clock start and end of the step). An
        iperf3 client that crashed on its interrupt (:class:`bench.bulk.BulkCrash`, iperf3's bug, not a measurement)
        makes the whole step run once more, said in the progress lines and counted in ``bulk_crashes``.
        """
        try:
            return self._step_under_bulk(tag, sockets, linger_s)
        except BulkCrash as exc:
            self.result["bulk_crashes"] = self.result.get("bulk_crashes", 0) + 1
            self.progress(f"  {tag}: an iperf3 client crashed when interrupted, without its JSON ({exc}); "
                          "running the phase again")
            return self._step_under_bulk(tag, sockets, linger_s)

    def _step_under_bulk(self, tag: str, sockets: dict[int, str] | None, linger_s: float):
        """:meth:`step_under_bulk`, once."""
        with bulk(self.tb, self.pairs, seconds=300) as b:
            time.sleep(self.settle_s)
            t0 = time.time()
            r = self.step(tag, sockets=sockets)
            t1 = time.time()
            if linger_s:
                self.progress(f"  {tag} median {r['median_s'] * 1000:.0f} ms; {self.workload} stopped, bulk alone "
                              f"for {linger_s:g} s")
                time.sleep(linger_s)
            if not b.alive():
                raise ScenarioError(f"{tag}: bulk traffic ended before the {self.workload} was done")
            return r, b.stop(), t0, t1


def phase_uncontended(sc: Scenario) -> None:
    """Phase 1: the workload alone."""
    sc.progress(f"phase 1/3 uncontended: {sc.workload} alone")
    r = sc.step("uncontended")
    sc.progress(f"  uncontended median {r['median_s'] * 1000:.0f} ms")


def phase_fifo(sc: Scenario) -> None:
    """Phase 2: the workload under bulk, every NIC the testbed's FIFO; records ``bulk_fifo_bps``."""
    sc.progress(f"phase 2/3 fifo: {sc.workload} under bulk, FIFO NICs (bulk ramps up for {sc.settle_s:g} s)")
    r, results, t0, t1 = sc.step_under_bulk("fifo")
    sc.result["bulk_fifo_bps"] = sc.bulk_rates(results, t0 + 0.5, t1)
    sc.progress(f"  fifo median {r['median_s'] * 1000:.0f} ms; bulk meanwhile {_fmt_rates(sc.result['bulk_fifo_bps'])}")


def phase_agent(sc: Scenario) -> None:
    """Phase 3: agents on every host, the same bulk, the workload's flows registered; then the bulk alone.

    Records ``agent_flows``, ``agent_registered``, ``bulk_agent_bps``, ``bulk_after_bps`` and ``bulk_after_ratio``.
    """
    from bench.agents import running_agents

    training = sc.workload == "training"
    flows = "the shim registers its flows at levels 0-3" if training else "all-reduce flows registered at level 0"
    sc.progress(f"phase 3/3 agent: agents on every host, same bulk, {flows}")
    agents_dir = os.path.join(sc.workdir, "agents")
    os.makedirs(agents_dir, exist_ok=True)
    with running_agents(sc.tb, workdir=agents_dir) as agents:
        sockets = {i: a.socket for i, a in agents.items()}
        r, results, t0, t_end = sc.step_under_bulk("agent", sockets=sockets, linger_s=1.0 + sc.after_s)
    record_registration(sc.result, r, training, sc.progress)
    sc.result["bulk_agent_bps"] = sc.bulk_rates(results, t0 + 0.5, t_end)
    sc.result["bulk_after_bps"] = sc.bulk_rates(results, t_end + 1.0)
    sc.result["bulk_after_ratio"] = min(sc.result["bulk_after_bps"].values()) / sc.tb.rate_bps
    sc.progress(f"  bulk during {sc.workload} {_fmt_rates(sc.result['bulk_agent_bps'])}; after "
                f"{_fmt_rates(sc.result['bulk_after_bps'])} = {sc.result['bulk_after_ratio']:.0%} of the link")


def record_registration(result: dict, r: dict, training: bool, progress) -> None:
    """Record the agent phase's registered flows (``agent_flows``, ``agent_registered``); warn if any is missing."""
    if training:
        stats = r["shim_stats"] or {}
        result["agent_registered"] = [bool(stats.get("agent", {}).get("registrations"))]
        result["agent_flows"] = stats.get("flows")
    else:
        result["agent_flows"] = r["flows_by_rank"]
        result["agent_registered"] = r["registered_by_rank"]
    if not all(result["agent_registered"]):
        progress(f"  WARNING: flows not registered: {r.get('agent_errors') or r.get('shim_stats')}")


PHASE_STEPS = {"uncontended": phase_uncontended, "fifo": phase_fifo, "agent": phase_agent}


def new_result(hosts: int, rate: str, workload: str, iters: int, streams: int, pairs: list, quick: bool,
               size_mb: float, profile: str) -> dict:
    """The figures' dict before any phase ran: the run's settings and the targets."""
    result: dict = {"hosts": hosts, "rate": rate, "workload": workload, "iters": iters, "streams": streams,
                    "bulk_pairs": pairs, "quick": quick, "targets": {
                        "agent_ratio_max": TARGET_AGENT_RATIO, "fifo_ratio_min": TARGET_FIFO_RATIO,
                        "bulk_after_ratio_min": TARGET_BULK_AFTER}}
    if workload == "training":
        result["profile"] = profile
    else:
        result["size_mb"] = size_mb
    return result


def describe(result: dict, name: str) -> str:
    """The run's first progress line: testbed, workload, iterations and bulk."""
    if result["workload"] == "training":
        what = f"{result['profile']} (emulated) trained through the shim host1<->host2"
    else:
        what = f"all-reduce of {result['size_mb']:g} MiB host1<->host2"
    return (f"testbed {name}: {result['hosts']} hosts at {result['rate']}; {what}, {result['iters']} timed iterations "
            f"per phase; bulk {', '.join(f'h{a}->h{b} x{s}' for a, b, s in result['bulk_pairs'])}")


def run(hosts: int = 3, rate: str = "200mbit", size_mb: float = 10, iters: int | None = None, progress=print,
        quick: bool = False, name: str = "tw", streams: int = 4, phases=PHASES, settle_s: float = 2.0,
        after_s: float | None = None, port_base: int = 29500, workdir: str | None = None,
        workload: str = "allreduce", profile: str = TRAINING_PROFILE, comm_s: float | None = None) -> dict:
    """Run the scenario on a fresh testbed ``name`` and return the figures (see the module docstring).

    ``workload``: ``allreduce`` (a bare all-reduce of ``size_mb``) or ``training`` (``profile`` trained through the
    shim, its communication scaled to about ``comm_s`` seconds per iteration; ``size_mb`` unused). Keys:
    ``uncontended_s``, ``fifo_s``, ``agent_s`` (median seconds of one all-reduce or one training iteration),
    ``agent_ratio`` and ``fifo_ratio`` (over uncontended), ``bulk_after_ratio`` (bulk throughput / link after
    training stopped, the lowest over the bulk directions), per-iteration lists ``*_times_s``, bulk throughputs,
    flows, targets. Usage: ``run(rate="100mbit", quick=True, progress=print)``
    """
    from testbed import Testbed

    if hosts < 2:
        raise ValueError("the scenario needs at least 2 hosts")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, not {workload!r}")
    training = workload == "training"
    iters = iters or ((4 if quick else 8) if training else (6 if quick else 10))
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tensorlane-contention-")
    progress = progress or (lambda *a, **k: None)
    pairs = [(1, 2, streams), (2, 1, streams)]
    result = new_result(hosts, rate, workload, iters, streams, pairs, quick, size_mb, profile)
    t_start = time.monotonic()
    progress(describe(result, name))
    try:
        with Testbed(hosts=hosts, rate=rate, name=name) as tb:
            result["link_bps"] = tb.rate_bps
            sc = Scenario(tb, result, pairs, workdir, iters, port_base, progress, settle_s=settle_s,
                          after_s=after_s if after_s is not None else (3.0 if quick else 4.0), size_mb=size_mb,
                          comm_s=comm_s or (0.4 if quick else None))
            for phase in (p for p in PHASES if p in phases):
                PHASE_STEPS[phase](sc)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    result["agent_ratio"] = ratio(result.get("agent_s"), result.get("uncontended_s"))
    result["fifo_ratio"] = ratio(result.get("fifo_s"), result.get("uncontended_s"))
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


def scenario_parser(prog: str, description: str, rate: str = "200mbit", streams: int = 4,
                    workload: str = "allreduce", json_default: str | None = None) -> argparse.ArgumentParser:
    """The options of the scenario, with the defaults of its caller (``bench contention`` or ``bench.demo``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--json", metavar="FILE", default=json_default, help="write every figure here")
    p.add_argument("--quick", action="store_true", help="fewer iterations (what the tests run)")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate", default=rate, help=f"every link's rate (default {rate})")
    p.add_argument("--size-mb", type=float, default=10.0, help="the all-reduce's size (--workload allreduce)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per phase")
    p.add_argument("--streams", type=int, default=streams, help=f"iperf3 streams per direction (default {streams})")
    p.add_argument("--name", default="tw", help="testbed name (namespaces NAME-h1.., NAME-sw)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--workload", choices=WORKLOADS, default=workload,
                   help="a bare all-reduce, or a training loop through the shim (what `python -m bench.demo` runs)")
    p.add_argument("--profile", default=TRAINING_PROFILE, help="the emulated model of --workload training")
    p.add_argument("--comm-s", type=float, default=None,
                   help="--workload training: the model scaled to this many seconds of communication per iteration")
    return p


def run_args(p: argparse.ArgumentParser, args: argparse.Namespace, progress) -> dict:
    """:func:`run` with the options parsed by ``p`` (a :func:`scenario_parser`); an unknown phase is a usage error."""
    phases = tuple(x.strip() for x in args.phases.split(",") if x.strip())
    if unknown := set(phases) - set(PHASES):
        p.error(f"unknown phase(s) {sorted(unknown)}")
    return run(hosts=args.hosts, rate=args.rate, size_mb=args.size_mb, iters=args.iters, progress=progress,
               quick=args.quick, name=args.name, streams=args.streams, phases=phases, workload=args.workload,
               profile=args.profile, comm_s=args.comm_s)


def main(argv=None) -> int:
    """``python -m bench contention``: run the scenario, print its table; exit 1 when a target is missed."""
    p = scenario_parser("python -m bench contention", __doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    if needs_root("the contention scenario"):
        return 2
    result = run_args(p, args, progress_printer())
    show_figures(format_table(result), result, args.json)
    return 0 if all(v is not False for v in result["pass"].values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
