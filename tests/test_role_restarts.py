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
