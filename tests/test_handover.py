"""The flow table across a hand-over (agent/handover.py), without a kernel: what the old agent writes, which files
the next one refuses, and how a refused register is split so that only the flows at fault are left out. The real
hand-over, with processes holding sockets in a testbed namespace: tests/test_agent_netns.py."""
from __future__ import annotations

import json
import os
import types

from tensorlane.agent import handover
from tensorlane.agent.peers import process_start
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey


def _cfg(tmp_path, levels=4):
    return types.SimpleNamespace(state_dir=str(tmp_path), levels=levels)


def _key(sport):
    return FlowKey("udp", "198.18.0.1", sport, "198.18.0.2", 9000)


def test_written_flows_leave_out_draining_ones_and_gone_owners(tmp_path):
    table = FlowTable(4)
    table.register("job-a", 1, (_key(1), _key(2)), rank=3, pid=os.getpid(), uid=0, run="r1",
                   fds={_key(1): 7, _key(2): 8})
    table.register("job-a", 2, (_key(3),), pid=None, uid=None)
    table.register("job-b", 0, (_key(4),), pid=2**22 + 12345, uid=1000)  # (no such process)
    table.drain([_key(2)], until=1e18)
    assert handover.write_flows(_cfg(tmp_path), table, {"job-a": {"step_bytes": 4096}}) == 2
    path = tmp_path / handover.FLOWS_FILE
    assert path.stat().st_mode & 0o777 == 0o600  # root's: it names every user's processes and flows
    doc = json.loads(path.read_text())
    assert doc["format"] == 1 and doc["boot_id"] == handover.boot_id() and doc["netns"] == handover.netns_id()
    flows = {f["flow"][2]: f for f in doc["flows"]}
    assert set(flows) == {1, 3}
    assert flows[1] == {"flow": list(_key(1)), "job": "job-a", "level": 1, "rank": 3, "run": "r1", "pid": os.getpid(),
                        "start": process_start(os.getpid()), "uid": 0, "fd": 7}
    assert flows[3]["pid"] is None and flows[3]["uid"] is None and flows[3]["fd"] is None
    assert doc["reported"] == {"job-a": {"step_bytes": 4096}}


class FakeApi:
    """Answers registers like the agent's Api: refused (not_owner) when they name a flow of ``refused``."""

    def __init__(self, refused=()):
        self.refused = set(refused)
        self.calls = []
        self.policy = types.SimpleNamespace(allowed=lambda peer: True)
        self.table = types.SimpleNamespace(by_job={})
        self.jobs = types.SimpleNamespace(inputs=("step_bytes", "compute_s"))
        self.taken = []

    def _take_inputs(self, job, sent, refused):
        self.taken.append((job, sent, refused))

    def handle(self, line, peer):
        req = json.loads(line)
        self.calls.append((req, peer))
        if any(f["sport"] in self.refused for f in req["flows"]):
            return json.dumps({"ok": False, "error": {"code": "not_owner", "message": "closed"}}).encode()
        self.table.by_job.setdefault(req["job"], set()).update(f["sport"] for f in req["flows"])
        return json.dumps({"ok": True, "result": {}}).encode()


def _write(tmp_path, flows, **doc):
    body = {"format": 1, "boot_id": handover.boot_id(), "netns": handover.netns_id(), "flows": flows} | doc
    (tmp_path / handover.FLOWS_FILE).write_text(json.dumps(body))


def _flow(sport, level=1, job="job-a", fd=None):
    return {"flow": list(_key(sport)), "job": job, "level": level, "rank": None, "run": None, "pid": None,
            "start": None, "uid": None, "fd": fd}


def test_a_refused_register_is_split_until_the_flows_at_fault_are_found(tmp_path):
    api = FakeApi(refused={5, 11})
    _write(tmp_path, [_flow(s) for s in range(16)])
    counts = handover.adopt_flows(_cfg(tmp_path), api)
    assert counts == {"adopted": 14, "not_owner": 2}
    adopted = sorted(f["sport"] for req, _ in api.calls for f in req["flows"]
                     if not api.refused & {g["sport"] for g in req["flows"]})
    assert adopted == [s for s in range(16) if s not in (5, 11)]
    assert len(api.calls) <= 16  # halves, not one request per flow
    assert not (tmp_path / handover.FLOWS_FILE).exists()  # read once


def test_reported_inputs_come_along_for_the_jobs_taken_back(tmp_path):
    api = FakeApi()
    reported = {"job-a": {"step_bytes": 4096, "compute_s": 0.5, "window_steps": 3}, "job-gone": {"step_bytes": 1}}
    _write(tmp_path, [_flow(1)], reported=reported)
    assert handover.adopt_flows(_cfg(tmp_path), api) == {"adopted": 1}
    # (as the agent's own: the old agent took them from a reporter that could speak for the job; inputs the policy
    # does not order by are left out, and so is a job none of whose flows were taken back)
    assert api.taken == [("job-a", {"step_bytes": 4096, "compute_s": 0.5}, None)]


def test_requests_keep_job_level_and_fds_and_levels_beyond_the_new_ones_go_to_the_last(tmp_path):
    api = FakeApi()
    _write(tmp_path, [_flow(1, level=3, fd=9), _flow(2, level=3, fd=10), _flow(3, level=0, job="job-a@alice")])
    assert handover.adopt_flows(_cfg(tmp_path, levels=2), api) == {"adopted": 3}
    reqs = [req for req, _ in api.calls]
    # the job id a client named (a user's own job ID@USER is mapped again by the Api), under its own id first
    assert reqs[0]["job"] == "job-a" and reqs[0]["level"] == 1 and reqs[0]["fds"] == [9, 10]
    assert reqs[1]["job"] == "job-a" and reqs[1]["level"] == 0 and "fds" not in reqs[1]


def test_a_file_of_another_boot_or_namespace_or_a_newer_format_is_dropped(tmp_path):
    for doc in ({"boot_id": "another"}, {"netns": [0, 1]}, {"format": 2}, {"flows": "x"}):
        api = FakeApi()
        _write(tmp_path, [_flow(1)], **{k: v for k, v in doc.items() if k != "flows"})
        if "flows" in doc:
            _write(tmp_path, doc["flows"])
        assert handover.adopt_flows(_cfg(tmp_path), api) is None and api.calls == [], doc
        assert not (tmp_path / handover.FLOWS_FILE).exists()
    (tmp_path / handover.FLOWS_FILE).write_text("{not json")
    assert handover.adopt_flows(_cfg(tmp_path), FakeApi()) is None
    assert handover.adopt_flows(_cfg(tmp_path), FakeApi()) is None  # no file: nothing (the marks kept INHERIT_S)
    _write(tmp_path, [])
    assert handover.adopt_flows(_cfg(tmp_path), FakeApi()) == {}  # a hand-over without flows


def test_an_owner_whose_pid_names_another_process_now_is_not_taken_back(tmp_path):
    api = FakeApi()
    mine = dict(_flow(1), pid=os.getpid(), start=process_start(os.getpid()) + 1, uid=os.getuid())
    gone = dict(_flow(2), pid=2**22 + 12345, start=1, uid=os.getuid())
    same = dict(_flow(3), pid=os.getpid(), start=process_start(os.getpid()), uid=os.getuid())
    _write(tmp_path, [mine, gone, same])
    assert handover.adopt_flows(_cfg(tmp_path), api) == {"adopted": 1, "owner_gone": 2}
    (req, peer), = api.calls
    assert [f["sport"] for f in req["flows"]] == [3] and peer.pid == os.getpid() and peer.pidfd is not None
