"""PyTorch Lightning worker for tests/test_frameworks.py: one process = one node of ``num_nodes`` (1 device each).

Launched by hand in each testbed host namespace (no torchrun): LOCAL_RANK=0 tells Lightning the processes
are created externally; NODE_RANK, MASTER_ADDR and MASTER_PORT do the rest. Trains the same model with
``DDPStrategy(process_group_backend="gloo")`` once per variant, with what Lightning does between backward and
the step in the loop: ``gradient_clip_val`` (norm, active on every step), ``configure_optimizers`` returning an
LR scheduler with ``"interval": "step"``, and ``on_before_optimizer_step`` logging the gradients' norms with
``lightning.pytorch.utilities.grad_norm`` (recorded: they must be the same with the shim):

- ``plain``: Lightning's own DDP;
- ``shim``:  ``DDPStrategy(..., ddp_comm_state=shim.comm_state(..., module=model),
  ddp_comm_hook=shim.priority_hook)`` plus ``shim.lightning.CommHook``, the callback that registers the hook where
  Lightning does not (see below);
- ``shim-learn``: the same without ``module=`` (the levels are learnt from DDP's buckets).
- ``shim-spawn``: ``shim`` with ``DDPStrategy(start_method="spawn")`` (``strategy="ddp_spawn"``), which pickles the
  Trainer, and so the shim's state, for the processes it starts: refused with the shim's ``TypeError`` (recorded as
  ``error``; until 2026-11-27 Python's "cannot pickle '_thread.lock' object"), before anything trains.
- ``plain-single``, ``shim-single``: one process, ``devices=1`` with the default strategy (no DDP: a script's
  debugging run), ``CommHook`` kept in the callbacks for ``shim-single``: the shim's warning, training equal to
  Lightning's own (until 2026-11-28 ``fit`` raised a bare AttributeError, ``register_comm_hook``).

    python tests/framework_workers/lightning_worker.py --out DIR --variants plain,shim,shim-learn --levels 3 \
        --agent-socket /run/tensorlane/fw-h1/agent.sock --job fw-lightning
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
from lightning.pytorch.utilities import grad_norm  # noqa: E402

import tensorlane.shim.lightning as shim_lightning  # noqa: E402
from tensorlane import shim  # noqa: E402

CLIP_NORM = 0.05  # under this model's gradient norm: Lightning clips on every step


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = common.make_model()
        self.loss = nn.CrossEntropyLoss()
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, _idx):
        x, y = batch
        return self.loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):  # after backward, before Lightning clips
        norms = grad_norm(self.net, norm_type=2)
        self.log_dict(norms)
        self.grad_norms.append(float(norms["grad_2.0_norm_total"]))
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def train(variant: str, args) -> tuple[dict, dict]:
    model = Net()
    initial = common.params_of(model.net)
    loader = torch.utils.data.DataLoader(common.dataset(), batch_size=8, shuffle=False)
    callbacks, state, record = [], None, {"variant": variant}
    single = variant.endswith("-single")  # one process, Lightning's default strategy (no DDP)
    if single:
        strategy = "auto"
        if variant == "shim-single":
            state = shim.comm_state(args.levels, agent_socket=args.agent_socket, job=f"{args.job}-{variant}",
                                    module=model)
            callbacks.append(shim_lightning.CommHook(state))
    elif variant.startswith("shim"):
        # "shim": levels from the module's parameter order at once; "shim-learn": no module, levels learnt from
        # DDP's buckets in the second iteration (every piece at the last level until then)
        state = shim.comm_state(args.levels, agent_socket=args.agent_socket, job=f"{args.job}-{variant}",
                                module=model if variant == "shim" else None)
        spawn = {"start_method": "spawn"} if variant == "shim-spawn" else {}
        strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=shim.priority_hook,
                               **spawn)
        callbacks.append(shim_lightning.CommHook(state))
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=1 if single else args.nodes, strategy=strategy,
                        max_steps=args.steps, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm", callbacks=callbacks)
    if variant == "shim-spawn":
        try:
            trainer.fit(model, loader)
        except TypeError as exc:
            record["error"] = str(exc)
        record["initial_changed"] = any(not torch.equal(initial[k], v)
                                        for k, v in common.params_of(model.net).items())
        state.close()
        return common.params_of(model.net), record
    if single:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                trainer.fit(model, loader)
            except Exception as exc:  # (recorded for the test)
                record["error"] = f"{type(exc).__name__}: {exc}"
        record["warnings"] = [str(w.message) for w in caught if "tensorlane" in str(w.message)]
        record["global_step"] = trainer.global_step
        record["initial_changed"] = any(not torch.equal(initial[k], v)
                                        for k, v in common.params_of(model.net).items())
        if state is not None:
            state.close()
        return common.params_of(model.net), record
    trainer.fit(model, loader)
    record["global_step"] = trainer.global_step
    record["world_size"] = trainer.world_size
    record["grad_norms"], record["lrs"] = model.grad_norms, model.lrs
    record["initial_changed"] = any(not torch.equal(initial[k], v) for k, v in common.params_of(model.net).items())
    if state is not None:
        record["hook_registered_by_callback"] = callbacks[0].registered_here
        job = f"{args.job}-{variant}"
        record["flows_during"] = common.wait_levels(args.agent_socket, job, args.levels, record=record, state=state)
        record["stats"] = state.stats()
        state.close()
        record["flows_after_close"] = common.wait_gone(args.agent_socket, job)
    return common.params_of(model.net), record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="plain,shim,shim-learn")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nodes", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--agent-socket", default=None)
    p.add_argument("--job", default="fw-lightning")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    rank = int(os.environ["NODE_RANK"])
    for variant in args.variants.split(","):
        params, record = train(variant, args)
        common.save(args.out, variant, rank, params, record)
    return common.finish()


if __name__ == "__main__":
    sys.exit(main())
