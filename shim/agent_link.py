"""The shim's link to the local agent: registers the job's flows, re-registers after an agent restart, and never
blocks or breaks training when the agent is absent (short timeouts, one warning, a counter).

No torch here, and nothing privileged: it only talks to the agent's Unix socket.
Usage: ``link = AgentLink("/run/tensorlane/agent.sock", job="resnet", rank=0); link.add(0, flows); link.close()``
"""
from __future__ import annotations

import logging
import math
import threading
import time

from tensorlane.client import AgentClient, AgentError, AgentUnavailable, agent_text
from tensorlane.flows import flow_key, own_flow_fds

log = logging.getLogger("tensorlane.shim")
MAX_FLOWS_PER_REQUEST = 1024
MAX_LOST_WARNINGS = 3  # times the agent going away (and coming back) is a warning; after that, info
# After the agent was found away (not a refusal), the keep-alive tries every RETRY_S for RETRY_WINDOW_S, then every
# interval_s: a restarted agent (about 1 s without one) gets the flows added meanwhile, and all of them after a
# restore restart, within RETRY_S of answering instead of at the next keep-alive (up to 2 s later). Bounded: at most
# RETRY_WINDOW_S / RETRY_S tries of a connect to a Unix socket per time the agent went away.
RETRY_S = 0.2
RETRY_WINDOW_S = 10.0


