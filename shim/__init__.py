"""Training-side shim of tensorlane. ``import shim; handle = shim.attach(ddp_model, optimizer)`` gives a DDP model
prioritized all-reduce through the local agent (see shim/ddp.py and docs/shim.md). ``shim.flows`` and
``shim.agent_link`` need no torch; ``attach`` imports torch when first used.
"""


def attach(*args, **kwargs):
    """See :func:`shim.ddp.attach`."""
    from shim.ddp import attach as _attach

    return _attach(*args, **kwargs)
