"""Which flows a process really owns, from the kernel's socket tables (/proc/PID/fd and /proc/PID/net/*).

A client may register only flows of its own sockets: a TCP flow must be an established connection of the
process with exactly that 5-tuple; a UDP flow needs a socket of the process bound to the source address and
port (connected to the destination, or not connected at all). Usage: ``owned_by(pid, flows)``
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from agent.protocol import FlowKey
from shim.flows import _socket_inodes, parse_proc_net_tcp

TCP_ESTABLISHED = 0x01
_TABLES = (("tcp", "tcp", False), ("tcp6", "tcp", True), ("udp", "udp", False), ("udp6", "udp", True))


def sockets_of(pid: int) -> list[tuple[str, str, int, str, int, int]]:
    """``(proto, laddr, lport, raddr, rport, state)`` of every TCP/UDP socket process ``pid`` holds.

    Raises ProcessLookupError when the process is gone.
    """
    try:
        inodes = _socket_inodes(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    out = []
    for table, proto, v6 in _TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                rows = parse_proc_net_tcp(fh.read(), v6)
        except FileNotFoundError:
            continue
        for inode, state, (laddr, lport), (raddr, rport) in rows:
            if inode and inode in inodes:
                out.append((proto, str(laddr), lport, str(raddr), rport, state))
    return out


def _unspecified(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_unspecified


def owns(key: FlowKey, sockets: Iterable[tuple]) -> bool:
    """Whether one of ``sockets`` (from ``sockets_of``) is the local end of flow ``key``."""
    for proto, laddr, lport, raddr, rport, state in sockets:
        if proto != key.proto or lport != key.sport:
            continue
        if key.proto == "tcp":
            if state == TCP_ESTABLISHED and (laddr, raddr, rport) == (key.src, key.dst, key.dport):
                return True
        elif laddr == key.src or _unspecified(laddr):
            if (raddr, rport) == (key.dst, key.dport) or (_unspecified(raddr) and rport == 0):
                return True
    return False


def not_owned(pid: int, flows: Iterable[FlowKey]) -> list[FlowKey]:
    """The flows among ``flows`` that process ``pid`` does not own (all of them if the process is gone)."""
    flows = list(flows)
    try:
        sockets = sockets_of(pid)
    except ProcessLookupError:
        return flows
    return [k for k in flows if not owns(k, sockets)]
