"""What the running kernel offers, probed rather than assumed.

Each qdisc kind is tried on the loopback device of a throwaway network namespace, so the probe never touches
the host's interfaces. Usage: ``kinds = probe_qdiscs(("prio", "htb"))``
"""
from __future__ import annotations

import os
from pathlib import Path

from pyroute2 import IPRoute, netns

_PROBE_ARGS = {"htb": {"default": 0x10}, "prio": {"bands": 3, "priomap": [1] * 16}, "pfifo": {"limit": 10}}


PROBE_PREFIX = "tlprobe"
NETNS_DIR = Path("/run/netns")


def remove_stale_probes() -> list[str]:
    """Remove the probe namespaces of agents that died while probing (SIGKILL in that window leaves
    ``tlprobe<PID>`` behind): those whose PID no longer runs. Returns their names."""
    stale = []
    for path in NETNS_DIR.glob(f"{PROBE_PREFIX}*"):
        pid = path.name[len(PROBE_PREFIX):]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                netns.remove(path.name)
                stale.append(path.name)
            except OSError:  # removed by someone else meanwhile
                continue
    return stale


def probe_qdiscs(kinds: tuple[str, ...] = ("prio", "htb", "pfifo")) -> set[str]:
    """Return the subset of ``kinds`` that this kernel can instantiate (stale probe namespaces removed first)."""
    remove_stale_probes()
    name = f"{PROBE_PREFIX}{os.getpid()}"
    found: set[str] = set()
    netns.create(name)
    try:
        with IPRoute(netns=name) as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            for kind in kinds:
                try:
                    ipr.tc("add", kind, index=lo, handle=0x10000, **_PROBE_ARGS.get(kind, {}))
                    found.add(kind)
                    ipr.tc("del", kind, index=lo, handle=0x10000)
                except Exception:  # noqa: BLE001 - any refusal means "not available"
                    continue
    finally:
        netns.remove(name)
    return found


def choose_backend(wanted: str, available: set[str], link_rate_given: bool) -> str:
    """Pick the backend. ``auto``: htb when a link rate is configured (the agent must shape to own the queue,
    as on veth or a NIC faster than the real bottleneck), else prio when the kernel has it, else htb.

    Raises ValueError naming what is missing. Usage: ``choose_backend("auto", {"htb"}, True) == "htb"``
    """
    if wanted == "auto":
        order = ("htb", "prio") if link_rate_given else ("prio", "htb")
        for kind in order:
            if kind in available:
                return kind
        raise ValueError("backend: this kernel has neither sch_prio nor sch_htb")
    if wanted not in available:
        raise ValueError(f"backend '{wanted}' is not supported by this kernel (it has: "
                         f"{', '.join(sorted(available)) or 'none of prio, htb'})")
    return wanted


# Device kinds whose driver reports a fixed speed that says nothing of the link (veth 10000 Mb/s, tun 10 Mb/s).
PLACEHOLDER_SPEED_KINDS = frozenset({"veth", "tun"})


def interface_speed_bps(ifname: str, kind: str = "") -> int | None:
    """The link speed the driver reports in /sys; None where it reports none, or for a device of ``kind`` (its
    IFLA_INFO_KIND) in PLACEHOLDER_SPEED_KINDS. Usage: ``interface_speed_bps("eth0", link.kind)``"""
    if kind in PLACEHOLDER_SPEED_KINDS:
        return None
    try:
        mbps = int(Path(f"/sys/class/net/{ifname}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbps * 10**6 if mbps > 0 else None


def operstate(ifname: str) -> str:
    """The interface's operational state as /sys says it (``up``, ``down``, ``lowerlayerdown``, ...); "" unknown."""
    try:
        return Path(f"/sys/class/net/{ifname}/operstate").read_text().strip()
    except OSError:
        return ""
