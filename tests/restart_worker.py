"""A training worker for the torchrun restart tests (``tests/test_restarts.py``): run by ``torchrun --max-restarts 1``.

Trains a small MLP with dropout, AdamW and a warm-up LR schedule over a shuffled ``DistributedSampler``, plain DDP
(``--mode ddp``), through the shim in overlap mode (``overlap``) or hook mode (``hook``, ``attach`` without the
optimizer); ``--resume-mode`` is the mode of the restarted attempt (default: ``--mode``). Every ``--save-every``
steps, right after ``optimizer.step()`` (an overlap step still deferred), rank 0 writes a checkpoint (model,
optimizer, scheduler, epoch, step) and each rank its RNG state, atomically, then a barrier. In the first attempt
rank ``--crash-rank`` fails right after the checkpoint of step ``--crash-step``: ``raise`` (an exception), ``kill``
(SIGKILL to itself) or ``hang`` (sleeps; its peer's next collective times out after ``--pg-timeout`` seconds).
A (re)started worker resumes from the checkpoint: the epoch's sampler order, the batches already taken skipped,
the RNG restored. At the end: ``OUT/final-RANK.pt`` (the parameters) and ``OUT/start-RANK-ATTEMPT.json``.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/restart_worker.py --out DIR --mode overlap
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorlane import shim  # noqa: E402


def write_atomic(obj, path: str) -> None:
    """``torch.save`` ``obj`` to ``path`` through a temporary file: a kill never leaves half a checkpoint."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", default="overlap", choices=["ddp", "overlap", "hook"])
    p.add_argument("--resume-mode", default=None, choices=["ddp", "overlap", "hook"])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--crash-step", type=int, default=-1, help="global step (from 1); -1: no crash")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash", default="raise", choices=["raise", "kill", "hang"])
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--agent-socket", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mode = args.mode if attempt == 0 else (args.resume_mode or args.mode)
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())  # dropout: the only draw
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    epoch0, skip, step = 0, 0, 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        epoch0, skip, step = ckpt["epoch"], ckpt["taken"], ckpt["step"]
        torch.set_rng_state(torch.load(os.path.join(args.out, f"rng-{rank}.pt")))
    model = DDP(model, bucket_cap_mb=0.001)  # several buckets
    handle = None
    if mode != "ddp":
        handle = shim.attach(model, optimizer=opt if mode == "overlap" else None, levels=2,
                             agent_socket=args.agent_socket, require_overlap=mode == "overlap")
    with open(os.path.join(args.out, f"start-{rank}-{attempt}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "mode": mode, "step": step, "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                   "job": handle.state.job if handle is not None else None}, f)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        taken = skip if epoch == epoch0 else 0
        for x, y in itertools.islice(loader, taken, None):
            loss_fn(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step, taken = step + 1, taken + 1
            if step % args.save_every == 0:  # right after step(): under overlap the update is still deferred
                if rank == 0:
                    write_atomic({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                  "sched": sched.state_dict(), "epoch": epoch, "taken": taken, "step": step}, ckpt_path)
                write_atomic(torch.get_rng_state(), os.path.join(args.out, f"rng-{rank}.pt"))
                dist.barrier()
            if attempt == 0 and step == args.crash_step and rank == args.crash_rank:
                if args.crash == "raise":
                    raise RuntimeError(f"injected failure at step {step}")
                if args.crash == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
    final = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    torch.save(final, os.path.join(args.out, f"final-{rank}.pt"))
    if handle is not None:
        handle.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
