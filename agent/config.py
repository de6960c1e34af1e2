"""Agent configuration: one TOML file, validated before the agent touches the kernel.

Every error names the field it is about. Usage: ``cfg = load_config("/etc/tensorlane/agent.toml")``
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field

from tensorlane import units
from tensorlane.client import DEFAULT_SOCKET, JOB_ID_RE
from tensorlane.policies.jobs import JOB_POLICIES
from tensorlane.policies.levels import dscp_table

BACKENDS = ("auto", "htb", "prio")



class ConfigError(ValueError):
    """A configuration value is wrong; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"config field '{field_name}': {message}")
        self.field = field_name


def parse_rate(value: int | str, field_name: str = "link_rate") -> int:
    """Parse a tc-style rate ("200mbit", "10gbit", or bits/s as an int) into bits per second, 8kbit..4tbit.

    Usage: ``parse_rate("200mbit") == 200_000_000``
    """
    try:
        return units.parse_rate(value)
    except ValueError as exc:
        raise ConfigError(field_name, str(exc)) from None


@dataclass(frozen=True)
class Config:
    """Validated agent configuration (see docs/agent.md for each field)."""

    interface: str
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    metrics_address: str = "127.0.0.1:9477"
    backend: str = "auto"
    link_rate_bps: int | None = None
    levels: int = 4
    dscp: tuple[int, ...] = field(default_factory=lambda: dscp_table(4))
    take_over_root: bool = False
    state_dir: str = "/run/tensorlane"
    queue_limit_packets: int = 1000
    reconcile_interval_s: float = 5.0
    socket_group: str | None = None
    allowed_users: tuple[str, ...] = ()
    allowed_groups: tuple[str, ...] = ()
    level_limits: dict = field(default_factory=dict)
    trusted_users: tuple[str, ...] = ()
    check_ownership: bool = True
    rate_limit_per_s: float = 1000.0
    max_flows: int = 100_000
    job_policy: str = "none"
    rotate_epoch_s: float = 20.0
    job_priority: dict = field(default_factory=dict)
    job_intensity: dict = field(default_factory=dict)
    max_connections: int = 1024
    reserved_connections: int = 32
    max_connections_per_user: int = 64
    requests_per_user_per_s: float = 200.0
    idle_timeout_s: float = 60.0


_FIELDS = {
    "interface", "socket", "socket_mode", "metrics_address", "backend", "link_rate", "levels", "dscp",
    "take_over_root", "state_dir", "queue_limit_packets", "reconcile_interval_s", "socket_group", "allowed_users",
    "allowed_groups", "level_limits", "trusted_users", "check_ownership", "rate_limit_per_s", "max_flows",
    "job_policy", "rotate_epoch_s", "job_priority", "job_intensity", "max_connections", "reserved_connections",
    "max_connections_per_user", "requests_per_user_per_s", "idle_timeout_s",
}


def _job_table(raw: dict, name: str, kind: type, lo: float, hi: float) -> dict:
    """A ``{job id: number}`` table (``job_priority``, ``job_intensity``), every key a valid job id."""
    table = _want(raw, name, dict, {})
    out = {}
    for job, value in table.items():
        if not isinstance(job, str) or not JOB_ID_RE.match(job):
            raise ConfigError(name, f"keys are job ids (1-64 of letters, digits, '_.:-', starting with a letter or "
                                    f"digit), got {job!r}")
        ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
        if not ok or not lo <= value <= hi:
            what = f"a number {lo:g}..{hi:g}" if kind is float else f"an integer {int(lo)}..{int(hi)}"
            raise ConfigError(name, f"{job!r}: expected {what}, got {value!r}")
        out[job] = kind(value)
    return out


