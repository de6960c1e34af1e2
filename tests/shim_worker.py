"""A training worker for the shim tests, run under torchrun (env:// rendezvous) or with RANK/WORLD_SIZE/MASTER_*
set by hand. Trains the same small model with plain DDP, the shim's hook mode and its overlap mode, and saves each
mode's final parameters (and a checkpoint round trip) to OUT/mode-rank.pt.

    torchrun --standalone --nproc-per-node 2 tests/shim_worker.py --out DIR --steps 20 --optimizer sgd
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorlane import shim  # noqa: E402


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def make_optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=1e-4)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


def train(mode: str, args, rank: int) -> tuple[dict, dict]:
    model = DDP(make_model(), bucket_cap_mb=0.01)  # several buckets, so several levels are in flight
    opt = make_optimizer(args.optimizer, model.parameters())
    handle = None
    if mode != "ddp":
        handle = shim.attach(model, optimizer=opt if mode == "overlap" else None, levels=args.levels,
                             agent_socket=args.agent_socket, partition_bytes=args.partition_bytes,
                             disable=(mode == "disabled"), link_bps=args.link_bps)
    loss_fn = nn.CrossEntropyLoss()
    steps = args.steps if args.join_after is None else args.steps - 4 * rank  # uneven inputs under join()
    with contextlib.ExitStack() as joined:  # on leaving join(): the others' remaining steps shadowed, final broadcast
        for step in range(steps):
            if step == args.join_after:
                joined.enter_context(model.join())
            x, y = batch(rank, step)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if mode != "ddp":  # (the plain DDP run is the parameters' reference only: no need to make it longer)
                time.sleep(args.step_sleep)
            if step == args.steps // 2 and mode == "overlap" and args.join_after is None:
                ckpt = {"model": model.state_dict(), "opt": opt.state_dict()}  # flushes pending updates first
                assert all(torch.equal(ckpt["model"][k], v) for k, v in model.state_dict().items())
    model.eval()
    with torch.no_grad():
        model(batch(rank, 999)[0])  # eval forward applies what is pending
    stats = handle.stats() if handle else {}
    if handle:
        handle.close()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, stats


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--modes", default="ddp,hook,overlap,disabled")
    p.add_argument("--agent-socket", default="/nonexistent/tensorlane.sock")
    p.add_argument("--partition-bytes", type=int, default=None)
    p.add_argument("--link-bps", type=float, default=None, help="the planner's link rate (default: the agent's)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep per step in the shim's modes (longer runs; ddp, the reference, does not)")
    p.add_argument("--join-after", type=int, default=None,
                   help="uneven inputs: rank r trains steps - 4 r steps, those from this one on inside model.join(); "
                        "a mode that raises writes OUT/mode-rank.err and the next mode runs")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in args.modes.split(","):
        try:
            params, stats = train(mode, args, rank)
        except RuntimeError as exc:
            if args.join_after is None:
                raise
            with open(os.path.join(args.out, f"{mode}-{rank}.err"), "w") as fh:
                fh.write(str(exc))
            continue
        torch.save(params, os.path.join(args.out, f"{mode}-{rank}.pt"))
        with open(os.path.join(args.out, f"{mode}-{rank}.json"), "w") as fh:
            json.dump(dict(stats, run_id=os.environ.get("TORCHELASTIC_RUN_ID")) if stats.get("enabled") else stats, fh)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
