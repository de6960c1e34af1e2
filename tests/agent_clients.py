"""Helpers shared by the tests that talk to a real agent as other users and from other namespaces, and by the
benchmarks' smoke tests that build a testbed."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000


def request(path: str, msg: dict, timeout: float = 5.0) -> dict:
    """One request on a fresh connection to the agent's socket at ``path``; its one reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        # refused and closed before the request was written: the agent's error line is still there to read
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(json.dumps(msg).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def enter_netns(name: str) -> None:
    """Move this (single-threaded, root) process into the named network namespace: the agent decides who owns a
    flow in its own namespace, so clients that register flows must live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {name}")
    finally:
        os.close(fd)


def require_netns_tools() -> None:
    """Fail (never skip) unless this is root with ip, tc and nft: what the netns tests and smoke runs need."""
    assert os.geteuid() == 0, "the netns tests need root (network namespaces, tc, nftables): run them as root"
    for tool in ("ip", "tc", "nft"):
        assert shutil.which(tool), f"{tool} is missing: run scripts/bootstrap"


def tc_dump(host, dev: str = "eth0") -> str:
    """``dev``'s qdiscs, classes and filters as tc prints them, without statistics: HTB's ``direct_packets_stat``, a
    counter that ``tc qdisc show`` prints even without ``-s``, is left out (a packet sent while a tree is replaced
    would make two identical trees differ)."""
    out = "\n".join(host.run(["tc", what, "show", "dev", dev]).stdout for what in ("qdisc", "class", "filter"))
    return re.sub(r" direct_packets_stat \d+", "", out)


def flow(src_host, sport, dst_host, dport, proto="udp") -> dict:
    """A flow dict of the API from testbed host ``src_host`` to ``dst_host``."""
    return {"proto": proto, "src": src_host.ip, "sport": sport, "dst": dst_host.ip, "dport": dport}


def nft_tables(host) -> str:
    """``nft list tables`` on testbed host ``host``."""
    return host.run(["nft", "list", "tables"]).stdout


def wait_for(what, check, seconds: float = 8.0):
    """Poll ``check()`` until it returns something true (bounded: ``seconds``); its last value, or an assertion
    naming ``what``."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.1)


def udpprobe(args: list[str], as_uid: int | None = None) -> list[str]:
    """The command that runs ``testbed.udpprobe`` with ``args``; with ``as_uid``, as that user (``setpriv``, its
    group the same number), the module's source given with ``-c`` (``-I``): the user need not read the checkout,
    which a clone under a private directory (``mktemp -d``) keeps from it (until 2026-11-29 such a run failed
    "No module named 'testbed'")."""
    if as_uid is None:
        return [sys.executable, "-m", "testbed.udpprobe", *args]
    source = (Path(__file__).resolve().parent.parent / "testbed" / "udpprobe.py").read_text()
    return ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", sys.executable, "-I", "-c",
            source, *args]


def udp_exchange(sender, receiver, sport, dport, seconds=1.5, pps=300, during=None, tos=0, as_uid=None) -> dict:
    """Send UDP from testbed host ``sender`` to ``receiver`` (``testbed.udpprobe``) and return what the receiver
    saw (DSCP per datagram); ``during()`` runs while it sends. ``tos``: the sender's IP_TOS; ``as_uid``: the sender
    runs as that user (``setpriv``)."""
    py = [sys.executable, "-m"]
    recv = receiver.popen(py + ["testbed.udpprobe", "recv", "--port", str(dport), "--seconds", str(seconds + 5)],
                          stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    send = sender.popen(udpprobe(["send", "--dst", receiver.ip, "--port", str(dport), "--sport", str(sport), "--pps",
                                  str(pps), "--seconds", str(seconds), "--tos", str(tos)], as_uid),
                        stdout=subprocess.PIPE, text=True)
    try:
        if during:
            during()
        sent = json.loads(send.communicate(timeout=seconds + 10)[0])
        got = json.loads(recv.communicate(timeout=seconds + 10)[0])
    finally:
        for p in (send, recv):
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return {"sent": sent, **got}


RECV_DSCP = r"""
import json, socket, sys
v6 = ":" in sys.argv[1]
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
if v6:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
else:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
dscp = {}
try:
    while True:
        data, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(4))
        if data == b"stop":
            break
        tos = next((int.from_bytes(c[2][:4], sys.byteorder) if v6 else c[2][0]) for c in anc)
        dscp[str(tos >> 2)] = dscp.get(str(tos >> 2), 0) + 1
except TimeoutError:
    pass
print(json.dumps(dscp))
"""


def dscp_receiver(host, address: str, port: int, seconds: float = 10.0) -> subprocess.Popen:
    """A UDP receiver on ``address``:``port`` (IPv6 where it has a colon) in testbed host ``host``, counting the
    DSCP of each datagram (traffic class or TOS, read from the control message) until a datagram ``stop`` or
    ``seconds`` with none; returned once its socket is bound. ``communicate()[0]`` then gives the counts as JSON, the
    DSCP as a string key."""
    recv = host.popen([sys.executable, "-c", RECV_DSCP, address, str(port), str(seconds)], stdout=subprocess.PIPE,
                      text=True)
    try:
        assert recv.stdout.readline().strip() == "ready"
    except BaseException:
        recv.kill()
        recv.wait(5)
        raise
    return recv
