"""The Ansible role (ansible/): ansible-lint's production profile, and a real deployment to three emulated hosts.

The hosts are testbed namespaces ``tan-h1..3`` with two NICs each (eth0, eth1) and their own sshd;
``ansible-playbook`` runs in a fourth host namespace (the controller) and reaches them with the ssh connection
plugin (ansible/fleet_testbed.py). h1 names both NICs (``tensorlane_interfaces``, a rate per device), h2 one with
the older ``tensorlane_interface``, h3 finds both by their routes (``auto``). The test checks that the first run
changes every host and the second changes nothing, that each agent answers on its metrics endpoint, manages the
interfaces it was given and queues and marks a registered flow, and that the uninstall play leaves each host's
qdiscs, classes, filters and nftables tables exactly as they were before the deployment.

Without a network: the role's defaults, argument spec and docs/deploy.md agree; the config template renders each
way of naming interfaces and link rates into a file the agent reads back; preflight refuses conflicting settings.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
import zipfile

import pytest
import yaml

from tensorlane.agent.config import from_dict, parse_rate
from testbed import Testbed

pytestmark = [pytest.mark.netns, pytest.mark.concurrent]  # beside another file's (make test)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSIBLE_DIR = os.path.join(REPO_ROOT, "ansible")
ROLE = os.path.join(ANSIBLE_DIR, "roles", "tensorlane")
DEFAULTS = os.path.join(ROLE, "defaults", "main.yml")
RATE = "100mbit"
RATE_ETH1 = "50mbit"  # h1's second NIC, by a per-device tensorlane_link_rate
DEVICES = ("eth0", "eth1")


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
    """What the uninstall must give back: each NIC's qdiscs, classes and filters, and the nftables tables."""
    argvs = [["tc", what, "show", "dev", dev] for dev in DEVICES for what in ("qdisc", "class", "filter")]
    return "\n".join(f"$ {' '.join(argv)}\n" + host.run(argv, timeout=10).stdout
                     for argv in [*argvs, ["nft", "list", "tables"]])


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
        deadline = time.monotonic() + 15  # the receiver imports and binds (about 0.4 s on this machine)
        while not receiver.run(["ss", "-Hlun", f"sport = :{dport}"], timeout=10).stdout.strip():
            assert recv.poll() is None and time.monotonic() < deadline, f"the receiver never bound port {dport}"
            time.sleep(0.05)
        sent = sender.run([venv_python, "-c", SENDER, sock, sender.ip, receiver.ip, str(sport), str(dport),
                           str(level), str(seconds), "300"], timeout=seconds + 15)
        got = json.loads(recv.communicate(timeout=seconds + 10)[0])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
    return {"sent": json.loads(sent.stdout), **got}


def agent_status(fleet, host) -> dict:
    venv_python = os.path.join(fleet.host_root(host), "opt", "venv", "bin", "python")
    sock = os.path.join(fleet.host_root(host), "run", "agent.sock")
    out = subprocess.run([venv_python, "-m", "tensorlane.cli", "status", "--socket", sock, "--json"],
                         capture_output=True, text=True, timeout=15, check=True).stdout
    return json.loads(out)


def agent_classes(fleet, host) -> dict:
    """The classes' counters, summed over the agent's queue devices."""
    return {c["class"]: c for c in agent_status(fleet, host)["classes"]}


def wheel_as_version(wheel: str, version: str, out_dir: str) -> str:
    """A copy of ``wheel`` that is distribution version ``version`` (file name, dist-info directory, METADATA and
    RECORD; the agent reports the version from the metadata), to deploy an upgrade and a rollback without a build."""
    name = os.path.basename(wheel)
    old = name.split("-")[1]
    dist = f"tensorlane-{version}"
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, name.replace(f"tensorlane-{old}-", f"{dist}-"))
    with zipfile.ZipFile(wheel) as src:
        files = {i.filename.replace(f"tensorlane-{old}.dist-info/", f"{dist}.dist-info/"): src.read(i)
                 for i in src.infolist()}
    meta = f"{dist}.dist-info/METADATA"
    files[meta] = files[meta].replace(f"\nVersion: {old}\n".encode(), f"\nVersion: {version}\n".encode(), 1)
    record = f"{dist}.dist-info/RECORD"

    def row(path: str) -> str:
        if path == record:
            return f"{path},,"
        digest = base64.urlsafe_b64encode(hashlib.sha256(files[path]).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(files[path])}"
    files[record] = ("\n".join(row(p) for p in files) + "\n").encode()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for path, data in files.items():
            dst.writestr(path, data)
    return out


