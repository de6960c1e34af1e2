"""One TCP socket of the agent's network namespace by its 5-tuple, asked of the kernel (netlink sock_diag).

``/proc/self/net/tcp`` walks the whole TCP hash table (milliseconds on a host with much memory: 262,144
buckets here) and formats every socket as text; an exact ``SOCK_DIAG_BY_FAMILY`` request (no dump flag) is one
hash lookup in the kernel, answered with the socket's state and inode. The netlink socket lives in the agent's
network namespace, so a socket of another namespace is never found. Usage::

    diag = SockDiag()
    found = diag.tcp("198.18.0.1", 41000, "198.18.0.2", 29500)   # TcpSocket(state, inode, uid) or None
    many = diag.tcp_many([("198.18.0.1", 41000, "198.18.0.2", 29500), ...])   # batched, in order
    owners = unix_name_sockets("tensorlane-agent")   # [UnixSocket(inode, uid)]: the abstract sockets of that name
    on_port = diag.udp_port(socket.AF_INET, 5000)  # [UdpSocket(state, inode, laddr, lport, raddr, rport)], one dump
"""
from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from tensorlane.agent.kernel.netlink import (
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSG_HDR,
    RTATTR,
    error_code,
)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
UDIAG_SHOW_NAME, UDIAG_SHOW_UID = 0x01, 0x40
UNIX_DIAG_NAME, UNIX_DIAG_UID = 0, 7
_UNIX_REQ = struct.Struct("=BBHIII2I")  # unix_diag_req: family, protocol, pad, states, ino, show, cookie[2]
_UNIX_MSG = 16  # unix_diag_msg: family, type, state, pad, ino, cookie[2]; its attributes follow
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
BATCH = 64  # requests per send: their answers (about 1 KiB each with overhead) fit the receive buffer
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2 head: family, protocol, ext, pad, states
_ID = struct.Struct(">HH16s16s")  # inet_diag_sockid head: sport, dport (big-endian), src, dst
_ID_TAIL = struct.Struct("=III")  # if, cookie[2]
_MSG_STATE = NLMSG_HDR.size + 1  # inet_diag_msg: family, state, ...
_MSG_UID = NLMSG_HDR.size + 4 + 48 + 12  # ... after timer, retrans, the sockid, expires, rqueue, wqueue
_MSG_INODE = _MSG_UID + 4
_MSG_ID = NLMSG_HDR.size + 4  # the inet_diag_sockid in an inet_diag_msg
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_SKV6ONLY = 11  # an attribute of every AF_INET6 socket's answer: IPV6_V6ONLY
INET_DIAG_BC_S_EQ = 11  # inet_diag_bc_op code: the socket's local port equals the next op's ``no``
_BC_OP = struct.Struct("=BBH")  # inet_diag_bc_op: code, yes, no
_HOSTCOND = struct.Struct("=BBxxi")  # inet_diag_hostcond: family, prefix_len, port (-1: any), then the address
INET_DIAG_BC_S_COND = 7  # inet_diag_bc_op code: the local end matches the inet_diag_hostcond that follows
INET_DIAG_BC_JMP = 1  # inet_diag_bc_op code: jump by ``no``


class TcpSocket(NamedTuple):
    """What the kernel says of one TCP socket: its state (``TCP_ESTABLISHED`` = 1, ...), its inode (0: held by no
    process) and the uid of the user that made it."""

    state: int
    inode: int
    uid: int


