"""Which flows a process really owns, decided in the network namespace the agent manages (its own).

A client may register only flows of its own sockets: a TCP flow must be an established connection of the
process with exactly that 5-tuple; a UDP flow needs a socket of the process bound to the source address and
port, or to the wildcard address of the flow's family (``0.0.0.0`` for IPv4, ``::`` for IPv6), connected to the
destination or not connected at all. "Its own sockets" are the ``socket:[INODE]``
links in ``/proc/PID/fd``; they count only if they are sockets of the AGENT's network namespace: asked of the
kernel by 5-tuple through the agent's own sock_diag socket (``agent/kernel/sockdiag.py``), or found in that
namespace's tables (``/proc/self/net/tcp{,6}`` read by the agent; the sweep reads them at most once per pass);
UDP sockets by exact sock_diag lookups or port dumps (``udp_sockets``). A client may name the fd that holds each
flow's socket (``fds``): then only ``/proc/PID/fd/N`` of those fds is read, whatever its count of open files.
A socket created in another namespace never appears there,
whatever that namespace's own tables say: a process in a private namespace that gives its loopback the host's
addresses and opens another job's 5-tuple owns nothing here. ``/proc/PID/net/*`` (the client's view) is never
read. ``netns_of`` names a namespace (device and inode of ``/proc/PID/ns/net``) so that a client in another
namespace can be told so plainly (docs/agent.md, "Ownership and namespaces").

Usage::

    if netns_of(pid) != netns_of("self"): refuse
    foreign = not_owned(pid, flows)                       # one client: exact kernel lookups (sock_diag)
    foreign = not_owned(pid, flows, fds={flow: fd, ...})  # the client named each flow's fd: only those are read
    gone = not_owned_by_owners({pid: flows, ...}, fd_of=table_fd)  # the sweep: the same, the TCP tables at most once
    keep = still_sending(gone, uid_of)                    # closed, its user's kernel socket still sends: kept
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import random
import socket
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping

from tensorlane.agent.kernel.sockdiag import SockDiag, UdpSocket
from tensorlane.agent.peers import account_uid
from tensorlane.flows import TCP_ESTABLISHED, FlowKey, TooManyFiles, parse_proc_net_tcp, socket_fds, socket_inodes

log = logging.getLogger("tensorlane.ownership")
TCP_LISTEN = 0x0A
# closed by every process that held it, the kernel still sends its queued bytes and FIN (FIN_WAIT1, LAST_ACK, CLOSING)
TCP_CLOSED_SENDING = frozenset({0x04, 0x09, 0x0B})
# A process that owns flows has its open files read (a readlink each, 3-8 us) at each register and sweep: one with
# a million of them (RLIMIT_NOFILE allows it) stalled the agent's loop for seconds at each. At most MAX_OWNER_FDS of
# one process are read (a register from a process with more is refused ``limit``), at most SWEEP_FDS in one sweep.
MAX_OWNER_FDS = 8192
SWEEP_FDS = 32768
UDP_PORT_DUMPS = 4  # port dumps (``udp_sockets``) per register or sweep, where an exact lookup did not decide
EXACT_LOOKUPS_MAX = 256  # up to this many TCP flows, exact lookups whatever the tables hold
ROWS_PER_LOOKUP = 3  # one exact lookup (~12 us) costs about what 3 rows of the text tables do (~4 us each)
_DIAG = SockDiag()  # the agent's namespace: a socket of another one is never found
atexit.register(_DIAG.close)  # (its socket, opened at first use, is not left to the interpreter's exit)
_TABLES = (("tcp", "tcp", False), ("tcp6", "tcp", True), ("udp", "udp", False), ("udp6", "udp", True))

Socket = tuple[str, str, int, str, int, int]  # (proto, laddr, lport, raddr, rport, state)


class UndecidedPorts(Exception):
    """A register's UDP flows needed more port dumps than ``UDP_PORT_DUMPS`` to be judged: none is taken as another
    user's, and the client is told to register them in several requests."""


class SharedPort(Exception):
    """A UDP flow's source port is shared (SO_REUSEADDR) with a socket another user made that owns the flow too:
    ``args`` = (the flow, that socket's user)."""


class NotLocal(Exception):
    """A UDP flow's source is no address of the agent's network namespace: ``args`` = (the flow,)."""


NetnsId = tuple[int, int]


def netns_of(pid: int | str) -> NetnsId:
    """Identity of the network namespace of process ``pid`` ("self": the agent): (st_dev, st_ino) of its
    ``/proc/PID/ns/net``. Raises ProcessLookupError when the process is gone."""
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    return st.st_dev, st.st_ino


