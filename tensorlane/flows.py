"""Flow identity, and a process's own established TCP flows (no torch, no privileges).

Shared by the agent (``FlowKey`` in its table; ``socket_inodes`` for ownership) and the shim (``own_tcp_flows``;
``own_flow_fds``: which fd holds each, sent with a register).

A process's sockets are the ``socket:[INODE]`` links in ``/proc/PID/fd``. The caller's own are asked for their
addresses and state directly (``getsockname``, ``getpeername``, ``TCP_INFO`` on a duplicate of each fd: a cost per
socket of the process, not per socket of the host); another process's, from the rows of ``/proc/PID/net/tcp`` and
``/proc/PID/net/tcp6`` (which show the network namespace of PID). Only
established sockets are returned, as agent flow dicts ``{"proto", "src", "sport", "dst", "dport"}`` in the
direction the flow leaves this host (local address/port to remote address/port). IPv4-mapped IPv6 addresses
(``::ffff:a.b.c.d``, what a dual-stack socket shows) are returned as IPv4.

Usage::

    before = own_tcp_flows()
    dist.init_process_group(...)
    flows = new_flows(before, own_tcp_flows(remote_filter=peer_addresses))
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

TCP_ESTABLISHED = 0x01

FlowDict = dict


class FlowKey(NamedTuple):
    """One direction of a transport flow as it leaves this host: local address/port to remote address/port.

    On the wire (the API) a flow is the dict ``as_dict()`` gives. A tuple of atomic values, so that the garbage
    collector stops tracking it: tens of thousands of registered flows then cost no full-collection pauses.
    """

    proto: str
    src: str
    sport: int
    dst: str
    dport: int

    @property
    def family(self) -> int:
        return ipaddress.ip_address(self.src).version

    def as_dict(self) -> dict:
        return {"proto": self.proto, "src": self.src, "sport": self.sport, "dst": self.dst, "dport": self.dport}

    def __str__(self) -> str:
        return f"{self.proto} {self.src}:{self.sport} -> {self.dst}:{self.dport}"
RemoteFilter = Callable[[dict], bool] | str | Iterable[str] | ipaddress.IPv4Network | ipaddress.IPv6Network | None


class TooManyFiles(OSError):
    """``socket_fds`` with a ``limit``: the process holds more open files than that (they were not read)."""


def socket_fds(pid: int | str, limit: int | None = None, files: list[int] | None = None) -> dict[int, int]:
    """``{inode: fd}`` of the sockets that process ``pid`` holds open (its lowest fd per socket; fds that vanish
    while we look are skipped). With ``limit``: raises TooManyFiles, having read no link, where the process holds more
    open files (each costs a readlink, about 3-8 us: a process with a million of them cost seconds). ``files`` gets
    how many open files were read (sockets or not: what the call cost)."""
    fd_dir = f"/proc/{pid}/fd"
    fds: dict[int, int] = {}
    names = []
    with os.scandir(fd_dir) as entries:
        for entry in entries:
            names.append(entry.name)
            if limit is not None and len(names) > limit:
                raise TooManyFiles(errno.EMFILE, f"process {pid} holds more than {limit} open files")
    if files is not None:
        files.append(len(names))
    for name in sorted(names, key=int):
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            fds.setdefault(int(target[8:-1]), int(name))
    return fds


def socket_inodes(pid: int | str, limit: int | None = None, files: list[int] | None = None) -> set[int]:
    """Inodes of the sockets that process ``pid`` holds open (fds that vanish while we look are skipped; ``limit``,
    ``files``: ``socket_fds``')."""
    return set(socket_fds(pid, limit, files))


def _addr4(hexaddr: str) -> ipaddress.IPv4Address:
    # The kernel prints the in-memory (network order) 32-bit word as a host-order integer.
    return ipaddress.IPv4Address(struct.pack("=I", int(hexaddr, 16)))


def _addr6(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    words = [int(hexaddr[i:i + 8], 16) for i in range(0, 32, 8)]
    addr = ipaddress.IPv6Address(struct.pack("=4I", *words))
    return addr.ipv4_mapped or addr


def _endpoint(text: str, v6: bool):
    hexaddr, hexport = text.split(":")
    return (_addr6(hexaddr) if v6 else _addr4(hexaddr)), int(hexport, 16)


def parse_proc_net_tcp(text: str, v6: bool = False, inodes: set[int] | None = None,
                       uids: dict[int, int] | None = None) -> list[tuple[int, int, tuple, tuple]]:
    """Parse the text of /proc/net/tcp(6) (or udp(6): same columns) into
    ``(inode, state, (laddr, lport), (raddr, rport))`` rows; with ``inodes``, only the rows of those sockets
    (the others are skipped before their addresses are parsed: cheap on large tables). ``uids``, where given, gets
    each row's inode -> the uid of the user that made its socket."""
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            inode = int(fields[9])
            if inodes is not None and inode not in inodes:
                continue
            local = _endpoint(fields[1], v6)
            remote = _endpoint(fields[2], v6)
            state = int(fields[3], 16)
            if uids is not None:
                uids[inode] = int(fields[7])
        except ValueError:
            continue
        rows.append((inode, state, local, remote))
    return rows


def _matcher(remote_filter: RemoteFilter) -> Callable[[dict], bool]:
    """Turn ``remote_filter`` into a predicate on flow dicts.

    Accepts a callable (given the flow dict), an address or network string ("198.18.0.2", "198.18.0.0/24"),
    an ip_network, or an iterable of those; None keeps every flow.
    """
    if remote_filter is None:
        return lambda flow: True
    if callable(remote_filter):
        return remote_filter
    items = [remote_filter] if isinstance(remote_filter, (str, ipaddress.IPv4Network, ipaddress.IPv6Network)) \
        else list(remote_filter)
    nets = []
    for item in items:
        net = ipaddress.ip_network(item, strict=False) if not isinstance(
            item, (ipaddress.IPv4Network, ipaddress.IPv6Network)) else item
        if isinstance(net, ipaddress.IPv6Network) and net.prefixlen == 128 and net.network_address.ipv4_mapped:
            net = ipaddress.ip_network(net.network_address.ipv4_mapped)
        nets.append(net)
    return lambda flow: any(ipaddress.ip_address(flow["dst"]) in net for net in nets)


def own_tcp_flows(pid: int | None = None, remote_filter: RemoteFilter = None) -> list[FlowDict]:
    """Established TCP flows of process ``pid`` (default: the caller), as agent flow dicts, sorted.

    ``remote_filter`` keeps only flows whose remote end matches (see ``_matcher``): e.g. the peers' addresses,
    so that a connection to a rendezvous store or a metrics server is left out.
    """
    keep = _matcher(remote_filter)
    flows: dict[tuple, FlowDict] = {}
    ends = _own_established() if pid is None else _established_of(str(int(pid)))
    for (laddr, lport), (raddr, rport) in ends:
        if laddr.version != raddr.version:
            continue
        flow = {"proto": "tcp", "src": str(laddr), "sport": lport, "dst": str(raddr), "dport": rport}
        if keep(flow):
            flows[flow_key(flow)] = flow
    return [flows[k] for k in sorted(flows)]


def _established_of(proc: str) -> list[tuple[tuple, tuple]]:
    """The (local, remote) ends of process ``proc``'s established TCP sockets, from its namespace's tables (only
    its own sockets' rows are parsed)."""
    inodes = socket_inodes(proc)
    ends = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{proc}/net/{name}") as fh:
                text = fh.read()
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        ends += [(local, remote) for inode, state, local, remote in parse_proc_net_tcp(text, v6, inodes)
                 if state == TCP_ESTABLISHED and inode != 0]
    return ends


def _own_established() -> list[tuple[tuple, tuple]]:
    """The (local, remote) ends of the caller's established TCP sockets, each asked through a duplicate of its fd.
    Until 2026-11-27 this read the namespace's whole /proc/self/net/tcp(6) and parsed every row, per call: with 800
    sockets on the host 16 ms a call, 8 calls per ``shim.attach`` (two per level), half of a conformance cell's
    time; it grows with the host's sockets, this with the process's own."""
    return [pair for _, pair in _own_established_fds()]


def _own_established_fds() -> list[tuple[int, tuple[tuple, tuple]]]:
    """``(fd, (local, remote))`` of the caller's established TCP sockets (``_own_established``)."""
    ends = []
    for fd in socket_fds("self").values():
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile
            continue
        if (pair := _ends(dup)) is not None:
            ends.append((fd, pair))
    return ends


def own_flow_fds() -> dict[FlowKey, int]:
    """``{flow: fd}`` of the caller's established TCP flows (as ``own_tcp_flows`` gives them): the fd of this process
    that holds each flow's socket, for a register's ``fds`` (the agent then checks that fd alone, not every open
    file of the process: docs/protocol.md)."""
    out: dict[FlowKey, int] = {}
    for fd, ((laddr, lport), (raddr, rport)) in _own_established_fds():
        if laddr.version == raddr.version:
            out.setdefault(FlowKey("tcp", str(laddr), lport, str(raddr), rport), fd)
    return out


_NONBLOCK_STREAM = socket.SOCK_STREAM | socket.SOCK_NONBLOCK


def _ends(fd: int) -> tuple[tuple, tuple] | None:
    """The (local, remote) ends of the established TCP socket on ``fd`` (None where it is none); ``fd`` is closed.
    The socket object is made without touching the file's flags: ``socket.socket(fileno=fd)`` puts it in
    non-blocking mode where ``socket.setdefaulttimeout()`` was called, and ``fd`` is a duplicate, which shares the
    open file's flags with the process's own fd (its blocking sockets then raised BlockingIOError: a user's, the
    rendezvous store's). Given its family and type with SOCK_NONBLOCK, Python asks the fd nothing and sets nothing."""
    try:
        sock = socket.socket(socket.AF_INET, _NONBLOCK_STREAM, 0, fileno=fd)
    except (OSError, ValueError):
        os.close(fd)
        return None
    try:
        family = sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        if family not in (socket.AF_INET, socket.AF_INET6) or \
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
            return None
        if family == socket.AF_INET6:  # (its addresses are read as the object's family says)
            fd = sock.detach()
            try:
                sock = socket.socket(socket.AF_INET6, _NONBLOCK_STREAM, 0, fileno=fd)
            except (OSError, ValueError):
                os.close(fd)
                return None
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED:
            return None
        return _sockaddr(sock.getsockname()), _sockaddr(sock.getpeername())
    except OSError:  # not a socket (the fd reused meanwhile), or no longer connected
        return None
    finally:
        sock.close()


def _sockaddr(addr: tuple) -> tuple:
    """``(ip_address, port)`` of a socket address, an IPv4-mapped one as IPv4 and without a scope, as the tables
    show it."""
    ip = ipaddress.ip_address(addr[0].split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip), addr[1]


def flow_key(flow: FlowDict) -> FlowKey:
    """Hashable identity of a flow dict (``FlowKey(**flow)`` with the protocol defaulting to tcp)."""
    return FlowKey(flow.get("proto", "tcp"), flow["src"], flow["sport"], flow["dst"], flow["dport"])


def new_flows(before: Iterable[FlowDict], after: Iterable[FlowDict]) -> list[FlowDict]:
    """Flows of ``after`` that are not in ``before`` (order of ``after`` kept)."""
    seen = {flow_key(f) for f in before}
    out = []
    for flow in after:
        key = flow_key(flow)
        if key not in seen:
            seen.add(key)
            out.append(flow)
    return out
