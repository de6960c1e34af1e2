"""What keeping the gradient watch (``shim.overlap.GradWatch``) on the training thread's mode stack costs in overlap
mode: the time per iteration of one small DDP model in overlap mode with the watch on (the shim as shipped: from the
end of each forward to the next forward) and off (as before 2026-12: only while probing), alternating iteration by
iteration in the same processes, so that both share the machine's noise.

    torchrun --standalone --nproc-per-node 2 bench/grad_watch.py [--iterations 300 --width 256]

Each iteration: a batch drawn (``torch.randn`` on the training thread, inside the watched window), forward, loss,
backward, ``step()``, ``zero_grad()``, ``loss.item()``; the variants alternate iteration by iteration (the setting of
an iteration decides the watch from the end of its forward on). An iteration's time is the slowest rank's. Prints one
JSON line: the median seconds per iteration of each variant, their difference and ratio, the median of the paired
differences, how many torch operations the watch handled per iteration, and what the watch costs one operation
(``torch.add`` of small tensors timed with and without it on the stack): its cost is per operation.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorlane import shim  # noqa: E402
from tensorlane.shim import overlap as ov  # noqa: E402


def iteration(model, opt, step: int, width: int) -> float:
    """One training iteration; returns its seconds."""
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss.item()
    return time.perf_counter() - t0


def op_cost(watch, grads, chunks: int = 40, chunk: int = 2000) -> dict:
    """Seconds per torch operation (``torch.add`` of two small tensors that are not gradients) with the watch on
    the mode stack, watching ``grads``, and without it, in alternating chunks: the medians, and their difference."""
    a, b = torch.ones(4), torch.ones(4)
    out: dict = {"on": [], "off": []}
    watch.watch(grads)
    for k in range(chunks):
        for variant in (("on", "off") if k % 2 else ("off", "on")):
            if variant == "on":
                watch.push()
            t0 = time.perf_counter()
            for _ in range(chunk):
                torch.add(a, b)
            out[variant].append((time.perf_counter() - t0) / chunk)
            watch.pop()
    watch.unwatch()
    on, off = statistics.median(out["on"]), statistics.median(out["off"])
    return {"on": on, "off": off, "diff": on - off}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=300, help="timed iterations per variant (alternating)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--warmup", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*(agent|loopback).*")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    w = args.width
    model = DDP(nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                              nn.Linear(w, 10)), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    handle = shim.attach(model, opt, levels=2, policy="layer_order", agent_socket="/nonexistent/tl.sock")
    watch = handle.state.deferred.watch
    step = 0
    for _ in range(args.warmup):
        iteration(model, opt, step, w)
        step += 1
    assert handle.stats()["mode"] == "overlap", handle.stats()["mode_reason"]

    handled = [0]
    handler = ov.GradWatch.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        handled[0] += 1
        return handler(self, func, types, args, kwargs)
    ov.GradWatch.__torch_function__ = counting
    for _ in range(20):
        iteration(model, opt, step, w)
        step += 1
    ov.GradWatch.__torch_function__ = handler
    per_iteration_ops = handled[0] / 20

    times: dict = {"on": [], "off": []}
    for k in range(args.iterations):
        for variant in (("on", "off") if k % 2 else ("off", "on")):  # paired, neither always first
            if variant == "off":
                watch.push = lambda: None  # as before: the watch is pushed while probing only
            else:
                watch.__dict__.pop("push", None)
            times[variant].append(iteration(model, opt, step, w))
            step += 1
    watch.__dict__.pop("push", None)
    both = torch.tensor([times["on"], times["off"]], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # each iteration's slowest rank
    times = {"on": both[0].tolist(), "off": both[1].tolist()}
    per_op = op_cost(watch, [p.grad if p.grad is not None else p for p in model.parameters()])
    stats = handle.stats()
    handle.close()
    if dist.get_rank() == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        paired = statistics.median(a - b for a, b in zip(times["on"], times["off"], strict=True))
        print(json.dumps({"world": dist.get_world_size(), "width": w, "iterations_each": len(times["on"]),
                          "median_on_s": on, "median_off_s": off, "diff_s": on - off, "ratio": on / off,
                          "median_paired_diff_s": paired, "ops_through_watch_per_iteration": per_iteration_ops,
                          "watch_cost_per_op_s": per_op, "mode": stats["mode"],
                          "averaged_on_read": stats["overlap"]["averaged_on_read"]}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
