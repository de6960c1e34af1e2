"""Issue 4, measured: the execution model's predicted iteration times against the testbed, and the planner's choice
against the other candidates it considered.

On one fresh testbed (``NAME-h1``.., 2 hosts at 200 Mbit/s, an agent with 5 levels on each host):

1. **Calibration** (before any training, its own worker set: ``bench.worker training --mode calibrate``): uncontended
   all-reduces of 4 KiB, 1 MiB and 4 MiB give the per-operation startup alpha and the link's payload rate
   (``policies.execution.fit_alpha_beta``); the same workers measure the host's cost of issuing one asynchronous
   all-reduce, the wake-up of a waiting thread, the compute lost per all-reduce completing with a Python callback
   (the shim's) and the copy rate (``policies.execution.HostCosts``). Nothing here is fitted to the training
   measurements.
2. **Planning**: each profile's emulated model (``bench.models``: scaled layer bytes, nominal compute) goes to
   ``policies.planner.plan_shim`` with the calibrated costs; bucket sizes 25, 5 and 1 MB and partitions none,
   4 MB and 1 MB of the full-size model, divided by ``param_scale`` as ``bench.priority`` scales bucket sizes.
3. **Measuring**: per profile one worker set runs, interleaved in rotating order for ``rounds`` rounds:
   ``compute`` (the realised compute floor), ``ddp``, ``app_order`` (the shim on one level), ``shim_overlap``
   (layer order on 4 levels; ``bench.priority``'s 5 MB buckets), and the planner's chosen configuration plus up to
   ``candidates`` others it considered (``bench.worker training --configs``).
4. **Predicting**: every measured configuration is predicted by ``policies.execution`` from the calibration of
   step 1 and the profile with its compute scaled to the compute measured in step 3 (compute median / nominal:
   the issue allows measured per-layer times).

Measured figures are medians over the steady-state iterations of all rounds, per iteration the slowest rank's
time (``bench.worker training``): each round's first timed iteration follows ``flush()`` and is left out (its forward
waits for nothing, in the overlap modes).

Result: ``result["profiles"][name][policy] = {"predicted_s", "measured_s", "error", "within_15pct"}`` (policy:
``ddp``, ``app_order``, ``shim_overlap``), ``result["planner"][name] = {"chosen", "chosen_s", "best_s", "best",
"ratio", "within_5pct", "candidates": [...]}``, plus ``rate``, ``hosts``, ``rounds``, ``iters``, ``elapsed_s`` and
``calibration``. ``format_table(result)`` renders both tables as Markdown.

Usage: ``python -m bench.validate --json validate.json [--quick]`` (root: it builds network namespaces), or
``run(quick=True)`` from Python.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, replace

from bench.workers import cli, needs_root, progress_printer, scratch_dir, show_figures

PROFILES = ("resnet50", "vgg16", "bert_base")
POLICIES = ("ddp", "app_order", "shim_overlap")
TOLERANCE = 0.15          # |predicted / measured - 1| the issue accepts
PLANNER_TOLERANCE = 0.05  # chosen / best measured - 1 the issue accepts
AGENT_LEVELS = 5
SHIM_LEVELS = 4           # shim_overlap's levels (bench.priority's)
SHIM_BUCKET_MB = 5.0      # MB of the full-size model (bench.priority's shim buckets)
DDP_BUCKET_MB = 25.0      # DDP's default, of the full-size model
BUCKET_CANDIDATES_MB = (25.0, 5.0, 1.0)
PARTITION_CANDIDATES = (None, 4 << 20, 1 << 20)
MiB = 1 << 20


# ------------------------------------------------------------------------------------------- pure helpers

def emulated_profile(name: str, param_scale: float, compute_scale: float, compute_factor: float = 1.0):
    """The emulated model of ``bench.models`` as a :class:`policies.model.Profile`: the scaled float32 layer bytes,
    compute times x ``compute_scale * compute_factor``, a chain (the emulated model is a Sequential).

    Usage: ``emulated_profile("vgg16", 30, 2.484)``
    """
    from bench.models import layer_numels
    from tensorlane.policies.model import Profile, load_profile, scaled

    p = load_profile(name)
    layers = tuple(replace(layer, params_bytes=4 * n)
                   for layer, n in zip(p.layers, layer_numels(p, param_scale), strict=True))
    return scaled(Profile(p.name, layers), compute_scale * compute_factor)


def calibration_costs(cal: dict, ranks: int) -> dict:
    """Fit the calibration worker's measurements: ``alpha_s`` and ``link_bps`` from the medians per size of the
    timed all-reduces (``policies.execution.fit_alpha_beta``), plus the host costs.

    Usage: ``calibration_costs(worker_json["modes"]["calibrate"]["calibration"], ranks=2)``
    """
    from tensorlane.policies.execution import fit_alpha_beta

    by_size: dict[int, list[float]] = {}
    for nbytes, secs in cal["samples"]:
        by_size.setdefault(int(nbytes), []).append(float(secs))
    medians = sorted((b, statistics.median(v)) for b, v in by_size.items())
    alpha, link = fit_alpha_beta(medians, ranks)
    return {"alpha_s": alpha, "link_bps": link, "launch_s": float(cal["launch_s"]),
            "wake_s": float(cal["wake_s"]), "copy_bps": float(cal["copy_bps"]),
            # measured, but not applied: the shim's overlap mode no longer runs a Python callback per piece
            "callback_measured_s": float(cal.get("callback_s", 0.0)), "callback_s": 0.0,
            "allreduce_medians_s": {str(b): t for b, t in medians}}


def _cost_host(costs: dict, ranks: int):
    """The calibrated ``(CostModel, HostCosts)`` of ``policies.execution`` for ``ranks`` ranks."""
    from tensorlane.policies.execution import HostCosts
    from tensorlane.policies.model import CostModel

    return (CostModel(ranks, costs["link_bps"], 0.0, costs["alpha_s"]),
            HostCosts(launch_s=costs["launch_s"], copy_bps=costs["copy_bps"], wake_s=costs["wake_s"],
                      callback_s=costs.get("callback_s", 0.0)))


def setting_of(policy: str, param_scale: float) -> dict:
    """The shim/DDP setting of a fixed policy, as in ``bench.worker training`` (bucket sizes in bytes of the emulated
    model).

    Usage: ``setting_of("shim_overlap", 5)``
    """
    shim_bucket = int(SHIM_BUCKET_MB / param_scale * MiB)
    if policy == "ddp":
        return {"kind": "ddp", "bucket_bytes": int(DDP_BUCKET_MB / param_scale * MiB)}
    if policy == "app_order":
        return {"kind": "shim", "policy": "flat", "levels": 1, "partition_bytes": None, "bucket_bytes": shim_bucket}
    if policy == "shim_overlap":
        return {"kind": "shim", "policy": "layer_order", "levels": SHIM_LEVELS, "partition_bytes": None,
                "bucket_bytes": shim_bucket}
    raise ValueError(f"unknown policy {policy!r}")


def predict(setting: dict, profile, costs: dict, ranks: int) -> float:
    """Predicted iteration seconds of one setting (``setting_of`` or a planner candidate) on ``profile``.

    Usage: ``predict(setting_of("ddp", 5), emulated_profile("resnet50", 5, 10.416), costs, 2)``
    """
    from tensorlane.policies.execution import ddp_iteration, shim_iteration
    from tensorlane.policies.planner import shim_levels

    cost, host = _cost_host(costs, ranks)
    if setting["kind"] == "ddp":
        return ddp_iteration(profile, cost, setting["bucket_bytes"], host=host).iter_s
    levels = shim_levels(profile, setting["policy"], setting["levels"])
    return shim_iteration(profile, cost, levels, setting["bucket_bytes"], setting["partition_bytes"],
                          host=host).iter_s


def candidate_setting(c) -> dict:
    """A planner candidate (``policies.planner.ShimCandidate``) as a setting for :func:`predict`."""
    return {"kind": "shim", "policy": c.policy, "levels": c.levels, "partition_bytes": c.partition_bytes,
            "bucket_bytes": c.bucket_bytes}


def pick_candidates(plan, others: int) -> list:
    """The chosen candidate and up to ``others`` more to measure against it: the best with another number of
    levels, the best with another bucket size, the best with another partition, the best flat one (in that order,
    distinct). Usage: ``pick_candidates(plan_shim(...), 3)``
    """
    cands = sorted(plan.candidates, key=lambda c: c.predicted_iter_s)
    chosen = next(c for c in cands if (c.policy, c.levels, c.partition_bytes, c.bucket_bytes)
                  == (plan.policy, plan.levels, plan.partition_bytes, plan.bucket_bytes))
    picks = [chosen]
    rules = (lambda c: c.levels != chosen.levels, lambda c: c.bucket_bytes != chosen.bucket_bytes,
             lambda c: c.partition_bytes != chosen.partition_bytes, lambda c: c.policy == "flat")
    for rule in rules:
        if len(picks) > others:
            break
        c = next((c for c in cands if rule(c) and c not in picks), None)
        if c is not None:
            picks.append(c)
    return picks


def _same(setting: dict, c) -> bool:
    """Whether ``setting`` is the shim configuration of planner candidate ``c``."""
    return setting.get("kind") == "shim" and (setting["policy"], setting["levels"], setting["partition_bytes"],
                                              setting["bucket_bytes"]) == (c.policy, c.levels, c.partition_bytes,
                                                                           c.bucket_bytes)


def steady_median(times: list[float], iters: int) -> float:
    """Median of the steady-state iterations: ``times`` holds ``iters`` per round, and each round's first one is
    left out when there are more (it follows ``flush()``, so its forward waits for nothing in the overlap modes).

    Usage: ``steady_median([0.8, 1.0, 1.1, 0.8, 1.2, 1.0], 3) == 1.05``
    """
    if iters < 2:
        return statistics.median(times)
    return statistics.median([t for k, t in enumerate(times) if k % iters])


def judge(predicted: float, measured: float) -> dict:
    """``{"predicted_s", "measured_s", "error", "within_15pct"}``; error = predicted / measured - 1."""
    err = predicted / measured - 1
    return {"predicted_s": predicted, "measured_s": measured, "error": err, "within_15pct": abs(err) <= TOLERANCE}


# ---------------------------------------------------------------------------------------------------- runner

@dataclass
class _Bench:
    """What every step of one validation run shares: the testbed, its ranks and agents, the run's sizes and (after
    step 1) the calibrated costs."""

    tb: object
    ranks: list[int]
    workdir: str
    sockets: dict[int, str]
    rounds: int
    iters: int
    warmup: int
    comm_target: float
    progress: object
    costs: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        """The number of ranks."""
        return len(self.ranks)


def calibrate(b: _Bench, port: int, profile: str) -> dict:
    """Step 1: the calibration worker set on ``profile``'s emulated model; sets ``b.costs`` and returns them with
    the worker's raw measurements under ``raw``."""
    from bench.models import balanced_scales
    from bench.priority import run_training

    link = b.tb.rate_bps
    ps0, cs0 = balanced_scales(profile, link, b.n, b.comm_target)
    r = run_training(b.tb, b.ranks, port, profile, "calibrate", 1, 0, ps0, cs0, b.workdir, "calibrate",
                     levels=AGENT_LEVELS, job="val-cal", timeout=180)
    cal = r["modes"]["calibrate"]["calibration"]
    b.costs = costs = calibration_costs(cal, b.n)
    b.progress(f"calibration: alpha {costs['alpha_s'] * 1e3:.2f} ms, link {costs['link_bps'] / 1e6:.1f} Mbit/s "
               f"payload ({costs['link_bps'] / link:.3f} of nominal), launch "
               f"{costs['launch_s'] * 1e6:.0f} us, wake {costs['wake_s'] * 1e6:.0f} us, callback stall "
               f"{costs['callback_s'] * 1e6:.0f} us, copy "
               f"{costs['copy_bps'] / 1e9:.2f} GB/s")
    return {**costs, "raw": cal}