def _job_policy(raw: dict) -> dict:
    """The job policy fields (docs/jobs.md), validated; each table only with the policy that reads it."""
    policy = _want(raw, "job_policy", str, "none")
    if policy not in JOB_POLICIES:
        raise ConfigError("job_policy", f"expected one of {', '.join(JOB_POLICIES)}, got {policy!r}")
    epoch = _want(raw, "rotate_epoch_s", (int, float), 20.0)
    if not 0.5 <= epoch <= 86400:
        raise ConfigError("rotate_epoch_s", f"expected 0.5..86400 seconds, got {epoch}")
    if "rotate_epoch_s" in raw and policy != "rotate":
        raise ConfigError("rotate_epoch_s", f"only used with job_policy = \"rotate\", not {policy!r}")
    priority = _job_table(raw, "job_priority", int, -10**6, 10**6)
    if priority and policy != "static":
        raise ConfigError("job_priority", f"only used with job_policy = \"static\", not {policy!r}")
    intensity = _job_table(raw, "job_intensity", float, 0.0, 1e12)
    if intensity and policy != "intensity":
        raise ConfigError("job_intensity", f"only used with job_policy = \"intensity\", not {policy!r}")
    return {"job_policy": policy, "rotate_epoch_s": float(epoch), "job_priority": priority,
            "job_intensity": intensity}


def _connection_limits(raw: dict) -> dict:
    """The socket server's fairness limits (docs/agent.md, "Fairness"), validated against each other."""
    total = _want(raw, "max_connections", int, 1024)
    if not 1 <= total <= 65536:
        raise ConfigError("max_connections", f"expected 1..65536 connections, got {total}")
    reserved = _want(raw, "reserved_connections", int, 32)
    if not 0 <= reserved < total:
        raise ConfigError("reserved_connections", f"expected 0..{total - 1} (fewer than max_connections = "
                                                  f"{total}), got {reserved}")
    per_user = _want(raw, "max_connections_per_user", int, 64)
    if not 1 <= per_user <= total - reserved:
        raise ConfigError("max_connections_per_user", f"expected 1..{total - reserved} (max_connections - "
                                                      f"reserved_connections), got {per_user}")
    user_rate = _want(raw, "requests_per_user_per_s", (int, float), 200.0)
    if not 1 <= user_rate <= 1_000_000:
        raise ConfigError("requests_per_user_per_s", f"expected 1..1000000 requests per second, got {user_rate}")
    idle = _want(raw, "idle_timeout_s", (int, float), 60.0)
    if not 0.5 <= idle <= 86400:
        raise ConfigError("idle_timeout_s", f"expected 0.5..86400 seconds, got {idle}")
    return {"max_connections": total, "reserved_connections": reserved, "max_connections_per_user": per_user,
            "requests_per_user_per_s": float(user_rate), "idle_timeout_s": float(idle)}


def _names(raw: dict, name: str) -> tuple[str, ...]:
    value = _want(raw, name, list, [])
    if not all(isinstance(v, str) and v and len(v) <= 64 for v in value):
        raise ConfigError(name, f"expected a list of user or group names, got {value!r}")
    return tuple(value)


