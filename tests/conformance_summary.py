"""Summarize a conformance-matrix run kept with TENSORLANE_CONFORMANCE_OUT=DIR: per idiom, the worst relative
difference from plain DDP of each mode (over ranks, final state and loop observations) and the overlap cells'
mode, for 2 and 3 ranks, as a Markdown table.

    python tests/conformance_summary.py DIR
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


def main(out: str) -> int:
    worker = _load("conformance_worker")
    tc = _load("test_conformance")
    idioms = list(worker.MAIN_IDIOMS) + ["checkpoint_resume"]
    print("| idiom | hook, 2 ranks | overlap, 2 ranks | hook, 3 ranks | overlap, 3 ranks | overlap cells ran as |")
    print("|---|---:|---:|---:|---:|---|")
    for idiom in idioms:
        row, modes = [], set()
        for world in (2, 3):
            for mode in ("hook", "overlap"):
                d, reported = cell(out, idiom, mode, world, tc)
                row.append("0" if d == 0 else f"{d:.1e}")
                if mode == "overlap":
                    modes.add(reported)
        print(f"| {idiom} | " + " | ".join(row) + f" | {', '.join(sorted(modes))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
