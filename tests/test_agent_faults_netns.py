"""Faults around following managed interfaces by name, repairs and start/stop, against the real kernel in a testbed
of its own ("fz"): interfaces flapping, renamed, swapped, moved away and back; foreign roots, filters and nftables
changes; SIGTERM and SIGKILL at awkward moments; a state directory that turns read-only. After each, the host's tc
trees and nftables tables must be as they were before the agent started."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from agent_clients import flow, nft_tables, tc_dump, udp_exchange, wait_for

from bench.agents import AgentStartError, agent_config, render_config, running_agents
from testbed import Testbed

pytestmark = [pytest.mark.netns, pytest.mark.concurrent]  # beside another file's (make test)
PY = [sys.executable, "-m"]
TRUST = {"trusted_users": ["root"]}
FAST = {"reconcile_interval_s": 0.1, **TRUST}


@pytest.fixture(scope="module")
def fz():
    with Testbed(hosts=2, rate="100mbit", name="fz") as bed:
        yield bed




def links(host) -> dict[str, int]:
    """Every device of the host's namespace: name -> index."""
    return {d["ifname"]: d["ifindex"] for d in json.loads(host.run(["ip", "-j", "link", "show"]).stdout)}


def ours(host) -> list[str]:
    """The devices of the host whose root qdisc is the agent's (7a1:)."""
    return sorted(name for name in links(host) if "7a1: root" in host.run(["tc", "qdisc", "show", "dev", name]).stdout)



def passes_again(agent, seconds: float = 8.0) -> None:
    """Wait until the agent's passes no longer fail (its error counter stays for a few passes)."""
    def steady():
        errors = agent.status()["reconcile"]["errors"]
        time.sleep(0.5)
        return agent.status()["reconcile"]["errors"] == errors
    wait_for("reconcile passes again", steady, seconds)


def add_veth(host, name: str, tbf_rate: str | None = None, peer: str = "") -> None:
    """A veth ``name`` (peer ``peer``, default ``{name}p``), up, with a tbf root of ``tbf_rate`` (a foreign tree)
    when given: made under a temporary name and renamed, so that it comes under ``name`` with its root."""
    host.run(["ip", "link", "add", "tltmp", "type", "veth", "peer", "name", peer or f"{name}p"])
    if tbf_rate:
        host.run(["tc", "qdisc", "add", "dev", "tltmp", "root", "handle", "1:", "tbf", "rate", tbf_rate, "burst",
                  "32k", "latency", "50ms"])
    host.run(["ip", "link", "set", "tltmp", "name", name])
    host.run(["ip", "link", "set", name, "up"])


def del_links(host, *names: str) -> None:
    for name in names:
        host.run(["ip", "link", "del", name], check=False)



def state_files(agent) -> dict[str, int]:
    """The agent's state files: device name -> recorded ifindex."""
    d = os.path.dirname(agent.socket)
    return {f[len("agent-"):-len(".json")]: json.load(open(os.path.join(d, f)))["ifindex"]
            for f in os.listdir(d) if f.startswith("agent-") and f.endswith(".json")}


def test_flapping_interface_keeps_flows_marked_and_is_restored(fz):
    """tlx deleted and re-created (with a foreign tbf root) and renamed back and forth many times, quickly, while a
    flow on eth0 is registered and sending: eth0's marks never stop, the agent ends holding exactly the tlx there
    is, and on exit every device is as before."""
    h1, h2 = fz.host(1), fz.host(2)
    add_veth(h1, "tlx", "10mbit")
    rng = random.Random(7)
    try:
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx")}
        tables = nft_tables(h1)
        with running_agents(fz, hosts=[1], backend="htb",
                            config_extra={"interfaces": ["eth0", "tlx"], **FAST}) as agents:
            with agents[1].client() as agent:
                agent.register("job-f", 0, [flow(h1, 9811, h2, 9810)])
            for i in range(30):
                if i % 3 == 0:
                    del_links(h1, "tlx")
                    add_veth(h1, "tlx", "10mbit")
                elif i % 3 == 1:
                    h1.run(["ip", "link", "set", "tlx", "name", "tly"])
                else:
                    h1.run(["ip", "link", "set", "tly", "name", "tlx"])
                time.sleep(rng.uniform(0.0, 0.25))
            got = udp_exchange(h1, h2, 9811, 9810, seconds=0.5)
            wait_for("tlx held again", lambda: ours(h1) == ["eth0", "tlx"] and "tlx" in str(agents[1].status()))
            st = wait_for("no failing pass", lambda: (s := agents[1].status())["reconcile"]["last_error"] == ""
                          or s["interfaces"][1]["present"] and s)
            files = state_files(agents[1])
            idx = links(h1)
            assert files == {"eth0": idx["eth0"], "tlx": idx["tlx"]}, files
            errors = agents[1].status()["reconcile"]["errors"]
            time.sleep(0.6)
            assert agents[1].status()["reconcile"]["errors"] == errors, agents[1].status()["reconcile"]
            assert "9811" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
            assert st["flows"] == 1
        assert got["dscp"] == {"46": got["packets"]} and got["packets"] > 0, got
        assert tc_dump(h1, "eth0") == before["eth0"]
        assert tc_dump(h1, "tlx") == before["tlx"]
        assert nft_tables(h1) == tables and ours(h1) == []
    finally:
        del_links(h1, "tlx", "tly")


