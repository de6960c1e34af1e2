"""The API's request parsing: every malformed request gets a precise, stable error code."""
import json

import pytest

from tensorlane.agent.protocol import MAX_MESSAGE_BYTES, ProtocolError, parse_request
from tensorlane.flows import FlowKey

FLOW = {"proto": "tcp", "src": "198.18.0.1", "sport": 4000, "dst": "198.18.0.2", "dport": 5000}


def req(**fields):
    return json.dumps(fields).encode()


def test_register_parses_flows_and_dedups():
    r = parse_request(req(op="register", id=7, job="job-a", level=1, rank=0, flows=[FLOW, FLOW]))
    assert r.op == "register" and r.id == 7 and r.level == 1
    assert r.flows == (FlowKey("tcp", "198.18.0.1", 4000, "198.18.0.2", 5000),)


def test_a_rank_is_bounded():
    """A rank is listed with each of the job's flows: a 4,000-digit rank (JSON allows it) on 600 flows of one user
    made root's list page 2.4 MB, over the agent's 1 MiB of unread replies: root's list (and ``verify``) failed,
    "agent closed the connection". Now refused before anything changes, the message clipped."""
    assert parse_request(req(op="register", job="j", level=0, rank=2**31 - 1, flows=[FLOW])).rank == 2**31 - 1
    for rank in (2**31, 10**4000, -1, 1.0, True):
        with pytest.raises(ProtocolError, match=r"rank must be an integer 0\.\.2147483647") as info:
            parse_request(req(op="register", job="j", level=0, rank=rank, flows=[FLOW]))
        assert info.value.code == "bad_request" and len(str(info.value)) < 120


def test_a_registers_fds_are_one_integer_per_flow():
    """``fds`` (optional): the fd of the client's process that holds each flow's socket, in the order of ``flows``
    (a flow sent twice names the same fd); anything else is ``bad_request`` and changes nothing. Without it a
    register is as before (``fds`` None: the agent reads the process's open files)."""
    other = {**FLOW, "sport": FLOW["sport"] + 1}
    assert parse_request(req(op="register", job="j", level=0, flows=[FLOW])).fds is None
    r = parse_request(req(op="register", job="j", level=0, flows=[FLOW, other, FLOW], fds=[5, 2**31 - 1, 5]))
    assert r.fds == (5, 2**31 - 1) and len(r.flows) == 2
    for fds in ([], [5], [5, 6, 7, 8], [5, -1, 5], [5, 2**31, 5], [5, True, 5], [5, 1.0, 5], [5, "6", 5],
                [5, 6, 7], "5", {"5": 5}):
        with pytest.raises(ProtocolError) as info:
            parse_request(req(op="register", job="j", level=0, flows=[FLOW, other, FLOW], fds=fds))
        assert info.value.code == "bad_request" and "fds" in str(info.value) or "two fds" in str(info.value), fds
    with pytest.raises(ProtocolError, match="unknown field 'fds'"):
        parse_request(req(op="unregister", job="j", flows=[FLOW], fds=[5]))


def test_ipv6_and_mapped_addresses():
    r = parse_request(req(op="register", job="j", level=0, flows=[
        {**FLOW, "src": "::ffff:198.18.0.1", "dst": "::ffff:198.18.0.2"},
        {**FLOW, "src": "fd00::1", "dst": "fd00::2"}]))
    assert r.flows[0].src == "198.18.0.1" and r.flows[0].family == 4
    assert r.flows[1].family == 6