def agent_starts(fleet, host) -> int:
    """How many times tensorlane-agentctl's supervisor has started ``host``'s agent (its log's lines)."""
    with open(os.path.join(fleet.host_root(host), "log", "agent.log")) as fh:
        return sum("tensorlane-agentctl: starting " in line for line in fh)


def dependencies(fleet, host) -> dict[str, int]:
    """The inode of each distribution's metadata directory in ``host``'s virtualenv, tensorlane's own aside: a
    dependency that pip reinstalled has a new one."""
    lib = os.path.join(fleet.host_root(host), "opt", "venv", "lib")
    site = [os.path.join(lib, v, "site-packages") for v in os.listdir(lib)]
    return {d: os.stat(os.path.join(s, d)).st_ino for s in site for d in os.listdir(s)
            if d.endswith(".dist-info") and not d.startswith("tensorlane-")}


def wheels(fleet, host) -> list[str]:
    """The wheels the role keeps in ``host``'s install directory."""
    return sorted(os.listdir(os.path.join(fleet.host_root(host), "opt", "wheels")))


# --- without a network: defaults, argument spec and docs; the config template; preflight refusals -------------
def _ansible_env(tmp_path) -> dict:
    return dict(os.environ, ANSIBLE_CONFIG=os.path.join(ANSIBLE_DIR, "ansible.cfg"),
                ANSIBLE_ROLES_PATH=os.path.join(ANSIBLE_DIR, "roles"), ANSIBLE_HOME=str(tmp_path / "ansible-home"),
                ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"), ANSIBLE_NOCOLOR="1", ANSIBLE_RETRY_FILES_ENABLED="0")


def render(tmp_path, src: str, name: str, **overrides) -> str:
    """The text of ``src`` (a path) rendered by ansible's template module, locally, with the role's defaults and
    ``overrides`` (as extra variables, over the defaults)."""
    dest = tmp_path / name
    extra = {"ansible_python_interpreter": sys.executable, **overrides}
    proc = subprocess.run([_tool("ansible"), "localhost", "-c", "local", "-i", "localhost,", "-m",
                           "ansible.builtin.template", "-a", f"src={src} dest={dest} mode=0644", "-e", f"@{DEFAULTS}",
                           "-e", json.dumps(extra)], capture_output=True, text=True, timeout=120, check=False,
                          env=_ansible_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dest.read_text()


def _spec_options() -> dict:
    with open(os.path.join(ROLE, "meta", "argument_specs.yml")) as fh:
        specs = yaml.safe_load(fh)["argument_specs"]
    assert specs["uninstall"]["options"] == specs["main"]["options"]
    return specs["main"]["options"]


def _documented_defaults() -> dict[str, str]:
    """docs/deploy.md's variables table: ``{variable: its default column}`` (a row naming two, ``a` / `b``, with two
    defaults or one for both, gives each its own)."""
    with open(os.path.join(REPO_ROOT, "docs", "deploy.md")) as fh:
        rows = [line.split("|")[1:3] for line in fh if line.startswith("| `tensorlane_")]
    out = {}
    for names, default in rows:
        names = [n.strip().strip("`") for n in names.split(" / ")]
        defaults = [d.strip().strip("`") for d in default.split(" / ")]
        out |= dict(zip(names, defaults if len(defaults) == len(names) else defaults[:1] * len(names), strict=True))
    return out


def test_defaults_argument_spec_and_docs_agree(tmp_path):
    """Each variable has one default, in defaults/main.yml; the argument spec states it as the defaults render
    (templated ones with nothing else set), and docs/deploy.md's table lists every variable with that default (or
    the template it comes from). A variable without a default (the older tensorlane_interface) has none anywhere."""
    with open(DEFAULTS) as fh:
        raw = yaml.safe_load(fh)
    options = _spec_options()
    types = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list, "dict": dict, "raw": object}
    untyped = {k: v.get("type") for k, v in options.items() if v.get("type") not in types or not v.get("description")}
    assert not untyped, f"options without a type (or an unknown one) or a description: {untyped}"
    mistyped = {k: (options[k]["type"], v) for k, v in raw.items()
                if k in options and not isinstance(v, types[options[k]["type"]])}
    assert not mistyped, f"defaults/main.yml's value is not of the argument spec's type: {mistyped}"
    with_default = {k for k, v in options.items() if "default" in v}
    assert set(raw) == with_default, f"defaults only: {set(raw) - with_default}, spec only: {with_default - set(raw)}"
    names = sorted(options)
    template = tmp_path / "vars.j2"
    template.write_text("{{ dict(__names | zip(query('ansible.builtin.vars', *__names))) | to_json }}")
    rendered = json.loads(render(tmp_path, str(template), "vars.json", __names=sorted(raw)))
    wrong = {k: (options[k]["default"], rendered[k]) for k in sorted(raw) if options[k]["default"] != rendered[k]}
    assert not wrong, f"argument spec default != rendered default: {wrong}"
    documented = _documented_defaults()
    assert set(names) <= set(documented), f"not in docs/deploy.md's table: {sorted(set(names) - set(documented))}"
    for name in names:
        text = documented[name]
        if name not in raw:
            assert text in ("", "unset", "-"), f"{name} has no default, docs/deploy.md says {text!r}"
        elif not text.startswith("...") and text != raw[name]:  # "...": a path given in full on the row already
            value = yaml.safe_load(text)
            assert value in (raw[name], rendered[name]), f"{name}: docs/deploy.md says {text!r}, default {raw[name]!r}"


def test_the_deploy_docs_config_extra_examples_render_into_a_config_the_agent_takes(tmp_path):
    """Each ```yaml example of docs/deploy.md that sets tensorlane_config_extra, rendered by agent.toml.j2, is a
    config the agent's parser takes with those settings; among them kernel_tcp_dscp, which a host whose kernel TCP
    clients mark their traffic (NVMe/TCP) needs: until 2026-11-29 the deploy docs did not say that the agent resets
    those marks by default, nor how to keep them."""
    with open(os.path.join(REPO_ROOT, "docs", "deploy.md")) as fh:
        blocks = re.findall(r"```yaml\n(.*?)```", fh.read(), re.S)
    examples = [yaml.safe_load(textwrap.dedent(b)) for b in blocks if "tensorlane_config_extra:" in b]
    assert examples
    for i, example in enumerate(examples):
        example.pop("tensorlane_socket_group", None)  # a group of the example's, not of this machine
        text = render(tmp_path, os.path.join(ROLE, "templates", "agent.toml.j2"), f"agent-{i}.toml", **example)
        cfg = from_dict(tomllib.loads(text))
        for key, value in example["tensorlane_config_extra"].items():
            assert getattr(cfg, key) == (tuple(value) if isinstance(value, list) else value), (key, text)
    assert any("kernel_tcp_dscp" in e["tensorlane_config_extra"] for e in examples)


RENDER_CASES = {
    "two NICs, a rate each": ({"tensorlane_interfaces": ["eth0", "eth1"],
                               "tensorlane_link_rate": {"eth0": "25gbit", "eth1": "100gbit"}},
                              ("eth0", "eth1"), (), {"eth0": 25 * 10**9, "eth1": 100 * 10**9}),
    "older tensorlane_interface": ({"tensorlane_interface": "ens1f0", "tensorlane_link_rate": "25gbit"},
                                   ("ens1f0",), (), 25 * 10**9),
    "auto": ({"tensorlane_interfaces": "auto", "tensorlane_training_subnets": ["10.1.0.0/16", "fd00:10::/64"]},
             (), ("10.1.0.0/16", "fd00:10::/64"), None),
    "defaults": ({}, ("eth0",), (), None),
}


@pytest.mark.parametrize("case", list(RENDER_CASES))
def test_config_template_renders_interfaces_and_link_rates(tmp_path, case):
    """agent.toml.j2 writes the interfaces (one as ``interface``, as before), the subnets with auto, and one link
    rate or an inline table of them; the agent's own parser reads back what was asked for."""
    overrides, interfaces, subnets, rates = RENDER_CASES[case]
    text = render(tmp_path, os.path.join(ROLE, "templates", "agent.toml.j2"), "agent.toml", **overrides)
    cfg = from_dict(tomllib.loads(text))
    assert (cfg.interfaces, cfg.training_subnets, cfg.link_rate_bps) == (interfaces, subnets, rates), text
    if isinstance(rates, dict):
        assert 'link_rate = { "eth0" = "25gbit", "eth1" = "100gbit" }' in text.splitlines(), text
        assert cfg.rate_of("eth1") == 100 * 10**9 and cfg.rate_of("eth2") is None
    if len(interfaces) == 1:
        assert f'interface = "{interfaces[0]}"' in text.splitlines(), text  # what the role wrote before


REFUSALS = {
    "both": ({"tensorlane_interface": "eth0", "tensorlane_interfaces": ["eth0", "eth1"]},
             "sets both tensorlane_interfaces"),
    "auto without subnets": ({"tensorlane_interfaces": "auto"}, "tensorlane_interfaces: auto needs "
                                                                 "tensorlane_training_subnets"),
    "subnets without auto": ({"tensorlane_interfaces": ["eth0"], "tensorlane_training_subnets": ["10.0.0.0/8"]},
                             "tensorlane_training_subnets is used only with tensorlane_interfaces: auto"),
    "watchdog under two passes": ({"tensorlane_interfaces": ["eth0"], "tensorlane_watchdog_s": 8,
                                   "tensorlane_reconcile_interval_s": 5},
                                  "tensorlane_watchdog_s (8) must be more than twice tensorlane_reconcile_interval_s"),
    "config_extra repeating a setting the role writes": ({"tensorlane_interfaces": ["eth0"],
                                                          "tensorlane_config_extra": {"levels": 3, "min_share": 0.02}},
                                                         "tensorlane_config_extra sets levels, which the role writes "
                                                         "itself: set tensorlane_levels instead"),
    "the public PyPI": ({"tensorlane_interfaces": ["eth0"], "tensorlane_link_rate": "1gbit"},
                        "tensorlane is not published on the public PyPI"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_preflight_refuses_conflicting_interface_settings(tmp_path, case):
    """The role's first checks stop the play on this machine (nothing installed, nothing probed) and say why."""
    overrides, message = REFUSALS[case]
    play = tmp_path / "play.yml"
    play.write_text("- name: Preflight only\n  hosts: localhost\n  gather_facts: false\n  roles: [tensorlane]\n")
    extra = {"ansible_python_interpreter": sys.executable, "tensorlane_install_os_packages": False, **overrides}
    proc = subprocess.run([_tool("ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "--tags",
                           "tensorlane_preflight", "-e", json.dumps(extra)], capture_output=True, text=True,
                          timeout=120, check=False, env=_ansible_env(tmp_path))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and message in out, out[-3000:]
    assert "Probe the host" not in out, out[-3000:]


def test_preflight_refuses_a_device_without_a_rate_for_htb(tmp_path):
    """The whole preflight on this machine's loopback (its driver reports no speed; this kernel has no sch_prio, so
    ``auto`` is htb): without tensorlane_link_rate the play stops naming the device, where the agent would refuse to
    start after the config was written (until 2026-11-28 the play went on and failed 30 s later in verify with `no
    agent at SOCKET`); with a rate for it every check passes."""
    play = tmp_path / "play.yml"
    play.write_text("- name: Preflight only\n  hosts: localhost\n  gather_facts: false\n  roles: [tensorlane]\n")
    base = {"ansible_python_interpreter": sys.executable, "tensorlane_install_os_packages": False,
            "tensorlane_python": sys.executable, "tensorlane_service_manager": "none", "tensorlane_interfaces": ["lo"],
            "tensorlane_pip_environment": {"PIP_INDEX_URL": "https://pypi.invalid/simple"}}
    outs = {}
    for name, rate in (("none", ""), ("lo's", {"lo": "1gbit"})):
        proc = subprocess.run([_tool("ansible-playbook"), "-i", "localhost,", "-c", "local", str(play), "--tags",
                               "tensorlane_preflight", "-e", json.dumps({**base, "tensorlane_link_rate": rate})],
                              capture_output=True, text=True, timeout=120, check=False, env=_ansible_env(tmp_path))
        outs[name] = (proc.returncode, " ".join((proc.stdout + proc.stderr).split()))
    rc, out = outs["none"]
    assert rc != 0 and "On localhost lo report no link speed" in out and '{"lo": "25gbit"}' in out, out[-3000:]
    rc, out = outs["lo's"]
    assert rc == 0 and "failed=0" in out, out[-3000:]



UNSUPPORTED = {  # host: (a stub of `unshare` for the probe's throwaway namespace, a stub Python, the message)
    "nohtb": ('echo "nftables yes"', None,
              "the agent needs sch_htb or sch_prio (backend auto) and nf_tables, with tc (iproute2), nft (nftables) "
              "and unshare (util-linux); a probe in a throwaway network namespace found only: nftables yes."),
    "nonft": ('echo "qdisc htb"', None, "found only: qdisc htb."),
    "py310": (None, 'case "$2" in *version_info*) exit 1 ;; *) echo 3.10.12 ;; esac',
              "it is Python 3.10.12, older than 3.11 (the agent needs tomllib)"),
}


def test_preflight_refuses_an_unsupported_host(tmp_path):
    """The whole preflight on this machine's loopback, as for hosts whose kernel lacks the qdiscs or nf_tables (the
    probe's namespace finds only what a stub `unshare`, first on the host's PATH, prints) or whose Python is older
    than 3.11 (a stub tensorlane_python): one play, a local "host" each; each stops at the probe's checks, naming
    what is missing, before anything is installed."""
    hosts = {}
    for host, (unshare, python, _) in UNSUPPORTED.items():
        stubs = tmp_path / host
        stubs.mkdir()
        for name, body in (("unshare", unshare), ("python3", python)):
            if body:
                (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
                (stubs / name).chmod(0o755)
        interpreter = stubs / "interpreter"  # the modules' Python, with the stubs first on its PATH
        interpreter.write_text(f'#!/bin/sh\nPATH="{stubs}:$PATH" exec {sys.executable} "$@"\n')
        interpreter.chmod(0o755)
        hosts[host] = {"ansible_connection": "local", "ansible_python_interpreter": str(interpreter),
                       "tensorlane_python": str(stubs / "python3") if python else sys.executable}
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}))
    play = tmp_path / "play.yml"
    play.write_text("- name: Preflight only\n  hosts: all\n  gather_facts: false\n  roles: [tensorlane]\n")
    extra = {"tensorlane_install_os_packages": False, "tensorlane_service_manager": "none",
             "tensorlane_interfaces": ["lo"], "tensorlane_link_rate": "1gbit",
             "tensorlane_pip_environment": {"PIP_INDEX_URL": "https://pypi.invalid/simple"}}
    proc = subprocess.run([_tool("ansible-playbook"), "-i", str(inventory), str(play), "-e", json.dumps(extra)],
                          capture_output=True, text=True, timeout=120, check=False, env=_ansible_env(tmp_path))
    out = proc.stdout + proc.stderr
    stats = fleet_testbed.recap(out)
    assert proc.returncode != 0 and set(stats) == set(UNSUPPORTED), out[-3000:]
    for host, (_, _, message) in UNSUPPORTED.items():
        failed = " ".join(out[out.index(f"fatal: [{host}]"):].split("\n\n")[0].split())
        assert stats[host]["failed"] == 1 and message in failed, (host, failed[-2000:])
    assert "Install tensorlane" not in out and "Copy the tensorlane wheel" not in out, out[-3000:]


def test_the_deploy_docs_controller_set_up_installs_every_tool_they_run():
    """docs/deploy.md's controller set-up (a fresh ``.venv-deploy``) pip-installs each Ansible tool that the page
    then runs (``ansible-playbook``: ansible-core; ``ansible-lint``), pinned to the version of pyproject.toml's test
    extra, which the tests run: until 2026-11-29 it installed ansible-core alone, and the page's lint command,
    copied as written, failed with ``ansible-lint: command not found``."""
    with open(os.path.join(REPO_ROOT, "docs", "deploy.md")) as fh:
        doc = fh.read()
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as fh:
        extra = tomllib.load(fh)["project"]["optional-dependencies"]["test"]
    pins = dict(re.match(r"([\w-]+)==(\S+)$", r).groups() for r in extra if "==" in r)
    installed = {}
    for line in re.findall(r"^\.venv-deploy/bin/pip install (.*)$", doc, re.M):
        installed |= dict(re.findall(r'"([\w-]+)==([^"]+)"', line.split("#")[0]))
    tools = {"ansible-core": r"\bansible-playbook\b", "ansible-lint": r"\bansible-lint\b"}
    used = {dist for dist, command in tools.items() if re.search(command, doc)}
    assert used == set(tools), used
    assert {d: installed.get(d) for d in used} == {d: pins[d] for d in used}, (installed, pins)


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
        tb = Testbed(hosts=4, rate=RATE, name="tan", segments=2)
        host_vars = {  # h2 keeps the group's settings, with the older variable
            tb.host(1).name: {"tensorlane_interfaces": ["eth0", "eth1"],
                              "tensorlane_link_rate": {"eth0": RATE, "eth1": RATE_ETH1}},
            tb.host(2).name: {"tensorlane_interface": "eth0"},
            tb.host(3).name: {"tensorlane_interfaces": "auto", "tensorlane_training_subnets": ["198.18.0.0/15"]},
        }
        managed = {tb.host(1).name: DEVICES, tb.host(2).name: ("eth0",), tb.host(3).name: DEVICES}
        with tb, fleet_testbed.running_fleet(tb, workdir, managed=[1, 2, 3], controller=4,
                                             host_vars=host_vars) as fleet:
            before = {h.name: host_state(h) for h in fleet.managed}

            first, out = _playbook(fleet, "site.yml")
            assert all(s["changed"] > 0 for s in first.values()), out[-4000:]

            for h in fleet.managed:
                for dev in DEVICES:
                    tc = h.run(["tc", "class", "show", "dev", dev]).stdout
                    if dev in managed[h.name]:
                        assert "class htb 7a1:10" in tc and "class htb 7a1:14" in tc, tc  # 4 levels + default
                    else:
                        assert "7a1:" not in tc, f"{h.name} {dev} is not to be managed:\n{tc}"
                status = agent_status(fleet, h)
                assert sorted(i["name"] for i in status["interfaces"] if i["name"]) == list(managed[h.name]), status
                states = sorted(f for f in os.listdir(os.path.join(fleet.host_root(h), "run"))
                                if f.startswith("agent-") and f.endswith(".json"))
                assert states == [f"agent-{dev}.json" for dev in managed[h.name]], states  # a record per device
                assert "table inet tensorlane" in h.run(["nft", "list", "tables"]).stdout
                metrics = fleet.controller.run([sys.executable, "-c", FETCH, f"http://{h.ip}:9477/metrics"],
                                               timeout=15).stdout
                assert "tensorlane_" in metrics, metrics[:2000]

            h1, h2 = fleet.managed[0], fleet.managed[1]
            rates = {d["device"]: d["link_rate_bps"] for d in agent_status(fleet, h1)["devices"]}
            assert rates == {"eth0": parse_rate(RATE), "eth1": parse_rate(RATE_ETH1)}, rates  # per device
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

            # Upgrades from the deployed wheel (0.1.0) to 0.1.1 and 0.1.2, then a rollback to 0.1.1, on h1: each
            # restarts the agent once, which runs the version just installed, manages both devices and keeps a
            # record of each; pip replaces tensorlane alone (until 2026-11-28 each new wheel was installed with
            # --force-reinstall, which reinstalled every dependency too); the wheels kept are the current one and the
            # one that ran before it (until 2026-11-28 every deployed wheel stayed). The first upgrade changes a
            # setting too (levels 4 -> 3): the config is rewritten and the handler restarts the agent once for both
            # (a run of its own for the setting until 2026-11-28: make test's time).
            pid_file = os.path.join(fleet.host_root(h1), "run", "agent.pid")
            with open(pid_file) as fh:
                pid = fh.read().strip()
            upgrades_started = time.monotonic()
            with open(fleet.inventory) as fh:
                wheel_a = json.load(fh)["tensorlane"]["vars"]["tensorlane_wheel"]
            versions = {v: wheel_as_version(wheel_a, v, os.path.join(workdir, "versions")) for v in ("0.1.1", "0.1.2")}
            names = {"0.1.0": os.path.basename(wheel_a)} | {v: os.path.basename(w) for v, w in versions.items()}
            assert wheels(fleet, h1) == [names["0.1.0"]]
            for version, kept in (("0.1.1", ["0.1.0", "0.1.1"]), ("0.1.2", ["0.1.1", "0.1.2"]),
                                  ("0.1.1", ["0.1.1", "0.1.2"])):
                starts, deps = agent_starts(fleet, h1), dependencies(fleet, h1)
                step, out = _playbook(fleet, "site.yml", "--limit", h1.name, "-e", "tensorlane_levels=3", "-e",
                                      f"tensorlane_wheel={versions[version]}", hosts=[h1])
                status = agent_status(fleet, h1)
                assert status["version"] == version and agent_starts(fleet, h1) == starts + 1, out[-4000:]
                if pid is not None:  # the first: the setting and the wheel changed, one restart
                    with open(pid_file) as fh:
                        assert fh.read().strip() != pid and step[h1.name]["changed"] >= 2, out[-4000:]
                    for dev in DEVICES:
                        tc = h1.run(["tc", "class", "show", "dev", dev]).stdout
                        assert "class htb 7a1:13" in tc and "class htb 7a1:14" not in tc, tc  # 3 levels + default
                    pid = None
                assert sorted(i["name"] for i in status["interfaces"] if i["name"]) == list(DEVICES), status
                assert sorted(f for f in os.listdir(os.path.join(fleet.host_root(h1), "run"))
                              if f.startswith("agent-")) == [f"agent-{dev}.json" for dev in DEVICES]
                assert deps and dependencies(fleet, h1) == deps, f"{version} reinstalled the dependencies"
                assert wheels(fleet, h1) == sorted(names[v] for v in kept), (version, out[-4000:])
            upgrades_s = time.monotonic() - upgrades_started

            # A kept record of a restore that was not complete stops the uninstall before it removes the directory
            # (the record's only copy) on that host, naming the file; moved away, the uninstall goes on.
            kept = os.path.join(fleet.host_root(h2), "run", "incomplete-eth0-20261128T000000.json")
            with open(kept, "w") as fh:
                fh.write("{}")
            proc = fleet.playbook("uninstall.yml", "--limit", h2.name, timeout=240)
            out = proc.stdout + proc.stderr
            assert proc.returncode != 0 and "incomplete-eth0-20261128T000000.json" in out, out[-4000:]
            assert os.path.exists(kept), out[-4000:]
            os.unlink(kept)

            _, out = _playbook(fleet, "uninstall.yml")
            after = {h.name: host_state(h) for h in fleet.managed}
            assert after == before, out[-3000:]
            for h in fleet.managed:
                assert os.listdir(fleet.host_root(h)) == [], f"{h.name}: left {os.listdir(fleet.host_root(h))}"
            print(f"changed per host: first run {[s['changed'] for s in first.values()]}, second run "
                  f"{[s['changed'] for s in second.values()]}; 2 upgrades (the first with a levels change) and a "
                  f"rollback {upgrades_s:.0f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
