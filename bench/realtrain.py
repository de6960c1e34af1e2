"""Real-compute training under bulk traffic: a small CNN (``bench.models.small_cnn``, no sleep emulation) trained
data-parallel with a linear warm-up LR schedule (``LambdaLR``), ``clip_grad_norm_`` and bf16 autocast on
deterministic synthetic images, on the namespace testbed (2 hosts, one rank per host, gloo over eth0), with an
agent on every host and iperf3 bulk between the hosts both ways (never registered).

One set of workers (one process per rank) runs the modes interleaved, ``rounds`` times in rotating order, so that
they share the machine's noise; every run builds the same model from the same seed and trains it on the same
batches, so the loss curves of the modes can be compared step by step:

``compute``      every rank alone, no communication (the realised compute per iteration; diagnostic);
``ddp``          plain ``DistributedDataParallel`` (DDP's default buckets) with clipping; its flows are not
                 registered (a user without tensorlane): under the bulk it shares the lowest class with iperf3;
``shim_clip``    the same loop (clipping) with ``shim.attach(ddp, optimizer, levels=4)``: the shim detects the
                 clipping at the first iteration and runs its exact hook mode (``stats()["mode"] == "hook"``);
``shim_noclip``  the shim on the same loop without clipping, so that its overlap mode runs;
``ddp_noclip``   plain DDP without clipping: the reference for ``shim_noclip``'s losses and time.

Figures: the median iteration time per mode (the slowest rank per iteration, start to start, as in
``bench.worker training``), ``shim_clip_vs_ddp`` and ``shim_noclip_vs_ddp``; the per-step losses of every run (per rank
and the mean over ranks); ``loss.shim_clip_vs_ddp``: the largest relative difference per step between the shim
with clipping and plain DDP (over ranks and rounds; equal data, init and 2 ranks: it should be 0 or ~1e-7).

Usage: ``python -m bench realtrain --json results/realtrain.json [--quick]`` (root: it builds network namespaces);
the per-rank worker it starts is ``python -m bench.worker realtrain ...`` (``bench.worker``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.workers import ScenarioError, machine_info, progress_printer, ratio, run_workers, show_figures, text_table

MODES = ("compute", "ddp", "shim_clip", "ddp_noclip", "shim_noclip")
ALL_MODES = MODES
CLIP_MODES = ("ddp", "shim_clip", "compute")
SHIM_MODES = ("shim_clip", "shim_noclip")
KEY = {"compute": "compute_s", "ddp": "ddp_s", "shim_clip": "shim_clip_s", "shim_noclip": "shim_noclip_s",
       "ddp_noclip": "ddp_noclip_s"}
DEFAULTS = {"rate": "100mbit", "width": 48, "batch": 32, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4,
            "warmup_steps": 5, "max_norm": 1.0, "levels": 4, "shim_bucket_mb": 2.0, "streams": 4, "seed": 0}
LOSS_TOLERANCE = 1e-6   # the largest relative loss difference shim (clip) vs DDP the report calls "met"


# ----------------------------------------------------------------------------------------------------- analysis

def rel_diff(a: float, b: float) -> float:
    """``|a - b| / |b|`` (0 when equal; ``|a - b|`` when ``b`` is 0). Usage: ``rel_diff(1.0, 1.0) == 0.0``"""
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else abs(a - b)


def loss_diff(runs_of: dict, mode: str, ref: str) -> dict | None:
    """Per step, the largest relative difference between ``mode``'s and ``ref``'s losses over ranks and rounds
    (round r of one against round r of the other, rank by rank); None if either mode was not run.

    ``runs_of[mode]``: per rank, a list of runs with ``losses``. Returns ``per_step``, ``max``, ``exact_steps``
    (steps with bit-equal losses on every rank and round) and ``steps``.
    """
    if mode not in runs_of or ref not in runs_of:
        return None
    per_step: list[float] = []
    exact = 0
    ranks = range(len(runs_of[ref]))
    rounds = min(len(runs_of[mode][0]), len(runs_of[ref][0]))
    steps = len(runs_of[ref][0][0]["losses"])
    for s in range(steps):
        diffs = [rel_diff(runs_of[mode][k][r]["losses"][s], runs_of[ref][k][r]["losses"][s])
                 for k in ranks for r in range(rounds)]
        per_step.append(max(diffs))
        exact += all(d == 0.0 for d in diffs)
    return {"per_step": per_step, "max": max(per_step), "exact_steps": exact, "steps": steps}


def merge(results: list[dict], modes) -> dict:
    """Combine the ranks' JSON: per mode the iteration times (per iteration, the slowest rank), the median, the
    losses per round (mean over ranks and per rank), phases, the shim's mode and reason."""
    out: dict = {}
    runs_of = {m: [r["runs"][m] for r in results] for m in modes}
    for mode in modes:
        per_rank = runs_of[mode]
        rounds = len(per_rank[0])
        times = [max(r[k]["local_times_s"][i] for r in per_rank)
                 for k in range(rounds) for i in range(len(per_rank[0][k]["local_times_s"]))]
        losses = [[statistics.fmean(r[k]["losses"][s] for r in per_rank) for s in range(len(per_rank[0][k]["losses"]))]
                  for k in range(rounds)]
        m = {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "times_s": times,
             "losses": losses, "losses_by_rank": [[r[k]["losses"] for r in per_rank] for k in range(rounds)],
             "grad_norms": [per_rank[0][k]["grad_norms"] for k in range(rounds)],
             "lrs": per_rank[0][0]["lrs"],
             "phases_s": {ph: statistics.median(x for r in per_rank for k in range(rounds) for x in r[k][ph])
                          for ph in ("forward", "backward", "step")},
             # the training thread's own CPU time and run-queue wait per timed iteration (median over ranks and
             # iterations): a wait of the size of the iteration means the CPUs were busy with something else
             "cpu_s": statistics.median(x for r in per_rank for k in range(rounds) for x in r[k]["cpu_s"]),
             "cpu_wait_s": statistics.median(x for r in per_rank for k in range(rounds) for x in r[k]["cpu_wait_s"]),
             "param_max_abs_diff_vs_ddp": max((r[k].get("param_max_abs_diff_vs_ddp") for r in per_rank
                                               for k in range(rounds)
                                               if r[k].get("param_max_abs_diff_vs_ddp") is not None), default=None),
             "rounds_identical": all(per_rank[0][k]["losses"] == per_rank[0][0]["losses"] for k in range(rounds))}
        if mode in SHIM_MODES:
            m["shim_mode"] = [per_rank[0][k].get("shim_mode") for k in range(rounds)]
            m["mode_reason"] = per_rank[0][-1].get("mode_reason")
            m["shim_stats"] = per_rank[0][-1].get("shim_stats")
        out[mode] = m
    return {"modes": out, "runs_of": runs_of}