def _request(seq: int, src: str, sport: int, dst: str, dport: int, ifindex: int = 0) -> bytes:
    """One exact SOCK_DIAG_BY_FAMILY request (TCP, any state) for a 5-tuple of address strings; ``ifindex``: the
    interface of a link-local address's scope (a socket connected through one is bound to it: 0 finds none)."""
    family = socket.AF_INET6 if ":" in src else socket.AF_INET
    body = (_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + _ID.pack(sport, dport, socket.inet_pton(family, src), socket.inet_pton(family, dst))
            + _ID_TAIL.pack(ifindex, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """``(type, seq, message)`` of each netlink message in the datagram ``data`` (header included)."""
    pos = 0
    while pos + NLMSG_HDR.size <= len(data):
        length, kind, _flags, seq, _pid = NLMSG_HDR.unpack_from(data, pos)
        yield kind, seq, data[pos:pos + length]
        pos += max(NLMSG_HDR.size, (length + 3) & ~3)


def _kernel_error(msg: bytes, what: str) -> OSError:
    """The error an NLMSG_ERROR message ``msg`` carries, as an OSError naming ``what`` (errno 0: an ack)."""
    code = error_code(msg)
    return OSError(code, f"{what}: {errno.errorcode.get(code, code)}")


def _answers(data: bytes) -> Iterator[tuple[int, TcpSocket | None]]:
    """``(seq, TcpSocket or None)`` of each netlink message in ``data``; OSError for a kernel error other
    than "no such socket" or an unexpected message."""
    for kind, seq, msg in _messages(data):
        length = len(msg)
        if kind == NLMSG_ERROR:
            exc = _kernel_error(msg, "sock_diag")
            if exc.errno not in (errno.ENOENT, 0):
                raise exc
            yield seq, None
        elif kind != SOCK_DIAG_BY_FAMILY or length < _MSG_INODE + 4:
            raise OSError(errno.EPROTO, f"sock_diag: unexpected answer type {kind}")
        else:
            uid, inode = struct.unpack_from("=II", msg, _MSG_UID)
            yield seq, TcpSocket(msg[_MSG_STATE], inode, uid)


class UdpSocket(NamedTuple):
    """One UDP socket as a port dump gives it: state (1 connected, 7 not), inode (0: held by no process), local and
    remote address (canonical text, a v4-mapped IPv6 one as IPv4, as the socket tables show them) and port."""

    state: int
    inode: int
    laddr: str
    lport: int
    raddr: str
    rport: int
    uid: int = -1  # the user that made it (-1: not told)
    v6only: bool = False  # an IPv6 socket with IPV6_V6ONLY (a wildcard one without it receives and sends IPv4 too)


def _port_dump(seq: int, family: int, protocol: int, port: int,
               addrs: Sequence[tuple[int, str]] = ()) -> bytes:
    """A SOCK_DIAG_BY_FAMILY dump request of ``family``/``protocol`` with a kernel-side bytecode filter: the local
    port is ``port`` (the kernel walks its table but answers only those sockets) and, with ``addrs`` ((family,
    address) pairs), the local address is one of them (an AF_INET one matches a v4-mapped IPv6 socket's too)."""
    if not addrs:
        bc = _BC_OP.pack(INET_DIAG_BC_S_EQ, 8, 12) + _BC_OP.pack(0, 0, port)  # yes: accept; no: past the end, reject
    else:
        conds = [_HOSTCOND.pack(fam, 32 if fam == socket.AF_INET else 128, port) + socket.inet_pton(fam, addr)
                 for fam, addr in addrs]
        # cond, JMP, cond, JMP, ..., cond: a cond that holds goes on to its JMP, which jumps to the end (accept);
        # one that does not skips its JMP, to the next cond, the last past the end (reject). (The kernel's audit
        # walks the ``yes`` jumps: every op must lie on that walk.)
        sizes = [_BC_OP.size + len(c) for c in conds]
        bc = b""
        for i, (cond, size) in enumerate(zip(conds, sizes, strict=True)):
            last = i == len(conds) - 1
            bc += _BC_OP.pack(INET_DIAG_BC_S_COND, size, size + 4) + cond
            if not last:
                rest = _BC_OP.size + sum(sizes[i + 1:]) + _BC_OP.size * (len(conds) - 2 - i)
                bc += _BC_OP.pack(INET_DIAG_BC_JMP, _BC_OP.size, rest)
    attr = RTATTR.pack(RTATTR.size + len(bc), INET_DIAG_REQ_BYTECODE) + bc
    body = (_REQ.pack(family, protocol, 0, 0, 0xFFFFFFFF) + _ID.pack(0, 0, bytes(16), bytes(16))
            + _ID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE) + attr)
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw[:4])
    addr = ipaddress.IPv6Address(raw)
    return str(addr.ipv4_mapped or addr)


