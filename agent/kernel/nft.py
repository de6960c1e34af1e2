"""nftables through libnftables' JSON API (ctypes; the same library the `nft` tool and python3-nftables use).

The agent's table ``inet tensorlane`` holds two verdict maps per IP family: ``flows4``/``flows6`` keyed by the flow
5-tuple, and ``uflows4``/``uflows6`` for UDP flows keyed by the sending socket's user (``meta skuid``) and the
4-tuple: a UDP port may be shared by two users' sockets (SO_REUSEADDR), whose datagrams carry the same 5-tuple, so a
user's UDP flow matches only the packets of sockets of the user whose socket owned it at its register (a packet with
no socket, forwarded or the kernel's own, matches no ``uflows`` element). A packet leaving a managed interface is
looked up (a hash lookup: cost does not grow with the number of flows) and jumps to its level's chain, which sets
``meta priority`` (the tc class) and the DSCP, and counts. In the chains of the less urgent levels, after a rule
that takes every packet longer than a pure ACK at the level, rules send the flows' pure ACKs (TCP, no SYN, FIN, RST
or PSH, and no data: ``_pure_acks``) to the most urgent level's class and DSCP instead: an ACK queued behind the
class's own data, throttled to its guaranteed share while more urgent classes are busy, would stall the *other*
direction's sender into a retransmission timeout (docs/agent.md, ``ack_priority``). With ``reset_user_dscp``,
``egress`` then resets the DSCP of the packets no flow took of users other than root, and chain ``sockless`` (hook
``output``, before ``egress``) that of this host's TCP packets without a socket file (``kernel_tcp_dscp`` kept).
Usage: ``nft = Nft(); nft.run([{"add": {"table": {...}}}])``
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json

from tensorlane.agent.config import Config
from tensorlane.flows import FlowKey

TABLE = "tensorlane"
FAMILY = "inet"
_OUTPUT_JSON = 1 << 4


class NftError(RuntimeError):
    """libnftables refused a command batch; the message is nft's own."""


def _load():
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise NftError(f"libnftables is not installed ({exc}); install the 'nftables' package") from None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    return lib


class Nft:
    """One libnftables context (not thread-safe: use one per thread)."""

    def __init__(self):
        self._lib = _load()
        self._ctx = self._lib.nft_ctx_new(0)
        self._lib.nft_ctx_buffer_output(self._ctx)
        self._lib.nft_ctx_buffer_error(self._ctx)
        self._lib.nft_ctx_output_set_flags(self._ctx, _OUTPUT_JSON)

    def close(self) -> None:
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None

    def run(self, commands: list[dict]) -> dict | None:
        """Run a list of JSON commands as one atomic transaction; return parsed output, raise NftError."""
        payload = json.dumps({"nftables": [{"metainfo": {"json_schema_version": 1}}, *commands]}).encode()
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, payload)
        out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
        err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip() or f"nft failed with {rc}")
        return json.loads(out) if out.strip() else None


# ---- the desired table, as JSON commands ------------------------------------------------------------------

def _map_type(family: int, by_user: bool = False) -> list[str]:
    """The key of map ``flows{family}`` (5-tuple), or with ``by_user`` of ``uflows{family}`` (uid and 4-tuple)."""
    addr = "ipv4_addr" if family == 4 else "ipv6_addr"
    return ["uid", addr, addr, "inet_service", "inet_service"] if by_user else [addr, addr, "inet_proto",
                                                                                  "inet_service", "inet_service"]


def map_name(family: int, uid: int | None) -> str:
    """The map that holds a flow of ``family`` marked for socket user ``uid`` (None: any socket, by 5-tuple)."""
    return f"flows{family}" if uid is None else f"uflows{family}"


def level_chain(level: int) -> str:
    return f"level{level}"


def _prio(classid: int) -> str:
    return f"{classid >> 16:x}:{classid & 0xFFFF:x}"


# the IP length field of the longest pure ACK (IPv4: 20 + a 60-byte TCP header; IPv6: the payload's, 60)
ACK_HEADERS_MAX = {"ip": 80, "ip6": 60}


