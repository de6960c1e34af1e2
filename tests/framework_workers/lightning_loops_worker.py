"""PyTorch Lightning loops for tests/test_frameworks.py (``test_lightning_loops``): under torchrun (``devices=2``, 2
processes on one host, gloo over loopback, no agent), each variant trained once without the shim and once with
``comm_state(module=model)`` and ``shim.lightning.CommHook`` (hook mode), the same seeds and data:

- ``accum``: ``accumulate_grad_batches=4`` over 2 epochs of 6 batches (a short last group in each epoch) with
  ``gradient_clip_val`` and ``gradient_clip_algorithm="value"``;
- ``bf16``: ``precision="bf16-mixed"`` with ``gradient_clip_val`` (norm), AdamW;
- ``manual``: ``automatic_optimization = False``: ``manual_backward``, ``clip_gradients`` (norm), ``opt.step()``
  and the scheduler stepped by hand;
- ``resume``: ``max_steps=4`` (mid-epoch), ``trainer.save_checkpoint``, then a fresh model, ``comm_state`` and
  ``Trainer`` resuming with ``fit(ckpt_path=...)`` to 2 epochs;
- ``limit``: ``limit_train_batches=4`` with ``max_epochs=3`` (a shuffled loader: a new order every epoch);
- ``plateau``: a validation loop every second epoch (``check_val_every_n_epoch=2``, 4 epochs, ``val_loss`` logged with
  ``sync_dist``) and two schedulers on one optimizer: a step ``StepLR`` and a ``ReduceLROnPlateau`` monitoring
  ``val_loss`` (``"strict": False``: no ``val_loss`` in the epochs without validation); the validation losses and the
  learning rates at each epoch's end recorded;
- ``manual2``: manual optimization with two optimizers (SGD on the convolutions, AdamW on the head and on a layer
  the forward never uses, stepped every second batch) and their schedulers (``StepLR``; ``ReduceLROnPlateau`` stepped
  by hand on the ranks' mean loss), value clipping on the first, under
  ``DDPStrategy(find_unused_parameters=True, static_graph=True)``;
- ``scale_batch_size``: ``Tuner(trainer).scale_batch_size(model)``: refused by Lightning itself under DDP, with or
  without the shim (the error recorded), before anything trains.

Recorded: the final parameters, the per-step losses, the global step, the optimizer state (as tensors' sums).

    torchrun --nproc-per-node 2 tests/framework_workers/lightning_loops_worker.py --out DIR --variants accum,bf16
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository on sys.path)
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

import tensorlane.shim.lightning as shim_lightning  # noqa: E402
from tensorlane import shim  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.net = common.make_model()
        self.loss = nn.CrossEntropyLoss()
        self.losses: list[float] = []
        self.batch_size = 8
        self.lrs: list = []
        if variant == "manual2":
            self.unused = nn.Linear(4, 4)  # never used by the forward: find_unused_parameters=True
        if variant in ("manual", "manual2"):
            self.automatic_optimization = False

    def training_step(self, batch, _idx):
        x, y = batch
        loss = self.loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        if self.variant == "manual2":
            (opt_a, opt_b), (sched_a, sched_b) = self.optimizers(), self.lr_schedulers()
            opt_a.zero_grad()
            opt_b.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt_a, gradient_clip_val=0.01, gradient_clip_algorithm="value")
            opt_a.step()
            if _idx % 2 == 1:
                opt_b.step()
            sched_a.step()
            sched_b.step(self.all_gather(loss.detach()).mean())
            self.lrs.append([opt_a.param_groups[0]["lr"], opt_b.param_groups[0]["lr"]])
            return None
        opt, sched = self.optimizers(), self.lr_schedulers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        sched.step()
        return None

    def train_dataloader(self):
        return torch.utils.data.DataLoader(common.dataset(), batch_size=self.batch_size, shuffle=True,
                                           generator=torch.Generator().manual_seed(7))

    def on_train_epoch_end(self):
        self.lrs.append([o.param_groups[0]["lr"] for o in self.trainer.optimizers])

    def configure_optimizers(self):
        if self.variant == "manual2":
            opt_a = torch.optim.SGD(self.net[:4].parameters(), lr=0.05, momentum=0.9)
            opt_b = torch.optim.AdamW([*self.net[4:].parameters(), *self.unused.parameters()], lr=2e-3)
            return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.7),
                                    torch.optim.lr_scheduler.ReduceLROnPlateau(opt_b, patience=0, factor=0.5)]
        if self.variant == "bf16":
            opt = torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        if self.variant == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"},
                           {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch", "strict": False}]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class NetVal(Net):
    """``Net`` with a validation loop (``plateau``)."""

    def __init__(self, variant: str):
        super().__init__(variant)
        self.val_losses: list[float] = []

    def validation_step(self, batch, _idx):
        x, y = batch
        loss = self.loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.val_losses.append(float(loss))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(common.dataset(32), batch_size=8)


TRAINER_ARGS = {  # variant -> the Trainer's arguments beyond the common ones
    "accum": dict(max_epochs=2, accumulate_grad_batches=4, gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "bf16": dict(max_epochs=1, precision="bf16-mixed", gradient_clip_val=0.05),
    "manual": dict(max_epochs=2),
    "resume": dict(max_epochs=2),
    "limit": dict(max_epochs=3, limit_train_batches=4),
    "plateau": dict(max_epochs=4, check_val_every_n_epoch=2),
    "manual2": dict(max_epochs=2),
    "scale_batch_size": dict(max_epochs=1),
}


def make_trainer(variant: str, model: Net, with_shim: bool, root: str, **extra):
    """A Trainer for ``variant`` and, with the shim, its state (``comm_state(module=model)`` + ``CommHook``)."""
    state, callbacks = None, []
    ddp = dict(find_unused_parameters=True, static_graph=True) if variant == "manual2" else {}
    if with_shim:
        state = shim.comm_state(3, module=model, policy="layer_order")
        strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=shim.priority_hook,
                               **ddp)
        callbacks.append(shim_lightning.CommHook(state))
    else:
        strategy = DDPStrategy(process_group_backend="gloo", **ddp)
    kwargs = dict(TRAINER_ARGS[variant], **extra)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        default_root_dir=root, callbacks=callbacks, **kwargs)
    return trainer, state


def optimizer_sums(trainer) -> list[float]:
    """Each optimizer state tensor's sum, in order (momentum buffers, Adam moments), optimizer after optimizer."""
    return [float(v.double().sum()) for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
            if torch.is_tensor(v)]


