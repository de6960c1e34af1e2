"""Snapshot of an interface's egress tc tree, and its exact restoration.

Before the agent replaces a root qdisc it records every qdisc, class and filter of the interface as the kernel
dumped them (kind and option attributes, byte for byte). On exit it deletes its own root qdisc and, unless the
previous root was the kernel's default (which the kernel puts back by itself), sends the recorded objects back
in tree order. Stored as JSON in the state directory, so a restarted agent can still restore after SIGKILL.
Usage: ``snap = capture(ipr, ifindex); ...; restore(snap)``
"""
from __future__ import annotations

import contextlib
import errno
import socket
import struct
from dataclasses import asdict, dataclass, field

from pyroute2.netns import create_socket

from tensorlane.agent.kernel.netlink import (
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_EXCL,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSG_HDR,
    RTM_GETTFILTER,
    RTM_NEWQDISC,
    RTM_NEWTCLASS,
    RTM_NEWTFILTER,
    error_code,
)

TC_H_ROOT = 0xFFFFFFFF
U32_ROOT = 0xFFF00000  # u32's handle "fff:": the root table of the instance a request names (by parent and prio)
# Attributes that configure an object (the rest of a dump is statistics).
_CONFIG_ATTRS = {1, 2, 5, 8, 11}  # TCA_KIND, TCA_OPTIONS, TCA_RATE, TCA_STAB, TCA_CHAIN
_U32_KIND = "0800010075333200"  # TCA_KIND "u32", as dumped
_TCMSG = struct.Struct("=BxxxiIII")


@dataclass
class TcObject:
    """One qdisc, class or filter as the kernel reported it."""

    what: str  # "qdisc" | "class" | "filter"
    handle: int
    parent: int
    info: int
    attrs: list[tuple[int, str]]  # (attribute type, hex of the whole attribute incl. header)
    kind: str = ""


@dataclass
class Snapshot:
    """An interface's recorded tree. ``u32_roots``: each u32 instance's root table, ``[parent, info, handle]``
    (the kernel shares a qdisc's u32 tables among its parents, so dumps cannot tell which parent owns which table;
    asked per instance at capture). None in a record from before 2026-11-28 (the format without it)."""

    ifname: str
    ifindex: int
    objects: list[TcObject] = field(default_factory=list)
    u32_roots: list[list[int]] | None = None

    @property
    def root(self) -> TcObject | None:
        return next((o for o in self.objects if o.what == "qdisc" and o.parent == TC_H_ROOT), None)

    @property
    def root_is_default(self) -> bool:
        """True when the root is the kernel's own default (handle 0), which it recreates when ours goes away."""
        root = self.root
        return root is None or root.handle == 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Snapshot:
        objs = [TcObject(**{**o, "attrs": [tuple(a) for a in o["attrs"]]}) for o in data["objects"]]
        roots = data.get("u32_roots")
        return cls(data["ifname"], data["ifindex"], objs, None if roots is None else [list(r) for r in roots])


def _raw(msg) -> bytes:
    return bytes(msg.data[msg.offset: msg.offset + msg["header"]["length"]])


def _parse(what: str, raw: bytes) -> TcObject:
    _, _, handle, parent, info = _TCMSG.unpack_from(raw, NLMSG_HDR.size)
    pos, attrs, kind = NLMSG_HDR.size + _TCMSG.size, [], ""
    while pos + 4 <= len(raw):
        length, atype = struct.unpack_from("=HH", raw, pos)
        if length < 4:
            break
        atype &= 0x3FFF
        if atype in _CONFIG_ATTRS:
            attrs.append((atype, raw[pos: pos + length].hex()))
        if atype == 1:
            kind = raw[pos + 4: pos + length].rstrip(b"\0").decode()
        pos += (length + 3) & ~3
    return TcObject(what, handle, parent, info, attrs, kind)


def tc_object(what: str, msg) -> TcObject:
    """One dumped qdisc, class or filter (a pyroute2 message) as recorded: its configuration attributes raw.
    Usage: ``tc_object("filter", ipr.get_filters(index=2, parent=0x7A10000)[0]).attrs``"""
    return _parse(what, _raw(msg))


