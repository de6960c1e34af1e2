"""A UDP probe that reports the DSCP of every datagram it receives (IP_RECVTOS), to check marking on the wire
without a packet capture. Run inside a namespace:

    python -m testbed.udpprobe recv --port 9000 --seconds 5          # prints {"packets": N, "dscp": {"46": N}}
    python -m testbed.udpprobe send --dst 198.18.0.2 --port 9000 --sport 9001 --pps 200 --seconds 5
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time

IP_RECVTOS = getattr(socket, "IP_RECVTOS", 13)
IP_TOS = socket.IP_TOS


def receive(port: int, seconds: float, bind: str = "0.0.0.0") -> dict:
    """Count datagrams per DSCP value for ``seconds`` (or until a datagram b"stop")."""
    counts: dict[int, int] = {}
    timeline: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
        s.bind((bind, port))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(1))
            except TimeoutError:
                break
            if data == b"stop":
                break
            tos = next((c[2][0] for c in anc if c[0] == socket.IPPROTO_IP and c[1] in (IP_TOS, IP_RECVTOS)), 0)
            counts[tos >> 2] = counts.get(tos >> 2, 0) + 1
            if len(timeline) < 100_000:
                timeline.append(tos >> 2)
    return {"packets": sum(counts.values()), "dscp": {str(k): v for k, v in sorted(counts.items())},
            "timeline": timeline}


def send(dst: str, port: int, sport: int, pps: float, seconds: float, size: int = 1000, tos: int = 0) -> dict:
    """Send ``pps`` datagrams per second of ``size`` bytes from ``sport`` for ``seconds``; then a b"stop". ``tos``:
    the socket's IP_TOS (the DSCP shifted left by 2), as any user may set it."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        if tos:
            s.setsockopt(socket.IPPROTO_IP, IP_TOS, tos)
        s.bind(("0.0.0.0", sport))
        payload = b"x" * size
        start = time.monotonic()
        while (now := time.monotonic()) - start < seconds:
            due = int((now - start) * pps) + 1
            while sent < due:
                s.sendto(payload, (dst, port))
                sent += 1
            time.sleep(min(0.01, 1.0 / pps))
        for _ in range(3):
            s.sendto(b"stop", (dst, port))
    return {"sent": sent, "bytes": sent * size}


def main(argv: list[str] | None = None) -> int:
    """``python -m testbed.udpprobe recv|send ...``: one end of a UDP probe, its JSON result on stdout."""
    p = argparse.ArgumentParser(prog="python -m testbed.udpprobe")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--port", type=int, required=True)
    r.add_argument("--seconds", type=float, default=5)
    s = sub.add_parser("send")
    s.add_argument("--dst", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--sport", type=int, required=True)
    s.add_argument("--pps", type=float, default=200)
    s.add_argument("--seconds", type=float, default=2)
    s.add_argument("--size", type=int, default=1000)
    s.add_argument("--tos", type=int, default=0, help="IP_TOS of the socket (DSCP << 2)")
    a = p.parse_args(argv)
    out = (receive(a.port, a.seconds) if a.cmd == "recv"
           else send(a.dst, a.port, a.sport, a.pps, a.seconds, a.size, a.tos))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
