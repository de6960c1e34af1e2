"""Make the kernel match the desired state: the qdisc tree of the backend and the nftables flow maps.

Incremental changes (a registration, or the flows a job-order change moves) go out as one nftables transaction; a
full pass compares the kernel's maps with the FlowTable and repairs any drift (run periodically and after any
failed change). The kernel gets each flow's *effective* level (``FlowTable.effective_level``: the level asked
for, or what the job policy makes of it).
Usage: ``rec = Reconciler(backend, dscp, ifname, ifindex, ipr); rec.install(); rec.apply(table, added, moved, removed)``
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tensorlane.agent.kernel import nft as nftables
from tensorlane.agent.state import FlowTable
from tensorlane.flows import FlowKey

log = logging.getLogger("tensorlane.reconcile")


@dataclass
class ReconcileStats:
    passes: int = 0
    repairs: int = 0
    errors: int = 0
    last_error: str = ""


class Reconciler:
    """Owns the kernel objects of one managed interface."""

    def __init__(self, backend, dscp: tuple[int, ...], ifname: str, ifindex: int, ipr, nft=None):
        self.backend = backend
        self.dscp = dscp
        self.ifname = ifname
        self.ifindex = ifindex
        self.ipr = ipr
        self.nft = nft or nftables.Nft()
        self.stats = ReconcileStats()

    def _table_commands(self) -> list[dict]:
        classids = [self.backend.classid(lvl) for lvl in range(self.backend.levels)]
        return nftables.table_commands(self.ifname, classids, list(self.dscp))

    def install(self) -> None:
        """Create (or update in place) the qdisc tree and the nftables table, keeping registered elements."""
        self.backend.apply(self.ipr, self.ifindex)
        self.nft.run(self._table_commands())

    def apply(self, table: FlowTable, added: list[FlowKey], moved: list[FlowKey], removed: list[FlowKey]) -> None:
        """Push one change to the kernel as a single transaction; fall back to a full pass if it fails.

        ``moved`` flows are in the kernel at their old level: they are deleted and re-added at their effective
        level in the same transaction, so no packet sees them unclassified.
        """
        cmds = nftables.element_commands("delete", [(k, None) for k in (*removed, *moved)])
        cmds += nftables.element_commands("add", [(k, table.effective_level(k)) for k in (*added, *moved)])
        if not cmds:
            return
        try:
            self.nft.run(cmds)
        except nftables.NftError as exc:
            log.warning("incremental update failed (%s); reconciling fully", exc)
            self.reconcile(table)

    def reconcile(self, table: FlowTable) -> int:
        """Full pass: qdisc tree in place, table present, map elements equal to ``table``. Returns repairs."""
        self.stats.passes += 1
        try:
            self.backend.apply(self.ipr, self.ifindex)
            listing = nftables.list_table(self.nft)
            if listing is None or not self._table_complete(listing):
                self.nft.run(self._table_commands())
                listing = nftables.list_table(self.nft)
            have = nftables.parse_map_elements(listing)
            level_of = table.level_of
            want = {k: level_of(e) for k, e in table.flows.items()}
            stale = [k for k, lvl in have.items() if want.get(k) != lvl]
            missing = [k for k, lvl in want.items() if have.get(k) != lvl]
            cmds = nftables.element_commands("delete", [(k, None) for k in stale])
            cmds += nftables.element_commands("add", [(k, want[k]) for k in missing])
            if cmds:
                self.nft.run(cmds)
                self.stats.repairs += len(stale) + len(missing)
                log.info("reconcile: removed %d stale and added %d missing flow entries", len(stale), len(missing))
            return len(stale) + len(missing)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the agent keeps running
            self.stats.errors += 1
            self.stats.last_error = str(exc)
            log.error("reconcile failed: %s", exc)
            return 0

    def _table_complete(self, listing: dict) -> bool:
        chains = {i["chain"]["name"] for i in listing.get("nftables", []) if "chain" in i}
        maps = {i["map"]["name"] for i in listing.get("nftables", []) if "map" in i}
        want_chains = {"egress", *(nftables.level_chain(lvl) for lvl in range(self.backend.levels))}
        rules = sum(1 for i in listing.get("nftables", []) if "rule" in i)
        return want_chains <= chains and {"flows4", "flows6"} <= maps and rules == 2 * len(want_chains)

    def counters(self) -> dict[int, dict[str, int]]:
        """Per-level packet and byte counters of the marking chains."""
        return nftables.chain_counters(nftables.list_table(self.nft))

    def teardown(self) -> None:
        """Remove the nftables table (the qdisc is restored by the daemon from its snapshot)."""
        try:
            self.nft.run(nftables.delete_table_commands())
        except nftables.NftError as exc:
            log.warning("removing the nftables table: %s", exc)