def agent_sockets(inodes: set[int] | None = None, proc: str = "self",
                  protos: tuple[str, ...] = ("tcp", "udp")) -> dict[int, Socket]:
    """The TCP/UDP sockets of the agent's network namespace by inode (``/proc/self/net/*``); only those in
    ``inodes`` when given (rows of other sockets are skipped unparsed), of ``protos``. ``proc`` is for tests."""
    out: dict[int, Socket] = {}
    if inodes is not None and not inodes:
        return out
    for proto, v6, text in _tables(proc, protos):
        for inode, state, (laddr, lport), (raddr, rport) in parse_proc_net_tcp(text, v6, inodes):
            if inode:  # 0: TIME_WAIT and other orphans, owned by no process
                out[inode] = (proto, str(laddr), lport, str(raddr), rport, state)
    return out


def listening_uids(port: int, proc: str = "self") -> set[int]:
    """The uids of the users that made the TCP sockets listening on ``port`` in the agent's network namespace
    (``/proc/self/net/tcp{,6}``). ``proc`` is for tests."""
    uids: set[int] = set()
    for _proto, v6, text in _tables(proc, ("tcp",)):
        uid_of: dict[int, int] = {}
        rows = parse_proc_net_tcp(text, v6, uids=uid_of)
        uids |= {uid_of[inode] for inode, state, (_, lport), _ in rows if state == TCP_LISTEN and lport == port}
    return uids


def _tables(proc: str, protos: tuple[str, ...]) -> Iterator[tuple[str, bool, str]]:
    """``(proto, v6, text)`` of each socket table of ``protos`` in ``/proc/PROC/net`` (a table this kernel lacks,
    IPv6's, is left out)."""
    for table, proto, v6 in _TABLES:
        if proto not in protos:
            continue
        try:
            with open(f"/proc/{proc}/net/{table}") as fh:
                text = fh.read()
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        yield proto, v6, text


def tcp_rows(proc: str = "self") -> int:
    """How many rows the TCP tables of the agent's namespace hold now: sockets in use and in TIME_WAIT, from
    ``/proc/self/net/sockstat{,6}`` (a few counters, not a walk of the tables). ``proc`` is for tests."""
    total = 0
    for name in ("sockstat", "sockstat6"):
        try:
            with open(f"/proc/{proc}/net/{name}") as fh:
                lines = [line.split() for line in fh if line.startswith(("TCP:", "TCP6:"))]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for f in lines:
            total += sum(int(f[i + 1]) for i in range(1, len(f) - 1, 2) if f[i] in ("inuse", "tw"))
    return total


def lookups_cheaper(count: int) -> bool:
    """Whether ``count`` exact sock_diag lookups cost less than one read of the namespace's TCP tables: always
    up to ``EXACT_LOOKUPS_MAX``, beyond that while the tables hold ``ROWS_PER_LOOKUP`` rows per flow or more (on a
    busy host a sweep's cost then grows with the registered flows, never with the host's sockets)."""
    return count <= EXACT_LOOKUPS_MAX or count * ROWS_PER_LOOKUP <= tcp_rows()


def inodes_of(pid: int, files: list[int] | None = None, uid: int | None = None) -> set[int]:
    """Inodes of the sockets process ``pid`` holds (``files`` gets how many open files were read); with ``uid``, only
    those that user made (``made_by``: one stat per socket). Raises ProcessLookupError when the process is gone,
    TooManyFiles when it holds more than ``MAX_OWNER_FDS`` open files."""
    try:
        if uid is None:
            return socket_inodes(pid, MAX_OWNER_FDS, files)
        return set(fds_of(pid, uid, files))
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None


def fds_of(pid: int, uid: int | None = None, files: list[int] | None = None) -> dict[int, int]:
    """``{inode: fd}`` of the sockets process ``pid`` holds (its lowest fd per socket); with ``uid``, only those that
    user made (``made_by``). ``files`` gets how many open files were read. Raises as ``inodes_of``."""
    try:
        found = socket_fds(pid, MAX_OWNER_FDS, files)
        return found if uid is None else {inode: fd for inode, fd in found.items() if made_by(pid, fd, uid) == inode}
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None


def made_by(pid: int, fd: int, uid: int) -> int | None:
    """The inode of the socket on fd ``fd`` of process ``pid`` if user ``uid`` made it (the socket's owner, the
    file-system uid of the process that created it, is ``uid`` or a uid of ``uid``'s subordinate range:
    ``account_uid``), else None (another user's socket, not a socket, closed, or the process is gone). One readlink
    and one stat that asks no file system (``stat_cached``).

    A process may hold a socket another user made: a setuid program it exec'd after connecting to the agent (the
    connection's credentials stay its user's), an fd a root service leaked into it, one passed to it. Its user may
    not register that socket's flows: they are that other user's traffic."""
    inode = fd_inode(pid, fd)  # (no file system is asked: a file that is not a socket is refused unlooked-at)
    if inode is None:
        return None
    st = stat_cached(f"/proc/{pid}/fd/{fd}")
    if st is None or not stat.S_ISSOCK(st[0]) or st[2] != inode or account_uid(st[1]) != uid:
        return None  # (a file put at the fd since the readlink is not looked at either)
    return inode