def _want(raw: dict, name: str, kind: type | tuple[type, ...], default):
    """Return ``raw[name]`` (or ``default``) after checking its type; booleans are not numbers."""
    value = raw.get(name, default)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or (isinstance(value, bool) and bool in kinds):
        return value
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(name, f"expected {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def from_dict(raw: dict) -> Config:
    """Validate a parsed config mapping and return a Config. Usage: ``from_dict({"interface": "eth0"})``"""
    if not isinstance(raw, dict):
        raise ConfigError("<root>", "expected a table of settings")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ConfigError(unknown[0], f"unknown setting (known: {', '.join(sorted(_FIELDS))})")
    iface = _want(raw, "interface", str, None)
    if not iface or len(iface) > 15 or "/" in iface or iface.strip() != iface:
        raise ConfigError("interface", f"expected a network interface name, got {iface!r}")
    backend = _want(raw, "backend", str, "auto")
    if backend not in BACKENDS:
        raise ConfigError("backend", f"expected one of {', '.join(BACKENDS)}, got {backend!r}")
    levels = _want(raw, "levels", int, 4)
    dscp_raw = _want(raw, "dscp", (dict, list), {})
    if isinstance(dscp_raw, list):
        dscp_raw = {str(i): v for i, v in enumerate(dscp_raw)}
    overrides: dict[int, int | str] = {}
    for key, value in dscp_raw.items():
        try:
            overrides[int(key)] = value
        except ValueError:
            raise ConfigError("dscp", f"keys are level numbers, got {key!r}") from None
    try:
        if not isinstance(levels, int) or not 1 <= levels <= 5:
            raise ConfigError("levels", f"expected 1..5 priority levels, got {levels!r}")
        table = dscp_table(levels, overrides)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError("dscp", str(exc)) from None
    link_rate = raw.get("link_rate")
    rate = None if link_rate is None else parse_rate(link_rate)
    mode = _want(raw, "socket_mode", (int, str), 0o660)
    if isinstance(mode, str):
        try:
            mode = int(mode, 8)
        except ValueError:
            raise ConfigError("socket_mode", f"expected an octal mode such as '0660', got {mode!r}") from None
    if not 0 <= mode <= 0o777:
        raise ConfigError("socket_mode", f"expected a mode 0..0777, got {oct(mode)}")
    metrics = _want(raw, "metrics_address", str, "127.0.0.1:9477")
    if metrics and not re.match(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]*):\d{1,5}$", metrics):
        raise ConfigError("metrics_address", f"expected HOST:PORT (or empty to disable), got {metrics!r}")
    socket_path = _want(raw, "socket", str, DEFAULT_SOCKET)
    if not socket_path.startswith("/") or len(socket_path.encode()) > 107:
        raise ConfigError("socket", f"expected an absolute path of at most 107 bytes, got {socket_path!r}")
    state_dir = _want(raw, "state_dir", str, "/run/tensorlane")
    if not state_dir.startswith("/"):
        raise ConfigError("state_dir", f"expected an absolute path, got {state_dir!r}")
    qlimit = _want(raw, "queue_limit_packets", int, 1000)
    if not 10 <= qlimit <= 100_000:
        raise ConfigError("queue_limit_packets", f"expected 10..100000, got {qlimit}")
    interval = _want(raw, "reconcile_interval_s", (int, float), 5.0)
    if not 0.1 <= interval <= 3600:
        raise ConfigError("reconcile_interval_s", f"expected 0.1..3600 seconds, got {interval}")
    limits = _want(raw, "level_limits", dict, {})
    for who, lvl in limits.items():
        if isinstance(lvl, bool) or not isinstance(lvl, int) or not 0 <= lvl < levels:
            raise ConfigError("level_limits", f"{who!r}: expected a level 0..{levels - 1}, got {lvl!r}")
    rate_limit = _want(raw, "rate_limit_per_s", (int, float), 1000.0)
    if not 1 <= rate_limit <= 1_000_000:
        raise ConfigError("rate_limit_per_s", f"expected 1..1000000 requests per second, got {rate_limit}")
    max_flows = _want(raw, "max_flows", int, 100_000)
    if not 1 <= max_flows <= 1_000_000:
        raise ConfigError("max_flows", f"expected 1..1000000, got {max_flows}")
    group = _want(raw, "socket_group", str, None)
    jobs = _job_policy(raw)
    return Config(
        **jobs, **_connection_limits(raw),
        socket_group=group, allowed_users=_names(raw, "allowed_users"), allowed_groups=_names(raw, "allowed_groups"),
        level_limits=dict(limits), trusted_users=_names(raw, "trusted_users"),
        check_ownership=_want(raw, "check_ownership", bool, True), rate_limit_per_s=float(rate_limit),
        max_flows=max_flows,
        interface=iface, socket=socket_path, socket_mode=mode, metrics_address=metrics, backend=backend,
        link_rate_bps=rate, levels=levels, dscp=table, take_over_root=_want(raw, "take_over_root", bool, False),
        state_dir=state_dir, queue_limit_packets=qlimit, reconcile_interval_s=float(interval),
    )


def load_config(path: str, overrides: dict | None = None) -> Config:
    """Read and validate a TOML config file; ``overrides`` (from command-line flags) win over the file."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("<file>", f"no config file at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not valid TOML: {exc}") from None
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(raw)
