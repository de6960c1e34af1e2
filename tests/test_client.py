"""The agent client (tensorlane/client.py) against a plain Unix listener: a connection the agent refuses and
closes before the request is written still raises the agent's error (forbidden, busy), not "Broken pipe"."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading

import pytest

from tensorlane.client import AgentClient, AgentError, AgentUnavailable


def refusing_listener(path: str, line: bytes | None) -> threading.Thread:
    """Accept one connection, send ``line`` (if any) and close it at once, as the agent's ``_refuse`` does."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve():
        with srv:
            conn, _ = srv.accept()
            with conn:
                if line is not None:
                    conn.sendall(line)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("code", ["forbidden", "busy"])
def test_refusal_before_the_request_is_written(tmp_path, code):
    path = str(tmp_path / "agent.sock")
    line = json.dumps({"ok": False, "id": None, "error": {"code": code, "message": f"{code} for test"}}).encode()
    server = refusing_listener(path, line + b"\n")
    client = AgentClient(path, timeout=2.0).connect()
    server.join(2.0)  # the listener has sent its line and closed: the request's write now fails (EPIPE)
    assert not server.is_alive()
    with pytest.raises(AgentError) as err:
        client.request("status")
    assert err.value.code == code and f"{code} for test" in str(err.value)


def test_close_without_a_line_is_unavailable(tmp_path):
    path = str(tmp_path / "agent.sock")
    server = refusing_listener(path, None)
    client = AgentClient(path, timeout=2.0).connect()
    server.join(2.0)
    with pytest.raises(AgentUnavailable, match=str(path)):
        client.request("status")


def test_no_agent_is_unavailable(tmp_path):
    with pytest.raises(AgentUnavailable, match="no agent at"):
        AgentClient(os.fspath(tmp_path / "absent.sock")).connect()


def test_a_socket_that_refuses_this_user_says_so(tmp_path, monkeypatch):
    """A training job that does not run as root, on a socket it may not use (EACCES): the message names the cause
    and where to change it, not "no agent" (the agent is running)."""
    import socket

    def refuse(self, address):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(AgentUnavailable, match=r"refuses this user \(permission denied\).*allowed_groups"):
        AgentClient(os.fspath(tmp_path / "agent.sock")).connect()


@pytest.mark.parametrize("kind", ["directory", "file"])
@pytest.mark.parametrize("errno_", [13, 111])
def test_a_path_that_is_no_socket_says_so(tmp_path, monkeypatch, kind, errno_):
    """The agent's ``state_dir`` (or one of its files) given for its socket: connect() fails EACCES for a user who
    may not write it, ECONNREFUSED for root. Until 2026-11-29 the first said the socket "refuses this user" and
    sent the user to the agent's socket_group (found on the testbed as a non-root user, agent_socket=
    "/run/tensorlane/h1"), the second "is it running?" of a running agent: both now say the path is no socket."""
    import socket

    path = tmp_path / "state"
    path.mkdir() if kind == "directory" else path.write_text("{}")

    def refuse(self, address):
        raise (PermissionError if errno_ == 13 else ConnectionRefusedError)(errno_, os.strerror(errno_))
    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(AgentUnavailable) as err:
        AgentClient(os.fspath(path)).connect()
    assert str(err.value).startswith(f"no agent at {path}: it is a {kind}, not a socket"), err.value
    assert "default socket: /run/tensorlane/agent.sock" in str(err.value) and "socket_group" not in str(err.value)


