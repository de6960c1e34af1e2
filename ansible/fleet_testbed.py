"""An emulated fleet for the Ansible role: testbed host namespaces, each with its own sshd, and one more host
namespace as the Ansible controller. Used by tests/test_ansible.py; also a CLI to try the playbooks by hand.

::

    python ansible/fleet_testbed.py up --name tan --hosts 3 --dir /tmp/tan   # prints the commands to run
    cd ansible
    ip netns exec tan-h4 ansible-playbook -i /tmp/tan/inventory.yml site.yml
    ip netns exec tan-h4 ansible-playbook -i /tmp/tan/inventory.yml uninstall.yml
    cd .. && python ansible/fleet_testbed.py down --name tan --dir /tmp/tan

Hosts 1..N are the managed hosts ``{name}-h{i}`` (eth0 198.18.0.{i}, reached over ssh on port 22 as root with a key
made for the fleet); host N+1 is the controller, an ordinary testbed host outside the inventory. The namespaces
share this machine's filesystem, so every path the role writes is put under ``DIR/hosts/{inventory_hostname}``.
The project wheel is built from this checkout and the agent's dependencies are fetched once into a wheelhouse
(``pip download``), so the hosts install offline (``--no-index``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from testbed import Testbed  # noqa: E402 (REPO_ROOT must be on sys.path first)
from testbed.topology import down_by_name  # noqa: E402

SSHD = "/usr/sbin/sshd"
PACKAGE_DIRS = ("tensorlane", "agent", "shim", "policies")   # what the wheel ships (pyproject.toml)
SSH_READY_TIMEOUT_S = 15
RECAP_RE = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)"
                      r"\s+rescued=(\d+)\s+ignored=(\d+)", re.MULTILINE)


class FleetError(RuntimeError):
    """The emulated fleet could not be built; the message says what is missing or what failed."""


def _bin(name: str) -> str:
    """An executable next to this Python (the project venv) or on PATH; FleetError if there is none."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.access(local, os.X_OK) else shutil.which(name)
    if not found:
        raise FleetError(f"{name} not found next to {sys.executable} or on PATH (pip install ansible-core)")
    return found


def check_tools() -> None:
    """FleetError naming whatever the fleet needs and this machine lacks."""
    missing = [t for t in ("ssh", "ssh-keygen", "setsid", "unshare", "ip", "tc", "nft") if not shutil.which(t)]
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} (Debian package openssh-server)")
    for tool in ("ansible-playbook",):
        try:
            _bin(tool)
        except FleetError:
            missing.append(f"{tool} (pip ansible-core)")
    if missing:
        raise FleetError(f"the emulated fleet needs: {', '.join(missing)}")


