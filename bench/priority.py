"""Training with tensor priorities: plain DDP vs application-level ordering vs the shim's priority levels with
overlap, on emulated models (``bench.models``) over the namespace testbed, with an agent on every host.

For each profile (ResNet-50, VGG-16, BERT-base by default) one set of workers (``bench.worker training``, one rank per
host) runs these modes interleaved, ``rounds`` times each in rotating order, so that they share the machine's
noise:

``compute``       every rank alone, no communication (the realised compute floor; diagnostic, not a target);
``ddp``           plain DDP (gloo), DDP's default 25 MB buckets (scaled: 25 MB / param_scale);
``app_order``     ``shim.attach(levels=1, optimizer=opt)``: overlap with the next forward and layer-order updates,
                  one network priority (ordering at the application only, ByteScheduler-style);
``shim_overlap``  ``shim.attach(levels=4, optimizer=opt)`` with the agent: layer order on 4 strict-priority levels,
                  and overlap.

Both shim modes use DDP buckets of ``shim_bucket_mb`` (5 MB of the full-size model, scaled like the parameters):
the next forward waits for the bucket that holds the first layers, which is the last one backward fills.

Each profile's scales come from ``bench.models.balanced_scales`` (all gradients' ring all-reduce ~0.75 s on the
link, forward + backward equal to that), so compute and communication are the same size. ``lower_bound_s`` is
max(compute, communication of all gradients at link rate); ``lower_bound_dep_s`` the dependency-aware bound
(``bench.models.dependency_bound``: the maximum over layers k of forward and backward of layers k.. plus the
all-reduce of layers ..k at link rate; k = the first layer gives compute + the first layer's all-reduce), which no
schedule that waits for a layer's whole gradient before updating it can beat (docs/priority.md). Optional bulk
traffic (``--bulk``: iperf3 between host 1 and host 2, both ways, never registered) runs during every mode; then
plain DDP's flows are registered with the agents too (all at level 0) so that only the ordering among the job's own
tensors differs.

Targets (the issue's): ``shim_s <= 0.8 x ddp_s``, ``shim_s <= 1.15 x lower_bound_s``, ``shim_s < app_order_s``.

Usage: ``python -m bench priority --json out.json [--quick]`` (root: it builds network namespaces), or
``run(quick=True)`` from Python.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

from bench.workers import ScenarioError, machine_info, progress_printer, ratio, run_workers, show_figures, text_table

PROFILES = ("resnet50", "vgg16", "bert_base")
MODES = ("compute", "ddp", "app_order", "shim_overlap")
TARGET_VS_DDP = 0.8
TARGET_VS_LOWER_BOUND = 1.15
SHIM_BUCKET_MB = 5.0   # DDP bucket size in the shim modes, MB of the full-size model (plain DDP: its default 25)
KEY = {"compute": "compute_s", "ddp": "ddp_s", "app_order": "app_order_s", "shim_overlap": "shim_s",
       "shim": "shim_no_overlap_s"}


def run_training(tb, ranks: list[int], port: int, profile: str, mode: str, iters: int, warmup: int,
                 param_scale: float, compute_scale: float, workdir: str, tag: str, levels: int = 4,
                 sockets: dict[int, str] | None = None, job: str = "prio", timeout: float = 300.0,
                 extra: list[str] | None = None, ddp_registered: bool = False) -> dict:
    """Run one ``bench.worker training`` worker per host in ``ranks`` (host indexes in rank order) and wait (bounded).

    ``mode`` may be a comma-separated list (see bench.worker). ``sockets`` go to the shim modes; plain DDP
    registers its flows (all at level 0) only with ``ddp_registered``. Returns rank 0's result (``times_s``:
    per-iteration maxima over ranks) with ``by_rank`` (every rank's).
    """
    master = f"{tb.host(ranks[0]).ip}:{port}"

    def argv_of(rank: int, host, out: str) -> list[str]:
        argv = [sys.executable, "-m", "bench.worker", "training", "--rank", str(rank), "--world", str(len(ranks)),
                "--master", master, "--profile", profile, "--mode", mode, "--iters", str(iters),
                "--warmup", str(warmup), "--param-scale", f"{param_scale:g}",
                "--compute-scale", f"{compute_scale:g}", "--levels", str(levels), "--job", job,
                "--ifname", host.ifname, "--link-rate", str(int(tb.rate_bps)), "--json", out,
                "--timeout", str(int(timeout)), *(extra or [])]
        if sockets and host.index in sockets:
            argv += ["--agent-socket", sockets[host.index]]
            if not ddp_registered:
                argv += ["--ddp-level", "-1"]
        return argv

    results = run_workers(tb, ranks, argv_of, workdir, tag, timeout)
    res = dict(results[0])
    res["by_rank"] = results
    return res


def passes(fig: dict) -> dict:
    """Which targets one profile's figures meet (None where a figure is missing)."""
    s, d, lb, a = fig.get("shim_s"), fig.get("ddp_s"), fig.get("lower_bound_s"), fig.get("app_order_s")
    return {
        "shim_vs_ddp": None if s is None or d is None else s <= TARGET_VS_DDP * d,
        "shim_vs_lower_bound": None if s is None or lb is None else s <= TARGET_VS_LOWER_BOUND * lb,
        "shim_below_app_order": None if s is None or a is None else s < a,
    }


def run(profiles=PROFILES, rate: str = "200mbit", hosts: int = 2, iters: int | None = None,
        warmup: int | None = None, quick: bool = False, progress=print, name: str = "tp", modes=MODES,
        levels: int = 4, bulk_streams: int = 0, comm_s: float | None = None, port_base: int = 29600,
        settle_s: float = 2.0, workdir: str | None = None, rounds: int | None = None,
        shim_bucket_mb: float | None = SHIM_BUCKET_MB, partition_bytes: int | None = None) -> dict:
    """Run the benchmark on a fresh testbed ``name``; return ``{"profiles": {name: figures}, ...}``.

    Figures per profile: ``ddp_s``, ``app_order_s``, ``shim_s`` (median iteration seconds, slowest rank),
    ``compute_s`` (every rank alone, no communication), ``lower_bound_s``, ``lower_bound_dep_s`` (and the layer
    that sets it, ``lower_bound_dep_layer``), ``shim_vs_ddp``, ``shim_vs_lower_bound``, ``shim_vs_lower_bound_dep``,
    ``app_order_vs_ddp``, the scales, per-iteration lists ``*_times_s``, phase medians and the shim's stats.
    ``bulk_streams`` > 0 adds iperf3 bulk host1<->host2 with that many streams per direction.
    """
    from bench.models import DEFAULT_COMM_S

    if hosts < 2:
        raise ValueError("the benchmark needs at least 2 hosts")
    unknown = set(modes) - set(KEY)
    if unknown:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}")
    iters = iters or (3 if quick else 8)
    warmup = warmup if warmup is not None else (1 if quick else 2)
    rounds = rounds or (1 if quick else 3)
    progress = progress or (lambda *a, **k: None)
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tensorlane-priority-")
    result: dict = {"rate": rate, "hosts": hosts, "ranks": hosts, "iters": iters, "warmup": warmup,
                    "rounds": rounds, "shim_bucket_mb": shim_bucket_mb, "partition_bytes": partition_bytes,
                    "levels": levels, "modes": list(modes), "bulk_streams": bulk_streams, "quick": quick,
                    "comm_s_target": comm_s or DEFAULT_COMM_S, "profiles": {},
                    "targets": {"shim_vs_ddp_max": TARGET_VS_DDP, "shim_vs_lower_bound_max": TARGET_VS_LOWER_BOUND,
                                "shim_below_app_order": True}}
    t_start = time.monotonic()
    progress(f"testbed {name}: {hosts} hosts at {rate}, {hosts} ranks; profiles {', '.join(profiles)}; "
             f"modes {', '.join(modes)} interleaved, {rounds} round(s) of {iters} timed iterations (+{warmup} warm-up)"
             + (f"; bulk h1<->h2 x{bulk_streams}" if bulk_streams else ""))
    try:
        _run_profiles(result, profiles, name, port_base, settle_s, workdir, progress)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    result["elapsed_s"] = time.monotonic() - t_start
    result["machine"] = machine_info()
    result["pass"] = {p: f["pass"] for p, f in result["profiles"].items()}
    return result


