"""Change HTB classes' rates in place, with netlink messages built here.

The job policy's parts move several times a second, one class change each. pyroute2 computes two 256-entry rate
tables in Python for every HTB class it sends (``calc_rtab``): 65 % of an agent's CPU under a job order
(docs/jobs-measured.md, "What the machine moves"). The kernel's HTB (``htb_change_class``) reads those tables only
to tell the link layer of a rate that does not state it, as an old ``tc`` sent; the rates themselves are computed
from the rate. So a change here sends ``TCA_HTB_PARMS`` with the link layer set to Ethernet (what the kernel finds in
pyroute2's tables), ``TCA_HTB_RATE64``/``TCA_HTB_CEIL64`` where a rate does not fit in 32 bits, and no tables. The
bursts become psched ticks as pyroute2 and ``tc`` compute them (``calc_xmittime``). The classes are created by
pyroute2 (``HtbBackend.apply``); this only changes them.

Usage: ``change_classes(index, parent, [ClassRates(classid, rate, ceil, burst, cburst, quantum, prio)])``
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

from tensorlane.agent.kernel.netlink import (
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSG_HDR,
    RTM_NEWTCLASS,
    error_code,
    messages,
)
from tensorlane.agent.kernel.tcstats import TCMSG

TCA_KIND, TCA_OPTIONS = 1, 2
TCA_HTB_PARMS, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 6, 7
TC_LINKLAYER_ETHERNET = 1
U32_MAX = (1 << 32) - 1
# struct tc_htb_opt: two struct tc_ratespec {u8 cell_log, linklayer; u16 overhead; s16 cell_align; u16 mpu; u32 rate}
# (rate, ceil), then u32 buffer, cbuffer (psched ticks), quantum, level, prio
HTB_OPT = struct.Struct("=BBHhHI BBHhHI IIIII".replace(" ", ""))


@dataclass(frozen=True)
class ClassRates:
    """What a change sets: rates in bytes/s (as pyroute2 takes them), bursts in bytes."""

    classid: int
    rate: int
    ceil: int
    burst: int
    cburst: int
    quantum: int
    prio: int


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + bytes(-size % 4)


def change_message(index: int, parent: int, c: ClassRates, seq: int) -> bytes:
    """The ``RTM_NEWTCLASS`` request (acknowledged, no create flag: the class must exist) that sets ``c``."""
    opt = HTB_OPT.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(c.rate, U32_MAX),
                       0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(c.ceil, U32_MAX),
                       calc_xmittime(c.rate, c.burst), calc_xmittime(c.ceil, c.cburst), c.quantum, 0, c.prio)
    options = _attr(TCA_HTB_PARMS, opt)
    if c.rate > U32_MAX:
        options += _attr(TCA_HTB_RATE64, struct.pack("=Q", c.rate))
    if c.ceil > U32_MAX:
        options += _attr(TCA_HTB_CEIL64, struct.pack("=Q", c.ceil))
    body = (TCMSG.pack(socket.AF_UNSPEC, 0, 0, index, c.classid, parent, 0) + _attr(TCA_KIND, b"htb\0")
            + _attr(TCA_OPTIONS, options))
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), RTM_NEWTCLASS, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def change_classes(index: int, parent: int, classes: list[ClassRates], timeout_s: float = 5.0) -> None:
    """Change every class of ``classes`` (under ``parent`` on interface ``index``, in this process's network
    namespace) in place: one message each, all sent, then every answer read. Raises OSError naming the first class
    the kernel refused (the others may have changed: the agent's next full pass brings every class back)."""
    if not classes:
        return
    base = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    waiting = {base + i: c for i, c in enumerate(classes)}
    errors: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(timeout_s)
        for seq, c in waiting.items():
            sock.send(change_message(index, parent, c, seq))
        for kind, seq, data, pos, length in messages(sock, f"changing HTB classes on interface {index}"):
            if kind == NLMSG_ERROR and seq in waiting and length >= NLMSG_HDR.size + 4:
                code = error_code(data, pos)
                c = waiting.pop(seq)
                if code:
                    errors[c.classid] = code
                if not waiting:
                    break
    if waiting:
        raise OSError(f"changing HTB classes on interface {index}: no answer for {len(waiting)} of them")
    if errors:
        classid, err = next(iter(errors.items()))
        raise OSError(err, f"changing HTB class {classid >> 16:x}:{classid & 0xFFFF:x} on interface {index}: "
                           f"{os.strerror(err)}")
