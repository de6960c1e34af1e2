"""``python -m bench.demo`` (``make demo``): a training loop through the shim under bulk traffic, FIFO vs tensorlane.

An emulated ResNet-50 (``bench.models``) is trained by DDP with ``shim.attach(ddp, optimizer, levels=4)`` between
two testbed hosts, alone, under iperf3 bulk with FIFO NICs, and under the same bulk with an agent on every host
(``bench.contention``, workload ``training``). The demo shows, it does not judge: it prints a table (median
iteration time per phase, relative to alone, bulk throughput) and writes a PNG plot next to ``--json``; it exits 0
whenever the scenario ran, and non-zero only when it could not run (not root, a tool missing, a step failed). The
targets and their pass/fail belong to ``python -m bench contention``. Options are those of ``bench contention``,
with the demo's defaults: 50 Mbit/s links (on a 2-core machine the bulk's packet processing at 100 Mbit/s and more
takes the CPU the training needs, which no queue gives back), 16 bulk streams per direction so that FIFO is
clearly slower on any run.

Usage: ``python -m bench.demo --json demo.json [--plot demo.png] [--quick]`` (root: it builds network namespaces).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from bench import contention
from bench.workers import ScenarioError, progress_printer, ratio, text_table, write_json

DEMO_RATE = "50mbit"
DEMO_STREAMS = 16
DEMO_ITERS = 6
DEMO_COMM_S = 0.4     # seconds of communication per iteration, alone (the model is scaled to it)
TOOLS = ("ip", "tc", "nft", "iperf3")
PHASE_NAMES = {"uncontended": "alone (no bulk, no agents)", "fifo": "FIFO NICs under bulk",
               "agent": "agents under the same bulk", "after": "bulk alone after training (agents on)"}
COLORS = {"uncontended": "tab:gray", "fifo": "tab:red", "agent": "tab:green", "after": "tab:blue"}


def mean_bps(rates: dict | None) -> float | None:
    """The mean over the bulk directions of ``{"h1->h2": bps, ...}`` (None if absent)."""
    return sum(rates.values()) / len(rates) if rates else None


def bulk_of(result: dict) -> dict:
    """Bulk throughput per phase (bit/s, mean over directions): ``{"uncontended": 0, "fifo": .., ...}``."""
    out = {"uncontended": 0.0 if result.get("uncontended_s") is not None else None}
    for phase, key in (("fifo", "bulk_fifo_bps"), ("agent", "bulk_agent_bps"), ("after", "bulk_after_bps")):
        out[phase] = mean_bps(result.get(key))
    return out


def format_table(result: dict) -> str:
    """Phase, median iteration time, times alone, bulk throughput per direction; then a one-line summary.

    Usage: ``print(format_table(contention.run(workload="training", rate="100mbit")))``
    """
    link = result.get("link_bps")
    unc = result.get("uncontended_s")
    bulk = bulk_of(result)
    rows = [("phase", "median iteration", "x alone", "bulk throughput (per direction)")]
    for phase, name in PHASE_NAMES.items():
        med = result.get(f"{phase}_s")
        bps = bulk.get(phase)
        if med is None and bps is None:
            continue
        x = ratio(med, unc)
        share = f" ({bps / link:.0%} of the link)" if bps and link else ""
        rows.append((name, "-" if med is None else f"{med * 1000:.0f} ms", "-" if x is None else f"{x:.2f}x",
                     "-" if bps is None else f"{bps / 1e6:.0f} Mbit/s{share}" if bps else "none"))
    lines = text_table(rows)
    fifo, agent = result.get("fifo_ratio"), result.get("agent_ratio")
    if fifo is not None and agent is not None:
        lines.append(f"under the same bulk, training takes {fifo:.2f}x its time alone with FIFO NICs and "
                     f"{agent:.2f}x with tensorlane's agents")
    machine = result.get("machine") or {}
    if machine.get("load_avg") and machine.get("cores") and machine["load_avg"][0] > 2 * machine["cores"]:
        lines.append(f"({machine.get('cores')} cores, load average {machine['load_avg'][0]:g} at the end: other work "
                     "on the machine slows every phase)")
    return "\n".join(lines)


def plot_path(json_path: str | None, plot: str | None) -> str:
    """Where the PNG goes: ``plot`` if given, else next to the JSON file (``demo.json`` -> ``demo.png``)."""
    if plot:
        return plot
    return (os.path.splitext(json_path)[0] if json_path else "demo") + ".png"


def plot_iterations(ax, result: dict) -> None:
    """Each phase's timed iterations (dots, ms) and their median (a bar, labelled)."""
    phases = [p for p in ("uncontended", "fifo", "agent") if result.get(f"{p}_s") is not None]
    top = 0.0
    for x, phase in enumerate(phases):
        times = [t * 1000 for t in result.get(f"{phase}_times_s") or []]
        med = result[f"{phase}_s"] * 1000
        top = max([top, med, *times])
        ax.bar(x, med, 0.6, color=COLORS[phase], alpha=0.35)
        ax.scatter([x + (i - (len(times) - 1) / 2) * 0.06 for i in range(len(times))], times, s=14,
                   color=COLORS[phase], zorder=3)
        ax.annotate(f"median {med:.0f} ms", (x, max([med, *times])), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, (top or 1.0) * 1.15)
    ax.set_xticks(range(len(phases)), [PHASE_NAMES[p].replace(" under", "\nunder") for p in phases])
    ax.set_ylabel("iteration time (ms)")
    ax.set_title("training iterations (dots) and their median (bars)", fontsize=10)