def train(variant: str, with_shim: bool, root: str) -> tuple[dict, dict]:
    torch.manual_seed(99)
    model = (NetVal if variant == "plateau" else Net)(variant)
    record: dict = {"variant": variant, "shim": with_shim}
    os.makedirs(root, exist_ok=True)
    if variant == "scale_batch_size":
        trainer, state = make_trainer(variant, model, with_shim, root)
        try:
            Tuner(trainer).scale_batch_size(model, max_trials=2)
        except Exception as exc:  # noqa: BLE001 (recorded: Lightning refuses it under DDP)
            record["error"] = f"{type(exc).__name__}: {exc}"
        if state is not None:
            state.close()
        record["global_step"] = trainer.global_step
        return common.params_of(model.net), record
    losses = []
    if variant == "resume":  # a first run stopped mid-epoch, its checkpoint; then a fresh model and Trainer
        trainer, state = make_trainer(variant, model, with_shim, root, max_steps=4)
        trainer.fit(model)
        ckpt = os.path.join(root, "mid.ckpt")
        trainer.save_checkpoint(ckpt)
        if state is not None:
            record["first_allreduces"] = [lv["allreduces"] for lv in state.stats()["levels"]]
            state.close()
        losses += model.losses
        torch.manual_seed(5)  # a different initialisation: the checkpoint must restore everything
        model = Net(variant)
        trainer, state = make_trainer(variant, model, with_shim, root)
        trainer.fit(model, ckpt_path=ckpt)
    else:
        trainer, state = make_trainer(variant, model, with_shim, root)
        trainer.fit(model)
    losses += model.losses
    record.update(global_step=trainer.global_step, world_size=trainer.world_size, losses=losses,
                  optimizer=optimizer_sums(trainer), precision=str(trainer.precision), lrs=model.lrs,
                  val_losses=getattr(model, "val_losses", []),
                  metrics={k: float(v) for k, v in sorted(trainer.callback_metrics.items())})
    if state is not None:
        stats = state.stats()
        record.update(mode=stats["mode"], allreduces=[lv["allreduces"] for lv in stats["levels"]])
        state.close()
    params = common.params_of(model.net)
    if variant == "manual2":  # the layer the forward never uses (AdamW's weight decay moves it)
        params.update({f"unused.{k}": v for k, v in common.params_of(model.unused).items()})
    return params, record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default=",".join(TRAINER_ARGS))
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    for variant in args.variants.split(","):
        for with_shim in (False, True):
            name = f"{'shim' if with_shim else 'plain'}-{variant}"
            params, record = train(variant, with_shim, os.path.join(args.out, name))
            common.save(args.out, name, int(os.environ["RANK"]), params, record)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
