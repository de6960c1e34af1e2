"""Agent configuration: one TOML file, validated before the agent touches the kernel.

Every error names the field it is about. Usage: ``cfg = load_config("/etc/tensorlane/agent.toml")``
"""
from __future__ import annotations

import difflib
import ipaddress
import os
import re
import stat
import tomllib
from dataclasses import MISSING, dataclass, field, fields

from tensorlane import units
from tensorlane.client import DEFAULT_SOCKET, JOB_ID_RE
from tensorlane.policies.jobs import JOB_POLICIES, ROTATING, SHARE_AMONG, TIMED
from tensorlane.policies.levels import DEFAULT_LEVELS, MAX_LEVELS, dscp_table, parse_dscp

BACKENDS = ("auto", "htb", "prio")


FILE_FIELD = "<file>"  # the ``field`` of an error about the file itself (absent, not TOML)


class ConfigError(ValueError):
    """A configuration value is wrong; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        """``message`` about the setting ``field_name`` (``field``), or about the file (FILE_FIELD)."""
        super().__init__(message if field_name == FILE_FIELD else f"config field '{field_name}': {message}")
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
    """Validated agent configuration (see docs/agent.md for each field).

    Each default is stated here only: ``from_dict`` takes an absent setting's value from these fields. A field's
    TOML key is its name unless its metadata says otherwise (``link_rate``, a rate string, becomes
    ``link_rate_bps``).
    """

    interfaces: tuple[str, ...] = ()  # empty: those routed to training_subnets (TOML: also ``interface = "eth0"``)
    training_subnets: tuple[str, ...] = ()
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    metrics_address: str = "127.0.0.1:9477"
    backend: str = "auto"
    link_rate_bps: int | dict | None = field(default=None, metadata={"key": "link_rate"})  # or {device: bits/s}
    levels: int = DEFAULT_LEVELS
    dscp: tuple[int, ...] = field(default_factory=lambda: dscp_table(Config.levels))  # the default levels' table
    take_over_root: bool = False
    state_dir: str = "/run/tensorlane"
    queue_limit_packets: int = 1000
    min_share: float = 0.01  # htb: the link's share guaranteed to every class (no RTO starvation); 0: strict
    # htb: with min_share > 0, every class's guarantee is at least this many bits/s, where the link leaves room (at
    # most half of it for all classes); 0 (the default): min_share alone. Off by default: on a slow link it cut the
    # lower levels' timeouts but not the shim's step times (docs/jobs-measured.md, "The link's rate and the CPU")
    min_rate_bps: int = field(default=0, metadata={"key": "min_rate"})
    ack_priority: bool = True  # pure ACKs of every registered flow in the most urgent class (no ACK starvation)
    reset_user_dscp: bool = True  # a user's unregistered packets leave the managed interfaces with DSCP 0
    # with reset_user_dscp: the DSCP values that this host's TCP packets without a socket file keep (the kernel's own
    # TCP clients root gave one, such as NVMe/TCP's --tos); empty: those packets leave with DSCP 0 too
    kernel_tcp_dscp: tuple[int, ...] = ()
    reconcile_interval_s: float = 5.0
    socket_group: str | None = None
    allowed_users: tuple[str, ...] = ()
    allowed_groups: tuple[str, ...] = ()
    level_limits: dict = field(default_factory=dict)
    trusted_users: tuple[str, ...] = ()
    check_ownership: bool = True
    rate_limit_per_s: float = 1000.0
    max_flows: int = 100_000
    # of one user that is neither root nor trusted: flows (so that no user fills max_flows and locks the others
    # out) and jobs (under a job policy each job takes a band, and the order costs O(jobs) per request)
    max_flows_per_user: int = 50_000
    max_jobs_per_user: int = 32
    reserved_flow_share: float = 0.01  # of max_flows, kept for root and trusted_users: other users fill the rest
    job_policy: str = "none"
    rotate_epoch_s: float = 20.0
    job_priority: dict = field(default_factory=dict)
    job_intensity: dict = field(default_factory=dict)
    # under a job policy: the link's share guaranteed to the jobs, in equal parts; 0: strict; "auto": 0.2 while the
    # jobs leave the link idle at times, 0.95 while they keep it saturated (policies.jobs.AUTO_SHARES)
    job_share: float | str = 0.2
    # the parts of job_share: "sending" (each of k jobs with queued bytes gets job_share / k, as FIFO gives each
    # about 1/k; sampled with three jobs or more) or "present" (job_share / n of the n jobs on the host)
    job_share_among: str = "sending"
    # with job_share_among = "sending": how often the server samples the classes, and how long a job counts as
    # sending after a sample last found it so (0: until the next sample); docs/jobs.md, "How quickly the parts follow"
    job_sample_s: float = 0.05
    job_hold_s: float = 0.0
    max_connections: int = 1024
    reserved_connections: int = 32
    max_connections_per_user: int = 64
    requests_per_user_per_s: float = 200.0
    idle_timeout_s: float = 60.0

    def rate_of(self, *devices: str) -> int | None:
        """The configured link rate of the first of ``devices`` that has one (a queue device, then the interface
        it serves); None when the config gives none (the driver's speed is used)."""
        if not isinstance(self.link_rate_bps, dict):
            return self.link_rate_bps
        return next((self.link_rate_bps[d] for d in devices if d in self.link_rate_bps), None)


_KEYS = {f.metadata.get("key", f.name): f for f in fields(Config)}  # TOML key -> field
ALIASES = {"interface": "interfaces"}  # TOML keys that set a field another way: ``interface = "eth0"``
MAX_INTERFACES = 16


def _default(key: str):
    """The Config default of the setting ``key`` (a fresh one for a mutable default)."""
    f = _KEYS[key]
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _want(raw: dict, name: str, kind: type | tuple[type, ...]):
    """Return ``raw[name]`` after checking its type (booleans are not numbers), or the default when absent."""
    if name not in raw:
        return _default(name)
    value = raw[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or (isinstance(value, bool) and bool in kinds):
        return value
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(name, f"expected {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _within(name: str, value, lo, hi, unit: str = "") -> None:
    """Refuse ``value`` outside ``lo..hi``: "expected {lo}..{hi}{unit}, got {value}"."""
    if not lo <= value <= hi:
        raise ConfigError(name, f"expected {lo}..{hi}{unit}, got {value}")


def _number(raw: dict, name: str, lo, hi, unit: str = "") -> float:
    """A number setting (int or float) in ``lo..hi``, as a float."""
    value = _want(raw, name, (int, float))
    _within(name, value, lo, hi, unit)
    return float(value)


def _integer(raw: dict, name: str, lo: int, hi: int, unit: str = "") -> int:
    """An integer setting in ``lo..hi``."""
    value = _want(raw, name, int)
    _within(name, value, lo, hi, unit)
    return value


def _job_table(raw: dict, name: str, kind: type, lo: float, hi: float) -> dict:
    """A ``{job id: number}`` table (``job_priority``, ``job_intensity``), every key a valid job id."""
    table = _want(raw, name, dict)
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


def _job_policy(raw: dict, min_shares: float) -> dict:
    """The job policy fields (docs/jobs.md), validated; each table only with the policy that reads it.
    ``min_shares``: what every class's ``min_share`` together guarantees already (``job_share`` adds at most the
    rest of the link)."""
    policy = _want(raw, "job_policy", str)
    if policy not in JOB_POLICIES:
        raise ConfigError("job_policy", f"expected one of {', '.join(JOB_POLICIES)}, got {policy!r}")
    epoch = _number(raw, "rotate_epoch_s", 0.5, 86400, " seconds")
    if "rotate_epoch_s" in raw and policy not in ROTATING:
        raise ConfigError("rotate_epoch_s", f"only used with job_policy = \"rotate\" or \"alternate\", not {policy!r}")
    priority = _job_table(raw, "job_priority", int, -10**6, 10**6)
    if priority and policy != "static":
        raise ConfigError("job_priority", f"only used with job_policy = \"static\", not {policy!r}")
    intensity = _job_table(raw, "job_intensity", float, 0.0, 1e12)
    if intensity and policy != "intensity":
        raise ConfigError("job_intensity", f"only used with job_policy = \"intensity\", not {policy!r}")
    top = min(0.95, round(1.0 - min_shares, 4))
    if raw.get("job_share") == "auto":
        share: float | str = "auto"  # the agent chooses the part from the classes' backlog (JobScheduler.observe)
    elif isinstance(raw.get("job_share"), str):
        raise ConfigError("job_share", f"expected a fraction of the link or \"auto\", got {raw['job_share']!r}")
    else:
        share = _number(raw, "job_share", 0.0, top, f" (a fraction of the link, at most 0.95 and what the classes' "
                                                     f"min_share leave: 1 - {round(min_shares, 4)}; or \"auto\")")
    among = _want(raw, "job_share_among", str)
    if among not in SHARE_AMONG:
        raise ConfigError("job_share_among", f"expected one of {', '.join(SHARE_AMONG)}, got {among!r}")
    sample = _number(raw, "job_sample_s", 0.01, 1.0, " seconds")
    hold = _number(raw, "job_hold_s", 0.0, 10.0, " seconds")
    for name in ("job_share", "job_share_among", "job_sample_s", "job_hold_s"):
        if name in raw and policy == "none":
            raise ConfigError(name, f"only used with a job policy ({', '.join(JOB_POLICIES[1:])}), not 'none'")
    for name in ("job_share_among", "job_hold_s", "job_sample_s"):  # no parts to split, follow or hold
        if name in raw and share == 0 and policy != "none" and not (name == "job_sample_s" and policy in TIMED):
            raise ConfigError(name, "job_share = 0 gives the jobs no parts (a strict order): nothing to split, "
                                    "sample or hold")
    if "job_sample_s" in raw and among != "sending" and share != "auto" and policy not in TIMED:
        raise ConfigError("job_sample_s", f"only used with job_share_among = \"sending\", job_share = \"auto\" or "
                                          f"job_policy = \"slowdown\", not {among!r}")
    if "job_hold_s" in raw and among != "sending":
        raise ConfigError("job_hold_s", f"only used with job_share_among = \"sending\", not {among!r}")
    if 0 < hold <= sample:  # samples come at least job_sample_s apart: such a hold never spans one
        raise ConfigError("job_hold_s", f"{hold:g} s holds a job no longer than 0 does: the samples come at least "
                                        f"job_sample_s = {sample:g} s apart; give 0 or more than {sample:g}")
    return {"job_policy": policy, "rotate_epoch_s": epoch, "job_priority": priority, "job_intensity": intensity,
            "job_share": share, "job_share_among": among, "job_sample_s": sample, "job_hold_s": hold}


def _connection_limits(raw: dict) -> dict:
    """The socket server's fairness limits (docs/agent.md, "Fairness"), validated against each other."""
    total = _integer(raw, "max_connections", 1, 65536, " connections")
    reserved = _integer(raw, "reserved_connections", 0, total - 1,
                        f" (fewer than max_connections = {total})")
    per_user = _integer(raw, "max_connections_per_user", 1, total - reserved,
                        " (max_connections - reserved_connections)")
    return {"max_connections": total, "reserved_connections": reserved, "max_connections_per_user": per_user,
            "requests_per_user_per_s": _number(raw, "requests_per_user_per_s", 1, 1_000_000,
                                               " requests per second"),
            "idle_timeout_s": _number(raw, "idle_timeout_s", 0.5, 86400, " seconds")}


def _names(raw: dict, name: str) -> tuple[str, ...]:
    """A list of user or group names (``allowed_users``, ``allowed_groups``, ``trusted_users``), as a tuple."""
    value = _want(raw, name, list)
    if not all(isinstance(v, str) and v and len(v) <= 64 for v in value):
        raise ConfigError(name, f"expected a list of user or group names, got {value!r}")
    return tuple(value)


def _check_keys(raw) -> None:
    """Refuse anything but a table of known settings."""
    if not isinstance(raw, dict):
        raise ConfigError("<root>", "expected a table of settings")
    known = sorted({*_KEYS, *ALIASES})
    unknown = sorted(set(raw) - set(known))
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f", did you mean {near[0]!r}?" if near else ""
        raise ConfigError(unknown[0], f"unknown setting{hint} (known: {', '.join(known)})")


def _dscp(raw: dict, levels) -> tuple[int, ...]:
    """The DSCP table of ``levels`` levels with the ``dscp`` overrides (a table by level, or a list)."""
    overrides_raw = _want(raw, "dscp", (dict, list)) if "dscp" in raw else {}  # absent: no overrides
    if isinstance(overrides_raw, list):
        overrides_raw = {str(i): v for i, v in enumerate(overrides_raw)}
    overrides: dict[int, int | str] = {}
    for key, value in overrides_raw.items():
        try:
            overrides[int(key)] = value
        except ValueError:
            raise ConfigError("dscp", f"keys are level numbers, got {key!r}") from None
    if not isinstance(levels, int) or not 1 <= levels <= MAX_LEVELS:
        raise ConfigError("levels", f"expected 1..{MAX_LEVELS} priority levels, got {levels!r}")
    try:
        return dscp_table(levels, overrides)
    except ValueError as exc:
        raise ConfigError("dscp", str(exc)) from None


def _ifname(name: str, value) -> str:
    """A network interface name (1-15 characters, no '/', no spaces), or ConfigError about ``name``."""
    if not isinstance(value, str) or not value or len(value) > 15 or "/" in value or value.split() != [value]:
        raise ConfigError(name, f"expected a network interface name, got {value!r}")
    return value


def _subnets(raw: dict) -> tuple[str, ...]:
    """``training_subnets``: networks in CIDR notation, normalised (``198.18.0.0/15``)."""
    value = _want(raw, "training_subnets", list)
    out = []
    for net in value:
        try:
            out.append(str(ipaddress.ip_network(net, strict=False)))
        except (TypeError, ValueError):
            raise ConfigError("training_subnets", f"expected networks such as '10.0.0.0/8', got {net!r}") from None
    return tuple(out)


def _interfaces(raw: dict) -> dict:
    """``interface`` (one), ``interfaces`` (a list, or "auto" with ``training_subnets``): which to manage."""
    if "interface" in raw and "interfaces" in raw:
        raise ConfigError("interface", "set either interface or interfaces, not both")
    subnets = _subnets(raw)
    if "interface" in raw:
        names = (_ifname("interface", raw["interface"]),)
    elif raw.get("interfaces") == "auto":
        if not subnets:
            raise ConfigError("interfaces", 'interfaces = "auto" needs training_subnets (the networks the training '
                                            "traffic goes to): the agent manages every interface routed to them")
        return {"interfaces": (), "training_subnets": subnets}
    elif "interfaces" in raw:
        value = raw["interfaces"]
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_INTERFACES:
            raise ConfigError("interfaces", f'expected a list of 1..{MAX_INTERFACES} interface names or "auto", '
                                            f"got {value!r}")
        names = tuple(_ifname("interfaces", v) for v in value)
        if len(set(names)) != len(names):
            raise ConfigError("interfaces", f"an interface is named twice in {list(names)}")
    else:
        raise ConfigError("interface", 'required: the egress interface to manage (interface = "eth0"), several '
                                       '(interfaces = ["eth0", "eth1"]), or interfaces = "auto" with '
                                       "training_subnets")
    if subnets:
        raise ConfigError("training_subnets", 'only used with interfaces = "auto"')
    return {"interfaces": names, "training_subnets": ()}


def _link_rates(raw: dict) -> int | dict | None:
    """``link_rate``: one rate for every device, or a table ``{device: rate}`` (absent devices: the driver's)."""
    value = raw.get("link_rate")
    if not isinstance(value, dict):
        return None if value is None else parse_rate(value)
    return {_ifname("link_rate", dev): parse_rate(rate) for dev, rate in value.items()}


def _queues(raw: dict) -> dict:
    """The interfaces and their queues: ``interface(s)``, ``backend``, ``levels``, ``dscp``, ``link_rate``."""
    ifaces = _interfaces(raw)
    backend = _want(raw, "backend", str)
    if backend not in BACKENDS:
        raise ConfigError("backend", f"expected one of {', '.join(BACKENDS)}, got {backend!r}")
    levels = _want(raw, "levels", int)
    table = _dscp(raw, levels)
    return ifaces | {"backend": backend, "levels": levels, "dscp": table, "link_rate_bps": _link_rates(raw)}


def _endpoints(raw: dict) -> dict:
    """Where the agent listens and keeps state: ``socket_mode``, ``metrics_address``, ``socket``, ``state_dir``."""
    mode = _want(raw, "socket_mode", (int, str))
    if isinstance(mode, str):
        try:
            mode = int(mode, 8)
        except ValueError:
            raise ConfigError("socket_mode", f"expected an octal mode such as '0660', got {mode!r}") from None
    if not 0 <= mode <= 0o777:
        given = oct(mode) if isinstance(raw.get("socket_mode"), str) else f"{mode} (a TOML integer is decimal)"
        raise ConfigError("socket_mode", f"expected a mode 0..0777, written 0o660 or \"0660\", got {given}")
    metrics = _want(raw, "metrics_address", str)
    if metrics and not (re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]*):\d{1,5}", metrics)
                        and 1 <= int(metrics.rsplit(":", 1)[1]) <= 65535):
        raise ConfigError("metrics_address", f"expected HOST:PORT with a port 1..65535 (or empty to disable), got "
                                             f"{metrics!r}")
    socket_path = _want(raw, "socket", str)
    if not socket_path.startswith("/") or len(socket_path.encode()) > 107:
        raise ConfigError("socket", f"expected an absolute path of at most 107 bytes, got {socket_path!r}")
    state_dir = _want(raw, "state_dir", str)
    if not state_dir.startswith("/"):
        raise ConfigError("state_dir", f"expected an absolute path, got {state_dir!r}")
    return {"socket_mode": mode, "metrics_address": metrics, "socket": socket_path, "state_dir": state_dir}


def _level_limits(raw: dict, levels: int) -> dict:
    """``level_limits``: user or group -> the most urgent level it may ask for."""
    limits = _want(raw, "level_limits", dict)
    for who, lvl in limits.items():
        if isinstance(lvl, bool) or not isinstance(lvl, int) or not 0 <= lvl < levels:
            raise ConfigError("level_limits", f"{who!r}: expected a level 0..{levels - 1}, got {lvl!r}")
    return dict(limits)


def _min_rate(raw: dict) -> int:
    """``min_rate`` (:func:`parse_min_rate`), or its default."""
    return parse_min_rate(raw.get("min_rate", _default("min_rate")))


def parse_min_rate(value: int | str) -> int:
    """A ``min_rate`` in bits/s: a rate ("2.5mbit", or bits/s as an int), or 0 for none.

    Usage: ``parse_min_rate("1mbit") == 1_000_000`` and ``parse_min_rate(0) == 0``
    """
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError("min_rate", f"expected a rate such as \"2.5mbit\", bits/s or 0, got {value!r}")
    return parse_rate(value, "min_rate")


def _service(raw: dict, levels: int) -> dict:
    """The main loop and the API's limits: queue length, reconcile interval, level limits, rates, flows."""
    levels_and_default = levels + 1
    return {"queue_limit_packets": _integer(raw, "queue_limit_packets", 10, 100_000),
            "min_share": _number(raw, "min_share", 0.0, round(0.5 / levels_and_default, 4),
                                 f" (a fraction of the link for each of the {levels_and_default} classes; "
                                 "together at most half of it)"),
            "min_rate_bps": _min_rate(raw),
            "reconcile_interval_s": _number(raw, "reconcile_interval_s", 0.1, 3600, " seconds"),
            "level_limits": _level_limits(raw, levels),
            "rate_limit_per_s": _number(raw, "rate_limit_per_s", 1, 1_000_000, " requests per second"),
            "max_flows": _integer(raw, "max_flows", 1, 1_000_000),
            "max_flows_per_user": _integer(raw, "max_flows_per_user", 1, 1_000_000),
            "max_jobs_per_user": _integer(raw, "max_jobs_per_user", 1, 100_000),
            "reserved_flow_share": _number(raw, "reserved_flow_share", 0.0, 0.5, " (a share of max_flows)"),
            "socket_group": _want(raw, "socket_group", str),
            "ack_priority": _want(raw, "ack_priority", bool),
            "reset_user_dscp": _want(raw, "reset_user_dscp", bool),
            "kernel_tcp_dscp": _kernel_tcp_dscp(raw)}


def _kernel_tcp_dscp(raw: dict) -> tuple[int, ...]:
    """``kernel_tcp_dscp``: DSCP values (numbers 0..63 or names such as "CS3"), each once, sorted; only with
    ``reset_user_dscp`` (without it every packet keeps its DSCP: a list would say otherwise)."""
    value = _want(raw, "kernel_tcp_dscp", list)
    out = []
    for v in value:
        try:
            out.append(parse_dscp(v))
        except ValueError as exc:
            raise ConfigError("kernel_tcp_dscp", str(exc)) from None
    if len(set(out)) != len(out):
        raise ConfigError("kernel_tcp_dscp", f"a DSCP is named twice in {value!r}")
    if out and not _want(raw, "reset_user_dscp", bool):
        raise ConfigError("kernel_tcp_dscp", "only used with reset_user_dscp = true (with false, every packet keeps "
                                             "its DSCP)")
    return tuple(sorted(out))


def _access(raw: dict) -> dict:
    """Who may use the agent (docs/agent.md, "Security settings"), and whether the interface may be taken over."""
    return {"allowed_users": _names(raw, "allowed_users"), "allowed_groups": _names(raw, "allowed_groups"),
            "trusted_users": _names(raw, "trusted_users"),
            "check_ownership": _want(raw, "check_ownership", bool),
            "take_over_root": _want(raw, "take_over_root", bool)}


def from_dict(raw: dict) -> Config:
    """Validate a parsed config mapping and return a Config. Usage: ``from_dict({"interface": "eth0"})``"""
    _check_keys(raw)
    values = _queues(raw)
    values |= _endpoints(raw)
    values |= _service(raw, values["levels"])
    values |= _job_policy(raw, values["min_share"] * (values["levels"] + 1))
    values |= _connection_limits(raw)
    values |= _access(raw)
    return Config(**values)


def _with_ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, up to ``/``."""
    out = [path]
    while out[-1] != os.path.dirname(out[-1]):
        out.append(os.path.dirname(out[-1]))
    return out


def _links_on_the_way(path: str, depth: int = 0) -> list[str]:
    """The paths of every symbolic link met while resolving ``path``, and of everything the kernel looks at on the
    way to each one's target (a link to a link: the second is neither in the path as written nor in the resolved
    one), with the directories above them."""
    out: list[str] = []
    cur = "/"
    for part in os.path.abspath(path).split("/"):
        if not part:
            continue
        nxt = os.path.join(cur, part)
        if depth < 40 and os.path.islink(nxt):  # (40: the kernel's own limit of links in one lookup)
            target = os.path.join(cur, os.readlink(nxt))
            out += [nxt, *_with_ancestors(os.path.abspath(target)), *_links_on_the_way(target, depth + 1)]
            cur = os.path.realpath(nxt)
        else:
            cur = nxt
    return out


def others_may_write(path: str) -> str:
    """Why a user other than root and this process's could change what is at ``path`` ("" when none can): it, or a
    directory above it, as written or with its links resolved (each link met on the way too), owned by another user
    (a symbolic link too: its owner may replace it), or writable by group or others (a directory with the sticky
    bit, such as ``/tmp``, excepted: no one else may replace what root made there)."""
    try:
        links = _links_on_the_way(path)
    except OSError as exc:
        return f"cannot resolve {path}: {exc}"
    for p in dict.fromkeys(_with_ancestors(os.path.abspath(path)) + _with_ancestors(os.path.realpath(path)) + links):
        try:
            st = os.lstat(p)
        except OSError as exc:
            return f"cannot look at {p}: {exc}"
        if st.st_uid not in (0, os.geteuid()):
            return f"{p} is {'a symbolic link ' if stat.S_ISLNK(st.st_mode) else ''}owned by uid {st.st_uid}"
        if (st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)
                and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)):
            return (f"{p} is writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode "
                    f"{stat.S_IMODE(st.st_mode):04o})")
    return ""


def load_config(path: str, overrides: dict | None = None) -> Config:
    """Read and validate a TOML config file; ``overrides`` (from command-line flags) win over the file. A file another
    user could change is refused: it says whom the agent, root, trusts (``trusted_users``, ``level_limits``,
    ``check_ownership``) and which trees it restores; before, a group-writable file gave its group all that."""
    if os.path.exists(path) and (problem := others_may_write(path)):
        raise ConfigError(FILE_FIELD, f"{path}: another user could change the agent's configuration: {problem}; make "
                                      "it and its directories root's (or the agent user's), not writable by others")
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(FILE_FIELD, f"no config file at {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(FILE_FIELD, f"{path} is not valid TOML: {exc}") from None
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "interface" in overrides:  # the command line's one interface replaces the file's choice
        for key in ("interfaces", "training_subnets"):
            raw.pop(key, None)
    raw.update(overrides)
    return from_dict(raw)
