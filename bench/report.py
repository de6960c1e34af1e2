"""The results page and the README's headline block, made from the benchmarks' JSON files: one table with a row per
figure (ours, the alternative it was measured beside, their ratio, the target and whether it was met or by how much it
was missed), a line per benchmark (machine, link rate, repetitions, duration), one PNG plot per benchmark and the
predicted-vs-measured tables of ``validate``.

Inputs (``--results``, default ``results/``): ``contention.json``, ``priority.json``, ``jobs.json``,
``control-plane.json``, ``shim-overhead.json``, ``realtrain.json`` and, optionally, ``classifier.json`` and
``validate.json``, each written by ``python -m bench NAME --json results/NAME.json``. A missing file gives a "not run"
row; a missing key shows "-".

Outputs: ``--page`` (default ``README.md`` in the results directory: ``results/README.md``), written whole; in
``--readme`` only the short block between ``<!-- perf-table:begin -->`` and ``<!-- perf-table:end -->`` (a headline
figure per benchmark and a link to the page); in ``--jobs-doc`` (default ``docs/jobs-measured.md`` beside the
README, when it exists) only the jobs benchmark's per-policy table between ``<!-- jobs-figures:begin -->`` and
``<!-- jobs-figures:end -->``; ``--img-dir``/bench-NAME.png. Running it twice changes nothing. ``--check`` writes
nothing and exits 1 when the page, a block or a plot is not what the JSON files give.

Usage: ``python -m bench.report [--results results] [--readme README.md] [--page results/README.md]
[--jobs-doc docs/jobs-measured.md] [--img-dir docs/img] [--check] [--print]`` (also ``make report``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

BEGIN = "<!-- perf-table:begin -->"
END = "<!-- perf-table:end -->"
# The jobs benchmark's per-policy table in docs/jobs-measured.md (beside the README, when that file exists)
FIGURES_BEGIN = "<!-- jobs-figures:begin -->"
FIGURES_END = "<!-- jobs-figures:end -->"
JOBS_DOC = os.path.join("docs", "jobs-measured.md")
# (name, file, required): the order of the table
BENCHES = (("contention", "contention.json", True), ("priority", "priority.json", True), ("jobs", "jobs.json", True),
           ("control-plane", "control-plane.json", True), ("shim-overhead", "shim-overhead.json", True),
           ("realtrain", "realtrain.json", True), ("classifier", "classifier.json", False))
PROFILE_NAMES = {"resnet50": "ResNet-50", "vgg16": "VGG-16", "bert_base": "BERT-base"}
DASH = "-"
INFORMATIONAL = "none (informational)"
# The README's headline block: per benchmark its first row, or the rows whose figure holds this text
HEADLINE = {"priority": "shim vs plain DDP", "control-plane": "register p99, 10,000"}
# Where each benchmark's method is described (repository-relative), linked from the results page
METHOD_DOCS = {"contention": "docs/benchmarks.md#contention", "priority": "docs/priority.md",
               "jobs": "docs/jobs-measured.md",
               "control-plane": "docs/benchmarks.md#control-plane",
               "shim-overhead": "docs/benchmarks.md#shim-overhead", "realtrain": "docs/benchmarks.md#realtrain",
               "classifier": "docs/classifier.md", "validate": "docs/policies.md#predicted-vs-measured"}
VALIDATE_POLICIES = {"ddp": "plain DDP", "app_order": "application order (1 level)",
                     "shim_overlap": "shim (overlap mode)"}


class ReportError(RuntimeError):
    """The README cannot be updated (markers missing or out of order, file unreadable); the message says why."""


@dataclasses.dataclass
class Row:
    """One figure of the table; :func:`judged` fills ``target``, ``result`` and ``missed`` from a verdict."""

    bench: str
    figure: str
    ours: str = DASH
    alternatives: str = DASH
    ratio: str = DASH
    target: str = DASH
    result: str = DASH
    missed: str | None = None   # "by how much", for the summary of missed targets


# ---------------------------------------------------------------------------------------------------- formatting

def num(v) -> float | None:
    """``v`` as a float if it is a finite number, else None. Usage: ``num("x") is None``"""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def fmt_s(v, unit: str | None = None) -> str:
    """Seconds for the table: ``446 ms``, ``8.4 ms``, ``12.3 s``; ``-`` if missing. ``unit`` ("ms" or "s") forces
    one unit (see :func:`time_unit`). Usage: ``fmt_s(0.446) == "446 ms"``, ``fmt_s(7.0, "s") == "7.00 s"``
    """
    v = num(v)
    if v is None:
        return DASH
    unit = unit or time_unit(v)
    if unit == "s":
        return f"{v:.2f} s" if v < 100 else f"{v:.0f} s"
    return f"{v * 1000:.1f} ms" if v < 0.01 else f"{v * 1000:.0f} ms"


def time_unit(*values) -> str:
    """The unit for a row of times, so that they read alike: "s" when the largest is 10 s or more, else "ms"."""
    vals = [num(v) for v in values if num(v) is not None]
    return "s" if vals and max(vals) >= 10 else "ms"


def timer(*values):
    """A formatter with the unit :func:`time_unit` picks for ``values``. Usage: ``t = timer(a, b); t(a)``"""
    unit = time_unit(*values)
    return lambda v: fmt_s(v, unit)


def fmt_ms(v) -> str:
    """Milliseconds: ``1.08 ms``; ``-`` if missing. Usage: ``fmt_ms(1.083)``"""
    v = num(v)
    return DASH if v is None else f"{v:.2f} ms"


def fmt_x(v) -> str:
    """A ratio: ``0.81``; ``-`` if missing. Usage: ``fmt_x(0.8123)``"""
    v = num(v)
    return DASH if v is None else f"{v:.2f}"


def fmt_bps(v) -> str:
    """Bits per second: ``187 Mbit/s``, ``1.2 Gbit/s``. Usage: ``fmt_bps(187e6)``"""
    v = num(v)
    if v is None:
        return DASH
    return f"{v / 1e9:.3g} Gbit/s" if v >= 1e9 else f"{v / 1e6:.0f} Mbit/s"


def fmt_rate(rate) -> str:
    """A tc-style rate as text: ``"200mbit"`` -> ``200 Mbit/s``; numbers are bits per second."""
    if num(rate) is not None:
        return fmt_bps(rate)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*", str(rate or ""), re.IGNORECASE)
    if not m:
        return str(rate) if rate else DASH
    unit = {"bit": "bit", "kbit": "kbit", "mbit": "Mbit", "gbit": "Gbit"}[m.group(2).lower()]
    return f"{float(m.group(1)):g} {unit}/s"


def ratio_of(a, b) -> float | None:
    """``a / b`` when both are numbers and ``b`` is non-zero, else None."""
    a, b = num(a), num(b)
    return None if a is None or not b else a / b


def verdict(value, op: str, target: float, unit: str = "") -> tuple[str, str | None]:
    """``("met", None)``, ``("missed by 0.03", "0.03")`` or ``("-", None)`` for ``value op target``.

    ``op`` is ``<=``, ``<``, ``>=`` or ``>``; ``unit`` is appended to the margin (" ms"). Usage:
    ``verdict(0.83, "<=", 0.80) == ("**missed** by 0.03", "0.03")``
    """
    v = num(value)
    if v is None:
        return DASH, None
    ok = {"<=": v <= target, "<": v < target, ">=": v >= target, ">": v > target}[op]
    if ok:
        return "met", None
    gap = abs(v - target)
    margin = f"{gap:.2f}{unit}" if gap >= 0.01 else f"{gap:.3f}{unit}"   # never "missed by 0.00"
    return f"**missed** by {margin}", margin


def target_text(op: str, target: float, unit: str = "") -> str:
    """``<= 1.10`` etc. Usage: ``target_text("<=", 10, " ms") == "<= 10 ms"``"""
    return f"{op} {target:g}{unit}" if unit else f"{op} {target:.2f}"


def judged(row: Row, value, op: str, target: float, unit: str = "") -> Row:
    """Fill ``row``'s target and result from ``value op target``; returns the row."""
    row.target = target_text(op, target, unit)
    row.result, row.missed = verdict(value, op, target, unit)
    return row


# ------------------------------------------------------------------------------------------- rows per benchmark

def rows_contention(d: dict) -> list[Row]:
    """Agents vs alone (<= 1.10), FIFO vs alone (>= 2: the contention is real), bulk after training (>= 0.80)."""
    what = "training step" if d.get("workload") == "training" else "all-reduce"
    t = d.get("targets") or {}
    unc, fifo, agent = d.get("uncontended_s"), d.get("fifo_s"), d.get("agent_s")
    ts = timer(unc, fifo, agent)
    agent_ratio = num(d.get("agent_ratio")) if num(d.get("agent_ratio")) is not None else ratio_of(agent, unc)
    fifo_ratio = num(d.get("fifo_ratio")) if num(d.get("fifo_ratio")) is not None else ratio_of(fifo, unc)
    rows = [judged(Row("contention", f"{what} under bulk with agents, vs alone", ts(agent),
                       f"alone {ts(unc)}; FIFO under bulk {ts(fifo)}", fmt_x(agent_ratio)),
                   agent_ratio, "<=", num(t.get("agent_ratio_max")) or 1.10),
            judged(Row("contention", f"{what} under bulk with FIFO NICs, vs alone (contention is real)", ts(fifo),
                       f"alone {ts(unc)}", fmt_x(fifo_ratio)),
                   fifo_ratio, ">=", num(t.get("fifo_ratio_min")) or 2.0)]
    after = d.get("bulk_after_bps") if isinstance(d.get("bulk_after_bps"), dict) else {}
    low = min((num(v) for v in after.values() if num(v) is not None), default=None)
    rows.append(judged(Row("contention", "bulk once training stops (agents on), share of the link", fmt_bps(low),
                           f"link {fmt_bps(d.get('link_bps')) if d.get('link_bps') else fmt_rate(d.get('rate'))}",
                           fmt_x(d.get("bulk_after_ratio"))),
                       d.get("bulk_after_ratio"), ">=", num(t.get("bulk_after_ratio_min")) or 0.80))
    return rows