def plan(b: _Bench, prof: str, ps: float, base_profile, others: int):
    """Step 2: ``plan_shim`` on the emulated model (nominal compute, calibrated network and host); returns the plan,
    the candidates to measure (the chosen one first) and the ``--configs`` of those no fixed policy measures."""
    from tensorlane.policies.planner import plan_shim

    t0 = time.perf_counter()
    shim_plan = plan_shim(base_profile, b.n, b.costs["link_bps"], levels_max=AGENT_LEVELS,
                          bucket_bytes=tuple(int(mb / ps * MiB) for mb in BUCKET_CANDIDATES_MB),
                          partitions=tuple(None if p is None else int(p / ps) for p in PARTITION_CANDIDATES),
                          alpha_s=b.costs["alpha_s"], host=_cost_host(b.costs, b.n)[1], payload_fraction=1.0)
    plan_s = time.perf_counter() - t0
    picks = pick_candidates(shim_plan, others)
    b.progress(f"{prof}: plan_shim chose {shim_plan.label} (predicted {shim_plan.predicted_iter_s * 1e3:.0f} ms, "
               f"{len(shim_plan.candidates)} candidates, {plan_s * 1e3:.0f} ms); measuring "
               + ", ".join(c.label for c in picks))
    configs: dict[str, dict] = {}
    for k, c in enumerate(picks):
        if any(_same(setting_of(p, ps), c) for p in POLICIES if p != "ddp"):
            continue  # measured anyway as app_order / shim_overlap
        configs[f"cand{k}"] = {"base": "shim_overlap", "levels": c.levels, "policy": c.policy,
                               "partition_bytes": c.partition_bytes, "bucket_cap_mb": c.bucket_bytes / MiB}
    return shim_plan, picks, configs


