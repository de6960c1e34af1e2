"""Hugging Face Transformers ``Trainer`` worker for tests/test_frameworks.py: under torchrun (2 processes on one
host, gloo over loopback), ``Trainer(model, TrainingArguments(use_cpu=True, ddp_backend="gloo", max_steps=8, ...))``
once without the shim and once with it per variant. The shim comes in through a ``TrainerCallback`` that attaches
at ``on_train_begin`` (the Trainer has prepared the model in DDP and the optimizer by then):
``shim.attach(trainer.model_wrapped)`` (or with ``trainer.optimizer``), closed at ``on_train_end``.

- ``default``: the Trainer's defaults (``max_grad_norm=1.0``, under this model's gradient norm: no clipping; a linear
  LR schedule), the shim in hook mode: ``shim.attach(trainer.model_wrapped)``, the recipe;
- ``clip``: ``max_grad_norm=0.05`` (clipping on every step), ``attach`` given the optimizer too: overlap is asked
  for and the shim falls back to hook mode (the Trainer's ``clip_grad_norm_`` changes the gradients);
- ``noclip``: ``max_grad_norm=0``, the optimizer given: hook mode all the same (the Trainer still computes the
  gradients' norm for its logs with ``clip_grad_norm_(..., inf)``, which multiplies them by 1 in place);
- ``accum``: ``gradient_accumulation_steps=2`` (the Trainer's ``no_sync`` on the first micro-batch), hook mode;
- ``compile_refused``: ``torch_compile=True`` (Accelerate compiles the DDP model): ``attach`` in the callback refuses
  it with a ``TypeError`` naming ``torch_compile``, before the first step (recorded as ``error``; nothing trains).

    torchrun --standalone --nproc-per-node 2 tests/framework_workers/transformers_worker.py --out DIR
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
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tensorlane import shim  # noqa: E402


class Net(nn.Module):
    """common.make_model() as the Trainer wants it: keyword inputs, a dict with the loss."""

    def __init__(self):
        super().__init__()
        self.net = common.make_model()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = common.dataset().tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class ShimCallback(TrainerCallback):
    """The recipe of docs/frameworks.md: attach when training begins, close when it ends."""

    def __init__(self, trainer, with_optimizer: bool = False, **attach_options):
        self.trainer, self.with_optimizer, self.options = trainer, with_optimizer, attach_options
        self.handle = self.stats = None

    def on_train_begin(self, args, state, control, **kwargs):
        opt = self.trainer.optimizer if self.with_optimizer else None  # None: hook mode
        self.handle = shim.attach(self.trainer.model_wrapped, opt, **self.options)

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        self.stats = self.handle.stats()
        self.handle.close()  # applies the pending updates (overlap mode) before the model is read or saved


def train(kind: str, with_shim: bool, args) -> tuple[dict, dict]:
    model = Net()
    initial = common.params_of(model.net)
    options = {"default": {}, "clip": {"max_grad_norm": 0.05}, "noclip": {"max_grad_norm": 0.0},
               "accum": {"gradient_accumulation_steps": 2}, "compile_refused": {"torch_compile": True}}[kind]
    targs = TrainingArguments(output_dir=os.path.join(args.out, f"run-{kind}-{with_shim}"), use_cpu=True,
                              ddp_backend="gloo", max_steps=8, per_device_train_batch_size=4, learning_rate=0.05,
                              optim="sgd", weight_decay=1e-4, logging_steps=1, save_strategy="no", report_to="none",
                              disable_tqdm=True, seed=7, dataloader_num_workers=0, **options)
    trainer = Trainer(model=model, args=targs, train_dataset=Data())
    callback = None
    if with_shim:
        callback = ShimCallback(trainer, with_optimizer=kind in ("clip", "noclip"), levels=args.levels,
                                job=f"fw-hf-{kind}", policy="layer_order")
        trainer.add_callback(callback)
    if kind == "compile_refused":
        try:
            trainer.train()
            error = None
        except TypeError as exc:  # raised in on_train_begin, before the first step
            error = str(exc)
        params = common.params_of(model.net)
        return params, {"variant": kind, "error": error, "ddp": type(trainer.model_wrapped).__name__,
                        "global_step": trainer.state.global_step,
                        "initial_changed": any(not torch.equal(initial[k], v) for k, v in params.items())}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    record = {"variant": kind, "shim": with_shim, "global_step": trainer.state.global_step,
              "world_size": trainer.args.world_size, "ddp": type(trainer.model_wrapped).__name__,
              "backend": torch.distributed.get_backend(), "losses": [h["loss"] for h in logs],
              "grad_norms": [h.get("grad_norm") for h in logs], "lrs": [h["learning_rate"] for h in logs]}
    if callback is not None:
        record["stats"] = callback.stats
    params = common.params_of(model.net)
    record["initial_changed"] = any(not torch.equal(initial[k], v) for k, v in params.items())
    return params, record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="default,clip,noclip,accum")
    p.add_argument("--levels", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers|accelerate")
    for kind in args.variants.split(","):
        for with_shim in (False, True) if kind != "compile_refused" else (True,):
            params, record = train(kind, with_shim, args)
            common.save(args.out, f"{'shim' if with_shim else 'plain'}-{kind}", torch.distributed.get_rank(), params,
                        record)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
