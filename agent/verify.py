"""`tensorlane verify`: capture on the wire and check each registered flow's DSCP and queue.

The DSCP is read from captured packets (scapy, on the managed interface, after the qdisc, through a raw packet
socket: no libpcap or tcpdump, so it runs on a minimal host). The queue is checked
through the class counters: each level's class must have sent at least the bytes the capture saw for that
level's flows during the window. Usage: ``report = verify("/run/tensorlane/agent.sock", seconds=5)``
"""
from __future__ import annotations

import ipaddress

from tensorlane.client import AgentClient
from tensorlane.flows import FlowKey


class CaptureError(RuntimeError):
    """The capture could not start: no such interface here, or no raw packet socket (CAP_NET_RAW)."""


def _capture(iface, seconds: float, on_packet) -> None:
    """Call ``on_packet`` for each frame seen on ``iface`` (a name or a list) for ``seconds``; CaptureError, naming
    the interfaces, where the capture cannot start."""
    from scapy.sendrecv import sniff

    try:
        # No BPF filter: scapy compiles one through libpcap, which a minimal host lacks; ``_key`` skips what is not
        # IP (ARP, LLDP: a few frames), so the capture needs only a raw packet socket.
        sniff(iface=iface, timeout=seconds, prn=on_packet, store=False)
    except PermissionError as exc:
        raise CaptureError(f"cannot capture ({exc.strerror}): a raw packet socket needs root (CAP_NET_RAW)") from None
    except (OSError, ValueError) as exc:
        where = iface if isinstance(iface, str) else ", ".join(iface)
        raise CaptureError(f"cannot capture on {where}: {exc} (an interface of this network namespace)") from None


def _key(pkt) -> FlowKey | None:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.inet6 import IPv6

    ip = pkt.getlayer(IP) or pkt.getlayer(IPv6)
    l4 = pkt.getlayer(TCP) or pkt.getlayer(UDP)
    if ip is None or l4 is None:
        return None
    proto = "tcp" if l4.name == "TCP" else "udp"
    return FlowKey(proto, str(ipaddress.ip_address(ip.src)), l4.sport, str(ipaddress.ip_address(ip.dst)), l4.dport)


