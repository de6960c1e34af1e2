"""Wait-free backpropagation (WFBP) as in Poseidon.

Paper: "Poseidon: An Efficient Communication Architecture for Distributed Deep Learning on GPU Clusters",
USENIX ATC 2017. Each layer's gradient is communicated as soon as backward has produced it, without waiting for
the whole backward pass and without any priority between layers.
"""
from __future__ import annotations

from tensorlane.policies.model import Profile, Schedule, layer_ranges, make_blocks


def wfbp(profile: Profile) -> Schedule:
    """Wait-free backpropagation (Poseidon, ATC'17): each layer's all-reduce is launched as soon as its gradient
    is ready, with no priority: one block per layer, first-ready first-served on one communication stream.

    Usage: ``simulate(p, wfbp(p), cost)``
    """
    return Schedule("wfbp", make_blocks(profile, layer_ranges(profile)), max_inflight=1)
