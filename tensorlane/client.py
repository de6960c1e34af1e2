"""The agent's local API as both sides see it: its constants, job-id rule and a client (docs/protocol.md).

The agent (``tensorlane.agent.protocol`` parses, ``tensorlane.agent.server`` serves) and its clients (the CLI,
``tensorlane.shim``) import this module; neither imports the other. No privileges needed.

Usage::

    with AgentClient("/run/tensorlane/agent.sock") as agent:
        agent.register("job-a", level=0, flows=[{"src": "198.18.0.1", "sport": 4000, ...}])
"""
from __future__ import annotations

import itertools
import json
import os
import re
import socket
import stat
import time

DEFAULT_SOCKET = "/run/tensorlane/agent.sock"
MAX_MESSAGE_BYTES = 64 * 1024
MAX_REPLY_BYTES = 4 << 20  # a reply line the client reads at most (a list page is well under the agent's 1 MiB)
MAX_FLOWS_PER_MESSAGE = 1024
LIST_PAGE = 2000  # flows per list reply (well under the agent's 1 MiB of unread output); the client asks page by page
MAX_LIST_PAGES = 1000  # pages the client asks for at most (2 million flows; an agent holds at most max_flows)
OPS = ("register", "unregister", "list", "status", "hello", "report")
MAX_REPORT_LEVELS = 16
MAX_COMPUTE_S = 86400.0  # a report's compute seconds per training step: at most a day
MAX_WINDOW_STEPS = 1024  # a report's steps in its window (job_policy "slowdown")
MAX_RANK = 2**31 - 1  # a register's rank (torch.distributed's are int32): listed with each flow, so it is bounded
JOB_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}\Z")  # \Z: "$" would take a trailing newline
JOB_ID_RULE = "1-64 characters of letters, digits, '_.:-', starting with a letter or digit"
SOCKET_ENV = "TENSORLANE_AGENT_SOCKET"


def agent_socket(path: str | None = None) -> str:
    """The agent socket a client asks: ``path``, else ``$TENSORLANE_AGENT_SOCKET`` where set and not empty, else
    :data:`DEFAULT_SOCKET`. The CLI and the shim both resolve it here, so they never ask different agents.
    Usage: ``agent_socket(None) == "/run/tensorlane/agent.sock"`` with the variable unset or empty"""
    return path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def clean_job_id(raw: str) -> str:
    """``raw`` made into a valid job id (``JOB_ID_RE``): other characters become '-', at most 64.

    Usage: ``clean_job_id("my run/3") == "my-run-3"``
    """
    job = re.sub(r"[^A-Za-z0-9_.:\-]", "-", raw)[:64]
    return job if job[:1].isalnum() else f"j{job}"[:64]


class AgentUnavailable(ConnectionError):
    """No agent answers on the socket (absent, stopped, or too slow)."""


class BadReply(AgentUnavailable):
    """The agent's reply is not one (not JSON, not an object, no ``result`` object, over ``MAX_REPLY_BYTES``)."""


class AgentError(RuntimeError):
    """The agent refused a request; ``code`` is its machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


# C0 and C1 control characters but tab: an agent's text goes into the logs of whoever runs its client
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x09}


def agent_text(value, limit: int = 300) -> str:
    """An agent-supplied ``value`` as one bounded line of text: control characters as ``\\xNN``, at most ``limit``
    characters. Usage: ``agent_text("a\\x1b[2J") == "a\\\\x1b[2J"``"""
    text = str(value)[:limit + 1].translate(CONTROL_ESCAPES)
    return text if len(text) <= limit else text[:limit] + "..."


def _not_a_socket(path: str) -> str | None:
    """What ``path`` is where it exists and is no socket ("a directory, not a socket", "a file, not a socket", "not a
    socket"), else None (a socket, or nothing this user may look at). connect() to such a path fails EACCES (a user
    who may not write it) or ECONNREFUSED (root), which said "refuses this user" or "is it running?": until
    2026-11-29 the agent's ``state_dir`` given for its socket sent a non-root user to change socket_group."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return next((f"{kind}, not a socket" for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"))
                 if test(mode)), "not a socket")


