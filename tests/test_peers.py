"""Who is on the other end of the agent's socket (agent/peers.py), on real Unix sockets and real processes.

The kernel records the peer's pid, uid, gid and groups at connect(). A pid outlives its process only as a number:
one that exited before the agent read its /proc entries may name another process by then. The last test makes
that happen (``ns_last_pid``, root) and checks that the agent does not judge the new process's sockets as the
peer's. Every child is bounded in time and reaped.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import tempfile
import time

import pytest
from test_jobs_agent import make_api

from tensorlane.agent.peers import credentials

NOBODY = 65534


@contextlib.contextmanager
def listener():
    """A listening Unix socket any user may connect to (pytest's own temporary directories are root's alone)."""
    with tempfile.TemporaryDirectory(prefix="tl-peers-") as d:
        os.chmod(d, 0o755)
        path = os.path.join(d, "agent.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(4)
        srv.settimeout(10)
        try:
            yield srv, path
        finally:
            srv.close()


def connect_and_exit(path: str, uid: int | None = None) -> int:
    """Fork a child that connects to ``path`` (as ``uid``) and exits at once; reaped. Returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery from here on
        code = 1
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return pid


def test_credentials_carry_the_groups_the_kernel_recorded_at_connect():
    with listener() as (srv, path), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(path)
        conn, _ = srv.accept()
        with conn:
            peer = credentials(conn)
            assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
            assert set(peer.gids) == set(os.getgroups())
            with peer.pinned():  # alive throughout: nothing raised
                pass


def test_a_peer_that_exited_is_gone_even_before_its_pid_is_reused():
    with listener() as (srv, path):
        pid = connect_and_exit(path)
        conn, _ = srv.accept()
        with conn:
            peer = credentials(conn)
            assert peer.pid == pid
            with pytest.raises(ProcessLookupError), peer.pinned():
                pass