def _udp_socket(msg: bytes) -> UdpSocket:
    """The UdpSocket an inet_diag_msg (header included) describes."""
    fam = msg[NLMSG_HDR.size]
    sport, dport, src, dst = _ID.unpack_from(msg, _MSG_ID)
    uid, inode = struct.unpack_from("=II", msg, _MSG_UID)
    v6only = _unix_attrs(msg[_MSG_INODE + 4:]).get(INET_DIAG_SKV6ONLY, b"\0")[:1] != b"\0"
    return UdpSocket(msg[_MSG_STATE], inode, _address(fam, src), sport, _address(fam, dst), dport, uid, v6only)


class SockDiag:
    """A netlink sock_diag socket of the calling process's network namespace (opened at first use)."""

    def __init__(self, timeout_s: float = 0.5):
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._seq = itertools.count(1)

    def _socket(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
            s.settimeout(self.timeout_s)
            self._sock = s
        return self._sock

    def tcp(self, src: str, sport: int, dst: str, dport: int, ifindex: int = 0) -> TcpSocket | None:
        """The TCP socket whose local end is ``src:sport`` and remote end ``dst:dport``, or
        None if this namespace has none. An IPv4 flow is also looked for as a dual-stack (v4-mapped) socket.
        ``ifindex``: the interface of link-local addresses' scope (``fe80::1%eth0``: the scope is not part of
        ``src``). Raises OSError when the kernel cannot answer (no sock_diag): the caller falls back to the tables."""
        if ifindex:
            return self._lookup_many([(src, sport, dst, dport)], ifindex)[0]
        return self.tcp_many([(src, sport, dst, dport)])[0]

    def tcp_many(self, flows: Sequence[tuple[str, int, str, int]]) -> list[TcpSocket | None]:
        """``tcp`` for each ``(src, sport, dst, dport)`` of ``flows``, in order: up to ``BATCH`` requests go out in
        one send and their answers are matched by sequence number (a sweep of hundreds of flows makes a few
        system calls per flow less). Usage: ``diag.tcp_many([("10.0.0.1", 41000, "10.0.0.2", 29500)])``"""
        found = self._lookup_many(flows)
        retry = [i for i, f in enumerate(found) if f is None and ":" not in flows[i][0]]
        if retry:
            mapped = [(f"::ffff:{s}", sport, f"::ffff:{d}", dport) for s, sport, d, dport in (flows[i] for i in retry)]
            for i, f in zip(retry, self._lookup_many(mapped), strict=True):
                found[i] = f
        return found

    def _lookup_many(self, addrs: Sequence[tuple[str, int, str, int]], ifindex: int = 0) -> list[TcpSocket | None]:
        out: list[TcpSocket | None] = [None] * len(addrs)
        sock = self._socket()
        for first in range(0, len(addrs), BATCH):
            waiting: dict[int, int] = {}
            requests = []
            for i in range(first, min(first + BATCH, len(addrs))):
                seq = next(self._seq)
                waiting[seq] = i
                requests.append(_request(seq, *addrs[i], ifindex))
            sock.send(b"".join(requests))
            while waiting:
                for seq, result in _answers(sock.recv(65536)):
                    if seq in waiting:  # else a late answer to an earlier request that timed out
                        out[waiting.pop(seq)] = result
        return out

    def udp(self, src: str, sport: int, dst: str, dport: int) -> UdpSocket | None:
        """The UDP socket that receives what ``dst:dport`` sends to ``src:sport`` (an exact request: one hash lookup
        in the kernel, which picks the best match, a connected socket before a bound one, a bound one before a
        wildcard, among IPv4 and dual-stack IPv6 sockets for an IPv4 ``src``), or None. Raises OSError when the
        kernel cannot answer (no ``udp_diag``)."""
        family = socket.AF_INET6 if ":" in src else socket.AF_INET
        seq = next(self._seq)
        # (the kernel takes the request's source as the packet's: the remote end; "swapped for historical reasons")
        body = (_REQ.pack(family, socket.IPPROTO_UDP, 0, 0, 0xFFFFFFFF)
                + _ID.pack(dport, sport, socket.inet_pton(family, dst), socket.inet_pton(family, src))
                + _ID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
        sock = self._socket()
        sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body)
        while True:
            for kind, got, msg in _messages(sock.recv(1 << 16)):
                if got != seq:  # a late answer to an earlier request that timed out
                    continue
                if kind == NLMSG_ERROR:
                    exc = _kernel_error(msg, "sock_diag (udp)")
                    if exc.errno in (errno.ENOENT, 0):
                        return None
                    raise exc
                if kind != SOCK_DIAG_BY_FAMILY or len(msg) < _MSG_INODE + 4:
                    raise OSError(errno.EPROTO, f"sock_diag (udp): unexpected answer type {kind}")
                return _udp_socket(msg)

    def udp_port(self, family: int, port: int, addrs: Sequence[tuple[int, str]] = ()) -> list[UdpSocket]:
        """The UDP sockets of ``family`` (AF_INET, AF_INET6) in this namespace whose local port is ``port``: one dump
        filtered in the kernel (``INET_DIAG_REQ_BYTECODE``), so the answer holds the sockets of that port only,
        not the namespace's thousands (``/proc/self/net/udp`` prints them all: 660 ms at 19,000). Raises OSError
        when the kernel cannot answer (no ``udp_diag``): the caller falls back to the tables. ``addrs``: only sockets
        bound to one of these (family, address) pairs (``_port_dump``)."""
        sock = self._socket()
        seq = next(self._seq)
        sock.send(_port_dump(seq, family, socket.IPPROTO_UDP, port, addrs))
        out: list[UdpSocket] = []
        while True:
            for kind, got, msg in _messages(sock.recv(1 << 16)):
                if got != seq:  # a late answer to an earlier request that timed out
                    continue
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    raise _kernel_error(msg, "sock_diag (udp)")
                if kind != SOCK_DIAG_BY_FAMILY or len(msg) < _MSG_INODE + 4:
                    raise OSError(errno.EPROTO, f"sock_diag (udp): unexpected answer type {kind}")
                found = _udp_socket(msg)
                if found.lport == port:  # (the filter did its work; a kernel that ignored it is not trusted blindly)
                    out.append(found)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class UnixSocket(NamedTuple):
    """One Unix socket as a unix_diag dump gives it: its inode (``socket:[INODE]`` among a holder's open files) and
    the uid of the user that made it."""

    inode: int
    uid: int


def unix_name_sockets(name: str, timeout_s: float = 1.0) -> list[UnixSocket]:
    """The abstract Unix sockets named ``name`` in this network namespace, each with the uid of the process that
    made it (``UNIX_DIAG_UID``: the socket's owner, fixed at ``socket()``; passing the socket on or handing it to a
    setuid program does not change it). One dump of the namespace's Unix sockets. Raises OSError where the kernel
    cannot answer (no ``unix_diag``)."""
    want = b"\0" + name.encode()
    body = _UNIX_REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_UID,
                          INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(timeout_s)
        head = NLMSG_HDR.pack(NLMSG_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        sock.send(head + body)
        found: list[UnixSocket] = []
        while True:
            for kind, _seq, msg in _messages(sock.recv(1 << 16)):
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    raise _kernel_error(msg, "sock_diag (unix)")
                attrs = _unix_attrs(msg[NLMSG_HDR.size + _UNIX_MSG:])
                if attrs.get(UNIX_DIAG_NAME) != want:
                    continue
                if UNIX_DIAG_UID not in attrs:  # (Linux before 5.3 ignores UDIAG_SHOW_UID)
                    raise OSError(errno.EOPNOTSUPP, "sock_diag (unix): this kernel reports no UNIX_DIAG_UID")
                inode = struct.unpack_from("=I", msg, NLMSG_HDR.size + 4)[0]  # (udiag_ino)
                found.append(UnixSocket(inode, struct.unpack_from("=I", attrs[UNIX_DIAG_UID])[0]))


def _unix_attrs(data: bytes) -> dict[int, bytes]:
    """A unix_diag_msg's (or inet_diag_msg's) attributes: ``{type: payload}``."""
    out, pos = {}, 0
    while pos + RTATTR.size <= len(data):
        length, kind = RTATTR.unpack_from(data, pos)
        if length < RTATTR.size:
            break
        out[kind] = data[pos + RTATTR.size:pos + length]
        pos += (length + 3) & ~3
    return out
