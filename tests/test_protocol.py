"""The API's request parsing: every malformed request gets a precise, stable error code."""
import json

import pytest

from agent.protocol import MAX_MESSAGE_BYTES, FlowKey, ProtocolError, parse_request

FLOW = {"proto": "tcp", "src": "198.18.0.1", "sport": 4000, "dst": "198.18.0.2", "dport": 5000}


def req(**fields):
    return json.dumps(fields).encode()


def test_register_parses_flows_and_dedups():
    r = parse_request(req(op="register", id=7, job="job-a", level=1, rank=0, flows=[FLOW, FLOW]))
    assert r.op == "register" and r.id == 7 and r.level == 1
    assert r.flows == (FlowKey("tcp", "198.18.0.1", 4000, "198.18.0.2", 5000),)


def test_ipv6_and_mapped_addresses():
    r = parse_request(req(op="register", job="j", level=0, flows=[
        {**FLOW, "src": "::ffff:198.18.0.1", "dst": "::ffff:198.18.0.2"}, {**FLOW, "src": "fd00::1", "dst": "fd00::2"}]))
    assert r.flows[0].src == "198.18.0.1" and r.flows[0].family == 4
    assert r.flows[1].family == 6


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