def test_a_socket_nobody_listens_on_is_no_agent(tmp_path):
    """A socket file left behind by an agent that is gone (ECONNREFUSED on a real socket) stays "no agent"."""
    path = os.fspath(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
    with pytest.raises(AgentUnavailable, match=r"no agent at .*\(connection refused: is it running\?\)"):
        AgentClient(path).connect()


def test_the_verify_table_keeps_its_columns_with_long_job_ids():
    """The shim's own job ids (``job-`` and 12 hex digits) and torchrun's run ids (UUIDs) are longer than 12
    characters: the job column widens to the longest, so the columns after it stay under their headings."""
    from tensorlane.agent.verify import format_report

    row = {"proto": "tcp", "src": "198.18.0.1", "sport": 34267, "dst": "198.18.0.2", "dport": 58222, "level": 3,
           "queue": "7a1:13", "expected_dscp": 18, "seen_dscp": [18], "packets": 4, "verdict": "ok"}
    flows = [dict(row, job="job-3b446be6e099"), dict(row, job="a")]
    header, *rows = format_report({"interface": "eth0", "seconds": 2.0, "flows": flows, "ok": True}).splitlines()[1:4]
    ends = {header.index("queue") + len("queue")} | {r.index("7a1:13") + len("7a1:13") for r in rows}
    assert len(ends) == 1, [header, *rows]


def test_verify_with_no_flow_registered_says_there_was_nothing_to_verify():
    from tensorlane.agent.verify import format_report

    text = format_report({"interface": "eth0", "seconds": 1.0, "flows": [], "queues": {}, "ok": True})
    assert text.splitlines()[-1].startswith("no flows registered with the agent: nothing to verify")
    assert "verified" not in text and len(text.splitlines()) == 2  # no table heading over no rows


def test_verify_names_what_keeps_the_capture_from_starting(monkeypatch, capsys):
    """An interface that is not here, or no raw socket (no CAP_NET_RAW), is one line and exit 1 (both were
    tracebacks); a capture of 0 or fewer seconds is a usage error."""
    from tensorlane.agent import verify
    from tensorlane.cli import main

    with pytest.raises(verify.CaptureError, match="cannot capture on tl-none0: .*not found"):
        verify._capture("tl-none0", 0.1, print)

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("scapy.sendrecv.sniff", refused)
    with pytest.raises(verify.CaptureError, match=r"needs root \(CAP_NET_RAW\)"):
        verify._capture(["eth0"], 0.1, print)
    monkeypatch.setattr(verify, "verify", lambda *a: verify._capture("eth0", 0.1, print))
    assert main(["verify", "--seconds", "1"]) == 1
    assert capsys.readouterr().err.startswith("tensorlane verify: cannot capture")
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            main(["verify", "--seconds", bad])


def fill_backlog(path: str) -> list[socket.socket]:
    """Connections to the listener at ``path`` (which accepts none) until its backlog is full."""
    fillers = []
    for _ in range(64):
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return fillers
        fillers.append(s)
    pytest.fail("the backlog never filled")


def test_connect_waits_while_the_agents_backlog_is_full(tmp_path):
    """A Unix socket with a timeout gets EAGAIN at once when the listener's backlog is full (a blocking one would
    wait): another user connecting and closing in a loop filled the agent's backlog, and three of four of root's
    requests failed "Resource temporarily unavailable". The client now waits up to its timeout for room."""
    import time

    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        fillers = fill_backlog(path)

        def drain():
            time.sleep(0.3)
            for _ in fillers:
                srv.accept()[0].close()
            conn, _ = srv.accept()
            with conn:
                assert conn.recv(1000).startswith(b'{"op":"hello"')
                conn.sendall(b'{"id":1,"ok":true,"result":{"version":"x"}}\n')

        t = threading.Thread(target=drain)
        t.start()
        try:
            with AgentClient(path, timeout=3) as client:
                assert client.request("hello") == {"version": "x"}
        finally:
            t.join(timeout=5)
            for s in fillers:
                s.close()
        fillers = fill_backlog(path)  # nothing accepts now: refused after the timeout, not at once, not hung
        t0 = time.monotonic()
        with pytest.raises(AgentUnavailable, match="Resource temporarily unavailable") as err:
            AgentClient(path, timeout=0.3).connect()
        # (an agent SIGSTOPped mid-run: "no agent at", and the shim's hint to name another socket, misled)
        assert "backlog is full" in str(err.value) and not str(err.value).startswith("no agent at")
        assert 0.25 < time.monotonic() - t0 < 15  # (not < 2: an idle-priority test on a busy machine stalls that long)
        for s in fillers:
            s.close()


@pytest.mark.parametrize("cmd", ["status", "verify"])
def test_status_and_verify_ask_the_socket_the_shim_is_told(tmp_path, monkeypatch, capsys, cmd):
    """``tensorlane status`` and ``verify`` default to ``$TENSORLANE_AGENT_SOCKET``, as the shim does (they asked
    /run/tensorlane/agent.sock whatever it said), ``--socket`` wins, and "no agent" says how to name another."""
    from tensorlane.cli import main

    env_sock, flag_sock = str(tmp_path / "env.sock"), str(tmp_path / "flag.sock")
    monkeypatch.setenv("TENSORLANE_AGENT_SOCKET", env_sock)
    assert main([cmd, "--seconds", "1"] if cmd == "verify" else [cmd]) == 1
    err = capsys.readouterr().err
    assert f"no agent at {env_sock} " in err and "--socket PATH or TENSORLANE_AGENT_SOCKET" in err, err
    assert main([cmd, "--socket", flag_sock]) == 1
    assert f"no agent at {flag_sock} " in capsys.readouterr().err


def test_the_cli_and_the_shim_ask_the_same_socket(monkeypatch):
    """``agent_socket``: an explicit path, else ``$TENSORLANE_AGENT_SOCKET`` where set and not empty (an empty one,
    ``export TENSORLANE_AGENT_SOCKET=``, is the default: the shim once asked the socket "" there while the CLI asked
    the default), else the default; the CLI's ``--socket`` goes through it too."""
    from types import SimpleNamespace

    from tensorlane import cli
    from tensorlane.client import DEFAULT_SOCKET, agent_socket

    monkeypatch.delenv("TENSORLANE_AGENT_SOCKET", raising=False)
    assert agent_socket() == agent_socket(None) == DEFAULT_SOCKET
    monkeypatch.setenv("TENSORLANE_AGENT_SOCKET", "")
    assert agent_socket() == cli._socket(SimpleNamespace(socket=None)) == DEFAULT_SOCKET
    monkeypatch.setenv("TENSORLANE_AGENT_SOCKET", "/run/x.sock")
    assert agent_socket() == cli._socket(SimpleNamespace(socket=None)) == "/run/x.sock"
    assert agent_socket("/run/y.sock") == cli._socket(SimpleNamespace(socket="/run/y.sock")) == "/run/y.sock"


def test_status_writes_what_an_agent_sent_without_terminal_escapes(tmp_path, monkeypatch, capsys):
    """``tensorlane status`` printed the agent's text as it came: an error message or a name with ESC sequences (a
    socket that is not the agent's: ``--socket``, ``$TENSORLANE_AGENT_SOCKET``) could clear, retitle or rewrite
    the terminal of whoever ran it, root. Control characters but newline and tab are written as ``\\xNN`` now;
    ``--json`` escapes them already."""
    from tensorlane import cli
    from tensorlane.client import AgentClient

    path = str(tmp_path / "fake.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)

        def answer():
            conn, _ = srv.accept()
            with conn:
                conn.recv(1000)
                conn.sendall(b'{"id":1,"ok":false,"error":{"code":"internal","message":"\\u001b]0;owned\\u0007'
                             b'\\u001b[2J\\u009b"}}\n')

        t = threading.Thread(target=answer)
        t.start()
        try:
            assert cli.main(["status", "--socket", path]) == 1
        finally:
            t.join(timeout=5)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\x9b" not in err and "\\x1b]0;owned\\x07\\x1b[2J\\x9b" in err
    monkeypatch.setattr(AgentClient, "status", lambda self: {})
    monkeypatch.setattr(AgentClient, "connect", lambda self: self)
    monkeypatch.setattr(cli, "format_status", lambda st: "job a\x1b[31mb:\n\t3 flows")
    assert cli.main(["status", "--socket", path]) == 0
    assert capsys.readouterr().out == "job a\\x1b[31mb:\n\t3 flows\n"


def test_status_into_a_closed_pipe_stops_quietly(tmp_path):
    """``tensorlane status --json | grep -q ...`` (or ``| head``): the reader leaves before the reply is written.
    Until 2026-11-28 that printed a BrokenPipeError traceback from cli.py; now nothing on stderr, exit status 141
    (128 + SIGPIPE), as cat or head give."""
    import subprocess
    import sys

    path = str(tmp_path / "fake.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        proc = subprocess.Popen([sys.executable, "-m", "tensorlane.cli", "status", "--json", "--socket", path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before anything is written
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.recv(1000)
            conn.sendall(json.dumps({"id": 1, "ok": True, "result": {"flows": [0] * 1000}}).encode() + b"\n")
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, err
    assert err == "", err


def misbehaving_listener(path: str, behave) -> threading.Event:
    """Accept one connection, read the request line and hand the connection to ``behave(conn, stop)``; set the
    returned event to end it."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    stop = threading.Event()

    def serve():
        with srv:
            conn, _ = srv.accept()
            with conn, conn.makefile("rb") as lines:
                lines.readline()
                with contextlib.suppress(OSError):
                    behave(conn, stop)
    threading.Thread(target=serve, daemon=True).start()
    return stop


def test_a_reply_sent_a_byte_at_a_time_is_cut_off_at_the_timeout(tmp_path):
    """The timeout bounds the whole request: an agent that sends a byte every 0.1 s never let a 0.5 s timeout
    expire (a recv at a time), and held the shim's keep-alive (and a handle's close()) for as long as it went on."""
    import time

    path = str(tmp_path / "agent.sock")

    def dribble(conn, stop):  # for 30 s: a client that waits it out fails below, rather than hanging
        end = time.monotonic() + 30
        while not stop.wait(0.1) and time.monotonic() < end:
            conn.sendall(b" ")
    stop = misbehaving_listener(path, dribble)
    try:
        start = time.monotonic()
        with pytest.raises(AgentUnavailable, match="timed out"):
            AgentClient(path, timeout=0.5).request("hello")
        assert time.monotonic() - start < 15  # (not < 1.5: a busy machine stalls an idle-priority test that long)
    finally:
        stop.set()


def test_an_endless_reply_line_is_cut_off_at_max_reply_bytes(tmp_path):
    """A 100 MB line (another user's socket, or a broken agent) was read whole into memory, with quadratic copies."""
    from tensorlane.client import MAX_REPLY_BYTES, BadReply

    path = str(tmp_path / "agent.sock")
    sent = []

    def flood(conn, stop):
        chunk = b"x" * (1 << 16)
        while not stop.is_set() and sum(sent) < 100 << 20:
            conn.sendall(chunk)
            sent.append(len(chunk))
    stop = misbehaving_listener(path, flood)
    try:
        with pytest.raises(BadReply, match="over"):
            AgentClient(path, timeout=10.0).request("hello")
        assert sum(sent) < MAX_REPLY_BYTES + (4 << 20)  # (what the socket's buffers held besides)
    finally:
        stop.set()


@pytest.mark.parametrize("line", [b"[1, 2]", b"{not json", b'{"id": 1, "ok": true}',
                                  b'{"id": 1, "ok": true, "result": 3}', b"\xff\xfe", b'"ok"'])
def test_a_reply_that_is_not_one_is_a_bad_reply(tmp_path, line):
    """Each raised AttributeError, KeyError or a bare JSONDecodeError, which the shim's threads did not expect."""
    from tensorlane.client import BadReply

    path = str(tmp_path / "agent.sock")
    stop = misbehaving_listener(path, lambda conn, stop: conn.sendall(line + b"\n") or stop.wait(2))
    try:
        with pytest.raises(BadReply, match="bad reply"):
            AgentClient(path, timeout=2.0).request("hello")
    finally:
        stop.set()


def test_an_error_reply_of_any_shape_is_an_agent_error_in_one_bounded_line(tmp_path):
    path = str(tmp_path / "agent.sock")
    error = {"code": "new_code\x1b[2J", "message": "m\x1b]0;pwned\x07" * 500}
    line = json.dumps({"id": 1, "ok": False, "error": error})
    stop = misbehaving_listener(path, lambda conn, stop: conn.sendall(line.encode() + b"\n") or stop.wait(2))
    try:
        with pytest.raises(AgentError) as err:
            AgentClient(path, timeout=2.0).request("hello")
        assert "\x1b" not in str(err.value) and "\x07" not in str(err.value) and len(str(err.value)) < 1200
        assert err.value.code == "new_code\\x1b[2J"
    finally:
        stop.set()
    path2 = str(tmp_path / "agent2.sock")
    stop = misbehaving_listener(path2, lambda conn, stop: conn.sendall(b'{"id": 1, "ok": false, "error": "x"}\n')
                                or stop.wait(2))
    try:
        with pytest.raises(AgentError, match="unknown error"):
            AgentClient(path2, timeout=2.0).request("hello")
    finally:
        stop.set()


def test_a_broken_pipe_inside_the_agent_is_not_hidden(monkeypatch):
    """Only the reports (status, verify) stop quietly when their reader leaves: a BrokenPipeError from inside the
    agent (a socket or pipe of its own) is a failure, and its traceback is kept (before, the agent exited 141,
    silently, as if a reader had left)."""
    import pytest

    from tensorlane import cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_agent", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["agent", "--interface", "lo"])