def measure(b: _Bench, port: int, prof: str, ps: float, cs: float, modes: list[str], configs: dict,
            lb: float) -> tuple[dict, dict]:
    """Step 3: one worker set runs ``modes`` interleaved; returns the steady-state median per mode and the record
    of each mode (``result["measured"][prof]``)."""
    import json

    from bench.priority import run_training

    extra = ["--rounds", str(b.rounds), "--shim-bucket-cap-mb", f"{SHIM_BUCKET_MB / ps:g}"]
    if configs:
        extra += ["--configs", json.dumps(configs)]
    b.progress(f"{prof}: param_scale {ps:g}, compute_scale {cs:g}, lower bound {lb:.3f} s; modes "
               + ",".join(modes))
    r = run_training(b.tb, b.ranks, port, prof, ",".join(modes), b.iters, b.warmup, ps, cs, b.workdir, prof,
                     levels=SHIM_LEVELS, job=f"val-{prof}", sockets=b.sockets, extra=extra,
                     timeout=180 + b.rounds * len(modes) * (b.iters + b.warmup + 3) * 6 * lb)
    med = {m: steady_median(r["modes"][m]["times_s"], b.iters) for m in modes}
    keys = ("times_s", "shim_stats", "phases_s", "device_idle_s", "device_idle_per_iter_s", "local_times_s")
    record = {m: {"median_s": med[m], "median_all_s": r["modes"][m]["median_s"],
                  **{k: r["modes"][m].get(k) for k in keys}} for m in modes}
    return med, record