def _open(netns: str | None) -> socket.socket:
    """A raw rtnetlink socket in ``netns`` (None: this process's own), bound, with a 2-s timeout."""
    sock = create_socket(netns, socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE, flags=0)
    sock.settimeout(2.0)
    sock.bind((0, 0))
    return sock


def _u32_root(sock: socket.socket, ifindex: int, f: TcObject) -> int | None:
    """The root table's handle of the u32 instance that filter ``f`` belongs to (its parent, prio and chain): the
    kernel answers a get of handle ``fff:`` with the instance's own root (``tc filter get dev X parent 1:1 prio 1
    protocol ip handle fff: u32``). None where it has none (gone meanwhile).
    Usage: ``_u32_root(sock, 2, f)``"""
    body = _TCMSG.pack(0, ifindex, U32_ROOT, f.parent, f.info)
    body += b"".join(bytes.fromhex(h) + b"\0" * (-len(bytes.fromhex(h)) % 4) for t, h in f.attrs if t in (1, 11))
    sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body)
    root = None
    while True:
        data, pos = sock.recv(65536), 0
        while pos + NLMSG_HDR.size <= len(data):
            length, rtype, _, rseq, _ = NLMSG_HDR.unpack_from(data, pos)
            if rtype == RTM_NEWTFILTER and rseq == 1:
                root = _parse("filter", data[pos: pos + length]).handle
            elif rtype == NLMSG_ERROR and rseq == 1:
                err = error_code(data, pos)
                if err and err != errno.ENOENT:
                    raise OSError(err, f"asking u32's root table at {f.parent:#x} prio {f.info >> 16}")
                return None if err else root
            pos += (length + 3) & ~3 if length else len(data)


def capture(ipr, ifname: str, index: int, netns: str | None = None) -> Snapshot:
    """Record the interface's qdiscs, classes and filters (pyroute2 ``ipr`` in the right namespace, ``netns`` the
    same one), and each u32 instance's root table (:attr:`Snapshot.u32_roots`)."""
    snap = Snapshot(ifname, index, u32_roots=[])
    qdiscs = [_parse("qdisc", _raw(m)) for m in ipr.get_qdiscs(index=index)]
    snap.objects.extend(q for q in qdiscs if q.parent != 0xFFFFFFF1)  # not ingress/clsact: we never touch them
    classes = [_parse("class", _raw(m)) for m in ipr.get_classes(index=index)]
    snap.objects.extend(classes)
    seen: set[tuple] = set()
    instances: dict[tuple, TcObject] = {}
    parents = [q.handle for q in qdiscs if q.handle and q.parent != 0xFFFFFFF1] + [c.handle for c in classes]
    for parent in parents:  # (filters of inner classes too: an HTB class's own filters were lost on restore)
        for f in (_parse("filter", _raw(m)) for m in ipr.get_filters(index=index, parent=parent)):
            if f.kind == "u32":
                instances.setdefault((f.parent, f.info, _chain(f)), f)
            # u32 lists all of a qdisc's tables of one prio at every parent that has that prio (whatever protocol)
            key = (f.kind, f.handle, f.info >> 16 if f.kind == "u32" else f.info, tuple(f.attrs))
            if any(a[0] == 2 for a in f.attrs) and key not in seen:  # skip bare chain heads
                seen.add(key)
                snap.objects.append(f)
    if instances:
        with _open(netns) as sock:
            for f in instances.values():
                root = _u32_root(sock, index, f)
                if root is not None:
                    snap.u32_roots.append([f.parent, f.info, root])
    owner = {root: (parent, info) for parent, info, root in snap.u32_roots}
    for f in snap.objects:  # a root table and its keys under their instance's parent (dumped under the first one)
        if f.what == "filter" and f.kind == "u32" and f.handle & 0xFFF00000 in owner:
            f.parent, f.info = owner[f.handle & 0xFFF00000]
    return snap


def _chain(f: TcObject) -> str:
    """The hex of ``f``'s TCA_CHAIN attribute ("" where it has none)."""
    return next((h for t, h in f.attrs if t == 11), "")


