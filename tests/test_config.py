"""Configuration is validated before the agent touches the kernel; every error names its field."""
import dataclasses
import re
from pathlib import Path

import pytest

from tensorlane.agent.config import Config, ConfigError, from_dict, load_config, parse_rate

TEMPLATE = Path(__file__).parent.parent / "ansible" / "roles" / "tensorlane" / "templates" / "agent.toml.j2"


def test_minimal_config_has_defaults():
    cfg = from_dict({"interface": "eth0"})
    assert cfg.levels == 4 and cfg.dscp == (46, 34, 26, 18)
    assert cfg.backend == "auto" and cfg.take_over_root is False and cfg.link_rate_bps is None


def test_min_rate_is_a_rate_or_zero():
    assert from_dict({"interface": "eth0"}).min_rate_bps == 0  # off: min_share alone
    assert from_dict({"interface": "eth0", "min_rate": "1mbit"}).min_rate_bps == 1_000_000
    assert from_dict({"interface": "eth0", "min_rate": 0}).min_rate_bps == 0


def test_every_default_is_the_config_dataclass_one():
    assert dataclasses.asdict(from_dict({"interface": "eth0"})) == dataclasses.asdict(Config(interfaces=("eth0",)))


# parameters named after a setting that keep a default of their own, and why
OWN_DEFAULTS = {
    # a backend made directly (tests, bench.classifier) gives no guarantee; the agent passes Config's min_share and
    # min_rate through make_backend, which takes every setting
    ("agent/kernel/qdisc.py", "HtbBackend", "min_share"), ("agent/kernel/qdisc.py", "HtbBackend", "min_rate"),
    ("agent/kernel/qdisc.py", "PrioBackend", "min_share"), ("agent/kernel/qdisc.py", "PrioBackend", "min_rate"),
}


def test_the_agents_defaults_are_declared_once_in_config():
    """A parameter named after a setting (``queue_limit`` for ``queue_limit_packets``, ``max_flows``, ``levels``)
    takes Config's default (``Config.max_flows``) or none, never a literal of its own: until 2026-11-28 the backends
    wrote 1000 and FlowTable 100_000 again, and the shim 4 and 5 for the levels. The exceptions are OWN_DEFAULTS."""
    import ast

    root = Path(__file__).resolve().parents[1]
    names = {}
    for f in dataclasses.fields(Config):
        for n in (f.name, f.metadata.get("key", f.name), re.sub(r"_(packets|bps|per_s|s)$", "", f.name)):
            names[n] = f.name
    bad = []
    for part in ("agent", "tensorlane", "shim"):
        for path in sorted((root / part).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == "agent/config.py":
                continue
            tree = ast.parse(path.read_text())
            owners = {id(fn): cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for fn in cls.body}
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = fn.args
                pos = a.posonlyargs + a.args
                pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults, strict=True))
                pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
                for arg, d in pairs:
                    literal = isinstance(d, ast.Constant | ast.UnaryOp | ast.BinOp) and not (
                        isinstance(d, ast.Constant) and d.value is None)
                    if arg.arg in names and literal and (rel, owners.get(id(fn), fn.name), arg.arg) not in OWN_DEFAULTS:
                        bad.append(f"{rel}:{fn.lineno} {fn.name}({arg.arg}={ast.unparse(d)}): Config.{names[arg.arg]}")
    assert not bad, "\n".join(bad)


def test_known_settings_are_the_dataclass_fields_and_the_ansible_template_writes_only_those():
    known = {f.metadata.get("key", f.name) for f in dataclasses.fields(Config)} | {"interface"}
    with pytest.raises(ConfigError) as err:
        from_dict({"interface": "eth0", "colour": "blue"})
    assert str(err.value).endswith(f"unknown setting (known: {', '.join(sorted(known))})")
    with pytest.raises(ConfigError) as err:                   # a misspelt setting names the one meant
        from_dict({"interface": "eth0", "level": 4})
    assert f"'level': unknown setting, did you mean 'levels'? (known: {', '.join(sorted(known))})" in str(err.value)
    written = set(re.findall(r"^([a-z_]+) = ", TEMPLATE.read_text(), re.M))
    assert written and written <= known, sorted(written - known)