def dependency_bound_of(d: dict, prof: str, f: dict) -> float | None:
    """The dependency-aware lower bound of one profile: ``lower_bound_dep_s`` as recorded, else derived from what
    older files hold (the profile's name, ``param_scale``, ``compute_scale``, the run's ``ranks`` or ``hosts`` and
    ``link_bps`` or ``rate``) with ``bench.models.dependency_bound``; None when that is not enough.

    Usage: ``dependency_bound_of(priority_json, "bert_base", priority_json["profiles"]["bert_base"])``
    """
    if num(f.get("lower_bound_dep_s")) is not None:
        return num(f["lower_bound_dep_s"])
    ps, cs = num(f.get("param_scale")), num(f.get("compute_scale"))
    ranks = num(d.get("ranks")) or num(d.get("hosts"))
    rate = num(d.get("link_bps")) or (d.get("rate") if isinstance(d.get("rate"), str) else None)
    if ps is None or cs is None or not ranks or not rate:
        return None
    try:
        from bench.models import dependency_bound

        return dependency_bound(prof, int(ranks), rate, ps, cs)["lower_bound_dep_s"]
    except Exception:  # noqa: BLE001 - an unknown profile or rate: no figure, not a crash
        return None


def rows_priority(d: dict) -> list[Row]:
    """Per profile: shim vs DDP (<= 0.80), vs the lower bound (<= 1.15), vs the dependency-aware lower bound (no
    target: informational; derived for files that predate it), vs application order (< 1)."""
    t = d.get("targets") or {}
    profiles = d.get("profiles") if isinstance(d.get("profiles"), dict) else {}
    rows = []
    for prof, f in profiles.items():
        f = f if isinstance(f, dict) else {}
        name = PROFILE_NAMES.get(prof, prof)
        shim, ddp, app, lb = f.get("shim_s"), f.get("ddp_s"), f.get("app_order_s"), f.get("lower_bound_s")
        lbd = dependency_bound_of(d, prof, f)
        ts = timer(shim, ddp, app, lb, lbd)
        rows.append(judged(Row("priority", f"{name}: shim vs plain DDP", ts(shim), f"DDP {ts(ddp)}",
                               fmt_x(ratio_of(shim, ddp))), ratio_of(shim, ddp), "<=",
                           num(t.get("shim_vs_ddp_max")) or 0.80))
        rows.append(judged(Row("priority", f"{name}: shim vs lower bound", ts(shim), f"lower bound {ts(lb)}",
                               fmt_x(ratio_of(shim, lb))), ratio_of(shim, lb), "<=",
                           num(t.get("shim_vs_lower_bound_max")) or 1.15))
        rows.append(Row("priority", f"{name}: shim vs dependency-aware lower bound", ts(shim),
                        f"dependency-aware lower bound {ts(lbd)}", fmt_x(ratio_of(shim, lbd)), INFORMATIONAL))
        rows.append(judged(Row("priority", f"{name}: shim vs application order only", ts(shim),
                               f"app order {ts(app)}", fmt_x(ratio_of(shim, app))), ratio_of(shim, app), "<", 1.0))
    if not rows:
        rows.append(Row("priority", "no profile in the file"))
    return rows


def rows_jobs(d: dict) -> list[Row]:
    """The jobs benchmark's rows: per mix (``mixes``, :func:`rows_jobs_mixes`), or, in a file of the earlier
    benchmark (``runs`` per job count), :func:`rows_jobs_runs`."""
    return rows_jobs_mixes(d) if "mixes" in d else rows_jobs_runs(d)


# Every phase with the jobs together, in the order of the tables and plots (bench.jobs' phases)
JOBS_POLICY_NAMES = {"fifo": "FIFO", "static": "static", "rotate": "rotate", "alternate": "alternate",
                     "intensity": "intensity", "shortest": "shortest", "measured_intensity": "measured intensity",
                     "levels": "levels", "static_levels": "static levels", "intensity_hook": "intensity (hook)",
                     "static_present": "static (parts of jobs present)",
                     "intensity_present": "intensity (parts of jobs present)",
                     "static_held": "static (held)", "intensity_held": "intensity (held)",
                     "shortest_held": "shortest (held)", "fifo_control": "FIFO again (A/A control)",
                     "slowdown": "slowdown", "static_auto": "static (job_share auto)",
                     "shortest_auto": "shortest (job_share auto)"}
HELD_S = 0.2  # bench.jobs.HELD_S: the held phases' hold in a file that does not give its own held_s
JOBS_CONTROLS = ("fifo", "fifo_control")  # bench.jobs.CONTROLS: what the policies are judged against, not policies


def _policy_name(policy: str, mix: dict) -> str:
    """A phase's name in the tables and plots; a held phase's with its hold (the mix's ``held_s``)."""
    if policy.endswith("_held"):
        return f"{JOBS_POLICY_NAMES[policy.removesuffix('_held')]} (held {mix.get('held_s', HELD_S):g} s)"
    return JOBS_POLICY_NAMES.get(policy, policy)


def _mix_jobs(mix: dict, policy: str) -> list[dict]:
    """The per-job entries of ``policy`` in ``mix`` (``[]`` when missing or malformed)."""
    pols = mix.get("policies") if isinstance(mix.get("policies"), dict) else {}
    block = pols.get(policy) if isinstance(pols.get(policy), dict) else {}
    jobs = block.get("jobs") if isinstance(block.get("jobs"), list) else []
    return [j for j in jobs if isinstance(j, dict)]


def _avg(jobs: list[dict], key: str) -> float | None:
    """The mean of ``key`` over ``jobs``; None if any is missing."""
    vals = [num(j.get(key)) for j in jobs]
    return None if not vals or any(v is None for v in vals) else sum(vals) / len(vals)


def _largest(jobs: list[dict], key: str) -> tuple[int, float] | None:
    """``(job index, ratio)`` of the largest ``jct_s / key`` over ``jobs``; None if any is missing."""
    ratios = [ratio_of(j.get("jct_s"), j.get(key)) for j in jobs]
    if not ratios or any(r is None for r in ratios):
        return None
    k = max(range(len(ratios)), key=ratios.__getitem__)
    return k, ratios[k]


def _mix_avg_row(mix: dict, rec: str, figure: str, target: float | None) -> Row:
    """Average JCT of the recommended policy against FIFO's (the other policies and alone as alternatives)."""
    rj, fj = _mix_jobs(mix, rec), _mix_jobs(mix, "fifo")
    solo = (mix.get("solo") or {}).get("jobs") if isinstance(mix.get("solo"), dict) else None
    others = [(_policy_name(p, mix), _avg(_mix_jobs(mix, p), "jct_s")) for p in JOBS_POLICY_NAMES
              if p != rec and p not in JOBS_CONTROLS and _mix_jobs(mix, p)]
    avgs = [_avg(rj, "jct_s"), _avg(fj, "jct_s"), *(v for _, v in others)]
    solo_avg = _avg([j for j in solo if isinstance(j, dict)], "jct_s") if isinstance(solo, list) else None
    ts = timer(*avgs, solo_avg)
    bound = ratio_of(solo_avg, avgs[1])  # every job at its solo speed: no policy's average goes below it
    floor = f" ({fmt_x(bound)}x FIFO, a floor: no job beats its time alone)" if bound else ""
    alone = f"alone {ts(solo_avg)}{floor}"
    alts = "; ".join([f"FIFO {ts(avgs[1])}", alone, *(f"{n} {ts(v)}" for n, v in others)])
    value = ratio_of(avgs[0], avgs[1])
    row = Row("jobs", figure, ts(avgs[0]), alts, fmt_x(value))
    if target is None:
        row.target = INFORMATIONAL
        return row
    return judged(row, value, "<=", target)


def _mix_largest_row(mix: dict, rec: str, key: str, label: str, target: float) -> Row:
    """The largest per-job JCT ratio of the recommended policy against ``key`` (FIFO's or alone's JCT)."""
    jobs = _mix_jobs(mix, rec)
    big = _largest(jobs, key)
    name = mix.get("name", DASH)
    if big is None:
        return judged(Row("jobs", f"{name}: largest per-job JCT, {rec} vs {label}"), None, "<=", target)
    k, value = big
    ts = timer(jobs[k].get("jct_s"), jobs[k].get(key))
    return judged(Row("jobs", f"{name}: largest per-job JCT, {rec} vs {label}", ts(jobs[k].get("jct_s")),
                      f"job {k}: {label} {ts(jobs[k].get(key))}", fmt_x(value)), value, "<=", target)