def _reuse_pid(pid: int, lifetime_s: float) -> int | None:
    """Fork a child that gets ``pid`` (``ns_last_pid``: root) and sleeps at most ``lifetime_s``; None if another
    process took the pid first each time (bounded tries)."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
        child = os.fork()
        if child == 0:  # the child: no pytest machinery from here on
            try:
                signal.alarm(int(lifetime_s))
                signal.pause()
            finally:
                os._exit(0)
        if child == pid:
            return child
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    return None


@pytest.mark.netns  # root: ns_last_pid, and a client of another user
def test_a_peer_whose_pid_now_names_another_process_is_not_judged_by_its_sockets():
    """nobody connects and exits; its pid is given to a process that holds a real TCP connection. Registering that
    connection's flow as nobody (ownership checked) is refused: judged by the pid alone, the new process's socket
    passed as nobody's."""
    with socket.socket() as lst, socket.socket() as cli:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        cli.connect(lst.getsockname())
        srv_side, _ = lst.accept()
        key = {"proto": "tcp", "src": "127.0.0.1", "sport": cli.getsockname()[1], "dst": "127.0.0.1",
               "dport": lst.getsockname()[1]}
        with srv_side, listener() as (srv, path):
            pid = connect_and_exit(path, uid=NOBODY)
            conn, _ = srv.accept()
            holder = _reuse_pid(pid, lifetime_s=60)  # inherits the TCP connection: its /proc shows the socket
            assert holder is not None, "pid could not be reused in 20 tries (another process took it each time)"
            try:
                with conn:
                    peer = credentials(conn)
                    assert (peer.pid, peer.uid) == (holder, NOBODY)
                    api, rec = make_api(check_ownership=True)
                    msg = {"op": "register", "job": "squat", "level": 0, "flows": [key]}
                    reply = json.loads(api.handle(json.dumps(msg).encode(), peer))
                    assert not reply["ok"] and reply["error"]["code"] == "not_owner", reply
                    assert "is gone" in reply["error"]["message"] and rec.kernel == {}, reply
            finally:
                os.kill(holder, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while os.waitpid(holder, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                    time.sleep(0.01)


def test_a_uids_name_is_looked_up_once_in_a_while(monkeypatch):
    """Every connection asks its peer's name (access, limits, log lines): a user connecting and closing in a loop
    made the passwd lookup a quarter of the agent's work. Names are remembered for ``NAME_TTL_S``."""
    import pwd

    from tensorlane.agent import peers

    calls = []
    real = pwd.getpwuid
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: calls.append(uid) or real(uid))
    monkeypatch.setattr(peers, "_names", {})
    clock = [100.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: clock[0])
    assert peers.Peer(1, 0, 0).user == "root" == peers.Peer(2, 0, 0).user
    assert peers.Peer(3, 2**31 - 7, 0).user == str(2**31 - 7)  # no such user: its number
    assert calls == [0, 2**31 - 7]
    clock[0] += peers.NAME_TTL_S
    assert peers.Peer(1, 0, 0).user == "root" and calls == [0, 2**31 - 7, 0]


def test_a_uid_of_a_users_subordinate_range_is_that_user(tmp_path, monkeypatch):
    """A user runs processes as any uid of its ``/etc/subuid`` range (``newuidmap``; ``newgidmap`` keeps its own
    group, so an ``allowed_groups`` member stays allowed): each such uid had a user's limits of its own (connections,
    requests, flows, jobs), so one user had 65,536 times them. Now the agent counts such a uid as its user; a uid
    with a passwd entry of its own, and root, stay themselves."""
    from tensorlane.agent import peers

    subuid = tmp_path / "subuid"
    subuid.write_text("nobody:300000:65536\n")
    monkeypatch.setattr(peers, "SUBUID", str(subuid))
    with listener() as (srv, path):
        for uid, counted_as in ((300007, NOBODY), (NOBODY, NOBODY), (1, 1), (0, 0)):
            pid = os.fork()
            if pid == 0:  # a child that connects as ``uid`` and waits for the parent to read its credentials
                try:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(uid)
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(path)
                        s.settimeout(10)
                        s.recv(1)
                finally:
                    os._exit(0)
            conn, _ = srv.accept()
            with conn:
                peer = credentials(conn)
                conn.send(b"x")
            os.waitpid(pid, 0)
            assert (peer.pid, peer.uid, peer.user) == (pid, counted_as, peers.user_name(counted_as)), uid


def test_a_uid_of_roots_subordinate_range_is_not_root(tmp_path, monkeypatch):
    """Root's own ``/etc/subuid`` range (LXD's ``root:1000000:1000000000``, containers root starts) holds the uids
    of processes that are not root's to trust: such a uid was counted as root, and had root's rights in the agent
    (any flow, any level, no ownership check). It, and one of the agent's user's range, stay themselves."""
    from tensorlane.agent import peers

    subuid = tmp_path / "subuid"
    subuid.write_text(f"root:300000:65536\n{os.geteuid()}:400000:65536\nnobody:500000:65536\n")
    monkeypatch.setattr(peers, "SUBUID", str(subuid))
    assert peers.account_uid(300007) == 300007
    assert peers.account_uid(400007) == 400007
    assert peers.account_uid(500007) == NOBODY


def test_a_peers_groups_are_read_from_its_status_where_the_kernel_did_not_tell_them():
    """``Peer.groups`` where SO_PEERGROUPS gave none (more than 256 groups): the process's ``Groups`` line of
    ``/proc/PID/status`` (``proc_status``, the reader the hand-over's owners are read with too); a process that is
    gone keeps its primary group only."""
    import grp

    from tensorlane.agent.peers import Peer, proc_status

    assert int(proc_status(os.getpid())["Uid"].split()[1]) == os.geteuid()
    assert proc_status("self")["Groups"].split() == [str(g) for g in sorted(os.getgroups())]

    def name(g: int) -> str:
        try:
            return grp.getgrgid(g).gr_name
        except KeyError:
            return str(g)

    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # (a process of a few groups of its own, held until killed)
        try:
            os.setgroups([1, 2, 3])
            os.write(ready_w, b"1")
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        assert Peer(child, 0, 0, gids=None).groups() == {name(g) for g in (0, 1, 2, 3)}
    finally:
        os.close(ready_r)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert Peer(child, 0, 0, gids=None).groups() == {name(0)}