def _candidate_row(b: _Bench, c, mode: str, chosen: bool, profile_f, measured_s: float) -> dict:
    """One measured planner candidate: its label, mode, planned seconds, and predicted (measured compute) vs
    measured."""
    return {"label": c.label, "mode": mode, "planned_s": c.predicted_iter_s, "ops": c.ops, "chosen": chosen,
            **judge(predict(candidate_setting(c), profile_f, b.costs, b.n), measured_s)}


def planner_figures(b: _Bench, shim_plan, picks: list, configs: dict, ps: float, profile_f, med: dict) -> dict:
    """Step 4 for the planner: every measured candidate (and app_order / shim_overlap when the planner considered
    them) predicted and judged; the chosen one against the best measured."""
    fixed = [p for p in POLICIES if p != "ddp"]
    rows = []
    for k, c in enumerate(picks):
        mode = f"cand{k}" if f"cand{k}" in configs else next(p for p in fixed if _same(setting_of(p, ps), c))
        rows.append(_candidate_row(b, c, mode, k == 0, profile_f, med[mode]))
    for pol in ("app_order", "shim_overlap"):  # measured anyway: compare them too when considered
        c = next((c for c in shim_plan.candidates if _same(setting_of(pol, ps), c)), None)
        if c is not None and all(row["mode"] != pol for row in rows):
            rows.append(_candidate_row(b, c, pol, False, profile_f, med[pol]))
    best = min(rows, key=lambda row: row["measured_s"])
    chosen = rows[0]
    ratio = chosen["measured_s"] / best["measured_s"]
    for row in rows:
        b.progress(f"  {row['label']:32s} measured {row['measured_s'] * 1e3:6.0f} ms, predicted "
                   f"{row['predicted_s'] * 1e3:6.0f} ms" + ("  <- chosen" if row["chosen"] else ""))
    b.progress(f"  planner: chosen / best measured = {ratio:.3f}")
    return {"chosen": chosen["label"], "chosen_s": chosen["measured_s"], "best": best["label"],
            "best_s": best["measured_s"], "ratio": ratio, "within_5pct": ratio <= 1 + PLANNER_TOLERANCE,
            "candidates": rows, "considered": len(shim_plan.candidates)}


