"""Run one worker process per rank on testbed hosts, wait for all of them (bounded), and collect their JSON.

Shared by the benchmarks that launch distributed workers (``bench.contention``, ``bench.priority``).
Usage: ``results = run_workers(tb, [1, 2], lambda rank, host, out: argv, workdir, "fifo", timeout=150)``
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from tensorlane.client import AgentClient, AgentError, AgentUnavailable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScenarioError(RuntimeError):
    """A step of a benchmark failed; the message says which and includes the relevant log."""


def repo_env(extra: dict | None = None) -> dict:
    """This process's environment with the repository importable (``bench``, ``testbed``) and unbuffered output,
    updated with ``extra``. Usage: ``host.popen(argv, env=repo_env(), cwd=REPO_ROOT)``
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def worker_env() -> dict:
    """The environment of a worker: the repository importable, unbuffered output, one OpenMP thread."""
    env = repo_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def tail(path: str, n: int = 2000) -> str:
    """The last ``n`` characters of a log file ("" if it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def run_workers(tb, hosts: list[int], argv_of, workdir: str, tag: str, timeout: float) -> list[dict]:
    """Start ``argv_of(rank, host, json_path)`` on each of ``hosts`` (testbed indexes, in rank order), wait for
    all (``timeout`` s in total) and return each rank's JSON. Raises ScenarioError with the failing rank's log;
    every worker still running is killed on the way out.
    """
    import time

    procs = []
    try:
        for rank, index in enumerate(hosts):
            host = tb.host(index)
            out = os.path.join(workdir, f"{tag}-r{rank}.json")
            log = open(os.path.join(workdir, f"{tag}-r{rank}.log"), "wb")  # noqa: SIM115 (closed in finally)
            procs.append((rank, host, out, log, host.popen(argv_of(rank, host, out), stdin=subprocess.DEVNULL,
                                                           stdout=log, stderr=subprocess.STDOUT, env=worker_env(),
                                                           cwd=REPO_ROOT)))
        deadline = time.monotonic() + timeout
        for rank, host, _, log, proc in procs:
            wait_worker(proc, deadline, timeout, f"{tag}: rank {rank} on {host.name}", log.name)
        results = []
        for _, _, out, _, _ in procs:
            with open(out) as fh:
                results.append(json.load(fh))
        return results
    finally:
        reap_workers((log, proc) for _, _, _, log, proc in procs)


def wait_worker(proc, deadline: float, timeout: float, what: str, log_path: str) -> None:
    """Wait for worker ``proc`` until ``deadline`` (time.monotonic(); at least 1 s); raise ScenarioError naming
    ``what`` with the tail of its log if it is still running (``timeout``: the budget, for the message) or failed.
    Usage: ``wait_worker(proc, deadline, 120, "tag: rank 0 on tw-h1", log.name)``
    """
    import time

    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise ScenarioError(f"{what} still running after {timeout:g} s; log:\n{tail(log_path)}") from None
    if proc.returncode != 0:
        raise ScenarioError(f"{what} exited {proc.returncode}; log:\n{tail(log_path)}")


def reap_workers(logs_and_procs) -> None:
    """Kill every worker still running and close its log file: ``(log, proc)`` pairs. Usage: in a ``finally``."""
    for log, proc in logs_and_procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def text_table(rows) -> list[str]:
    """Left-aligned columns of ``rows`` (the first is the header) with a rule of dashes under the header.

    Usage: ``"\n".join(text_table([("phase", "median"), ("fifo", "1794 ms")]))``
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def use_interface(ifname: str | None) -> str:
    """In a worker: pin gloo (and tensorpipe) to ``ifname``, by default eth0 when the host has one, else lo.

    Usage: ``use_interface(args.ifname)`` before importing torch.distributed's process groups.
    """
    ifname = ifname or ("eth0" if os.path.exists("/sys/class/net/eth0") else "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    os.environ.setdefault("TP_SOCKET_IFNAME", ifname)
    return ifname


def progress_printer():
    """A ``progress(msg)`` that prints each message with the seconds since it was made, flushed."""
    import time

    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    return progress


def stop_process(proc: subprocess.Popen, sig: int = 15, wait_s: float = 3.0) -> int:
    """Send ``sig`` (default SIGTERM) to ``proc`` and wait ``wait_s``; SIGKILL it if it is still there.

    The one way the benchmarks stop what they started (agents, iperf3, their own children). Returns its exit
    status (negative: the signal that ended it). Usage: ``stop_process(agent_proc, wait_s=10)``,
    ``stop_process(proc, signal.SIGKILL)``
    """
    import contextlib
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=5)
            return -signal.SIGKILL
    return proc.returncode