class AgentClient:
    """One connection to the agent; requests are synchronous, each bounded by ``timeout`` as a whole (sending and
    reading its reply, however the agent dribbles it) and by ``MAX_REPLY_BYTES``: never blocks training long."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 2.0):
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""
        self._ids = itertools.count(1)

    def connect(self) -> AgentClient:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                self._connect(s)
            except (PermissionError, ConnectionRefusedError, FileNotFoundError) as exc:
                s.close()
                if what := _not_a_socket(self.path):  # a wrong path, not a refusal nor a dead agent
                    raise AgentUnavailable(
                        f"no agent at {self.path}: it is {what} (the agent's default socket: {DEFAULT_SOCKET})") \
                        from None
                if isinstance(exc, PermissionError):
                    raise AgentUnavailable(
                        f"the agent's socket {self.path} refuses this user (permission denied): the agent's "
                        "socket_group and allowed_users/allowed_groups decide who may use it (docs/deploy.md)") \
                        from None
                raise AgentUnavailable(f"no agent at {self.path} ({exc.strerror.lower()}: is it running?)") from None
            except BlockingIOError as exc:  # an agent is there, but leaves its connections unaccepted
                s.close()
                raise AgentUnavailable(
                    f"the agent at {self.path} accepted no connection within {self.timeout} s ({exc.strerror}: its "
                    "backlog is full; is it stopped, stuck or overloaded?)") from None
            except OSError as exc:
                s.close()
                raise AgentUnavailable(f"no agent at {self.path}: {exc}") from None
            self._sock = s
        return self

    def _connect(self, s: socket.socket) -> None:
        """Connect ``s``, waiting up to ``timeout`` while the agent's listen backlog is full: a Unix socket with a
        timeout gets EAGAIN at once then, where a blocking one would wait (another user connecting in a loop filled
        it, and three requests of root's in four failed ``Resource temporarily unavailable``)."""
        deadline = time.monotonic() + (self.timeout if self.timeout is not None else 1e9)
        pause = 0.001
        while True:
            try:
                return s.connect(self.path)
            except BlockingIOError:
                if time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.02)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf = b""

    def __enter__(self) -> AgentClient:
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, op: str, **fields) -> dict:
        """Send one request and return its ``result``; raise AgentError or AgentUnavailable (BadReply for a reply
        that is not one)."""
        self.connect()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._sock.settimeout(self.timeout)  # (the last request's read may have left a sliver of it)
        rid = next(self._ids)
        line = json.dumps({"op": op, "id": rid, **fields}, separators=(",", ":")).encode() + b"\n"
        send_error = None
        try:
            self._sock.sendall(line)
        except OSError as exc:
            # The agent may refuse a connection (forbidden, busy, user_limit) and close it before this request
            # is written: its error line is then already here to read, and says more than "Broken pipe".
            send_error = exc
        self._read_line(send_error, deadline)
        reply_line, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(reply_line)
        except ValueError as exc:  # (UnicodeDecodeError too)
            self._bad(f"not JSON ({exc})")
        if not isinstance(reply, dict):
            self._bad(f"a JSON {type(reply).__name__}, not an object")
        if not reply.get("ok"):
            err = reply.get("error")
            err = err if isinstance(err, dict) else {}
            raise AgentError(agent_text(err.get("code", "error"), 64),
                             agent_text(err.get("message", "unknown error"), 1000))
        if not isinstance(reply.get("result"), dict):
            self._bad("an ok reply without a result object")
        return reply["result"]

    def _bad(self, why: str) -> None:
        self.close()  # what follows on this connection cannot be trusted to line up with the requests
        raise BadReply(f"agent at {self.path} sent a bad reply: {why}")

    def _read_line(self, send_error: OSError | None, deadline: float | None = None) -> None:
        """Read until ``self._buf`` holds a whole reply line, or raise AgentUnavailable (with ``send_error`` when
        sending failed and the agent left no line) once ``deadline`` passes or the line grows over
        ``MAX_REPLY_BYTES`` (BadReply): an agent that sends a byte at a time, or an endless line, is cut off."""
        parts, size = [self._buf], len(self._buf)  # (joined once: each chunk added to the rest copied it all)
        try:
            while b"\n" not in parts[-1]:
                if size > MAX_REPLY_BYTES:
                    self._bad(f"a line over {MAX_REPLY_BYTES} bytes")
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("timed out")
                    self._sock.settimeout(left)
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise send_error or OSError("agent closed the connection")
                parts.append(chunk)
                size += len(chunk)
            self._buf = b"".join(parts)
        except BadReply:
            raise
        except OSError as exc:
            self.close()
            raise AgentUnavailable(f"agent at {self.path}: {send_error or exc}") from None

    def register(self, job: str, level: int, flows: list[dict], rank: int | None = None,
                 run: str | None = None, fds: list[int] | None = None) -> dict:
        """Register ``flows`` (dicts with proto, src, sport, dst, dport) of ``job`` at ``level``; ``run``: a token
        all ranks of this run of the job share, so that the agent can tell another job with the same id apart;
        ``fds``: the fd of this process that holds each flow's socket, in order (``flows.own_flow_fds``): the agent
        then checks those fds alone, not every open file of the process (it reads at most 8,192 of them)."""
        fields = {"job": job, "level": level, "flows": flows}
        if fds is not None:
            fields["fds"] = list(fds)
        if rank is not None:
            fields["rank"] = rank
        if run is not None:
            fields["run"] = run
        try:
            return self.request("register", **fields)
        except AgentError as exc:
            if fds is None or exc.code != "bad_request" or "unknown field 'fds'" not in str(exc):
                raise
        del fields["fds"]  # an agent from before fds (2026-11-28): it reads the process's open files instead
        return self.request("register", **fields)

    def unregister(self, job: str, flows: list[dict] | None = None) -> dict:
        """Remove ``flows`` of ``job``, or all of its flows when ``flows`` is None."""
        return self.request("unregister", job=job, **({"flows": flows} if flows is not None else {}))

    def list(self, job: str | None = None) -> dict:
        """The registered flows (of ``job``), all of them: the agent answers at most ``LIST_PAGE`` per request, each
        reply naming the last flow to ask after (``next``), so this asks page by page until it is null."""
        fields: dict = {"job": job} if job is not None else {}
        flows: list[dict] = []
        for _ in range(MAX_LIST_PAGES):  # each page starts after the last one's flow, in the agent's order
            page = self.request("list", **fields)
            if not isinstance(page.get("flows"), list):
                self._bad("a list page without a list of flows")
            flows += page["flows"]
            if not page.get("next"):
                return {"flows": flows}
            fields["after"] = page["next"]
        raise AgentError("bad_reply", f"list did not end within {MAX_LIST_PAGES} pages")

    def status(self) -> dict:
        return self.request("status")