def test_re_created_with_a_foreign_root_is_refused_until_it_goes(fz):
    """take_over_root = false: a re-created tlx that comes with a foreign root is refused (and retried), never
    replaced; once its root is the default again it is taken over; on exit its default root is back."""
    h1 = fz.host(1)
    add_veth(h1, "tlx")
    try:
        with running_agents(fz, hosts=[1], backend="htb",
                            config_extra={"interfaces": ["tlx"], "take_over_root": False, **FAST}) as agents:
            assert ours(h1) == ["tlx"]
            del_links(h1, "tlx")
            add_veth(h1, "tlx", "10mbit")
            foreign = tc_dump(h1, "tlx")
            wait_for("refused", lambda: "refusing to replace" in agents[1].status()["reconcile"]["last_error"])
            time.sleep(0.5)
            assert tc_dump(h1, "tlx") == foreign and ours(h1) == []
            assert state_files(agents[1]) == {}
            h1.run(["tc", "qdisc", "del", "dev", "tlx", "root"])
            wait_for("taken over", lambda: ours(h1) == ["tlx"])
            passes_again(agents[1])
        assert ours(h1) == [] and "tbf" not in tc_dump(h1, "tlx")
    finally:
        del_links(h1, "tlx")


def test_restore_on_exit_follows_the_device_not_the_name(fz):
    """Between the last pass and SIGTERM, tlx is renamed to tly and another device is created as tlx: on exit the
    renamed device gets its own recorded tree back and the new tlx is left as it is."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = tc_dump(h1, "tlx")
        with running_agents(fz, hosts=[1], backend="htb",
                            config_extra={"interfaces": ["eth0", "tlx"], "reconcile_interval_s": 60}):
            assert ours(h1) == ["eth0", "tlx"]
            h1.run(["ip", "link", "set", "tlx", "name", "tly"])
            add_veth(h1, "tlx", "20mbit", peer="tlxq")
            new = tc_dump(h1, "tlx")
        assert tc_dump(h1, "tly") == before.replace("tlx", "tly")
        assert tc_dump(h1, "tlx") == new and ours(h1) == []
    finally:
        del_links(h1, "tlx", "tly")


def test_swapped_names_each_device_keeps_its_own_record(fz):
    """tlx and tly (both managed) swap names through a temporary one: each device gets its own tree back, the other
    is recorded and taken over under its new name, and on exit each device has its own original tree."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    add_veth(h1, "tly", "20mbit")
    try:
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx", "tly")}
        idx = links(h1)
        with running_agents(fz, hosts=[1], backend="htb",
                            config_extra={"interfaces": ["eth0", "tlx", "tly"], **FAST}) as agents:
            assert ours(h1) == ["eth0", "tlx", "tly"]
            h1.run(["ip", "link", "set", "tlx", "name", "tlt"])
            h1.run(["ip", "link", "set", "tly", "name", "tlx"])
            h1.run(["ip", "link", "set", "tlt", "name", "tly"])
            wait_for("both taken over again", lambda: state_files(agents[1]) == {
                "eth0": idx["eth0"], "tlx": idx["tly"], "tly": idx["tlx"]} and ours(h1) == ["eth0", "tlx", "tly"])
            passes_again(agents[1])
        assert tc_dump(h1, "eth0") == before["eth0"]
        assert tc_dump(h1, "tly") == before["tlx"].replace("tlx", "tly")  # the device first named tlx
        assert tc_dump(h1, "tlx") == before["tly"].replace("tly", "tlx")
    finally:
        del_links(h1, "tlx", "tly", "tlt")


