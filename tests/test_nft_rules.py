"""The nftables commands the agent sends (agent/kernel/nft.py), as data: no kernel needed. The netns tests
(test_agent_netns.py, test_security_netns.py, test_agent_faults_netns.py) check what they do to packets."""
import json

from tensorlane.agent.config import Config
from tensorlane.agent.kernel import nft
from tensorlane.agent.kernel.qdisc import HtbBackend
from tensorlane.agent.reconcile import Device, Reconciler

CLASSIDS = [0x7A10011, 0x7A10012]


def _chains(cmds: list[dict]) -> dict[str, dict]:
    return {c["add"]["chain"]["name"]: c["add"]["chain"] for c in cmds if "chain" in c.get("add", {})}


def _rules(cmds: list[dict], chain: str) -> list[list[dict]]:
    return [c["add"]["rule"]["expr"] for c in cmds if c.get("add", {}).get("rule", {}).get("chain") == chain]


def _match(expr: list[dict], key: str) -> dict | None:
    """The first match whose left side is ``meta key`` or a payload field ``key``."""
    for e in expr:
        left = e.get("match", {}).get("left", {})
        if left.get("meta", {}).get("key") == key or left.get("payload", {}).get("field") == key:
            return e["match"]
    return None


def test_the_sockless_chain_is_a_base_chain_at_output_and_nothing_needs_fib():
    """This host's TCP without a socket file is told apart by the hook (``output``: forwarded packets never pass
    it), not by ``fib saddr type local``: until 2026-11-29 the rule needed nft_fib, and a kernel without it could
    not take the table (the agent did not start). The chain is made and flushed like ``egress`` (updated in place),
    and made empty without ``reset_user_dscp``, so that a restart that turns it off leaves no rule of it."""
    for reset in (True, False):
        cmds = nft.table_commands(["eth0"], CLASSIDS, [46, 34], reset_user_dscp=reset)
        assert "fib" not in json.dumps(cmds)
        chains = _chains(cmds)
        assert chains[nft.SOCKLESS_CHAIN] == {"family": "inet", "table": "tensorlane", "name": "sockless",
                                              "type": "filter", "hook": "output", "prio": -150, "policy": "accept"}
        assert chains["egress"]["hook"] == "postrouting" and chains["egress"]["prio"] == -150
        made = cmds.index({"add": {"chain": chains[nft.SOCKLESS_CHAIN]}})
        flushed = cmds.index({"flush": {"chain": {"family": "inet", "table": "tensorlane", "name": "sockless"}}})
        rules = [i for i, c in enumerate(cmds) if c.get("add", {}).get("rule", {}).get("chain") == "sockless"]
        assert made < flushed and all(i > flushed for i in rules) and len(rules) == (4 if reset else 0)
        # the egress chain keeps no rule for TCP without a socket file (only the lookups, root's accept and the
        # users' reset, which needs a socket file: meta skuid != 0)
        assert not any(_match(r, "l4proto") and _match(r, "l4proto")["right"] == "tcp"
                       for r in _rules(cmds, "egress")), _rules(cmds, "egress")


def test_the_sockless_rules_let_packets_with_a_socket_file_go_and_keep_kernel_tcp_dscp():
    """Per IP family: first every packet with a socket file goes (``meta skuid >= 0``, which fails without one:
    ``egress`` tells root's from a user's), then the rest of TCP with a DSCP not kept is counted and set to 0. The
    DSCP is tested before the socket is looked at; ``kernel_tcp_dscp`` joins 0 in the values kept."""
    for kept, right in (((), 0), ((24,), {"set": [0, 24]}), ((26, 24), {"set": [0, 24, 26]}),
                        ((0, 24), {"set": [0, 24]})):
        cmds = nft.table_commands(["eth0", "eth1"], CLASSIDS, [46, 34], kernel_tcp_dscp=kept)
        rules = _rules(cmds, nft.SOCKLESS_CHAIN)
        assert len(rules) == 4
        for (go, reset), (nfproto, proto) in zip((rules[0:2], rules[2:4]), (("ipv4", "ip"), ("ipv6", "ip6")),
                                                 strict=True):
            for r in (go, reset):
                assert _match(r, "oifname")["right"] == {"set": ["eth0", "eth1"]}
                assert _match(r, "nfproto")["right"] == nfproto and _match(r, "l4proto")["right"] == "tcp"
                dscp = _match(r, "dscp")
                assert dscp["op"] == "!=" and dscp["right"] == right, dscp
                assert r[0]["match"]["left"]["meta"]["key"] == "oifname"
            keys = [e["match"]["left"].get("meta", {}).get("key") for e in go if "match" in e]
            assert keys[-1] == "skuid" and keys.index("skuid") > [
                e["match"]["left"].get("payload", {}).get("field") for e in go if "match" in e].index("dscp")
            assert _match(go, "skuid") == {"op": ">=", "left": {"meta": {"key": "skuid"}}, "right": 0}
            assert go[-1] == {"accept": None}
            assert _match(reset, "skuid") is None
            assert reset[-2:] == [{"counter": None},
                                  {"mangle": {"key": {"payload": {"protocol": proto, "field": "dscp"}}, "value": 0}}]


def test_the_reset_counter_sums_the_egress_and_sockless_chains():
    """``tensorlane_unregistered_dscp_reset_packets_total`` counts the users' packets reset in ``egress`` and the
    TCP without a socket file reset in ``sockless`` (a kernel TCP client whose DSCP is not in kernel_tcp_dscp: a
    steady rise); the ``accept`` rules' counters, and the level chains', are not resets."""
    def rule(chain: str, packets: int, mangle: bool) -> dict:
        expr = [{"counter": {"packets": packets, "bytes": packets * 100}}]
        expr += [{"mangle": {"key": {"payload": {"protocol": "ip", "field": "dscp"}}, "value": 0}}] if mangle else []
        return {"rule": {"chain": chain, "expr": expr}}
    listing = {"nftables": [rule("egress", 3, True), rule("sockless", 5, True), rule("sockless", 100, False),
                            rule("level0", 1000, True)]}
    assert nft.reset_counters(listing) == {"packets": 8, "bytes": 800}


def test_the_reconciler_installs_the_configured_kernel_tcp_dscp():
    rec = Reconciler([Device("eth0", 2, HtbBackend(2, 10**9), "eth0")], (46, 26), {"eth0": 2}, None, nft=object(),
                     kernel_tcp_dscp=(24,))
    rules = _rules(rec._table_commands(), nft.SOCKLESS_CHAIN)
    assert rules and all(_match(r, "dscp")["right"] == {"set": [0, 24]} for r in rules)
    default = Reconciler([Device("eth0", 2, HtbBackend(2, 10**9), "eth0")], (46, 26), {"eth0": 2}, None,
                         nft=object())
    assert Config.kernel_tcp_dscp == () and default.kernel_tcp_dscp == ()
    assert all(_match(r, "dscp")["right"] == 0 for r in _rules(default._table_commands(), nft.SOCKLESS_CHAIN))
