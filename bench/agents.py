"""Start a tensorlane agent in each testbed host namespace, and stop them again (SIGTERM restores the interface).

Usage::

    with Testbed(hosts=3, rate="200mbit", name="tw") as tb, running_agents(tb) as agents:
        agents[1].socket        # "/run/tensorlane/tw-h1/agent.sock": give it to the training process on host 1
        agents[1].client().status()

Each agent gets its own TOML config (interface eth0, the testbed's link rate, ``take_over_root = true`` so that
it replaces the testbed's FIFO HTB root and restores it on exit, a socket and state directory per host, metrics
on the namespace's own loopback) and runs as ``python -m tensorlane.cli agent --config FILE`` in the foreground.
Startup waits (bounded) until the agent answers ``status``; on exit every agent gets SIGTERM, then SIGKILL
if it does not stop in time. Failures carry the tail of the agent's stderr.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tensorlane.client import AgentClient, AgentError, AgentUnavailable
from bench.workers import stop_process

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AgentStartError(RuntimeError):
    """An agent did not come up, or did not stop cleanly."""


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def render_config(fields: dict) -> str:
    """A flat TOML document of ``fields`` (tables given as dicts are written as inline tables)."""
    lines = []
    for k, v in fields.items():
        if v is None:
            continue
        if isinstance(v, dict):
            lines.append(f"{k} = {{ " + ", ".join(f'"{kk}" = {_toml_value(vv)}' for kk, vv in v.items()) + " }")
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def agent_config(tb, host, levels: int = 4, backend: str = "auto", **extra) -> dict:
    """The config fields of the agent on ``host`` (see agent/config.py); ``extra`` adds or overrides fields."""
    rundir = f"/run/tensorlane/{host.name}"
    fields = {
        "interface": host.ifname,
        "link_rate": int(tb.rate_bps),
        "take_over_root": True,
        "socket": f"{rundir}/agent.sock",
        "state_dir": rundir,
        "metrics_address": "127.0.0.1:9477",
        "levels": levels,
        "backend": backend,
    }
    fields.update(extra)
    return fields


@dataclass
class RunningAgent:
    host: object
    proc: subprocess.Popen
    socket: str
    config_path: str
    stderr_path: str

    def client(self, timeout: float = 2.0) -> AgentClient:
        return AgentClient(self.socket, timeout=timeout)

    def status(self) -> dict:
        with self.client() as c:
            return c.status()

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            with open(self.stderr_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - n))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""


def _command(config_path: str) -> list[str]:
    return [sys.executable, "-m", "tensorlane.cli", "agent", "--config", config_path]


def _wait_ready(agent: RunningAgent, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        if agent.proc.poll() is not None:
            raise AgentStartError(f"agent on {agent.host.name} exited with {agent.proc.returncode} before it was "
                                  f"ready; stderr:\n{agent.stderr_tail()}")
        try:
            return agent.status()
        except (AgentUnavailable, AgentError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AgentStartError(f"agent on {agent.host.name} did not answer status on {agent.socket} within "
                                  f"{timeout} s ({last}); stderr:\n{agent.stderr_tail()}")
        time.sleep(0.1)


def stop_agent(agent: RunningAgent, timeout: float = 10.0) -> int:
    """SIGTERM ``agent`` and wait (bounded), then SIGKILL; return its exit status (negative: killed)."""
    return stop_process(agent.proc, signal.SIGTERM, timeout)


@contextlib.contextmanager
def running_agents(tb, levels: int = 4, hosts=None, backend: str = "auto", ready_timeout: float = 10.0,
                   stop_timeout: float = 10.0, workdir: str | None = None, config_extra: dict | None = None,
                   env: dict | None = None):
    """Run one agent per testbed host (``hosts``: indexes, default all); yields ``{index: RunningAgent}``.

    Raises AgentStartError when an agent does not come up, or (when the body itself raised nothing) when one did
    not exit cleanly on SIGTERM.
    """
    indexes = list(hosts) if hosts is not None else list(range(1, len(tb.hosts) + 1))
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix=f"tensorlane-agents-{getattr(tb, 'name', 'tb')}-")
    run_env = dict(os.environ)
    run_env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + run_env["PYTHONPATH"] if run_env.get("PYTHONPATH") else "")
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env.update(env or {})
    agents: dict[int, RunningAgent] = {}
    failed = False
    try:
        for i in indexes:
            host = tb.host(i)
            host.run(["ip", "link", "set", "lo", "up"], check=False, timeout=10)
            fields = agent_config(tb, host, levels=levels, backend=backend, **(config_extra or {}))
            os.makedirs(fields["state_dir"], exist_ok=True)
            config_path = os.path.join(workdir, f"{host.name}.toml")
            with open(config_path, "w") as fh:
                fh.write(render_config(fields))
            stderr_path = os.path.join(workdir, f"{host.name}.stderr")
            with open(stderr_path, "wb") as err:
                proc = host.popen(_command(config_path), stdin=subprocess.DEVNULL, stdout=err,
                                  stderr=subprocess.STDOUT, env=run_env, cwd=REPO_ROOT)
            agents[i] = RunningAgent(host, proc, fields["socket"], config_path, stderr_path)
        for agent in agents.values():
            _wait_ready(agent, ready_timeout)
        yield agents
    except BaseException:
        failed = True
        raise
    finally:
        problems = []
        for agent in agents.values():
            code = stop_agent(agent, stop_timeout)
            with contextlib.suppress(OSError):  # the per-host run directory, if the agent left it empty
                os.rmdir(os.path.dirname(agent.socket))
            if code != 0:
                problems.append(f"agent on {agent.host.name} exited with {code} on SIGTERM; stderr:\n"
                                f"{agent.stderr_tail()}")
        if problems and not failed:
            raise AgentStartError("\n".join(problems))
        if problems:
            print("\n".join(problems), file=sys.stderr)
        if own_dir and not problems:
            for name in os.listdir(workdir):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(workdir, name))
            with contextlib.suppress(OSError):
                os.rmdir(workdir)
