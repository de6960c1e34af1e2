"""shim.flows on loopback with real sockets (no privileges, no torch)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tensorlane.flows import flow_key, new_flows, own_tcp_flows, parse_proc_net_tcp


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


class Pair:
    """A listening socket, a client connected to it and the accepted server end; closed on exit."""

    def __init__(self, family=socket.AF_INET, listen_addr="127.0.0.1", connect_addr=None, v6only=None):
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        if v6only is not None:
            self.listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        self.listener.bind((listen_addr, 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.client = socket.create_connection((connect_addr or listen_addr, self.port), timeout=5)
        self.server, _ = self.listener.accept()
        self.cport = self.client.getsockname()[1]

    def close(self):
        for s in (self.client, self.server, self.listener):
            if s is not None:
                s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_ipv4_both_directions_listed():
    with Pair() as p:
        flows = own_tcp_flows()
        assert {"proto": "tcp", "src": "127.0.0.1", "sport": p.cport, "dst": "127.0.0.1", "dport": p.port} in flows
        assert {"proto": "tcp", "src": "127.0.0.1", "sport": p.port, "dst": "127.0.0.1", "dport": p.cport} in flows
        # the listener is not established: only the two connected ends use the port
        assert sum(1 for f in flows if p.port in (f["sport"], f["dport"])) == 2


def test_closed_sockets_disappear_and_new_flows():
    before = own_tcp_flows()
    with Pair() as p:
        during = own_tcp_flows()
        added = new_flows(before, during)
        assert {flow_key(f) for f in added} >= {
            ("tcp", "127.0.0.1", p.cport, "127.0.0.1", p.port),
            ("tcp", "127.0.0.1", p.port, "127.0.0.1", p.cport),
        }
        ports = (p.port, p.cport)
    after = own_tcp_flows()
    assert not [f for f in after if f["sport"] in ports and f["dport"] in ports]


def test_new_flows_keeps_order_and_dedups():
    a = {"proto": "tcp", "src": "10.0.0.1", "sport": 1, "dst": "10.0.0.2", "dport": 2}
    b = {"proto": "tcp", "src": "10.0.0.1", "sport": 3, "dst": "10.0.0.2", "dport": 4}
    c = {"src": "10.0.0.1", "sport": 5, "dst": "10.0.0.3", "dport": 6}
    assert new_flows([a], [b, a, c, dict(b)]) == [b, c]
    assert new_flows([], []) == []


def test_remote_filter_forms():
    with Pair() as p, Pair(listen_addr="127.0.0.2") as q:
        everything = own_tcp_flows()
        assert any(f["dst"] == "127.0.0.2" for f in everything)
        only2 = own_tcp_flows(remote_filter="127.0.0.2")
        assert only2 and all(f["dst"] == "127.0.0.2" for f in only2)
        assert {f["sport"] for f in only2} == {q.cport}
        assert own_tcp_flows(remote_filter=["127.0.0.2", "127.0.0.3"]) == only2
        assert own_tcp_flows(remote_filter="127.0.0.0/30") == [f for f in everything if f["dst"] in
                                                                ("127.0.0.1", "127.0.0.2", "127.0.0.3")]
        assert own_tcp_flows(remote_filter=lambda f: f["dport"] == p.port) == [
            {"proto": "tcp", "src": "127.0.0.1", "sport": p.cport, "dst": "127.0.0.1", "dport": p.port}]
        assert own_tcp_flows(remote_filter=[]) == []


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback in this kernel")
def test_ipv6_loopback():
    with Pair(family=socket.AF_INET6, listen_addr="::1") as p:
        flows = own_tcp_flows(remote_filter="::1")
        assert {"proto": "tcp", "src": "::1", "sport": p.cport, "dst": "::1", "dport": p.port} in flows


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback in this kernel")
def test_ipv4_mapped_dual_stack_is_reported_as_ipv4():
    # A dual-stack IPv6 listener accepting an IPv4 client: the server end is a tcp6 row with ::ffff:127.0.0.1.
    with Pair(family=socket.AF_INET6, listen_addr="::", connect_addr="127.0.0.1", v6only=False) as p:
        flows = own_tcp_flows()
        server_end = {"proto": "tcp", "src": "127.0.0.1", "sport": p.port, "dst": "127.0.0.1", "dport": p.cport}
        client_end = {"proto": "tcp", "src": "127.0.0.1", "sport": p.cport, "dst": "127.0.0.1", "dport": p.port}
        assert server_end in flows and client_end in flows
        assert not any("ffff" in f["src"] or "ffff" in f["dst"] for f in flows)
        assert own_tcp_flows(remote_filter="::ffff:127.0.0.1") == own_tcp_flows(remote_filter="127.0.0.1")


@contextlib.contextmanager
def connected_child(closes_on_line: bool = False):
    """A child process connected over TCP to a listener of this one on 127.0.0.1: yields (child, the listener's
    port, the child's port) once the connection is accepted, and reaps the child on exit (its stdin closed). With
    ``closes_on_line``, a line written to its stdin makes it close its socket and print ``closed``."""
    closing = 'sys.stdin.readline()\ns.close()\nprint("closed", flush=True)\n' if closes_on_line else ""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", "import socket, sys\n"
                                  f"s = socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                                  "print(s.getsockname()[1], flush=True)\n" + closing + "sys.stdin.read()\n"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            conn, _ = listener.accept()
            with conn:
                yield child, port, int(child.stdout.readline())
        finally:
            child.stdin.close()
            child.wait(timeout=10)
            child.stdout.close()


def test_other_process_by_pid():
    with connected_child() as (child, port, cport):
        theirs = own_tcp_flows(pid=child.pid)
        assert theirs == [{"proto": "tcp", "src": "127.0.0.1", "sport": cport, "dst": "127.0.0.1", "dport": port}]
        mine = own_tcp_flows()
        assert {"proto": "tcp", "src": "127.0.0.1", "sport": port, "dst": "127.0.0.1", "dport": cport} in mine
        assert not any(f["sport"] == cport for f in mine)


def test_parse_rows_byte_order_and_state():
    text = textwrap.dedent("""\
          sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
           0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0
           1: 010012C6:9C40 020012C6:0FA0 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1
        garbage line
        """)
    rows = parse_proc_net_tcp(text)
    if sys.byteorder == "little":
        assert [(r[0], r[1], str(r[2][0]), r[2][1], str(r[3][0]), r[3][1]) for r in rows] == [
            (111, 0x0A, "127.0.0.1", 8080, "0.0.0.0", 0),
            (222, 0x01, "198.18.0.1", 40000, "198.18.0.2", 4000),
        ]
    text6 = textwrap.dedent("""\
          sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
           0: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000200007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0 20 4 30 10 -1
           1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:A001 01 00000000:00000000 00:00000000 00000000     0        0 444 1 0 20 4 30 10 -1
        """)
    rows6 = parse_proc_net_tcp(text6, v6=True)
    if sys.byteorder == "little":
        assert [(str(r[2][0]), str(r[3][0]), r[3][1]) for r in rows6] == [
            ("127.0.0.1", "127.0.0.2", 0xA000), ("::1", "::1", 0xA001)]


def test_parse_rows_filtered_by_inode():
    """With ``inodes`` only those sockets' rows come back (the agent's sweep reads its tables so, once per pass)."""
    text = textwrap.dedent("""\
          sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
           0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0
           1: 010012C6:9C40 020012C6:0FA0 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1
           2: ZZZZZZZZ:9C40 020012C6:0FA0 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0 20 4 30 10 -1
        """)
    assert [r[0] for r in parse_proc_net_tcp(text)] == [111, 222]  # the unparsable row is skipped
    assert [r[0] for r in parse_proc_net_tcp(text, inodes={222, 333, 999})] == [222]
    assert parse_proc_net_tcp(text, inodes=set()) == []
    uids: dict[int, int] = {}
    assert [r[0] for r in parse_proc_net_tcp(text, uids=uids)] == [111, 222]
    assert uids == {111: 0, 222: 0}


def test_the_uids_listening_on_a_port_are_read_from_the_agents_tables():
    """``listening_uids``: the users whose TCP sockets listen on a port of this namespace, IPv4 and IPv6 alike (the
    metrics port found in use: root's or the agent's listener is a configuration error, another user's is not);
    a port connected to but not listened on has none."""
    import socket

    from tensorlane.agent.ownership import listening_uids

    with socket.socket() as s4, socket.socket(socket.AF_INET6) as s6:
        s4.bind(("127.0.0.1", 0))
        s4.listen()
        s6.bind(("::1", 0))
        s6.listen()
        assert listening_uids(s4.getsockname()[1]) == {os.geteuid()}
        assert listening_uids(s6.getsockname()[1]) == {os.geteuid()}
        with socket.create_connection(s4.getsockname()) as c:
            assert listening_uids(c.getsockname()[1]) == set()


def test_agent_side_ownership_uses_the_callers_namespace_tables():
    """agent.ownership finds a process's sockets through the CALLER's (the agent's) /proc/self/net tables: a
    child in the same namespace owns its connection, a closed connection is owned by no one."""
    from tensorlane.agent.ownership import agent_sockets, inodes_of, not_owned, not_owned_by_owners
    from tensorlane.agent.protocol import FlowKey

    with connected_child(closes_on_line=True) as (child, port, cport):
        key = FlowKey("tcp", "127.0.0.1", cport, "127.0.0.1", port)
        other = FlowKey("tcp", "127.0.0.1", cport + 1 if cport < 65535 else 1, "127.0.0.1", port)
        assert ("tcp", "127.0.0.1", cport, "127.0.0.1", port, 1) in agent_sockets(inodes_of(child.pid)).values()
        assert not_owned(child.pid, [key, other]) == [other]
        assert not_owned_by_owners({child.pid: [key]}) == []
        assert not_owned(child.pid, [key], table={}) == [key]  # a table without its socket: not owned
        assert len(agent_sockets()) >= 2
        child.stdin.write("close\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
        assert not_owned_by_owners({child.pid: [key]}) == [key]
    assert not_owned(child.pid, [key]) == [key]  # gone
    assert not_owned_by_owners({child.pid: [key]}) == [key]


def test_a_process_with_too_many_open_files_is_not_read(monkeypatch):
    """Each register and sweep read the owner's open files, a readlink each (3-8 us): a process with a million of
    them (RLIMIT_NOFILE allows it; 19,000 here cost 160 ms) stalled the agent's one loop for seconds at each of its
    registers (200 a second) and sweeps (2 a second). Now a register from a process with more than MAX_OWNER_FDS is
    refused ``limit`` before any link is read, a sweep drops the flows of such an owner (it may open them after
    registering) and reads at most SWEEP_FDS open files in all, the other owners left to a later pass."""
    from test_jobs_agent import make_api

    from tensorlane.agent import ownership
    from tensorlane.agent.peers import Peer
    from tensorlane.agent.protocol import FlowKey

    monkeypatch.setattr(ownership, "MAX_OWNER_FDS", 200)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        flow = {"proto": "udp", "src": "127.0.0.1", "sport": port, "dst": "127.0.0.2", "dport": 9}
        key = FlowKey("udp", "127.0.0.1", port, "127.0.0.2", 9)
        api, _ = make_api()
        me = Peer(os.getpid(), 65534, 65534)
        assert ownership.not_owned_by_owners({os.getpid(): [key]}) == []  # few files: read, owned
        extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(250)]
        try:
            reply = json.loads(api.handle(json.dumps({"op": "register", "job": "j", "level": 0,
                                                      "flows": [flow]}).encode(), me))
            assert reply["ok"] is False and reply["error"]["code"] == "limit", reply
            assert "more than 200 open files" in reply["error"]["message"] and not api.table.flows
            assert ownership.not_owned_by_owners({os.getpid(): [key]}) == [key]  # (opened after registering)
        finally:
            for fd in extra:
                os.close(fd)
        monkeypatch.setattr(ownership, "SWEEP_FDS", 1)
        read = []
        assert ownership.not_owned_by_owners({os.getpid(): [key], 1: [key]}, read) == [] and read == [os.getpid()]


def test_a_sweep_counts_the_open_files_it_read_not_the_sockets(monkeypatch):
    """SWEEP_FDS bounds the open files one sweep reads (a readlink each): an owner holding many files that are not
    sockets costs as many. Counting only its sockets let 512 owners of 8,192 other files each cost 4 million
    readlinks in one pass; now the owners after one that used up the budget wait for a later pass."""
    from tensorlane.agent import ownership
    from tensorlane.agent.protocol import FlowKey

    gone = subprocess.Popen(["true"])
    gone.wait()
    key = FlowKey("udp", "127.0.0.1", 9, "127.0.0.2", 9)
    monkeypatch.setattr(ownership, "SWEEP_FDS", 100)
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(150)]
    try:
        read: list[int] = []
        ownership.not_owned_by_owners({os.getpid(): [key], gone.pid: [key]}, read)
        assert read == [os.getpid()]  # (its 150+ files were the pass's budget: the other owner waits)
    finally:
        for fd in extra:
            os.close(fd)
    read = []
    assert ownership.not_owned_by_owners({os.getpid(): [key], gone.pid: [key]}, read) == [key, key]
    assert read == [os.getpid(), gone.pid]  # (few files now: both judged)

def test_a_register_of_udp_flows_beyond_the_port_dumps_says_how_many_it_may_name():
    """Three IPv4 ports whose exact lookup finds another socket take six port dumps (IPv4 and dual-stack IPv6 sockets
    of each): refused ``limit``, whose message said "more source ports than the 4 the agent looks at", so a client
    that sent 3 ports (or 4) per request was refused again and again."""
    import contextlib

    from test_jobs_agent import make_api

    from tensorlane.agent.peers import Peer

    with contextlib.ExitStack() as stack:
        flows, fds = [], []
        for _ in range(3):
            with made_as(65534):  # (the peer's user's sockets)
                mine, theirs = (stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
                                for _ in range(2))
            for s in (mine, theirs):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mine.bind(("0.0.0.0", 0))
            theirs.bind(("127.0.0.1", mine.getsockname()[1]))  # it wins the exact lookup
            flows.append({"proto": "udp", "src": "127.0.0.1", "sport": mine.getsockname()[1], "dst": "127.0.0.2",
                          "dport": 9})
            fds.append(mine.fileno())
        api, _ = make_api()
        reply = json.loads(api.handle(json.dumps({"op": "register", "job": "j", "level": 0, "flows": flows,
                                                  "fds": fds}).encode(), Peer(os.getpid(), 65534, 65534)))
    assert reply["ok"] is False and reply["error"]["code"] == "limit" and not api.table.flows, reply
    assert "an IPv4 flow's port takes two" in reply["error"]["message"], reply


def test_sock_diag_finds_a_tcp_socket_by_its_5_tuple():
    """The agent's exact lookup (netlink sock_diag): state and inode of a connection of this namespace, by 5-tuple,
    also through a dual-stack (v4-mapped) socket; nothing for a 5-tuple no socket has."""
    import os
    import socket

    from tensorlane.agent.kernel.sockdiag import SockDiag

    diag = SockDiag()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c, srv.accept()[0], \
                socket.socket(socket.AF_INET6) as c6:
            c6.connect(("::ffff:127.0.0.1", port))
            with srv.accept()[0]:
                sport, sport6 = c.getsockname()[1], c6.getsockname()[1]
                assert diag.tcp("127.0.0.1", sport, "127.0.0.1", port) == (1, os.fstat(c.fileno()).st_ino, os.geteuid())
                assert diag.tcp("127.0.0.1", sport6, "127.0.0.1", port) == (1, os.fstat(c6.fileno()).st_ino, os.geteuid())
                assert diag.tcp("127.0.0.1", sport, "127.0.0.2", port) is None
    diag.close()

def test_sweep_chooses_lookups_by_the_namespaces_socket_count(monkeypatch):
    """``tcp_rows`` counts this namespace's TCP sockets (sockstat, no table walk); beyond EXACT_LOOKUPS_MAX flows
    the exact lookups are kept while the tables hold ROWS_PER_LOOKUP rows per flow, so that on a busy host the
    sweep's cost follows the registered flows, not the host's sockets."""
    from tensorlane.agent import ownership

    before = ownership.tcp_rows()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        pairs = [(socket.create_connection(srv.getsockname()), srv.accept()[0]) for _ in range(50)]
        assert ownership.tcp_rows() >= before + 50  # 100 opened: slack for other processes here
        for c, s in pairs:
            c.close()
            s.close()
    assert ownership.lookups_cheaper(ownership.EXACT_LOOKUPS_MAX)
    monkeypatch.setattr(ownership, "tcp_rows", lambda proc="self": 20000)
    assert ownership.lookups_cheaper(20000 // ownership.ROWS_PER_LOOKUP)
    monkeypatch.setattr(ownership, "tcp_rows", lambda proc="self": 300)
    assert not ownership.lookups_cheaper(ownership.EXACT_LOOKUPS_MAX + 1)

def test_a_udp_wildcard_socket_owns_flows_of_its_own_family_only():
    """An unconnected UDP socket bound to a wildcard owns the UDP flows of its port, but only of its family. Before,
    a user's socket on 0.0.0.0:P owned the IPv6 flow of another user's socket on [fd00::1]:P (and an IPV6_V6ONLY
    socket on [::]:P the IPv4 flow of one on 198.18.0.1:P): the kernel lets those sockets coexist, so the user
    could register the other's flow first at the least urgent level, and the owner was refused ``conflict``."""
    from tensorlane.agent.ownership import not_owned, owns
    from tensorlane.agent.protocol import FlowKey

    v4 = FlowKey("udp", "198.18.0.1", 5555, "198.18.0.2", 6666)
    v6 = FlowKey("udp", "fd00::1", 5555, "fd00::2", 6666)
    any4 = [("udp", "0.0.0.0", 5555, "0.0.0.0", 0, 7)]
    any6 = [("udp", "::", 5555, "::", 0, 7)]
    assert owns(v4, any4) and not owns(v6, any4)
    assert owns(v6, any6) and not owns(v4, any6)
    assert owns(v4, [("udp", "198.18.0.1", 5555, "198.18.0.2", 6666, 1)])  # bound and connected: as before
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s4, \
            socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s6:
        s4.bind(("0.0.0.0", 0))
        port = s4.getsockname()[1]
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s6.bind(("::", port))  # (the kernel lets the two share the port)
        mine4, mine6 = v4._replace(sport=port), v6._replace(sport=port)
        assert not_owned(os.getpid(), [mine4, mine6]) == []  # each by the socket of its family
        s6.close()
        assert not_owned(os.getpid(), [mine4, mine6]) == [mine6]  # the IPv4 socket does not own the IPv6 flow

def test_own_flows_asked_of_the_sockets_equal_the_namespaces_tables():
    """The caller's flows come from its own sockets (getsockname, getpeername, TCP_INFO), another process's from
    the tables of /proc/PID/net: both give the same flows, IPv4, IPv6 and a dual-stack listener's IPv4-mapped ends
    (as IPv4) alike, and leave out listeners, a half-closed connection and sockets of other kinds."""
    import socket

    srv = socket.socket(socket.AF_INET6)
    srv.bind(("::", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    held = [srv, socket.socket(socket.AF_UNIX), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)]
    try:
        for addr in ("127.0.0.1", "::1", "127.0.0.2"):
            held.append(socket.create_connection((addr, port), timeout=5))
            held.append(srv.accept()[0])
        closing = socket.create_connection(("127.0.0.1", port), timeout=5)
        peer = srv.accept()[0]
        held.append(peer)
        closing.close()  # peer: CLOSE_WAIT, no longer established
        mine = own_tcp_flows()
        assert mine == own_tcp_flows(pid=os.getpid())
        ends = {(f["src"], f["dst"]) for f in mine if port in (f["sport"], f["dport"])}
        assert ends == {("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("127.0.0.1", "127.0.0.2"),
                        ("127.0.0.2", "127.0.0.1")}, mine
        assert sum(1 for f in mine if port in (f["sport"], f["dport"])) == 6
    finally:
        for s in held:
            s.close()

def test_own_flows_leave_the_sockets_blocking_under_a_default_timeout():
    """socket.setdefaulttimeout() set by the training script: asking the process's own sockets must not put them
    (the same open files as the duplicates asked) in non-blocking mode."""
    import fcntl
    import socket as socket_mod

    srv = socket_mod.create_server(("127.0.0.1", 0))
    c = socket_mod.create_connection(srv.getsockname())
    s, _ = srv.accept()
    u1, u2 = socket_mod.socketpair()
    v6 = socket_mod.socket(socket_mod.AF_INET6)
    before = socket_mod.getdefaulttimeout()
    try:
        socket_mod.setdefaulttimeout(5.0)
        flows = own_tcp_flows()
    finally:
        socket_mod.setdefaulttimeout(before)
    try:
        assert {"proto": "tcp", "src": "127.0.0.1", "sport": c.getsockname()[1], "dst": "127.0.0.1",
                "dport": srv.getsockname()[1]} in flows
        for sock in (c, s, u1, v6):
            assert not fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        for sock in (srv, c, s, u1, u2, v6):
            sock.close()

def test_a_flow_registered_with_its_fd_is_checked_by_that_fd_alone(monkeypatch):
    """A register that names each flow's fd (``fds``) is checked by one readlink per flow and the flow's own socket
    (a sock_diag lookup, a UDP port dump): a training process with more open files than MAX_OWNER_FDS (dataset
    shards, DataLoader's file_descriptor sharing) registers and keeps its flows at every sweep, however many it
    opens later. Before, it was refused ``limit`` and a sweep dropped its flows. An fd that does not hold the flow's
    socket is ``not_owner``; an fd closed and reused by another socket loses the flow at the next sweep."""
    from test_jobs_agent import make_api

    from tensorlane.agent import ownership
    from tensorlane.agent.peers import Peer

    def ask(msg):
        return json.loads(api.handle(json.dumps(msg).encode(), me))

    monkeypatch.setattr(ownership, "MAX_OWNER_FDS", 200)
    api, _ = make_api()
    me = Peer(os.getpid(), 65534, 65534)
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(250)]
    with made_as(65534):  # (the peer's user's sockets)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        u.bind(("127.0.0.1", 0))
        with made_as(65534):
            c = socket.socket()
        c.connect(srv.getsockname())
        peer = srv.accept()[0]
        udp = {"proto": "udp", "src": "127.0.0.1", "sport": u.getsockname()[1], "dst": "127.0.0.2", "dport": 9}
        tcp = {"proto": "tcp", "src": "127.0.0.1", "sport": c.getsockname()[1], "dst": "127.0.0.1",
               "dport": srv.getsockname()[1]}
        register = {"op": "register", "job": "j", "level": 0, "flows": [udp, tcp]}
        reply = ask(register)  # without fds: the whole fd table is read, and it is too large
        assert reply["error"]["code"] == "limit" and "fds" in reply["error"]["message"], reply
        reply = ask({**register, "fds": [c.fileno(), u.fileno()]})  # crossed: neither fd holds its flow's socket
        assert reply["error"]["code"] == "not_owner" and f"fd {c.fileno()} of process" in reply["error"]["message"]
        assert not api.table.flows
        reply = ask({**register, "fds": [u.fileno(), c.fileno()]})
        assert reply["ok"], reply
        more = [os.open(os.devnull, os.O_RDONLY) for _ in range(250)]  # opened after registering: nothing lost
        extra += more
        assert api.sweep() == 0 and len(api.table.flows) == 2
        fd = c.fileno()
        c.close()  # its fd number taken by another socket: not the flow's
        other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        assert other.fileno() == fd
        try:
            api.sweep()  # (the flow's socket may still be sending its FIN: then it drains, no longer the process's)
            assert [k.proto for k in api.table.flows if k not in api.table.draining] == ["udp"]
            assert [k.proto for keys in api.table.by_pid.values() for k in keys] == ["udp"]
        finally:
            other.close()
        peer.close()
    finally:
        for fd in extra:
            os.close(fd)
        u.close()
        srv.close()

def test_a_flow_registered_without_fds_is_swept_by_the_fd_found_at_its_register(monkeypatch):
    """A register without ``fds`` reads the process's open files once, and the flow keeps the fd found holding its
    socket: each sweep checks that fd alone (one readlink), as for a flow whose fd the client named. Before, every
    sweep read all of each such owner's open files again: five processes of one user with 8,150 open files and a
    flow each (under MAX_OWNER_FDS) made each sweep read 32,768 files, the agent's loop at a third of a core and
    root's ``hello`` waiting up to 1.9 s (p99 1.8 s; 51 ms since). A socket moved to another fd since keeps its flow:
    the client named no fd, so a found fd that no longer holds the socket has the process's open files read again
    (once: the fd found then is kept); a socket closed for good loses its flow."""
    from test_jobs_agent import make_api

    from tensorlane.agent import ownership
    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    me = Peer(os.getpid(), 65534, 65534)
    with made_as(65534):  # (the peer's user's sockets)
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c = socket.socket()
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        u.bind(("127.0.0.1", 0))
        c.connect(srv.getsockname())
        peer = srv.accept()[0]
        udp = {"proto": "udp", "src": "127.0.0.1", "sport": u.getsockname()[1], "dst": "127.0.0.2", "dport": 9}
        tcp = {"proto": "tcp", "src": "127.0.0.1", "sport": c.getsockname()[1], "dst": "127.0.0.1",
               "dport": srv.getsockname()[1]}
        reply = json.loads(api.handle(json.dumps({"op": "register", "job": "j", "level": 0,
                                                  "flows": [udp, tcp]}).encode(), me))
        assert reply["ok"], reply
        assert sorted((k.proto, e.fd) for k, e in api.table.flows.items()) == [("tcp", c.fileno()),
                                                                              ("udp", u.fileno())]
        reads = []
        real = ownership.socket_fds
        monkeypatch.setattr(ownership, "socket_fds", lambda *a, **kw: (reads.append(a), real(*a, **kw))[1])
        assert api.sweep() == 0 and len(api.table.flows) == 2
        assert reads == []  # no open-file table read: one link per flow
        moved = os.dup(c.fileno())  # the socket on another fd, the fd found closed: the process still holds it, and
        c.close()  # the client named no fd (until 2026-11-28 the flow went: flow state lost on a dup2/close)
        try:
            assert api.sweep() == 0 and len(api.table.flows) == 2
            assert {(k.proto, e.fd) for k, e in api.table.flows.items()} == {("tcp", moved), ("udp", u.fileno())}
            reads.clear()
            assert api.sweep() == 0 and reads == []  # (found again: one link a flow from then on)
        finally:
            os.close(moved)
        api.sweep()  # closed for good: the flow goes
        assert [k.proto for k in api.table.flows if k not in api.table.draining] == ["udp"]
        peer.close()
    finally:
        u.close()
        srv.close()


def test_udp_ownership_reads_no_socket_table(monkeypatch):
    """UDP flows are judged on the sockets of their source port, asked of the kernel (a sock_diag dump filtered by
    port), with or without fds: the namespace's UDP table (``/proc/self/net/udp``: 660 ms at 19,000 sockets, at
    each register and sweep) is not read. The UDP rule is unchanged: bound to the source or to the wildcard of the
    flow's own family, connected to the destination or not at all."""
    from tensorlane.agent import ownership
    from tensorlane.agent.protocol import FlowKey

    def no_tables(*a, **kw):
        raise AssertionError("read the namespace's socket tables")

    monkeypatch.setattr(ownership, "agent_sockets", no_tables)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s4, \
            socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s6, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as conn:
        s4.bind(("0.0.0.0", 0))
        port = s4.getsockname()[1]
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s6.bind(("::", port))
        conn.bind(("127.0.0.1", 0))
        conn.connect(("127.0.0.3", 7))
        mine4 = FlowKey("udp", "198.18.0.1", port, "198.18.0.2", 6666)
        mine6 = FlowKey("udp", "fd00::1", port, "fd00::2", 6666)
        cport = conn.getsockname()[1]
        connected = FlowKey("udp", "127.0.0.1", cport, "127.0.0.3", 7)
        elsewhere = FlowKey("udp", "127.0.0.1", cport, "127.0.0.4", 7)
        assert ownership.not_owned(os.getpid(), [mine4, mine6, connected, elsewhere]) == [elsewhere]
        assert ownership.not_owned_by_owners({os.getpid(): [mine4, mine6, connected]}) == []
        # where the TCP flows are judged by the TCP tables (many flows, few TCP sockets here), the UDP table is not
        # read with them (a register of 257 TCP flows and one UDP flow read it all)
        monkeypatch.setattr(ownership, "lookups_cheaper", lambda count: False)
        tcp_only = []
        monkeypatch.setattr(ownership, "agent_sockets", lambda inodes=None, proc="self", protos=("tcp", "udp"):
                            no_tables() if "udp" in protos else tcp_only.append(protos) or {})
        lost = FlowKey("tcp", "127.0.0.1", 1, "127.0.0.1", 2)
        assert ownership.not_owned(os.getpid(), [lost, mine4, mine6, connected, elsewhere]) == [lost, elsewhere]
        assert ownership.not_owned_by_owners({os.getpid(): [lost, mine4, mine6, connected]}) == [lost]
        assert tcp_only == [("tcp",), ("tcp",)]
        monkeypatch.setattr(ownership, "agent_sockets", no_tables)
        fds = {mine4: s4.fileno(), mine6: s6.fileno(), connected: conn.fileno(), elsewhere: conn.fileno()}
        assert ownership.not_owned(os.getpid(), list(fds), fds=fds) == [elsewhere]
        crossed = {mine4: s6.fileno(), mine6: s4.fileno()}  # a wildcard of the other family owns nothing
        assert ownership.not_owned(os.getpid(), list(crossed), fds=crossed) == [mine4, mine6]
        assert ownership.not_owned_by_owners({os.getpid(): list(fds)}, fd_of=fds.get) == [elsewhere]

def test_udp_ownership_by_exact_lookup_then_by_port(monkeypatch):
    """A UDP flow is looked up exactly (the socket that receives from its destination): O(1). Where another socket
    wins that lookup (a socket bound to the flow's source next to the owner's wildcard one, SO_REUSEADDR), the
    sockets of the port are dumped (at most UDP_PORT_DUMPS per call): the owner's wildcard socket still owns it."""
    from tensorlane.agent import ownership
    from tensorlane.agent.kernel.sockdiag import SockDiag
    from tensorlane.agent.protocol import FlowKey

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mine, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as theirs:
        for s in (mine, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mine.bind(("0.0.0.0", 0))
        port = mine.getsockname()[1]
        key = FlowKey("udp", "127.0.0.1", port, "127.0.0.2", 9)
        assert SockDiag().udp(*key[1:]).inode == os.fstat(mine.fileno()).st_ino
        theirs.bind(("127.0.0.1", port))
        assert SockDiag().udp(*key[1:]).inode == os.fstat(theirs.fileno()).st_ino  # it wins the lookup
        assert ownership.not_owned(os.getpid(), [key], fds={key: mine.fileno()}) == []  # found by the port dump
        assert ownership.not_owned(os.getpid(), [key], fds={key: theirs.fileno()}) == []  # (bound to the source)
        # judged in one sweep beside a flow of the socket that wins its lookup (another owner's, here another fd):
        # that socket is not this flow's fd, so its port is dumped as above (the flow was dropped: the lookup's
        # socket was among the sweep's sockets, all owners' together, and taken as deciding it)
        other = FlowKey("udp", "127.0.0.1", port, "127.0.0.5", 9)
        held = {key: mine.fileno(), other: theirs.fileno()}
        assert ownership.not_owned_by_owners({os.getpid(): [key, other]}, fd_of=held.get) == []
        # beyond the dumps a call may make, a register is refused as such (not as another user's flow) and a
        # sweep keeps the flow for a later pass (until 2026-11-28 both took it as not owned: a sweep dropped it)
        monkeypatch.setattr(ownership, "UDP_PORT_DUMPS", 0)
        with pytest.raises(ownership.UndecidedPorts):
            ownership.not_owned(os.getpid(), [key], fds={key: mine.fileno()})
        assert ownership.not_owned_by_owners({os.getpid(): [key]}, fd_of=lambda k: mine.fileno()) == []


@contextlib.contextmanager
def made_as(uid: int):
    """Sockets made inside this block are user ``uid``'s (the test runs as root: its effective uid, and so its
    file-system uid, is ``uid`` until the block ends)."""
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_a_socket_another_user_made_is_not_a_users_to_register():
    """A user's process may hold a socket another user made: a setuid program it exec'd after connecting to the
    agent (SO_PEERCRED keeps the user who connected), an fd a root service leaked into it, one passed to it. Its
    flows are that other user's traffic: a user that named it (by fd or not) registered it at the level of its
    choice, and the socket's owner was then refused ``conflict``. Now only sockets the peer's user made count
    (``ownership.made_by``: the socket's owner uid): ``not_owner``, nothing registered."""
    from test_jobs_agent import make_api

    from tensorlane.agent.peers import Peer

    def ask(msg):
        return json.loads(api.handle(json.dumps(msg).encode(), nobody))

    api, _ = make_api()
    nobody = Peer(os.getpid(), 65534, 65534)
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        roots = stack.enter_context(socket.create_connection(srv.getsockname()))  # root's (the setuid program's)
        stack.enter_context(srv.accept()[0])
        udp_root = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        udp_root.bind(("127.0.0.1", 0))
        with made_as(65534):
            mine = stack.enter_context(socket.socket())
            udp_mine = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        mine.connect(srv.getsockname())
        udp_mine.bind(("127.0.0.1", 0))
        stack.enter_context(srv.accept()[0])

        def tcp(s):
            return {"proto": "tcp", "src": "127.0.0.1", "sport": s.getsockname()[1], "dst": "127.0.0.1",
                    "dport": srv.getsockname()[1]}

        def udp(s):
            return {"proto": "udp", "src": "127.0.0.1", "sport": s.getsockname()[1], "dst": "127.0.0.2", "dport": 9}

        for flow, sock in ((tcp(roots), roots), (udp(udp_root), udp_root)):
            for fds in (None, [sock.fileno()]):
                msg = {"op": "register", "job": "j", "level": 3, "flows": [flow]}
                reply = ask(msg if fds is None else {**msg, "fds": fds})
                assert reply["error"]["code"] == "not_owner", reply
                assert "made by user nobody" in reply["error"]["message"], reply
        assert not api.table.flows
        for fds in (None, [mine.fileno(), udp_mine.fileno()]):  # its own: registered, with fds or not
            msg = {"op": "register", "job": "j", "level": 3, "flows": [tcp(mine), udp(udp_mine)]}
            reply = ask(msg if fds is None else {**msg, "fds": fds})
            assert reply["ok"] and reply["result"]["added"] + reply["result"]["unchanged"] == 2, reply
        assert len(api.table.flows) == 2


@pytest.mark.parametrize("named", [True, False], ids=["fds", "found"])
def test_a_users_flow_whose_socket_is_swapped_for_another_users_is_swept(named):
    """A register refuses a socket another user made (above); a sweep must not keep a flow for one either. The user
    registers its own socket's flow, then its process holds another user's socket with the same 5-tuple at that fd
    (the port rebound by a setuid program it exec'd, or a socket passed to it, put at the same fd; or, registered
    without fds, at another fd): its flow then marks that user's traffic at the level of its choice. The sweep
    judges with the user's sockets only (``made_by``): the flow goes. Before, any socket at the fd (or, for a flow
    registered without fds, any of the process's) kept it."""
    from test_jobs_agent import make_api

    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    nobody = Peer(os.getpid(), 65534, 65534)
    with contextlib.ExitStack() as stack:
        with made_as(65534):
            mine = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        mine.bind(("127.0.0.1", 0))
        port = mine.getsockname()[1]
        flow = {"proto": "udp", "src": "127.0.0.1", "sport": port, "dst": "127.0.0.2", "dport": 9}
        msg = {"op": "register", "job": "j", "level": 3, "flows": [flow], **({"fds": [mine.fileno()]} if named else {})}
        reply = json.loads(api.handle(json.dumps(msg).encode(), nobody))
        assert reply["ok"], reply
        api.sweep()
        assert len(api.table.by_pid.get(os.getpid(), ())) == 1  # its own socket: kept
        fd = mine.fileno()
        mine.close()
        roots = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))  # another user's (root's)
        roots.bind(("127.0.0.1", port))
        if named and roots.fileno() != fd:  # at the very fd the client named (the lowest free: most often its own)
            os.dup2(roots.fileno(), fd)
            stack.callback(os.close, fd)
        api.sweep()
        assert not api.table.by_pid.get(os.getpid()), api.table.flows


def test_many_udp_flows_of_one_socket_cost_one_lookup(monkeypatch):
    """One unconnected UDP socket owns a flow to every destination: a user registered max_flows_per_user (50,000) of
    them, and every sweep (each SWEEP_S, 0.5 s) made an exact sock_diag lookup per flow and, with ``fds``, a readlink
    per flow: 20,000 such flows cost 0.9-1.9 s a sweep here (0.3 s without fds), the agent's loop stalled, root's
    requests waiting. Now a socket found once decides every flow it owns (0.1 s): one lookup and one link for them
    all, at a register and a sweep, with fds or not; a flow it does not own is still looked up."""
    from test_jobs_agent import make_api

    from tensorlane.agent import ownership
    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    me = Peer(os.getpid(), 65534, 65534)
    calls = {"udp": 0, "stat": 0}
    real_udp, real_stat = ownership._DIAG.udp, os.stat

    def udp(*a):
        calls["udp"] += 1
        return real_udp(*a)

    def counted_stat(path, *a, **kw):
        calls["stat"] += str(path).startswith("/proc/")
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(ownership._DIAG, "udp", udp)
    monkeypatch.setattr(ownership.os, "stat", counted_stat)
    with made_as(65534):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        u.bind(("0.0.0.0", 0))
        port = u.getsockname()[1]
        flows = [{"proto": "udp", "src": "127.0.0.1", "sport": port, "dst": f"198.18.1.{i}", "dport": 9}
                 for i in range(1, 201)]
        for job, fds in (("a", [u.fileno()] * 100), ("b", None)):
            part = flows[:100] if fds else flows[100:]
            msg = {"op": "register", "job": job, "level": 3, "flows": part} | ({"fds": fds} if fds else {})
            reply = json.loads(api.handle(json.dumps(msg).encode(), me))
            assert reply["ok"] and reply["result"]["added"] == 100, reply
            assert calls["udp"] == 1 and (calls["stat"] <= 2 or not fds), calls  # (its netns, then its fd: 101)
            calls.update(udp=0, stat=0)
        assert api.sweep() == 0 and len(api.table.flows) == 200
        assert calls["udp"] <= 2, calls  # one for the flows with fds, one for the others (200 before)


@pytest.mark.parametrize("first", ["victim", "attacker"])
def test_a_udp_port_shared_with_another_users_socket_is_not_a_users_to_register(first):
    """Linux lets any two users' UDP sockets share a port when both set SO_REUSEADDR (no uid check, unlike
    SO_REUSEPORT), and both then own every flow of it by the UDP rule: the packets of either socket carry the same
    5-tuple. A user that bound another user's port so was let register that user's flows first, at a level of its
    own (the owner's register then refused ``conflict``), whichever socket was bound first. A register of a UDP
    flow whose port another user's socket shares, that owns the flow too, is refused ``not_owner`` since
    2026-11-28, with fds or not, also where that socket is a dual-stack IPv6 one on ``[::]`` (it sends IPv4); the
    same user's two sockets on the port, or another user's IPV6_V6ONLY one, are still fine."""
    from test_jobs_agent import make_api

    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    nobody = Peer(os.getpid(), 65534, 65534)

    def ask(msg):
        return json.loads(api.handle(json.dumps(msg).encode(), nobody))

    def bound(uid, addr, port):
        with made_as(uid):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        return s

    with contextlib.ExitStack() as stack:
        if first == "victim":
            victim = stack.enter_context(bound(1, "127.0.0.1", 0))
            port = victim.getsockname()[1]
            mine = stack.enter_context(bound(65534, "0.0.0.0", port))
        else:
            mine = stack.enter_context(bound(65534, "127.0.0.1", 0))
            port = mine.getsockname()[1]
            stack.enter_context(bound(1, "0.0.0.0", port))
        flow = {"proto": "udp", "src": "127.0.0.1", "sport": port, "dst": "127.0.0.2", "dport": 9}
        for fds in (None, [mine.fileno()]):
            msg = {"op": "register", "job": "j", "level": 3, "flows": [flow]}
            reply = ask(msg if fds is None else {**msg, "fds": fds})
            assert not reply["ok"] and reply["error"]["code"] == "not_owner", reply
            assert "another user's socket" in reply["error"]["message"], reply
        assert not api.table.flows
        # a dual-stack IPv6 socket on the wildcard sends the IPv4 flow's datagrams too (an IPV6_V6ONLY one does not)
        for v6only in (0, 1):
            with made_as(1):
                dual = stack.enter_context(socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
            dual.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            dual.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
            dual.bind(("::", 0))
            alone = stack.enter_context(bound(65534, "127.0.0.1", dual.getsockname()[1]))
            reply = ask({"op": "register", "job": "j", "level": 3, "fds": [alone.fileno()],
                         "flows": [{**flow, "sport": alone.getsockname()[1]}]})
            assert reply["ok"] == bool(v6only), (v6only, reply)
        own = stack.enter_context(bound(65534, "127.0.0.1", port) if first == "victim" else bound(65534, "0.0.0.0", 0))
        mine2 = stack.enter_context(bound(65534, "127.0.0.1", 0))
        stack.enter_context(bound(65534, "0.0.0.0", mine2.getsockname()[1]))  # the user's own two sockets: fine
        flow2 = {**flow, "sport": mine2.getsockname()[1]}
        reply = ask({"op": "register", "job": "j", "level": 3, "flows": [flow2], "fds": [mine2.fileno()]})
        assert reply["ok"], reply
        del own


FUSE_STALL = textwrap.dedent("""
    import json, os, socket, tempfile, threading
    from fusestall import StallFs
    from test_jobs_agent import make_api
    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    nobody = Peer(os.getpid(), 65534, 65534)
    os.setegid(65534); os.seteuid(65534)
    mine = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    os.seteuid(0); os.setegid(0)
    mine.bind(("127.0.0.1", 0))
    flow = {"proto": "udp", "src": "127.0.0.1", "sport": mine.getsockname()[1], "dst": "127.0.0.2", "dport": 9}
    out = {"registered": json.loads(api.handle(json.dumps(
        {"op": "register", "job": "j", "level": 3, "flows": [flow], "fds": [mine.fileno()]}).encode(), nobody))["ok"]}
    fs = StallFs(tempfile.mkdtemp())
    try:
        f = os.open(os.path.join(fs.mnt, "f"), os.O_RDONLY)
        fs.stall.set()  # its daemon answers no GETATTR of f from now on

        def attack():
            other = {**flow, "dst": "127.0.0.3"}
            out["named"] = json.loads(api.handle(json.dumps(
                {"op": "register", "job": "j", "level": 3, "flows": [other], "fds": [f]}).encode(), nobody))
            os.dup2(f, mine.fileno())  # the registered flow's fd is the file now
            api.sweep()
            out["left"] = len(api.table.flows)

        t = threading.Thread(target=attack, daemon=True)
        t.start()
        t.join(3)
        out["stalled"] = t.is_alive()
    finally:
        fs.close()
    t.join(3)
    print(json.dumps(out))
""")


def test_a_file_whose_stat_never_returns_put_at_a_named_fd_does_not_stall_the_agent(tmp_path):
    """A register names fds; the agent looked at each with ``stat``, which follows ``/proc/PID/fd/N`` to the file
    there. A user's FUSE mount (``fusermount3``) answers that stat when its daemon likes: naming such a file's fd,
    or putting it at a registered flow's fd before a sweep, stopped the agent's one loop for as long as the daemon
    waited (SIGTERM included). Since 2026-11-28 the fd is read as a link first (a file that is not a socket is not
    looked at) and the socket's owner comes from the kernel's cached attributes (``AT_STATX_DONT_SYNC``): the
    register is refused ``not_owner`` and the sweep drops the flow, with the daemon still silent. The mount is made
    in a mount namespace of the test's own (``unshare -m``)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(["unshare", "-m", sys.executable, "-c", FUSE_STALL], capture_output=True, text=True,
                         timeout=60, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["registered"] and not out["stalled"], out
    assert out["named"]["error"]["code"] == "not_owner", out
    assert out["left"] == 0, out


def test_a_udp_flow_from_an_address_that_is_not_the_hosts_is_not_a_users_to_register():
    """A UDP socket on the wildcard owns the flows of its port from any source by the UDP rule, and the maps are
    looked up in postrouting, which packets the host forwards (a container's, a routed host's) pass too: a user
    registered a flow from such an address and the forwarded datagrams of that 5-tuple left with its level (50 of
    50 in a router namespace with the agent's table). Since 2026-11-28 a user's UDP flow must come from an address of
    the agent's namespace (``not_owner``); root and trusted users may still register any."""
    from test_jobs_agent import make_api

    from tensorlane.agent.peers import Peer

    api, _ = make_api()
    nobody = Peer(os.getpid(), 65534, 65534)
    with made_as(65534):
        mine = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with mine:
        mine.bind(("0.0.0.0", 0))
        port = mine.getsockname()[1]
        for src, ok in (("198.51.100.7", False), ("127.0.0.1", True)):
            flow = {"proto": "udp", "src": src, "sport": port, "dst": "127.0.0.2", "dport": 9}
            for fds in (None, [mine.fileno()]):
                msg = {"op": "register", "job": "j", "level": 3, "flows": [flow]}
                reply = json.loads(api.handle(json.dumps(msg if fds is None else {**msg, "fds": fds}).encode(), nobody))
                assert reply["ok"] == ok, reply
                if not ok:
                    assert reply["error"]["code"] == "not_owner" and "no address of this host" in reply["error"]["message"]
        assert [k.src for k in api.table.flows] == ["127.0.0.1"]