def test_fairness_limits_defaults_and_values():
    cfg = from_dict({"interface": "eth0"})
    assert (cfg.max_connections, cfg.reserved_connections, cfg.max_connections_per_user) == (1024, 32, 64)
    assert cfg.requests_per_user_per_s == 200.0 and cfg.idle_timeout_s == 60.0
    cfg = from_dict({"interface": "eth0", "max_connections": 100, "reserved_connections": 0,
                     "max_connections_per_user": 100, "requests_per_user_per_s": 5, "idle_timeout_s": 2})
    assert (cfg.max_connections, cfg.reserved_connections, cfg.max_connections_per_user) == (100, 0, 100)
    assert cfg.requests_per_user_per_s == 5.0 and cfg.idle_timeout_s == 2.0
    with pytest.raises(ConfigError, match=r"max_connections_per_user.*1\.\.68 \(max_connections - reserved"):
        from_dict({"interface": "eth0", "max_connections": 100, "max_connections_per_user": 69})


@pytest.mark.parametrize("text,bps", [("200mbit", 200_000_000), ("10gbit", 10**10), ("1.5gbit", 1_500_000_000),
                                      ("100kbit", 100_000), (64000, 64000)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("raw,field", [
    ({}, "interface"),
    ({"interface": "eth0", "interfaces": ["eth1"]}, "interface"),
    ({"interfaces": []}, "interfaces"),
    ({"interfaces": "eth0"}, "interfaces"),
    ({"interfaces": ["eth0", "eth0"]}, "interfaces"),
    ({"interfaces": ["eth0", "bad name"]}, "interfaces"),
    ({"interfaces": "auto"}, "interfaces"),  # auto needs training_subnets
    ({"interfaces": "auto", "training_subnets": ["10.0.0.0/33"]}, "training_subnets"),
    ({"interfaces": "auto", "training_subnets": "10.0.0.0/8"}, "training_subnets"),
    ({"interface": "eth0", "training_subnets": ["10.0.0.0/8"]}, "training_subnets"),  # only with auto
    ({"interface": "eth0", "link_rate": {"eth0": "fast"}}, "link_rate"),
    ({"interface": "eth0", "link_rate": {"bad/name": "1gbit"}}, "link_rate"),
    ({"interface": "this-name-is-too-long"}, "interface"),
    ({"interface": "eth0", "backend": "cbq"}, "backend"),
    ({"interface": "eth0", "levels": 0}, "levels"),
    ({"interface": "eth0", "levels": 9}, "levels"),
    ({"interface": "eth0", "levels": True}, "levels"),
    ({"interface": "eth0", "link_rate": "fast"}, "link_rate"),
    ({"interface": "eth0", "min_rate": "fast"}, "min_rate"),
    ({"interface": "eth0", "min_rate": True}, "min_rate"),
    ({"interface": "eth0", "min_rate": 1.5}, "min_rate"),
    ({"interface": "eth0", "dscp": {"0": 99}}, "dscp"),
    ({"interface": "eth0", "dscp": {"0": "XX"}}, "dscp"),
    ({"interface": "eth0", "levels": 2, "dscp": {"0": "AF41", "1": "AF41"}}, "dscp"),  # duplicate level queue
    ({"interface": "eth0", "dscp": {"0": "CS6"}}, "dscp"),  # reserved queue
    ({"interface": "eth0", "dscp": {"7": "EF"}}, "dscp"),
    ({"interface": "eth0", "socket": "relative.sock"}, "socket"),
    ({"interface": "eth0", "metrics_address": "nonsense"}, "metrics_address"),
    ({"interface": "eth0", "take_over_root": "yes"}, "take_over_root"),
    ({"interface": "eth0", "queue_limit_packets": 1}, "queue_limit_packets"),
    ({"interface": "eth0", "colour": "blue"}, "colour"),
    ({"interface": "eth0", "max_connections": 0}, "max_connections"),
    ({"interface": "eth0", "max_connections": "many"}, "max_connections"),
    ({"interface": "eth0", "reserved_connections": 1024}, "reserved_connections"),  # all of max_connections
    ({"interface": "eth0", "reserved_connections": -1}, "reserved_connections"),
    ({"interface": "eth0", "max_connections_per_user": 0}, "max_connections_per_user"),
    ({"interface": "eth0", "max_connections": 100, "max_connections_per_user": 90}, "max_connections_per_user"),
    ({"interface": "eth0", "max_connections_per_user": True}, "max_connections_per_user"),
    ({"interface": "eth0", "requests_per_user_per_s": 0}, "requests_per_user_per_s"),
    ({"interface": "eth0", "requests_per_user_per_s": "fast"}, "requests_per_user_per_s"),
    ({"interface": "eth0", "idle_timeout_s": 0}, "idle_timeout_s"),
    ({"interface": "eth0", "idle_timeout_s": 10**6}, "idle_timeout_s"),
    ({"interface": "eth0", "reset_user_dscp": "no"}, "reset_user_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": 24}, "kernel_tcp_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": [64]}, "kernel_tcp_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": [-1]}, "kernel_tcp_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": ["XX"]}, "kernel_tcp_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": [True]}, "kernel_tcp_dscp"),
    ({"interface": "eth0", "kernel_tcp_dscp": [24, "CS3"]}, "kernel_tcp_dscp"),  # 24 twice
    ({"interface": "eth0", "kernel_tcp_dscp": [24], "reset_user_dscp": False}, "kernel_tcp_dscp"),
])
def test_bad_values_name_their_field(raw, field):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field == field
    assert f"'{field}'" in str(err.value)


