"""Benchmarks of tensorlane on the namespace testbed: one distributed worker (``bench.worker``: a bare gloo
all-reduce, a training loop, a real CNN), iperf3 bulk traffic (``bench.bulk``), agents per testbed host
(``bench.agents``) and the scenarios that use them (``bench.contention``, ``bench.priority``, ...).

``python -m bench NAME [ARGS]`` calls ``main([NAME, *ARGS])``: ``python -m bench contention --json out.json``.
With ``--json FILE``, the file is stamped afterwards with ``benchmark`` (NAME) and ``machine``
(``bench.workers.machine_info()``) where the benchmark did not record them itself, so that ``bench.report`` can
say what each figure was measured on. ``python -m bench.report`` turns the files into the results page
(results/README.md).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

BENCHMARKS = {
    "contention": ("bench.contention", "all-reduce alone, under bulk with FIFO NICs, and under bulk with agents"),
    "priority": ("bench.priority",
                 "training: plain DDP vs application order vs the shim's priorities (emulated models)"),
    "jobs": ("bench.jobs", "mixes of jobs sharing hosts: JCT under FIFO, each job policy and alone"),
    "control-plane": ("bench.control_plane", "registration latency, memory and throughput at 0/1k/10k flows; soak"),
    "shim-overhead": ("bench.overhead", "step time of the shim against plain DDP when the link is not the bottleneck"),
    "realtrain": ("bench.realtrain", "a real CNN (bf16, LR warm-up, clipping) under bulk: plain DDP vs the shim, "
                                     "loss curves and step times"),
    "validate": ("bench.validate", "issue 4: the execution model's predicted vs measured iteration time, and the "
                                   "planner's choice"),
    "classifier": ("bench.classifier", "per-packet cost of nft map vs u32 filters vs SO_PRIORITY, by flow count"),
}


def json_path(argv: list[str]) -> str | None:
    """The FILE of ``--json FILE`` or ``--json=FILE`` in ``argv`` (None if absent).

    Usage: ``json_path(["--quick", "--json", "out.json"]) == "out.json"``
    """
    for i, arg in enumerate(argv):
        if arg == "--json" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--json="):
            return arg.split("=", 1)[1]
    return None


def stamp(path: str, name: str) -> bool:
    """Add ``benchmark`` and ``machine`` (or, to a benchmark's own ``machine`` record, its ``date`` and ``torch``)
    to the JSON object in ``path`` where missing; False if the file holds no JSON object.

    Usage: ``stamp("results/contention.json", "contention")``
    """
    from bench.workers import machine_info, write_json

    try:
        with open(path) as fh:
            obj = json.load(fh)
    except (OSError, ValueError):
        return False
    if not isinstance(obj, dict):
        return False
    info = machine_info()
    before = json.dumps(obj, sort_keys=True)
    obj.setdefault("benchmark", name)
    if isinstance(obj.get("machine"), dict):   # the benchmark's own record: add only what describes this run
        for key in ("date", "torch"):
            obj["machine"].setdefault(key, info[key])
    else:
        if "machine" in obj:
            obj["machine_note"] = obj["machine"]
        obj["machine"] = info
    if json.dumps(obj, sort_keys=True) == before:
        return True
    write_json(path, obj)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m bench NAME [ARGS]``: run benchmark NAME's ``main(ARGS)`` and stamp its ``--json`` file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        out = sys.stdout if not argv or argv[0] in ("-h", "--help") else sys.stderr  # the list asked for: stdout
        if argv and argv[0] not in ("-h", "--help"):
            print(f"bench: unknown benchmark {argv[0]!r}", file=out)
        print("usage: python -m bench NAME [ARGS...]   (NAME --help for its options)\n\nbenchmarks:", file=out)
        for name, (_, text) in BENCHMARKS.items():
            print(f"  {name:14s} {text}", file=out)
        print("\nthe results page (results/README.md): python -m bench.report (docs/benchmarks.md)", file=out)
        return 0 if out is sys.stdout else 2
    path = json_path(argv[1:])
    mtime = os.path.getmtime(path) if path and os.path.exists(path) else None
    code = importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:]) or 0
    if path and os.path.exists(path) and os.path.getmtime(path) != mtime:  # written by this run: stamp it
        stamp(path, argv[0])
    return code