def _run_profiles(result: dict, profiles, name: str, port_base: int, settle_s: float, workdir: str,
                  progress) -> None:
    """Build the testbed (agents, optional bulk) of ``result``'s settings and measure each profile into
    ``result["profiles"]``."""
    from bench.agents import running_agents
    from bench.bulk import bulk
    from testbed import Testbed

    streams = result["bulk_streams"]
    with contextlib.ExitStack() as stack:
        tb = stack.enter_context(Testbed(hosts=result["hosts"], rate=result["rate"], name=name))
        agents_dir = os.path.join(workdir, "agents")
        os.makedirs(agents_dir, exist_ok=True)
        agents = stack.enter_context(running_agents(tb, levels=max(result["levels"], 1), workdir=agents_dir))
        sockets = {i: a.socket for i, a in agents.items()}
        b = None
        if streams:
            b = stack.enter_context(bulk(tb, [(1, 2, streams), (2, 1, streams)], seconds=3600))
            time.sleep(settle_s)
        result["link_bps"] = tb.rate_bps
        for port, prof in enumerate(profiles, start=port_base + 1):
            fig = scaled_figures(prof, tb.rate_bps, result["ranks"], result["comm_s_target"], progress)
            result["profiles"][prof] = fig
            r = _train_profile(tb, result, prof, fig, port, sockets, workdir)
            _mode_figures(fig, r, result["modes"], progress)
            if r.get("ddp_flows"):
                fig["ddp_registered"] = r["ddp_registered"]
            _ratios(fig)
            fig["pass"] = passes(fig)
        if b is not None and not b.alive():
            raise ScenarioError("bulk traffic ended before the benchmark did")