def test_mapped_addresses_are_ipv4_before_any_comparison():
    """An IPv4 source with a mapped destination is an IPv4 flow, not "different IP versions"."""
    for src, dst in (("198.18.0.1", "::ffff:198.18.0.2"), ("::ffff:198.18.0.1", "198.18.0.2"),
                     ("::FFFF:c612:1", "::ffff:198.18.0.2")):
        r = parse_request(req(op="register", job="j", level=0, flows=[{**FLOW, "src": src, "dst": dst}]))
        assert r.flows == (FlowKey("tcp", "198.18.0.1", 4000, "198.18.0.2", 5000),) and r.flows[0].family == 4
    # the mapped and plain spellings of one flow are one flow
    r = parse_request(req(op="unregister", job="j", flows=[FLOW, {**FLOW, "dst": "::ffff:198.18.0.2"}]))
    assert len(r.flows) == 1
    v6 = parse_request(req(op="register", job="j", level=0, flows=[{**FLOW, "src": "fd00::1", "dst": "FD00::2"}]))
    assert v6.flows[0].dst == "fd00::2" and v6.flows[0].family == 6


@pytest.mark.parametrize("src,dst", [
    ("0.0.0.0", "198.18.0.2"), ("198.18.0.1", "0.0.0.0"), ("::", "fd00::2"), ("fd00::1", "::"),
    ("198.18.0.1", "224.0.0.1"), ("239.1.2.3", "198.18.0.2"), ("ff02::1", "fd00::2"), ("fd00::1", "ff05::2"),
    ("198.18.0.1", "255.255.255.255"), ("255.255.255.255", "198.18.0.2"),
    ("198.18.0.1", "::ffff:0.0.0.0"), ("::ffff:224.0.0.1", "198.18.0.2"), ("198.18.0.1", "::ffff:255.255.255.255"),
    ("fe80::1%eth0", "fe80::2"),
])
def test_non_unicast_addresses_are_refused(src, dst):
    for op in ("register", "unregister"):
        with pytest.raises(ProtocolError) as err:
            parse_request(req(op=op, job="j", level=0, flows=[{**FLOW, "src": src, "dst": dst}])
                          if op == "register" else req(op=op, job="j", flows=[{**FLOW, "src": src, "dst": dst}]))
        assert err.value.code == "bad_flow" and ("unicast" in str(err.value) or "scope" in str(err.value))


def test_unicast_edge_addresses_are_accepted():
    """Loopback, link-local and a subnet's own broadcast-looking address are unicast as far as a host can tell."""
    for src, dst in (("127.0.0.1", "127.0.0.2"), ("169.254.1.1", "169.254.1.2"), ("::1", "::1"),
                     ("fe80::1", "fe80::2"), ("198.18.0.1", "198.18.0.255")):
        r = parse_request(req(op="register", job="j", level=0, flows=[{**FLOW, "src": src, "dst": dst}]))
        assert r.flows[0].src == src and r.flows[0].dst == dst


@pytest.mark.parametrize("line,code", [
    (b"not json", "bad_json"),
    (b"[1,2]", "bad_request"),
    (req(op="explode"), "unknown_op"),
    (req(op="register", job="j", level=0, flows=[]), "bad_flow"),
    (req(op="register", job="j", level=-1, flows=[FLOW]), "bad_level"),
    (req(op="register", job="j", level="high", flows=[FLOW]), "bad_level"),
    (req(op="register", job="", level=0, flows=[FLOW]), "bad_job"),
    (req(op="register", job="a b", level=0, flows=[FLOW]), "bad_job"),
    (req(op="register", job="j", level=0, flows=[{**FLOW, "sport": 0}]), "bad_flow"),
    (req(op="register", job="j", level=0, flows=[{**FLOW, "src": "nope"}]), "bad_flow"),
    (req(op="register", job="j", level=0, flows=[{**FLOW, "dst": "fd00::1"}]), "bad_flow"),
    (req(op="register", job="j", level=0, flows=[{**FLOW, "proto": "sctp"}]), "bad_flow"),
    (req(op="register", job="j", level=0, flows=[{**FLOW, "extra": 1}]), "bad_flow"),
    (req(op="register", job="j", level=0, flows=FLOW), "bad_flow"),
    (req(op="status", job="j", level=0), "bad_request"),
    (req(op="list", id=True), "bad_request"),
    (b"{" + b" " * MAX_MESSAGE_BYTES + b"}", "too_large"),
])
def test_malformed_requests(line, code):
    with pytest.raises(ProtocolError) as err:
        parse_request(line)
    assert err.value.code == code
