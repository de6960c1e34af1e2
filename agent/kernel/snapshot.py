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

RTM_NEWQDISC, RTM_NEWTCLASS, RTM_NEWTFILTER = 36, 40, 44
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
TC_H_ROOT = 0xFFFFFFFF
NLMSG_ERROR = 2
# Attributes that configure an object (the rest of a dump is statistics).
_CONFIG_ATTRS = {1, 2, 5, 8, 11}  # TCA_KIND, TCA_OPTIONS, TCA_RATE, TCA_STAB, TCA_CHAIN
_TCMSG = struct.Struct("=BxxxiIII")
_NLMSG = struct.Struct("=IHHII")


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
    ifname: str
    ifindex: int
    objects: list[TcObject] = field(default_factory=list)

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
        return cls(data["ifname"], data["ifindex"], objs)


def _raw(msg) -> bytes:
    return bytes(msg.data[msg.offset: msg.offset + msg["header"]["length"]])


def _parse(what: str, raw: bytes) -> TcObject:
    _, _, handle, parent, info = _TCMSG.unpack_from(raw, _NLMSG.size)
    pos, attrs, kind = _NLMSG.size + _TCMSG.size, [], ""
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


def capture(ipr, ifname: str, index: int) -> Snapshot:
    """Record the interface's qdiscs, classes and filters (pyroute2 ``ipr`` in the right namespace)."""
    snap = Snapshot(ifname, index)
    qdiscs = [_parse("qdisc", _raw(m)) for m in ipr.get_qdiscs(index=index)]
    snap.objects.extend(q for q in qdiscs if q.parent != 0xFFFFFFF1)  # not ingress/clsact: we never touch them
    classes = [_parse("class", _raw(m)) for m in ipr.get_classes(index=index)]
    snap.objects.extend(classes)
    seen: set[tuple] = set()
    parents = [q.handle for q in qdiscs if q.handle and q.parent != 0xFFFFFFF1] + [c.handle for c in classes]
    for parent in parents:  # (filters of inner classes too: an HTB class's own filters were lost on restore)
        for f in (_parse("filter", _raw(m)) for m in ipr.get_filters(index=index, parent=parent)):
            key = (f.kind, f.handle, f.info, tuple(f.attrs))  # u32 lists a qdisc's tables of one prio at every parent
            if any(a[0] == 2 for a in f.attrs) and key not in seen:  # skip bare chain heads
                seen.add(key)
                snap.objects.append(f)
    return snap


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
    sock.send(_NLMSG.pack(_NLMSG.size + len(body), mtype, flags, seq, 0) + body)
    while True:
        data = sock.recv(65536)
        length, rtype, _, rseq, _ = _NLMSG.unpack_from(data, 0)
        if rtype == NLMSG_ERROR and rseq == seq:
            (err,) = struct.unpack_from("=i", data, _NLMSG.size)
            if err:
                raise OSError(-err, f"restoring {obj.what} {obj.kind} {obj.handle:#x}: "
                                    f"{errno.errorcode.get(-err, str(-err))}")
            return


def _tree_order(objs: list[TcObject]) -> list[TcObject]:
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
    return out + pending + _u32_order([o for o in objs if o.what == "filter"])


def _u32_order(filters: list[TcObject]) -> list[TcObject]:
    """Filters in the order that gives u32's hash tables their recorded ids back: a u32 instance (one parent and
    prio) gets its root table's id from the kernel (the next free one of the qdisc's shared counter, 800: and up)
    when it is made. So the instances are made first, by an empty u32 filter each, in their roots' id order (the
    lowest of the kernel's ids among each one's tables); then the other tables (a table of an id of its own, ``2:``,
    made first would make its instance and take the next id), then the keys. Sent in dump order, a second prio's
    root took another prio's id: its keys went to the wrong instance, or to a table nothing linked to (EINVAL).
    Usage: ``for obj in _u32_order(filters): ...``"""
    u32 = [f for f in filters if f.kind == "u32"]
    tables = sorted((f for f in u32 if f.handle & 0xFFFFF == 0), key=lambda f: f.handle)
    roots: dict[tuple[int, int], TcObject] = {}
    for t in tables:  # (the kernel's ids have bit 0x800 set: a table made with an id of its own, "2:", is no root)
        if t.handle & 0x80000000:
            roots.setdefault((t.parent, t.info), t)
    made = [TcObject("filter", 0, t.parent, t.info, [a for a in t.attrs if a[0] == 1], "u32")
            for t in sorted(roots.values(), key=lambda t: t.handle)]
    others = [t for t in tables if roots.get((t.parent, t.info)) is not t]
    return [f for f in filters if f.kind != "u32"] + made + others + [f for f in u32 if f.handle & 0xFFFFF]