def socket_users(pid: int, fds: Mapping[FlowKey, int], uid: int | None) -> dict[FlowKey, int]:
    """The user that made the socket on each flow's fd (``fds``) of process ``pid``, for its UDP flows: the uid the
    kernel sees as the socket's (``meta skuid``: the file-system uid of the process that created it), which is
    ``uid``'s own or one of its subordinate range (``account_uid``; ``uid`` None: root's register, any). A flow
    whose fd holds no socket of that user now is left out. One cached stat per fd, whatever the flows."""
    seen: dict[int, int | None] = {}
    out: dict[FlowKey, int] = {}
    for k, fd in fds.items():
        if k.proto != "udp":
            continue
        if fd not in seen:
            st = stat_cached(f"/proc/{pid}/fd/{fd}")
            ok = st is not None and stat.S_ISSOCK(st[0]) and (uid is None or account_uid(st[1]) == uid)
            seen[fd] = st[1] if ok else None
        if seen[fd] is not None:
            out[k] = seen[fd]
    return out


_STATX_MASK = 0x1 | 0x2 | 0x8 | 0x100  # STATX_TYPE | STATX_MODE | STATX_UID | STATX_INO
_AT_STATX_DONT_SYNC = 0x4000


def _libc_statx():
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    return fn


_STATX = _libc_statx()


def stat_cached(path: str) -> tuple[int, int, int] | None:
    """(mode, uid, inode) of the file ``path`` leads to, from the kernel's cached attributes (``statx`` with
    ``AT_STATX_DONT_SYNC``), or None where it cannot be read. A plain ``stat`` of ``/proc/PID/fd/N`` follows the
    link to whatever file a client put there; on a FUSE file system (``fusermount3`` lets any user mount one) it
    waits for that user's daemon to answer, for ever: the agent's one loop stopped, SIGTERM included, until a
    SIGKILL. Without ``statx`` in libc: a plain ``stat``."""
    if _STATX is None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_mode, st.st_uid, st.st_ino
    buf = ctypes.create_string_buffer(256)  # struct statx
    if _STATX(-100, path.encode(), _AT_STATX_DONT_SYNC, _STATX_MASK, buf) != 0:  # (AT_FDCWD)
        return None
    mode = int.from_bytes(buf.raw[28:30], sys.byteorder)
    return mode, int.from_bytes(buf.raw[20:24], sys.byteorder), int.from_bytes(buf.raw[32:40], sys.byteorder)


_UNSPECIFIED = frozenset({"0.0.0.0", "::"})  # as the socket tables' addresses are written (str of an ip_address)


def _unspecified(addr: str) -> bool:
    """Whether ``addr``, an address of the socket tables (``agent_sockets``: canonical text), is unspecified. A
    string compare: parsing it per flow and socket was half of a sweep's cost (a user's one UDP socket can own
    ``max_flows_per_user`` flows)."""
    return addr in _UNSPECIFIED


def _by_port(sockets: Iterable[Socket]) -> dict[tuple[str, int], list[Socket]]:
    index: dict[tuple[str, int], list[Socket]] = {}
    for sock in sockets:
        index.setdefault((sock[0], sock[2]), []).append(sock)
    return index


def _wildcard_of(laddr: str, src: str) -> bool:
    """Whether ``laddr`` is the wildcard address of ``src``'s family: ``0.0.0.0`` for an IPv4 source, ``::`` for
    an IPv6 one. A wildcard of the other family is not (an IPv4 socket bound to ``0.0.0.0:P`` sends no IPv6; an
    IPv6 one bound to ``[::]:P`` sends IPv4 only when it is not IPV6_V6ONLY, which the tables do not say): with
    any wildcard, a user's socket on port P owned every UDP flow of port P of the other family, so it could
    register another user's flow (a socket of that family on the same port, which the kernel lets coexist) at the
    least urgent level first, and the owner's own registration was refused ``conflict``."""
    return _unspecified(laddr) and (":" in laddr) == (":" in src)


def _owns(key: FlowKey, candidates: Iterable[Socket]) -> bool:
    for proto, laddr, lport, raddr, rport, state in candidates:
        if proto != key.proto or lport != key.sport:
            continue
        if key.proto == "tcp":
            if state == TCP_ESTABLISHED and (laddr, raddr, rport) == (key.src, key.dst, key.dport):
                return True
        elif (laddr == key.src or _wildcard_of(laddr, key.src)) and (
                (raddr, rport) == (key.dst, key.dport) or (_unspecified(raddr) and rport == 0)):
            return True
    return False


def owns(key: FlowKey, sockets: Iterable[Socket]) -> bool:
    """Whether one of ``sockets`` (from ``sockets_of``) is the local end of flow ``key``."""
    return _owns(key, sockets)


