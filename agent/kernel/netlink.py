"""Raw netlink, as the agent speaks it without pyroute2 where pyroute2 is too slow or lacks a message: the header,
the flags and message types, and the readers of messages and attributes (linux/netlink.h, linux/rtnetlink.h).

One place for what tcstats.py, htbclass.py, snapshot.py and sockdiag.py each wrote again.
Usage: ``for kind, seq, data, pos, length in messages(sock, "class dump"): ...``
"""
from __future__ import annotations

import socket
import struct

NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x300, 0x200, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWQDISC, RTM_NEWTCLASS, RTM_GETTCLASS, RTM_NEWTFILTER, RTM_GETTFILTER = 36, 40, 42, 44, 46
NLMSG_HDR = struct.Struct("=IHHII")  # struct nlmsghdr: length, type, flags, sequence, port
RTATTR = struct.Struct("=HH")  # struct rtattr: length, type
RECV_BYTES = 1 << 16
MAX_RECVS = 256  # a dump of a few hundred classes takes a few datagrams; a bound, never reached


def error_code(data: bytes, pos: int = 0) -> int:
    """The errno an NLMSG_ERROR message at ``data[pos:]`` carries (its header included; 0: an ack)."""
    return -struct.unpack_from("=i", data, pos + NLMSG_HDR.size)[0]


def attrs(data: bytes, pos: int, end: int):
    """``(type, value start, value end)`` of each netlink attribute in ``data[pos:end]`` (flags masked off)."""
    while pos + RTATTR.size <= end:
        length, kind = RTATTR.unpack_from(data, pos)
        if length < RTATTR.size or pos + length > end:
            return
        yield kind & 0x3FFF, pos + RTATTR.size, pos + length
        pos += (length + 3) & ~3


def messages(sock: socket.socket, what: str):
    """Every netlink message read from ``sock``, datagram after datagram (at most :data:`MAX_RECVS`), as ``(type,
    sequence, data, start, length)``; a truncated one raises OSError, ``what`` naming the request."""
    for _ in range(MAX_RECVS):
        data = sock.recv(RECV_BYTES)
        pos = 0
        while pos + NLMSG_HDR.size <= len(data):
            length, kind, _flags, seq, _port = NLMSG_HDR.unpack_from(data, pos)
            if length < NLMSG_HDR.size or pos + length > len(data):
                raise OSError(f"{what}: a truncated netlink message")
            yield kind, seq, data, pos, length
            pos += (length + 3) & ~3