def validate_profile(b: _Bench, result: dict, prof: str, port: int, with_planner: bool, others: int) -> None:
    """Steps 2-4 for one profile: plan (``with_planner``), measure, predict; the figures go into ``result``."""
    from bench.models import balanced_scales, compute_s, lower_bound_s

    ps, cs = balanced_scales(prof, b.tb.rate_bps, b.n, b.comm_target)
    nominal = compute_s(prof, cs)
    shim_plan, picks, configs = plan(b, prof, ps, emulated_profile(prof, ps, cs), others) if with_planner \
        else (None, [], {})
    modes = ["compute", *POLICIES, *configs]
    lb = lower_bound_s(prof, b.n, b.tb.rate_bps, ps, cs)
    med, result["measured"][prof] = measure(b, port, prof, ps, cs, modes, configs, lb)
    factor = med["compute"] / nominal
    profile_f = emulated_profile(prof, ps, cs, factor)
    figs: dict = {"param_scale": ps, "compute_scale": cs, "compute_nominal_s": nominal,
                  "compute_s": med["compute"], "compute_factor": factor, "lower_bound_s": lb}
    for pol in POLICIES:
        figs[pol] = judge(predict(setting_of(pol, ps), profile_f, b.costs, b.n), med[pol])
        b.progress(f"  {pol:13s} measured {med[pol] * 1e3:6.0f} ms, predicted "
                   f"{figs[pol]['predicted_s'] * 1e3:6.0f} ms ({figs[pol]['error']:+.1%})")
    result["profiles"][prof] = figs
    if shim_plan is not None:
        result["planner"][prof] = planner_figures(b, shim_plan, picks, configs, ps, profile_f, med)


def run(profiles=PROFILES, quick: bool = False, rate: str = "200mbit", hosts: int = 2, rounds: int | None = None,
        iters: int | None = None, warmup: int | None = None, candidates: int | None = None,
        planner_profiles=None, name: str = "tv", progress=print, port_base: int = 29700,
        comm_s: float | None = None, workdir: str | None = None) -> dict:
    """Calibrate, plan, measure and predict on a fresh testbed ``name`` (see the module docstring).

    ``candidates``: planner candidates measured besides the chosen one (default 2, quick 1; ``app_order`` and
    ``shim_overlap`` are compared too when the planner considered them);
    ``planner_profiles``: the profiles whose candidates are measured (default: all of ``profiles``).
    Usage: ``run(profiles=("resnet50",), quick=True)``
    """
    from bench.agents import running_agents
    from bench.models import DEFAULT_COMM_S
    from testbed import Testbed

    if hosts < 2:
        raise ValueError("validation needs at least 2 hosts")
    rounds = rounds or (1 if quick else 3)
    iters = iters or (3 if quick else 6)
    warmup = warmup if warmup is not None else (1 if quick else 2)
    others = candidates if candidates is not None else (1 if quick else 2)
    planner_profiles = tuple(profiles if planner_profiles is None else planner_profiles)
    comm_target = comm_s or DEFAULT_COMM_S
    progress = progress or (lambda *a, **k: None)
    result: dict = {"rate": rate, "hosts": hosts, "ranks": hosts, "rounds": rounds, "iters": iters, "warmup": warmup,
                    "quick": quick, "comm_s_target": comm_target, "agent_levels": AGENT_LEVELS,
                    "tolerance": TOLERANCE, "planner_tolerance": PLANNER_TOLERANCE, "profiles": {}, "planner": {},
                    "measured": {}}
    t_start = time.monotonic()
    progress(f"testbed {name}: {hosts} hosts at {rate}; profiles {', '.join(profiles)}; {rounds} round(s) of "
             f"{iters} timed iterations (+{warmup} warm-up); planner candidates measured: chosen + {others}")
    with scratch_dir(workdir, "tensorlane-validate-") as workdir, Testbed(hosts=hosts, rate=rate, name=name) as tb, \
            running_agents(tb, levels=AGENT_LEVELS, workdir=os.path.join(workdir, "agents")) as agents:
        result["link_bps_nominal"] = tb.rate_bps
        b = _Bench(tb, list(range(1, hosts + 1)), workdir, {i: a.socket for i, a in agents.items()}, rounds,
                   iters, warmup, comm_target, progress)
        result["calibration"] = calibrate(b, port_base, profiles[0])
        for k, prof in enumerate(profiles, start=1):
            validate_profile(b, result, prof, port_base + k, prof in planner_profiles, others)
    result["elapsed_s"] = time.monotonic() - t_start
    result["pass"] = {"predictions": all(f[p]["within_15pct"] for f in result["profiles"].values() for p in POLICIES),
                      "planner": all(v["within_5pct"] for v in result["planner"].values())}
    return result


