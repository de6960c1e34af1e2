"""The agent's life cycle without a kernel change (agent/daemon.py): the signals it answers. The take-over itself
runs in tests/test_agent_netns.py."""
from __future__ import annotations

import logging
import os
import signal

from tensorlane.agent import daemon


def test_sighup_is_logged_and_neither_stops_nor_kills_the_agent(caplog):
    """SIGHUP (an operator's ``kill -HUP`` or ``systemctl kill -s HUP``, expecting a reload) killed the agent with
    its default action: no restore, and systemd does not restart a unit whose main process died of SIGHUP."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop = daemon._stop_on_signals()
        with caplog.at_level(logging.WARNING, logger="tensorlane.agent"):
            os.kill(os.getpid(), signal.SIGHUP)
        assert not stop.is_set()
        assert "does not reload its configuration" in caplog.text
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
