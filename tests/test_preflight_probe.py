"""The Ansible role's preflight probe (ansible/roles/tensorlane/files/preflight-probe.sh) on this machine, with
interpreters that cannot run the agent: each gets a ``python_error`` line that says why (no root needed); and its
interfaces: named ones, a bond's members, those routed to the training subnets (``ip`` and ``tc`` faked)."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "tensorlane" / "files" / "preflight-probe.sh"


def probe(python: str) -> dict[str, str]:
    """Run the probe as the role does (``sh -c "$(cat probe)" probe IFACES PYTHON``); ``{key: rest of line}``."""
    out = subprocess.run(["sh", "-c", PROBE.read_text(), "probe", "lo", python], capture_output=True, text=True,
                         timeout=60, check=True)
    return dict((line.split(" ", 1) + [""])[:2] for line in out.stdout.splitlines() if line)


def fake(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_good_interpreter_passes():
    found = probe(sys.executable)
    assert found.get("python") == sys.version.split()[0] and "python_error" not in found


def test_an_old_interpreter_is_named(tmp_path):
    """A Python 3.10 is refused with its version and the reason (tomllib)."""
    old = fake(tmp_path, "python3.10", 'case "$2" in *version_info*) exit 1;; *) echo 3.10.12;; esac')
    assert probe(old)["python_error"] == "it is Python 3.10.12, older than 3.11 (the agent needs tomllib)"


def test_an_interpreter_without_venv_is_named(tmp_path):
    """A Python without venv/ensurepip (Debian without python3-venv) is refused, saying so."""
    real = sys.executable
    body = (f'case "$2" in *ensurepip*) echo "ModuleNotFoundError: No module named \'ensurepip\'" >&2; exit 1;; '
            f'*) exec "{real}" "$@";; esac')
    err = probe(fake(tmp_path, "python3", body))["python_error"]
    assert "lacks venv or ensurepip" in err and "ensurepip" in err.split(":", 1)[1]


def test_a_missing_interpreter_is_named(tmp_path):
    err = probe(os.path.join(tmp_path, "no-such-python"))["python_error"]
    assert err.startswith("cannot run it:")


# --- interfaces: named ones, a bond's members, and those routed to the training subnets (auto) ---------------
BOND = ("5: bond0: <BROADCAST,MULTICAST,MASTER,UP,LOWER_UP> mtu 9000 qdisc noqueue state UP mode DEFAULT group "
        "default qlen 1000\\    link/ether 02:00:00:00:00:05 brd ff:ff:ff:ff:ff:ff promiscuity 0 minmtu 68 maxmtu "
        "65535 \\    bond mode 802.3ad miimon 100 updelay 0 downdelay 0 \\    addrgenmode eui64 numtxqueues 16")
MEMBER = ("{i}: {name}: <BROADCAST,MULTICAST,SLAVE,UP,LOWER_UP> mtu 9000 qdisc mq master bond0 state UP mode "
          "DEFAULT group default qlen 1000\\    link/ether 02:00:00:00:00:05 brd ff:ff:ff:ff:ff:ff promiscuity 0 "
          "\\    bond_slave state ACTIVE mii_status UP \\    addrgenmode eui64 numtxqueues 16")
NIC = ("{i}: {name}: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 qdisc mq state UP mode DEFAULT group default qlen "
       "1000\\    link/ether 02:00:00:00:00:0{i} brd ff:ff:ff:ff:ff:ff promiscuity 0 minmtu 68 maxmtu 9600 "
       "\\    addrgenmode eui64 numtxqueues 16")


def fake_net(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``ip`` and ``tc`` describe a host with a bond of ens1f0 and ens1f1 (10.1.0.0/16), two
    rails rail0/rail1 (10.2.0.0/16 by a multipath route in table 100) and a default route through eth0; any other
    call goes to the real tools (the probe's throwaway namespace)."""
    real_ip, real_tc = shutil.which("ip"), shutil.which("tc")
    answers = {
        "-d -o link show dev bond0": BOND,
        "-o link show master bond0": "\n".join(MEMBER.format(i=i, name=n) for i, n in ((3, "ens1f1"), (2, "ens1f0"))),
        "-d -o link show dev rail0": NIC.format(i=6, name="rail0"),
        "-d -o link show dev rail1": NIC.format(i=7, name="rail1"),
        "-4 -o route show table all type unicast to root 10.1.0.0/16":
            "10.1.0.0/16 dev bond0 proto kernel scope link src 10.1.0.5",
        "-4 -o route show table all type unicast to match 10.1.0.0/16":
            "default via 192.0.2.1 dev eth0\n10.1.0.0/16 dev bond0 proto kernel scope link src 10.1.0.5",
        "-4 -o route show table all type unicast to root 10.2.0.0/16":
            "10.2.0.0/16 table 100 proto static \\tnexthop via 10.9.0.1 dev rail0 weight 1 "
            "\\tnexthop via 10.9.1.1 dev rail1 weight 1",
        "-4 -o route show table all type unicast to match 10.2.0.0/16": "default via 192.0.2.1 dev eth0",
        "-4 -o route show table all type unicast to root 10.3.0.0/16": "",
        "-4 -o route show table all type unicast to match 10.3.0.0/16": "",
    }
    cases = "".join(f"    {shlex.quote(k)}) printf '%s\\n' {' '.join(map(shlex.quote, v.splitlines()))} ;;\n"
                    for k, v in answers.items() if v)
    cases += "".join(f"    {shlex.quote(k)}) ;;\n" for k, v in answers.items() if not v)
    fake(tmp_path, "ip", f'case "$*" in\n{cases}    *) exec {real_ip} "$@" ;;\nesac')
    fake(tmp_path, "tc", 'case "$*" in\n'
                         "    'qdisc show dev ens1f0 root') echo 'qdisc mq 0: root' ;;\n"
                         "    'qdisc show dev ens1f1 root') echo 'qdisc htb 1: root refcnt 17 r2q 10 default 0' ;;\n"
                         "    'qdisc show dev rail0 root'|'qdisc show dev rail1 root') echo 'qdisc mq 0: root' ;;\n"
                         f'    *) exec {real_tc} "$@" ;;\nesac')
    return dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