def _mix_oversub_row(mix: dict, target: float) -> Row:
    """The largest per-job JCT ratio against FIFO under any policy (an oversubscribed mix)."""
    worst = None
    pols = mix.get("policies") if isinstance(mix.get("policies"), dict) else {}
    for p in pols:  # every phase the run had, named here or not
        big = _largest(_mix_jobs(mix, p), "fifo_jct_s") if p not in JOBS_CONTROLS else None
        if big is not None and (worst is None or big[1] > worst[2]):
            worst = (p, big[0], big[1])
    row = Row("jobs", f"{mix.get('name', DASH)} (oversubscribed): largest per-job JCT vs FIFO, any policy")
    if worst is None:
        return judged(row, None, "<=", target)
    p, k, value = worst
    j = _mix_jobs(mix, p)[k]
    ts = timer(j.get("jct_s"), j.get("fifo_jct_s"))
    row.ours, row.alternatives, row.ratio = ts(j.get("jct_s")), f"{p}, job {k}: FIFO {ts(j.get('fifo_jct_s'))}", \
        fmt_x(value)
    return judged(row, value, "<=", target)


def rows_jobs_mixes(d: dict) -> list[Row]:
    """Per mix (docs/jobs.md), for the recommended policy: the colliding mix that fits the link first, its average
    JCT vs FIFO's (<= 0.80: the README's headline); on every mix that fits the link the largest per-job JCT vs FIFO
    (<= 1.02) and vs alone (<= 1.15); on a mix that does not, the largest per-job JCT vs FIFO under any policy
    (<= 1.05) and the average vs FIFO (informational)."""
    mixes = [m for m in d.get("mixes") or [] if isinstance(m, dict)]
    t = d.get("targets") if isinstance(d.get("targets"), dict) else {}
    lim = {k: num(t.get(k)) or v for k, v in (("collide_avg_vs_fifo_max", 0.80), ("fits_vs_fifo_max", 1.02),
                                              ("fits_vs_solo_max", 1.15), ("oversub_vs_fifo_max", 1.05))}
    first = [m for m in mixes if m.get("collides") and m.get("fits_link")]
    rows = []
    for mix in first + [m for m in mixes if m not in first]:
        rec, name = str(mix.get("recommended") or d.get("recommended") or "static"), mix.get("name", DASH)
        if mix in first:
            rows.append(_mix_avg_row(mix, rec, f"colliding mix ({name}): average JCT, {rec} vs FIFO",
                                     lim["collide_avg_vs_fifo_max"]))
        if mix.get("fits_link"):
            rows.append(_mix_largest_row(mix, rec, "fifo_jct_s", "FIFO", lim["fits_vs_fifo_max"]))
            rows.append(_mix_largest_row(mix, rec, "solo_jct_s", "alone", lim["fits_vs_solo_max"]))
        else:
            rows.append(_mix_oversub_row(mix, lim["oversub_vs_fifo_max"]))
            rows.append(_mix_avg_row(mix, rec, f"{name} (oversubscribed): average JCT, {rec} vs FIFO", None))
    return rows or [Row("jobs", "no mix in the file")]


def rows_jobs_runs(d: dict) -> list[Row]:
    """The earlier benchmark's file (identical jobs, ``runs`` per job count): average JCT with rotation vs FIFO
    (<= 0.75: >= 25 % better); no job worse than under FIFO (each job's rotation JCT over its FIFO JCT, the
    largest <= 1; lists are job 0 first); worst JCT vs FIFO's."""
    runs = d.get("runs") if isinstance(d.get("runs"), dict) else {}
    target = num((d.get("targets") or {}).get("rotate_vs_fifo_avg_max")) or 0.75
    rows = []
    for n in sorted(runs, key=lambda k: (len(str(k)), str(k))):
        r = runs[n] if isinstance(runs[n], dict) else {}
        avg = num(r.get("rotate_vs_fifo_avg"))
        avg = avg if avg is not None else ratio_of(r.get("rotate_avg_s"), r.get("fifo_avg_s"))
        worst = num(r.get("rotate_worst_vs_fifo_worst"))
        worst = worst if worst is not None else ratio_of(r.get("rotate_worst_s"), r.get("fifo_worst_s"))
        ts = timer(*(r.get(f"{p}_{k}_s") for p in ("fifo", "static", "rotate") for k in ("avg", "worst")))
        rows.append(judged(Row("jobs", f"{n} jobs: average JCT, rotation vs FIFO", ts(r.get("rotate_avg_s")),
                               f"FIFO {ts(r.get('fifo_avg_s'))}; static priority {ts(r.get('static_avg_s'))}",
                               fmt_x(avg)), avg, "<=", target))
        per_job = per_job_ratios(r.get("rotate_jct_s"), r.get("fifo_jct_s"))
        if per_job:
            k = max(range(len(per_job)), key=per_job.__getitem__)
            rows.append(judged(Row("jobs", f"{n} jobs: no job worse than FIFO (largest per-job JCT ratio, job {k})",
                                   ts(r["rotate_jct_s"][k]), f"FIFO {ts(r['fifo_jct_s'][k])}", fmt_x(per_job[k])),
                               per_job[k], "<=", 1.0))
        rows.append(judged(Row("jobs", f"{n} jobs: worst JCT, rotation vs FIFO", ts(r.get("rotate_worst_s")),
                               f"FIFO {ts(r.get('fifo_worst_s'))}; static priority {ts(r.get('static_worst_s'))}",
                               fmt_x(worst)), worst, "<=", 1.0))
    if not rows:
        rows.append(Row("jobs", "no run in the file"))
    return rows


def per_job_ratios(ours, fifo) -> list[float]:
    """Each job's JCT over its FIFO JCT (lists in job order); [] unless both are equal-length lists of numbers."""
    if not isinstance(ours, list) or not isinstance(fifo, list) or len(ours) != len(fifo) or not ours:
        return []
    out = [ratio_of(a, b) for a, b in zip(ours, fifo, strict=True)]
    return [] if any(x is None for x in out) else out


def rows_control_plane(d: dict) -> list[Row]:
    """Register p99 at each size (target <= 10 ms at 10,000 flows) and throughput vs 0 flows (>= 0.90 at 10,000)."""
    sizes = d.get("sizes") if isinstance(d.get("sizes"), dict) else {}
    order = sorted(sizes, key=lambda k: num(_int(k)) or 0)
    if "10000" not in sizes:
        order.append("10000")
    zero = sizes.get("0", {}) if isinstance(sizes.get("0"), dict) else {}
    rows = []
    for size in order:
        f = sizes.get(size) if isinstance(sizes.get(size), dict) else None
        label = f"{_int(size):,} flows" if _int(size) is not None else f"{size} flows"
        if f is None:
            rows.append(Row("control-plane", f"register p99 and throughput, {label}", "not run", result="not run"))
            continue
        row = Row("control-plane", f"register p99, {label} registered", fmt_ms(f.get("register_p99_ms")),
                  f"p50 {fmt_ms(f.get('register_p50_ms'))}")
        rows.append(judged(row, f.get("register_p99_ms"), "<=", 10, " ms") if size == "10000" else row)
        if size != "0":
            row = Row("control-plane", f"iperf3 through the host queue, {label} vs 0", fmt_bps(f.get("throughput_bps")),
                      f"0 flows {fmt_bps(zero.get('throughput_bps'))}", fmt_x(f.get("throughput_ratio")))
            rows.append(judged(row, f.get("throughput_ratio"), ">=", 0.90) if size == "10000" else row)
    return rows + rows_busy_host(d.get("busy_host"))


def rows_busy_host(b) -> list[Row]:
    """The busy host (issue 15): agent CPU (target <= 5 % of a core) and register p99 (<= 5 ms) with 20,000
    sockets open and 8 owners; no row when the run did not include it."""
    if not isinstance(b, dict):
        return []
    setup = f"{b.get('sockets', '-'):,} sockets, {b.get('owners', '-')} owners" if isinstance(
        b.get("sockets"), int) else "busy host"
    cpu = num(b.get("agent_cpu_ratio"))
    row = Row("control-plane", f"agent CPU, {setup}", "-" if cpu is None else f"{100 * cpu:.1f} % of a core",
              f"over {b.get('window_s', '-')} s")
    p99 = Row("control-plane", f"register p99, {setup}", fmt_ms(b.get("register_p99_ms")),
              f"same host without the sockets {fmt_ms(b.get('quiet_register_p99_ms'))}")
    return [judged(row, cpu, "<=", 0.05), judged(p99, b.get("register_p99_ms"), "<=", 5, " ms")]


def _int(text) -> int | None:
    """``text`` as an int, or None when it is not one."""
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def rows_overhead(d: dict) -> list[Row]:
    """Shim step time vs plain DDP, overlap mode (the normal use) and hook mode (both <= 1.05)."""
    t = d.get("targets") or {}
    ddp = d.get("ddp_s")
    ts = timer(ddp, d.get("shim_s"), d.get("shim_hook_s"))
    r = num(d.get("ratio")) if num(d.get("ratio")) is not None else ratio_of(d.get("shim_s"), ddp)
    h = num(d.get("ratio_hook")) if num(d.get("ratio_hook")) is not None else ratio_of(d.get("shim_hook_s"), ddp)
    return [judged(Row("shim-overhead", "step time through the shim (overlap mode) vs plain DDP, link not limiting",
                       ts(d.get("shim_s")), f"DDP {ts(ddp)}", fmt_x(r)), r, "<=",
                   num(t.get("ratio_max")) or 1.05),
            judged(Row("shim-overhead", "step time through the shim (hook mode) vs plain DDP, link not limiting",
                       ts(d.get("shim_hook_s")), f"DDP {ts(ddp)}", fmt_x(h)), h, "<=",
                   num(t.get("ratio_hook_max")) or 1.05)]


