"""Which interfaces the agent manages, and on which devices their queues live.

A managed interface is one that training traffic is routed out of: the agent's nftables rule matches it as the
packet's output interface (``oifname`` at postrouting), so a flow is marked on whichever managed interface the
routing table sends it through, and follows a route change by itself. The queue tree goes where packets wait:
on the interface itself, or, for a bond or team (a device without a queue of its own: it hands each packet to
one member at once), on each member. The mark (``skb->priority``) travels with the packet from the bond to the
member, so the member's tree classifies it.

Interfaces are named in the config, or found at start-up from the routes to the training subnets.
Usage: ``egress = resolve(ipr, ("eth0", "eth1"), ())``
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

AGGREGATES = ("bond", "team")  # upper devices whose members carry the queues
RTN_UNICAST = 1


class LinkError(ValueError):
    """An interface cannot be managed; the message says which and why."""


@dataclass(frozen=True)
class Link:
    """One network device: ``kind`` is its IFLA_INFO_KIND ("" for a physical NIC), ``master`` the index of the
    bond, team or bridge it is a member of."""

    name: str
    index: int
    kind: str = ""
    master: int | None = None


@dataclass(frozen=True)
class Egress:
    """A managed interface (matched as the output interface) and the devices that carry its queues."""

    name: str
    index: int
    queues: tuple[Link, ...]


def _link(msg) -> Link:
    """A Link from one RTM_NEWLINK message."""
    info = msg.get_attr("IFLA_LINKINFO")
    kind = (info.get_attr("IFLA_INFO_KIND") if info is not None else None) or ""  # an nla is a dict: never `if info`
    return Link(msg.get_attr("IFLA_IFNAME"), msg["index"], kind, msg.get_attr("IFLA_MASTER"))


def read_links(ipr) -> dict[str, Link]:
    """Every device of this network namespace, by name."""
    return {link.name: link for link in map(_link, ipr.get_links())}


def queue_links(link: Link, links: dict[str, Link]) -> tuple[Link, ...]:
    """The devices that carry ``link``'s queues: its members for a bond or team, else the link itself.

    Usage: ``queue_links(bond0, links) == (eth2, eth3)``
    """
    if link.kind not in AGGREGATES:
        return (link,)
    members = tuple(sorted((m for m in links.values() if m.master == link.index), key=lambda m: m.name))
    if not members:
        raise LinkError(f"{link.name} is a {link.kind} with no members: its traffic has no queue to manage")
    return members


def _route(msg) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, list[int]]:
    """(destination network, output interface indexes) of one route message (multipath: every next hop)."""
    family = 4 if msg["family"] == 2 else 6
    dst = msg.get_attr("RTA_DST") or ("0.0.0.0" if family == 4 else "::")
    net = ipaddress.ip_network(f"{dst}/{msg['dst_len']}", strict=False)
    oifs = [msg.get_attr("RTA_OIF")] if msg.get_attr("RTA_OIF") else []
    oifs += [hop["oif"] for hop in (msg.get_attr("RTA_MULTIPATH") or [])]
    return net, oifs


def routed_interfaces(routes, subnets: tuple[str, ...], links: dict[str, Link]) -> list[str]:
    """Names of the interfaces that routes to ``subnets`` (CIDR strings) leave through, in link order; the
    default route counts only when no more specific route covers a subnet. Only unicast routes count (of any
    routing table: policy routing may send each rail's traffic through its own), never loopback.

    ``routes`` are RTM_NEWROUTE messages, as ``ipr.get_routes()`` returns them.
    """
    by_index = {link.index: link.name for link in links.values()}
    wanted = [ipaddress.ip_network(s, strict=False) for s in subnets]
    found: set[int] = set()
    for want in wanted:
        unicast = (_route(msg) for msg in routes if msg["type"] == RTN_UNICAST)
        hits = [(net, oifs) for net, oifs in unicast if net.version == want.version and net.overlaps(want)]
        specific = [h for h in hits if h[0].prefixlen > 0]
        for _net, oifs in specific or hits:
            found.update(i for i in oifs if by_index.get(i) not in (None, "lo"))
    return [by_index[i] for i in sorted(found)]


def _queues(link: Link, links: dict[str, Link], absent_ok: bool) -> tuple[Link, ...]:
    """``queue_links``; with ``absent_ok`` a bond with no members yet has none (followed: its members are taken
    over as they join)."""
    try:
        return queue_links(link, links)
    except LinkError:
        if not absent_ok:
            raise
        return ()


def resolve(ipr, names: tuple[str, ...], subnets: tuple[str, ...], absent_ok: bool = False) -> list[Egress]:
    """The managed interfaces: ``names``, or (when empty) those routed to ``subnets``; each with its queue
    devices. Raises LinkError naming what is missing; with ``absent_ok`` a named interface that is not here is an
    Egress of index 0 with no queues, a bond with no members one with no queues (the agent follows them by name:
    taken over once they appear)."""
    links = read_links(ipr)
    if not names:
        names = tuple(routed_interfaces(ipr.get_routes(), subnets, links))
        if not names:
            raise LinkError(f"no interface has a route to the training subnets {', '.join(subnets)}")
    missing = [n for n in names if n not in links]
    if missing and not absent_ok:
        raise LinkError(f"no interface named {missing[0]!r} in this network namespace")
    out = [Egress(n, links[n].index, _queues(links[n], links, absent_ok)) if n in links else Egress(n, 0, ())
           for n in names]
    seen: dict[str, str] = {}
    for eg in out:
        for q in eg.queues:
            if q.name in seen:
                raise LinkError(f"{q.name} carries the queues of both {seen[q.name]} and {eg.name}: name one of them")
            seen[q.name] = eg.name
    return out


def egress_of(ipr, pairs, managed: dict[int, str]) -> dict[tuple[str, str], str]:
    """The managed interface each (source, destination) address pair leaves through, by a route lookup;
    pairs routed elsewhere (or not at all) map to ""."""
    out = {}
    for src, dst in pairs:
        try:
            msg = ipr.route("get", dst=dst, src=src)[0]
            out[(src, dst)] = managed.get(msg.get_attr("RTA_OIF"), "")
        except Exception:  # noqa: BLE001 - no route, or a source address this host does not have
            out[(src, dst)] = ""
    return out