def write_json(path: str, obj, rank: int | None = None) -> str:
    """Write ``obj`` to ``path`` atomically (a temporary file, then rename); "{rank}" in it becomes ``rank``."""
    if rank is not None:
        path = path.replace("{rank}", str(rank))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def scratch_dir(workdir: str | None, prefix: str):
    """Yield ``workdir`` (kept), or a fresh temporary directory named ``prefix...`` that is removed on exit.

    Usage: ``with scratch_dir(workdir, "tensorlane-jobs-") as workdir: ...``
    """
    if workdir is not None:
        yield workdir
        return
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def needs_root(what: str) -> bool:
    """True, after saying so on stderr, when this process is not root (``what`` builds network namespaces).

    Usage: ``if needs_root("the jobs benchmark"): return 2``
    """
    if os.geteuid() == 0:
        return False
    print(f"tensorlane: {what} builds network namespaces: run it as root", file=sys.stderr)
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C, so that every ``finally`` (testbed namespaces, agents, workers) runs."""


def _terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
    raise Terminated


def cli(main, sigterm: bool = False) -> None:
    """Exit with ``main()``'s status (130 on Ctrl-C). With ``sigterm`` (``python -m bench NAME``, the command people
    run and stop with ``kill`` or ``timeout``), SIGTERM unwinds like Ctrl-C and exits 143 after the benchmark's
    clean-up ran; without it a SIGTERM left the testbed's namespaces, agents and workers behind. A benchmark's child
    processes keep SIGTERM's default: their parent stops them.
    Usage: ``if __name__ == "__main__": cli(main)``"""
    if sigterm:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        sys.exit(main())
    except Terminated:
        sys.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:
        sys.exit(130)


def show_figures(table: str, result: dict, json_path: str | None) -> None:
    """Print a benchmark's table and, when asked, write its figures as JSON."""
    print()
    print(table)
    if json_path:
        write_json(json_path, result)
        print(f"figures written to {json_path}")


def machine_info() -> dict:
    """What the figures were measured on: cores, memory, kernel, Python, torch version, load and the date.

    Cheap (torch is not imported: its version comes from the package metadata). Benchmarks record it as
    ``result["machine"]``; ``python -m bench NAME --json FILE`` adds it to FILE when a benchmark did not.
    Usage: ``result["machine"] = machine_info()``
    """
    import contextlib
    import datetime
    import platform

    info: dict = {"cores": os.cpu_count(), "memory_bytes": None, "kernel": platform.release(),
                  "python": platform.python_version(), "torch": None, "cpu_model": None, "load_avg": None,
                  "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from importlib import metadata

    with contextlib.suppress(Exception):  # not installed, or broken metadata: leave None
        info["torch"] = metadata.version("torch")
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), None)
    with contextlib.suppress(OSError):
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return info


def jsonable(obj):
    """``obj`` as JSON can hold it: dict keys as strings, tuples as lists, anything else unknown as its repr."""
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        if isinstance(obj, dict):
            return {str(k): jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [jsonable(v) for v in obj]
        return repr(obj)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is zero (a figure that could not be measured)."""
    return None if a is None or not b else a / b


def register_flows(socket_path: str, job: str, level: int, flows: list[dict], rank: int | None = None,
                   warn=None) -> tuple[bool, str | None]:
    """Register ``flows`` of ``job`` at ``level`` with the agent; never raises (the workload goes on without the
    agent). Returns ``(registered, error)``; ``warn(text)``, when given, is told why it failed.

    Usage: ``ok, err = register_flows(sock, "demo", 0, flows, rank=0, warn=print)``
    """
    if not flows:
        return False, "no flows found"
    try:
        with AgentClient(socket_path) as agent:
            agent.register(job, level=level, flows=flows, rank=rank)
        return True, None
    except AgentUnavailable as exc:
        if warn:
            warn(f"agent unavailable, flows not prioritised: {exc}")
        return False, str(exc)
    except AgentError as exc:
        if warn:
            warn(f"agent refused the flows: {exc}")
        return False, str(exc)


def unregister_flows(socket_path: str, job: str, flows: list[dict], warn=None) -> None:
    """Unregister ``flows`` of ``job`` from the agent; never raises (``warn(text)``, when given, hears a failure)."""
    try:
        with AgentClient(socket_path) as agent:
            agent.unregister(job, flows=flows)
    except (AgentUnavailable, AgentError) as exc:
        if warn:
            warn(f"could not unregister the flows: {exc}")
