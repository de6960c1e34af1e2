"""One TCP socket of the agent's network namespace by its 5-tuple, asked of the kernel (netlink sock_diag).

``/proc/self/net/tcp`` walks the whole TCP hash table (milliseconds on a host with much memory: 262,144
buckets here) and formats every socket as text; an exact ``SOCK_DIAG_BY_FAMILY`` request (no dump flag) is one
hash lookup in the kernel, answered with the socket's state and inode. The netlink socket lives in the agent's
network namespace, so a socket of another namespace is never found. Usage::

    diag = SockDiag()
    found = diag.tcp("198.18.0.1", 41000, "198.18.0.2", 29500)   # (state, inode) or None
"""
from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI")  # inet_diag_req_v2 head: family, protocol, ext, pad, states
_ID = struct.Struct(">HH16s16s")  # inet_diag_sockid head: sport, dport (big-endian), src, dst
_ID_TAIL = struct.Struct("=III")  # if, cookie[2]
_MSG_STATE = _HDR.size + 1  # inet_diag_msg: family, state, ...
_MSG_INODE = _HDR.size + 4 + 48 + 16  # ... after timer, retrans, the sockid, expires, rqueue, wqueue, uid


def _addr16(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return addr.packed.ljust(16, b"\0")


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

    def tcp(self, src: str, sport: int, dst: str, dport: int) -> tuple[int, int] | None:
        """``(state, inode)`` of the TCP socket whose local end is ``src:sport`` and remote end ``dst:dport``, or
        None if this namespace has none. An IPv4 flow is also looked for as a dual-stack (v4-mapped) socket.
        Raises OSError when the kernel cannot answer (no sock_diag): the caller falls back to the tables."""
        s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
        found = self._lookup(socket.AF_INET if s.version == 4 else socket.AF_INET6, s, sport, d, dport)
        if found is None and s.version == 4:
            s6, d6 = (ipaddress.IPv6Address("::ffff:" + str(a)) for a in (s, d))
            found = self._lookup(socket.AF_INET6, s6, sport, d6, dport)
        return found

    def _lookup(self, family: int, src, sport: int, dst, dport: int) -> tuple[int, int] | None:
        seq = next(self._seq)
        body = (_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
                + _ID.pack(sport, dport, _addr16(src), _addr16(dst))
                + _ID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
        sock = self._socket()
        sock.send(_HDR.pack(_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body)
        while True:
            data = sock.recv(65536)
            length, kind, _flags, got_seq, _pid = _HDR.unpack_from(data)
            if got_seq != seq:  # a late answer to an earlier request that timed out
                continue
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, _HDR.size)[0]
                if code in (errno.ENOENT, 0):
                    return None
                raise OSError(code, f"sock_diag: {errno.errorcode.get(code, code)}")
            if kind != SOCK_DIAG_BY_FAMILY or length < _MSG_INODE + 4:
                raise OSError(errno.EPROTO, f"sock_diag: unexpected answer type {kind}")
            return data[_MSG_STATE], struct.unpack_from("=I", data, _MSG_INODE)[0]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