def test_kernel_tcp_dscp_is_a_list_of_dscp_values_kept_only_with_reset_user_dscp():
    """The DSCP values this host's TCP without a socket file keeps (the kernel's own TCP clients root configured):
    numbers or names, sorted; empty by default, and with ``reset_user_dscp = false`` (nothing is reset then) an
    empty list is accepted, any other refused (it would say something that does not happen)."""
    assert from_dict({"interface": "eth0"}).kernel_tcp_dscp == ()
    assert from_dict({"interface": "eth0", "kernel_tcp_dscp": ["AF31", 24, "0"]}).kernel_tcp_dscp == (0, 24, 26)
    assert from_dict({"interface": "eth0", "kernel_tcp_dscp": [], "reset_user_dscp": False}).kernel_tcp_dscp == ()
    with pytest.raises(ConfigError, match="only used with reset_user_dscp = true"):
        from_dict({"interface": "eth0", "kernel_tcp_dscp": [24], "reset_user_dscp": False})


def test_load_file_and_overrides(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('interface = "eth0"\nlink_rate = "1gbit"\nlevels = 2\n[dscp]\n0 = "EF"\n1 = "AF31"\n')
    cfg = load_config(str(path), {"interface": "eth1", "socket": None})
    assert cfg.interfaces == ("eth1",) and cfg.link_rate_bps == 10**9 and cfg.dscp == (46, 26)
    path.write_text('interfaces = "auto"\ntraining_subnets = ["10.0.0.0/8"]\n')
    cfg = load_config(str(path), {"interface": "eth1"})  # the command line's interface replaces the file's choice
    assert cfg.interfaces == ("eth1",) and cfg.training_subnets == ()


def test_load_reports_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("interface = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="^no config file"):  # no "config field '<file>'" before it
        load_config(str(tmp_path / "absent.toml"))


def test_a_config_file_another_user_could_change_is_refused(tmp_path):
    """The file says whom the agent, root, trusts (``trusted_users``, ``level_limits``, ``check_ownership = false``)
    and which trees it restores: a group-writable file, one another user owns, or one in a directory others may
    write (they can replace it) gave that user all of it at the next start. Refused now, naming the file; a sticky
    directory (``/tmp``) and root's own files are fine."""
    import os

    path = tmp_path / "agent.toml"
    path.write_text('interface = "eth0"\nlink_rate = "1gbit"\n')
    load_config(str(path))
    path.chmod(0o664)
    with pytest.raises(ConfigError, match="another user could change.*writable by its group"):
        load_config(str(path))
    path.chmod(0o644)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        load_config(str(path))
    os.chown(path, 0, 0)
    tmp_path.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        load_config(str(path))
    tmp_path.chmod(0o1777)
    assert load_config(str(path)).link_rate_bps == 10**9
    tmp_path.chmod(0o755)


def test_several_interfaces_and_rates_per_device():
    cfg = from_dict({"interfaces": ["eth0", "bond0"], "link_rate": {"eth0": "25gbit", "eth2": "100gbit"}})
    assert cfg.interfaces == ("eth0", "bond0") and cfg.training_subnets == ()
    assert cfg.rate_of("eth0") == 25 * 10**9 and cfg.rate_of("eth2", "bond0") == 10**11
    assert cfg.rate_of("eth3", "bond0") is None  # not configured: the driver's speed
    assert from_dict({"interface": "eth0", "link_rate": "1gbit"}).rate_of("anything") == 10**9
    auto = from_dict({"interfaces": "auto", "training_subnets": ["198.18.0.7/15", "fd00::/8"]})
    assert auto.interfaces == () and auto.training_subnets == ("198.18.0.0/15", "fd00::/8")


def test_check_config_checks_a_file_and_changes_nothing(tmp_path, capsys):
    """``tensorlane agent --check-config``: exit 0 and "ok" for a good file, 2 and the field for a bad one; the
    agent is not started (the role's template validation runs it)."""
    from tensorlane.cli import main

    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('interface = "eth0"\nlink_rate = "1gbit"\n')
    bad.write_text('interface = "eth0"\nlevels = 9\n')
    assert main(["agent", "--check-config", "--config", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["agent", "--check-config", "--config", str(bad)]) == 2
    assert "config field 'levels'" in capsys.readouterr().err
    # what the host makes of it now, on stderr, not a failure: an interface absent (it may come up before the
    # agent starts), one here with its queue devices, a socket_group not on this host
    absent = tmp_path / "absent.toml"
    absent.write_text('interfaces = ["lo", "tl-absent0"]\nlink_rate = "1gbit"\nsocket_group = "tl-no-group"\n')
    assert main(["agent", "--check-config", "--config", str(absent)]) == 0
    err = capsys.readouterr().err
    assert "tl-absent0: no such interface here now" in err and "lo: here, queues on lo" in err, err
    assert "no group 'tl-no-group' on this host" in err, err


def test_check_config_notes_a_missing_link_rate_and_a_foreign_root_qdisc(monkeypatch):
    """``--check-config``'s notes name the two refusals a first start on a veth (the testbed's hosts) meets: no
    link_rate where the driver's speed is a placeholder, and a root qdisc tensorlane did not create without
    take_over_root. It said only "eth0: here, queues on eth0", and the agent then refused to start."""
    from pyroute2.netlink.rtnl.tcmsg import tcmsg

    from tensorlane.agent import daemon
    from tensorlane.agent.kernel import links, snapshot
    from tensorlane.agent.kernel.qdisc import MAJOR, handle

    veth = links.Link("tl-v0", 7, "veth")
    monkeypatch.setattr(links, "resolve", lambda *a, **k: [links.Egress("tl-v0", 7, (veth,))])

    def root(h):
        msg = tcmsg()
        msg["handle"], msg["parent"] = h, snapshot.TC_H_ROOT
        msg["attrs"] = [("TCA_KIND", "htb")]
        return msg

    class Ipr:
        qdiscs = [root(handle(1))]

        def get_qdiscs(self, index):
            assert index == 7
            return self.qdiscs

    notes = daemon.host_notes(from_dict({"interface": "tl-v0"}), Ipr())
    assert notes[0] == "tl-v0: here, queues on tl-v0", notes
    assert any("config field 'link_rate': tl-v0: its veth driver's speed is a placeholder" in n for n in notes), notes
    assert any("tl-v0 has a root qdisc 'htb' (handle 1:) that tensorlane did not create; set take_over_root = true"
               in n for n in notes), notes
    ipr = Ipr()
    assert daemon.host_notes(from_dict({"interface": "tl-v0", "link_rate": "1gbit", "take_over_root": True}),
                             ipr) == ["tl-v0: here, queues on tl-v0"]
    assert daemon.host_notes(from_dict({"interface": "tl-v0", "link_rate": "1gbit"}), ipr)[1:]  # refused
    ipr.qdiscs = [root(handle(MAJOR))]  # a previous agent's tree: adopted at start, no note
    assert daemon.host_notes(from_dict({"interface": "tl-v0", "link_rate": "1gbit"}), ipr) == [
        "tl-v0: here, queues on tl-v0"]
    # a per-device table that names another device (a typo): the managed one's rate would not come from it
    assert daemon.host_notes(from_dict({"interface": "tl-v0", "link_rate": {"tl-v0": "1gbit", "tl-v9": "2gbit"}}),
                             ipr) == ["tl-v0: here, queues on tl-v0", "link_rate names tl-v9, which carries none "
                                      "of the managed queues here (tl-v0): its rate is not used"]


def test_flags_without_a_file_keep_an_empty_metrics_address(monkeypatch):
    """``tensorlane agent --interface eth0 --metrics-address ""`` disables /metrics, as with a file (docs/agent.md);
    an absent flag leaves the default."""
    from tensorlane.agent import daemon
    from tensorlane.cli import main

    seen = []
    monkeypatch.setattr(daemon, "run", lambda cfg: seen.append(cfg) or 0)
    assert main(["agent", "--interface", "eth0", "--metrics-address", ""]) == 0
    assert main(["agent", "--interface", "eth0"]) == 0
    assert [c.metrics_address for c in seen] == ["", "127.0.0.1:9477"]


def test_an_agent_with_neither_a_file_nor_an_interface_asks_for_config(capsys):
    from tensorlane.cli import main

    for argv in (["agent"], ["agent", "--check-config"], ["agent", "--socket", "/tmp/x.sock"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("tensorlane agent: no configuration: --config FILE (TOML")


def test_an_agent_without_root_is_refused_by_name_before_anything_is_made(tmp_path, monkeypatch, capsys):
    """Without CAP_NET_ADMIN and CAP_SYS_ADMIN the agent stops with one line (exit 2), before its state_dir is made;
    it died in the qdisc probe with a traceback ("PermissionError: mount rundir failed")."""
    from tensorlane.agent import daemon
    from tensorlane.cli import main

    assert daemon.missing_capabilities("CapEff:\t0000000000001000\n") == ["CAP_SYS_ADMIN"]
    assert daemon.missing_capabilities("CapEff:\t000001ffffffffff\n") == []
    monkeypatch.setattr(daemon, "missing_capabilities", lambda: ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"])
    conf = tmp_path / "agent.toml"
    conf.write_text(f'interface = "eth0"\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["agent", "--config", str(conf)]) == 2
    assert "must run as root: this process lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_socket_mode_is_octal_and_a_decimal_integer_is_refused_saying_how_to_write_it():
    for mode in ("0660", 0o660, "0o660"):
        assert from_dict({"interface": "eth0", "socket_mode": mode}).socket_mode == 0o660
    # `socket_mode = 660` (the docs' 0660 without its zero, which TOML refuses) is decimal 660 = 0o1224
    with pytest.raises(ConfigError, match=r"^config field 'socket_mode': .*written 0o660 or \"0660\", got 660 \("):
        from_dict({"interface": "eth0", "socket_mode": 660})
    with pytest.raises(ConfigError, match=r"got 0o1777$"):
        from_dict({"interface": "eth0", "socket_mode": "1777"})