def rows_realtrain(d: dict) -> list[Row]:
    """A real CNN under bulk: the shim with clipping (hook mode) and without (overlap) vs plain DDP, no target;
    the loss curves of the shim with clipping and DDP, largest relative difference per step (<= 1e-6)."""
    ddp, clip, noclip = d.get("ddp_s"), d.get("shim_clip_s"), d.get("shim_noclip_s")
    ddp_nc = d.get("ddp_noclip_s")
    ts = timer(ddp, clip, noclip, ddp_nc)
    modes = d.get("modes") if isinstance(d.get("modes"), dict) else {}

    def shim_mode(mode: str) -> str:
        """`` (hook mode)`` etc. as recorded for ``mode``; empty when not recorded."""
        m = modes.get(mode) if isinstance(modes.get(mode), dict) else {}
        found = sorted({x for x in m.get("shim_mode") or [] if isinstance(x, str)})
        return f" ({'/'.join(found)} mode)" if found else ""

    rows = [Row("realtrain", f"shim with clipping{shim_mode('shim_clip')} vs plain DDP with clipping, under bulk",
                ts(clip), f"DDP {ts(ddp)}", fmt_x(ratio_of(clip, ddp)), INFORMATIONAL)]
    if ddp_nc is not None:
        rows.append(Row("realtrain", f"shim without clipping{shim_mode('shim_noclip')} vs plain DDP without "
                        "clipping, under bulk", ts(noclip), f"DDP {ts(ddp_nc)}", fmt_x(ratio_of(noclip, ddp_nc)),
                        INFORMATIONAL))
    rows.append(Row("realtrain", "what clipping costs the shim (hook mode instead of overlap): with vs without",
                    ts(clip), f"without clipping {ts(noclip)}", fmt_x(ratio_of(clip, noclip)), INFORMATIONAL))
    losses = d.get("loss") if isinstance(d.get("loss"), dict) else {}
    tol = num((d.get("targets") or {}).get("loss_max_rel_diff_max")) or 1e-6
    for key, what in (("shim_clip_vs_ddp", "shim with clipping vs plain DDP with clipping"),
                      ("shim_noclip_vs_ddp_noclip", "shim without clipping vs plain DDP without clipping")):
        loss = losses.get(key) if isinstance(losses.get(key), dict) else None
        if loss is None and key != "shim_clip_vs_ddp":
            continue
        loss = loss or {}
        v = num(loss.get("max"))
        row = Row("realtrain", f"loss curve, {what}: largest relative difference per step",
                  DASH if v is None else f"{v:.2g}",
                  f"{loss['exact_steps']} of {loss['steps']} steps bit-equal" if num(loss.get("steps")) else DASH,
                  DASH, f"<= {tol:g}")
        if v is not None:
            row.result, row.missed = ("met", None) if v <= tol else (f"**missed** by {v - tol:.2g}", f"{v - tol:.2g}")
        rows.append(row)
    return rows


def rows_classifier(d: dict) -> list[Row]:
    """The agent's nft map at the largest N against the smallest (no numeric target: not linear in N)."""
    res = [r for r in d.get("results") or [] if isinstance(r, dict)]
    nft = sorted((r for r in res if r.get("mechanism") == "nft-map" and num(r.get("n")) is not None),
                 key=lambda r: r["n"])
    u32 = {r.get("n"): r for r in res if r.get("mechanism") == "u32-linear"}
    none = next((r for r in res if r.get("mechanism") == "none"), {})
    if not nft:
        return [Row("classifier", "no nft-map result in the file")]
    lo, hi = nft[0], nft[-1]
    alt = f"N={lo['n']:,}: {fmt_gbps(lo.get('gbps_median'))}; no classifier {fmt_gbps(none.get('gbps_median'))}"
    if hi["n"] in u32:
        alt += f"; u32 filters, N={hi['n']:,}: {fmt_gbps(u32[hi['n']].get('gbps_median'))}"
    return [Row("classifier", f"one CPU-bound stream through the nft map, N={hi['n']:,} flows vs N={lo['n']:,}",
                fmt_gbps(hi.get("gbps_median")), alt, fmt_x(ratio_of(hi.get("gbps_median"), lo.get("gbps_median"))),
                "not linear in N (no number)", DASH)]


def fmt_gbps(v) -> str:
    """Gigabits per second: ``1.80 Gbit/s``; ``-`` if missing."""
    v = num(v)
    return DASH if v is None else f"{v:.2f} Gbit/s"


ROWS = {"contention": rows_contention, "priority": rows_priority, "jobs": rows_jobs,
        "control-plane": rows_control_plane, "shim-overhead": rows_overhead, "realtrain": rows_realtrain,
        "classifier": rows_classifier}


# ------------------------------------------------------------------------------------------- run descriptions

def describe_machine(d: dict) -> str:
    """``2 cores, 23.5 GiB, Linux 6.18.44, Python 3.11.7, torch 2.13.0+cpu, 2026-11-22`` from ``d["machine"]``."""
    m = d.get("machine")
    if not isinstance(m, dict):   # the classifier records its own few facts
        m = {"cores": d.get("cpus"), "kernel": d.get("kernel")} if d.get("kernel") or d.get("cpus") else {}
    parts = []
    cores = num(m.get("cores")) or num(m.get("cpus"))
    if cores:
        parts.append(f"{int(cores)} cores")
    if num(m.get("memory_bytes")):
        parts.append(f"{m['memory_bytes'] / 2**30:.1f} GiB")
    elif num(m.get("mem_gib")):
        parts.append(f"{m['mem_gib']:.1f} GiB")
    if m.get("kernel"):
        parts.append(f"Linux {m['kernel']}")
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    if m.get("date"):
        parts.append(str(m["date"])[:10])
    if not parts:
        note = d.get("machine") if isinstance(d.get("machine"), str) else d.get("machine_note")
        return f"machine: {note}" if isinstance(note, str) and note else "machine not recorded"
    return ", ".join(parts)


def describe_reps(name: str, d: dict) -> str:
    """How many repetitions each figure summarises, from the keys each benchmark records."""
    it, rounds = num(d.get("iters")), num(d.get("rounds"))
    if name == "contention":
        return f"median of {int(it)} iterations per phase" if it else "repetitions not recorded"
    if name == "priority":
        if it and rounds:
            return f"median of {int(it * rounds)} iterations per mode ({_rounds(rounds, it)})"
        return "repetitions not recorded"
    if name == "realtrain":
        if it and rounds:
            steps = f" ({int(d['steps'])} per run)" if num(d.get("steps")) else ""
            return (f"median of {int(it * rounds)} iterations per mode ({_rounds(rounds, it)}); the loss of every "
                    f"step{steps}")
        return "repetitions not recorded"
    if name == "shim-overhead":
        reps = num(d.get("reps")) or (it * rounds if it and rounds else None)
        if reps:
            return (f"median of {int(reps)} iterations per mode"
                    + (f" ({_rounds(rounds, it)})" if it and rounds else ""))
        return "repetitions not recorded"
    if name == "classifier":
        if rounds and num(d.get("seconds")):
            each = f"{d['seconds']:g} s"
            return f"median of {_rounds(rounds, each)} per configuration"
        return "repetitions not recorded"
    if name == "jobs" and it:
        reps = num(d.get("reps")) or 1
        return (f"{int(it)} iterations per job; JCT per job " + ("from 1 run" if reps == 1 else
                f"the mean of {int(reps)} repetitions") + " of every phase")
    if name == "control-plane":
        soak = d.get("soak") if isinstance(d.get("soak"), dict) else {}
        text = (f"{int(d['rounds'])} registrations per size" if num(d.get("rounds"))
                else "registrations per size not recorded")
        if num(soak.get("clients")) and num(soak.get("seconds")):
            text += f"; soak {int(soak['clients'])} clients x {soak['seconds']:g} s"
        return text
    for key, what in (("reps", "repetitions"), ("repeats", "repetitions"), ("iters", "iterations"),
                      ("rounds", "rounds")):
        if num(d.get(key)):
            return f"{int(d[key])} {what}"
    return "repetitions not recorded"


def _rounds(rounds, each) -> str:
    """``3 interleaved rounds of 8``, ``1 round of 3``."""
    each = f"{int(each)}" if num(each) is not None else each
    return f"{int(rounds)} interleaved rounds of {each}" if int(rounds) != 1 else f"1 round of {each}"


