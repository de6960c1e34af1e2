"""Hugging Face Accelerate loops for tests/test_frameworks.py (``test_accelerate_loops``): under torchrun (2 processes
on one host, ``Accelerator(cpu=True)``: MULTI_CPU, gloo over loopback, no agent), each variant trained once without
the shim and once with ``shim.attach(model, opt)`` (overlap asked for), the same seeds and data:

- ``accum_clip``: ``gradient_accumulation_steps=3`` (12 micro-batches: 4 steps) with ``accelerator.clip_grad_norm_``
  on every micro-batch, the no_sync ones too (a rank's own partial gradient is clipped there, as under DDP); hook;
- ``bf16``: ``mixed_precision="bf16"``, AdamW; overlap;
- ``no_sync``: ``with accelerator.no_sync(model):`` around every other micro-batch's backward, a step after each
  synchronized one; overlap;
- ``clip_late``: ``accelerator.clip_grad_norm_`` on every step, with a bound reached only from the 4th step on
  (the first steps multiply the gradients by 1.0); hook;
- ``zero_first``: ``opt.zero_grad()`` at the top of the iteration, before the forward (not after the step); overlap;
- ``wclip``: WGAN's weight clipping after every step, ``p.data.clamp_(-0.1, 0.1)`` (it bites); overlap;
- ``wassign``: the same written as ``p.data = p.data.clamp(-0.1, 0.1)`` (a new tensor); overlap;
- ``save_load``: ``save_state`` after step 3 of 6, training on; then fresh objects (``prepare``, a new ``attach``),
  ``load_state`` and ``skip_first_batches``, the last 3 steps again: both ends equal to plain DDP's, and the saved
  files byte for byte equal to those saved without the shim.

Recorded: the final parameters, the per-step losses, the AdamW/SGD state sums, the shim's mode and reason.

    torchrun --nproc-per-node 2 tests/framework_workers/accelerate_loops_worker.py --out DIR --variants bf16
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository on sys.path)
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from tensorlane import shim  # noqa: E402

MICRO = {"accum_clip": 12, "bf16": 6, "no_sync": 12, "save_load": 6, "clip_late": 6, "zero_first": 6, "wclip": 6,
         "wassign": 6}  # micro-batches of 4 per rank


def setup(kind: str, with_shim: bool):
    """A fresh Accelerator, prepared model, optimizer and loader for ``kind``; with the shim, its handle."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3 if kind == "accum_clip" else 1,
                              mixed_precision="bf16" if kind == "bf16" else "no")
    net = common.make_model()
    if kind == "bf16":
        opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loader = torch.utils.data.DataLoader(common.dataset(), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(7))
    model, opt, loader = accelerator.prepare(net, opt, loader)
    handle = shim.attach(model, opt, levels=3, policy="layer_order") if with_shim else None
    return accelerator, model, opt, loader, handle


def opt_sums(opt) -> list[float]:
    return [float(v.double().sum()) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def run(kind, accelerator, model, opt, batches, record, save_dir=None, save_at=None) -> None:
    """Train on ``batches`` as ``kind`` does; ``save_state(save_dir)`` after the ``save_at``-th step."""
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(batches):
        if kind == "accum_clip":
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                record["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), max_norm=0.05)))
                opt.step()
                opt.zero_grad()
        elif kind == "no_sync" and i % 2 == 0:
            with accelerator.no_sync(model):
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
        else:
            if kind == "zero_first":
                opt.zero_grad()
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            if kind == "clip_late":  # called on every step; a bound it reaches only from the 4th step
                record["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                                         max_norm=1e3 if i < 3 else 0.05)))
            opt.step()
            if kind == "wclip":  # WGAN's weight clipping, through .data, between step() and the next forward
                for p in model.parameters():
                    p.data.clamp_(-0.1, 0.1)
            if kind == "wassign":  # a new tensor assigned to .data between step() and the next forward
                for p in model.parameters():
                    p.data = p.data.clamp(-0.1, 0.1)
            if kind != "zero_first":
                opt.zero_grad()
        record["losses"].append(float(loss.detach()))
        if save_at is not None and i + 1 == save_at:
            accelerator.save_state(save_dir)


def train(kind: str, with_shim: bool, out: str) -> tuple[dict, dict]:
    name = f"{'shim' if with_shim else 'plain'}-{kind}"
    accelerator, model, opt, loader, handle = setup(kind, with_shim)
    record: dict = {"variant": kind, "shim": with_shim, "losses": [], "norms": [],
                    "distributed_type": accelerator.distributed_type.name, "ddp": type(model).__name__}
    batches = list(loader)[:MICRO[kind]]
    save_dir = os.path.join(out, f"state-{name}") if kind == "save_load" else None
    run(kind, accelerator, model, opt, batches, record, save_dir, save_at=3 if save_dir else None)
    if handle is not None:
        record.update(mode=handle.stats()["mode"], mode_reason=handle.stats().get("mode_reason"))
        handle.close()
    record["optimizer"] = opt_sums(opt)
    params = common.params_of(accelerator.unwrap_model(model))
    if save_dir:  # fresh objects resumed from the state saved after step 3, the last 3 steps again
        accelerator.wait_for_everyone()
        accelerator, model, opt, loader, handle = setup(kind, with_shim)
        accelerator.load_state(save_dir)
        resumed = {"losses": [], "norms": []}
        run(kind, accelerator, model, opt, list(accelerator.skip_first_batches(loader, 3))[:3], resumed)
        if handle is not None:
            resumed["mode"] = handle.stats()["mode"]
            handle.close()
        record["resumed_losses"], record["resumed_mode"] = resumed["losses"], resumed.get("mode")
        record["resumed_optimizer"] = opt_sums(opt)
        record["resumed_equal"] = all(torch.equal(v, params[k]) for k, v in
                                      common.params_of(accelerator.unwrap_model(model)).items())
    return params, record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default=",".join(MICRO))
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="accelerate")
    for kind in args.variants.split(","):
        for with_shim in (False, True):
            params, record = train(kind, with_shim, args.out)
            name = f"{'shim' if with_shim else 'plain'}-{kind}"
            common.save(args.out, name, torch.distributed.get_rank(), params, record)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