def _pure_acks(proto: str) -> list[list[dict]]:
    """Matches of a pure ACK of IP family ``proto`` ("ip", "ip6"), one per TCP header length (``doff`` 5..15): a
    TCP segment without SYN, FIN, RST or PSH and without data, its IP length (``ip length``; IPv6: the payload's,
    ``ip6 length``) exactly its headers' (IPv4 without options; IPv6 without extension headers).
    PSH excludes small *data* segments the kernel pushes at the end of a write (moved ahead of their flow's queued
    data they arrived out of order: docs/jobs-measured.md). A length bound instead (``meta length < 128``, until
    2026-11-28) took a data segment without PSH to the most urgent level: any user sends them (a write with
    ``MSG_MORE``, then ``TCP_NODELAY`` set: the segment leaves without PSH), 75 bytes of data each, and so sent its
    data at the most urgent class and DSCP whatever its ``level_limits``."""
    tcp = [{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
           {"match": {"op": "!", "left": {"payload": {"protocol": "tcp", "field": "flags"}},
                      "right": ["fin", "syn", "rst", "psh"]}}]  # none of them set
    if proto == "ip":
        head = [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "hdrlength"}}, "right": 5}}]
        base = 20
    else:
        head = [{"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "nexthdr"}}, "right": "tcp"}}]
        base = 0
    # (the IP length first: a small data packet leaves each of the 11 rules at its second test)
    return [[{"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": "length"}},
                        "right": base + 4 * doff}},
             *tcp, *head,
             {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "doff"}}, "right": doff}}]
            for doff in range(5, 16)]


def _level_rules(level: int, priority: int, dscp: int, ack: tuple[int, int] | None = None) -> list[dict]:
    """The rules of level ``level``'s chain: class ``priority`` and ``dscp``; pure ACKs first to ``ack``
    (classid, dscp) when given."""
    rules = []
    for proto, nfproto in (("ip", "ipv4"), ("ip6", "ipv6")):
        marks = [([], priority, dscp)]
        if ack is not None:  # (longer than any pure ACK: at its level in one rule, the bulk of a flow's packets)
            longer = {"match": {"op": ">", "left": {"payload": {"protocol": proto, "field": "length"}},
                                "right": ACK_HEADERS_MAX[proto]}}
            marks = [([longer], priority, dscp), *((match, *ack) for match in _pure_acks(proto)), *marks]
        family = {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": nfproto}}
        for match, classid, code in marks:
            rules.append({"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": level_chain(level), "expr": [
                family, *match,
                {"mangle": {"key": {"meta": {"key": "priority"}}, "value": _prio(classid)}},
                {"mangle": {"key": {"payload": {"protocol": proto, "field": "dscp"}}, "value": code}},
                {"counter": None},
                {"accept": None},
            ]}}})
    return rules


def _leaving(ifnames: list[str]) -> dict:
    """The match of a packet leaving through one of ``ifnames``."""
    return {"match": {"op": "==", "left": {"meta": {"key": "oifname"}},
                      "right": ifnames[0] if len(ifnames) == 1 else {"set": list(ifnames)}}}


def _of_family(family: int) -> dict:
    """The match of an IPv4 (``family`` 4) or IPv6 packet."""
    return {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv4" if family == 4 else "ipv6"}}


def _lookup_rule(ifnames: list[str], family: int, by_user: bool = False) -> dict:
    """The egress rule that looks a packet up in ``flows{family}`` by its 5-tuple, or with ``by_user`` a UDP
    packet in ``uflows{family}`` by its socket's user and 4-tuple (``meta skuid``: a packet without a socket of
    this namespace, forwarded or the kernel's own, breaks the lookup and goes on to the next rule)."""
    proto = "ip" if family == 4 else "ip6"
    ends = [{"payload": {"protocol": proto, "field": "saddr"}}, {"payload": {"protocol": proto, "field": "daddr"}}]
    if by_user:
        key = {"concat": [{"meta": {"key": "skuid"}}, *ends, {"payload": {"protocol": "udp", "field": "sport"}},
                          {"payload": {"protocol": "udp", "field": "dport"}}]}
    else:
        key = {"concat": [*ends, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "sport"}},
                          {"payload": {"protocol": "th", "field": "dport"}}]}
    udp = [{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "udp"}}] if by_user else []
    return {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": "egress", "expr": [
        _leaving(ifnames),
        _of_family(family),
        *udp,
        {"vmap": {"key": key, "data": f"@{map_name(family, 0 if by_user else None)}"}},
    ]}}}


