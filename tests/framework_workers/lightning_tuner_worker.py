"""PyTorch Lightning's learning-rate finder for tests/test_frameworks.py: ``Tuner(trainer).lr_find(model, ...)``
and then ``trainer.fit(model)`` on the same Trainer, once without the shim and once with it per variant, under
torchrun (``devices=2``, 2 processes on one host, gloo over loopback, no agent).

The tuner runs a ``fit`` of its own: ``num_training`` steps at rising learning rates from a checkpoint it saves
first, then restores that checkpoint (parameters, optimizer, loops) and sets the suggested rate on the module; the
real ``fit`` then builds a new DDP model. So the shim's state meets two DDP models in one run:

- ``lr_find``: ``comm_state(module=model)`` with ``shim.lightning.CommHook`` (CPU, as documented). The tuner's
  callback runs its steps in ``on_fit_start`` and ends that fit there, before the ``CommHook`` has registered the
  hook: the trial steps are plain DDP, and only the real fit's steps go through the shim;
- ``lr_find-learn``: the same with ``comm_state()`` (no ``module=``): the levels learnt from the buckets in the
  real fit's first steps (the trials being plain DDP);
- ``lr_find-cuda``: the strategy registers the hook itself, as ``DDPStrategy`` does on CUDA (a subclass that does
  it on CPU too), with ``comm_state()`` learning its levels: the same state on the tuner's DDP model and on the
  fit's, the levels learnt during the trial steps.

Recorded: the trial losses and the suggested rate (the same with the shim), the per-level all-reduce counts and
the final parameters.

    torchrun --nproc-per-node 2 tests/framework_workers/lightning_tuner_worker.py --out DIR --variants lr_find
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
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

import tensorlane.shim.lightning as shim_lightning  # noqa: E402
from tensorlane import shim  # noqa: E402

EPOCHS = 3  # the real fit: 6 batches of 8 per rank and epoch
TRIALS = 16  # the tuner's steps (its suggestion skips the first 10 and the last)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = common.make_model()
        self.loss = nn.CrossEntropyLoss()
        self.lr = 0.05  # the tuner's update_attr=True sets its suggestion here

    def training_step(self, batch, _idx):
        x, y = batch
        return self.loss(self.net(x), y)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(common.dataset(), batch_size=8, shuffle=True,
                                           generator=torch.Generator().manual_seed(7))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CudaLikeDDP(DDPStrategy):
    """``DDPStrategy`` registering ``ddp_comm_hook`` on every device, as Lightning 2.6 does on CUDA only."""

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook)


def train(variant: str, with_shim: bool, root: str) -> tuple[dict, dict]:
    torch.manual_seed(99)
    model = Net()
    callbacks, state = [], None
    if with_shim and variant in ("lr_find", "lr_find-learn"):
        module = model if variant == "lr_find" else None  # lr_find-learn: levels learnt from the fit's buckets
        state = shim.comm_state(3, module=module, policy="layer_order")
        strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=shim.priority_hook)
        callbacks.append(shim_lightning.CommHook(state))
    elif with_shim:
        state = shim.comm_state(3, policy="layer_order")  # levels learnt from the buckets (in the tuner's steps)
        strategy = CudaLikeDDP(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=shim.priority_hook)
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, default_root_dir=root, callbacks=callbacks)
    found = Tuner(trainer).lr_find(model, min_lr=1e-3, max_lr=0.5, num_training=TRIALS, update_attr=True,
                                   early_stop_threshold=None)
    record = {"suggested": model.lr, "trial_losses": found.results["loss"], "trial_lrs": found.results["lr"]}
    trainer.fit(model)
    record.update(global_step=trainer.global_step, world_size=trainer.world_size)
    if state is not None:
        record["allreduces"] = [lv["allreduces"] for lv in state.stats()["levels"]]
        record["hook_registered_by_callback"] = bool(callbacks) and callbacks[0].registered_here
        state.close()
    return common.params_of(model.net), record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="lr_find,lr_find-learn,lr_find-cuda")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    for variant in args.variants.split(","):
        for with_shim in (False, True):
            name = f"{'shim' if with_shim else 'plain'}-{variant}"
            params, record = train(variant, with_shim, os.path.join(args.out, name))
            common.save(args.out, name, torch.distributed.get_rank(), params, record)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