def _unowned(flows: Iterable[FlowKey], sockets: list[Socket]) -> list[FlowKey]:
    index = _by_port(sockets)
    return [k for k in flows if not _owns(k, index.get((k.proto, k.sport), ()))]


def _tcp_unowned(flows_of: Mapping[int, list[FlowKey]], held: Mapping[int, set[int]],
                 held_at: dict[FlowKey, int] | None = None) -> dict[int, list[FlowKey]]:
    """For each pid of ``flows_of``, its TCP flows not held by a socket among ``held[pid]``: one exact sock_diag
    lookup per flow, all owners' lookups sent together in batches (raises OSError when the kernel cannot answer).
    ``held_at`` gets the inode of each held flow's socket."""
    pairs = [(pid, k) for pid, fl in flows_of.items() for k in fl if k.proto == "tcp"]
    found = _DIAG.tcp_many([(k.src, k.sport, k.dst, k.dport) for _, k in pairs]) if pairs else []
    out: dict[int, list[FlowKey]] = {pid: [] for pid in flows_of}
    for (pid, k), f in zip(pairs, found, strict=True):
        if f is None or f[0] != TCP_ESTABLISHED or f[1] not in held[pid]:
            out[pid].append(k)
        elif held_at is not None:
            held_at[k] = f[1]
    return out


def udp_sockets(flows: Iterable[FlowKey], inodes: set[int], undecided: set,
                own: Mapping[FlowKey, set[int]] | None = None) -> dict[int, Socket]:
    """The UDP sockets among ``inodes`` that may own ``flows`` (UDP flows), by inode, asked of the kernel: first
    one exact sock_diag lookup per flow (the socket that receives what the flow's destination sends to its
    source: a hash lookup, about 10 us, whatever the namespace's sockets); where that socket is not one of
    ``inodes`` or does not own the flow by the UDP rule (a dual-stack ``[::]`` socket is found for an IPv4 flow,
    and owns none), the sockets of the flow's source port, by a dump filtered by port in the kernel (it walks the
    namespace's UDP sockets in the kernel: about 2 ms at 19,000; at most ``UDP_PORT_DUMPS`` per call, so a user
    registering other users' flows cannot make a call cost more; which ports are dumped is drawn at random, so
    that a sweep comes to every port in turn). ``undecided`` gets the (family, port) of the ports not dumped: their
    flows are neither owned nor unowned yet. ``own``: the sockets of each flow's owner where ``inodes`` holds
    several owners' (a sweep): the lookup's socket decides a flow only if it is its owner's. The namespace's UDP
    tables are read instead only when the kernel cannot answer (no ``udp_diag``)."""
    out: dict[int, Socket] = {}
    if not inodes:
        return out
    try:
        wanted = set()
        found: dict[int, list[tuple[int, Socket]]] = {}  # port -> (inode, row) of the sockets found so far
        for k in flows:
            mine = inodes if own is None else own[k]
            if any(i in mine and _owns(k, [row]) for i, row in found.get(k.sport, ())):
                continue  # decided by a socket already found (one user socket may own 50,000 flows: a lookup each
                # made a sweep of them take 1-2 s, every SWEEP_S, and root's requests waited behind it)
            u = _DIAG.udp(k.src, k.sport, k.dst, k.dport)
            if u is not None and u.inode in mine and _owns(k, [_udp_row(u)]):
                if u.inode not in out:
                    found.setdefault(u.lport, []).append((u.inode, _udp_row(u)))
                out[u.inode] = _udp_row(u)
            else:
                wanted.add((socket.AF_INET6 if ":" in k.src else socket.AF_INET, k.sport))
        asks = sorted({(socket.AF_INET6, port) for _, port in wanted} | {w for w in wanted if w[0] == socket.AF_INET})
        if len(asks) > UDP_PORT_DUMPS:
            dumped = set(random.sample(asks, UDP_PORT_DUMPS))
            undecided.update(a for a in asks if a not in dumped)
            asks = sorted(dumped)
        for family, port in asks:
            for u in _DIAG.udp_port(family, port):
                if u.inode in inodes:
                    out[u.inode] = _udp_row(u)
    except OSError:  # no udp_diag here: read the tables
        return agent_sockets(inodes, protos=("udp",))
    return out


