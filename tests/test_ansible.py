"""The Ansible role (ansible/): ansible-lint's production profile, and a real deployment to three emulated hosts.

The hosts are testbed namespaces ``tan-h1..3``, each with its own sshd; ``ansible-playbook`` runs in a fourth
host namespace (the controller) and reaches them with the ssh connection plugin (ansible/fleet_testbed.py).
The test checks that the first run changes every host and the second changes nothing, that each agent answers on
its metrics endpoint and queues and marks a registered flow, and that the uninstall play leaves each host's
qdiscs, classes, filters and nftables tables exactly as they were before the deployment.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from testbed import Testbed

pytestmark = pytest.mark.netns

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSIBLE_DIR = os.path.join(REPO_ROOT, "ansible")
RATE = "100mbit"


def _load_fleet():
    spec = importlib.util.spec_from_file_location("fleet_testbed", os.path.join(ANSIBLE_DIR, "fleet_testbed.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fleet_testbed = _load_fleet()


def _tool(name: str) -> str:
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.access(local, os.X_OK) else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing: pip install ansible-core ansible-lint (the test extra)")
    return found


def host_state(host) -> str:
    """What the uninstall must give back: the interface's qdiscs, classes and filters, and the nftables tables."""
    return "\n".join(f"$ {' '.join(argv)}\n" + host.run(argv, timeout=10).stdout
                     for argv in (["tc", "qdisc", "show", "dev", "eth0"], ["tc", "class", "show", "dev", "eth0"],
                                  ["tc", "filter", "show", "dev", "eth0"], ["nft", "list", "tables"]))


def _playbook(fleet, name: str, *args: str, hosts=None) -> tuple[dict, str]:
    """Run a playbook from the controller; assert that it reached every host (``hosts``) and failed nowhere."""
    proc = fleet.playbook(name, *args, timeout=240)
    out = proc.stdout + proc.stderr
    stats = fleet_testbed.recap(out)
    expected = {h.name for h in (hosts or fleet.managed)}
    assert proc.returncode == 0 and set(stats) == expected, f"ansible-playbook {name} failed:\n{out[-6000:]}"
    assert all(s["failed"] == 0 and s["unreachable"] == 0 for s in stats.values()), out[-6000:]
    return stats, out


FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"

# Sends UDP from a socket it owns, registered with the agent at a level first (level < 0: unregistered), so that
# the agent accepts the registration whether or not it checks who owns a flow.
SENDER = r"""
import json, socket, sys, time
from tensorlane.client import AgentClient
path, src, dst, sport, dport, level, seconds, pps = sys.argv[1:]
sport, dport, level, seconds, pps = int(sport), int(dport), int(level), float(seconds), float(pps)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, AgentClient(path, timeout=10) as agent:
    s.bind((src, sport))
    s.connect((dst, dport))
    reply = None
    if level >= 0:
        reply = agent.register("fleet-test", level, [{"proto": "udp", "src": src, "sport": sport, "dst": dst,
                                                      "dport": dport}])
    sent, start = 0, time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        while sent < int((now - start) * pps) + 1:
            try:
                s.send(b"x" * 1000)
            except ConnectionRefusedError:  # ICMP port unreachable: the receiver is not bound yet; the packet is lost
                pass
            sent += 1
        time.sleep(0.005)
    for _ in range(3):
        try:
            s.send(b"stop")
        except ConnectionRefusedError:
            pass
    if level >= 0:
        agent.unregister("fleet-test")
print(json.dumps({"sent": sent, "bytes": sent * 1000, "reply": reply}))
"""


