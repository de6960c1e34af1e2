"""The agent's life cycle without a kernel change (agent/daemon.py): the signals it answers. The take-over itself
runs in tests/test_agent_netns.py."""
from __future__ import annotations

import logging
import os
import signal

import pytest

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


def test_a_second_agent_in_the_network_namespace_is_refused_naming_the_first():
    """Abstract Unix socket names are per network namespace, like the agent's nftables table: a second agent with
    another state_dir (which passes the state_dir lock) is refused before it changes anything, naming the pid that
    holds the lock; the name is free again once the first lets it go."""
    name = f"tensorlane-test-{os.getpid()}"  # not the agents' own name: an agent may run in this namespace
    first = daemon.lock_netns(name)
    try:
        with pytest.raises(daemon.StartupError, match=rf"another tensorlane agent \(pid {os.getpid()}\) runs in this "
                                                      "network namespace"):
            daemon.lock_netns(name)
    finally:
        first.close()
    daemon.lock_netns(name).close()
