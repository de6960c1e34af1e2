"""Kernel-facing parts of the agent: qdisc backends (netlink), nftables marking, detection, snapshots."""