# ---------------------------------------------------------------------------------------------------- benchmark

def run(quick: bool = False, rate: str = DEFAULTS["rate"], iters: int | None = None, warmup: int | None = None,
        rounds: int | None = None, modes=MODES, width: int = DEFAULTS["width"], batch: int = DEFAULTS["batch"],
        streams: int = DEFAULTS["streams"], levels: int = DEFAULTS["levels"],
        shim_bucket_mb: float = DEFAULTS["shim_bucket_mb"], lr: float = DEFAULTS["lr"],
        warmup_steps: int = DEFAULTS["warmup_steps"], max_norm: float = DEFAULTS["max_norm"],
        seed: int = DEFAULTS["seed"], name: str = "tr", progress=print, port: int = 29700, settle_s: float = 2.0,
        workdir: str | None = None) -> dict:
    """Run the benchmark on a fresh 2-host testbed ``name``; return the figures (module docstring)."""
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        raise ValueError(f"unknown mode(s) {sorted(unknown)}; modes are {', '.join(ALL_MODES)}")
    cfg = {"modes": list(modes), "rounds": rounds or (1 if quick else 3), "iters": iters or (3 if quick else 10),
           "warmup": warmup if warmup is not None else (1 if quick else 2), "width": width, "batch": batch,
           "lr": lr, "warmup_steps": warmup_steps, "max_norm": max_norm, "seed": seed, "levels": levels,
           "shim_bucket_mb": shim_bucket_mb}
    progress = progress or (lambda *a, **k: None)
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tensorlane-realtrain-")
    result = _header(cfg, rate, quick, streams)
    t_start = time.monotonic()
    progress(f"testbed {name}: 2 hosts at {rate}; small CNN width {width} ({result['model']['params'] / 1e6:.2f} M "
             f"parameters, {result['model']['gradient_bytes'] / 1e6:.1f} MB of gradients), batch {batch} per rank, "
             f"bf16 autocast; modes {', '.join(modes)} interleaved, {cfg['rounds']} round(s) of {cfg['iters']} timed "
             f"iterations (+{cfg['warmup']} warm-up); bulk h1<->h2 x{streams} each way, agents on both hosts")
    try:
        results = _measure(result, cfg, name, rate, port, settle_s, workdir)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    _figures(result, results, modes)
    result["elapsed_s"] = time.monotonic() - t_start
    result["machine"] = machine_info()
    return result