class AgentLink:
    """Desired registrations of this process, kept in sync with whatever agent instance is running."""

    def __init__(self, socket_path: str, job: str, rank: int | None = None, interval_s: float = 2.0,
                 timeout_s: float = 0.5, run: str | None = None):
        """``run``: a token every rank of this run of the job shares (``agree_run``), so that the agent sees
        another job that uses the same id as a conflict instead of merging the two silently."""
        self.socket_path = socket_path
        self.job = job
        self.rank = rank
        self.run = run
        self.conflict = ""  # the agent's message when another run uses this job id on the host
        self.timeout_s = timeout_s
        self.flows: dict[int, list[dict]] = {}
        self.counters = {"registrations": 0, "failures": 0, "refusals": 0, "reregistrations": 0}
        self.last_error = ""
        self.link_bps: float | None = None  # the rate of the NIC the job's flows use (``status``), for the planner
        self.agent_levels: int | None = None  # the agent's levels (``hello``): a level beyond them goes to its last
        self.on_registered = None  # called (no arguments, never blocking) once flows are registered with a new agent
        self.alive = None  # a callable: False once the connections these flows are were destroyed (then retired)
        self.on_retired = None  # called (no arguments) when the link retires itself (the reporter stops with it)
        self.retired = ""  # why the link withdrew its flows and stopped without close()
        self._instance: str | None = None
        self._warned = False
        self._lost = 0  # times the agent was found away (each once, until it answers again)
        self._away_since: float | None = None  # monotonic time the agent was last found away (None: answering)
        self._fold_warned = False  # warned that levels beyond the agent's are registered at its last
        self._ever_registered = False
        self._was_held: set = set()  # flows whose socket this process held at a register (_drop_closed)
        self._ever_answered = False  # an agent answered hello once (a process with no flows registers none)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the keep-alive's pause ends early: stopping, or the agent found away
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="tensorlane-agent-link",
                                        daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._instance is not None

    def add(self, level: int, flows: list[dict]) -> None:
        """Add ``flows`` at ``level`` to what this process wants registered, and register them now if possible."""
        with self._lock:
            self.flows.setdefault(level, []).extend(flows)
            if self._instance is not None:
                self._talk(lambda agent: self._register(agent, {level: flows}))
                return
        self.sync()

    def sync(self) -> bool:
        """Register everything if the agent is new (or was away). Returns whether the agent is reachable."""
        with self._lock:
            return self._talk(self._register_all_if_new)

    def agent_level(self, level: int) -> int:
        """The agent's level for the shim's ``level``: the same, or the agent's least urgent one where it has fewer
        levels (its config says so, or it was restarted with fewer): those flows stay in a registered class,
        below the job's more urgent ones, rather than refused into the default class."""
        return level if self.agent_levels is None else min(level, self.agent_levels - 1)

    def _register(self, agent: AgentClient, flows: dict[int, list[dict]]) -> None:
        if not self._fold_warned and any(self.agent_level(lvl) != lvl for lvl in flows):
            self._fold_warned = True
            log.warning("tensorlane: the agent at %s has %d levels: this process's levels from %d on are registered "
                        "at its level %d", self.socket_path, self.agent_levels, self.agent_levels,
                        self.agent_levels - 1)
        held = own_flow_fds()  # which fd holds each flow's socket: the agent checks those alone
        flows = self._drop_closed(flows, held)
        for level, fl in sorted(flows.items()):
            for i in range(0, len(fl), MAX_FLOWS_PER_REQUEST):
                part = fl[i:i + MAX_FLOWS_PER_REQUEST]
                fds = [held.get(flow_key(f)) for f in part]
                reply = agent.register(self.job, self.agent_level(level), part, rank=self.rank, run=self.run,
                                       fds=fds if None not in fds else None)
                if reply.get("conflict") and not self.conflict:
                    self.conflict = agent_text(reply["conflict"])
                    log.warning("tensorlane: %s", self.conflict)

    def _drop_closed(self, flows: dict[int, list[dict]], held: dict) -> dict[int, list[dict]]:
        """``flows`` less those this process held a socket of at an earlier register and holds none of now (``held``:
        ``own_flow_fds()``): a closed TCP connection never comes back, and the agent refuses a whole register that
        names one (``not_owner``). They leave ``self.flows`` too, with a warning. Until 2026-11-29 they stayed, and
        every register after an agent restart or a timeout (every RETRY_S for RETRY_WINDOW_S) was refused: the
        job's other flows, still open, were never registered again. Flows never held (another process's, a test's)
        are sent as before."""
        keys = {flow_key(f) for fl in flows.values() for f in fl}
        closed = (keys & self._was_held) - held.keys()
        self._was_held |= keys & held.keys()
        if not closed:
            return flows
        for level in list(self.flows):
            self.flows[level] = [f for f in self.flows[level] if flow_key(f) not in closed]
        self._was_held -= closed
        log.warning("tensorlane: %d of this job's connections registered with the agent were closed (%s): they are "
                    "no longer registered, and what their levels still send goes on connections the shim did not "
                    "find, unprioritised", len(closed),
                    ", ".join(f"{k.src}:{k.sport} > {k.dst}:{k.dport}" for k in sorted(closed)[:3]))
        return {level: [f for f in fl if flow_key(f) not in closed] for level, fl in flows.items()}

    def _register_all_if_new(self, agent: AgentClient) -> None:
        hello = agent.request("hello")
        instance = hello.get("instance")
        if instance == self._instance:
            return
        levels = hello.get("levels")
        levels = levels if isinstance(levels, int) and not isinstance(levels, bool) and levels > 0 else None
        if levels != self.agent_levels:
            self.agent_levels, self._fold_warned = levels, False
        self._register(agent, self.flows)
        if self.link_bps is None:
            # one page (2000 flows) is plenty for which interface most of the job's few flows use; every page was
            # asked for, up to 1000: an agent answering `next` without end held this (and attach) for minutes
            mine = agent.request("list", job=self.job)["flows"] if self.flows else []
            self.link_bps = job_link_rate(agent.request("status"), mine)
        back = self._ever_answered
        self._ever_answered = True
        if self.flows:
            self.counters["registrations"] += 1
            self.counters["reregistrations"] += self._ever_registered
            self._ever_registered = True
        if self._warned:  # ("is back" for an agent started after the job, which was never there, misled)
            log.log(self._lost_level(), "tensorlane: agent at %s %s%s", self.socket_path,
                    "is back" if back else "answers now",
                    "" if not self.flows else "; flows registered again" if back else "; flows registered")
            self._warned = False
        self._instance = instance
        self._away_since = None
        if self.on_registered is not None and self.flows:
            self.on_registered()  # a restarted agent has none of this job's reports: send them now, not in 5 s

    def _talk(self, action) -> bool:
        """Run ``action(agent)`` on a fresh short-timeout connection; failures are counted and warned once."""
        try:
            with AgentClient(self.socket_path, timeout=self.timeout_s) as agent:
                action(agent)
            return True
        except AgentError as exc:  # the agent refused: keep training, say why once
            self.counters["refusals"] += 1
            self._fail(f"agent refused the registration: {exc}; training continues without network priority")
        except (KeyError, TypeError, AttributeError) as exc:  # an ok reply whose fields are not what the protocol says
            self.counters["failures"] += 1
            self._fail(f"agent at {self.socket_path} sent a bad reply ({type(exc).__name__}: {agent_text(exc)}); "
                       "training continues without network priority")
        except (AgentUnavailable, OSError, ValueError) as exc:
            self.counters["failures"] += 1
            why = str(exc) if isinstance(exc, AgentUnavailable) else f"no agent at {self.socket_path} ({exc})"
            if why.startswith("no agent at"):  # as the CLI says: the agent may listen where its config's `socket` is
                why += " (an agent on another socket: TENSORLANE_AGENT_SOCKET=PATH or attach(agent_socket=PATH))"
            if self._away_since is None:  # (a restart: the keep-alive tries again soon, for a while)
                self._away_since = time.monotonic()
                self._wake.set()  # (a keep-alive pausing interval_s since before: its next pause is RETRY_S)
            self._fail(f"{why}; training continues without network priority")
        return False

    def _fail(self, message: str) -> None:
        self._instance = None
        self.last_error = message
        if not self._warned:
            self._lost += 1
            more = "" if self._lost != MAX_LOST_WARNINGS else (
                f" (the {MAX_LOST_WARNINGS}rd time: from now on the agent going away and coming back is logged at "
                "info level; stats()['agent'] counts it)")
            log.log(self._lost_level(), "tensorlane: %s%s", message, more)
            self._warned = True

    def _lost_level(self) -> int:
        """An agent that keeps going away (overloaded, timing out one keep-alive in two) is warned of a few times,
        not every few seconds for the rest of the run."""
        return logging.WARNING if self._lost <= MAX_LOST_WARNINGS else logging.INFO

    def check_alive(self) -> bool:
        """Whether the connections of this link's flows still exist (``alive``); once they are found destroyed (the
        process group destroyed without ``handle.close()``) the flows are withdrawn, the keep-alive stops and
        ``on_retired`` runs, once. Usage: ``if not link.check_alive(): ...``"""
        alive = self.alive
        if alive is None or self._stop.is_set() or alive():
            return not self.retired
        self.retired = ("the process groups of this attach were destroyed (dist.destroy_process_group()) without "
                        "handle.close(): its flows are withdrawn from the agent and its threads stopped")
        log.warning("tensorlane: %s", self.retired)
        retired, self.on_retired = self.on_retired, None
        if retired is not None:
            retired()
        self.close()
        return False

    def _wait_s(self, interval_s: float) -> float:
        """The keep-alive's next pause: RETRY_S within RETRY_WINDOW_S of the agent found away, else ``interval_s``."""
        away = self._away_since
        if away is not None and self._instance is None and time.monotonic() - away < RETRY_WINDOW_S:
            return min(RETRY_S, interval_s)
        return interval_s

    def _run(self, interval_s: float) -> None:
        while True:
            woken = self._wake.wait(self._wait_s(interval_s))
            self._wake.clear()
            if self._stop.is_set():
                return
            if woken:  # (the agent found away by add(): the next pause is RETRY_S)
                continue
            if not self.check_alive():
                return
            self.sync()

    def close(self) -> None:
        """Stop the keep-alive thread and withdraw this process's flows (best effort, bounded)."""
        self._stop.set()
        self._wake.set()
        self.alive = self.on_retired = None  # (nothing of the process groups is kept once closed)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.timeout_s * 4 + 2)
        with self._lock:
            flows = [f for fl in self.flows.values() for f in fl]
            self.flows.clear()
            if not flows or self._instance is None:
                return
            try:
                with AgentClient(self.socket_path, timeout=self.timeout_s) as agent:
                    for i in range(0, len(flows), MAX_FLOWS_PER_REQUEST):
                        agent.unregister(self.job, flows[i:i + MAX_FLOWS_PER_REQUEST])
            except (AgentUnavailable, AgentError, OSError):
                pass


def job_link_rate(status: dict, flows: list[dict]) -> float | None:
    """The rate of the link this job's flows leave through, from the agent's ``status`` and ``list`` replies: the
    rate of the managed interface most of them use (a bond's: its members' sum), else the agent's only one;
    None when unknown."""
    by_iface: dict[str, float] = {}
    devices = status.get("devices")
    for dev in devices if isinstance(devices, list) else []:  # (an agent's reply: what is not a device is skipped)
        rate = dev.get("link_rate_bps") if isinstance(dev, dict) else None
        serves = dev.get("serves", "") if isinstance(dev, dict) else ""
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < math.inf \
                and isinstance(serves, str):
            by_iface[serves] = by_iface.get(serves, 0.0) + float(rate)
    used = [f.get("interface") for f in flows if isinstance(f, dict) and f.get("interface") in by_iface]
    if used:
        return by_iface[max(set(used), key=used.count)]
    return next(iter(by_iface.values())) if len(by_iface) == 1 else None