def is_local(addr: str) -> bool:
    """Whether ``addr`` is an address of the agent's network namespace (a bind to it, port 0, without IP_FREEBIND,
    succeeds: about 10 us). A UDP socket on the wildcard owns the flows of its port from any source by the UDP rule,
    and the maps are looked up in postrouting, which forwarded packets pass too: a user registered a flow from a
    container's or another host's address and the packets the host forwards with that 5-tuple took its level."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((addr, 0))
    except OSError:
        return False
    return True


def shared_with(flows: Iterable[FlowKey], uid: int) -> tuple[FlowKey, int] | None:
    """The first UDP flow of ``flows`` (owned by a socket user ``uid`` made) that a socket another user made owns
    too, with that user, or None. Linux lets two users' UDP sockets share a port when both set SO_REUSEADDR (no uid
    check, unlike SO_REUSEPORT): both own every flow of the port by the UDP rule and their packets carry the same
    5-tuple, so a register of one user's would give the other's traffic the level of its choice. One port dump per
    (family, port), at most ``UDP_PORT_DUMPS`` (UndecidedPorts beyond); without udp_diag, the tables."""
    udp = [k for k in flows if k.proto != "tcp"]
    # (an IPv4 flow's port in both families: a dual-stack IPv6 wildcard socket sends that flow's datagrams too), and
    # of each, only the sockets bound to a flow's source or the wildcard, filtered in the kernel: another user may
    # hold thousands on the port bound to other addresses, which own none of the flows
    ports: dict[tuple[int, int], set[tuple[int, str]]] = {}
    for k in udp:
        if ":" in k.src:
            ports.setdefault((socket.AF_INET6, k.sport), set()).update({(socket.AF_INET6, k.src),
                                                                         (socket.AF_INET6, "::")})
        else:
            ports.setdefault((socket.AF_INET, k.sport), set()).update({(socket.AF_INET, k.src),
                                                                        (socket.AF_INET, "0.0.0.0")})
            ports.setdefault((socket.AF_INET6, k.sport), set()).update({(socket.AF_INET, k.src),
                                                                         (socket.AF_INET6, "::")})
    if not ports:
        return None
    if len(ports) > UDP_PORT_DUMPS:
        raise UndecidedPorts(len(ports))
    me = account_uid(uid)
    try:
        others = [(row, u.uid) for (family, port), addrs in sorted(ports.items())
                  for u in _DIAG.udp_port(family, port, sorted(addrs))
                  if u.uid >= 0 and account_uid(u.uid) != me for row in _dual_stack_rows(u)]
    except OSError:  # no udp_diag here: the tables (their uid column)
        others = [(row, owner) for row, owner in _udp_table_uids({p for _, p in ports}) if account_uid(owner) != me]
    # by (local address, remote end): each flow looks up the 4 ends that own it, not every socket (another user may
    # hold thousands on the port, bound elsewhere, owning none: flows x sockets was seconds of the agent's loop)
    index: dict[tuple[str, str | None, int], int] = {}
    for (_, laddr, _, raddr, rport, _), owner in others:
        wild = _unspecified(laddr)
        index.setdefault(("*" + (":" if ":" in laddr else "") if wild else laddr,
                          None if _unspecified(raddr) and rport == 0 else raddr, rport), owner)
    for k in udp:
        wild = "*" + (":" if ":" in k.src else "")
        for local in (k.src, wild):
            for end in ((k.dst, k.dport), (None, 0)):
                if (local, *end) in index:
                    return k, index[local, *end]
    return None


def _dual_stack_rows(u: UdpSocket) -> list[Socket]:
    """``u``'s row, and for an IPv6 wildcard socket without IPV6_V6ONLY, which sends IPv4 datagrams too, a row as
    the IPv4 wildcard (for ``shared_with`` only: the UDP rule lets no one register an IPv4 flow of ``[::]``)."""
    row = _udp_row(u)
    if u.laddr == "::" and not u.v6only and u.raddr in ("::", "0.0.0.0"):
        return [row, ("udp", "0.0.0.0", *row[2:])]
    return [row]


def _udp_table_uids(ports: set[int]) -> list[tuple[Socket, int]]:
    """The UDP sockets of the agent's namespace on ``ports`` with their users, from ``/proc/self/net/udp{,6}``."""
    out = []
    for name, _, v6 in _TABLES[2:]:
        try:
            with open(f"/proc/self/net/{name}") as f:
                text = f.read()
        except OSError:
            continue
        uids = {}
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 10 and fields[9].isdigit() and fields[7].isdigit():
                uids[int(fields[9])] = int(fields[7])
        for inode, state, (laddr, lport), (raddr, rport) in parse_proc_net_tcp(text, v6):
            if lport in ports and inode in uids:
                out.append((("udp", str(laddr), lport, str(raddr), rport, state), uids[inode]))
    return out


def _udp_row(u: UdpSocket) -> Socket:
    return ("udp", u.laddr, u.lport, u.raddr, u.rport, u.state)


def _undecided(k: FlowKey, undecided: set) -> bool:
    """Whether UDP flow ``k``'s port was not dumped (``udp_sockets``): a dual-stack socket may hold it by IPv6."""
    return k.proto != "tcp" and bool(undecided) and (
        (socket.AF_INET6 if ":" in k.src else socket.AF_INET, k.sport) in undecided
        or (socket.AF_INET6, k.sport) in undecided)


