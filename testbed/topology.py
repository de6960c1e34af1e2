"""Namespace testbed: N emulated hosts on one emulated DSCP-trusting switch, every link shaped to RATE.

::

    tl-h1 [eth0 198.18.0.1/24] ==veth== [p1]-+
    tl-h2 [eth0 198.18.0.2/24] ==veth== [p2]-+- br0   (namespace tl-sw)
    tl-hN [eth0 198.18.0.N/24] ==veth== [pN]-+

With ``segments=2`` every host also has ``eth1`` at 198.19.0.{i}/24 on a second bridge ``br1`` of the same switch
namespace, through port ``p{i}s1`` (two rails: the segments are not connected to each other). With ``ipv6=True``
every NIC also has ``2001:2:0:{s}::{i}/64`` (RFC 5180's benchmarking prefix) and the switch queues IPv6 packets by
their traffic class; otherwise IPv6 is off in every namespace (no neighbour discovery or MLD in the queues).

Switch port egress: HTB at RATE, 8 strict-priority queues, queue = DSCP >> 3 (testbed.switch). Host NIC egress
(``shape_hosts=True``): HTB at RATE, one FIFO class. See docs/testbed.md.

Usage::

    with Testbed(hosts=3, rate="200mbit", name="tl") as tb:
        tb.host(2).popen(["iperf3", "-s", "-1"])
        tb.host(1).run(["iperf3", "-c", tb.host(2).ip, "-t", "3"])
        print(tb.switch_port_stats(2))

CLI: ``python -m testbed up --hosts 3 --rate 200mbit --name tl [--segments 2]`` / ``down --name tl`` /
``down --all`` / ``list``.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

from pyroute2 import IPRoute

from tensorlane import units
from testbed import records, switch

NETNS_DIR = "/run/netns"
SUBNETS = ("198.18.0", "198.19.0")  # segment s: 198.18.0.0/15 split into /24s, one per segment
SUBNETS6 = ("2001:2:0:0", "2001:2:0:1")  # segment s with ipv6: 2001:2::/48 (benchmarking), a /64 per segment
PREFIXLEN6 = 64
SUBNET = SUBNETS[0]
PREFIXLEN = 24
IFNAME = "eth0"  # segment 0; interface_name(s) in general
BRIDGE = "br0"  # segment 0; bridge_name(s) in general
MAX_HOSTS = 64
MAX_SEGMENTS = len(SUBNETS)
MIN_RATE_BPS = 1_000_000
MAX_RATE_BPS = 10_000_000_000
CMD_TIMEOUT_S = 10
KILL_GRACE_S = 2.0
# TCP builds 64 KB GSO super-packets by default; HTB would then shape and pfifo would count in 64 KB units.
# gso_max_segs=1 (set over netlink on every veth) makes every packet on the wire a real <= 1514-byte frame.
GSO_MAX_SEGS = 1
IFA_F_NODAD = 0x02

_NO_IPV6 = ("[ -d /proc/sys/net/ipv6 ] || exit 0; for c in all default; "
            "do echo 1 > /proc/sys/net/ipv6/conf/$c/disable_ipv6 || exit 1; done")


class TestbedError(RuntimeError):
    """A testbed could not be built, inspected or torn down; the message says which namespace and why."""

    __test__ = False  # not a pytest test class


class CommandError(TestbedError, subprocess.CalledProcessError):
    """A command run with ``Host.run(check=True)`` exited non-zero; the message includes its stderr."""

    def __init__(self, returncode: int, cmd, output=None, stderr=None):
        subprocess.CalledProcessError.__init__(self, returncode, cmd, output, stderr)

    def __str__(self) -> str:
        """The command, its exit status and the tail of its stderr."""
        err = (self.stderr or "").strip()[-500:] if isinstance(self.stderr, str) else ""
        return f"{subprocess.CalledProcessError.__str__(self)}{': ' + err if err else ''}"


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate such as ``"200mbit"``, ``"1gbit"``, ``"5000kbit"`` (1 mbit..10 gbit).

    Usage: ``parse_rate("200mbit") == 200_000_000``
    """
    if not isinstance(rate, str):
        raise ValueError(f"rate must look like '200mbit', '1gbit' or '5000kbit' (bits per second), not {rate!r}")
    return units.parse_rate(rate, MIN_RATE_BPS, MAX_RATE_BPS)


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid testbed name (1-8 of a-z, 0-9); raise ValueError otherwise."""
    if not isinstance(name, str) or not records.NAME_RE.fullmatch(name):
        raise ValueError(f"testbed name must be 1-8 characters of [a-z0-9], not {name!r}")
    return name


def validate_segments(segments: int) -> int:
    """Return ``segments`` if it is a valid segment count (1..MAX_SEGMENTS); raise ValueError otherwise."""
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= MAX_SEGMENTS:
        raise ValueError(f"segments must be an integer 1..{MAX_SEGMENTS}, not {segments!r}")
    return segments


def interface_name(segment: int) -> str:
    """Name of a host's NIC on ``segment``: ``eth0``, ``eth1``."""
    return f"eth{segment}"


