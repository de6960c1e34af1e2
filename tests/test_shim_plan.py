"""shim.plan: the profile measured during one iteration, and the planner's choice installed by ``attach``.

Single-process parts here (no process group); the multi-rank path runs in tests/test_shim.py (policy "planner" is
the default there) and on the testbed in tests/test_priority.py.
"""
from __future__ import annotations

import torch  # required (the [shim] extra): a missing torch fails these tests


def _model():
    from bench.models import emulated_model
    from tensorlane.policies.model import Layer, Profile

    prof = Profile("toy", (Layer("a", 4 * 1000, 0.004, 0.008), Layer("b", 4 * 50, 0.002, 0.004),
                           Layer("c", 4 * 3000, 0.006, 0.012)))
    return prof, emulated_model(prof)


def test_recorder_measures_forward_and_backward_per_module():
    from bench.models import reset_stream, synthetic_batch
    from tensorlane.shim.plan import Recorder, owner_modules

    prof, model = _model()
    owners = owner_modules(model)
    assert owners == list(model)  # one module per layer, in parameter order
    seen = []
    rec = Recorder(owners, on_done=seen.append)
    x, t = synthetic_batch()
    reset_stream()
    (model(x) - t).square().mean().backward()  # a backward DDP does not synchronize (no_sync: no note_synced)
    assert not rec.done  # ranks may accumulate different numbers of micro-batches: only synchronized ones count
    loss = (model(x) - t).square().mean()
    rec.note_synced()  # (the shim's comm hook, at a bucket of this backward)
    loss.backward()
    assert rec.done and not seen  # handed over by consume() (the shim's comm hook at the next backward)
    model(x)
    assert not seen  # a forward is no point every rank reaches alike (a validation on rank 0 alone)
    rec.consume()
    rec.consume()  # once
    assert seen == [rec]
    measured = rec.profile()
    assert [ly.params_bytes for ly in measured.layers] == [ly.params_bytes for ly in prof.layers]
    # host-clock times of the emulated device: host work overlapped with it may shorten a layer a little
    for got, want in zip(measured.layers, prof.layers, strict=True):
        assert 0 < got.fwd_s < 0.5 and 0 < got.bwd_s < 0.5, (got, want)
    assert 0.5 * prof.fwd_total <= measured.fwd_total <= 3 * prof.fwd_total + 0.05, measured
    assert 0.5 * prof.bwd_total <= measured.bwd_total <= 3 * prof.bwd_total + 0.05, measured
    assert measured.layers[2].bwd_s > measured.layers[1].bwd_s  # the largest backward is seen as the largest
    rec.remove()
    rec.remove()  # idempotent


def test_owner_modules_skips_frozen_and_shared():
    from tensorlane.shim.plan import owner_modules

    lin = torch.nn.Linear(2, 2)
    frozen = torch.nn.Linear(2, 2)
    frozen.requires_grad_(False)
    root = torch.nn.Sequential(lin, frozen, lin)
    assert owner_modules(root) == [lin]