def describe_setup(name: str, d: dict) -> str:
    """Hosts and link rate (the classifier: a veth pair, no shaping)."""
    if name == "classifier":
        return "two namespaces on a veth pair, one CPU-bound TCP stream (no link shaping)"
    hosts = num(d.get("hosts"))
    rate = fmt_bps(d.get("link_bps")) if num(d.get("link_bps")) else fmt_rate(d.get("rate"))
    text = f"{int(hosts)} hosts at {rate}" if hosts else f"links at {rate}"
    if name == "jobs" and isinstance(d.get("mixes"), list):
        text = f"{_jobs_hosts(d['mixes'])} at {rate}"
    if name == "realtrain":
        m = d.get("model") if isinstance(d.get("model"), dict) else {}
        tr = d.get("train") if isinstance(d.get("train"), dict) else {}
        if num(m.get("params")):
            text += (f"; small CNN ({num(m['params']) / 1e6:.2f} M parameters, {fmt_bytes(m.get('gradient_bytes'))} of "
                     f"gradients, {fmt_s(d.get('comm_s'))} at link rate; compute {fmt_s(d.get('compute_s'))}), "
                     f"batch {m.get('batch_per_rank', DASH)} per rank, bf16 autocast, SGD with "
                     f"{tr.get('warmup_steps', DASH)}-step linear warm-up, clipping at {tr.get('max_norm', DASH)}")
        if num(d.get("bulk_streams")):
            text += f"; iperf3 bulk {int(d['bulk_streams'])} streams each way (unregistered), agents on both hosts"
    if name == "jobs" and isinstance(d.get("mixes"), list):
        names = [m.get("name", DASH) for m in d["mixes"] if isinstance(m, dict)]
        share, parts = num(d.get("min_share")), num(d.get("job_share"))
        text += (f"; mixes {', '.join(map(str, names)) or DASH}, two ranks per job, each on its own host; agents' "
                 f"min_share {DASH if share is None else f'{share:g}'}"
                 + ("" if d.get("min_share_passed") else " (default)"))
        if num(d.get("min_rate_bps")) is not None:  # files from before min_rate have none
            text += f", min_rate {num(d['min_rate_bps']) / 1e6:g} Mbit/s"  # defaults change: the value run with
        if parts is not None:  # files from before job_share have none
            text += f", job_share {parts:g}" + ("" if d.get("job_share_passed") else " (default)")
            text += "".join(f", {v:g} on {', '.join(ns)}" for v, ns in _mixes_apart(d, "job_share").items())
            text += "".join(f", job_hold_s {v:g} on {', '.join(ns)}" for v, ns in _mixes_apart(d, "job_hold_s").items())
    if name == "shim-overhead" and d.get("profile"):
        model = PROFILE_NAMES.get(d["profile"], d["profile"])
        text += (f" (the testbed's highest rate: not the bottleneck); emulated {model}, "
                 f"{fmt_bytes(d.get('gradient_bytes'))} of gradients, {fmt_s(d.get('compute_nominal_s'))} compute")
    return text


def _mixes_apart(d: dict, key: str) -> dict[float, list[str]]:
    """The jobs benchmark's mixes that ran with their own ``key`` (each mix records the agent settings it ran with),
    by value, where it differs from the run's. Usage: ``_mixes_apart(d, "job_share") == {0.95: ["stagger4"]}``"""
    other: dict[float, list[str]] = {}
    for m in d["mixes"]:
        if isinstance(m, dict) and num(m.get(key)) not in (None, num(d.get(key))):
            other.setdefault(num(m[key]), []).append(str(m.get("name", DASH)))
    return other


def _jobs_hosts(mixes: list) -> str:
    """How many hosts the jobs benchmark's mixes ran on: ``2 hosts``, ``2 hosts (4: spread4)``; files from before
    the mixes named their hosts ran every mix on 2."""
    count = {str(m.get("name", DASH)): len(m["hosts"]) if isinstance(m.get("hosts"), list) else 2
             for m in mixes if isinstance(m, dict)}
    common = max(set(count.values()), key=list(count.values()).count) if count else 2
    other: dict[int, list[str]] = {}
    for mix, n in count.items():
        if n != common:
            other.setdefault(n, []).append(mix)
    return f"{common} hosts" + "".join(f" ({n}: {', '.join(ns)})" for n, ns in sorted(other.items()))


def fmt_bytes(v) -> str:
    """Bytes as megabytes: ``5.2 MB``; ``-`` if missing."""
    v = num(v)
    return DASH if v is None else f"{v / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------------- loading

