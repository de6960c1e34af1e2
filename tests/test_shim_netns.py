"""The shim with real agents on the testbed: each level's gloo connections are registered with the host's agent;
when the agent stops, training goes on; when it comes back, the shim registers again; the parameters end equal
to plain DDP's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest

from bench.agents import AgentStartError, running_agents
from testbed import Testbed

pytestmark = [pytest.mark.netns, pytest.mark.concurrent]  # beside another file's (make test)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_workers(tb, out, port: int, sockets: dict[int, str], *args: str) -> list[subprocess.Popen]:
    procs = []
    for rank, host in enumerate(tb.hosts):
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(len(tb.hosts)),
                   MASTER_ADDR=tb.host(1).ip, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                   TENSORLANE_JOB="shimtest")
        procs.append(host.popen([sys.executable, os.path.join(REPO, "tests", "shim_worker.py"), "--out", str(out),
                                 "--agent-socket", sockets[host.index], *args],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def levels_registered(agent) -> set[int]:
    try:
        with agent.client(timeout=1) as c:
            return {f["level"] for f in c.list(job="shimtest")["flows"]}
    except OSError:
        return set()


def tc_and_nft(host) -> str:
    return "\n".join([host.run(["tc", w, "show", "dev", "eth0"]).stdout for w in ("qdisc", "class", "filter")]
                     + [host.run(["nft", "list", "ruleset"]).stdout])


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "handover"])
def test_flows_registered_per_level_and_survive_agent_restart(tmp_path, how):
    """Training through the shim goes on, exact, while host 1's agent stops (SIGTERM: the host restored), is killed
    (SIGKILL: the next agent adopts its tree) or hands over (SIGUSR2, a planned restart: tree, table and marks left
    for the next agent); the next agent gets every level's flows registered again, and its stop leaves the host's
    tc and nftables state as before."""
    import torch

    with Testbed(hosts=2, rate="200mbit", name="ts") as tb, running_agents(tb, hosts=[2], levels=3) as agents2:
        sockets = {1: f"/run/tensorlane/{tb.host(1).name}/agent.sock", 2: agents2[2].socket}
        before = tc_and_nft(tb.host(1))
        killed = pytest.raises(AgentStartError, match="exited with -9") if how == "sigkill" else nullcontext()
        with killed, running_agents(tb, hosts=[1], levels=3, workdir=str(tmp_path / "agents1")) as agents1:
            procs = start_workers(tb, tmp_path, 29610, sockets, "--modes", "ddp,overlap", "--levels", "3",
                                  "--steps", "60", "--step-sleep", "0.1")
            try:
                assert wait_for(lambda: levels_registered(agents1[1]) == {0, 1, 2}, 60, "host1's registrations")
                assert wait_for(lambda: levels_registered(agents2[2]) == {0, 1, 2}, 10, "host2's registrations")
                with agents1[1].client() as c:
                    flows = c.list(job="shimtest")["flows"]
                assert all(f["src"] == tb.host(1).ip and f["dst"] == tb.host(2).ip for f in flows)
            except BaseException:
                for p in procs:
                    p.kill()
                raise
            if how == "sigkill":  # no chance to clean up: the next agent finds its tree and adopts it
                agents1[1].proc.kill()
                agents1[1].proc.wait(5)
            elif how == "handover":  # exits 0 leaving its tree, table and marks (the stop's SIGTERM then finds it gone)
                agents1[1].proc.send_signal(signal.SIGUSR2)
                assert agents1[1].proc.wait(10) == 0
                assert "handing over" in agents1[1].stderr_tail()
                assert "tensorlane" in tb.host(1).run(["nft", "list", "tables"]).stdout  # left for the next agent
        # host1's agent is gone (SIGTERM): training goes on; a new agent gets the flows registered again
        time.sleep(3)  # longer than the shim's keep-alive period: it notices the agent is gone
        with running_agents(tb, hosts=[1], levels=3) as agents1:
            assert wait_for(lambda: levels_registered(agents1[1]) == {0, 1, 2}, 10, "re-registration")
            outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert tc_and_nft(tb.host(1)) == before  # no orphan classes, filters or nftables rules
    assert [p.returncode for p in procs] == [0, 0], outputs
    ref = torch.load(tmp_path / "ddp-0.pt")
    got = torch.load(tmp_path / "overlap-0.pt")
    assert max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref) <= 1e-5
    stats = json.loads((tmp_path / "overlap-0.json").read_text())
    assert stats["agent"]["reregistrations"] >= 1 and stats["agent"]["failures"] >= 1
    assert all(n >= 1 for n in stats["flows"].values()) and len(stats["flows"]) == 3
    assert outputs[0].count("training continues without network priority") == 1  # one warning, not one per try