def _patch_nested(attr: bytes, inner_type: int, patch) -> bytes:
    """Apply ``patch(buf, offset_of_value)`` to each attribute of type ``inner_type`` nested in ``attr``."""
    buf, pos = bytearray(attr), 4
    while pos + 4 <= len(buf):
        length, atype = struct.unpack_from("=HH", buf, pos)
        if length < 4:
            break
        if atype & 0x3FFF == inner_type:
            patch(buf, pos + 4)
        pos += (length + 3) & ~3
    return bytes(buf)


def _as_config(obj: TcObject, atype: int, attr: bytes) -> bytes:
    """Turn a dumped attribute into its configuration form where a kind dumps differently than it is set.

    HTB dumps its full version (3.17) in TCA_HTB_INIT but accepts only the major (3) when created; u32 dumps
    state bits (in_hw, not_in_hw) in TCA_U32_FLAGS that are refused as input.
    """
    def htb_version(buf, off):
        struct.pack_into("=I", buf, off, struct.unpack_from("=I", buf, off)[0] >> 16)

    def u32_flags(buf, off):
        struct.pack_into("=I", buf, off, struct.unpack_from("=I", buf, off)[0] & 0x3)  # skip_hw | skip_sw

    if atype == 2 and obj.what == "qdisc" and obj.kind == "htb":
        attr = _patch_nested(attr, 2, htb_version)  # TCA_HTB_INIT
    elif atype == 2 and obj.what == "filter" and obj.kind == "u32":
        attr = _patch_nested(attr, 11, u32_flags)  # TCA_U32_FLAGS
    return attr + b"\0" * (-len(attr) % 4)


def _request(sock: socket.socket, seq: int, mtype: int, obj: TcObject, ifindex: int) -> None:
    body = _TCMSG.pack(0, ifindex, obj.handle, obj.parent, obj.info)
    body += b"".join(_as_config(obj, t, bytes.fromhex(h)) for t, h in obj.attrs)
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | (NLM_F_EXCL if obj.what != "filter" else 0)
    sock.send(NLMSG_HDR.pack(NLMSG_HDR.size + len(body), mtype, flags, seq, 0) + body)
    while True:
        data = sock.recv(65536)
        length, rtype, _, rseq, _ = NLMSG_HDR.unpack_from(data, 0)
        if rtype == NLMSG_ERROR and rseq == seq:
            err = error_code(data)
            if err:
                raise OSError(err, f"restoring {obj.what} {obj.kind} {obj.handle:#x}: "
                                   f"{errno.errorcode.get(err, str(err))}")
            return


def _tree_order(objs: list[TcObject], u32_roots: list[list[int]] | None = None) -> list[TcObject]:
    """Order objects so that each one's parent exists before it: root qdisc, then classes and child qdiscs."""
    done_handles: set[int] = {TC_H_ROOT}
    out, pending = [], [o for o in objs if o.what != "filter"]
    for _ in range(len(pending) + 1):
        if not pending:
            break
        ready = [o for o in pending if o.parent in done_handles]
        if not ready:
            break
        for o in ready:
            out.append(o)
            done_handles.add(o.handle)
            pending.remove(o)
    return out + pending + _u32_order([o for o in objs if o.what == "filter"], u32_roots)


def _u32_order(filters: list[TcObject], u32_roots: list[list[int]] | None = None) -> list[TcObject]:
    """Filters in the order that gives u32's hash tables their recorded ids back: a u32 instance (one parent and
    prio) gets its root table's id from the kernel (the next free one of the qdisc's shared counter, 800: and up)
    when it is made. So the instances are made first, by an empty u32 filter each, in their roots' id order (the
    lowest of the kernel's ids among each one's tables); then the other tables (a table of an id of its own, ``2:``,
    made first would make its instance and take the next id), then the keys. Sent in dump order, a second prio's
    root took another prio's id: its keys went to the wrong instance, or to a table nothing linked to (EINVAL).
    ``u32_roots`` (:attr:`Snapshot.u32_roots`) says which parent owns which root table; a record without it (before
    2026-11-28) is taken to have each (parent, prio)'s lowest kernel id as its root (:func:`_unsure_u32_owners`).
    Usage: ``for obj in _u32_order(filters, snap.u32_roots): ...``"""
    u32 = [f for f in filters if f.kind == "u32"]
    tables = sorted((f for f in u32 if f.handle & 0xFFFFF == 0), key=lambda f: f.handle)
    not_u32, keys = [f for f in filters if f.kind != "u32"], [f for f in u32 if f.handle & 0xFFFFF]
    if u32_roots is not None:
        return not_u32 + _u32_known(tables, u32_roots) + keys
    roots: dict[tuple[int, int], TcObject] = {}
    for t in tables:  # (the kernel's ids have bit 0x800 set: a table made with an id of its own, "2:", is no root)
        if t.handle & 0x80000000:
            roots.setdefault((t.parent, t.info), t)
    made = [TcObject("filter", 0, t.parent, t.info, [a for a in t.attrs if a[0] in (1, 11)] or [(1, _U32_KIND)],
                     "u32") for t in sorted(roots.values(), key=lambda t: t.handle)]
    rooted = {t.handle for t in roots.values()}
    return not_u32 + made + [t for t in tables if t.handle not in rooted] + keys