def _run(argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if proc.returncode != 0:
        raise FleetError(f"{' '.join(argv)} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    return proc


def build_wheel(out_dir: str) -> str:
    """Build the project wheel from a copy of this checkout (the tree itself gets no build/ or egg-info)."""
    src = os.path.join(out_dir, "src")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(os.path.join(REPO_ROOT, name), src)
    for name in PACKAGE_DIRS:
        shutil.copytree(os.path.join(REPO_ROOT, name), os.path.join(src, name),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = os.path.join(out_dir, "dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src],
         timeout=300)
    shutil.rmtree(src, ignore_errors=True)
    wheels = sorted(f for f in os.listdir(dist) if f.startswith("tensorlane-") and f.endswith(".whl"))
    if not wheels:
        raise FleetError(f"pip wheel left no tensorlane wheel in {dist}")
    return os.path.join(dist, wheels[-1])


def agent_dependencies() -> list[str]:
    """The distribution names in pyproject.toml's ``dependencies`` (what the agent needs, torch excluded)."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in deps]


def fill_wheelhouse(out_dir: str) -> str:
    """``pip download`` the agent's dependencies (the versions installed here) into ``out_dir/wheelhouse``."""
    house = os.path.join(out_dir, "wheelhouse")
    pins = []
    for dist in agent_dependencies():
        try:
            pins.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pins.append(dist)
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", house, *pins], timeout=300)
    return house


def _sshd_config(d: str, address: str) -> str:
    return "\n".join([
        f"ListenAddress {address}",
        "Port 22",
        f"HostKey {d}/ssh_host_ed25519_key",
        f"PidFile {d}/sshd.pid",
        f"AuthorizedKeysFile {d}/authorized_keys",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "X11Forwarding no",
        "MaxSessions 50",
        "MaxStartups 50",
        "Subsystem sftp internal-sftp",
        "",
    ])


@dataclass
class Fleet:
    """Managed hosts with an sshd each, the controller host, and the inventory that reaches them."""

    tb: Testbed
    managed: list
    controller: object
    workdir: str
    inventory: str
    env: dict
    sshd: dict = field(default_factory=dict)

    def playbook(self, name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        """Run ``ansible-playbook -i INVENTORY ansible/NAME ARGS`` in the controller namespace (not checked)."""
        argv = [_bin("ansible-playbook"), "-i", self.inventory, os.path.join(HERE, name), *args]
        return self.controller.run(argv, check=False, timeout=timeout, env=self.env, cwd=HERE)

    def host_root(self, host) -> str:
        """The directory under which the role puts everything for ``host``."""
        return os.path.join(self.workdir, "hosts", host.name)


def recap(output: str) -> dict[str, dict[str, int]]:
    """The PLAY RECAP of an ansible-playbook run: ``{host: {ok, changed, unreachable, failed, ...}}``."""
    keys = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
    return {m.group(1): dict(zip(keys, map(int, m.groups()[1:]), strict=True))
            for m in RECAP_RE.finditer(output)}


def _inventory(fleet_root: str, hosts: list, key: str, wheel: str, wheelhouse: str, rate: str,
               host_vars: dict | None = None) -> dict:
    host_vars = host_vars or {}
    return {"tensorlane": {
        "hosts": {h.name: {"ansible_host": h.ip, **host_vars.get(h.name, {})} for h in hosts},
        "vars": {
            "ansible_user": "root",
            "ansible_become": False,  # already root; the play asks for become (sudo is not installed here)
            "ansible_ssh_private_key_file": key,
            "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                                       "-o LogLevel=ERROR -o ConnectTimeout=10",
            # The hosts' Python for Ansible's modules (ansible.builtin.pip needs `packaging`); the agent's own
            # virtualenv is made by tensorlane_python, the system Python, as on a real host.
            "ansible_python_interpreter": sys.executable,
            "fleet_root": fleet_root,
            "tensorlane_install_os_packages": False,
            "tensorlane_service_manager": "none",
            # tensorlane_interfaces: the role's default, [eth0]; a host's own in host_vars.
            "tensorlane_link_rate": rate,
            "tensorlane_take_over_root": True,  # the testbed's emulated NIC has a root HTB of its own
            "tensorlane_wheel": wheel,
            # Offline, from the wheelhouse; no byte-compiling (pip reads PIP_NO_COMPILE=0 as --no-compile).
            "tensorlane_pip_environment": {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": wheelhouse, "PIP_NO_COMPILE": "0"},
            "tensorlane_install_dir": "{{ fleet_root }}/{{ inventory_hostname }}/opt",
            "tensorlane_config_dir": "{{ fleet_root }}/{{ inventory_hostname }}/etc",
            "tensorlane_run_dir": "{{ fleet_root }}/{{ inventory_hostname }}/run",
            "tensorlane_log_dir": "{{ fleet_root }}/{{ inventory_hostname }}/log",
            "tensorlane_metrics_address": "{{ ansible_host }}:9477",
        },
    }}


def _wait_ssh(controller, host, timeout: float) -> None:
    """Wait until ``host``'s sshd accepts TCP connections from the controller namespace."""
    probe = ("import socket, sys, time\n"
             "deadline = time.monotonic() + float(sys.argv[2])\n"
             "while True:\n"
             "    try:\n"
             "        socket.create_connection((sys.argv[1], 22), timeout=1).close(); break\n"
             "    except OSError:\n"
             "        if time.monotonic() > deadline: sys.exit(1)\n"
             "        time.sleep(0.1)\n")
    proc = controller.run([sys.executable, "-c", probe, host.ip, str(timeout)], check=False, timeout=timeout + 10)
    if proc.returncode != 0:
        raise FleetError(f"sshd on {host.name} ({host.ip}:22) did not answer within {timeout} s")


def start(tb: Testbed, workdir: str, managed: list[int] | None = None, controller: int | None = None,
          wheel: str | None = None, wheelhouse: str | None = None, host_vars: dict | None = None) -> Fleet:
    """sshd in every managed host of ``tb`` (default: all but the last), keys, inventory; returns the Fleet.
    ``host_vars``: inventory variables of single hosts, ``{host name: {variable: value}}``.

    Call ``stop(fleet)`` afterwards (the sshds are also ended by the testbed's teardown, which kills every
    process left in its namespaces).
    """
    check_tools()
    n = len(tb.hosts)
    managed = managed or list(range(1, n))
    controller = controller or n
    if not managed or controller in managed:
        raise FleetError("need at least one managed host and a controller host outside them")
    os.makedirs(workdir, exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    wheel = wheel or build_wheel(workdir)
    wheelhouse = wheelhouse or fill_wheelhouse(workdir)
    key = os.path.join(workdir, "id_ed25519")
    if not os.path.exists(key):
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tensorlane-fleet", "-f", key])
    fleet_root = os.path.join(workdir, "hosts")
    os.makedirs(fleet_root, exist_ok=True)
    hosts = [tb.host(i) for i in managed]
    inventory = os.path.join(workdir, "inventory.yml")
    with open(inventory, "w") as fh:  # JSON is YAML
        json.dump(_inventory(fleet_root, hosts, key, wheel, wheelhouse, tb.rate, host_vars), fh, indent=2)
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": os.path.join(HERE, "ansible.cfg"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": os.path.join(workdir, "cp"),
        "ANSIBLE_HOME": os.path.join(workdir, "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": os.path.join(workdir, "ansible-tmp"),
        "ANSIBLE_REMOTE_TMP": os.path.join(workdir, "ansible-remote-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "PATH": os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
    })
    fleet = Fleet(tb, hosts, tb.host(controller), workdir, inventory, env)
    try:
        for h in hosts:
            d = os.path.join(workdir, "sshd", h.name)
            os.makedirs(d, exist_ok=True)
            hostkey = os.path.join(d, "ssh_host_ed25519_key")
            if not os.path.exists(hostkey):
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hostkey])
            shutil.copy(key + ".pub", os.path.join(d, "authorized_keys"))
            config = os.path.join(d, "sshd_config")
            with open(config, "w") as fh:
                fh.write(_sshd_config(d, h.ip))
            with open(os.path.join(d, "sshd.log"), "ab") as log:
                fleet.sshd[h.name] = h.popen([SSHD, "-D", "-e", "-f", config], stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for h in hosts:
            _wait_ssh(fleet.controller, h, SSH_READY_TIMEOUT_S)
    except BaseException:
        stop(fleet)
        raise
    return fleet


def stop(fleet: Fleet) -> None:
    """End the sshds (and their sessions) that ``start`` began; the agents are left to the uninstall play or
    to the testbed's teardown."""
    for proc in fleet.sshd.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in fleet.sshd.values():
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@contextlib.contextmanager
def running_fleet(tb: Testbed, workdir: str, **kw):
    """``start`` on enter, ``stop`` on exit."""
    fleet = start(tb, workdir, **kw)
    try:
        yield fleet
    finally:
        stop(fleet)


def _cmd_up(args) -> int:
    tb = Testbed(hosts=args.hosts + 1, rate=args.rate, name=args.name)
    tb.up()
    try:
        fleet = start(tb, os.path.abspath(args.dir))
    except BaseException:
        tb.down()
        raise
    ctl = fleet.controller.name
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    print(f"fleet {args.name}: managed hosts {', '.join(f'{h.name} ({h.ip})' for h in fleet.managed)}; "
          f"controller namespace {ctl}; inventory {fleet.inventory}")
    print(f"  cd {HERE}")
    print(f"  ip netns exec {ctl} {playbook} -i {fleet.inventory} site.yml")
    print(f"  ip netns exec {ctl} {playbook} -i {fleet.inventory} uninstall.yml")
    print(f"  {sys.executable} {os.path.join(HERE, 'fleet_testbed.py')} down --name {args.name} --dir {args.dir}")
    return 0


def _cmd_down(args) -> int:
    removed = down_by_name(args.name)  # SIGTERM, then SIGKILL, to whatever still runs in the namespaces
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"fleet {args.name}: removed {', '.join(removed) if removed else 'no namespaces'} and {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleet_testbed.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="testbed + sshd per host + inventory, left running")
    up.add_argument("--name", default="tan")
    up.add_argument("--hosts", type=int, default=3, help="managed hosts (one more namespace is the controller)")
    up.add_argument("--rate", default="100mbit")
    up.add_argument("--dir", default="/tmp/tensorlane-fleet")
    down = sub.add_parser("down", help="stop everything in the namespaces, remove them and the directory")
    down.add_argument("--name", default="tan")
    down.add_argument("--dir", default="/tmp/tensorlane-fleet")
    args = p.parse_args(argv)
    try:
        return {"up": _cmd_up, "down": _cmd_down}[args.cmd](args)
    except (FleetError, OSError, ValueError, subprocess.SubprocessError) as exc:
        print(f"fleet_testbed: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
