"""Training-side shim of tensorlane. ``import shim; handle = shim.attach(ddp_model, optimizer)`` gives a DDP model
prioritized all-reduce through the local agent (see shim/ddp.py and docs/shim.md); frameworks that wrap the model
in DDP themselves take ``shim.comm_state()`` with ``shim.priority_hook`` (docs/frameworks.md). ``shim.flows`` and
``shim.agent_link`` need no torch; the names below import torch when first used.
"""

_LAZY = ("attach", "comm_state", "priority_hook", "overlap_hook", "agree_job_id")


def __getattr__(name):
    if name in _LAZY:
        try:
            from tensorlane.shim import ddp, groups
        except ModuleNotFoundError as exc:
            if exc.name != "torch" and not (exc.name or "").startswith("torch."):
                raise
            raise ModuleNotFoundError(
                f"tensorlane.shim.{name} needs torch, which this environment lacks ({exc}): install tensorlane with "
                "its shim extra: `pip install '.[shim]'` in the checkout, `pip install 'WHEEL[shim]'` from a wheel "
                "(or torch first: README.md, Install)", name=exc.name) from exc
        return getattr(groups if name == "agree_job_id" else ddp, name)
    raise AttributeError(f"module 'shim' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