def _tc(h: int) -> str:
    """``1:10``, ``1:`` or ``root``: a tc handle as tc writes it."""
    return "root" if h == TC_H_ROOT else f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"


def _u32_name(h: int) -> str:
    """``802:0:800`` (a key) or ``802:`` (a table): a u32 handle as tc writes it."""
    return f"{h >> 20:x}:{h >> 12 & 0xFF:x}:{h & 0xFFF:x}" if h & 0xFFFFF else f"{h >> 20:x}:"


def _u32_known(tables: list[TcObject], u32_roots: list[list[int]]) -> list[TcObject]:
    """The u32 tables to send, for a record that names each instance's root (``u32_roots``): the kernel's ids
    (``800:`` and up) in id order, each root as the empty filter that makes its instance at its own parent and each
    other table of such an id (``divisor 16`` with no handle) sent with no handle, so that the kernel gives it the
    next id (sent as ``801:``, the kernel made a second table ``801:`` beside a root it had given ``801:``), at a
    parent whose instance of its prio is made by then (one id counter per qdisc: a root made before a lower table
    took its id); then the tables of ids of their own (``2:``).
    Usage: ``_u32_known(tables, snap.u32_roots)``"""
    rooted = {root: (parent, info) for parent, info, root in u32_roots}
    by_handle = {t.handle: t for t in tables}
    kernel_ids = sorted(set(rooted) | {t.handle for t in tables if t.handle & 0x80000000})
    out, made = [], {}
    for h in kernel_ids:
        t = by_handle.get(h)
        if h in rooted:
            parent, info = rooted[h]
            kind = [a for a in t.attrs if a[0] in (1, 11)] if t else [(1, _U32_KIND)]
            out.append(TcObject("filter", 0, parent, info, kind, "u32"))
            made.setdefault(info >> 16, (parent, info))
        elif t is not None:
            parent, info = made.get(t.info >> 16, (t.parent, t.info))
            out.append(TcObject("filter", 0, parent, info, t.attrs, "u32"))  # (sent as 801:, it made a second 801:)
    return out + [t for t in tables if t.handle not in rooted and not t.handle & 0x80000000]


def describe(obj: TcObject) -> str:
    """``filter u32 802:0:800 at 1: prio 3``: one recorded object, as tc names it, for a log line.
    Usage: ``describe(snap.objects[0])``"""
    name = _u32_name(obj.handle) if obj.what == "filter" and obj.kind == "u32" else _tc(obj.handle)
    where = f"at {_tc(obj.parent)} prio {obj.info >> 16}" if obj.what == "filter" else f"parent {_tc(obj.parent)}"
    return f"{obj.what} {obj.kind} {name} {where}"


def _default_child(obj: TcObject) -> bool:
    """Whether ``obj`` is a default child qdisc, which the kernel makes by itself (never sent)."""
    return obj.what == "qdisc" and obj.parent != TC_H_ROOT and obj.handle & 0xFFFF0000 == 0


def _sent(snap: Snapshot) -> list[TcObject]:
    """What a restore sends, in that order: the recorded objects (a default child qdisc left out) and the empty
    u32 filters that make u32's instances (:func:`_u32_order`)."""
    return [o for o in _tree_order([o for o in snap.objects if o.handle or o.what == "filter"], snap.u32_roots)
            if not _default_child(o)]