def test_sigterm_during_start_up_restores(fz, tmp_path):
    """SIGTERM as soon as the agent's tree is on eth0 (still starting: before it listens): the agent restores
    everything, as on a SIGTERM later."""
    h1 = fz.host(1)
    before, tables = tc_dump(h1), nft_tables(h1)
    for attempt in range(3):
        cfg = tmp_path / f"a{attempt}.toml"
        fields = agent_config(fz, h1, backend="htb", metrics_address="127.0.0.1:9479")
        os.makedirs(fields["state_dir"], exist_ok=True)
        cfg.write_text(render_config(fields))
        proc = h1.popen([sys.executable, "-m", "tensorlane.cli", "agent", "--config", str(cfg)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 10
            while "7a1:" not in h1.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        assert tc_dump(h1) == before and nft_tables(h1) == tables, (proc.returncode, err[-2000:])
        assert not [f for f in os.listdir(fields["state_dir"]) if f.endswith(".json")]


def test_nftables_table_deleted_or_its_policy_or_hook_changed(fz):
    """A foreign actor deletes the agent's table, sets a chain's policy to drop, re-creates a chain as a drop
    chain at another hook or priority (``egress`` at postrouting, ``sockless`` at output): each time host networking
    is back (plain traffic flows) and the flow is marked within a few passes; on exit no table is left."""
    h1, h2 = fz.host(1), fz.host(2)
    tables = nft_tables(h1)
    hooks = {"egress": "hook postrouting priority mangle; policy accept;",
             "sockless": "hook output priority mangle; policy accept;"}
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        with agents[1].client() as agent:
            agent.register("job-n", 0, [flow(h1, 9821, h2, 9820)])
        faults = [["nft", "delete", "table", "inet", "tensorlane"]]
        for chain in hooks:
            faults += [["nft", "chain", "inet", "tensorlane", chain, "{", "policy", "drop", ";", "}"],
                       ["nft", "-f", "-", chain]]
        recreate = {"egress": "add chain inet tensorlane egress { type filter hook postrouting priority 0; "
                              "policy drop; }\n",
                    "sockless": "add chain inet tensorlane sockless { type filter hook postrouting priority mangle; "
                                "policy drop; }\n"}

        def chains_as_made() -> bool:
            return all(hook in h1.run(["nft", "list", "chain", "inet", "tensorlane", chain], check=False).stdout
                       for chain, hook in hooks.items())
        for fault in faults:
            if fault[2] == "-":
                h1.run(fault[:3], input=f"delete chain inet tensorlane {fault[3]}\n" + recreate[fault[3]])
            else:
                h1.run(fault)

            def repaired():  # (none of the faults leaves this: each drops the table, or a chain's policy or hook)
                return chains_as_made() and "9821" in h1.run(
                    ["nft", "list", "map", "inet", "tensorlane", "flows4"], check=False).stdout
            wait_for(f"repaired after {fault}", repaired, 5)  # (a pass every 0.1 s: FAST)
            got = udp_exchange(h1, h2, 9821, 9820, seconds=0.5)
            plain = udp_exchange(h1, h2, 9822, 9820, seconds=0.5)
            assert got["dscp"] == {"46": got["packets"]} and got["packets"] > 0, (fault, got)
            assert plain["dscp"] == {"0": plain["packets"]} and plain["packets"] > 0, (fault, plain)
            assert chains_as_made(), fault
    assert nft_tables(h1) == tables


def test_foreign_filters_added_again_and_again(fz):
    """Foreign u32 filters on the agent's qdisc and parent class, at several prios and in another chain, added
    again and again: each is removed, the passes keep passing, the flow keeps its class; the log says it once and
    once as a tool that keeps adding them (before, a line a pass)."""
    h1, h2 = fz.host(1), fz.host(2)
    before = tc_dump(h1)
    with running_agents(fz, levels=2, hosts=[1], backend="htb", config_extra=FAST) as agents:
        with agents[1].client() as agent:
            agent.register("job-t", 0, [flow(h1, 9831, h2, 9830)])
        for i in range(10):
            for parent in ("7a1:", "7a1:1"):
                h1.run(["tc", "filter", "add", "dev", "eth0", "parent", parent, "protocol", "ip", "prio",
                        str(1 + i % 4), "u32", "match", "ip", "dst", h2.ip + "/32", "flowid", "7a1:12"])
            time.sleep(0.05)

        def clean():
            return not "".join(h1.run(["tc", "filter", "show", "dev", "eth0", "parent", p]).stdout
                               for p in ("7a1:", "7a1:1")).strip()
        wait_for("filters removed", clean)
        passes_again(agents[1])
        st = agents[1].status()
        assert st["reconcile"]["errors"] == 0, st["reconcile"]
        log = agents[1].stderr_tail(50000)  # said once, then once as a tool that keeps adding them (not each pass)
        assert log.count("removed foreign tc filters") <= 2 and st["reconcile"]["repairs"] >= 3, (log, st)
    assert tc_dump(h1) == before


def test_moved_to_another_namespace_and_back_keeps_flows_marked(fz):
    """eth0 (with flows registered) moved into another namespace and back (its address put back): its flows are
    marked on the wire again and in the map. The move destroyed its tree (the kernel's doing): on exit it has the
    tree it came back with (the default), and the testbed's shaping is put back by hand."""
    h1, h2 = fz.host(1), fz.host(2)
    before, tables = tc_dump(h1), nft_tables(h1)
    subprocess.run(["ip", "netns", "add", "fz-away"], check=True)
    try:
        with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
            with agents[1].client() as agent:
                agent.register("job-m", 1, [flow(h1, 9841, h2, 9840)])
            h1.run(["ip", "link", "set", "eth0", "netns", "fz-away"])
            wait_for("eth0 absent", lambda: not agents[1].status()["interfaces"][0]["present"])
            subprocess.run(["ip", "-n", "fz-away", "link", "set", "eth0", "netns", h1.name], check=True)
            h1.run(["ip", "addr", "add", f"{h1.ip}/24", "dev", "eth0"])
            h1.run(["ip", "link", "set", "eth0", "up"])
            wait_for("eth0 taken over again", lambda: ours(h1) == ["eth0"] and agents[1].status()[
                "interfaces"][0]["present"])
            passes_again(agents[1])
            assert "9841" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
            time.sleep(1.0)  # the neighbour entry
            got = udp_exchange(h1, h2, 9841, 9840, seconds=0.5)
            assert got["dscp"] == {"34": got["packets"]} and got["packets"] > 0, got
        after = tc_dump(h1)
    finally:
        subprocess.run(["ip", "-n", "fz-away", "link", "set", "eth0", "netns", h1.name], check=False,
                       capture_output=True)
        subprocess.run(["ip", "netns", "del", "fz-away"], check=False)
        for cmd in ("qdisc replace dev eth0 root handle 1: htb default 10 r2q 10",
                    "class add dev eth0 parent 1: classid 1:10 htb rate 100mbit ceil 100mbit burst 14000b"
                    " cburst 14000b",
                    "qdisc add dev eth0 parent 1:10 handle 10: pfifo limit 1000"):
            h1.run(["tc", *cmd.split()], check=False)
    assert after.startswith("qdisc noqueue 0: root") and "7a1:" not in after and nft_tables(h1) == tables, after
    assert tc_dump(h1) == before


def kill_agent(fz, tmp_path, during, **kw) -> None:
    """Run an agent on host 1, call ``during(agent)``, then SIGKILL it (it leaves its trees and state files)."""
    with pytest.raises(AgentStartError, match="exited with -9"):
        with running_agents(fz, hosts=[1], backend="htb", workdir=str(tmp_path), **kw) as agents:
            during(agents[1])
            agents[1].proc.kill()
            agents[1].proc.wait(5)


def test_sigkill_after_a_mid_run_take_over_then_a_new_agent_adopts_and_restores(fz, tmp_path):
    """tlx re-created (with a foreign root) and taken over mid-run, then SIGKILL: the next agent adopts both trees
    and restores each device's original on exit."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx")}
        extra = {"interfaces": ["eth0", "tlx"], **FAST}

        def recreate(agent):
            del_links(h1, "tlx")
            add_veth(h1, "tlx", "10mbit")
            wait_for("the new tlx taken over", lambda: ours(h1) == ["eth0", "tlx"] and
                     state_files(agent).get("tlx") == links(h1)["tlx"])

        kill_agent(fz, tmp_path, recreate, config_extra=extra)
        assert ours(h1) == ["eth0", "tlx"]
        with running_agents(fz, hosts=[1], backend="htb", config_extra=extra) as agents:
            assert "adopting the tree left by a previous agent on tlx" in agents[1].stderr_tail()
            passes_again(agents[1])
        assert tc_dump(h1, "eth0") == before["eth0"] and tc_dump(h1, "tlx") == before["tlx"]
        assert ours(h1) == [] and "tensorlane" not in nft_tables(h1)
    finally:
        del_links(h1, "tlx")


def test_sigkill_then_renamed_away_and_a_new_device_under_the_name(fz, tmp_path):
    """SIGKILL, then (no agent running) tlx is renamed to tly and a new tlx comes: the next agent gives the renamed
    device its recorded tree back (before, the record was overwritten by the new tlx's and tly kept the agent's
    tree for good), takes over the new tlx, and restores it on exit."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = tc_dump(h1, "tlx")
        extra = {"interfaces": ["eth0", "tlx"], **FAST}
        kill_agent(fz, tmp_path, lambda agent: None, config_extra=extra)
        h1.run(["ip", "link", "set", "tlx", "name", "tly"])
        add_veth(h1, "tlx", "20mbit", peer="tlxq")
        new = tc_dump(h1, "tlx")
        with running_agents(fz, hosts=[1], backend="htb", config_extra=extra):
            assert tc_dump(h1, "tly") == before.replace("tlx", "tly")
            assert ours(h1) == ["eth0", "tlx"]
        assert tc_dump(h1, "tlx") == new and ours(h1) == []
    finally:
        del_links(h1, "tlx", "tly")


def test_sigkill_then_two_managed_interfaces_swap_names(fz, tmp_path):
    """SIGKILL, then (no agent running) tlx and tly swap names: the next agent finds each device's record by its
    index under the other name and adopts it, and on exit each device has its own original tree. Before, it refused
    to start ("a tensorlane root qdisc but no state file") and both devices kept the agent's tree."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    add_veth(h1, "tly", "20mbit")
    try:
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx", "tly")}
        extra = {"interfaces": ["eth0", "tlx", "tly"], **FAST}
        kill_agent(fz, tmp_path, lambda agent: None, config_extra=extra)
        h1.run(["ip", "link", "set", "tlx", "name", "tlt"])
        h1.run(["ip", "link", "set", "tly", "name", "tlx"])
        h1.run(["ip", "link", "set", "tlt", "name", "tly"])
        idx = links(h1)
        with running_agents(fz, hosts=[1], backend="htb", config_extra=extra) as agents:
            assert agents[1].stderr_tail().count("adopting the tree left by a previous agent") == 3
            assert state_files(agents[1]) == {"eth0": idx["eth0"], "tlx": idx["tlx"], "tly": idx["tly"]}
            passes_again(agents[1])
        assert tc_dump(h1, "eth0") == before["eth0"]
        assert tc_dump(h1, "tly") == before["tlx"].replace("tlx", "tly")  # the device first named tlx
        assert tc_dump(h1, "tlx") == before["tly"].replace("tly", "tlx")
        assert ours(h1) == [] and "tensorlane" not in nft_tables(h1)
    finally:
        del_links(h1, "tlx", "tly", "tlt")


def test_sigkill_then_an_interface_no_longer_configured_is_restored_at_start(fz, tmp_path):
    """SIGKILL, then the next agent no longer names tlx: tlx is restored at its start (as before the change that
    finds a left device by its index)."""
    h1 = fz.host(1)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = tc_dump(h1, "tlx")
        kill_agent(fz, tmp_path, lambda agent: None, config_extra={"interfaces": ["eth0", "tlx"], **FAST})
        with running_agents(fz, hosts=[1], backend="htb", config_extra={"interfaces": ["eth0"], **FAST}) as agents:
            assert tc_dump(h1, "tlx") == before and ours(h1) == ["eth0"]
            assert set(state_files(agents[1])) == {"eth0"}
    finally:
        del_links(h1, "tlx")


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_state_dir_read_only_or_full_mid_run(fz, fault):
    """state_dir (a small tmpfs) made read-only or full mid-run, then tlx renamed away and back and re-created: what
    cannot be recorded is not taken over (its foreign root untouched, a clear error), nothing else breaks; once the
    state_dir is writable again tlx is taken over, and on exit every device is as before."""
    h1 = fz.host(1)
    st = "/run/tensorlane/fz-h1-state"
    os.makedirs(st, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", st], check=True)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = {dev: tc_dump(h1, dev) for dev in ("eth0", "tlx")}
        with running_agents(fz, hosts=[1], backend="htb",
                            config_extra={"interfaces": ["eth0", "tlx"], "state_dir": st, **FAST}) as agents:
            assert ours(h1) == ["eth0", "tlx"]
            if fault == "read-only":  # (full: after the give back, which frees its state file's room)
                subprocess.run(["mount", "-o", "remount,ro", st], check=True)
            h1.run(["ip", "link", "set", "tlx", "name", "tly"])
            wait_for("tly given back", lambda: ours(h1) == ["eth0"])
            if fault == "full":
                subprocess.run(["dd", "if=/dev/zero", f"of={st}/fill", "bs=4k", "count=64"], capture_output=True)
            assert tc_dump(h1, "tly") == before["tlx"].replace("tlx", "tly")
            h1.run(["ip", "link", "set", "tly", "name", "tlx"])
            wait_for("refused", lambda: "cannot write its state file" in agents[1].status()["reconcile"][
                "last_error"])
            del_links(h1, "tlx")
            add_veth(h1, "tlx", "10mbit")
            time.sleep(0.5)
            assert ours(h1) == ["eth0"] and tc_dump(h1, "tlx") == before["tlx"]
            assert agents[1].status()["interfaces"][0]["present"]
            if fault == "read-only":
                subprocess.run(["mount", "-o", "remount,rw", st], check=True)
            else:
                os.unlink(f"{st}/fill")
            wait_for("taken over", lambda: ours(h1) == ["eth0", "tlx"])
            passes_again(agents[1])
        assert tc_dump(h1, "eth0") == before["eth0"] and tc_dump(h1, "tlx") == before["tlx"]
        assert ours(h1) == [] and not [f for f in os.listdir(st) if f.endswith(".json")]
    finally:
        del_links(h1, "tlx", "tly")
        subprocess.run(["umount", st], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(st)


def test_sigterm_while_a_device_is_re_created_again_and_again(fz, tmp_path):
    """tlx deleted and re-created (with a foreign root) every few ms while the agent reconciles every 0.1 s; SIGTERM
    at a random moment, five times: each agent exits 0 and leaves no tree, state file or table behind."""
    h1 = fz.host(1)
    rng = random.Random(11)
    add_veth(h1, "tlx", "10mbit")
    try:
        before = tc_dump(h1, "eth0")
        for attempt in range(5):
            stopping = threading.Event()

            def flap(stopping=stopping):
                for _ in range(200):
                    if stopping.is_set():
                        return
                    del_links(h1, "tlx")
                    with contextlib.suppress(Exception):
                        add_veth(h1, "tlx", "10mbit")
                    time.sleep(rng.uniform(0.0, 0.03))

            with running_agents(fz, hosts=[1], backend="htb", workdir=str(tmp_path / str(attempt)),
                                config_extra={"interfaces": ["eth0", "tlx"], "take_over_root": True,
                                              "reconcile_interval_s": 0.1}) as agents:
                flapper = threading.Thread(target=flap)
                flapper.start()
                try:
                    time.sleep(rng.uniform(0.2, 1.0))
                    agents[1].proc.send_signal(signal.SIGTERM)
                    assert agents[1].proc.wait(10) == 0, agents[1].stderr_tail()
                finally:
                    stopping.set()
                    flapper.join(30)
            assert ours(h1) == [] and tc_dump(h1, "eth0") == before and "tensorlane" not in nft_tables(h1)
            assert not [f for f in os.listdir("/run/tensorlane/fz-h1") if f.endswith(".json")] if os.path.isdir(
                "/run/tensorlane/fz-h1") else True
            if "tlx" not in links(h1):
                add_veth(h1, "tlx", "10mbit")
            assert "tbf 1: root" in tc_dump(h1, "tlx")
    finally:
        del_links(h1, "tlx", "tltmp")


def test_a_foreign_filter_in_another_chain_is_not_repaired_every_pass(fz):
    """A foreign filter on the agent's qdisc in chain 1 (which nothing sends packets to once chain 0 is empty) and
    one in chain 0: the chain 0 one is removed once; the passes do not report a repair (and log a warning) every
    reconcile_interval_s for the chain 1 one, which deleting chain 0's filters never removes."""
    h1, h2 = fz.host(1), fz.host(2)
    with running_agents(fz, levels=2, hosts=[1], backend="htb", config_extra=FAST) as agents:
        for chain in ("1", "0"):
            h1.run(["tc", "filter", "add", "dev", "eth0", "parent", "7a1:", "chain", chain, "protocol", "ip", "prio",
                    "3", "u32", "match", "ip", "dst", h2.ip + "/32", "flowid", "7a1:12"])
        wait_for("chain 0's filter removed", lambda: agents[1].status()["reconcile"]["repairs"] >= 1)
        shown = h1.run(["tc", "filter", "show", "dev", "eth0", "parent", "7a1:"]).stdout
        assert "chain 1" in shown and "chain 0" not in shown, shown
        repairs = agents[1].status()["reconcile"]["repairs"]
        time.sleep(1.0)
        st = agents[1].status()["reconcile"]
        assert st["repairs"] == repairs and st["errors"] == 0, st
        assert agents[1].stderr_tail(20000).count("removed foreign tc filters") <= 2


def test_an_administrators_root_or_deleted_leaf_is_put_back_logged_and_counted(fz):
    """``tc qdisc replace dev eth0 root ...``, a leaf qdisc and a leaf class deleted under the agent: the next pass
    puts its tree back, logs what it put back (a class by its id since 2026-11-29; before, only its leaf qdisc) and
    counts a repair (status, metrics). Before, the tree came back and nothing said so: ``repairs`` stayed 0, no line
    in the log, though a tool on the host fought the agent every pass. On exit the original tree is back."""
    h1, h2 = fz.host(1), fz.host(2)
    before, tables = tc_dump(h1, "eth0"), nft_tables(h1)
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        agent = agents[1]
        with agent.client() as c:
            c.register("job-r", 0, [flow(h1, 9821, h2, 9820)])
        repairs = agent.status()["reconcile"]["repairs"]
        h1.run(["tc", "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf", "rate", "10mbit", "burst",
                "32k", "latency", "50ms"])
        wait_for("root put back", lambda: ours(h1) == ["eth0"] and agent.status()["reconcile"]["repairs"] > repairs)
        wait_for("logged", lambda: "put back its root qdisc (tbf 1: was the root)" in agent.stderr_tail())
        repairs = agent.status()["reconcile"]["repairs"]
        h1.run(["tc", "qdisc", "del", "dev", "eth0", "parent", "7a1:11"])
        wait_for("leaf put back", lambda: "qdisc pfifo 101: parent 7a1:11" in h1.run(
            ["tc", "qdisc", "show", "dev", "eth0"]).stdout and agent.status()["reconcile"]["repairs"] > repairs)
        wait_for("logged", lambda: "put back 1 leaf qdiscs (101:)" in agent.stderr_tail())
        repairs = agent.status()["reconcile"]["repairs"]
        h1.run(["tc", "class", "del", "dev", "eth0", "classid", "7a1:12"])  # (its leaf qdisc 102: goes with it)
        wait_for("class put back", lambda: "class htb 7a1:12" in h1.run(
            ["tc", "class", "show", "dev", "eth0"]).stdout and agent.status()["reconcile"]["repairs"] > repairs)
        wait_for("logged", lambda: "put back 1 leaf qdiscs (102:); 1 classes (7a1:12)" in agent.stderr_tail())
        passes_again(agent, 4.0)
        repairs = agent.status()["reconcile"]["repairs"]
        time.sleep(0.5)  # a tree left alone is no repair
        assert agent.status()["reconcile"]["repairs"] == repairs
        assert "9821" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
    assert tc_dump(h1, "eth0") == before and nft_tables(h1) == tables


def test_a_class_added_under_the_agents_tree_is_removed_logged_and_counted(fz):
    """``tc class add ... parent 7a1:1 classid 7a1:99`` (a tool adding its own class at the agent's handles: packets
    whose ``skb->priority`` names it would bypass the levels): the next pass makes the tree afresh without it, and
    logs and counts that as a repair, as for a replaced root. Before, the tree was made afresh with a warning about
    "another layout" but ``repairs`` stayed 0. Registered flows stay marked."""
    h1, h2 = fz.host(1), fz.host(2)
    before = tc_dump(h1, "eth0")
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        agent = agents[1]
        with agent.client() as c:
            c.register("job-c", 0, [flow(h1, 9841, h2, 9840)])
        repairs = agent.status()["reconcile"]["repairs"]
        h1.run(["tc", "class", "add", "dev", "eth0", "parent", "7a1:1", "classid", "7a1:99", "htb", "rate", "1mbit"])
        wait_for("class removed", lambda: "7a1:99" not in h1.run(["tc", "class", "show", "dev", "eth0"]).stdout)
        wait_for("counted", lambda: agent.status()["reconcile"]["repairs"] > repairs)
        wait_for("logged", lambda: "put back its tree, made afresh (it had classes 7a1:99" in agent.stderr_tail())
        assert "class htb 7a1:13 parent 7a1:1 leaf 103: prio 3" in h1.run(["tc", "class", "show", "dev", "eth0"]).stdout
        assert "9841" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"]).stdout
    assert tc_dump(h1, "eth0") == before


def test_a_class_or_leaf_changed_in_place_is_put_back_logged_and_counted(fz):
    """``tc class change`` on a level's class (capped at 1 Mbit/s, another prio) and ``tc qdisc change`` of a leaf's
    limit, under the agent's running tree: the next pass sets them back, logs what it put back and counts a repair.
    Before, each pass set them back and nothing said so (``repairs`` 0, no log line): a tuning script capping the
    urgent class went unseen. The agent's own changes (the pass's, a new job part) are no repair."""
    h1 = fz.host(1)
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        agent = agents[1]
        passes_again(agent, 4.0)
        repairs = agent.status()["reconcile"]["repairs"]
        assert repairs == 0, agent.status()["reconcile"]
        h1.run(["tc", "class", "change", "dev", "eth0", "parent", "7a1:1", "classid", "7a1:10", "htb", "rate", "8kbit",
                "ceil", "1mbit", "prio", "5"])
        wait_for("class put back", lambda: "prio 0 rate 1Mbit ceil 100Mbit" in h1.run(
            ["tc", "class", "show", "dev", "eth0", "classid", "7a1:10"]).stdout)
        wait_for("counted", lambda: agent.status()["reconcile"]["repairs"] == repairs + 1)
        wait_for("logged", lambda: "put back the rate, ceil, quantum or prio of 7a1:10" in agent.stderr_tail())
        h1.run(["tc", "qdisc", "change", "dev", "eth0", "parent", "7a1:11", "handle", "101:", "pfifo", "limit", "3"])
        wait_for("counted", lambda: agent.status()["reconcile"]["repairs"] == repairs + 2)
        assert "limit 1000p" in h1.run(["tc", "qdisc", "show", "dev", "eth0", "parent", "7a1:11"]).stdout
        assert "put back the limit of leaf qdiscs 101:" in agent.stderr_tail()
        time.sleep(0.5)  # a tree left alone is no repair
        assert agent.status()["reconcile"]["repairs"] == repairs + 2


def test_nft_flush_ruleset_is_logged_as_the_table_gone_and_counted(fz):
    """``nft flush ruleset`` (a firewall reload) deletes the agent's table: the next pass makes it again with its
    flows, and says that the table was gone. Before, the log said only "added 1 missing flow entries", as if an
    entry alone had gone, and the table's re-creation was not counted. Flushed again and again (a reload in a
    loop), each is counted, and said once as a tool that keeps changing it (before, one warning a pass)."""
    h1, h2 = fz.host(1), fz.host(2)
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        agent = agents[1]
        with agent.client() as c:
            c.register("job-n", 0, [flow(h1, 9831, h2, 9830)])
        repairs = agent.status()["reconcile"]["repairs"]
        h1.run(["nft", "flush", "ruleset"])
        wait_for("table back", lambda: "9831" in h1.run(["nft", "list", "map", "inet", "tensorlane", "flows4"],
                                                        check=False).stdout)
        wait_for("logged", lambda: "nftables table inet tensorlane is gone" in agent.stderr_tail())
        assert agent.status()["reconcile"]["repairs"] >= repairs + 2  # the table and its flow entry
        for _ in range(6):  # a firewall reload in a loop: each counted, said once as a fight, not logged each time
            h1.run(["nft", "flush", "ruleset"])
            wait_for("table back", lambda: "tensorlane" in nft_tables(h1))
        assert agent.status()["reconcile"]["repairs"] >= repairs + 2 * 7
        log = agent.stderr_tail(50000)
        assert log.count("nftables table inet tensorlane is gone") == 2, log
        assert log.count("a tool on the host keeps changing the nftables table") == 1, log
    assert "tensorlane" not in nft_tables(h1)


def test_run_directory_removed_then_sigkill_the_next_agent_starts_and_restores(fz, tmp_path):
    """``rm -rf`` of the agent's run directory (socket, lock and state files; a tmpfiles clean-up) while it runs:
    within a pass the socket answers again, the state file is written again and the state_dir lock is taken again;
    a SIGKILL then (the watchdog) and the next agent adopts the tree and restores the original on exit. Before, the
    socket stayed unreachable and the next agent refused to start ("a tensorlane root qdisc but no state file"):
    the original tree was lost; and the lock stayed on the removed file (until 2026-11-27)."""
    h1, h2 = fz.host(1), fz.host(2)
    before, tables = tc_dump(h1, "eth0"), nft_tables(h1)  # (the testbed's own htb 1: tree: the original here)
    with pytest.raises(AgentStartError, match="exited with -9"):
        with running_agents(fz, hosts=[1], backend="htb", workdir=str(tmp_path), config_extra=FAST) as agents:
            agent = agents[1]
            run_dir = os.path.dirname(agent.socket)
            for _ in range(20):  # (the agent may write a file into it while rm empties it: rmdir then fails)
                if subprocess.run(["rm", "-rf", run_dir], stderr=subprocess.DEVNULL).returncode == 0:
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"rm -rf {run_dir} failed 20 times")
            wait_for("state file again", lambda: os.path.exists(f"{run_dir}/agent-eth0.json"))
            wait_for("socket again", lambda: os.path.exists(agent.socket))
            wait_for("lock file again", lambda: os.path.exists(f"{run_dir}/agent.lock"))
            held = os.open(f"{run_dir}/agent.lock", os.O_RDONLY)
            try:  # held by the agent again: a second agent with this state_dir (another namespace's) is refused
                with pytest.raises(BlockingIOError):
                    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(held)
            assert agent.status()["reconcile"]["repairs"] >= 2
            with agent.client() as c:
                c.register("job-d", 0, [flow(h1, 9841, h2, 9840)])
            wait_for("logged", lambda: "agent-eth0.json was removed while the agent ran" in agent.stderr_tail())
            agent.proc.kill()
            agent.proc.wait(5)
    assert ours(h1) == ["eth0"]
    with running_agents(fz, hosts=[1], backend="htb", config_extra=FAST) as agents:
        assert "adopting the tree left by a previous agent on eth0" in agents[1].stderr_tail()
    assert tc_dump(h1, "eth0") == before and nft_tables(h1) == tables


READ_ONLY_CLOSE = r"""
import os, subprocess, sys
sys.path.insert(0, sys.argv[2])
from test_metrics import fake_api
from tensorlane.agent.server import Server
d = sys.argv[1]
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", d], check=True)
server = Server(fake_api(), os.path.join(d, "agent.sock"), 0o600)
subprocess.run(["mount", "-o", "remount,ro", d], check=True)
server.close()
print("closed; the socket file left:", os.path.exists(os.path.join(d, "agent.sock")))
"""


def test_a_socket_directory_read_only_at_exit_does_not_fail_the_exit(tmp_path):
    """The socket's directory read-only by the time the agent stops (a remount): ``Server.close()`` logs that the
    file stays and returns, so the exit (and the restore, after it) goes on with status 0; before, only a missing
    file was allowed for and EROFS raised out of close(). Real read-only tmpfs, in a mount namespace of its own."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["unshare", "-m", sys.executable, "-c", READ_ONLY_CLOSE, str(tmp_path), here],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(here)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "closed; the socket file left: True" in out.stdout and "cannot remove the socket file" in out.stderr
