"""Telling the service manager how the agent is: readiness, the watchdog, stopping.

Under systemd (``Type=notify``) the messages are datagrams to ``$NOTIFY_SOCKET`` (the sd_notify protocol; an
address starting with ``@`` is in the abstract namespace); ``WATCHDOG=1`` is sent when ``$WATCHDOG_USEC`` asks for
it, at most every half of that period. Without systemd, ``tensorlane-agentctl`` sets ``$TENSORLANE_HEARTBEAT``:
the agent touches that file on each watchdog feed (and writes ``stopping`` into it as it stops), and the control
script's supervisor restarts an agent whose heartbeat is older than its timeout. Neither is needed: without them
every call does nothing.
Usage: ``n = Notifier(); n.ready("managing eth0"); ...; n.watchdog(); ...; n.stopping()``
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("tensorlane.agent")

HEARTBEAT_ENV = "TENSORLANE_HEARTBEAT"


def notify_address(value: str | None) -> str | bytes | None:
    """The socket address of ``$NOTIFY_SOCKET``: a path, or (``@name``) an abstract address; None if unusable."""
    if not value or value[0] not in "/@":
        return None
    return b"\0" + value[1:].encode() if value[0] == "@" else value


def watchdog_period_s(env) -> float | None:
    """The watchdog period systemd asks for in ``env`` (None: none, or it is meant for another process)."""
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    try:
        if not usec or int(usec) <= 0 or (pid and int(pid) != os.getpid()):
            return None
        return int(usec) / 1e6
    except ValueError:
        return None


class Notifier:
    """sd_notify messages and the heartbeat file, read from ``env`` (``os.environ`` by default)."""

    def __init__(self, env=None, clock=time.monotonic):
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``/``WATCHDOG_PID`` and ``TENSORLANE_HEARTBEAT`` from ``env``."""
        env = os.environ if env is None else env
        self.socket = env.get("NOTIFY_SOCKET")
        self.address = notify_address(self.socket)
        self.watchdog_s = watchdog_period_s(env) if self.address else None
        heartbeat = env.get(HEARTBEAT_ENV)
        self.heartbeat = Path(heartbeat) if heartbeat else None
        self.clock = clock
        self.last_ping = None
        self.failed = False

    def send(self, *fields: str) -> bool:
        """Send one message of ``KEY=value`` fields to the service manager; False if there is none or it failed."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as exc:
            if not self.failed:  # once: a broken socket must not fill the log every pass
                log.warning("cannot notify the service manager at %s: %s", self.socket, exc)
                self.failed = True
            return False

    def ready(self, status: str = "") -> None:
        """The agent has taken the interface over and listens: ``READY=1`` and the first heartbeat."""
        self.send("READY=1", *([f"STATUS={status}"] if status else []))
        self.watchdog(force=True)

    def watchdog(self, force: bool = False) -> None:
        """Feed the watchdog (call it from the reconcile loop): ``WATCHDOG=1`` at most every half period, and the
        heartbeat file's modification time."""
        if self.watchdog_s is not None:
            now = self.clock()
            if force or self.last_ping is None or now - self.last_ping >= self.watchdog_s / 2:
                self.last_ping = now
                self.send("WATCHDOG=1")
        if self.heartbeat is not None:
            try:
                self.heartbeat.touch()
            except OSError as exc:
                log.warning("cannot touch the heartbeat file %s: %s", self.heartbeat, exc)

    def stopping(self) -> None:
        """The agent is stopping (it restores the interface now): ``STOPPING=1``, and the heartbeat file says
        ``stopping`` (the supervisor's watchdog then leaves the agent the stop timeout to finish)."""
        self.send("STOPPING=1", "STATUS=restoring the interface")
        if self.heartbeat is not None:
            try:
                self.heartbeat.write_text("stopping\n")
            except OSError as exc:
                log.warning("cannot write the heartbeat file %s: %s", self.heartbeat, exc)
