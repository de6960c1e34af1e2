"""Hugging Face Accelerate worker for tests/test_frameworks.py: one process per testbed host namespace.

``Accelerator(cpu=True)`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
(as torchrun sets them) is Accelerate's MULTI_CPU mode: it initializes a gloo process group itself and
``prepare()`` wraps the model in DistributedDataParallel. Each variant trains the same model from the same
data, without the shim (``plain``) and with ``handle = shim.attach(model, optimizer)`` (``shim``: overlap mode
requested):

- ``basic``: ``accelerator.backward(loss); opt.step(); opt.zero_grad()``;
- ``clip``:  the same with ``accelerator.clip_grad_norm_`` between backward and step (the shim must fall back
  to hook mode: clipping acts on the averaged gradient);
- ``accum``: ``gradient_accumulation_steps=2`` and ``with accelerator.accumulate(model)`` (no_sync on every
  other micro-batch; the optimizer steps only on synchronized ones), and ``opt.zero_grad(set_to_none=True)``
  (Accelerate reads the signature of the optimizer's ``zero_grad``, which the shim wraps);
- ``accum_manual``: the older Hugging Face ``no_trainer`` scripts' accumulation: every micro-batch's backward
  synchronized (no ``accumulate``, no ``no_sync``), ``loss / 2``, and every second one ``opt.step()``,
  ``lr_scheduler.step()`` (a LambdaLR warm-up given to ``prepare``), ``opt.zero_grad()``; AdamW.
- ``local_sgd``: post-local SGD with Accelerate's ``LocalSGD`` (``accelerate.local_sgd``): two synchronized steps (the
  probe, then overlap mode), then ``LocalSGD(local_sgd_steps=2)`` entered (``model.no_sync()``: each rank steps on its
  own gradient, the parameters averaged every second step and at its exit), left after three steps, one
  synchronized step after it. Until 2026-11-27 the shim refused the first step after ``no_sync`` in overlap mode.

    python tests/framework_workers/accelerate_worker.py --out DIR --variants basic,clip,accum,accum_manual --levels 3 \
        --agent-socket /run/tensorlane/fwa-h1/agent.sock --job fw-acc
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository on sys.path)
from accelerate import Accelerator  # noqa: E402

from tensorlane import shim  # noqa: E402


def train(kind: str, with_shim: bool, args) -> tuple[dict, dict]:
    accum = 2 if kind == "accum" else 1
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    net = common.make_model()
    initial = common.params_of(net)
    loader = torch.utils.data.DataLoader(common.dataset(), batch_size=8, shuffle=False)
    sched = None
    if kind == "accum_manual":
        opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
        model, opt, loader, sched = accelerator.prepare(net, opt, loader, sched)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        model, opt, loader = accelerator.prepare(net, opt, loader)
    job = f"{args.job}-{kind}"
    record = {"variant": kind, "shim": with_shim, "distributed_type": accelerator.distributed_type.name,
              "num_processes": accelerator.num_processes, "ddp": type(model).__name__, "backend":
              torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
    record["grad_norms"] = []  # clip: the norm before clipping, on every rank the averaged gradient's
    handle = None
    if with_shim:
        # layer_order: every level carries pieces, whatever the planner would measure on a loaded machine
        handle = shim.attach(model, opt, levels=args.levels, agent_socket=args.agent_socket, job=job,
                             policy="layer_order")
    loss_fn = nn.CrossEntropyLoss()
    steps = micro = 0
    local_sgd = None
    for x, y in loader:
        if kind == "local_sgd" and micro == 2:  # after the probe and one overlap step: post-local SGD
            from accelerate.local_sgd import LocalSGD
            local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2).__enter__()
        if kind == "accum_manual":  # every backward synchronized: under DDP each all-reduces last average + own
            accelerator.backward(loss_fn(model(x), y) / 2)
            micro += 1
            if micro % 2 == 0:
                opt.step()
                sched.step()
                opt.zero_grad()
                steps += 1
            continue
        ctx = accelerator.accumulate(model) if accum > 1 else contextlib.nullcontext()
        with ctx:
            accelerator.backward(loss_fn(model(x), y))
            if kind == "clip":
                norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.05)
                record["grad_norms"].append(float(norm))
            opt.step()
            if kind == "accum":
                opt.zero_grad(set_to_none=True)
            else:
                opt.zero_grad()
            steps += accelerator.sync_gradients
            micro += 1
        if local_sgd is not None:
            local_sgd.step()
            if micro == 5:  # averages the parameters, leaves no_sync: synchronized steps again
                local_sgd.__exit__(None, None, None)
                local_sgd = None
    record.update(steps=steps, micro_batches=micro)
    if handle is not None:
        record["flows_during"] = common.wait_levels(args.agent_socket, job, args.levels, record=record,
                                                    state=handle.state)
        record["stats"] = handle.stats()
        handle.close()  # applies the pending updates (overlap mode) before the parameters are read
        record["flows_after_close"] = common.wait_gone(args.agent_socket, job)
    params = common.params_of(accelerator.unwrap_model(model))
    record["initial_changed"] = any(not torch.equal(initial[k], v) for k, v in params.items())
    return params, record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="basic,clip,accum,accum_manual")
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--agent-socket", default=None)
    p.add_argument("--job", default="fw-acc")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="accelerate")
    for kind in args.variants.split(","):
        for with_shim in (False, True):
            params, record = train(kind, with_shim, args)
            rank = torch.distributed.get_rank()
            common.save(args.out, f"{'shim' if with_shim else 'plain'}-{kind}", rank, params, record)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