NAMES = {"resnet50": "ResNet-50", "vgg16": "VGG-16", "bert_base": "BERT-base"}
POLICY_NAMES = {"ddp": "plain DDP", "app_order": "shim, 1 level (app order)",
                "shim_overlap": "shim, layer order, 4 levels"}


def format_table(result: dict) -> str:
    """Markdown: predicted vs measured per profile x policy, then the planner's choice vs the measured candidates."""
    lines = ["| profile | policy | measured | predicted | error | within 15% |", "|---|---|---:|---:|---:|---|"]
    for prof, f in result["profiles"].items():
        for pol in POLICIES:
            if pol in f:
                j = f[pol]
                lines.append(f"| {NAMES.get(prof, prof)} | {POLICY_NAMES[pol]} | {j['measured_s'] * 1e3:.0f} ms | "
                             f"{j['predicted_s'] * 1e3:.0f} ms | {j['error']:+.1%} | "
                             f"{'yes' if j['within_15pct'] else 'NO'} |")
    if result.get("planner"):
        lines += ["", "| profile | candidate | planned | measured | predicted (measured compute) |",
                  "|---|---|---:|---:|---:|"]
        for prof, pl in result["planner"].items():
            for row in pl["candidates"]:
                mark = " **(chosen)**" if row["chosen"] else ""
                best = " (best)" if row["label"] == pl["best"] else ""
                lines.append(f"| {NAMES.get(prof, prof)} | `{row['label']}`{mark}{best} | "
                             f"{row['planned_s'] * 1e3:.0f} ms | {row['measured_s'] * 1e3:.0f} ms | "
                             f"{row['predicted_s'] * 1e3:.0f} ms |")
        lines += ["", "| profile | chosen | measured | best measured | chosen / best (<= 1.05) |",
                  "|---|---|---:|---|---:|"]
        for prof, pl in result["planner"].items():
            lines.append(f"| {NAMES.get(prof, prof)} | `{pl['chosen']}` | {pl['chosen_s'] * 1e3:.0f} ms | "
                         f"`{pl['best']}` {pl['best_s'] * 1e3:.0f} ms | {pl['ratio']:.3f} "
                         f"{'met' if pl['within_5pct'] else 'MISSED'} |")
    c = result.get("calibration")
    if c:
        lines += ["", (f"calibration: alpha {c['alpha_s'] * 1e3:.2f} ms, link {c['link_bps'] / 1e6:.1f} Mbit/s "
                       f"payload, launch {c['launch_s'] * 1e6:.0f} us, wake {c['wake_s'] * 1e6:.0f} us, callback stall "
                       f"{c.get('callback_s', 0) * 1e6:.0f} us, copy "
                       f"{c['copy_bps'] / 1e9:.2f} GB/s; {result['rounds']} round(s) x {result['iters']} iterations"
                       f"{' (quick)' if result.get('quick') else ''}, {result.get('elapsed_s', 0):.0f} s")]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m bench validate [--quick] [--json FILE] ...``: run, print the tables."""
    p = argparse.ArgumentParser(prog="python -m bench validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--quick", action="store_true", help="one round of 3 iterations, one other candidate")
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--planner-profiles", default=None,
                   help="profiles whose planner candidates are measured (default: all of --profiles)")
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None, help="rounds of interleaved modes (default 3, quick 1)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per mode and round (default 6, quick 3)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--candidates", type=int, default=None,
                   help="planner candidates measured besides the chosen one (default 2, quick 1)")
    p.add_argument("--comm-s", type=float, default=None, help="seconds of communication the scales aim at (0.75)")
    p.add_argument("--name", default="tv", help="testbed name (namespaces NAME-h1.., NAME-sw)")
    args = p.parse_args(argv)
    if needs_root("the validation"):
        return 2
    profiles = tuple(x for x in args.profiles.split(",") if x)
    planner = None if args.planner_profiles is None else tuple(x for x in args.planner_profiles.split(",") if x)
    result = run(profiles=profiles, quick=args.quick, rate=args.rate, hosts=args.hosts, rounds=args.rounds,
                 iters=args.iters, warmup=args.warmup, candidates=args.candidates, planner_profiles=planner,
                 name=args.name, progress=progress_printer(), comm_s=args.comm_s)
    show_figures(format_table(result), result, args.json)
    return 0 if all(result["pass"].values()) else 1


if __name__ == "__main__":
    cli(main, sigterm=True)  # python -m bench.X: SIGTERM unwinds like Ctrl-C, the testbed is removed