def _users_dscp_rule(ifnames: list[str], family: int) -> dict:
    """A packet that no flow of the maps took (unregistered), of a local socket that a user other than root made
    (``meta skuid``: forwarded packets and the kernel's own have no socket file and keep theirs here; this host's
    TCP without one: :func:`_sockless_tcp_rules`), leaves with DSCP 0, the default class's. ``IP_TOS`` needs no
    privilege: a user set the levels' DSCP, or CS6/CS7 above them all, on traffic it never registered and put it in
    the switch's queue of the most urgent level or above, past ``level_limits`` and the agent alike."""
    proto = "ip" if family == 4 else "ip6"
    return {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": "egress", "expr": [
        _leaving(ifnames),
        _of_family(family),
        {"match": {"op": "!=", "left": {"meta": {"key": "skuid"}}, "right": 0}},
        {"match": {"op": "!=", "left": {"payload": {"protocol": proto, "field": "dscp"}}, "right": 0}},
        {"counter": None},
        {"mangle": {"key": {"payload": {"protocol": proto, "field": "dscp"}}, "value": 0}},
    ]}}}


def _roots_accept_rule(ifnames: list[str]) -> dict:
    """Root's packets (a local socket of root's: ``meta skuid 0``) keep their DSCP: the rule after it is not
    theirs (:func:`_users_dscp_rule`)."""
    return {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": "egress", "expr": [
        _leaving(ifnames),
        {"match": {"op": "==", "left": {"meta": {"key": "skuid"}}, "right": 0}},
        {"accept": None},
    ]}}}


SOCKLESS_CHAIN = "sockless"  # at the output hook: TCP sent from this host with no socket file (_sockless_tcp_rules)


def _sockless_tcp_rules(ifnames: list[str], family: int, kept: tuple[int, ...] = ()) -> list[dict]:
    """The rules of chain ``sockless`` (hook ``output``: only this host's own packets pass it, never forwarded
    ones) for IP ``family``: a TCP packet with no socket file to tell its user (``meta skuid`` reads the socket's
    file, and fails without one) leaves the managed interfaces with DSCP 0 unless its DSCP is one of ``kept``
    (``kernel_tcp_dscp``: the DSCP root gave the kernel's own TCP clients, such as NVMe/TCP's ``--tos``): what a
    closed socket still sends (the send buffer and FIN after ``close()``), an MPTCP connection's subflows (the
    kernel's sockets), the kernel's resets (IPv4's reflect the TOS of the packet they answer) and time-wait ACKs.
    Until 2026-11-29 such packets kept the DSCP a user set with ``IP_TOS``: a user's MPTCP connection, or a TCP
    one's tail after close, left at DSCP 46. The first rule lets every packet with a socket file go (the ``egress``
    chain tells root's from a user's); the DSCP is tested before it, so a packet with DSCP 0 (or a kept one) leaves
    without its socket looked at. A registered flow's packets reset here get their level's DSCP in ``egress`` at
    ``postrouting``, which comes after ``output``; the counter counts them too (the shim sets no ``IP_TOS``: a
    registered flow's packets carry DSCP 0 here unless its process set one). The hook tells this host's packets
    apart: the rule this chain replaced sat in ``egress`` and matched ``fib saddr type local``, which needs the
    kernel's nft_fib (not probed): without it the table, and so the agent, could not start."""
    proto = "ip" if family == 4 else "ip6"
    dscp = {"payload": {"protocol": proto, "field": "dscp"}}
    keep = sorted({0, *kept})
    match = [
        _leaving(ifnames),
        _of_family(family),
        {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
        {"match": {"op": "!=", "left": dscp, "right": keep[0] if len(keep) == 1 else {"set": keep}}},
    ]
    return [{"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": SOCKLESS_CHAIN, "expr": [
                *match, {"match": {"op": ">=", "left": {"meta": {"key": "skuid"}}, "right": 0}}, {"accept": None}]}}},
            {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": SOCKLESS_CHAIN, "expr": [
                *match, {"counter": None}, {"mangle": {"key": dscp, "value": 0}}]}}}]