def describe(obj: TcObject) -> str:
    """``filter u32 802:0:800 at 1: prio 3``: one recorded object, as tc names it, for a log line.
    Usage: ``describe(snap.objects[0])``"""
    def tc(h: int) -> str:
        return "root" if h == TC_H_ROOT else f"{h >> 16:x}:{h & 0xFFFF:x}" if h & 0xFFFF else f"{h >> 16:x}:"
    if obj.what == "filter" and obj.kind == "u32":
        h = obj.handle
        name = f"{h >> 20:x}:{h >> 12 & 0xFF:x}:{h & 0xFFF:x}" if h & 0xFFFFF else f"{h >> 20:x}:"
    else:
        name = tc(obj.handle)
    where = f"at {tc(obj.parent)} prio {obj.info >> 16}" if obj.what == "filter" else f"parent {tc(obj.parent)}"
    return f"{obj.what} {obj.kind} {name} {where}"


def _default_child(obj: TcObject) -> bool:
    """Whether ``obj`` is a default child qdisc, which the kernel makes by itself (never sent)."""
    return obj.what == "qdisc" and obj.parent != TC_H_ROOT and obj.handle & 0xFFFF0000 == 0


def _sent(snap: Snapshot) -> list[TcObject]:
    """What a restore sends, in that order: the recorded objects (a default child qdisc left out) and the empty
    u32 filters that make u32's instances (:func:`_u32_order`)."""
    return [o for o in _tree_order([o for o in snap.objects if o.handle or o.what == "filter"])
            if not _default_child(o)]


def missing(snap: Snapshot, ipr) -> list[str]:
    """The recorded objects that are not on the device now (by kind, handle, parent and prio), described. A restore
    can leave one out without any error: u32 root tables get the qdisc's next free ids from the kernel, so a
    recorded ``802:`` (with ``801:`` deleted before the agent started) comes back as ``801:``.
    Usage: ``assert not missing(snap, ipr)``"""
    now = capture(ipr, snap.ifname, snap.ifindex)
    have = {(o.what, o.kind, o.handle, o.parent, o.info) for o in now.objects}
    recorded = [o for o in snap.objects if (o.handle or o.what == "filter") and not _default_child(o)]
    return [describe(o) for o in recorded if (o.what, o.kind, o.handle, o.parent, o.info) not in have]


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
    with create_socket(netns, socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE, flags=0) as sock:
        sock.settimeout(2.0)
        sock.bind((0, 0))
        mtypes = {"qdisc": RTM_NEWQDISC, "class": RTM_NEWTCLASS, "filter": RTM_NEWTFILTER}
        for seq, obj in enumerate(_sent(snap), 1):
            try:
                _request(sock, seq, mtypes[obj.what], obj, snap.ifindex)
            except OSError as exc:
                if obj.what in ("qdisc", "class") and exc.errno == errno.EEXIST:
                    continue  # made by its parent qdisc (tbf, prio, mq classes; default leaves)
                warnings.append(str(exc))
    try:
        warnings += [f"not back: {what}" for what in missing(snap, ipr)]
    except Exception as exc:  # noqa: BLE001 - (the device gone, a dump refused) not known to be whole
        warnings.append(f"cannot check what came back: {exc}")
    return warnings
