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

import tomli_w

from bench.workers import REPO_ROOT, repo_env, stop_process, tail
from tensorlane.client import AgentClient, AgentError, AgentUnavailable


class AgentStartError(RuntimeError):
    """An agent did not come up, or did not stop cleanly."""


def render_config(fields: dict) -> str:
    """The agent's TOML config file of ``fields`` (None values left out, tables' keys as strings).

    Usage: ``render_config(agent_config(tb, tb.host(1)))``; ``tensorlane.agent.config.load_config`` reads it.
    """
    return tomli_w.dumps({k: {str(kk): vv for kk, vv in v.items()} if isinstance(v, dict) else v
                          for k, v in fields.items() if v is not None})


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
    if "interfaces" in extra:  # several interfaces (or "auto") instead of the host's one
        del fields["interface"]
    fields.update(extra)
    return fields


@dataclass
class RunningAgent:
    """One agent process on a testbed host: its socket, config file and stderr log."""

    host: object
    proc: subprocess.Popen
    socket: str
    config_path: str
    stderr_path: str

    def client(self, timeout: float = 2.0) -> AgentClient:
        """A client of this agent (a context manager). Usage: ``with agent.client() as c: c.status()``"""
        return AgentClient(self.socket, timeout=timeout)

    def status(self) -> dict:
        """The agent's ``status`` reply."""
        with self.client() as c:
            return c.status()

    def cpu_s(self) -> float | None:
        """Seconds of CPU the agent has used so far, all its threads, user and system (``/proc/PID/stat``); None
        once it has exited."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15

    def stderr_tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the agent's stderr."""
        return tail(self.stderr_path, n)


def _start_agent(tb, index: int, workdir: str, env: dict, **fields) -> RunningAgent:
    """Write the config of the agent on host ``index`` into ``workdir`` and start it (``fields``: agent_config's)."""
    host = tb.host(index)
    host.run(["ip", "link", "set", "lo", "up"], check=False, timeout=10)
    config = agent_config(tb, host, **fields)
    os.makedirs(config["state_dir"], exist_ok=True)
    config_path = os.path.join(workdir, f"{host.name}.toml")
    with open(config_path, "w") as fh:
        fh.write(render_config(config))
    stderr_path = os.path.join(workdir, f"{host.name}.stderr")
    with open(stderr_path, "wb") as err:
        proc = host.popen([sys.executable, "-m", "tensorlane.cli", "agent", "--config", config_path],
                          stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    return RunningAgent(host, proc, config["socket"], config_path, stderr_path)


def _wait_ready(agent: RunningAgent, timeout: float) -> dict:
    """Poll ``status`` until the agent answers (bounded); AgentStartError with its stderr if it exits or not."""
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


def _stop_agents(agents, timeout: float) -> list[str]:
    """SIGTERM every agent (SIGKILL after ``timeout``); one line per agent that did not exit with 0."""
    problems = []
    for agent in agents:
        code = stop_process(agent.proc, signal.SIGTERM, timeout)
        with contextlib.suppress(OSError):  # the per-host run directory, if the agent left it empty
            os.rmdir(os.path.dirname(agent.socket))
        if code != 0:
            problems.append(f"agent on {agent.host.name} exited with {code} on SIGTERM; stderr:\n"
                            f"{agent.stderr_tail()}")
    return problems


def _remove_dir(path: str) -> None:
    """Remove ``path`` and the files in it (what could not be removed stays)."""
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


@contextlib.contextmanager
def running_agents(tb, levels: int = 4, hosts=None, backend: str = "auto", ready_timeout: float = 30.0,
                   stop_timeout: float = 10.0, workdir: str | None = None, config_extra: dict | None = None,
                   env: dict | None = None):
    """Run one agent per testbed host (``hosts``: indexes, default all); yields ``{index: RunningAgent}``.
    Their configs and logs go to ``workdir`` (created if missing; default: a temporary directory, removed after a
    clean stop).

    Raises AgentStartError when an agent does not come up, or (when the body itself raised nothing) when one did
    not exit cleanly on SIGTERM.
    """
    indexes = list(hosts) if hosts is not None else list(range(1, len(tb.hosts) + 1))
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix=f"tensorlane-agents-{getattr(tb, 'name', 'tb')}-")
    os.makedirs(workdir, exist_ok=True)
    run_env = repo_env(env)
    agents: dict[int, RunningAgent] = {}
    failed = False
    try:
        for i in indexes:
            agents[i] = _start_agent(tb, i, workdir, run_env, levels=levels, backend=backend, **(config_extra or {}))
        for agent in agents.values():
            _wait_ready(agent, ready_timeout)
        yield agents
    except BaseException:
        failed = True
        raise
    finally:
        problems = _stop_agents(agents.values(), stop_timeout)
        if problems and not failed:
            raise AgentStartError("\n".join(problems))
        if problems:
            print("\n".join(problems), file=sys.stderr)
        if own_dir and not problems:
            _remove_dir(workdir)