def plot_bulk(ax, result: dict) -> None:
    """The bulk's throughput per direction in each phase (bars, Mbit/s) against the link rate (dashed)."""
    bulk = {p: v for p, v in bulk_of(result).items() if v is not None}
    bars = ax.bar(range(len(bulk)), [v / 1e6 for v in bulk.values()], color=[COLORS[p] for p in bulk])
    ax.bar_label(bars, fmt="%.0f", fontsize=9)
    ax.set_xticks(range(len(bulk)), [{"uncontended": "alone", "fifo": "FIFO", "agent": "agents",
                                      "after": "after\ntraining"}[p] for p in bulk])
    if result.get("link_bps"):
        ax.axhline(result["link_bps"] / 1e6, ls="--", color="k", lw=0.8, label="link")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_ylabel("Mbit/s per direction")
    ax.set_title("bulk throughput (iperf3)", fontsize=10)


def save_plot(result: dict, path: str) -> str:
    """Draw iteration times per phase (each iteration a dot, the median a bar) and bulk throughput per phase.

    Usage: ``save_plot(json.load(open("demo.json")), "demo.png")``
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))
    try:
        plot_iterations(ax_t, result)
        plot_bulk(ax_b, result)
        fig.suptitle(f"tensorlane demo: {result.get('profile', '')} through the shim at {result.get('rate')}, "
                     f"{result.get('streams')} bulk streams per direction", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": None})
    finally:
        plt.close(fig)
    return path


def cannot_run() -> str | None:
    """Why the scenario cannot start here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "the demo builds network namespaces: run it as root (sudo make demo)"
    if missing := [t for t in TOOLS if not shutil.which(t)]:
        return f"{', '.join(missing)} not found: run scripts/bootstrap (make bootstrap) first"
    return None


def could_not_run_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean the scenario could not run (a testbed, agent, iperf3 or worker step failed)."""
    from bench.agents import AgentStartError
    from bench.bulk import BulkError
    from testbed import TestbedError

    return ScenarioError, AgentStartError, BulkError, TestbedError, TimeoutError, OSError, subprocess.SubprocessError


def parser():
    """The options of ``bench contention`` with the demo's defaults, plus ``--plot``."""
    p = contention.scenario_parser("python -m bench.demo", __doc__.split("\n\n")[0], rate=DEMO_RATE,
                                   streams=DEMO_STREAMS, workload="training")
    p.add_argument("--plot", metavar="PNG", help="the plot (default: next to --json, e.g. demo.png; else ./demo.png)")
    return p


def main(argv=None) -> int:
    """Run the scenario, print the table, write the JSON and the plot; 0 whenever the scenario ran."""
    p = parser()
    args = p.parse_args(argv)
    if not args.quick:
        args.iters = args.iters or DEMO_ITERS
    args.comm_s = args.comm_s or DEMO_COMM_S
    if why := cannot_run():
        print(f"bench.demo: {why}", file=sys.stderr)
        return 2
    try:
        result = contention.run_args(p, args, progress_printer())
    except could_not_run_errors() as exc:
        print(f"bench.demo: the scenario could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(result))
    if args.json:
        print(f"figures written to {write_json(args.json, result)}")
    try:
        print(f"plot written to {save_plot(result, plot_path(args.json, args.plot))}")
    except Exception as exc:  # noqa: BLE001 - the scenario ran: a missing plot is a warning, not a failure
        print(f"bench.demo: no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
