"""The agent's life cycle: check everything, record the interface, take it over, serve, and give it back.

Start-up refuses bad configuration before touching the kernel. The interface's previous tc tree is saved to the
state directory before anything changes, so that SIGTERM (or a restarted agent after SIGKILL) restores it. The
service manager is told when the agent is ready and, from each reconcile pass, that it is alive (agent/notify.py).
Usage: ``sys.exit(run(load_config(path)))``
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
from pathlib import Path

from pyroute2 import IPRoute

from tensorlane.agent.api import Api
from tensorlane.agent.config import Config, ConfigError
from tensorlane.agent.kernel import detect, snapshot
from tensorlane.agent.kernel.qdisc import fmt_handle, make_backend
from tensorlane.agent.notify import Notifier
from tensorlane.agent.reconcile import Reconciler
from tensorlane.agent.server import Server
from tensorlane.agent.state import FlowTable

log = logging.getLogger("tensorlane.agent")


class StartupError(RuntimeError):
    """The agent cannot start; nothing on the host was changed."""


def state_path(cfg: Config) -> Path:
    """The state file of ``cfg.interface``: the record of the tree the agent replaced."""
    return Path(cfg.state_dir) / f"agent-{cfg.interface}.json"


def _load_state(cfg: Config) -> dict | None:
    """The state a previous agent left (None: none); a corrupt file stops the start."""
    try:
        return json.loads(state_path(cfg).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise StartupError(f"state file {state_path(cfg)} is corrupt ({exc}); inspect it and remove it") from None


def _save_state(cfg: Config, state: dict) -> None:
    """Write the state file atomically (a temporary file, then a rename)."""
    path = state_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def prepare(cfg: Config, ipr: IPRoute) -> tuple[object, int, snapshot.Snapshot, str]:
    """All checks, no changes: returns (backend, ifindex, snapshot of the previous tree, backend kind)."""
    found = ipr.link_lookup(ifname=cfg.interface)
    if not found:
        raise ConfigError("interface", f"no interface named {cfg.interface!r} in this network namespace")
    ifindex = found[0]
    try:
        kind = detect.choose_backend(cfg.backend, detect.probe_qdiscs(("prio", "htb")),
                                     cfg.link_rate_bps is not None)
    except ValueError as exc:
        raise ConfigError("backend", str(exc)) from None
    rate = cfg.link_rate_bps or detect.interface_speed_bps(cfg.interface)
    if kind == "htb" and rate is None:
        raise ConfigError("link_rate", f"{cfg.interface} reports no speed; set link_rate for the htb backend")
    backend = make_backend(kind, cfg.levels, rate, cfg.queue_limit_packets)
    previous = _load_state(cfg)
    if previous and previous.get("ifindex") == ifindex and backend.owns(ipr, ifindex):
        log.warning("adopting the tree left by a previous agent on %s; keeping its record of the original",
                    cfg.interface)
        return backend, ifindex, snapshot.Snapshot.from_json(previous["snapshot"]), kind
    if previous:
        log.warning("state file %s describes a tree that is gone; recording the interface afresh",
                    state_path(cfg))
    snap = snapshot.capture(ipr, cfg.interface, ifindex)
    root = snap.root
    if backend.owns(ipr, ifindex):
        raise StartupError(f"{cfg.interface} has a tensorlane root qdisc but no state file in {cfg.state_dir}: "
                           "another agent may manage it; stop it or remove the qdisc")
    if not snap.root_is_default and not cfg.take_over_root:
        raise StartupError(f"{cfg.interface} has a root qdisc '{root.kind}' (handle {fmt_handle(root.handle)}) "
                           "that tensorlane did not create; refusing to replace it (set take_over_root = true "
                           "to replace it and restore it on exit)")
    return backend, ifindex, snap, kind


def restore_interface(cfg: Config, ipr: IPRoute, ifindex: int, snap: snapshot.Snapshot, rec) -> list[str]:
    """Remove everything the agent added and put the previous tree back; clears the state file."""
    rec.teardown()
    warnings = snapshot.restore(snap, ipr)
    for w in warnings:
        log.warning("restore: %s", w)
    state_path(cfg).unlink(missing_ok=True)
    return warnings


def _serve(cfg: Config, api: Api, rec: Reconciler, table: FlowTable, notifier: Notifier) -> None:
    """Serve the API socket and reconcile every ``reconcile_interval_s`` until SIGTERM/SIGINT; readiness is told
    once the socket listens, and each reconcile pass feeds the watchdog."""
    stop = threading.Event()
    gc.collect()
    gc.freeze()  # what start-up allocated (pyroute2, scapy, prometheus) is never scanned again: no long pauses
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = Server(api, cfg.socket, cfg.socket_mode, cfg.socket_group)
    log.info("listening on %s", cfg.socket)
    if notifier.watchdog_s is not None and notifier.watchdog_s < 2 * cfg.reconcile_interval_s:
        log.warning("the watchdog period (%.1f s) is less than twice reconcile_interval_s (%.1f s): a healthy agent "
                    "may be restarted", notifier.watchdog_s, cfg.reconcile_interval_s)
    notifier.ready(f"managing {cfg.interface}")

    def periodic() -> None:
        rec.reconcile(table)
        notifier.watchdog()

    try:
        server.serve(stop, cfg.reconcile_interval_s, periodic)
    finally:
        notifier.stopping()
        server.close()


def run(cfg: Config) -> int:
    """Run the agent in the foreground until SIGTERM/SIGINT. Returns the process exit status."""
    with IPRoute() as ipr:
        backend, ifindex, snap, kind = prepare(cfg, ipr)
        _save_state(cfg, {"ifindex": ifindex, "interface": cfg.interface, "backend": kind,
                          "snapshot": snap.to_json()})
        table = FlowTable(cfg.levels, cfg.max_flows)
        rec = Reconciler(backend, cfg.dscp, cfg.interface, ifindex, ipr)
        try:
            if not snap.root_is_default and not backend.owns(ipr, ifindex):
                ipr.tc("del", index=ifindex, parent=snapshot.TC_H_ROOT)
            rec.install()
            rec.reconcile(table)  # drops flow entries a previous agent left behind
            log.info("managing %s with the %s backend: %d levels, DSCP %s", cfg.interface, kind, cfg.levels,
                     list(cfg.dscp))
            api = Api(cfg, table, rec, kind)
            if cfg.metrics_address:
                from tensorlane.agent.metrics import start_metrics_server
                start_metrics_server(cfg.metrics_address, api)
            _serve(cfg, api, rec, table, Notifier())
        finally:
            restore_interface(cfg, ipr, ifindex, snap, rec)
            log.info("restored %s", cfg.interface)
    return 0