def bridge_name(segment: int) -> str:
    """Name of the switch bridge of ``segment``: ``br0``, ``br1``."""
    return f"br{segment}"


def port_name(index: int, segment: int = 0) -> str:
    """Name of the switch port toward host ``index`` on ``segment``: ``p{index}`` on 0, ``p{index}s{segment}`` else."""
    return f"p{index}" if segment == 0 else f"p{index}s{segment}"


def netns_exists(ns: str) -> bool:
    """Whether a named network namespace ``ns`` exists (``ip netns list`` reads the same directory)."""
    return os.path.exists(os.path.join(NETNS_DIR, ns))


def _ip(args: list[str], timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` with a timeout; raise TestbedError with ip's message on failure."""
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise TestbedError(f"'ip {' '.join(args)}' timed out after {timeout} s") from e
    if proc.returncode != 0:
        raise TestbedError(f"'ip {' '.join(args)}' failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _netns_pids(ns: str) -> list[int]:
    """Ids of the processes running inside namespace ``ns`` (never this process)."""
    try:
        out = _ip(["netns", "pids", ns]).stdout
    except TestbedError:
        return []
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_netns_processes(ns: str, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the processes left inside ``ns``, then SIGKILL those still there after ``grace`` seconds."""
    pids = _netns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _netns_pids(ns)
        if not pids:
            return


def _delete_netns(ns: str) -> bool:
    """Stop what runs in ``ns`` and delete it; False if it did not exist."""
    if not netns_exists(ns):
        return False
    _kill_netns_processes(ns)
    _ip(["netns", "del", ns])
    return True


def _exit_if_forked(owner: int) -> None:
    """End this process at once if it is not ``owner``: a fork that pyroute2 made to open a socket in a namespace.

    pyroute2 forks a copy of this process (the whole Python stack included) for every ``IPRoute(netns=...)``; a
    signal that turns into an exception in that copy (SIGINT from the terminal, SIGTERM when pyroute2 stops it)
    must not unwind into our cleanup code, or the copy would tear down the testbed its parent is building.
    """
    if os.getpid() != owner:
        os._exit(1)


@contextlib.contextmanager
def _ipr(ns: str) -> Iterator[IPRoute]:
    """An rtnetlink socket inside the existing namespace ``ns`` (flags=0: never creates one), closed on exit."""
    if not netns_exists(ns):
        raise TestbedError(f"network namespace {ns} does not exist")
    owner = os.getpid()
    try:
        ipr = IPRoute(netns=ns, flags=0)
    except BaseException:
        _exit_if_forked(owner)
        raise
    try:
        yield ipr
    finally:
        ipr.close()


def _link_index(ipr: IPRoute, ifname: str, ns: str) -> int:
    """Index of link ``ifname`` in the namespace of ``ipr``; TestbedError if absent."""
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise TestbedError(f"no link {ifname} in namespace {ns}")
    return found[0]


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back for the block (this thread); one that arrives meanwhile is delivered at its end.

    Used where an interruption would lose track of what exists: creating a namespace (an interrupted
    ``subprocess.run`` may leave ``ip netns add`` running unwaited, creating the namespace after we looked) and
    tearing down.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Host:
    """One emulated host: a network namespace with ``eth{s}`` at ``198.{18+s}.0.{index}/24`` per switch segment s."""

    def __init__(self, testbed: str, index: int, segments: int = 1, ipv6: bool = False):
        """Describe host ``index`` (1-based) of testbed ``testbed`` with ``segments`` NICs; creates nothing."""
        self.index = index
        self.name = f"{testbed}-h{index}"
        self.segments = validate_segments(segments)
        self.ipv6 = bool(ipv6)
        self.ip = self.address(0)
        self.ip6 = self.address6(0) if self.ipv6 else None
        self.ifname = self.interface(0)

    def _segment(self, segment: int) -> int:
        """Return ``segment`` if this host has a NIC on it; raise TestbedError otherwise."""
        if isinstance(segment, bool) or not isinstance(segment, int) or not 0 <= segment < self.segments:
            raise TestbedError(f"host {self.name} has segments 0..{self.segments - 1}, not {segment!r}")
        return segment

    def address(self, segment: int = 0) -> str:
        """IPv4 address of this host's NIC on ``segment`` (``198.18.0.{i}`` on 0, ``198.19.0.{i}`` on 1)."""
        return f"{SUBNETS[self._segment(segment)]}.{self.index}"

    def address6(self, segment: int = 0) -> str:
        """IPv6 address of this host's NIC on ``segment`` (``2001:2::{i}`` on 0; the testbed needs ``ipv6``)."""
        if not self.ipv6:
            raise TestbedError(f"host {self.name} has no IPv6 address (build the testbed with ipv6=True)")
        return str(ipaddress.IPv6Address(f"{SUBNETS6[self._segment(segment)]}::{self.index:x}"))

    def interface(self, segment: int = 0) -> str:
        """Name of this host's NIC on ``segment`` (``eth0``, ``eth1``)."""
        return interface_name(self._segment(segment))

    def __repr__(self) -> str:
        """``Host(tl-h1, 198.18.0.1)``."""
        return f"Host({self.name}, {self.ip})"

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` in the namespace and wait (``timeout`` s); output captured as text unless redirected.

        Raises CommandError (a TestbedError and a CalledProcessError) on non-zero exit when ``check``, and
        subprocess.TimeoutExpired when it runs too long (the child is killed).
        """
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        proc = subprocess.run(self.argv(argv), timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in the namespace; the caller waits for or kills it (``down()`` kills what is left)."""
        return subprocess.Popen(self.argv(argv), **kw)


class Testbed:
    """N host namespaces on one switch namespace; ``up()`` builds it, ``down()`` removes what ``up()`` made."""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int = 3, rate: str = "200mbit", name: str = "tl", shape_hosts: bool = True,
                 segments: int = 1, ipv6: bool = False):
        """Validate the parameters (ValueError when wrong); nothing is created before ``up()``.

        ``segments=2`` gives every host a second NIC ``eth1`` (198.19.0.{i}/24) on a second switch bridge.
        ``ipv6=True``: every NIC also has an IPv6 address (``Host.address6``), the switch queues IPv6 by traffic class.
        """
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an integer 1..{MAX_HOSTS}, not {hosts!r}")
        self.name = validate_name(name)
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.shape_hosts = bool(shape_hosts)
        self.segments = validate_segments(segments)
        self.switch_ns = f"{name}-sw"
        self.ipv6 = bool(ipv6)
        self.hosts = [Host(name, i, self.segments, self.ipv6) for i in range(1, hosts + 1)]
        self._created: list[str] = []
        self._token: str | None = None

    def __repr__(self) -> str:
        """``Testbed(tl, 3 hosts, 200mbit)``, ``Testbed(tl, 3 hosts, 200mbit, 2 segments)``."""
        extra = (f", {self.segments} segments" if self.segments > 1 else "") + (", IPv6" if self.ipv6 else "")
        return f"Testbed({self.name}, {len(self.hosts)} hosts, {self.rate}{extra})"

    def __enter__(self) -> Testbed:
        """Build the testbed (``up``)."""
        return self.up()

    def __exit__(self, *exc) -> None:
        """Tear the testbed down (``down``), whatever happened in the block."""
        self.down()

    def host(self, i: int) -> Host:
        """Host ``i``, 1-based."""
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= len(self.hosts):
            raise TestbedError(f"testbed {self.name} has hosts 1..{len(self.hosts)}, not {i!r}")
        return self.hosts[i - 1]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this testbed consists of, switch first."""
        return [self.switch_ns, *(h.name for h in self.hosts)]

    def up(self, detached: bool = False) -> Testbed:
        """Build everything; on any error (KeyboardInterrupt included) remove what was made and re-raise.

        ``detached``: the testbed is meant to outlive this process (``python -m testbed up``). Otherwise it lives as
        long as its builder: when a builder dies without ``down()`` (SIGKILL, a killed test run), the next ``up()`` of
        the same name removes what the record lists, says so on stderr, and builds anew.
        """
        if self._created:
            raise TestbedError(f"testbed {self.name} is already up")
        owner = os.getpid()
        with records.name_lock(self.name):
            self._refuse_existing(self._reclaim_leftover())
            try:
                self._build(detached)
            except BaseException as e:
                _exit_if_forked(owner)
                with _signals_held():
                    try:
                        self._teardown()
                    except Exception as cleanup_error:  # noqa: BLE001 - keep the original error
                        e.add_note(f"cleanup after the failed build also failed: {cleanup_error}")
                raise
        return self

    def down(self) -> None:
        """Remove every namespace this instance created (and processes left in them); safe to call twice."""
        if not self._created:
            return
        with _signals_held(), records.name_lock(self.name):
            self._teardown()

    def _reclaim_leftover(self) -> dict:
        """Remove the testbed of this name that a builder left when it died (not a detached one); the lock is held.
        Returns the record of this name that stands afterwards (``{}``: none)."""
        record = records.read_record(self.name)
        if record is None or record.get("detached") is not False or records.builder_alive(record) is not None:
            return record or {}
        removed = _remove_recorded(self.name, record)
        print(f"testbed {self.name}: removed {', '.join(removed) or 'nothing'}, left by process {record.get('pid')} "
              f"that built it and ended without tearing it down", file=sys.stderr)
        return {}  # all of it removed, and its record (else _remove_recorded raised)

    def _refuse_existing(self, record: dict) -> None:
        """Raise TestbedError if any namespace this testbed would create already exists (``record``: this name's)."""
        pid = records.builder_alive(record)
        for ns in self.namespaces:
            if not netns_exists(ns):
                continue
            if pid is not None and ns in record.get("netns", []):
                raise TestbedError(f"network namespace {ns} already exists: testbed {self.name} is in use by running "
                                   f"process {pid}")
            raise TestbedError(
                f"network namespace {ns} already exists; not touching it (if it is a leftover of testbed "
                f"{self.name}: python -m testbed down --name {self.name})"
            )

    def _build(self, detached: bool) -> None:
        """Create the namespaces (recorded first), the bridge, the links and the qdiscs."""
        self._token = uuid.uuid4().hex
        record = {"name": self.name, "token": self._token, "pid": os.getpid(),
                  "pid_start": records.process_start(os.getpid()), "detached": bool(detached),
                  "hosts": len(self.hosts), "segments": self.segments, "rate": self.rate, "rate_bps": self.rate_bps,
                  "created": time.time(), "netns": []}
        with _signals_held():
            records.write_record(self.name, record)
        for ns in self.namespaces:
            self._create_netns(record, ns)
        self._build_switch()
        for host in self.hosts:
            self._add_host(host)

    def _create_netns(self, record: dict, ns: str) -> None:
        """Record ``ns``, create it (dropping it from the record if that fails), quiet its IPv6."""
        with _signals_held():
            record["netns"].append(ns)
            records.write_record(self.name, record)
            try:
                _ip(["netns", "add", ns])
            except TestbedError:  # ip refused (e.g. it exists now): not ours
                record["netns"].remove(ns)
                records.write_record(self.name, record)
                raise
            self._created.append(ns)
        # IPv4-only testbed: without IPv6 there is no NDP/MLD chatter in the switch queues.
        if not self.ipv6:
            _ip(["netns", "exec", ns, "sh", "-c", _NO_IPV6])

    def _build_switch(self) -> None:
        """In the switch namespace: ``lo`` up and one bridge per segment (``br0``, ``br1``; no STP, delay 0) up."""
        with _ipr(self.switch_ns) as ipr:
            ipr.link("set", index=_link_index(ipr, "lo", self.switch_ns), state="up")
            for segment in range(self.segments):
                bridge = bridge_name(segment)
                ipr.link("add", ifname=bridge, kind="bridge", br_stp_state=0, br_forward_delay=0)
                ipr.link("set", index=_link_index(ipr, bridge, self.switch_ns), state="up")

    def _add_host(self, host: Host) -> None:
        """Wire ``host``: per segment s a veth eth{s} (host ns) <-> its switch port (on br{s}), shaped and up."""
        with _ipr(host.name) as ipr:
            ipr.link("set", index=_link_index(ipr, "lo", host.name), state="up")
            for segment in range(self.segments):
                self._add_nic(ipr, host, segment)
        with _ipr(self.switch_ns) as ipr:
            for segment in range(self.segments):
                self._add_switch_port(ipr, port_name(host.index, segment), bridge_name(segment))

    def _add_nic(self, ipr: IPRoute, host: Host, segment: int) -> None:
        """In ``host``'s namespace: create the veth of ``segment`` (peer into the switch), address, shaping, up."""
        ifname, port = host.interface(segment), port_name(host.index, segment)
        ipr.link("add", ifname=ifname, kind="veth", peer={"ifname": port, "net_ns_fd": self.switch_ns})
        idx = _link_index(ipr, ifname, host.name)
        ipr.link("set", index=idx, gso_max_segs=GSO_MAX_SEGS)
        ipr.addr("add", index=idx, address=host.address(segment), prefixlen=PREFIXLEN)
        if self.ipv6:  # no duplicate address detection: usable at once
            ipr.addr("add", index=idx, address=host.address6(segment), prefixlen=PREFIXLEN6, flags=IFA_F_NODAD)
        if self.shape_hosts:
            switch.install_fifo(ipr, idx, self.rate_bps)
        ipr.link("set", index=idx, state="up")

    def _add_switch_port(self, ipr: IPRoute, port: str, bridge: str) -> None:
        """In the switch namespace: ``port`` onto ``bridge``, strict-priority queues at RATE, up."""
        pidx = _link_index(ipr, port, self.switch_ns)
        ipr.link("set", index=pidx, gso_max_segs=GSO_MAX_SEGS)
        ipr.link("set", index=pidx, master=_link_index(ipr, bridge, self.switch_ns))
        switch.install_strict_priority(ipr, pidx, self.rate_bps, ipv6=self.ipv6)
        ipr.link("set", index=pidx, state="up")

    def _teardown(self) -> None:
        """Delete the namespaces this instance created, hosts first; then update or remove the record.

        If the record now belongs to another build of the same name (another token), nothing is deleted.
        """
        record = records.read_record(self.name)
        if record is not None and record.get("token") not in (None, self._token):
            self._created = []
            return
        errors = []
        for ns in reversed(self._created[:]):
            try:
                _delete_netns(ns)
                self._created.remove(ns)
            except TestbedError as e:
                errors.append(str(e))
        if record is not None:
            record["netns"] = [ns for ns in record.get("netns", []) if ns in self._created]
            if record["netns"]:
                records.write_record(self.name, record)
            else:
                records.remove_record(self.name)
        if errors:
            raise TestbedError(f"testbed {self.name}: could not remove: {'; '.join(errors)}")

    def switch_port(self, i: int, segment: int = 0) -> str:
        """Name of the switch port toward host ``i`` on ``segment``: ``p{i}``, or ``p{i}s1`` on segment 1."""
        host = self.host(i)
        return port_name(host.index, host._segment(segment))

    def switch_port_stats(self, i: int, segment: int = 0) -> dict[int, dict[str, int]]:
        """Counters of the switch port toward host ``i`` on ``segment`` (0 = ``p{i}``, 1 = ``p{i}s1``).

        Returns ``{queue 0..7: {bytes, packets, drops, backlog, qlen}}``.
        """
        port = self.switch_port(i, segment)
        with _ipr(self.switch_ns) as ipr:
            return switch.queue_stats(ipr, _link_index(ipr, port, self.switch_ns))


def down_by_name(name: str) -> list[str]:
    """Remove the namespaces that the ownership record of testbed ``name`` lists (and carry its prefix).

    Returns the names of the namespaces removed (sorted); a name without a record removes nothing.
    """
    validate_name(name)
    with records.name_lock(name):
        record = records.read_record(name)
        return [] if record is None else _remove_recorded(name, record)


def _remove_recorded(name: str, record: dict) -> list[str]:
    """Remove what ``record`` lists and ``name``'s prefix allows, then update or drop it (the lock is held)."""
    owned = records.owned_netns_re(name)
    removed, errors, left = [], [], []
    with _signals_held():
        listed = {ns for ns in record.get("netns", []) if isinstance(ns, str) and owned.fullmatch(ns)}
        for ns in sorted(listed, key=lambda n: n.endswith("-sw")):  # hosts first, the switch last
            try:
                if _delete_netns(ns):
                    removed.append(ns)
            except TestbedError as e:
                errors.append(str(e))
                left.append(ns)
        if left:
            records.write_record(name, {**record, "netns": left})
        else:
            records.remove_record(name)
    if errors:
        raise TestbedError(f"testbed {name}: could not remove: {'; '.join(errors)}")
    return sorted(removed)


def _print_hosts(tb: Testbed) -> None:
    """Print the host table of a testbed that is up."""
    segs = f", {tb.segments} segments" if tb.segments > 1 else ""
    print(f"testbed {tb.name} is up: {len(tb.hosts)} hosts{segs}, {tb.rate} per link, switch namespace {tb.switch_ns}")
    print(f"{'host':>4}  {'netns':<10} {'if':<5} {'ip':<18} switch port")
    for h in tb.hosts:
        for s in range(tb.segments):
            v6 = f"  {h.address6(s)}/{PREFIXLEN6}" if tb.ipv6 else ""
            print(f"{h.index:>4}  {h.name:<10} {h.interface(s):<5} {h.address(s) + '/' + str(PREFIXLEN):<18} "
                  f"{tb.switch_port(h.index, s)}{v6}")
    print(f"run in a host: ip netns exec {tb.hosts[0].name} CMD; tear down: python -m testbed down --name {tb.name}")


def _cmd_up(args: argparse.Namespace) -> int:
    """``up``: build and leave the testbed up (SIGINT/SIGTERM during the build clean up)."""
    tb = Testbed(hosts=args.hosts, rate=args.rate, name=args.name, shape_hosts=not args.no_shape_hosts,
                 segments=args.segments, ipv6=args.ipv6)

    owner = os.getpid()

    def _interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
        """SIGINT/SIGTERM: KeyboardInterrupt, so that the build cleans up (a pyroute2 fork just exits)."""
        _exit_if_forked(owner)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        tb.up(detached=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    _print_hosts(tb)
    return 0


def _creator_alive(name: str) -> int | None:
    """The pid that built testbed ``name`` if that very process still runs (and is not this one), else None."""
    return records.builder_alive(records.read_record(name) or {})


def _cmd_down(args: argparse.Namespace) -> int:
    """``down``: remove one recorded testbed; ``--all``: every recorded one whose builder process has ended."""
    names = records.recorded_names() if args.all else [args.name]
    for name in names:
        pid = _creator_alive(name) if args.all else None
        if pid is not None:
            print(f"testbed {name}: skipped, in use by running process {pid} (remove it with --name {name})")
            continue
        removed = down_by_name(name)
        print(f"testbed {name}: removed {', '.join(removed) if removed else 'nothing'}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:  # noqa: ARG001
    """``list``: recorded testbeds and which of their namespaces exist."""
    names = records.recorded_names()
    if not names:
        print("no testbeds recorded")
    for name in names:
        rec = records.read_record(name) or {}
        listed = rec.get("netns", [])
        present = [ns for ns in listed if netns_exists(ns)]
        segs = f", {rec['segments']} segments" if rec.get("segments", 1) != 1 else ""
        print(f"{name}: {rec.get('hosts', '?')} hosts{segs}, {rec.get('rate', '?')}, pid {rec.get('pid', '?')}, "
              f"{len(present)}/{len(listed)} namespaces present: {' '.join(present)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``up --hosts N --rate RATE [--name tl] [--segments 1|2]``, ``down [--name tl | --all]``, ``list``."""
    p = argparse.ArgumentParser(prog="testbed", description="tensorlane network-namespace testbed (root)")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed and leave it up")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate", default="200mbit")
    up.add_argument("--name", default="tl")
    up.add_argument("--no-shape-hosts", action="store_true", help="leave the host NICs unshaped")
    up.add_argument("--segments", type=int, default=1, choices=range(1, MAX_SEGMENTS + 1),
                    help="switch segments: 2 gives every host a second NIC eth1 (198.19.0.i/24) on bridge br1")
    up.add_argument("--ipv6", action="store_true", help="IPv6 addresses too (2001:2::i/64 on eth0)")
    down = sub.add_parser("down", help="remove a testbed (only what its ownership record lists)")
    which = down.add_mutually_exclusive_group()
    which.add_argument("--name", default="tl")
    which.add_argument("--all", action="store_true",
                       help="every recorded testbed whose builder has exited (a live test run keeps its testbed)")
    sub.add_parser("list", help="recorded testbeds")
    args = p.parse_args(argv)
    try:
        return {"up": _cmd_up, "down": _cmd_down, "list": _cmd_list}[args.cmd](args)
    except KeyboardInterrupt:
        print("testbed: interrupted; removed what was built", file=sys.stderr)
        return 130
    except (TestbedError, ValueError, TimeoutError, OSError) as e:
        print(f"testbed: error: {e}", file=sys.stderr)
        return 1