def table_commands(ifnames: list[str], classids: list[int], dscp: list[int], ack_level: int | None = 0,
                   reset_user_dscp: bool = Config.reset_user_dscp,
                   kernel_tcp_dscp: tuple[int, ...] = Config.kernel_tcp_dscp) -> list[dict]:
    """Commands that create or update the table's chains and maps in place, keeping the maps' elements.

    A packet leaving through any of ``ifnames`` is looked up; ``classids[level]`` is the tc class the level's
    packets enter (the same on every managed device), ``dscp[level]`` their DSCP. With ``ack_level`` (None: off),
    the pure ACKs of less urgent levels go to that level's class and DSCP. With ``reset_user_dscp``, the packets no
    flow took of users other than root leave with DSCP 0 (:func:`_users_dscp_rule`), and so do this host's TCP
    packets without a socket file, unless their DSCP is one of ``kernel_tcp_dscp`` (:func:`_sockless_tcp_rules`).
    Chain ``sockless`` is made either way (empty without ``reset_user_dscp``): flushed, a restart that turns the
    setting off leaves none of its rules behind.
    """
    cmds: list[dict] = [{"add": {"table": {"family": FAMILY, "name": TABLE}}}]
    for fam in (4, 6):
        for by_user in (False, True):
            name = map_name(fam, 0 if by_user else None)
            cmds.append({"add": {"map": {"family": FAMILY, "table": TABLE, "name": name,
                                         "type": _map_type(fam, by_user), "map": "verdict"}}})
    for level in range(len(classids)):
        cmds.append({"add": {"chain": {"family": FAMILY, "table": TABLE, "name": level_chain(level)}}})
        cmds.append({"flush": {"chain": {"family": FAMILY, "table": TABLE, "name": level_chain(level)}}})
        ack = None if ack_level is None or level <= ack_level else (classids[ack_level], dscp[ack_level])
        cmds.extend(_level_rules(level, classids[level], dscp[level], ack))
    cmds.append({"add": {"chain": {"family": FAMILY, "table": TABLE, "name": "egress", "type": "filter",
                                   "hook": "postrouting", "prio": -150, "policy": "accept"}}})
    cmds.append({"flush": {"chain": {"family": FAMILY, "table": TABLE, "name": "egress"}}})
    cmds.extend(_lookup_rule(ifnames, fam, by_user) for fam in (4, 6) for by_user in (True, False))
    if reset_user_dscp:
        cmds.append(_roots_accept_rule(ifnames))
        cmds.extend(_users_dscp_rule(ifnames, fam) for fam in (4, 6))
    cmds.append({"add": {"chain": {"family": FAMILY, "table": TABLE, "name": SOCKLESS_CHAIN, "type": "filter",
                                   "hook": "output", "prio": -150, "policy": "accept"}}})
    cmds.append({"flush": {"chain": {"family": FAMILY, "table": TABLE, "name": SOCKLESS_CHAIN}}})
    if reset_user_dscp:
        for fam in (4, 6):
            cmds.extend(_sockless_tcp_rules(ifnames, fam, kernel_tcp_dscp))
    return cmds


Mark = tuple[int, int | None]  # a flow's (level, socket user: None for any socket) in the maps


def _elem(key: FlowKey, level: int | None, uid: int | None) -> list | dict:
    if uid is None:
        concat = {"concat": [key.src, key.dst, key.proto, key.sport, key.dport]}
    else:
        concat = {"concat": [uid, key.src, key.dst, key.sport, key.dport]}
    return concat if level is None else [concat, {"goto": {"target": level_chain(level)}}]


def element_commands(verb: str, items: list[tuple]) -> list[dict]:
    """``add`` or ``delete`` commands for map elements, grouped per map (one command each). ``items``: (flow,
    level, uid) or (flow, level): ``uid`` None or left out puts the flow in ``flows{family}`` (any socket's packets
    of its 5-tuple), else in ``uflows{family}`` (only the packets of sockets user ``uid`` made; UDP flows only);
    ``level`` is ignored for ``delete``."""
    groups: dict[str, list] = {}
    for key, level, *uid in items:
        user = uid[0] if uid else None
        groups.setdefault(map_name(key.family, user), []).append(_elem(key, level if verb == "add" else None, user))
    return [{verb: {"element": {"family": FAMILY, "table": TABLE, "name": name, "elem": elems}}}
            for name, elems in sorted(groups.items())]


def parse_map_elements(listing: dict | None) -> dict[FlowKey, Mark]:
    """Flows and their marks (level, socket user or None) found in a ``list table`` JSON answer."""
    out: dict[FlowKey, Mark] = {}
    for item in (listing or {}).get("nftables", []):
        m = item.get("map")
        name = (m or {}).get("name", "")
        if not m or not name.startswith(("flows", "uflows")):
            continue
        by_user = name.startswith("uflows")
        for elem in m.get("elem", []):
            key, verdict = elem if isinstance(elem, list) else (elem, None)
            if isinstance(key, dict) and "elem" in key:
                key = key["elem"]["val"]
            if by_user:
                uid, src, dst, sport, dport = key["concat"]
                proto = "udp"
            else:
                src, dst, proto, sport, dport = key["concat"]
                uid = None
            target = (verdict or {}).get("goto", {}).get("target", "")
            if target.startswith("level"):
                out[FlowKey(proto, src, int(sport), dst, int(dport))] = (int(target[5:]),
                                                                          None if uid is None else int(uid))
    return out


