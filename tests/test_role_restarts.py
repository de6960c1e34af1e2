"""Which of the role's changes restart the agent (no network, no Ansible run): every file the running agent or its
supervisor reads when it starts, and nothing else, notifies the restart handler, so that a changed variable is in
effect after the play (docs/deploy.md, "What running jobs see")."""
from __future__ import annotations

import os

import yaml

ROLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ansible", "roles", "tensorlane")


def tasks(name: str) -> dict[str, dict]:
    with open(os.path.join(ROLE, "tasks", name)) as fh:
        return {t["name"]: t for t in yaml.safe_load(fh)}


def test_what_the_agent_or_its_supervisor_reads_at_start_restarts_it_when_changed():
    restarting = {name: task.get("notify") for file in ("install.yml", "configure.yml", "service-systemd.yml",
                                                          "service-none.yml") for name, task in tasks(file).items()}
    for name in ("Install tensorlane into its virtualenv, version {{ __tensorlane_install_version }}",
                 "Write the agent configuration", "Install the systemd unit",
                 # the supervisor's watchdog timeout, restart pause and open-file limit are in the script: a running
                 # supervisor keeps the old ones until it is started again
                 "Install tensorlane-agentctl"):
        assert restarting[name] == "Restart tensorlane", name
    assert restarting["Create the install directories"] is None and restarting["Copy the tensorlane wheel"] is None


def _handover_restart(tmp_path, main_pid: int, timeout_s: int = 5):
    """Run the systemd handler's script (files/handover-restart.sh) with a stub ``systemctl`` in PATH that logs each
    call and acts on process ``main_pid`` as the unit's main process (0: an inactive unit)."""
    import subprocess

    calls = tmp_path / "calls"
    stub = tmp_path / "bin" / "systemctl"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"""#!/bin/sh
alive() {{ [ {main_pid} -gt 0 ] && [ -e /proc/{main_pid} ] && [ "$(cut -d' ' -f3 /proc/{main_pid}/stat)" != Z ]; }}
echo "$* alive=$(alive && echo 1 || echo 0)" >>{calls}
case $1 in
    show) echo {main_pid} ;;
    is-active) alive ;;
    kill) kill -USR2 {main_pid} ;;
esac
""")
    stub.chmod(0o755)
    with open(os.path.join(ROLE, "files", "handover-restart.sh")) as fh:
        script = fh.read()
    proc = subprocess.run(["sh", "-c", script, "handover", "tensorlane-agent", str(timeout_s)], capture_output=True,
                          text=True, timeout=30, env={**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"})
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_the_systemd_handler_hands_over_then_restarts(tmp_path):
    """Under systemd the restart handler is a hand-over: SIGUSR2 to the unit's main process, a wait until it has
    exited, then ``systemctl restart`` (which starts the new agent); an inactive unit is just restarted; an agent
    that does not exit is left running and the handler fails. Until 2026-11-28 the handler was ``systemctl
    restart``: SIGTERM, the host restored, then taken over again (no queueing ~0.3 s, marks gone until the shims
    registered again). The agent's side: tests/test_watchdog.py (the same SIGUSR2 through tensorlane-agentctl)."""
    import subprocess
    import time

    with open(os.path.join(ROLE, "handlers", "main.yml")) as fh:
        handler = next(h for h in yaml.safe_load(fh) if h["name"] == "Restart tensorlane")
    assert "handover-restart.sh" in str(handler["ansible.builtin.command"]["argv"]), handler
    agent = subprocess.Popen(["sh", "-c", "trap 'sleep 0.3; exit 0' USR2; while :; do sleep 0.05; done"])
    try:
        time.sleep(0.2)  # (the trap installed)
        proc, calls = _handover_restart(tmp_path, agent.pid)
        assert proc.returncode == 0 and "handed over" in proc.stdout and "started" in proc.stdout, proc
        assert [c.split()[0] for c in calls] == ["daemon-reload", "show", "is-active", "kill", "restart"], calls
        assert "--signal=SIGUSR2" in calls[3] and calls[-1].endswith("alive=0"), calls  # exited before the start
    finally:
        agent.kill()
        agent.wait(5)
    (tmp_path / "calls").unlink()
    proc, calls = _handover_restart(tmp_path, 0)
    assert proc.returncode == 0 and proc.stdout.strip() == "started", proc
    assert [c.split()[0] for c in calls] == ["daemon-reload", "show", "restart"], calls
    (tmp_path / "calls").unlink()
    stuck = subprocess.Popen(["sh", "-c", "trap ':' USR2; while :; do sleep 0.05; done"])  # caught, not exiting
    try:
        time.sleep(0.2)
        proc, calls = _handover_restart(tmp_path, stuck.pid, timeout_s=1)
        assert proc.returncode == 1 and "still runs 1 s after SIGUSR2" in proc.stderr, proc
        assert "restart" not in [c.split()[0] for c in calls] and stuck.poll() is None, calls
    finally:
        stuck.kill()
        stuck.wait(5)


def test_the_systemd_handler_restarts_an_agent_without_the_hand_over_with_sigterm(tmp_path):
    """An agent from before the hand-over (2026-11-28) has no SIGUSR2 handler: SIGUSR2's default action kills it,
    without its restore, and systemd counts death by SIGUSR2 as a failure. The handler reads whether the unit's main
    process catches SIGUSR2 (SigCgt in /proc/PID/status) and, where it does not, does the old restart: ``systemctl
    restart`` (SIGTERM: restore, take over again). The old agent here is a real Python process with SIGUSR2 at its
    default: it must be alive after the script (the stub's restart does nothing), not killed. Until 2026-11-28 the
    first upgrade of a fleet through this handler killed every running agent."""
    import subprocess
    import sys
    import time

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        proc, calls = _handover_restart(tmp_path, old.pid)
        assert old.poll() is None, f"the old agent was killed (status {old.returncode}): {proc} {calls}"
        assert proc.returncode == 0 and "does not catch SIGUSR2" in proc.stdout and "handed over" not in proc.stdout, \
            proc
        assert [c.split()[0] for c in calls] == ["daemon-reload", "show", "is-active", "restart"], calls
    finally:
        old.kill()
        old.wait(5)