def scaled_figures(prof: str, link: float, ranks: int, comm_target: float, progress=None) -> dict:
    """A profile's scales (``bench.models.balanced_scales``) and what follows from them: gradient bytes, times on
    the wire and of compute, both lower bounds. Usage: ``scaled_figures("resnet50", 200e6, 2, 0.75)``"""
    from bench.models import balanced_scales, compute_s, dependency_bound, gradient_bytes, lower_bound_s
    from bench.models import comm_s as comm_time

    ps, cs = balanced_scales(prof, link, ranks, comm_target)
    fig: dict = {"param_scale": ps, "compute_scale": cs, "gradient_bytes": gradient_bytes(prof, ps),
                 "comm_s": comm_time(prof, ranks, link, ps), "compute_nominal_s": compute_s(prof, cs),
                 "lower_bound_s": lower_bound_s(prof, ranks, link, ps, cs)}
    dep = dependency_bound(prof, ranks, link, ps, cs)
    fig.update(lower_bound_dep_s=dep["lower_bound_dep_s"], lower_bound_dep_layer=dep["layer"],
               lower_bound_dep_layer_name=dep["layer_name"], lower_bound_first_layer_s=dep["first_layer_s"])
    if progress:
        progress(f"{prof}: param_scale {ps:g}, compute_scale {cs:g}: {fig['gradient_bytes'] / 1e6:.1f} MB "
                 f"of gradients ({fig['comm_s']:.3f} s on the wire), compute {fig['compute_nominal_s']:.3f} s;"
                 f" lower bound {fig['lower_bound_s']:.3f} s, dependency-aware "
                 f"{fig['lower_bound_dep_s']:.3f} s (layer {dep['layer']}, {dep['layer_name']})")
    return fig


def _train_profile(tb, result: dict, prof: str, fig: dict, port: int, sockets: dict, workdir: str) -> dict:
    """One set of workers running every mode of ``result`` on profile ``prof`` (scales in ``fig``)."""
    ps, rounds, modes = fig["param_scale"], result["rounds"], result["modes"]
    extra = ["--rounds", str(rounds)]
    if result["shim_bucket_mb"] is not None:
        extra += ["--shim-bucket-cap-mb", f"{result['shim_bucket_mb'] / ps:g}"]
    if result["partition_bytes"] is not None:
        extra += ["--partition-bytes", str(max(4, int(result["partition_bytes"] / ps)))]
    iters, warmup = result["iters"], result["warmup"]
    return run_training(tb, list(range(1, result["hosts"] + 1)), port, prof, ",".join(modes), iters, warmup, ps,
                        fig["compute_scale"], workdir, prof, levels=result["levels"], job=f"prio-{prof}",
                        sockets=sockets, ddp_registered=bool(result["bulk_streams"]), extra=extra,
                        timeout=120 + rounds * len(modes) * (iters + warmup + 2) * 6 * fig["lower_bound_s"])


def _mode_figures(fig: dict, r: dict, modes, progress) -> None:
    """Copy each mode's figures from the workers' result ``r`` to ``fig`` (``KEY[mode]`` and the lists)."""
    for mode in modes:
        m = r["modes"][mode]
        key = KEY[mode]
        fig[key] = m["median_s"]
        fig[key[:-2] + "_times_s"] = m["times_s"]
        fig[f"{mode}_phases_s"] = m["phases_s"]
        fig[f"{mode}_late_wakeups_s"] = m["late_wakeups_s"]
        fig[f"{mode}_device_idle_s"] = m["device_idle_s"]
        if m.get("shim_stats"):
            fig[f"{mode}_stats"] = m["shim_stats"]
        ph, idle = m["phases_s"], m["device_idle_s"]
        progress(f"  {mode:12s} median {m['median_s'] * 1000:6.0f} ms "
                 f"({m['median_s'] / fig['lower_bound_s']:.2f}x lower bound; forward "
                 f"{ph['forward'] * 1000:.0f}, backward {ph['backward'] * 1000:.0f}, step "
                 f"{ph['step'] * 1000:.0f} ms; device idle fwd/bwd {idle['forward'] * 1000:.0f}/"
                 f"{idle['backward'] * 1000:.0f}, late wake-ups "
                 f"{sum(m['late_wakeups_s'].values()) * 1000:.0f} ms)")