def _header(cfg: dict, rate: str, quick: bool, streams: int) -> dict:
    """The figures' description of the run (before it starts): settings, model, training, targets."""
    params = _count_params(cfg["width"])
    return {"hosts": 2, "ranks": 2, "rate": rate, "iters": cfg["iters"], "warmup": cfg["warmup"],
            "rounds": cfg["rounds"], "steps": cfg["warmup"] + cfg["iters"] + 1, "modes_run": cfg["modes"],
            "quick": quick, "bulk_streams": streams, "bulk_pairs": [(1, 2, streams), (2, 1, streams)],
            "levels": cfg["levels"], "shim_bucket_mb": cfg["shim_bucket_mb"],
            "model": {"kind": "small_cnn", "width": cfg["width"], "params": params, "gradient_bytes": 4 * params,
                      "batch_per_rank": cfg["batch"], "image": [3, 32, 32], "classes": 10},
            "train": {"optimizer": "SGD", "lr": cfg["lr"], "momentum": DEFAULTS["momentum"],
                      "weight_decay": DEFAULTS["weight_decay"], "schedule": "LambdaLR linear warm-up",
                      "warmup_steps": cfg["warmup_steps"], "max_norm": cfg["max_norm"], "autocast": "cpu bfloat16",
                      "seed": cfg["seed"], "ddp_bucket_mb": 25.0, "forward_sync_buffers": False},
            "targets": {"loss_max_rel_diff_max": LOSS_TOLERANCE}}


def worker_argv(cfg: dict, master: str, socket: str, rank: int, ifname: str, out: str) -> list[str]:
    """The command line of one rank's worker (``python -m bench.worker realtrain``) for the settings ``cfg``."""
    return [sys.executable, "-m", "bench.worker", "realtrain", "--rank", str(rank), "--world", "2",
            "--master", master, "--modes", ",".join(cfg["modes"]), "--rounds", str(cfg["rounds"]), "--iters",
            str(cfg["iters"]), "--warmup", str(cfg["warmup"]), "--width", str(cfg["width"]), "--batch",
            str(cfg["batch"]), "--lr", f"{cfg['lr']:g}", "--warmup-steps", str(cfg["warmup_steps"]), "--max-norm",
            f"{cfg['max_norm']:g}", "--seed", str(cfg["seed"]), "--levels", str(cfg["levels"]), "--shim-bucket-mb",
            f"{cfg['shim_bucket_mb']:g}", "--agent-socket", socket, "--job", "realtrain", "--ifname", ifname,
            "--json", out]


