"""Summarize a conformance-matrix run kept with TENSORLANE_CONFORMANCE_OUT=DIR: per idiom, the worst relative
difference from plain DDP of each mode (over ranks, final state and loop observations) and the overlap cells'
mode, for the world sizes DIR holds (``DIR/world2``, ``DIR/world3``, ``DIR/world4``...), as a Markdown table, then the
worst cells at more than 2 ranks (the ones that the summation order alone may move off DDP: fp32 around 1e-7..4e-6).

    python tests/conformance_summary.py DIR [--top N]
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cell(out: str, idiom: str, mode: str, world: int, tc) -> tuple[float, str]:
    """Worst difference of one cell over its ranks, and the overlap mode it reported."""
    ref_idiom = "checkpoint_save" if idiom == "checkpoint_resume" else idiom
    worst, reported = 0.0, ""
    for rank in range(world):
        base = os.path.join(out, f"world{world}", f"{idiom}-{mode}-{rank}")
        ref_base = os.path.join(out, f"world{world}", f"{ref_idiom}-ddp-{rank}")
        if not os.path.exists(base + ".pt"):
            return float("nan"), "missing"
        got, ref = torch.load(base + ".pt"), torch.load(ref_base + ".pt")
        with open(base + ".json") as f:
            meta = json.load(f)
        if any(meta.get("errors") or []):
            return float("nan"), "raised"
        worst = max(worst, tc.max_rel_diff(got["state"], ref["state"])[0])
        n = len(got["extras"].get("loss", []))
        extras_ref = ref["extras"] if idiom != "checkpoint_resume" else {"loss": ref["extras"]["loss"][-n:]}
        worst = max(worst, tc.max_rel_diff(got["extras"], extras_ref)[0])
        reported = (meta.get("stats") or {}).get("mode", "")
    return worst, reported


def worlds_in(out: str) -> list[int]:
    """The world sizes whose cells DIR holds (its ``worldN`` folders)."""
    return sorted(int(n[5:]) for n in os.listdir(out) if n.startswith("world") and n[5:].isdigit())


def main(out: str, top: int = 15) -> int:
    worker = _load("conformance_worker")
    tc = _load("test_conformance")
    idioms = list(worker.MAIN_IDIOMS) + ["checkpoint_resume"]
    worlds = worlds_in(out)
    heads = [f"{mode}, {world} ranks" for world in worlds for mode in ("hook", "overlap")]
    print("| idiom | " + " | ".join(heads) + " | overlap cells ran as |")
    print("|---|" + "---:|" * len(heads) + "---|")
    worst = []
    for idiom in idioms:
        row, modes = [], set()
        for world in worlds:
            for mode in ("hook", "overlap"):
                d, reported = cell(out, idiom, mode, world, tc)
                row.append("0" if d == 0 else f"{d:.1e}")
                if mode == "overlap":
                    modes.add(reported)
                if world > 2:
                    worst.append((-1.0 if d == 0 else d, idiom, mode, world, reported))
        print(f"| {idiom} | " + " | ".join(row) + f" | {', '.join(sorted(modes))} |")
    worst.sort(key=lambda t: (t[0] != t[0], t[0] if t[0] == t[0] else 0.0), reverse=True)  # NaN (missing, raised) first
    print(f"\nWorst {top} cells at more than 2 ranks:\n\n| idiom | mode | ranks | max rel diff |\n|---|---|---:|---:|")
    for d, idiom, mode, world, reported in worst[:top]:
        shown = reported if d != d else ("0" if d < 0 else f"{d:.1e}")
        print(f"| {idiom} | {mode} | {world} | {shown} |")
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    n = 15
    if "--top" in argv:
        i = argv.index("--top")
        n = int(argv[i + 1])
        del argv[i:i + 2]
    sys.exit(main(argv[0], n))