def _pure_ack(pkt) -> bool:
    """A TCP segment the agent's ``ack_priority`` rules send at the most urgent level: none of SYN, FIN, RST, PSH,
    and no data (``nft._pure_acks``: IPv4 without options, IPv6 without extension headers)."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.inet6 import IPv6

    tcp = pkt.getlayer(TCP)
    ip = pkt.getlayer(IP) or pkt.getlayer(IPv6)
    if tcp is None or ip is None or int(tcp.flags) & 0x0F:  # (0x0F: FIN, SYN, RST, PSH)
        return False
    if isinstance(ip, IPv6):
        return ip.nh == 6 and ip.plen == tcp.dataofs * 4
    return ip.ihl == 5 and ip.len == 20 + tcp.dataofs * 4


def _dscp(pkt) -> int:
    from scapy.layers.inet import IP

    ip = pkt.getlayer(IP)
    return (ip.tos if ip is not None else pkt.tc) >> 2


def verify(socket_path: str, seconds: float, interface: str | None = None) -> dict:
    """Capture for ``seconds`` and compare what each registered flow carried with what it should."""
    import scapy.layers.inet  # noqa: F401 - the dissectors must be loaded before the capture starts
    import scapy.layers.inet6  # noqa: F401
    import scapy.layers.l2  # noqa: F401

    with AgentClient(socket_path) as agent:
        flows = agent.list()["flows"]
        before = agent.status()
        # The managed interfaces (a bond, not its members: each packet is seen once, marked).
        # One that is absent (not there yet, or gone) is left out: it carries nothing to capture.
        iface = interface or [i["name"] for i in before["interfaces"] if i["name"] and i.get("present", True)]
        if not iface:
            raise CaptureError("no managed interface is here to capture on (tensorlane status: present false)")
        want = {FlowKey(f["proto"], f["src"], f["sport"], f["dst"], f["dport"]): f for f in flows}
        seen: dict[FlowKey, dict] = {}
        urgent = min((c for c in before["classes"] if c.get("level") is not None), key=lambda c: c["level"],
                      default=None)
        ack_dscp = urgent.get("dscp") if before.get("ack_priority") and urgent else None

        def on_packet(pkt) -> None:
            key = _key(pkt)
            if key in want:
                s = seen.setdefault(key, {"packets": 0, "bytes": 0, "dscp": {}, "ack_dscp": {}})
                s["packets"] += 1
                d = _dscp(pkt)
                if ack_dscp is not None and _pure_ack(pkt):  # the most urgent level's, by design: counted apart
                    s["ack_dscp"][d] = s["ack_dscp"].get(d, 0) + 1
                    return
                s["bytes"] += len(pkt)
                s["dscp"][d] = s["dscp"].get(d, 0) + 1

        _capture(iface, seconds, on_packet)
        after = agent.status()
    dscp_of = {c["level"]: c.get("dscp") for c in before["classes"]}
    class_of = {c["level"]: c["class"] for c in before["classes"]}
    sent = {c["class"]: c.get("bytes", 0) for c in after["classes"]}
    sent0 = {c["class"]: c.get("bytes", 0) for c in before["classes"]}
    level_bytes: dict[int, int] = {}
    rows = []
    for key, f in sorted(want.items()):
        s = seen.get(key)
        expected = dscp_of[f["level"]]
        acks_ok = s is None or set(s["ack_dscp"]) <= {expected, ack_dscp}
        if s is None:
            verdict = "no traffic"
        elif not s["dscp"] and acks_ok:  # its pure ACKs only: they leave at the most urgent level by design
            verdict = "acks only"
        elif set(s["dscp"]) <= {expected} and acks_ok:
            verdict = "ok"
            level_bytes[f["level"]] = level_bytes.get(f["level"], 0) + s["bytes"]
        else:
            verdict = "wrong dscp"
        rows.append({**f, "expected_dscp": expected, "seen_dscp": sorted((s or {}).get("dscp", {})),
                     "ack_dscp": sorted((s or {}).get("ack_dscp", {})),
                     "packets": (s or {}).get("packets", 0), "queue": class_of[f["level"]], "verdict": verdict})
    queues = {}
    for level, nbytes in level_bytes.items():
        cls = class_of[level]
        delta = sent[cls] - sent0[cls]
        # The class counts IP bytes, scapy whole frames: allow for the 14-byte Ethernet header per packet.
        queues[cls] = {"level": level, "class_bytes": delta, "captured_bytes": nbytes,
                       "ok": delta >= 0.9 * nbytes}
    for row in rows:
        if row["verdict"] == "ok" and not queues[row["queue"]]["ok"]:
            row["verdict"] = "wrong queue"
    ok = all(r["verdict"] in ("ok", "no traffic", "acks only") for r in rows)
    return {"interface": iface, "seconds": seconds, "flows": rows, "queues": queues, "ok": ok}


def format_report(report: dict) -> str:
    """The table `tensorlane verify` prints."""
    where = report["interface"] if isinstance(report["interface"], str) else ", ".join(report["interface"])
    job = max([12, *(len(r["job"]) for r in report["flows"])])  # the shim's own ids are 16 characters, a UUID 36
    lines = [f"capture on {where} for {report['seconds']}s",
             f"{'flow':<52} {'job':<{job}} {'lvl':>3} {'queue':>7} {'dscp want':>9} {'seen':>8} {'pkts':>7}  verdict"]
    for r in report["flows"]:
        flow = f"{r['proto']} {r['src']}:{r['sport']} -> {r['dst']}:{r['dport']}"
        seen = ",".join(map(str, r["seen_dscp"])) or "-"
        lines.append(f"{flow:<52} {r['job']:<{job}} {r['level']:>3} {r['queue']:>7} {r['expected_dscp']:>9} "
                     f"{seen:>8} {r['packets']:>7}  {r['verdict']}")
    if not report["flows"]:  # "0 flows verified" read as a pass on a host where no job had registered yet
        return "\n".join([lines[0], "no flows registered with the agent: nothing to verify (a job's shim registers "
                                     "its flows while it trains: run verify then)"])
    verified = sum(r["verdict"] == "ok" for r in report["flows"])
    idle = sum(r["verdict"] == "no traffic" for r in report["flows"])
    lines.append(f"{verified} flows verified, {idle} idle during the capture" if report["ok"]
                 else "MISMATCH: see verdicts above")
    return "\n".join(lines)