def missing(snap: Snapshot, ipr, netns: str | None = None) -> list[str]:
    """The recorded objects that are not on the device now (by kind, handle, parent and prio), described, and each
    recorded u32 instance (parent, prio) whose root table is not the recorded one. A restore can leave one out
    without any error: u32 root tables get the qdisc's next free ids from the kernel, so a recorded ``802:`` (with
    ``801:`` deleted before the agent started) comes back as ``801:``; and the kernel lists a qdisc's u32 tables of
    one prio at every parent with that prio, so a table made at the wrong parent would look in place (before
    2026-11-28 the inner class's table came back under the root, unlinked, and this check passed).
    Usage: ``assert not missing(snap, ipr)``"""
    now = capture(ipr, snap.ifname, snap.ifindex, netns)
    have = {(o.what, o.kind, o.handle, o.parent, o.info) for o in now.objects}
    recorded = [o for o in snap.objects if (o.handle or o.what == "filter") and not _default_child(o)]
    out = [describe(o) for o in recorded if (o.what, o.kind, o.handle, o.parent, o.info) not in have]
    roots_now = {(parent, info): root for parent, info, root in now.u32_roots or []}
    for parent, info, root in snap.u32_roots or []:
        if roots_now.get((parent, info)) != root:
            got = roots_now.get((parent, info))
            out.append(f"u32 at {_tc(parent)} prio {info >> 16} with its root table {_u32_name(root)} "
                       f"(now {_u32_name(got) if got is not None else 'none'})")
    return out


def _unsure_u32_owners(snap: Snapshot) -> list[str]:
    """For a record from before 2026-11-28 (no :attr:`Snapshot.u32_roots`): the prios with more than one table of
    the kernel's ids (``800:`` and up). Such a record cannot tell which parent owns which (the kernel lists them at
    every parent with that prio, and the record kept them under the first), so a restore of it is not known to
    be exact and is reported as not complete (the record kept).
    Usage: ``warnings += _unsure_u32_owners(snap)``"""
    by_prio: dict[int, list[int]] = {}
    for o in snap.objects:
        if o.what == "filter" and o.kind == "u32" and o.handle & 0xFFFFF == 0 and o.handle & 0x80000000:
            by_prio.setdefault(o.info >> 16, []).append(o.handle)
    return [f"recorded before 2026-11-28 without u32's table owners: cannot tell which parent owns which of "
            f"{', '.join(_u32_name(h) for h in sorted(hs))} (prio {prio})"
            for prio, hs in sorted(by_prio.items()) if len(hs) > 1]


def restore(snap: Snapshot, ipr, netns: str | None = None) -> list[str]:
    """Put the recorded tree back (after deleting whatever root qdisc is there now). Returns warnings: each request
    the kernel refused, then each recorded object that is not there afterwards (:func:`missing`); none when the
    tree came back whole.

    ``ipr`` and ``netns`` must name the same network namespace (None: this process's own).
    """
    warnings: list[str] = []
    with contextlib.suppress(Exception):  # already gone is fine
        ipr.tc("del", index=snap.ifindex, parent=TC_H_ROOT)
    if snap.root_is_default:
        return warnings
    with _open(netns) as sock:
        mtypes = {"qdisc": RTM_NEWQDISC, "class": RTM_NEWTCLASS, "filter": RTM_NEWTFILTER}
        for seq, obj in enumerate(_sent(snap), 1):
            try:
                _request(sock, seq, mtypes[obj.what], obj, snap.ifindex)
            except OSError as exc:
                if obj.what in ("qdisc", "class") and exc.errno == errno.EEXIST:
                    continue  # made by its parent qdisc (tbf, prio, mq classes; default leaves)
                warnings.append(str(exc))
    if snap.u32_roots is None:
        warnings += _unsure_u32_owners(snap)
    try:
        warnings += [f"not back: {what}" for what in missing(snap, ipr, netns)]
    except Exception as exc:  # noqa: BLE001 - (the device gone, a dump refused) not known to be whole
        warnings.append(f"cannot check what came back: {exc}")
    return warnings
