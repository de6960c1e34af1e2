"""Lightning Fabric worker for tests/test_frameworks.py: ``Fabric(accelerator="cpu", devices=N, strategy="ddp")``
under torchrun (2 processes on one host, gloo over loopback), the same loop once without the shim and once with it
per variant:

- ``basic``: ``fabric.setup(model, opt)``, ``fabric.backward``, ``opt.step()``; with the shim
  ``shim.attach(model, opt)`` on the ``_FabricModule`` and the ``_FabricOptimizer`` as ``setup`` returns them
  (``tensorlane.shim.fabric`` not needed: ``attach`` unwraps Fabric's wrapper to its DDP model);
- ``clip``: ``fabric.clip_gradients(model, opt, max_norm=0.05)`` before each step (clipping on every step);
- ``accum``: ``with fabric.no_backward_sync(model, enabled=not last):`` two micro-batches per step;
- ``hook``: ``shim.attach(model)`` (hook mode, no optimizer);
- ``save``: ``basic`` with ``fabric.save`` after step 3 and ``fabric.load`` of it into fresh objects, which train on;
- ``compiled``: ``fabric.setup(torch.compile(model, backend="eager"), opt, _reapply_compile=False)``: DDP of the
  compiled module, which ``attach`` takes (overlap mode);
- ``compile_refused``: ``fabric.setup(torch.compile(model), opt)`` (Fabric compiles the DDP model it makes):
  ``attach`` refuses it with a ``TypeError`` naming ``_reapply_compile=False`` (recorded as ``error``; nothing trains).

    torchrun --nproc-per-node 2 tests/framework_workers/fabric_worker.py --out DIR --variants basic,clip
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository on sys.path)
from lightning.fabric import Fabric  # noqa: E402

from tensorlane import shim  # noqa: E402

CLIP_NORM = 0.05  # under this model's gradient norm: clipping on every step
STEPS = 6


def make(fabric, kind: str = ""):
    net = common.make_model()
    if kind == "compiled":
        net = torch.compile(net, backend="eager")
    if kind == "compile_refused":
        net = torch.compile(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return net, opt


def train(fabric, kind: str, with_shim: bool, args) -> tuple[dict, dict]:
    net, opt = make(fabric, kind)
    initial = common.params_of(net)
    model, opt = fabric.setup(net, opt, _reapply_compile=kind != "compiled")
    if kind == "compile_refused":
        try:
            shim.attach(model, opt, levels=args.levels, policy="layer_order")
            error = None
        except TypeError as exc:
            error = str(exc)
        return common.params_of(net), {"variant": kind, "error": error, "ddp": type(model._forward_module).__name__}
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(common.dataset(), batch_size=4, shuffle=False))
    record = {"variant": kind, "shim": with_shim, "world_size": fabric.world_size, "grad_norms": [], "losses": [],
              "ddp": type(model._forward_module).__name__, "module": type(model._forward_module.module).__name__,
              "backend": torch.distributed.get_backend()}
    handle = None
    if with_shim:
        handle = shim.attach(model, None if kind == "hook" else opt, levels=args.levels, job=f"fw-fabric-{kind}",
                             policy="layer_order")
    loss_fn = nn.CrossEntropyLoss()
    accum = 2 if kind == "accum" else 1
    steps = micro = 0
    ckpt = os.path.join(args.out, f"ckpt-{'shim' if with_shim else 'plain'}.pt")  # (rank 0 writes it)
    for x, y in loader:
        micro += 1
        last = micro % accum == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_fn(model(x), y)
            fabric.backward(loss / accum)
        record["losses"].append(loss.item())
        if not last:
            continue
        if kind == "clip":
            record["grad_norms"].append(float(fabric.clip_gradients(model, opt, max_norm=CLIP_NORM)))
        opt.step()
        opt.zero_grad()
        steps += 1
        if kind == "save" and steps == 3:
            fabric.save(ckpt, {"model": model, "optimizer": opt, "steps": steps})
            if handle is not None:
                handle.close()
            net, opt = make(fabric)
            model, opt = fabric.setup(net, opt)
            state = {"model": model, "optimizer": opt, "steps": 0}
            fabric.load(ckpt, state)
            record["resumed_at"] = state["steps"]
            if with_shim:
                handle = shim.attach(model, opt, levels=args.levels, job="fw-fabric-save2", policy="layer_order")
        if steps == STEPS:
            break
    record.update(steps=steps, micro_batches=micro)
    if handle is not None:
        record["stats"] = handle.stats()
        handle.close()  # applies the pending updates (overlap mode) before the parameters are read
    params = common.params_of(model.module)
    record["initial_changed"] = any(not torch.equal(initial[k], v) for k, v in params.items())
    record["optimizer_state"] = {str(k): float(v["momentum_buffer"].abs().sum())
                                 for k, v in opt.optimizer.state_dict()["state"].items()}
    return params, record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="basic,clip,accum,hook,save")
    p.add_argument("--levels", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")), strategy="ddp")
    fabric.launch()
    for kind in args.variants.split(","):
        for with_shim in (False, True) if kind != "compile_refused" else (True,):
            params, record = train(fabric, kind, with_shim, args)
            common.save(args.out, f"{'shim' if with_shim else 'plain'}-{kind}", fabric.global_rank, params, record)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