def fd_inode(pid: int, fd: int) -> int | None:
    """The inode of the socket on file descriptor ``fd`` of process ``pid`` (``/proc/PID/fd/FD`` is
    ``socket:[INODE]``); None where that fd is closed, is not a socket, or the process is gone. One readlink,
    whatever the number of the process's open files."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    if target.startswith("socket:[") and target.endswith("]"):
        return int(target[8:-1])
    return None


def _unowned_by_fd(entries: list[tuple[int, FlowKey, int]], undecided: set, uid: int | None = None,
                   uid_of: Callable[[FlowKey], int | None] | None = None) -> list[int]:
    """Indexes of ``entries`` (pid, flow, fd) whose fd does not hold the flow's socket in the agent's namespace: the
    fd must be a socket (one readlink) that is, for TCP, the established socket of that 5-tuple (an exact sock_diag
    lookup gives its inode), for UDP, a socket of the flow's source port (a port dump) that owns the flow by the UDP
    rule (``_owns``). O(1) per flow, whatever the process's open files or the namespace's sockets. UDP flows whose
    port was not dumped are in neither (``undecided``). ``uid``: the fd must hold a socket that user made
    (``made_by``: a stat instead of the readlink); ``uid_of``: the same, each flow's user (None: any socket)."""
    seen: dict[tuple[int, int, int | None], int | None] = {}  # -> the fd's inode: one look per fd, however many flows

    def inode(pid: int, fd: int, user: int | None) -> int | None:
        if (pid, fd, user) not in seen:
            seen[pid, fd, user] = fd_inode(pid, fd) if user is None else made_by(pid, fd, user)
        return seen[pid, fd, user]

    inodes = [inode(pid, fd, uid if uid_of is None else uid_of(k)) for pid, k, fd in entries]
    bad = {i for i, n in enumerate(inodes) if n is None}
    tcp = [i for i, (_, k, _) in enumerate(entries) if k.proto == "tcp" and i not in bad]
    udp = [i for i, (_, k, _) in enumerate(entries) if k.proto != "tcp" and i not in bad]
    try:
        found = _DIAG.tcp_many([(entries[i][1].src, entries[i][1].sport, entries[i][1].dst, entries[i][1].dport)
                                for i in tcp]) if tcp else []
        bad |= {i for i, f in zip(tcp, found, strict=True)
                if f is None or f[0] != TCP_ESTABLISHED or f[1] != inodes[i]}
    except OSError:  # no sock_diag here: the tables, for those sockets only
        table = agent_sockets({inodes[i] for i in tcp}, protos=("tcp",))
        bad |= {i for i in tcp if not _owns(entries[i][1], [table[inodes[i]]] if inodes[i] in table else [])}
    rows = udp_sockets([entries[i][1] for i in udp], {inodes[i] for i in udp}, undecided,
                       {entries[i][1]: {inodes[i]} for i in udp})
    bad |= {i for i in udp if not _owns(entries[i][1], [rows[inodes[i]]] if inodes[i] in rows else [])
            and not _undecided(entries[i][1], undecided)}
    return sorted(bad)


def not_owned(pid: int, flows: Iterable[FlowKey], table: Mapping[int, Socket] | None = None,
              fds: Mapping[FlowKey, int] | None = None, uid: int | None = None,
              found: dict[FlowKey, int] | None = None, files: list[int] | None = None,
              exclusive: bool = False) -> list[FlowKey]:
    """The flows among ``flows`` that process ``pid`` does not own in the agent's network namespace (all of them
    if the process is gone). ``fds``: the client's word for which fd of the process holds each flow's socket: only
    that fd is looked at (``_unowned_by_fd``), and none of the process's other open files are read (no
    ``MAX_OWNER_FDS``). Otherwise the process's open files are read (TooManyFiles above ``MAX_OWNER_FDS``); TCP
    flows are looked up one by one in the kernel (sock_diag: a hash lookup, about 10 us) when that is cheaper
    (``lookups_cheaper``), else the namespace's TCP tables are read (milliseconds: the kernel walks its whole hash
    table and prints every socket); UDP flows, by a port dump (``udp_sockets``). Raises UndecidedPorts where UDP
    flows of more ports than ``UDP_PORT_DUMPS`` could not be judged. ``uid``: only sockets that user made count
    (``made_by``), not those of another user the process holds. ``found`` (without ``fds``) gets the fd that holds
    each owned flow's socket: the sweep then checks that fd alone (``not_owned_by_owners``), as if the client had
    named it. ``files`` gets how many open files of the process were read (none with ``fds``). ``exclusive`` (a
    register, with ``uid``): raises SharedPort for an owned UDP flow another user's socket owns too
    (``shared_with``), NotLocal for an owned UDP flow whose source is no address of the agent's namespace
    (``is_local``)."""
    flows = list(flows)
    foreign = _not_owned(pid, flows, table, fds, uid, found, files)
    if exclusive and uid is not None:
        unowned = set(foreign)
        owned = [k for k in flows if k not in unowned]
        local = {src: is_local(src) for src in {k.src for k in owned if k.proto != "tcp"}}  # (a bind per address)
        away = next((k for k in owned if k.proto != "tcp" and not local[k.src]), None)
        if away is not None:
            raise NotLocal(away)
        shared = shared_with(owned, uid)
        if shared is not None:
            raise SharedPort(*shared)
    return foreign


