"""The `tensorlane` command: agent, status and verify.

Each sub-command imports only what it needs, so the agent never loads torch. The benchmarks, the demo and the
namespace testbed are repository tools (``python -m bench``, ``python -m testbed``, ``make demo``).
Usage: ``tensorlane agent --config /etc/tensorlane/agent.toml``
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys

from tensorlane import __version__
from tensorlane.client import CONTROL_ESCAPES, DEFAULT_SOCKET, AgentClient, AgentError, AgentUnavailable, agent_socket


def _agent(args) -> int:
    from tensorlane.agent.config import ConfigError, from_dict, load_config
    from tensorlane.agent.daemon import StartupError, run
    from tensorlane.agent.logs import configure_logging, journal_prefix

    configure_logging(args.log_level)
    err = journal_prefix(logging.ERROR)
    flags = {"interface": args.interface, "socket": args.socket, "metrics_address": args.metrics_address}
    if not args.config and not args.interface:  # (it said only "config field 'interface': required")
        print(f"{err}tensorlane agent: no configuration: --config FILE (TOML, docs/agent.md; the Ansible role's is "
              "/etc/tensorlane/agent.toml), or --interface IFACE for the defaults", file=sys.stderr)
        return 2
    try:
        # a flag given empty counts (--metrics-address "" disables /metrics); an absent one is None
        cfg = load_config(args.config, flags) if args.config else from_dict(
            {k: v for k, v in flags.items() if v is not None})
    except ConfigError as exc:
        print(f"{err}tensorlane agent: {exc}", file=sys.stderr)
        return 2
    if args.check_config:  # parsed and checked as the agent would at start, nothing run or changed
        print(f"tensorlane agent: {args.config or 'the flags'}: ok")
        _print_host_notes(cfg)
        return 0
    try:
        return run(cfg)
    except (ConfigError, StartupError) as exc:
        print(f"{err}tensorlane agent: {exc}", file=sys.stderr)
        return 2


def _print_host_notes(cfg) -> None:
    """``--check-config``: what this host makes of the file now (``daemon.host_notes``), on stderr; not a failure
    (the interfaces may differ at the agent's start)."""
    from pyroute2 import IPRoute

    from tensorlane.agent.daemon import host_notes

    try:
        with IPRoute() as ipr:
            notes = host_notes(cfg, ipr)
    except Exception as exc:  # noqa: BLE001 - (pyroute2's NetlinkError is no OSError) a note, never a failure
        notes = [f"the interfaces could not be read: {exc}"]
    for note in notes:
        print(f"tensorlane agent: on this host: {note}", file=sys.stderr)


def format_status(st: dict) -> str:
    """Render a status reply as the table `tensorlane status` prints."""
    unnamed = {"": "(routed elsewhere)", None: "(not looked up yet)"}
    ifaces = ", ".join(f"{i['name'] or unnamed[i['name']]}: {i['flows']} flows"
                       + (" (absent: deleted, renamed or moved away)" if i.get("present") is False else "")
                       + (f" (queues on {', '.join(i['queues'])})" if i["queues"] not in ([i["name"]], []) else "")
                       for i in st["interfaces"])
    draining = f" ({st['draining_flows']} draining)" if st.get("draining_flows") else ""
    lines = [f"backend {st['backend']}  link {st.get('link_rate_bps') or '-'} bit/s  flows {st['flows']}{draining}  "
             f"jobs {len(st['jobs'])}  uptime {st['uptime_s']:.0f}s",
             f"interfaces {ifaces}",
             f"{'level':>7} {'class':>8} {'dscp':>4} {'flows':>6} {'sent_bytes':>14} {'marked_bytes':>14} "
             f"{'drops':>7} {'backlog_B':>10}"]
    for c in st["classes"]:
        level = "default" if c["level"] is None else str(c["level"])
        lines.append(f"{level:>7} {c['class']:>8} {c.get('dscp', '-'):>4} {c.get('flows', '-'):>6} "
                     f"{c.get('bytes', 0):>14} {c.get('marked_bytes', '-'):>14} {c.get('drops', 0):>7} "
                     f"{c.get('backlog_bytes', 0):>10}")
    if len(st.get("devices", [])) > 1:
        for d in st["devices"]:
            sent = "  ".join(f"{c['class']} {c.get('bytes', 0)}" for c in d["classes"])
            lines.append(f"device {d['device']} ({d.get('link_rate_bps') or '-'} bit/s): sent bytes {sent}")
    rec = st["reconcile"]
    lines.append(f"reconcile: {rec['passes']} passes, {rec['repairs']} repairs, {rec['errors']} errors"
                 + (f" (failing now: {rec['failing']})" if rec.get("failing") else
                    f" (passing; last: {rec['last_error']})" if rec["last_error"] else ""))
    table = st.get("flow_table") or {}  # (an older agent's status has none)
    if table.get("failing"):
        lines.append(f"flow table file {table['path']}: not written ({table['failing']}; {table['errors']} failed "
                     "writes, the agent retries): it holds an older table, and an agent killed now loses the flows "
                     "registered since whose clients do not register again; free space in state_dir or fix its "
                     "permissions")
    jp = st.get("job_policy") or {}
    if jp.get("policy", "none") != "none":
        parts = ", ".join(f"level {lvl} {100 * v:g} %" for lvl, v in jp.get("level_shares", {}).items())
        rates = [d["link_rate_bps"] for d in st.get("devices", []) if d.get("link_rate_bps")]
        said = {j: _reported(jp, j, min(rates, default=None)) for j in jp.get("order", [])}
        order = ", ".join(f"{j} ({said[j]})" if said[j] else j for j in jp.get("order", []))
        auto = ""
        if jp.get("job_share_auto"):  # the part follows whether the jobs saturate the link
            busy = "-" if jp.get("link_busy") is None else f"{100 * jp['link_busy']:.0f} %"
            auto = f" auto, {'saturated' if jp.get('saturated') else 'room left'} (link busy {busy})"
        lines.append(f"job policy {jp['policy']}: order {order or '-'}; job_share "
                     f"{jp.get('job_share', 0):g}{auto}" + (f" ({parts})" if parts else "")
                     + (f"; sending {', '.join(jp['sending'])}" if jp.get("sending") else ""))
        bands = jp.get("bands") or {}  # jobs of one band share its levels: the order alone does not say so
        if bands:
            lines.append("job bands: " + ", ".join(
                f"{j} level{'s' if b['levels'] > 1 else ''} {b['first_level']}"
                + (f"-{b['first_level'] + b['levels'] - 1}" if b["levels"] > 1 else "")
                for j in jp.get("order", []) if (b := bands.get(j))))
    for job, n in sorted(st["jobs"].items(), key=_job_key):
        lines.append(f"{job}: {n} flows" if job.startswith("(") else f"job {job}: {n} flows")
    for job, runs in sorted((st.get("job_conflicts") or {}).items(), key=_job_key):  # two jobs, one id: one band
        n = (st.get("job_conflict_runs") or {}).get(job, len(runs))  # (at most 8 runs named: the others counted)
        if not runs:  # another user's job (runs not named to this user): only its user can give it another id
            lines.append(f"job id conflict: {job} is used by {n} runs: the job policy treats them as one job")
            continue
        lines.append(f"job id conflict: {job} is used by {n} runs ({', '.join(runs)}{', ...' if n > len(runs) else ''}"
                     "): the job policy treats them as one job; give each job its own id")
    if st.get("unnamed_jobs"):
        n = st["unnamed_jobs"]
        lines.append(f"{n} job{'s' if n > 1 else ''} of other users shown unnamed: only root and trusted_users see "
                     "other users' job ids and runs")
    return "\n".join(lines)


def _job_key(item: tuple) -> tuple:
    """Sort key of a ``(job, ...)`` item of status: job ids by name, then the placeholders of other users' jobs
    (``(another user's job N)``: no job id starts with "(") by their number."""
    job = item[0]
    hidden = job.startswith("(")
    return hidden, len(job) if hidden else 0, job


def _reported(jp: dict, job: str, link_bps: float | None) -> str:
    """What ``job``'s shims reported for the job order (``status.job_policy``: ``step_bytes`` under ``shortest``
    and ``measured_intensity``, ``compute_s`` under ``measured_intensity`` and ``slowdown``) and, with both and a
    link rate, Crux's GPU intensity on this host's slowest managed link; under ``slowdown`` the job's slowdown as
    the agent ranked it; "" when nothing."""
    from tensorlane.policies.papers.crux import Job, gpu_intensity

    size, compute = jp.get("step_bytes", {}).get(job), jp.get("compute_s", {}).get(job)
    parts = [] if size is None else [f"{size} B/step"]
    if compute is not None:
        parts.append(f"{compute:.3g} s compute/step")
        if size is not None and link_bps:
            parts.append(f"intensity {gpu_intensity(Job('status', compute, size, link_bps)):.3g}")
    if job in jp.get("slowdown", {}):
        parts.append(f"slowdown {jp['slowdown'][job]:.3g}")
    return ", ".join(parts)


def _socket(args) -> str:
    """The socket ``status`` and ``verify`` ask: ``--socket``, else ``$TENSORLANE_AGENT_SOCKET`` (what the shim
    reads), else the agent's default."""
    return agent_socket(args.socket)


def _unavailable(cmd: str, exc: Exception) -> str:
    """The line for an agent that cannot be reached; where none listens, how to name another socket."""
    hint = ("; an agent on another socket (its config's `socket`): --socket PATH or TENSORLANE_AGENT_SOCKET"
            if str(exc).startswith("no agent at") else "")
    return f"tensorlane {cmd}: {exc}{hint}"


# C0 and C1 control characters but newline and tab, as escapes: printed as they came, an agent's text (an error message,
# a name in status) could move the cursor, retitle or rewrite the terminal of whoever runs the command (root)
_ESCAPES = {c: escape for c, escape in CONTROL_ESCAPES.items() if c != 0x0A}  # (the client's agent_text, newline kept)


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab written as ``\\xNN``."""
    return text.translate(_ESCAPES)


def _status(args) -> int:
    try:
        with AgentClient(_socket(args)) as agent:
            st = agent.status()
    except AgentUnavailable as exc:
        print(printable(_unavailable("status", exc)), file=sys.stderr)
        return 1
    except AgentError as exc:
        print(printable(f"tensorlane status: {exc}"), file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else printable(format_status(st)))
    return 0


def _verify(args) -> int:
    from tensorlane.agent.verify import CaptureError, format_report, verify

    try:
        report = verify(_socket(args), args.seconds, args.interface)
    except AgentUnavailable as exc:
        print(printable(_unavailable("verify", exc)), file=sys.stderr)
        return 1
    except (AgentError, CaptureError) as exc:
        print(printable(f"tensorlane verify: {exc}"), file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else printable(format_report(report)))
    return 0 if report["ok"] else 1


SOCKET_HELP = f"the agent's API socket (default $TENSORLANE_AGENT_SOCKET, else {DEFAULT_SOCKET})"


def _seconds(text: str) -> float:
    """``--seconds``: a capture length above 0 (argparse's type)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorlane", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("agent", help="run the per-host agent in the foreground")
    a.add_argument("--config", help="TOML config file (see docs/agent.md)")
    a.add_argument("--interface", help="override: egress interface to manage")
    a.add_argument("--socket", help="override: Unix socket path of the API")
    a.add_argument("--metrics-address", help="override: HOST:PORT for /metrics (empty disables)")
    a.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a.add_argument("--check-config", action="store_true",
                   help="only check the config (each error names its field; exit 2) and exit: nothing is changed")
    a.set_defaults(func=_agent)
    s = sub.add_parser("status", help="show a running agent's classes, flows and counters")
    s.add_argument("--socket", help=SOCKET_HELP)
    s.add_argument("--json", action="store_true", help="print the agent's reply as JSON")
    s.set_defaults(func=_status)
    v = sub.add_parser("verify", help="capture traffic and check each registered flow's DSCP and queue")
    v.add_argument("--socket", help=SOCKET_HELP)
    v.add_argument("--seconds", type=_seconds, default=5.0, help="how long to capture (default 5)")
    v.add_argument("--interface", help="capture here instead of on the agent's interfaces")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # (a pipe's buffer is written here, inside the try)
        return rc
    except BrokenPipeError:  # the reader left (`| head`, `| grep -q`): stop quietly, as cat and head do
        if args.func is _agent:  # (the agent prints no report: a broken pipe there is a failure to show, not hide)
            raise
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
