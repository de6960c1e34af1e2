"""FlowTable: the single place that holds the desired flow state."""
import pytest

from tensorlane.agent.protocol import ProtocolError
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey

A = FlowKey("tcp", "198.18.0.1", 4000, "198.18.0.2", 5000)
B = FlowKey("tcp", "198.18.0.1", 4001, "198.18.0.2", 5000)


def test_register_move_and_unregister():
    t = FlowTable(levels=3)
    assert t.register("j", 0, (A, B)) == ([A, B], [])
    assert t.register("j", 0, (A,)) == ([], [])
    assert t.register("j", 2, (A,)) == ([], [A])
    assert t.by_level() == {0: [B], 1: [], 2: [A]}
    assert t.unregister("j", (A,)) == [A]
    assert t.unregister("j") == [B] and not t.flows


def test_refusals_change_nothing():
    t = FlowTable(levels=2, max_flows=2)
    t.register("j", 0, (A,))
    for call in (lambda: t.register("k", 0, (B, A)), lambda: t.register("j", 5, (B,)),
                 lambda: t.unregister("k", (A,)),
                 lambda: t.register("j", 0, (B, FlowKey("udp", "198.18.0.1", 1, "198.18.0.2", 2)))):
        with pytest.raises(ProtocolError):
            call()
        assert list(t.flows) == [A] and t.flows[A].job == "j"


def test_runs_of_a_job_are_counted_and_conflicts_listed():
    t = FlowTable(levels=2)
    t.register("j", 0, (A,), run="r1")
    assert t.conflicts() == {} and t.runs == {"j": {"r1": 1}}
    t.register("j", 1, (B,), run="r2")
    assert t.conflicts() == {"j": ["r1", "r2"]}
    t.register("j", 0, (B,), run="r1")  # re-registered by the other run: counted once, under it
    assert t.runs == {"j": {"r1": 2}} and t.conflicts() == {}
    t.drop([A, B])
    assert t.runs == {} and t.by_job == {}


def test_the_per_job_and_per_user_indexes_follow_every_change():
    """``job_users``, ``job_floor``, ``user_flows`` and ``user_jobs`` (the agent's per-user rules and tiers) are
    counts kept with each change; they end empty with the table."""
    t = FlowTable(levels=4)
    t.register("j", 0, (A,), uid=1000, floor=2)
    t.register("j", 1, (B,), uid=0, floor=0)
    assert t.job_users("j") == {0, 1000} and t.job_floor("j") == 0
    assert t.user_flows(1000) == 1 and t.user_jobs(1000) == {"j"}
    t.register("j", 3, (B,), uid=0, floor=0)  # moved, same user: counted once
    assert t.user_flows(0) == 1
    assert t.unregister("j", (B,)) == [B]
    assert t.job_users("j") == {1000} and t.job_floor("j") == 2
    t.drop([A])
    assert not (t.users or t.floors or t.of_user) and t.job_users("j") == set()


def test_draining_flows_leave_their_process_and_stay_their_jobs():
    """``drain``: the owner let go of the socket while the kernel still sends; the flow is no longer its process's
    (an exit or sweep of it does not see it again), still its job's and user's, until ``drop``."""
    t = FlowTable(levels=2)
    t.register("j", 1, (A, B), pid=7, uid=1000)
    t.drain([A], until=5.0)
    assert t.by_pid == {7: {B}} and t.flows[A].pid is None and t.draining == {A: 5.0}
    assert t.by_level()[1] == [A, B] and t.user_flows(1000) == 2
    t.drain([B], until=6.0)
    assert t.by_pid == {} and list(t.draining) == [A, B]
    assert t.drop([A]) == [A] and list(t.draining) == [B]
    t.register("j", 0, (B,), pid=8, uid=1000)  # the same 5-tuple registered again: owned, not draining
    assert t.draining == {} and t.by_pid == {8: {B}}