def _not_owned(pid: int, flows: list[FlowKey], table: Mapping[int, Socket] | None,
               fds: Mapping[FlowKey, int] | None, uid: int | None,
               found: dict[FlowKey, int] | None, files: list[int] | None) -> list[FlowKey]:
    """``not_owned`` without its ``exclusive`` check."""
    undecided: set = set()
    if fds is not None:
        foreign = [flows[i] for i in _unowned_by_fd([(pid, k, fds[k]) for k in flows], undecided, uid)]
        if undecided:
            raise UndecidedPorts(len({port for _, port in undecided}))
        return foreign
    try:
        fd_at = fds_of(pid, uid, files)
    except ProcessLookupError:
        return flows
    inodes = set(fd_at)
    if table is None:
        tcp = [k for k in flows if k.proto == "tcp"]
        udp = [k for k in flows if k.proto != "tcp"]
        foreign = None
        tcp_at: dict[FlowKey, int] = {}  # (the exact lookups' inode of each owned TCP flow's socket)
        if not tcp or lookups_cheaper(len(tcp)):
            with contextlib.suppress(OSError):  # no sock_diag here: read the tables
                foreign = _tcp_unowned({pid: tcp}, {pid: inodes}, tcp_at)[pid] if tcp else []
        tcp_rows: dict[int, Socket] = {}
        if foreign is None:  # the TCP tables only: the UDP flows by port dumps, as above (the UDP table was read here
            # too: a register of 257 TCP flows and one UDP flow read all of it, 660 ms at 19,000 UDP sockets)
            tcp_rows = agent_sockets(inodes, protos=("tcp",))
            foreign = _unowned(tcp, [tcp_rows[i] for i in inodes if i in tcp_rows])
        udp_rows: dict[int, Socket] = {}
        if udp:
            udp_rows = udp_sockets(udp, inodes, undecided)
            if undecided:
                raise UndecidedPorts(len({port for _, port in undecided}))
            foreign += _unowned(udp, [udp_rows[i] for i in inodes if i in udp_rows])
        if found is not None:
            unowned = set(foreign)
            _found_fds([k for k in flows if k not in unowned], fd_at, tcp_at, {**tcp_rows, **udp_rows}, found)
        return foreign
    return _unowned(flows, [table[i] for i in inodes if i in table])


def _found_fds(owned: list[FlowKey], fd_at: Mapping[int, int], tcp_at: Mapping[FlowKey, int],
               rows: Mapping[int, Socket], found: dict[FlowKey, int]) -> None:
    """Fill ``found`` with the fd (``fd_at``: inode -> the process's fd) that holds each of ``owned``'s sockets:
    the inode :func:`not_owned` found for it, by the exact TCP lookup (``tcp_at``) or among the sockets it read
    (``rows``, by inode: the TCP tables where it read them, the UDP sockets that may own the flows), the first that
    owns the flow. A flow whose socket cannot be told is left out (the sweep then reads the process's open files for
    it, as before)."""
    by_port = _by_port_inodes(rows)
    for k in owned:
        inode = tcp_at.get(k)
        if inode is None:
            inode = next((i for i in by_port.get((k.proto, k.sport), ()) if i in fd_at and _owns(k, [rows[i]])), None)
        if inode is not None and inode in fd_at:
            found[k] = fd_at[inode]


def _by_port_inodes(rows: Mapping[int, Socket]) -> dict[tuple[str, int], list[int]]:
    """The inodes of ``rows`` (inode -> socket) by protocol and local port, as :func:`_by_port` indexes sockets."""
    index: dict[tuple[str, int], list[int]] = {}
    for inode, sock in rows.items():
        index.setdefault((sock[0], sock[2]), []).append(inode)
    return index


