"""Benchmarks of tensorlane on the namespace testbed: a gloo all-reduce worker (``bench.allreduce``), iperf3 bulk
traffic (``bench.bulk``), agents per testbed host (``bench.agents``) and the contention scenario of the demo
(``bench.contention``).

``tensorlane bench NAME [ARGS]`` calls ``main([NAME, *ARGS])``: ``tensorlane bench contention --json out.json``.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "contention": ("bench.contention", "all-reduce alone, under bulk with FIFO NICs, and under bulk with agents"),
    "allreduce": ("bench.allreduce", "one gloo all-reduce worker (run one per rank)"),
    "priority": ("bench.priority", "training: plain DDP vs application order vs the shim's priorities (emulated models)"),
    "control-plane": ("bench.control_plane", "registration latency, memory and throughput at 0/1k/10k flows; soak"),
    "classifier": ("bench.classifier", "per-packet cost of nft map vs u32 filters vs SO_PRIORITY, by flow count"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        out = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"tensorlane bench: unknown benchmark {argv[0]!r}", file=out)
        print("usage: tensorlane bench NAME [ARGS...]   (NAME --help for its options)\n\nbenchmarks:", file=out)
        for name, (_, text) in BENCHMARKS.items():
            print(f"  {name:12s} {text}", file=out)
        return 0 if out is sys.stdout else 2
    return importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:]) or 0