def _measure(result: dict, cfg: dict, name: str, rate: str, port: int, settle_s: float, workdir: str) -> list[dict]:
    """Build the testbed, agents and bulk, run the workers; every rank's JSON (link and bulk figures to ``result``)."""
    from bench.agents import running_agents
    from bench.bulk import BulkCrash, bulk
    from tensorlane.policies.model import CostModel
    from testbed import Testbed

    pairs = result["bulk_pairs"]
    with contextlib.ExitStack() as stack:
        tb = stack.enter_context(Testbed(hosts=2, rate=rate, name=name))
        link = tb.rate_bps
        result["link_bps"] = link
        result["comm_s"] = CostModel(2, link).wire_bits(result["model"]["gradient_bytes"]) / link
        agents_dir = os.path.join(workdir, "agents")
        os.makedirs(agents_dir, exist_ok=True)
        agents = stack.enter_context(running_agents(tb, levels=cfg["levels"], workdir=agents_dir))
        b = stack.enter_context(bulk(tb, pairs, seconds=3600))
        time.sleep(settle_s)
        master = f"{tb.host(1).ip}:{port}"

        def argv_of(rank: int, host, out: str) -> list[str]:
            return worker_argv(cfg, master, agents[host.index].socket, rank, host.ifname, out)

        t0 = time.time()
        budget = 180 + cfg["rounds"] * len(cfg["modes"]) * (cfg["iters"] + cfg["warmup"] + 1) * 8.0
        results = run_workers(tb, [1, 2], argv_of, workdir, "realtrain", budget)
        t1 = time.time()
        if not b.alive():
            raise ScenarioError("bulk traffic ended before the benchmark did")
        try:
            bulk_results = b.stop()
        except BulkCrash as exc:  # (iperf3's own abort on its interrupt: the bulk's figures are lost, the
            result["bulk_crash"] = str(exc)  # training's are not: they are what this benchmark measures)
            bulk_results = []
        with contextlib.suppress(Exception):
            result["bulk_bps"] = {f"h{a}->h{c}": res.mean_bps_wall(t0 + 1, t1)
                                  for (a, c, _), res in zip(pairs, bulk_results, strict=False)}
    return results


def _figures(result: dict, results: list[dict], modes) -> None:
    """Add the merged per-mode figures, the ratios, the loss comparisons and ``pass`` to ``result``."""
    merged = merge(results, modes)
    result["modes"] = merged["modes"]
    for mode in modes:
        result[KEY[mode]] = merged["modes"][mode]["median_s"]
    result["shim_clip_vs_ddp"] = ratio(result.get("shim_clip_s"), result.get("ddp_s"))
    result["shim_noclip_vs_ddp"] = ratio(result.get("shim_noclip_s"), result.get("ddp_s"))
    result["shim_clip_vs_noclip"] = ratio(result.get("shim_clip_s"), result.get("shim_noclip_s"))
    result["compute_vs_comm"] = ratio(result.get("compute_s"), result.get("comm_s"))
    runs_of = merged["runs_of"]
    result["loss"] = {"shim_clip_vs_ddp": loss_diff(runs_of, "shim_clip", "ddp"),
                      "shim_noclip_vs_ddp_noclip": loss_diff(runs_of, "shim_noclip", "ddp_noclip"),
                      "shim_noclip_vs_ddp": loss_diff(runs_of, "shim_noclip", "ddp")}
    lc = result["loss"]["shim_clip_vs_ddp"]
    result["loss_max_rel_diff"] = None if lc is None else lc["max"]
    result["shim_clip_mode"] = (result["modes"].get("shim_clip") or {}).get("shim_mode")
    result["shim_noclip_mode"] = (result["modes"].get("shim_noclip") or {}).get("shim_mode")
    result["pass"] = {"loss_equal": None if lc is None else lc["max"] <= LOSS_TOLERANCE}


def _count_params(width: int) -> int:
    """Parameters of ``small_cnn(width)`` without building it (torch-free)."""
    w, c = width, 10
    convs = [(3, w), (w, 2 * w), (2 * w, 2 * w), (2 * w, 4 * w), (4 * w, 4 * w), (4 * w, 8 * w)]
    return sum(9 * a * o + 2 * o for a, o in convs) + 8 * w * c + c


