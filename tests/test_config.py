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


def test_every_default_is_the_config_dataclass_one():
    assert dataclasses.asdict(from_dict({"interface": "eth0"})) == dataclasses.asdict(Config(interface="eth0"))


def test_known_settings_are_the_dataclass_fields_and_the_ansible_template_writes_only_those():
    known = {f.name for f in dataclasses.fields(Config)} - {"link_rate_bps"} | {"link_rate"}
    with pytest.raises(ConfigError) as err:
        from_dict({"interface": "eth0", "colour": "blue"})
    assert str(err.value).endswith(f"unknown setting (known: {', '.join(sorted(known))})")
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
    ({"interface": "this-name-is-too-long"}, "interface"),
    ({"interface": "eth0", "backend": "cbq"}, "backend"),
    ({"interface": "eth0", "levels": 0}, "levels"),
    ({"interface": "eth0", "levels": 9}, "levels"),
    ({"interface": "eth0", "levels": True}, "levels"),
    ({"interface": "eth0", "link_rate": "fast"}, "link_rate"),
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
])
def test_bad_values_name_their_field(raw, field):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.field == field
    assert f"'{field}'" in str(err.value)


def test_load_file_and_overrides(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('interface = "eth0"\nlink_rate = "1gbit"\nlevels = 2\n[dscp]\n0 = "EF"\n1 = "AF31"\n')
    cfg = load_config(str(path), {"interface": "eth1", "socket": None})
    assert cfg.interface == "eth1" and cfg.link_rate_bps == 10**9 and cfg.dscp == (46, 26)


def test_load_reports_bad_toml_and_missing_file(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("interface = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="no config file"):
        load_config(str(tmp_path / "absent.toml"))
