"""A training worker for ``scripts/torchrun_restart.py``: run by ``torchrun --max-restarts N`` on each testbed host.

Trains a small CNN with SGD + momentum, plain DDP (``--mode ddp``) or through the shim (``--mode overlap`` or ``hook``),
for ``--epochs`` epochs of ``--steps`` steps. After each epoch rank 0 writes a checkpoint (model, optimizer, epoch) to
``OUT/ckpt.pt`` (a temporary file renamed into place, so a kill never leaves half a checkpoint); a (re)started
worker resumes from it. Each start writes ``OUT/init-RANK-N.json`` (N: this rank's start number from 0; the worker
store's address and key count) and ``OUT/start-RANK-N.json`` (pid, torchrun's run id and restart count, the shim's
job id), and ``OUT/progress-RANK.json`` after each step, so that the driver can kill it mid-epoch and read the
agents. At the end: ``OUT/final-RANK.pt`` (the parameters) and ``OUT/stats-RANK-N.json``.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 198.18.0.1:29400 --rdzv-id J \\
        --max-restarts 2 scripts/elastic_worker.py --out DIR --mode overlap --agent-socket SOCK
"""
from __future__ import annotations

import argparse
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
    """The same initial weights on every start (the checkpoint, when there is one, replaces them)."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch that depends only on (rank, epoch, step): a resumed epoch sees the same data."""
    g = torch.Generator().manual_seed(100_000 * epoch + 100 * step + rank)
    return torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="overlap", choices=["ddp", "overlap", "hook"])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--agent-socket", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # only the failed node's agent counts up
    attempt = sum(name.startswith(f"start-{rank}-") for name in os.listdir(args.out))  # this rank's start number
    # the worker store torchrun shares across restarts: keys left by earlier attempts are still there
    store_keys = dist.distributed_c10d._get_default_store().num_keys()
    write_json(os.path.join(args.out, f"init-{rank}-{attempt}.json"),
               {"pid": os.getpid(), "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
                "store_keys": store_keys, "t": time.time()})
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, bucket_cap_mb=0.01)  # several buckets, so both levels carry traffic
    handle = None
    if args.mode != "ddp":  # hook mode: attach without the optimizer
        handle = shim.attach(model, optimizer=opt if args.mode == "overlap" else None, levels=args.levels,
                             agent_socket=args.agent_socket, require_overlap=args.mode == "overlap")
    job = handle.state.job if handle is not None else None
    write_json(os.path.join(args.out, f"start-{rank}-{attempt}.json"),
               {"pid": os.getpid(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "restart": restart,
                "job": job, "start_epoch": start_epoch,
                "master_addr": os.environ.get("MASTER_ADDR")})
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(start_epoch, args.epochs):
        for step in range(args.steps):
            x, y = batch(rank, epoch, step)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            write_json(os.path.join(args.out, f"progress-{rank}.json"),
                       {"pid": os.getpid(), "restart": restart, "epoch": epoch, "step": step})
            time.sleep(args.step_sleep)
        if rank == 0:  # state_dict() applies the shim's pending update first
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()  # no rank starts the next epoch before the checkpoint of this one is in place
    final = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    torch.save(final, os.path.join(args.out, f"final-{rank}.pt"))
    if handle is not None:
        write_json(os.path.join(args.out, f"stats-{rank}-{attempt}.json"), handle.stats())
        handle.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