def format_table(result: dict) -> str:
    """Median iteration per mode, ratio to plain DDP, the shim's mode, and the loss comparison."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"

    ddp = result.get("ddp_s")
    rows = [("mode", "median iteration", "vs DDP", "CPU / run-queue wait", "shim mode", "final loss (mean of ranks)",
             "losses vs DDP (same loop)")]
    for mode, m in (result.get("modes") or {}).items():
        ref = {"shim_clip": "shim_clip_vs_ddp", "shim_noclip": "shim_noclip_vs_ddp_noclip"}.get(mode)
        ld = (result.get("loss") or {}).get(ref) if ref else None
        modes = sorted(set(x for x in m.get("shim_mode") or [] if x)) if mode in SHIM_MODES else []
        rows.append((mode, ms(m.get("median_s")),
                     "-" if mode == "compute" or ddp is None else f"{m['median_s'] / ddp:.2f}x",
                     f"{ms(m.get('cpu_s'))} / {ms(m.get('cpu_wait_s'))}", ",".join(modes) or "-",
                     f"{m['losses'][0][-1]:.4f}" if m.get("losses") else "-",
                     "-" if ld is None else f"max rel diff {ld['max']:.2g} ({ld['exact_steps']}/{ld['steps']} exact)"))
    lines = text_table(rows)
    lines.append(f"communication per iteration at link rate {result.get('comm_s', 0) * 1000:.0f} ms "
                 f"({result['model']['gradient_bytes'] / 1e6:.1f} MB, ring over 2 ranks); compute "
                 f"{ms(result.get('compute_s'))}; bulk iperf3 x{result.get('bulk_streams')} each way, unregistered")
    reason = (result.get("modes", {}).get("shim_clip") or {}).get("mode_reason")
    if reason:
        lines.append(f"shim with clipping: {reason}")
    nc = (result.get("loss") or {}).get("shim_noclip_vs_ddp_noclip")
    if nc is not None:
        lines.append(f"shim without clipping (overlap) vs plain DDP without clipping: max rel loss diff "
                     f"{nc['max']:.2g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench realtrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--plot", metavar="PNG",
                   help="also save the plot here (bench.report makes docs/img/bench-realtrain.png)")
    p.add_argument("--quick", action="store_true", help="1 round of 3 iterations (a smoke run)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(ALL_MODES))
    p.add_argument("--rate", default=DEFAULTS["rate"])
    p.add_argument("--iters", type=int, default=None, help="timed iterations per mode and round (10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations before them (2; quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved modes (3; quick 1)")
    p.add_argument("--width", type=int, default=DEFAULTS["width"], help="CNN width (channels of the first block)")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="images per rank and step")
    p.add_argument("--streams", type=int, default=DEFAULTS["streams"], help="iperf3 streams per bulk direction")
    p.add_argument("--levels", type=int, default=DEFAULTS["levels"])
    p.add_argument("--shim-bucket-mb", type=float, default=DEFAULTS["shim_bucket_mb"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--warmup-steps", type=int, default=DEFAULTS["warmup_steps"])
    p.add_argument("--max-norm", type=float, default=DEFAULTS["max_norm"])
    p.add_argument("--name", default="tr", help="testbed name (namespaces NAME-h1, NAME-h2, NAME-sw)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("tensorlane: the realtrain benchmark builds network namespaces: run it as root", file=sys.stderr)
        return 2
    result = run(quick=args.quick, rate=args.rate, iters=args.iters, warmup=args.warmup, rounds=args.rounds,
                 modes=tuple(m for m in args.modes.split(",") if m), width=args.width, batch=args.batch,
                 streams=args.streams, levels=args.levels, shim_bucket_mb=args.shim_bucket_mb, lr=args.lr,
                 warmup_steps=args.warmup_steps, max_norm=args.max_norm, name=args.name,
                 progress=progress_printer())
    show_figures(format_table(result), result, args.json)
    if args.plot:
        from bench.report import save_plot

        save_plot("realtrain", result, args.plot)
    ok = result["pass"]["loss_equal"]
    return 0 if ok is not False else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
