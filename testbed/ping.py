"""A minimal ICMP echo client (raw socket, needs root), so the testbed needs no ``ping`` binary.

Run inside a host namespace: ``ip netns exec tl-h1 python -m testbed.ping 198.18.0.2 -c 3 -W 1 [--dscp 46]``.
Prints one line per reply (``seq=N time=T ms``) and a summary with the median RTT; exits 0 when every request got
a reply, 1 otherwise. ``--dscp`` marks the requests (the replies keep the DSCP: Linux echoes the request's TOS).
"""
from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time

ICMP_ECHO_REQUEST = 8
ICMP_ECHO_REPLY = 0


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, payload: bytes) -> bytes:
    """An ICMP echo request packet (header and payload) with a valid checksum."""
    header = struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ICMP_ECHO_REQUEST, 0, checksum(header + payload), ident, seq) + payload


def ping_once(sock: socket.socket, dst: str, ident: int, seq: int, timeout: float) -> float | None:
    """Send one echo request to ``dst`` and wait up to ``timeout`` s for its reply; the RTT in seconds, or None."""
    start = time.monotonic()
    sock.sendto(echo_request(ident, seq, struct.pack("!d", start) + b"tensorlane"), (dst, 0))
    deadline = start + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        packet, (src, _) = sock.recvfrom(65535)
        ihl = (packet[0] & 0x0F) * 4
        icmp_type, _, _, r_ident, r_seq = struct.unpack("!BBHHH", packet[ihl:ihl + 8])
        if src == dst and icmp_type == ICMP_ECHO_REPLY and r_ident == ident and r_seq == seq:
            return time.monotonic() - start
    return None


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m testbed.ping DST [-c COUNT] [-W TIMEOUT] [-i INTERVAL] [--dscp DSCP]``."""
    p = argparse.ArgumentParser(prog="testbed.ping", description="ICMP echo without the ping binary (root)")
    p.add_argument("dst")
    p.add_argument("-c", "--count", type=int, default=3)
    p.add_argument("-W", "--timeout", type=float, default=1.0, help="seconds to wait for each reply")
    p.add_argument("-i", "--interval", type=float, default=0.2)
    p.add_argument("--dscp", type=int, default=0, choices=range(64), metavar="0..63", help="DSCP of the requests")
    args = p.parse_args(argv)
    ident = os.getpid() & 0xFFFF
    rtts: list[float] = []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.dscp << 2)
        for seq in range(1, args.count + 1):
            rtt = ping_once(sock, args.dst, ident, seq, args.timeout)
            if rtt is None:
                print(f"{args.dst}: seq={seq} timeout")
            else:
                rtts.append(rtt)
                print(f"{args.dst}: seq={seq} time={rtt * 1000:.3f} ms")
            if seq < args.count:
                time.sleep(args.interval)
    median = f", median {statistics.median(rtts) * 1000:.3f} ms" if rtts else ""
    print(f"{args.count} sent, {len(rtts)} received{median}")
    return 0 if len(rtts) == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
