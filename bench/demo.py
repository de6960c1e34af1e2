"""``python -m bench.demo`` (``make demo``): the contention scenario with a real training loop through the shim.

An emulated ResNet-50 (``bench.models``) is trained by DDP with ``shim.attach(ddp, optimizer, levels=4)`` between
two testbed hosts, alone, under iperf3 bulk with FIFO NICs, and under the same bulk with an agent on every host
(``bench.contention``, workload ``training``). Options are those of ``python -m bench contention``.

Usage: ``python -m bench.demo --json demo.json [--quick]`` (root: it builds network namespaces).
"""
from __future__ import annotations

import sys

from bench import contention


def main(argv=None) -> int:
    """Run the contention scenario with ``--workload training`` (unless the caller chose another workload)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--workload" or a.startswith("--workload=") for a in argv):
        argv = ["--workload", "training", *argv]
    return contention.main(argv)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