def not_owned_by_owners(owners: Mapping[int, Iterable[FlowKey]], read: list[int] | None = None,
                        fd_of: Callable[[FlowKey], int | None] | None = None,
                        uid_of: Callable[[FlowKey], int | None] | None = None) -> list[FlowKey]:
    """For the periodic sweep: every flow of ``owners`` (pid -> its flows) whose owner no longer holds its socket
    in the agent's namespace (closed, or the process is gone). A flow registered with its fd (``fd_of`` gives it,
    None for one without) is judged by that fd alone (``_unowned_by_fd``: an fd closed, or reused by another
    socket, is not the flow's). For the others, each owner's ``/proc/PID/fd`` is read once (an owner that holds
    more than ``MAX_OWNER_FDS`` open files loses them: the agent does not read so many), in the order of
    ``owners``, until ``SWEEP_FDS`` open files (fds of flows count one each) were read (``read`` gets the pids
    judged; the others wait for a later pass); the TCP flows are looked up one by one while that is cheaper
    (``lookups_cheaper``), else the namespace's TCP tables are read once for all owners; UDP flows by port dumps
    (``udp_sockets``; those of ports beyond ``UDP_PORT_DUMPS`` are kept, for a later pass): the cost never grows
    with owners x sockets. ``uid_of``: the user each flow must be held by a socket of (``made_by``, as at its
    register: None, root's, any socket): a socket of another user's put in its place (same 5-tuple, at the fd or,
    for a flow without one, anywhere in the process) does not keep it; until 2026-11-28 it did."""
    undecided: set = set()
    gone: list[FlowKey] = []
    held: dict[int, set[int]] = {}
    by_fd: list[tuple[int, FlowKey, int]] = []
    flows_of: dict[int, list[FlowKey]] = {}
    spent = 0
    for pid, flows in owners.items():
        if spent >= SWEEP_FDS:
            break
        rest = []
        for k in flows:
            fd = fd_of(k) if fd_of is not None else None
            if fd is None:
                rest.append(k)
            else:
                by_fd.append((pid, k, fd))
                spent += 1
        if rest:
            files: list[int] = []
            users = {uid_of(k) for k in rest} if uid_of is not None else {None}
            try:  # (one user's flows, as a process's are: only its sockets; several (root's too): any, as before)
                held[pid] = inodes_of(pid, files, next(iter(users)) if len(users) == 1 else None)
                flows_of[pid] = rest
                spent += files[0] + 1  # (its open files read, sockets or not: counting its sockets let 512 owners
                # of 8,192 other files each cost 4 million readlinks in one pass)
            except ProcessLookupError:
                gone += rest
            except TooManyFiles as exc:
                log.warning("%s: its flows registered without their fds removed (the agent reads at most %d open "
                            "files of a process that owns flows)", exc.strerror, MAX_OWNER_FDS)
                gone += rest
                spent += MAX_OWNER_FDS
        if read is not None:
            read.append(pid)
    if by_fd:
        gone += [by_fd[i][1] for i in _unowned_by_fd(by_fd, undecided, uid_of=uid_of)]
    if not held:
        return gone
    tcp_count = sum(k.proto == "tcp" for fl in flows_of.values() for k in fl)
    if lookups_cheaper(tcp_count):  # exact lookups, and port dumps for UDP
        try:
            exact = _tcp_unowned(flows_of, held)
        except OSError:
            pass
        else:
            udp = {pid: [k for k in fl if k.proto != "tcp"] for pid, fl in flows_of.items()}
            rows = udp_sockets([k for fl in udp.values() for k in fl], set().union(*held.values()), undecided,
                               {k: held[pid] for pid, fl in udp.items() for k in fl})
            for pid, inodes in held.items():
                gone += exact[pid] + [k for k in _unowned(udp[pid], [rows[i] for i in inodes if i in rows])
                                      if not _undecided(k, undecided)]
            return gone
    every = set().union(*held.values())
    table = agent_sockets(every, protos=("tcp",))  # (the UDP flows by port dumps: not the UDP table, 660 ms at 19,000)
    udp = {k: held[pid] for pid, fl in flows_of.items() for k in fl if k.proto != "tcp"}
    rows = udp_sockets(list(udp), every, undecided, udp)
    for pid, inodes in held.items():
        gone += [k for k in _unowned(flows_of[pid], [s for i in inodes for s in (table.get(i), rows.get(i)) if s])
                 if not _undecided(k, undecided)]
    return gone


def still_sending(flows: Iterable[FlowKey], uid_of: Callable[[FlowKey], int | None]) -> list[FlowKey]:
    """The TCP flows among ``flows`` whose socket no process holds any more (closed, or its process exited) and
    whose kernel still sends what was written to it before the close, then its FIN (``TCP_CLOSED_SENDING``, inode
    0), and was made by the flow's user (``uid_of``: another user's socket of the same addresses keeps nothing).
    A ``close()`` right after the last ``send()`` returns while up to the send buffer's size (megabytes) is
    still to go. [] when the kernel cannot answer (no sock_diag)."""
    tcp = [k for k in flows if k.proto == "tcp"]
    if not tcp:
        return []
    try:
        found = _DIAG.tcp_many([(k.src, k.sport, k.dst, k.dport) for k in tcp])
    except OSError:
        return []
    return [k for k, f in zip(tcp, found, strict=True)
            if f is not None and f.state in TCP_CLOSED_SENDING and f.inode == 0 and account_uid(f.uid) == uid_of(k)]