def udp_through_agent(fleet, sender, receiver, sport: int, dport: int, level: int, seconds: float = 1.0) -> dict:
    """Send from ``sender`` to ``receiver`` (registered at ``level`` with the sender's deployed agent)."""
    venv_python = os.path.join(fleet.host_root(sender), "opt", "venv", "bin", "python")
    sock = os.path.join(fleet.host_root(sender), "run", "agent.sock")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    recv = receiver.popen([sys.executable, "-m", "testbed.udpprobe", "recv", "--port", str(dport), "--seconds",
                           str(seconds + 5)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        time.sleep(1.0)  # the receiver imports and binds (about 0.4 s on this machine)
        sent = sender.run([venv_python, "-c", SENDER, sock, sender.ip, receiver.ip, str(sport), str(dport),
                           str(level), str(seconds), "300"], timeout=seconds + 15)
        got = json.loads(recv.communicate(timeout=seconds + 10)[0])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
    return {"sent": json.loads(sent.stdout), **got}


def agent_classes(fleet, host) -> dict:
    venv_python = os.path.join(fleet.host_root(host), "opt", "venv", "bin", "python")
    sock = os.path.join(fleet.host_root(host), "run", "agent.sock")
    out = subprocess.run([venv_python, "-m", "tensorlane.cli", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, timeout=15, check=True).stdout
    return {c["class"]: c for c in json.loads(out)["classes"]}


def test_ansible_lint_production_profile():
    lint = _tool("ansible-lint")
    env = dict(os.environ, NO_COLOR="1", PATH=os.path.dirname(lint) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([lint, "--profile", "production", "--offline"], cwd=ANSIBLE_DIR, capture_output=True,
                          text=True, timeout=240, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Profile 'production' was required, and it passed" in out, out[-3000:]


def test_deploy_is_idempotent_enforces_and_uninstall_restores():
    try:
        fleet_testbed.check_tools()
    except fleet_testbed.FleetError as exc:
        pytest.fail(str(exc))
    workdir = tempfile.mkdtemp(prefix="tan-")  # short: the agents' socket paths lie under it
    try:
        with Testbed(hosts=4, rate=RATE, name="tan") as tb, \
                fleet_testbed.running_fleet(tb, workdir, managed=[1, 2, 3], controller=4) as fleet:
            before = {h.name: host_state(h) for h in fleet.managed}

            first, out = _playbook(fleet, "site.yml")
            assert all(s["changed"] > 0 for s in first.values()), out[-4000:]

            for h in fleet.managed:
                tc = h.run(["tc", "class", "show", "dev", "eth0"]).stdout
                assert "class htb 7a1:10" in tc and "class htb 7a1:14" in tc, tc  # 4 levels + default class
                assert "table inet tensorlane" in h.run(["nft", "list", "tables"]).stdout
                metrics = fleet.controller.run([sys.executable, "-c", FETCH, f"http://{h.ip}:9477/metrics"],
                                               timeout=15).stdout
                assert "tensorlane_" in metrics, metrics[:2000]

            h1, h2 = fleet.managed[0], fleet.managed[1]
            before_classes = agent_classes(fleet, h1)
            marked = udp_through_agent(fleet, h1, h2, 9301, 9300, level=0)
            plain = udp_through_agent(fleet, h1, h2, 9302, 9300, level=-1, seconds=0.5)
            after_classes = agent_classes(fleet, h1)
            assert marked["sent"]["reply"]["dscp"] == 46 and marked["sent"]["reply"]["class"] == "7a1:10"
            assert marked["packets"] >= 0.95 * marked["sent"]["sent"], marked
            assert marked["dscp"] == {"46": marked["packets"]}, marked["dscp"]
            assert plain["packets"] > 0 and plain["dscp"] == {"0": plain["packets"]}, plain["dscp"]
            assert after_classes["7a1:10"]["bytes"] - before_classes["7a1:10"]["bytes"] >= marked["sent"]["bytes"]

            second, out = _playbook(fleet, "site.yml")
            assert all(s["changed"] == 0 for s in second.values()), f"second run changed something:\n{out[-6000:]}"

            # A changed setting rewrites the config and the handler restarts that host's agent with it.
            pid_file = os.path.join(fleet.host_root(h1), "run", "agent.pid")
            with open(pid_file) as fh:
                pid = fh.read().strip()
            third, out = _playbook(fleet, "site.yml", "--limit", h1.name, "-e", "tensorlane_levels=3", hosts=[h1])
            with open(pid_file) as fh:
                new_pid = fh.read().strip()
            tc = h1.run(["tc", "class", "show", "dev", "eth0"]).stdout
            assert third[h1.name]["changed"] >= 2 and new_pid != pid, out[-4000:]
            assert "class htb 7a1:13" in tc and "class htb 7a1:14" not in tc, tc  # 3 levels + default class

            _, out = _playbook(fleet, "uninstall.yml")
            after = {h.name: host_state(h) for h in fleet.managed}
            assert after == before, out[-3000:]
            for h in fleet.managed:
                assert os.listdir(fleet.host_root(h)) == [], f"{h.name}: left {os.listdir(fleet.host_root(h))}"
            print(f"changed per host: first run {[s['changed'] for s in first.values()]}, second run "
                  f"{[s['changed'] for s in second.values()]}, levels change on {h1.name} {third[h1.name]['changed']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
