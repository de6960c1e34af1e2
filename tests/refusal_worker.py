"""Loops that overlap mode cannot reproduce once it has been chosen, run under torchrun: each must raise a clear
error on every rank, where it can before any parameter differs from plain DDP's (and ``early_use``,
``param_write_later``, ``clip_later``, ``grad_write_later`` and ``step_around_shim``, which it reproduces, must
not). Writes OUT/SCENARIO-RANK.json with the error and the largest relative difference from DDP at that point (DDP
after the same number of completed steps, :data:`SCENARIOS`; run as the loop of :data:`REFERENCE`). A second
step() with no backward between, ``double_step``, raised until 2026-11-28; it is reproduced now.

    torchrun --standalone --nproc-per-node 2 tests/refusal_worker.py --out DIR
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from optimizers import ClipAboveSGD  # noqa: E402  (tests/, this script's folder)

from tensorlane import shim  # noqa: E402

STEPS = 6
LATE = 3  # the iteration at which the loop starts doing what the first iterations did not


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, late: bool = False):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if late:  # from LATE on, c's parameters are used by the root's forward, c itself does not run
            return nn.functional.linear(h, self.c.weight, self.c.bias)
        return self.c(h)


def batch(step: int):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def clamp(w) -> None:
    with torch.no_grad():
        w.clamp_(-0.1, 0.1)


def counted(step):
    """``step`` behind a call counter (a user's wrapper of an optimizer class's step)."""
    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return step(*args, **kwargs)
    wrapper.calls = 0
    return wrapper


class CountingSGD(torch.optim.SGD):
    """SGD (declared per parameter) that, once ``counting`` is set, counts its steps in a tensor of its param group,
    in place (``group["count"] += 1``)."""

    counting = False

    def step(self, closure=None):
        out = super().step(closure)
        if self.counting:
            for g in self.param_groups:
                g["count"] += 1
        return out


def loop(scenario: str, shim_on: bool, steps: int):
    """Train ``steps`` iterations; returns (parameters, error text or None)."""
    model = DDP(Net(), bucket_cap_mb=0.0001)  # a bucket per parameter: c's step waits for c alone
    counter, clip = scenario == "group_counter_later", scenario == "parts_differ_later"
    opt = ClipAboveSGD(model.parameters(), lr=0.1) if clip else \
        (CountingSGD if counter else torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)
    if counter:
        opt.param_groups[0]["count"] = torch.tensor(0.0)
    handle, own_step = None, torch.optim.SGD.step
    if shim_on:
        handle = shim.attach(model, opt, levels=2, policy="layer_order", agent_socket="/nonexistent/tl.sock",
                             require_overlap=scenario == "require_overlap",
                             per_parameter_optimizer=counter or clip or None)
    error, other = None, None
    try:
        for step in range(steps):
            x, y = batch(step)
            late = step >= LATE
            functional = late and scenario == "stale_use" or scenario == "early_use"
            loss = ((model(x, late=functional) - y) ** 2).mean()
            loss.backward()
            if scenario == "clip_later" and late or scenario == "require_overlap":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            if scenario == "grad_write_later" and late:  # reads it: seen, made DDP's average first, exact
                next(model.parameters()).grad.mul_(0.5)
            if scenario == "grad_zeroed_later" and late:  # writes without reading: seen at step() only
                next(model.parameters()).grad.zero_()
            if scenario == "step_hook_later" and step == LATE:  # a hook after overlap mode was chosen
                opt.register_step_post_hook(lambda *_: None)
            if clip and step == LATE:  # the optimizer's step starts clipping by the norm of all gradients
                opt.max_norm = 0.01
            if counter and step == LATE:  # the optimizer's step starts writing its group's tensor in place
                opt.counting = True
            if scenario == "class_step_replaced_later" and step == LATE:  # a call counter on the class's step
                torch.optim.SGD.step = counted(own_step)
            if scenario == "step_around_shim" and late:  # the optimizer's own step, not the one the shim
                type(opt).step(opt)  # installed: it reads the gradients, which are made DDP's average first
            elif scenario == "step_around_shim_thread" and late:  # the same from another thread: not seen then
                stepper = threading.Thread(target=type(opt).step, args=(opt,))
                stepper.start()
                stepper.join()
            elif scenario == "other_optimizer_later" and late:  # a new optimizer, not attached
                if other is None:
                    other = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                other.step()
            else:
                opt.step()
            if scenario == "state_replaced_later" and step == LATE:  # the momenta thrown away after this step
                opt.state = collections.defaultdict(dict)
            if scenario == "double_step" and late:
                opt.step()
            if scenario == "param_write_later" and late:  # seen by the shim's guard: updated first, exact
                with torch.no_grad():
                    model.module.a.weight.clamp_(-0.1, 0.1)
            if scenario == "param_write_thread" and late:  # another thread: the guard does not see it
                writer = threading.Thread(target=clamp, args=(model.module.a.weight,))
                writer.start()
                writer.join()
            opt.zero_grad()
    except RuntimeError as exc:
        error = str(exc)
    finally:
        torch.optim.SGD.step = own_step
    if handle is not None and error is None:
        handle.flush()  # the last step's update (after an error: the parameters as they are)
    params = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    if handle is not None:
        handle.close()  # after a refusal: cleans up, drops what cannot be applied (a warning), never raises
    return params, error


# scenario -> the number of DDP steps the parameters must equal when the error is raised (None: the loop itself
# already changed them around the shim before it could be seen)
SCENARIOS = {"grad_zeroed_later": LATE, "require_overlap": 1,
             "double_step": STEPS,  # a second step() with no backward between: the first one's update applied,
             # then the optimizer's own step on .grad as DDP leaves it (until 2026-11-28 it raised there)
             "step_around_shim_thread": None, "param_write_thread": None,
             "stale_use": STEPS,  # c used outside c from LATE on: the guard applies the updates first, exact
             "step_around_shim": STEPS,  # its step reads the gradients: averaged first, exact
             "other_optimizer_later": LATE,
             "step_hook_later": STEPS,  # steps stamped before it applied without it, then hook mode: exact (raised
             # until 2026-11-29)
             "state_replaced_later": LATE,  # that step would be applied at the next forward, which refuses
             "class_step_replaced_later": LATE,  # refused at that step(), before it runs
             "group_counter_later": None,  # refused after the first part of that step (its write shows it)
             "parts_differ_later": LATE + 1,  # that step's last part applied in the next forward: checked whole,
             # set to the whole step's result, refused there
             "early_use": STEPS,  # c's parameters used outside c from the first iteration on: exact, no error
             "param_write_later": STEPS,  # clamped after step(): the guard applies the update first, exact
             "clip_later": STEPS,  # clipping (and a .grad scaled in place) that starts after the probe reads the
             "grad_write_later": STEPS}  # gradients: the watch makes them DDP's average first, exact
REFERENCE: dict = {}  # the DDP loop to compare with, where not the scenario's own


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for scenario in args.scenarios.split(","):
        params, error = loop(scenario, True, STEPS)
        exact = SCENARIOS[scenario]
        diff = None
        if exact is not None:
            ref = loop(REFERENCE.get(scenario, scenario), False, exact)[0]
            diff = max(float((params[k] - r).abs().max() / r.abs().max().clamp(min=1e-12)) for k, r in ref.items())
        with open(os.path.join(args.out, f"{scenario}-{rank}.json"), "w") as fh:
            json.dump({"error": error, "exact_steps": exact, "diff": diff}, fh)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