def load_one(path: str) -> dict:
    """``{"path", "data", "error"}`` for one JSON file: ``data`` the object, or ``error`` why it is unreadable;
    neither when the file does not exist. Usage: ``load_one("results/validate.json")["data"]``"""
    entry: dict = {"path": path, "data": None, "error": None}
    if os.path.exists(path):
        try:
            with open(path) as fh:
                data = json.load(fh)
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            entry["data"] = data
        except (OSError, ValueError, TypeError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


def load(results_dir: str) -> dict[str, dict]:
    """``{name: {"path", "required", "data" or "error"}}`` for every benchmark of the table (see :func:`load_one`)."""
    return {name: {**load_one(os.path.join(results_dir, fname)), "required": required}
            for name, fname, required in BENCHES}


# ---------------------------------------------------------------------------------------------------- rendering

def describe_run(name: str, d: dict, plot: str | None) -> str:
    """The line under the table for one benchmark: setup, repetitions, machine, duration, plot link."""
    took = num(d.get("elapsed_s"))
    return (f"- **{name}**{' (quick run)' if d.get('quick') else ''}: {describe_setup(name, d)}; "
            f"{describe_reps(name, d)}; {describe_machine(d)}"
            + (f"; took {took:.0f} s" if took is not None else "") + (f"; [plot]({plot})" if plot else ""))


def _cell(text: str) -> str:
    """``text`` safe inside a markdown table cell (pipes escaped, one line)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def collect(results: dict[str, dict], results_rel: str = "results", img_rel: str | None = "docs/img",
            plots: set[str] | None = None) -> tuple[list[Row], list[str], list[str]]:
    """``(rows, run lines, quick runs)`` of every benchmark in table order: a missing file gives a "not run" row,
    an unreadable one an "unreadable" row. ``plots``: the benchmarks whose PNG exists (linked); None: all with data.
    """
    rows: list[Row] = []
    lines: list[str] = []
    quick: list[str] = []
    for name, _, required in BENCHES:
        entry = results.get(name) or {"data": None, "error": None, "required": required}
        d = entry.get("data")
        if d is None:
            if not entry.get("required", required) and not entry.get("error"):
                continue
            why = f"unreadable ({entry['error']})" if entry.get("error") else "not run"
            rows.append(Row(name, DASH, why, result=why))
            cmd = f"python -m bench {name} --json {results_rel}/{name}.json"
            lines.append(f"- **{name}**: {why}: `{results_rel}/{name}.json`"
                         + ("" if entry.get("error") else f" (`{cmd}`)"))
            continue
        try:
            rows.extend(ROWS[name](d))
        except Exception as exc:  # noqa: BLE001 - a malformed file must not stop the report
            rows.append(Row(name, DASH, f"unreadable ({type(exc).__name__}: {exc})", result="unreadable"))
        if d.get("quick"):
            quick.append(name)
        plot = f"{img_rel}/bench-{name}.png" if img_rel and (plots is None or name in plots) else None
        try:
            lines.append(describe_run(name, d, plot))
        except Exception as exc:  # noqa: BLE001 - as above
            lines.append(f"- **{name}**: run not described ({type(exc).__name__}: {exc})")
    return rows, lines, quick


def table_lines(rows: list[Row]) -> list[str]:
    """The markdown table of ``rows``, header included."""
    out = ["| benchmark | figure | ours | alternative(s) | ratio | target | result |",
           "|---|---|---:|---|---:|---|---|"]
    return out + ["| " + " | ".join(_cell(c) for c in (r.bench, r.figure, r.ours, r.alternatives, r.ratio, r.target,
                                                         r.result)) + " |" for r in rows]


def judged_rows(rows: list[Row]) -> tuple[list[Row], list[Row]]:
    """``(judged, missed)``: the rows with a verdict against a target, and those of them that missed it."""
    missed = [r for r in rows if r.missed is not None]
    return [r for r in rows if r.result == "met" or r.missed is not None], missed


def quick_note(quick: list[str]) -> list[str]:
    """The paragraph that marks quick runs (none: no lines)."""
    if not quick:
        return []
    return [f"**Quick runs** (fewer repetitions, for smoke testing, not for quoting): {', '.join(quick)}.", ""]


def render(results: dict[str, dict], results_rel: str = "results", img_rel: str | None = "docs/img",
           plots: set[str] | None = None) -> str:
    """The full performance section: the table, the missed targets, what was not measured and a line per run.
    ``plots``: the benchmarks whose PNG exists (linked); None: every benchmark with data.

    Usage: ``render(load("results"))``
    """
    rows, lines_after, quick = collect(results, results_rel, img_rel, plots)
    out = ["Generated by `python -m bench.report` from `" + results_rel + "/*.json` (do not edit by hand). Every "
           "ratio compares figures measured side by side in one run on one testbed.", "", *quick_note(quick)]
    out += table_lines(rows)
    judged, missed = judged_rows(rows)
    out.append("")
    if missed:
        out += [f"Targets missed ({len(missed)} of {len(judged)} measured):", ""]
        out += [f"- {r.bench}, {r.figure}: {r.ratio if r.ratio != DASH else r.ours} against {r.target}, "
                f"missed by {r.missed}" for r in missed]
        out.append("")
    elif judged:
        out.append(f"All {len(judged)} measured targets met.")
    not_run = [r.bench if r.figure == DASH else f"{r.bench} ({r.figure})" for r in rows
               if r.result in ("not run",) or r.result.startswith("unreadable")]
    if not_run:
        out.append(f"Not measured: {', '.join(dict.fromkeys(not_run))}.")
    out += ["", "Runs:", "", *lines_after]
    return "\n".join(out)


def headline_rows(rows: list[Row]) -> list[Row]:
    """One row per benchmark (its first), or for those in HEADLINE the rows whose figure names it."""
    out = []
    for name, _, _ in BENCHES:
        mine = [r for r in rows if r.bench == name]
        picked = [r for r in mine if name in HEADLINE and HEADLINE[name] in r.figure]
        out += picked or mine[:1]
    return out


def render_headline(results: dict[str, dict], page_rel: str = "results/README.md", results_rel: str = "results") -> str:
    """The README's short block: a headline figure per benchmark, the count of targets met, a link to the page.

    Usage: ``render_headline(load("results"))``
    """
    rows, _, quick = collect(results, results_rel, None, set())
    judged, missed = judged_rows(rows)
    count = (f"{len(judged) - len(missed)} of {len(judged)} measured targets met" if judged
             else "no target measured yet")
    out = [f"Generated by `python -m bench.report` from `{results_rel}/*.json` (do not edit by hand): one headline "
           f"figure per benchmark; {count}. Every figure, the set-up of each run and the plots: "
           f"[{page_rel}]({page_rel}).", "", *quick_note(quick)]
    return "\n".join(out + table_lines(headline_rows(rows)))


def render_validate(entry: dict, root_rel: str = "..") -> list[str]:
    """The page's section on ``validate.json``: predicted vs measured per profile and policy (within 15 %), and the
    planner's choice against the best candidate measured (within 5 %). Nothing when the file is absent."""
    d = entry.get("data")
    if d is None:
        return [] if not entry.get("error") else ["## Predicted vs measured", "", f"unreadable ({entry['error']})"]
    profiles = d.get("profiles") if isinstance(d.get("profiles"), dict) else {}
    planner = d.get("planner") if isinstance(d.get("planner"), dict) else {}
    tol, ptol = num(d.get("tolerance")) or 0.15, num(d.get("planner_tolerance")) or 0.05
    out = [f"## Predicted vs measured (`validate`{', quick run' if d.get('quick') else ''})", "",
           f"`policies.execution`'s predictions against measured iteration times ({describe_setup('validate', d)}; "
           f"{describe_reps('priority', d)}; {describe_machine(d)}); how: "
           f"[{METHOD_DOCS['validate']}]({_join(root_rel, METHOD_DOCS['validate'])}).", "",
           f"| profile | policy | predicted | measured | error | within {tol:.0%} |", "|---|---|---:|---:|---:|---|"]
    for prof, f in profiles.items():
        for key, label in VALIDATE_POLICIES.items():
            p = (f or {}).get(key) if isinstance((f or {}).get(key), dict) else {}
            err = num(p.get("error"))
            out.append(f"| {PROFILE_NAMES.get(prof, prof)} | {label} | {fmt_s(p.get('predicted_s'))} | "
                       f"{fmt_s(p.get('measured_s'))} | {DASH if err is None else f'{err:+.1%}'} | "
                       f"{verdict(None if err is None else abs(err), '<=', tol)[0]} |")
    out += ["", f"| profile | planner's choice | measured | best candidate measured | measured | ratio "
                f"(<= {1 + ptol:.2f}) | result |", "|---|---|---:|---|---:|---:|---|"]
    for prof, p in planner.items():
        p = p if isinstance(p, dict) else {}
        out.append(f"| {PROFILE_NAMES.get(prof, prof)} | `{p.get('chosen', DASH)}` | {fmt_s(p.get('chosen_s'))} | "
                   f"`{p.get('best', DASH)}` | {fmt_s(p.get('best_s'))} | {fmt_x(p.get('ratio'))} | "
                   f"{verdict(p.get('ratio'), '<=', 1 + ptol)[0]} |")
    return out


def render_plots(results: dict[str, dict], img_rel: str, root_rel: str, plots: set[str]) -> list[str]:
    """The page's section per benchmark with data: where its method is described and its plot, embedded."""
    out = ["## Plots", ""]
    for name, _, _ in BENCHES:
        if (results.get(name) or {}).get("data") is None:
            continue
        out += [f"### {name}", "", f"How it runs: [{METHOD_DOCS[name]}]({_join(root_rel, METHOD_DOCS[name])}).", ""]
        if name in plots:
            out += [f"![{name}]({img_rel}/bench-{name}.png)", ""]
    return out


def _join(root_rel: str, path: str) -> str:
    """A repository-relative ``path`` as seen from where ``root_rel`` leads back to the root."""
    return path if root_rel in ("", ".") else f"{root_rel}/{path}"


def render_page(results: dict[str, dict], validate: dict | None = None, results_rel: str = "results",
                img_rel: str = "../docs/img", root_rel: str = "..", plots: set[str] | None = None) -> str:
    """The whole results page (``results/README.md``): the section of :func:`render`, a plot per benchmark and the
    validate tables. Links are relative to the page (``img_rel``, ``root_rel``: the repository root from it).

    Usage: ``render_page(load("results"), load_one("results/validate.json"))``
    """
    plots = {n for n, e in results.items() if e.get("data") is not None} if plots is None else plots
    docs = _join(root_rel, "docs/benchmarks.md")
    out = ["# Measured results", "",
           f"What each benchmark compares, how it runs, its options and notes on earlier runs: [docs/benchmarks.md]"
           f"({docs}). Regenerate this page, the README's headline block and the plots with `make report`; "
           "`python -m bench.report --check` exits 1 when any of them is out of date.", "",
           "## Every figure", "", render(results, results_rel, img_rel, plots), "", *render_plots(results, img_rel,
                                                                                                 root_rel, plots)]
    out += render_validate(validate or {}, root_rel)
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ jobs-measured's figures

JOBS_FIGURES_HEADER = ("| mix | policy | JCT (s) | avg / FIFO | max / FIFO | max / alone | CPU (s) | run queue (s) "
                       "| RTO |", "|---|---|---|---:|---:|---:|---|---|---|")


def _per_job(jobs: list[dict], key: str, fmt) -> str:
    """``key`` of every job in job order, each by ``fmt`` (``-`` when missing), joined by `` / ``."""
    return " / ".join(DASH if num(j.get(key)) is None else fmt(num(j[key])) for j in jobs)


def _fmt_rto(v: float) -> str:
    """A mean retransmission-timeout count: ``0``, ``0.5``, ``13``, ``18.5`` (one decimal, none when whole)."""
    return f"{v:.1f}".removesuffix(".0")


def render_jobs_figures(d: dict, results_rel: str = "results") -> str:
    """docs/jobs-measured.md's per-policy table from ``jobs.json``'s ``mixes``: per mix (the file's order) a row per
    phase (the file's order; ``*`` after the mix's ``recommended``) with each job's JCT, the average JCT over FIFO's,
    the largest per-job JCT over its FIFO and over its alone JCT (``solo_jct_s``: in the shim's phases the faster of
    alone and alone with the shim), each job's CPU, run-queue seconds and RTOs; then the rows of ``solo`` and
    ``solo_shim``. Usage: ``render_jobs_figures(json.load(open("results/jobs.json")))``
    """
    one = "{:.1f}".format
    out = [f"Generated by `python -m bench.report` from `{results_rel}/jobs.json` (do not edit by hand).", "",
           *JOBS_FIGURES_HEADER]
    for mix in (m for m in d.get("mixes") or [] if isinstance(m, dict)):
        name, rec = f"`{mix.get('name', DASH)}`", mix.get("recommended")
        pols = mix.get("policies") if isinstance(mix.get("policies"), dict) else {}
        rows = [(f"{p} *" if p == rec else p, _mix_jobs(mix, p), True) for p in pols]
        for key, label in (("solo", "alone"), ("solo_shim", "alone, shim")):
            block = mix.get(key) if isinstance(mix.get(key), dict) else {}
            if isinstance(block.get("jobs"), list):
                rows.append((label, [j for j in block["jobs"] if isinstance(j, dict)], False))
        for label, jobs, ratios in rows:
            cells = [fmt_x(ratio_of(_avg(jobs, "jct_s"), _avg(jobs, "fifo_jct_s"))),
                     fmt_x((_largest(jobs, "fifo_jct_s") or (0, None))[1]),
                     fmt_x((_largest(jobs, "solo_jct_s") or (0, None))[1])] if ratios else ["", "", ""]
            out.append("| " + " | ".join([name, label, _per_job(jobs, "jct_s", one), *cells,
                                          _per_job(jobs, "cpu_s", one), _per_job(jobs, "cpu_wait_s", one),
                                          _per_job(jobs, "rto", _fmt_rto)]) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- README

def split_readme(text: str, begin: str = BEGIN, end: str = END, where: str = "the README") -> tuple[str, str, str]:
    """``(before, section, after)`` around the markers (``before`` ends with ``begin``, ``after`` starts with ``end``).

    Raises ReportError, naming ``where``, when a marker is missing, repeated or out of order.
    """
    nb, ne = text.count(begin), text.count(end)
    if nb != 1 or ne != 1:
        raise ReportError(f"{where} must hold exactly one {begin} and one {end} (found {nb} and {ne})")
    i, j = text.index(begin), text.index(end)
    if j < i:
        raise ReportError(f"{end} comes before {begin} in {where}")
    return text[:i + len(begin)], text[i + len(begin):j], text[j:]


def replace_section(text: str, section: str, begin: str = BEGIN, end: str = END, where: str = "the README") -> str:
    """``text`` with only what lies between the markers replaced by ``section``. Idempotent."""
    before, _, after = split_readme(text, begin, end, where)
    return f"{before}\n{section.strip()}\n{after}"


# ---------------------------------------------------------------------------------------------------- plots

def _bars(ax, labels, values, title, ylabel, colors=None, ref=None, ref_label=""):
    """Bars of ``values`` (None: an empty slot), labelled with their value; ``ref``: a dashed target line."""
    xs = range(len(labels))
    vals = [num(v) or 0.0 for v in values]
    bars = ax.bar(xs, vals, color=colors)
    ax.set_xticks(list(xs), labels)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    for b, v in zip(bars, values, strict=True):
        if num(v) is not None:
            ax.annotate(f"{num(v):.0f}" if abs(num(v)) >= 10 else f"{num(v):.3g}",
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    top = max([*vals, num(ref) or 0.0]) or 1.0
    ax.set_ylim(0, top * 1.2)
    if num(ref) is not None:
        ax.axhline(num(ref), ls="--", color="k", lw=0.8, label=ref_label)
        ax.legend(fontsize=8, loc="upper left")


def _grouped(ax, groups, series, title, ylabel):
    """``series``: ``[(label, [value per group])]``; missing values are left out."""
    n = max(1, len(series))
    width = 0.8 / n
    top = 0.0
    for k, (label, values) in enumerate(series):
        xs = [g + (k - (n - 1) / 2) * width for g in range(len(groups))]
        vals = [num(v) or 0.0 for v in values]
        top = max([top, *vals])
        ax.bar(xs, vals, width, label=label)
    ax.set_xticks(list(range(len(groups))), groups)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, (top or 1.0) * 1.3)
    ax.legend(fontsize=8, ncol=min(4, n), loc="upper center")


def plot_contention(d, fig):
    """Median all-reduce (or step) alone, under bulk with FIFO NICs and with agents, with the target line."""
    ax = fig.add_subplot(1, 1, 1)
    vals = [d.get("uncontended_s"), d.get("fifo_s"), d.get("agent_s")]
    t = num((d.get("targets") or {}).get("agent_ratio_max")) or 1.10
    unc = num(d.get("uncontended_s"))
    ms = [None if num(v) is None else num(v) * 1000 for v in vals]
    _bars(ax, ["alone", "FIFO under bulk", "agents under bulk"], ms,
          f"contention: median {'training step' if d.get('workload') == 'training' else 'all-reduce'}", "ms",
          ["tab:gray", "tab:red", "tab:green"], ref=None if unc is None else unc * 1000 * t,
          ref_label=f"target: {t:.2f}x alone")
    return any(num(v) is not None for v in vals)


def plot_priority(d, fig):
    """Per profile: DDP, application order, the shim and the lower bounds, grouped bars."""
    profiles = d.get("profiles") if isinstance(d.get("profiles"), dict) else {}
    if not profiles:
        return False
    ax = fig.add_subplot(1, 1, 1)
    names = list(profiles)
    series = [(label, [None if num((profiles[p] or {}).get(k)) is None else num(profiles[p][k]) * 1000 for p in names])
              for label, k in (("DDP", "ddp_s"), ("app order", "app_order_s"), ("shim", "shim_s"),
                               ("lower bound", "lower_bound_s"))]
    deps = [dependency_bound_of(d, p, profiles[p] if isinstance(profiles[p], dict) else {}) for p in names]
    if any(v is not None for v in deps):
        series.append(("dep.-aware lower bound", [None if v is None else v * 1000 for v in deps]))
    _grouped(ax, [PROFILE_NAMES.get(p, p) for p in names], series, "priority: median iteration time", "ms")
    return True


def plot_jobs(d, fig):
    """Per mix and policy: average JCT over FIFO's, and the largest per-job JCT over the job's alone; or (the
    earlier benchmark's file) average and worst JCT per job policy, per job count."""
    if "mixes" not in d:
        return plot_jobs_runs(d, fig)
    mixes = [m for m in d.get("mixes") or [] if isinstance(m, dict)]
    if not mixes:
        return False
    names = [str(m.get("name", DASH)) for m in mixes]
    for i, (what, fn) in enumerate((
            ("average JCT / FIFO's", lambda jobs: ratio_of(_avg(jobs, "jct_s"), _avg(jobs, "fifo_jct_s"))),
            ("largest JCT / alone", lambda jobs: (_largest(jobs, "solo_jct_s") or (0, None))[1]))):
        ax = fig.add_subplot(1, 2, i + 1)
        series = [(_policy_name(p, mixes[0]), [fn(_mix_jobs(m, p)) for m in mixes]) for p in JOBS_POLICY_NAMES]
        series = [(label, vals) for label, vals in series if any(v is not None for v in vals)]
        _grouped(ax, names, series, f"jobs: {what}", "ratio")
        ax.axhline(1.0, ls="--", color="k", lw=0.8)
    return True


def plot_jobs_runs(d, fig):
    """Average and worst JCT per job policy, per job count (the earlier benchmark's file)."""
    runs = d.get("runs") if isinstance(d.get("runs"), dict) else {}
    if not runs:
        return False
    ns = sorted(runs, key=lambda k: (len(str(k)), str(k)))
    for i, (what, suffix) in enumerate((("average", "avg_s"), ("worst", "worst_s"))):
        ax = fig.add_subplot(1, 2, i + 1)
        series = [(pol, [(runs[n] or {}).get(f"{key}_{suffix}") for n in ns])
                  for pol, key in (("FIFO", "fifo"), ("static", "static"), ("rotation", "rotate"))]
        _grouped(ax, [f"{n} jobs" for n in ns], series, f"jobs: {what} JCT", "s")
    return True


def _flows_axis(ax, xs):
    """x axis of flow counts: symmetric-log when they span decades (0, 1,000, 10,000), ticks at the sizes."""
    if max(xs) > 1000:
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xlim(-30, max(xs) * 1.6)
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("flows registered")


def plot_control_plane(d, fig):
    """Register p50/p99 and throughput ratio against the number of flows registered, with the targets."""
    sizes = d.get("sizes") if isinstance(d.get("sizes"), dict) else {}
    keys = sorted((k for k in sizes if _int(k) is not None and isinstance(sizes[k], dict)), key=_int)
    if not keys:
        return False
    xs = [_int(k) for k in keys]
    ax = fig.add_subplot(1, 2, 1)
    for key, label in (("register_p50_ms", "p50"), ("register_p99_ms", "p99")):
        ax.plot(xs, [num(sizes[k].get(key)) for k in keys], marker="o", label=label)
    ax.axhline(10, ls="--", color="k", lw=0.8, label="target p99 10 ms")
    ax.set_ylim(0, None)
    _flows_axis(ax, xs)
    ax.set_ylabel("ms")
    ax.set_title("control plane: register latency", fontsize=10)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    ax.plot(xs, [num(sizes[k].get("throughput_ratio")) for k in keys], marker="o")
    ax.axhline(0.9, ls="--", color="k", lw=0.8, label="target 0.90")
    ax.set_ylim(0, 1.2)
    _flows_axis(ax, xs)
    ax.set_title("iperf3 throughput vs 0 flows", fontsize=10)
    ax.legend(fontsize=8)
    return True


def plot_overhead(d, fig):
    """Median step of plain DDP, the shim in hook mode and in overlap mode, with the target line."""
    ax = fig.add_subplot(1, 1, 1)
    vals = [d.get("ddp_s"), d.get("shim_hook_s"), d.get("shim_s")]
    t = num((d.get("targets") or {}).get("ratio_max")) or 1.05
    ddp = num(d.get("ddp_s"))
    _bars(ax, ["plain DDP", "shim, hook mode", "shim, overlap mode"],
          [None if num(v) is None else num(v) * 1000 for v in vals], "shim overhead: median step, link not limiting",
          "ms", ["tab:gray", "tab:blue", "tab:green"], ref=None if ddp is None else ddp * 1000 * t,
          ref_label=f"target: {t:.2f}x DDP")
    return any(num(v) is not None for v in vals)


REALTRAIN_LABELS = {"compute": "compute only", "ddp": "plain DDP (clip)", "shim_clip": "shim (clip)",
                    "shim_noclip": "shim (no clip)", "ddp_noclip": "plain DDP (no clip)"}
REALTRAIN_STYLE = {"ddp": ("tab:gray", "-", "o"), "shim_clip": ("tab:blue", "--", "x"),
                   "shim_noclip": ("tab:green", ":", "."), "ddp_noclip": ("tab:olive", "-.", "+")}


def plot_realtrain(d, fig):
    """Loss per step (first round, mean over ranks) of every mode, overlaid; median iteration time per mode."""
    modes = d.get("modes") if isinstance(d.get("modes"), dict) else {}
    if not modes:
        return False
    ax = fig.add_subplot(1, 2, 1)
    for mode, (color, ls, marker) in REALTRAIN_STYLE.items():
        m = modes.get(mode) if isinstance(modes.get(mode), dict) else {}
        losses = m.get("losses") or []
        if losses and isinstance(losses[0], list) and losses[0]:
            ax.plot(range(len(losses[0])), [num(v) for v in losses[0]], color=color, ls=ls, marker=marker,
                    label=REALTRAIN_LABELS.get(mode, mode), lw=1.2, ms=5)
    loss = (d.get("loss") or {}).get("shim_clip_vs_ddp") if isinstance(d.get("loss"), dict) else None
    diff = num((loss or {}).get("max")) if isinstance(loss, dict) else None
    ax.set_title("realtrain: loss per step" + ("" if diff is None else
                                               f" (shim clip vs DDP: max rel diff {diff:.2g})"), fontsize=9)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("cross-entropy, mean of ranks")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    order = [m for m in ("compute", "ddp", "ddp_noclip", "shim_clip", "shim_noclip") if m in modes]
    colors = {"compute": "tab:purple", **{k: v[0] for k, v in REALTRAIN_STYLE.items()}}
    _bars(ax, [REALTRAIN_LABELS[m].replace(" (", "\n(") for m in order],
          [None if num((modes[m] or {}).get("median_s")) is None else num(modes[m]["median_s"]) * 1000 for m in order],
          "median iteration (slowest rank), bulk on the link", "ms", [colors[m] for m in order],
          ref=None if num(d.get("comm_s")) is None else num(d["comm_s"]) * 1000, ref_label="all-reduce at link rate")
    ax.tick_params(axis="x", labelsize=8)
    return True


def plot_classifier(d, fig):
    """Throughput of one stream against N for the nft map and u32 filters; no classifier and SO_PRIORITY as lines."""
    res = [r for r in d.get("results") or [] if isinstance(r, dict)]
    if not res:
        return False
    ax = fig.add_subplot(1, 1, 1)
    for mech in ("nft-map", "u32-linear"):
        pts = sorted((r["n"], num(r.get("gbps_median"))) for r in res if r.get("mechanism") == mech
                     and num(r.get("n")) is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mech)
    for mech, style in (("none", "--"), ("so-priority", ":")):
        r = next((r for r in res if r.get("mechanism") == mech), None)
        if r and num(r.get("gbps_median")) is not None:
            ax.axhline(num(r["gbps_median"]), ls=style, color="k", lw=0.8, label=mech)
    ax.set_xscale("log")
    ax.set_xlabel("flows N")
    ax.set_ylabel("Gbit/s")
    ax.set_title("classifier: one CPU-bound stream", fontsize=10)
    ax.legend(fontsize=8)
    return True


PLOTS = {"contention": plot_contention, "priority": plot_priority, "jobs": plot_jobs,
         "control-plane": plot_control_plane, "shim-overhead": plot_overhead, "realtrain": plot_realtrain,
         "classifier": plot_classifier}
WIDE_PLOTS = ("jobs", "control-plane", "realtrain")


def write_plots(results: dict[str, dict], img_dir: str) -> dict[str, str]:
    """Save ``img_dir``/bench-NAME.png for every benchmark with data; returns ``{name: path}`` of those written."""
    os.makedirs(img_dir, exist_ok=True)
    written = {}
    for name, entry in results.items():
        d = entry.get("data")
        if d is None:
            continue
        path = os.path.join(img_dir, f"bench-{name}.png")
        try:
            if save_plot(name, d, path):
                written[name] = path
        except Exception as exc:  # noqa: BLE001 - a plot must not stop the report; say so
            print(f"bench.report: no plot for {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return written


def save_plot(name: str, d: dict, path: str) -> bool:
    """Draw benchmark ``name``'s plot of the figures ``d`` into ``path`` (PNG); False when there is nothing to plot.

    Usage: ``save_plot("realtrain", json.load(open("results/realtrain.json")), "/tmp/realtrain.png")``
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10 if name in WIDE_PLOTS else 6.5, 3.8))
    try:
        if not PLOTS[name](d, fig):
            return False
        fig.suptitle(f"{name}{' (quick run)' if d.get('quick') else ''}", fontsize=9, x=0.99, ha="right")
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": None})
        return True
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------- CLI

def _rel(path: str, start: str) -> str:
    """``path`` relative to ``start``, with forward slashes (for markdown links)."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(start)).replace(os.sep, "/")


def _read(path: str) -> str | None:
    """The text of ``path``, or None when it does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return fh.read()


def generate(results_dir: str, readme: str, page: str, img_dir: str, plots: set[str],
             jobs_doc: str | None = None) -> dict[str, str]:
    """``{path: text}`` of the README (its block replaced), the results page and, when ``jobs_doc`` exists and
    ``jobs.json`` has ``mixes``, ``jobs_doc`` (its jobs-figures block replaced), from ``results_dir``'s files.
    Paths written into the README and ``jobs_doc`` are relative to the README (the repository root); those in the
    page to the page."""
    base, page_dir = os.path.dirname(os.path.abspath(readme)), os.path.dirname(os.path.abspath(page))
    results, results_rel = load(results_dir), _rel(results_dir, base)
    text = _read(readme)
    if text is None:
        raise ReportError(f"{readme} does not exist")
    page_text = render_page(results, load_one(os.path.join(results_dir, "validate.json")), results_rel,
                            _rel(img_dir, page_dir), _rel(base, page_dir), plots)
    texts = {readme: replace_section(text, render_headline(results, _rel(page, base), results_rel)), page: page_text}
    jobs, doc = results["jobs"].get("data") or {}, _read(jobs_doc) if jobs_doc else None
    if doc is not None and isinstance(jobs.get("mixes"), list):
        texts[jobs_doc] = replace_section(doc, render_jobs_figures(jobs, results_rel), FIGURES_BEGIN, FIGURES_END,
                                          jobs_doc)
    return texts


def check(texts: dict[str, str], expected_plots: set[str], plots: set[str], img_dir: str, out=print) -> int:
    """0 when every file in ``texts`` already holds its text and every plot exists, else 1 (saying what differs)."""
    stale = [f"{path}: differs from what the results' JSON files give" for path, text in texts.items()
             if _read(path) != text]
    missing = sorted(expected_plots - plots)
    if missing:
        stale.append(f"plots missing in {img_dir}: " + ", ".join(f"bench-{n}.png" for n in missing))
    for line in stale:
        out(f"bench.report: {line}")
    if stale:
        out("bench.report: run `python -m bench.report` (or `make report`) to update")
        return 1
    out("bench.report: " + ", ".join(texts) + " up to date")
    return 0


def jobs_doc_of(readme: str, jobs_doc: str | None = None) -> str:
    """``jobs_doc``, or the default: docs/jobs-measured.md beside ``readme``."""
    return jobs_doc or os.path.join(os.path.dirname(readme), JOBS_DOC)


def build(results_dir: str, readme: str, img_dir: str, check_only: bool = False, out=print,
          page: str | None = None, jobs_doc: str | None = None) -> int:
    """Render from ``results_dir`` and update (or, with ``check_only``, compare) ``readme``'s block, the results page
    (default ``results_dir``/README.md), ``jobs_doc``'s block (default docs/jobs-measured.md beside ``readme``, if it
    exists) and the plots; 0 ok, 1 stale.

    Usage: ``build("results", "README.md", "docs/img")``
    """
    page = page or os.path.join(results_dir, "README.md")
    jobs_doc = jobs_doc_of(readme, jobs_doc)
    results = load(results_dir)
    expected_plots = {n for n, e in results.items() if e.get("data") is not None}
    if check_only:
        plots = {n for n in expected_plots if os.path.exists(os.path.join(img_dir, f"bench-{n}.png"))}
        return check(generate(results_dir, readme, page, img_dir, plots, jobs_doc), expected_plots, plots, img_dir,
                     out)
    plots = set(write_plots(results, img_dir))
    for path, text in generate(results_dir, readme, page, img_dir, plots, jobs_doc).items():
        if _read(path) == text:
            out(f"bench.report: {path}: unchanged")
            continue
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
        out(f"bench.report: {path}: updated")
    for name in sorted(plots):
        out(f"bench.report: plot {os.path.join(img_dir, f'bench-{name}.png')}")
    return 0


def main(argv=None) -> int:
    """``python -m bench.report``: see the module's docstring. Returns the exit status (0, 1 stale, 2 error)."""
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results", help="directory of the benchmarks' JSON files (%(default)s)")
    p.add_argument("--readme", default="README.md", help="the file with the perf-table markers (%(default)s)")
    p.add_argument("--page", help="the results page (default: README.md in the --results directory)")
    p.add_argument("--jobs-doc", help="the file with the jobs-figures markers, updated if it exists (default: "
                   f"{JOBS_DOC} beside --readme)")
    p.add_argument("--img-dir", default=os.path.join("docs", "img"), help="where the PNG plots go (%(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is out of date")
    p.add_argument("--print", action="store_true", dest="show", help="also print the results page it renders")
    args = p.parse_args(argv)
    if not os.path.exists(args.readme):
        print(f"bench.report: {args.readme} does not exist", file=sys.stderr)
        return 2
    page = args.page or os.path.join(args.results, "README.md")
    jobs_doc = jobs_doc_of(args.readme, args.jobs_doc)
    try:
        code = build(args.results, args.readme, args.img_dir, check_only=args.check, page=page, jobs_doc=jobs_doc)
    except (ReportError, OSError) as exc:
        print(f"bench.report: {exc}", file=sys.stderr)
        return 2
    if args.show:
        plots = {n for n, _, _ in BENCHES if os.path.exists(os.path.join(args.img_dir, f"bench-{n}.png"))}
        print(generate(args.results, args.readme, page, args.img_dir, plots, jobs_doc)[page])
    return code


if __name__ == "__main__":
    sys.exit(main())
