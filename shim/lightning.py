"""PyTorch Lightning: the shim's hook mode on the DDP model that Lightning's ``DDPStrategy`` builds.

Lightning (2.6) registers ``DDPStrategy(ddp_comm_hook=...)`` only when its root device is CUDA; on CPU (gloo) the
arguments are dropped silently. :class:`CommHook` registers the hook in ``on_fit_start`` (after the strategy
has wrapped the module in DDP, before the first forward) where Lightning did not. Lightning steps the optimizer
with a closure that runs forward and backward, so only hook mode applies (docs/frameworks.md). Importing this
module imports Lightning (``lightning`` or ``pytorch_lightning``).

Usage::

    state = shim.comm_state(levels=4, module=model)
    trainer = Trainer(strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                                           ddp_comm_hook=shim.priority_hook),
                      callbacks=[shim.lightning.CommHook(state)])
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone distribution
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError("tensorlane.shim.lightning needs PyTorch Lightning, and neither `lightning` nor "
                          "`pytorch_lightning` can be imported: pip install lightning (docs/frameworks.md)") from None

import warnings

from torch.nn.parallel import DistributedDataParallel

from tensorlane.shim.ddp import priority_hook, refuse_delayed_all_reduce


class CommHook(Callback):
    """Registers ``hook`` (default ``shim.priority_hook``) with ``state`` on Lightning's DDP model unless Lightning
    registered it itself (CUDA, ``DDPStrategy(ddp_comm_hook=...)``); ``registered_here`` says which. Another comm
    hook already on the model is an error (DDP takes one). Call ``state.close()`` once training is over."""

    def __init__(self, state, hook=priority_hook):
        self.state, self.hook = state, hook
        self.registered_here = False

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if getattr(self.state, "mode", "") == "disabled":
            return  # comm_state(disable=True) or TENSORLANE_DISABLE=1: plain DDP, no hook
        if not isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):  # (a compiled DDP model too)
            self._not_ddp(trainer, model)
            return
        if getattr(self.state, "closed", False):
            warnings.warn("tensorlane: the shim's state given to CommHook was closed (state.close()) before this fit: "
                          "its all-reduces are DDP's own and nothing is prioritised (training is plain DDP). Make a "
                          "new shim.comm_state() for each Trainer, and close it after that Trainer's fits",
                          stacklevel=2)
            return
        refuse_delayed_all_reduce(getattr(model, "_orig_mod", model))  # (before any step, Lightning's hook or not)
        hooks = list(getattr(model, "_comm_hooks", ()))  # DDP's registered (hook, state) pairs
        if any(state is self.state for _hook, state in hooks):
            return  # Lightning registered it (on CUDA it passes ddp_comm_hook on)
        if hooks:
            name = getattr(hooks[0][0], "__name__", hooks[0][0])
            raise RuntimeError(f"tensorlane: the DDP model already has another communication hook ({name}); DDP "
                               "takes one, so the shim's cannot be added. Remove that hook, or give the shim's to "
                               "DDPStrategy(ddp_comm_hook=...)")
        model.register_comm_hook(self.state, self.hook)  # Lightning dropped it (CPU) or was not given it
        self.registered_here = True

    @staticmethod
    def _not_ddp(trainer, model) -> None:
        """The strategy did not wrap the module in DDP: one process (``devices=1`` with the default strategy) trains
        as without the shim, with a warning; another multi-process strategy (FSDP, DeepSpeed, model parallel) is
        refused before the first step (until 2026-11-28 both raised a bare AttributeError, or FSDP's own
        ``register_comm_hook`` took a hook it would call with tensors, not DDP's buckets)."""
        strategy = type(trainer.strategy).__name__
        if trainer.world_size == 1:
            warnings.warn(f"tensorlane: this Trainer trains in one process ({strategy}, world size 1): no DDP, no "
                          "all-reduce, nothing to prioritise; CommHook does nothing and training is Lightning's own. "
                          "With several devices or nodes use DDPStrategy (strategy='ddp')", stacklevel=2)
            return
        raise TypeError(f"tensorlane: CommHook needs Lightning's DDP strategy (DDPStrategy, strategy='ddp'); this "
                        f"Trainer's {strategy} wraps the model in {type(model).__name__}, not "
                        "DistributedDataParallel, and the shim prioritises DDP's all-reduces only. Use "
                        "DDPStrategy, or train without CommHook and the shim's state")