def probe_lines(*args: str, env: dict | None = None) -> list[str]:
    """The probe's output lines for ``probe ARGS`` (IFACES PYTHON [GROUP [SUBNET...]])."""
    out = subprocess.run(["sh", "-c", PROBE.read_text(), "probe", *args], capture_output=True, text=True,
                         timeout=60, check=True, env=env)
    return out.stdout.splitlines()


def test_named_interfaces_each_get_a_link_and_root_qdisc_line():
    lines = probe_lines("lo nosuch0", sys.executable)
    assert "link lo ok" in lines and "queues lo lo" in lines
    assert any(line.startswith("root_qdisc lo qdisc ") for line in lines), lines
    assert [line for line in lines if line.startswith("link_error ")] == \
        ['link_error nosuch0 Device "nosuch0" does not exist'], lines
    assert not any(line.startswith("root_qdisc nosuch0") for line in lines)


def test_a_bond_is_queued_on_its_members(tmp_path):
    lines = probe_lines("bond0", sys.executable, env=fake_net(tmp_path))
    assert "link bond0 ok" in lines and "queues bond0 ens1f0 ens1f1" in lines, lines
    assert "root_qdisc ens1f0 qdisc mq 0: root" in lines, lines
    assert "root_qdisc ens1f1 qdisc htb 1: root refcnt 17 r2q 10 default 0" in lines, lines


def test_auto_finds_the_interfaces_routed_to_the_subnets(tmp_path):
    """A specific route wins over the default one; every next hop of a multipath route counts; a bond found so is
    queued on its members."""
    lines = probe_lines("auto", sys.executable, "", "10.1.0.0/16", "10.2.0.0/16", env=fake_net(tmp_path))
    assert [line for line in lines if line.startswith("route")] == ["route 10.1.0.0/16 bond0",
                                                                     "route 10.2.0.0/16 rail0 rail1"], lines
    assert [line for line in lines if line.startswith("link")] == ["link bond0 ok", "link rail0 ok", "link rail1 ok"]
    assert "queues bond0 ens1f0 ens1f1" in lines and "queues rail1 rail1" in lines, lines


def test_auto_without_a_route_says_so(tmp_path):
    lines = probe_lines("auto", sys.executable, "", "10.3.0.0/16", env=fake_net(tmp_path))
    assert "route_error no interface has a unicast route to 10.3.0.0/16" in lines, lines
    assert not any(line.startswith(("route ", "link")) for line in lines), lines


def test_each_queue_device_gets_the_speed_the_agent_would_shape_to(tmp_path):
    """A veth's driver speed is a placeholder (the agent ignores it), the loopback reports none, a bond's members
    are read one by one (here faked: no /sys entry, so none)."""
    veth = ("8: veth0@if9: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group "
            "default qlen 1000\\    link/ether 02:00:00:00:00:08 brd ff:ff:ff:ff:ff:ff link-netnsid 0 promiscuity 0 "
            "\\    veth addrgenmode eui64 numtxqueues 1")
    fake(tmp_path, "ip", f'case "$*" in\n    "-d -o link show dev veth0") echo {shlex.quote(veth)} ;;\n'
                         f'    *) exec {shutil.which("ip")} "$@" ;;\nesac')
    fake(tmp_path, "tc", f'case "$*" in\n    "qdisc show dev veth0 root") echo "qdisc noqueue 0: root" ;;\n'
                         f'    *) exec {shutil.which("tc")} "$@" ;;\nesac')
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    lines = probe_lines("veth0 lo", sys.executable, env=env)
    assert "speed veth0 none placeholder" in lines and "speed lo none" in lines, lines
    (tmp_path / "bond").mkdir()
    lines = probe_lines("bond0", sys.executable, env=fake_net(tmp_path / "bond"))
    assert "speed ens1f0 none" in lines and "speed ens1f1 none" in lines, lines