def _ratios(fig: dict) -> None:
    """The ratios of one profile's figures (None where a figure is missing)."""
    for key, a, b in (("shim_vs_ddp", "shim_s", "ddp_s"), ("shim_vs_lower_bound", "shim_s", "lower_bound_s"),
                      ("shim_vs_lower_bound_dep", "shim_s", "lower_bound_dep_s"),
                      ("shim_vs_app_order", "shim_s", "app_order_s"), ("app_order_vs_ddp", "app_order_s", "ddp_s"),
                      ("ddp_vs_lower_bound", "ddp_s", "lower_bound_s"),
                      ("ddp_vs_lower_bound_dep", "ddp_s", "lower_bound_dep_s")):
        fig[key] = ratio(fig.get(a), fig.get(b))


def format_table(result: dict) -> str:
    """One row per profile: medians per mode, both lower bounds and the ratios against the targets (the
    dependency-aware bound has no target: informational)."""
    head = ("profile", "compute", "DDP", "app order", "shim", "lower bound", "dep. LB", "shim/DDP", "shim/LB",
            "shim/dep. LB", "shim/app")
    rows = [head]

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    def x(v, target=None, le=True):
        if v is None:
            return "-"
        mark = "" if target is None else (" ok" if (v <= target if le else v < target) else " MISS")
        return f"{v:.2f}x{mark}"

    for prof, f in result["profiles"].items():
        rows.append((prof, ms(f.get("compute_s")), ms(f.get("ddp_s")), ms(f.get("app_order_s")), ms(f.get("shim_s")),
                     ms(f.get("lower_bound_s")), ms(f.get("lower_bound_dep_s")),
                     x(f.get("shim_vs_ddp"), TARGET_VS_DDP), x(f.get("shim_vs_lower_bound"), TARGET_VS_LOWER_BOUND),
                     x(f.get("shim_vs_lower_bound_dep")), x(f.get("shim_vs_app_order"), 1.0, le=False)))
    lines = text_table(rows)
    lines.append(f"targets: shim <= {TARGET_VS_DDP:.2f}x DDP, shim <= {TARGET_VS_LOWER_BOUND:.2f}x lower bound, "
                 f"shim < app order; dep. LB: the dependency-aware lower bound (no target)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench priority", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(KEY))
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved modes (default 3, quick 1)")
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--shim-bucket-mb", type=float, default=SHIM_BUCKET_MB,
                   help="DDP bucket size in the shim modes, in MB of the full-size model (divided by param_scale); "
                        "default %(default)g (plain DDP keeps its default 25)")
    p.add_argument("--partition-bytes", type=int, default=None,
                   help="the shim's partition size, in bytes of the full-size model (divided by param_scale)")
    p.add_argument("--comm-s", type=float, default=None,
                   help="seconds of communication (and of compute) per iteration the scales aim at (0.75)")
    p.add_argument("--bulk", type=int, default=0, metavar="STREAMS",
                   help="iperf3 bulk host1<->host2 with this many streams each way (default: none)")
    p.add_argument("--name", default="tp", help="testbed name (namespaces NAME-h1.., NAME-sw)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("tensorlane: the priority benchmark builds network namespaces: run it as root", file=sys.stderr)
        return 2
    progress = progress_printer()

    result = run(profiles=tuple(x for x in args.profiles.split(",") if x), rate=args.rate, hosts=args.hosts,
                 iters=args.iters, warmup=args.warmup, quick=args.quick, progress=progress, name=args.name,
                 modes=tuple(x for x in args.modes.split(",") if x), levels=args.levels, bulk_streams=args.bulk,
                 comm_s=args.comm_s, rounds=args.rounds, shim_bucket_mb=args.shim_bucket_mb,
                 partition_bytes=args.partition_bytes)
    show_figures(format_table(result), result, args.json)
    return 0 if all(v is not False for f in result["pass"].values() for v in f.values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