def chain_counters(listing: dict | None) -> dict[int, dict[str, int]]:
    """Per-level packet/byte counters from a ``list table`` JSON answer (both IP families summed)."""
    out: dict[int, dict[str, int]] = {}
    for item in (listing or {}).get("nftables", []):
        rule = item.get("rule")
        if not rule or not rule.get("chain", "").startswith("level"):
            continue
        level = int(rule["chain"][5:])
        if any("counter" in e for e in rule.get("expr", [])):
            _add_counters(rule, out.setdefault(level, {"packets": 0, "bytes": 0}))
    return out


def _add_counters(rule: dict, into: dict[str, int]) -> None:
    """Add the packets and bytes of ``rule``'s counters (a listed rule's JSON) to ``into``."""
    for expr in rule.get("expr", []):
        if "counter" in expr:
            into["packets"] += expr["counter"].get("packets", 0)
            into["bytes"] += expr["counter"].get("bytes", 0)


def reset_counters(listing: dict | None) -> dict[str, int]:
    """Packets and bytes whose DSCP the ``egress`` and ``sockless`` chains reset to 0 (a user's unregistered
    packets, :func:`_users_dscp_rule`; TCP without a socket file, :func:`_sockless_tcp_rules`), both IP families
    summed, from a ``list chain`` (or table) JSON answer."""
    out = {"packets": 0, "bytes": 0}
    for item in (listing or {}).get("nftables", []):
        rule = item.get("rule")
        if (rule and rule.get("chain") in ("egress", SOCKLESS_CHAIN)
                and any("mangle" in e for e in rule.get("expr", []))):
            _add_counters(rule, out)
    return out


def table_shape(listing: dict | None) -> list[str] | None:
    """The table's chains, maps and rules as listed, without what changes on its own (handles, counters, the maps'
    elements): equal shapes are the same rules (None: no table). The reconciler compares each pass's with the one
    listed after its own install, so that a rule replaced by another (the count unchanged) is seen."""
    if listing is None:
        return None
    out = []
    for item in listing.get("nftables", []):
        kind = next(iter(item), "")
        if kind not in ("chain", "map", "rule"):
            continue
        body = {k: v for k, v in item[kind].items() if k not in ("handle", "elem")}
        if kind == "rule":
            body["expr"] = [{"counter": None} if "counter" in e else e for e in body.get("expr", [])]
        out.append(json.dumps({kind: body}, sort_keys=True))
    return out


def stale_level_commands(listing: dict | None, levels: int) -> list[dict]:
    """Commands that remove the level chains beyond ``levels`` from a listed table (an agent killed with more
    ``levels`` left them), first moving the map elements that jump to one to the least urgent level ``levels - 1``
    (a chain is deleted only once nothing refers to it; empty: none left)."""
    stale = set()
    for item in (listing or {}).get("nftables", []):
        name = item.get("chain", {}).get("name", "")
        if name.startswith("level") and name[5:].isdigit() and int(name[5:]) >= levels:
            stale.add(int(name[5:]))
    if not stale:
        return []
    moved = [(k, uid) for k, (lvl, uid) in parse_map_elements(listing).items() if lvl >= levels]
    cmds = element_commands("delete", [(k, None, uid) for k, uid in moved])
    cmds += element_commands("add", [(k, levels - 1, uid) for k, uid in moved])
    cmds += [{"delete": {"chain": {"family": FAMILY, "table": TABLE, "name": level_chain(lvl)}}}
             for lvl in sorted(stale)]
    return cmds


def list_table(nft: Nft) -> dict | None:
    """The agent's table as JSON, or None when it does not exist."""
    try:
        return nft.run([{"list": {"table": {"family": FAMILY, "name": TABLE}}}])
    except NftError as exc:
        if "No such file" in str(exc) or "does not exist" in str(exc):
            return None
        raise


def delete_table_commands() -> list[dict]:
    return [{"delete": {"table": {"family": FAMILY, "name": TABLE}}}]
