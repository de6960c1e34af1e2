"""The shim's conformance matrix, worker side (issue 12): real training-loop idioms x {ddp, hook, overlap}.

Every idiom is one function that builds its model, optimizer and scheduler and runs its loop; the SAME function
runs for plain DDP ("ddp", the reference), the shim's hook mode ("hook": ``attach(model)``) and its overlap mode
("overlap": ``attach(model, optimizer)``); only ``ctx.attach`` differs. All idioms and modes run one after the
other in the same processes (one torchrun launch per world size). For each cell the worker writes

    OUT/IDIOM-MODE-RANK.pt    {"state": model.module.state_dict() at the end (after handle.close()),
                               "extras": {name: float64 tensor}}  (per-step losses, eval outputs, clip norms...)
    OUT/IDIOM-MODE-RANK.json  {"stats": handle.stats() or {}, "error": traceback or None,
                               "errors": [each rank's error or None], "seconds": wall time of the cell}

and tests/test_conformance.py compares every hook/overlap cell with the ddp cell of the same idiom.

The checkpoint idiom is in two parts: ``checkpoint_save`` (in the main launch) trains all the steps and, after
half of them, rank 0 saves model.module.state_dict(), optimizer and scheduler state to OUT/ckpt-MODE.pt;
``checkpoint_resume`` runs in a second, fresh launch (``--resume``): it loads that file, attaches, trains the
remaining steps, and must end equal to the uninterrupted ``checkpoint_save-ddp`` run.

    torchrun --standalone --nproc-per-node 2 tests/conformance_worker.py --out DIR            # the whole matrix
    torchrun --standalone --nproc-per-node 2 tests/conformance_worker.py --out DIR --resume   # checkpoint part 2
    torchrun --standalone --nproc-per-node 2 tests/conformance_worker.py --out DIR --idioms adam --modes ddp,overlap
    torchrun --standalone --nproc-per-node 2 tests/conformance_worker.py --out DIR --device cuda  # ranks share GPU 0
    python tests/conformance_worker.py --list                                                 # the idioms

The shim needs no agent here (``--agent-socket /nonexistent/...``: it warns once and trains unprioritised);
``link_bps=2e8`` lets its planner plan. Written against torch 2.11+ APIs (the CUDA machine has 2.11).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import functools
import gc
import io
import json
import os
import sys
import threading
import time
import traceback
import warnings

if any("cuda" in a for a in sys.argv[1:]):  # deterministic cuBLAS needs this before CUDA initialises
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.nn.utils.prune  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from optimizers import ClipAboveSGD  # noqa: E402  (tests/, this script's folder)

from tensorlane import shim  # noqa: E402

MODES = ("ddp", "hook", "overlap")
IDIOMS: dict = {}  # name -> function(ctx); in the order they run
CLIP_NORM = 0.05  # well under this model's gradient norm (about 1): clip_grad_norm_ really clips on every step
CLIP_VALUE = 0.01  # well under the largest gradient element
STEPS = 8  # iterations per cell (--steps)
CLAMP = 0.1  # under the initial weights of the first layers (about 0.19): the clamp bites from the first step


def idiom(name: str, **params):
    """Register ``fn(ctx, **params)`` as idiom ``name``."""
    def register(fn):
        IDIOMS[name] = lambda ctx: fn(ctx, **params)
        return fn
    return register


class Ctx:
    """What an idiom function gets: the mode's attach, a DDP wrapper, deterministic per-rank data, records."""

    def __init__(self, mode: str, rank: int, world: int, device: torch.device, steps: int, args):
        self.mode, self.rank, self.world, self.device, self.steps, self.args = mode, rank, world, device, steps, args
        self.handle = None
        self.others: list = []  # handles of further DDP models (attach_other), closed by run_cell
        self.model = None
        self.extras: dict[str, list[float]] = {}

    # -- set-up ---------------------------------------------------------------------------------------------
    def ddp(self, module: nn.Module, **kwargs) -> DDP:
        """``module`` on the device, wrapped in DDP with small buckets (several buckets, several levels)."""
        self.model = DDP(module.to(self.device), bucket_cap_mb=self.args.bucket_cap_mb, **kwargs)
        return self.model

    def attach(self, model: DDP, optimizer) -> None:
        """The only line that differs between the modes: nothing (ddp), hook mode, or overlap mode."""
        if self.mode == "ddp":
            return
        self.handle = shim.attach(model, optimizer=optimizer if self.mode == "overlap" else None,
                                  levels=self.args.levels, agent_socket=self.args.agent_socket,
                                  link_bps=self.args.link_bps)

    def attach_other(self, model: DDP, optimizer) -> None:
        """``attach`` for a second DDP model of the same loop (a GAN's generator), in the same mode."""
        if self.mode != "ddp":
            self.others.append(shim.attach(model, optimizer=optimizer if self.mode == "overlap" else None,
                                           levels=self.args.levels, agent_socket=self.args.agent_socket,
                                           link_bps=self.args.link_bps))

    # -- data: the same on every mode, different per rank and step ---------------------------------------------
    def gen(self, step: int, micro: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(100_003 * step + 1_009 * micro + self.rank + 17)

    def images(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gen(step, micro)
        x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        return x.to(self.device), y.to(self.device)

    def vectors(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gen(step)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        return x.to(self.device), y.to(self.device)

    def tokens(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gen(step)
        x, y = torch.randint(0, 50, (16, 4), generator=g), torch.randint(0, 50, (16,), generator=g)
        return x.to(self.device), y.to(self.device)

    def record(self, key: str, value) -> None:
        """Keep a number (or every element of a tensor) for the comparison with ddp."""
        if isinstance(value, torch.Tensor):
            self.extras.setdefault(key, []).extend(value.detach().double().flatten().cpu().tolist())
        else:
            self.extras.setdefault(key, []).append(float(value))


# -- models (seeded: every mode starts from the same parameters) ----------------------------------------------
def convnet(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    # a conv followed by BatchNorm has no bias (the usual way; its gradient would be rounding noise, which Adam
    # amplifies to lr-sized updates, so that any change of summation order would show as a difference)
    bn = (lambda c: [nn.BatchNorm2d(c)]) if batchnorm else (lambda c: [])
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=not batchnorm), *bn(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, bias=not batchnorm), *bn(16), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


class Branchy(nn.Module):
    """A trunk, a head, a branch used only on some ranks and iterations, and a submodule never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.trunk = nn.Linear(32, 64)
        self.head = nn.Linear(64, 10)
        self.branch = nn.Linear(64, 10)
        self.never = nn.Linear(64, 10)

    def forward(self, x, use_branch: bool):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        return out + self.branch(h) if use_branch else out


class TiedLM(nn.Module):
    """A tiny language model whose output projection is its embedding table (one Parameter, two modules)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(50, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 50)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens).mean(1))))


def sgd(params, lr=0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-3)


def plain_loop(ctx: Ctx, model, opt, sched=None, sched_every: int = 1, plateau_metrics=None,
               steps: int | None = None, after_step=None, batch=None, forward_context=None, before_forward=None,
               zero_grad_after: bool = True) -> None:
    """The textbook loop: (``before_forward(step)``), forward (and loss, inside ``forward_context()``), backward,
    step, (``after_step(step)``), (scheduler), zero_grad (unless not ``zero_grad_after``); ``steps`` (default
    ``ctx.steps``), ``batch(step)`` (default ``ctx.images``)."""
    for step in range(ctx.steps if steps is None else steps):
        if before_forward is not None:
            before_forward(step)
        x, y = (batch or ctx.images)(step)
        with (forward_context or contextlib.nullcontext)():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(step)
        if plateau_metrics is not None:
            sched.step(plateau_metrics[step])
        elif sched is not None and (step + 1) % sched_every == 0:
            sched.step()
        if zero_grad_after:
            opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("lr", opt.param_groups[0]["lr"])


# -- 1-4: optimizers and parameter groups -----------------------------------------------------------------------
@idiom("sgd_momentum")
def _sgd_momentum(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("adam")
def _adam(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("adamw")
def _adamw(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("param_groups")
def _param_groups(ctx: Ctx):
    model = ctx.ddp(convnet())
    m = model.module
    opt = torch.optim.SGD([
        {"params": list(m[0].parameters()) + list(m[2].parameters()), "lr": 0.02, "weight_decay": 0.0},
        {"params": m[5].parameters(), "lr": 0.05, "weight_decay": 1e-3},
        {"params": m[7].parameters(), "lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 1e-2},
    ], lr=0.01, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


# -- 5-14: LR schedulers, each created before and after attach -------------------------------------------------
def scheduled(ctx: Ctx, kind: str, before: bool):
    """One scheduler ``kind``, created before or after ``attach``; the rest of the loop is plain."""
    model = ctx.ddp(convnet())
    if kind in ("sequential",):
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    elif kind == "epoch_multistep":
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    else:
        opt = sgd(model.parameters(), lr=0.1)
    sl = torch.optim.lr_scheduler

    def make():
        if kind == "warmup_lambda":  # per-iteration linear warm-up
            return sl.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        if kind == "epoch_multistep":  # per-"epoch" (2 iterations), decays at epochs 1 and 2
            return sl.MultiStepLR(opt, milestones=[1, 2], gamma=0.3)
        if kind == "onecycle":  # cycles lr and momentum every iteration
            return sl.OneCycleLR(opt, max_lr=0.1, total_steps=ctx.steps, pct_start=0.4, cycle_momentum=True)
        if kind == "sequential":  # linear warm-up, then exponential decay
            return sl.SequentialLR(opt, [sl.LinearLR(opt, start_factor=0.2, total_iters=3),
                                         sl.ExponentialLR(opt, gamma=0.7)], milestones=[3])
        if kind == "plateau":
            return sl.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.0)
        raise ValueError(kind)

    sched = make() if before else None
    ctx.attach(model, opt)
    if not before:
        sched = make()
    # ReduceLROnPlateau's metric: deterministic and the same on every rank; no improvement at 2, 4, 5 -> cuts
    metrics = [1.0, 0.9, 0.95, 0.8, 0.85, 0.85, 0.7, 0.75, 0.75, 0.6] * (ctx.steps // 10 + 1)
    plain_loop(ctx, model, opt, sched, sched_every=2 if kind == "epoch_multistep" else 1,
               plateau_metrics=metrics if kind == "plateau" else None)


for _kind in ("warmup_lambda", "epoch_multistep", "onecycle", "sequential", "plateau"):
    for _when in ("before", "after"):
        idiom(f"{_kind}_{_when}", kind=_kind, before=_when == "before")(scheduled)


# -- manual hyperparameter changes ---------------------------------------------------------------------------------
@idiom("manual_hparams")
def _manual_hparams(ctx: Ctx):
    """User code writes param_groups[i]["lr"] every iteration (before the forward, where overlap mode applies the
    previous step), momentum at iteration 3 and weight_decay at iteration 5."""
    model = ctx.ddp(convnet())
    m = model.module
    opt = torch.optim.SGD([{"params": list(m[0].parameters()) + list(m[2].parameters())},
                           {"params": list(m[5].parameters()) + list(m[7].parameters()), "lr": 0.02}],
                          lr=0.05, momentum=0.9, weight_decay=1e-4)
    ctx.attach(model, opt)

    def set_hparams(step):
        opt.param_groups[0]["lr"] = 0.05 * 0.7 ** step
        opt.param_groups[1]["lr"] = 0.02 * (1 + step)
        if step == 3:
            opt.param_groups[1]["momentum"] = 0.3
        if step == 5:
            opt.param_groups[0]["weight_decay"] = 0.05
    plain_loop(ctx, model, opt, before_forward=set_hparams)


# -- gradients changed between backward() and step() ------------------------------------------------------------
@idiom("clip_grad_norm")
def _clip_grad_norm(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=CLIP_NORM)
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("total_norm", total)  # > CLIP_NORM: clipping happened (checked on the ddp cell)


@idiom("clip_grad_value")
def _clip_grad_value(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ctx.record("max_abs_grad", max(float(p.grad.abs().max()) for p in model.parameters()))
        nn.utils.clip_grad_value_(model.parameters(), clip_value=CLIP_VALUE)
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("grad_scaler")
def _grad_scaler(ctx: Ctx):
    """fp16 autocast with a GradScaler whose initial scale overflows fp16 gradients: the first steps are skipped
    (inf/NaN found, scale backed off), later ones taken; growth_interval=2 makes the scale grow again.
    ``unscale_`` is called explicitly on even iterations only (both of scaler.step's paths)."""
    dev = ctx.device.type
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 20, growth_interval=2)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        with torch.autocast(dev, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step % 2 == 0:
            scaler.unscale_(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.record("loss", loss.float().item())
        ctx.record("scale", scale)
        ctx.record("skipped", float(scaler.get_scale() < scale))  # backed off: this step found inf/NaN


# -- DDP features -------------------------------------------------------------------------------------------------
@idiom("no_sync_accumulation")
def _no_sync_accumulation(ctx: Ctx):
    """k = 3 micro-batches per step: the first k-1 backward passes under model.no_sync()."""
    k = 3
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        for micro in range(k):
            x, y = ctx.images(step, micro)
            if micro < k - 1:
                with model.no_sync():
                    loss = F.cross_entropy(model(x), y) / k
                    loss.backward()
            else:
                loss = F.cross_entropy(model(x), y) / k
                loss.backward()
            ctx.record("loss", loss.item())
        opt.step()
        opt.zero_grad()


@idiom("join_uneven")
def _join_uneven(ctx: Ctx):
    """Uneven inputs: rank r has ``steps - r`` batches, the loop inside ``model.join()`` (DDP shadows the joined
    ranks' all-reduces with zeros, then broadcasts the last joiner's parameters)."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    with model.join():
        plain_loop(ctx, model, opt, steps=ctx.steps - ctx.rank)


@idiom("frozen")
def _frozen(ctx: Ctx):
    """The first conv frozen (requires_grad=False); the optimizer still holds every parameter."""
    net = convnet()
    for p in net[0].parameters():
        p.requires_grad_(False)
    model = ctx.ddp(net)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("find_unused")
def _find_unused(ctx: Ctx):
    """find_unused_parameters=True: ``branch`` is used by some ranks on some iterations (globally unused on
    others), ``never`` is never used. Adam skips parameters whose grad is None: zeros instead would differ."""
    model = ctx.ddp(Branchy(), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=(step + ctx.rank) % 3 == 0), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("tied_weights")
def _tied_weights(ctx: Ctx):
    model = ctx.ddp(TiedLM())
    opt = sgd(model.parameters(), lr=0.2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.tokens)
    assert model.module.out.weight is model.module.embed.weight


@idiom("batchnorm")
def _batchnorm(ctx: Ctx):
    """BatchNorm running statistics (DDP broadcasts rank 0's buffers every forward); buffers are compared too."""
    model = ctx.ddp(convnet(batchnorm=True))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("static_graph")
def _static_graph(ctx: Ctx):
    model = ctx.ddp(convnet(), static_graph=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


# -- checkpoint mid-run, resumed in a fresh process ---------------------------------------------------------------
def _ckpt_setup(ctx: Ctx, state: dict | None):
    net = convnet()
    if state is not None:
        net.load_state_dict(state["model"])
    model = ctx.ddp(net)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    ctx.attach(model, opt)
    return model, opt, sched


def _ckpt_loop(ctx: Ctx, model, opt, sched, first: int, save_at: int | None) -> None:
    for step in range(first, ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        if save_at is not None and step + 1 == save_at:
            if ctx.rank == 0:  # the usual idiom: one rank saves, mid-run (overlap mode: updates still in flight)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step + 1},
                           os.path.join(ctx.args.out, f"ckpt-{ctx.mode}.pt"))
            dist.barrier()


@idiom("checkpoint_save")
def _checkpoint_save(ctx: Ctx):
    """Trains every step, saving a checkpoint after half of them (the uninterrupted run)."""
    model, opt, sched = _ckpt_setup(ctx, None)
    _ckpt_loop(ctx, model, opt, sched, 0, save_at=ctx.steps // 2)


@idiom("checkpoint_resume")
def _checkpoint_resume(ctx: Ctx):
    """Loads OUT/ckpt-MODE.pt (a fresh process: run with --resume), attaches, trains the remaining steps."""
    state = torch.load(os.path.join(ctx.args.out, f"ckpt-{ctx.mode}.pt"), map_location=ctx.device)
    model, opt, sched = _ckpt_setup(ctx, state)
    _ckpt_loop(ctx, model, opt, sched, state["step"], save_at=None)


# -- eval forwards in the loop, LBFGS -------------------------------------------------------------------------------
@idiom("eval_in_loop")
def _eval_in_loop(ctx: Ctx):
    """model.eval(); with torch.no_grad(): model(x); model.train() every 3 iterations (BatchNorm: eval uses the
    running statistics); the eval outputs are compared too."""
    model = ctx.ddp(convnet(batchnorm=True))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        if step % 3 == 1:
            model.eval()
            with torch.no_grad():
                ctx.record("eval_out", model(x_eval))
            model.train()


@idiom("lbfgs")
def _lbfgs(ctx: Ctx):
    """optimizer.step(closure): LBFGS evaluates the closure (forward + backward + all-reduce) several times per
    step. Tolerances 0 so that every rank makes the same number of evaluations (the loss is rank-local)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4, tolerance_grad=0.0,
                            tolerance_change=0.0)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        loss = opt.step(closure)
        ctx.record("loss", loss.item())


# -- parameters used between step() and the next forward ------------------------------------------------------------
@idiom("ema_averaged_model")
def _ema_averaged_model(ctx: Ctx):
    """torch.optim.swa_utils.AveragedModel (an EMA of the weights, made before DDP as timm does) updated after
    every step(); the EMA's parameters are compared too."""
    net = convnet()
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    model = ctx.ddp(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, after_step=lambda _step: ema.update_parameters(model.module))
    for p in ema.module.parameters():
        ctx.record("ema", p)


@idiom("weight_clamp")
def _weight_clamp(ctx: Ctx):
    """Every parameter clamped in place after every step() (WGAN's weight clipping)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)

    def clamp(_step):
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-CLAMP, CLAMP)
        ctx.record("clamped", sum(int((p.abs() >= CLAMP).sum()) for p in model.parameters()))
    plain_loop(ctx, model, opt, after_step=clamp)


@idiom("read_after_step")
def _read_after_step(ctx: Ctx):
    """Some iterations read parameters after step(): a weight norm logged every third step, a snapshot of the
    model (copy.deepcopy of the module, after attach: its hooks are copied too) at half-time; the norms and the
    snapshot's parameters are compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    snapshot = []

    def read(step):
        if step % 3 == 1:
            ctx.record("weight_norm", model.module[-1].weight.norm().item())
        if step == ctx.steps // 2:
            snapshot.append(copy.deepcopy(model.module))
    plain_loop(ctx, model, opt, after_step=read)
    for p in snapshot[0].parameters():
        ctx.record("snapshot", p)


class SparseLM(nn.Module):
    """A tiny language model whose embedding produces sparse gradients (``nn.Embedding(sparse=True)``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(50, 16, sparse=True)
        self.out = nn.Linear(16, 50)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens).mean(1)))


@idiom("sparse_embedding")
def _sparse_embedding(ctx: Ctx):
    """Sparse gradients (an embedding with sparse=True), plain SGD (which takes them)."""
    model = ctx.ddp(SparseLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.tokens)


# -- zero_grad variants, bf16 autocast ---------------------------------------------------------------------------
@idiom("zero_grad_first")
def _zero_grad_first(ctx: Ctx):
    """zero_grad(set_to_none=False) at the top of the loop (zeroed gradients kept, not freed), then forward,
    backward, step."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, before_forward=lambda _step: opt.zero_grad(set_to_none=False),
               zero_grad_after=False)


@idiom("autocast_bf16")
def _autocast_bf16(ctx: Ctx):
    """Forward and loss under torch.autocast in bfloat16 (no GradScaler: bf16 needs none), fp32 parameters."""
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, forward_context=lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16))


# -- activation checkpointing, torch.compile --------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """convnet's layers, the convolutions recomputed in backward (``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(self.convs, x, use_reentrant=False))


@idiom("activation_checkpoint")
def _activation_checkpoint(ctx: Ctx):
    """Part of the model recomputed in backward: its modules' forwards (and pre-hooks) run again there."""
    model = ctx.ddp(Checkpointed())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("compiled")
def _compiled(ctx: Ctx):
    """DDP of a torch.compile'd module (backend aot_eager: dynamo's tracing of the modules and their hooks, without
    a C++ compiler), DDP's default buckets (dynamo's DDPOptimizer refuses a first bucket larger than the others)."""
    ctx.model = model = DDP(torch.compile(convnet().to(ctx.device), backend="aot_eager"))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


# -- what the optimizer holds, beyond DDP's buckets; hooks around the step and the forward ----------------------------
@idiom("two_optimizers")
def _two_optimizers(ctx: Ctx):
    """Two optimizers on one DDP model (the trunk's and the head's), only the first given to attach: the second
    steps parameters DDP all-reduces (overlap mode falls back to hook mode)."""
    model = ctx.ddp(convnet())
    trunk = torch.optim.SGD(model.module[:4].parameters(), lr=0.05, momentum=0.9)
    head = torch.optim.Adam(model.module[4:].parameters(), lr=2e-3)
    ctx.attach(model, trunk)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        trunk.step()
        head.step()
        trunk.zero_grad()
        head.zero_grad()
        ctx.record("loss", loss.item())


@idiom("parameter_outside_ddp")
def _parameter_outside_ddp(ctx: Ctx):
    """A learnable temperature outside the model (CLIP's logit scale kept by the loss) in the same optimizer: DDP
    does not all-reduce it, so each rank steps it with its own gradient; compared too."""
    model = ctx.ddp(convnet())
    scale = nn.Parameter(torch.tensor(1.0, device=ctx.device))
    opt = torch.optim.Adam([*model.parameters(), scale], lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x) * scale, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("scale", scale)


@idiom("ddp_ignored")
def _ddp_ignored(ctx: Ctx):
    """Parameters DDP is told to ignore (``_set_params_and_buffers_to_ignore_for_model``: kept per rank), in the
    optimizer with the others."""
    net = convnet()
    DDP._set_params_and_buffers_to_ignore_for_model(net, ["7.weight", "7.bias"])
    model = ctx.ddp(net)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("unfreeze_add_group")
def _unfreeze_add_group(ctx: Ctx):
    """Gradual unfreezing: the first conv frozen when DDP is made (so DDP never all-reduces it), unfrozen and added
    to the optimizer as a param group with its own learning rate halfway through."""
    net = convnet()
    for p in net[0].parameters():
        p.requires_grad_(False)
    model = ctx.ddp(net)
    opt = sgd(model.module[1:].parameters())
    ctx.attach(model, opt)

    def unfreeze(step):
        if step == ctx.steps // 2:
            for p in model.module[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model.module[0].parameters()), "lr": 0.01})
    plain_loop(ctx, model, opt, before_forward=unfreeze)


@idiom("pruned")
def _pruned(ctx: Ctx):
    """``torch.nn.utils.prune`` before DDP, on the first layer (whose step the forward needs first): a forward
    pre-hook of the module computes its weight from the parameter ``weight_orig`` and the mask, so the shim must
    apply that parameter's step before the hook runs."""
    net = convnet()
    torch.nn.utils.prune.l1_unstructured(net[0], "weight", amount=0.5)
    model = ctx.ddp(net)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("user_pre_hook")
def _user_pre_hook(ctx: Ctx):
    """A forward pre-hook of the user's on the first layer, registered before attach, that reads the layer's weight
    (a norm logged at every forward); the norms are compared too."""
    model = ctx.ddp(convnet())
    model.module[0].register_forward_pre_hook(lambda m, _inputs: ctx.record("norm", m.weight.norm().item()))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("step_hooks")
def _step_hooks(ctx: Ctx):
    """An EMA of the weights kept by an optimizer step post-hook (overlap mode falls back to hook mode: it would
    take the step later, in parts); the EMA is compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ema = [p.detach().clone() for p in model.parameters()]

    def average(*_args):
        with torch.no_grad():
            for e, p in zip(ema, model.parameters(), strict=True):
                e.mul_(0.8).add_(p, alpha=0.2)
    opt.register_step_post_hook(average)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)
    for e in ema:
        ctx.record("ema", e)


@idiom("optimizer_state_reset")
def _optimizer_state_reset(ctx: Ctx):
    """Adam's state cleared after a step() halfway through (a warm restart), and its first moments logged after
    every step(): the optimizer's state used between step() and the next forward; the moments are compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    first = next(model.parameters())

    def after(step):
        ctx.record("exp_avg", opt.state[first]["exp_avg"].norm().item())
        if step == ctx.steps // 2:
            opt.state.clear()
    plain_loop(ctx, model, opt, after_step=after)


@idiom("no_zero_grad")
def _no_zero_grad(ctx: Ctx):
    """Gradients never zeroed: each backward adds to what the last left, which under DDP is the average."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, zero_grad_after=False)


@idiom("compiled_optimizer_step")
def _compiled_optimizer_step(ctx: Ctx):
    """The optimizer's step compiled (``opt.step = torch.compile(opt.step)``, before attach; backend eager): its
    rounding differs from eager steps of parts, so overlap mode falls back to hook mode."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    opt.step = torch.compile(opt.step, backend="eager")
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


# -- unusual tensors and layouts ------------------------------------------------------------------------------------
@idiom("channels_last")
def _channels_last(ctx: Ctx):
    """Conv weights in channels_last memory order (DDP lays their gradients out in that order in its buckets)."""
    net = convnet().to(memory_format=torch.channels_last)
    model = ctx.ddp(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt,
               batch=lambda step: tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                                        for t in ctx.images(step)))


class ComplexNet(nn.Module):
    """A complex linear layer between real ones (DDP's bucket holds a complex gradient as two reals each)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.inp = nn.Linear(32, 16)
        self.mix = nn.Linear(16, 16, dtype=torch.complex64)
        self.out = nn.Linear(16, 10)

    def forward(self, x):
        return self.out(self.mix(self.inp(x).to(torch.complex64)).abs())


@idiom("complex_parameters")
def _complex_parameters(ctx: Ctx):
    model = ctx.ddp(ComplexNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.vectors)


@idiom("unused_on_some_ranks")
def _unused_on_some_ranks(ctx: Ctx):
    """find_unused_parameters=True, a branch that rank 0 alone uses in the first iteration, the shim's planner
    measuring it (every rank must end its measurement in the same iteration: its agreement is a collective)."""
    net = Branchy()
    del net.never
    model = ctx.ddp(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=(step == 0 and ctx.rank == 0) or step % 3 == 2), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class MixedDtypes(nn.Module):
    """An fp32 layer and a bf16 one (DDP makes a bucket per dtype)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.a = nn.Linear(32, 16)
        self.b = nn.Linear(16, 10).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


@idiom("adafactor_mixed_dtypes")
def _adafactor_mixed_dtypes(ctx: Ctx):
    """Adafactor (its default eps=(None, ...): the first epsilon from the first stepped parameter's dtype) over a
    group of two dtypes: one parameter's update depends on the others', so overlap mode falls back to hook mode."""
    model = ctx.ddp(MixedDtypes())
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.vectors)


# -- review 3 (a researcher's own loops): skipped steps, restores, optimizer variants, DDP options, autograd ----------
@idiom("nonfinite_loss_skip")
def _nonfinite_loss_skip(ctx: Ctx):
    """A NaN/inf guard on the loss: step 3's batch holds an inf on every rank, so the loss is not finite and the
    step is skipped (``if torch.isfinite(loss): opt.step()``); zero_grad at the top of the loop."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        opt.zero_grad()
        x, y = ctx.images(step)
        if step == 3:
            x[0, 0, 0, 0] = float("inf")
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if torch.isfinite(loss):
            opt.step()
        ctx.record("skipped", float(not torch.isfinite(loss)))


@idiom("grad_norm_skip")
def _grad_norm_skip(ctx: Ctx):
    """Loss-spike protection that reads, but does not change, the gradients: the step is skipped when the total
    gradient norm is over 1.05 times the mean of the earlier ones (under DDP the averaged gradient's norm: the same
    decision on every rank; some steps are skipped at 2, 3 and 4 ranks: at 1.1 times none was at 4 ranks)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    norms = []
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        skip = bool(norms) and norm > 1.05 * sum(norms) / len(norms)
        norms.append(norm)
        if not skip:
            opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("grad_norm", norm)
        ctx.record("skipped", float(skip))


@idiom("restore_midrun")
def _restore_midrun(ctx: Ctx):
    """A roll-back: model and optimizer state kept in memory after step 2 (deep copies of their state_dict()) and
    loaded back into the live model and optimizer after step 5 (model.module.load_state_dict,
    optimizer.load_state_dict), as after a loss spike."""
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ctx.attach(model, opt)
    kept = {}

    def after(step):
        if step == 2:
            kept["model"] = copy.deepcopy(model.module.state_dict())
            kept["opt"] = copy.deepcopy(opt.state_dict())
        if step == 5:
            model.module.load_state_dict(kept["model"])
            opt.load_state_dict(kept["opt"])
    plain_loop(ctx, model, opt, after_step=after)


@idiom("fused_adamw")
def _fused_adamw(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, fused=True)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("sgd_foreach_false_maximize")
def _sgd_foreach_false_maximize(ctx: Ctx):
    """SGD with foreach=False and maximize=True on the negated loss (Adam, maximize too, on the head)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=False, maximize=True)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = -F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("zero_redundancy")
def _zero_redundancy(ctx: Ctx):
    """torch.distributed.optim.ZeroRedundancyOptimizer (each rank steps its shard, then broadcasts it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = ctx.ddp(convnet())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("grad_as_bucket_view")
def _grad_as_bucket_view(ctx: Ctx):
    """DDP(gradient_as_bucket_view=True) (the gradients are views of DDP's buckets; saves a copy of them): overlap
    mode falls back to hook mode (it raised at attach)."""
    model = ctx.ddp(convnet(), gradient_as_bucket_view=True)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("eval_mode_training")
def _eval_mode_training(ctx: Ctx):
    """Some training iterations with the model in eval mode (BatchNorm frozen: running statistics used, not
    updated), model.train(False) for iterations 2..4."""
    model = ctx.ddp(convnet(batchnorm=True))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, before_forward=lambda step: model.train(not 2 <= step <= 4))


@idiom("two_views")
def _two_views(ctx: Ctx):
    """Two forward passes of the DDP model (two augmented views), one loss, one backward (SimCLR-like)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        x2 = ctx.images(step, 1)[0]
        z1, z2 = model(x), model(x2)
        loss = F.cross_entropy(z1, y) + F.mse_loss(z1.softmax(1), z2.softmax(1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("retain_graph_two_losses")
def _retain_graph_two_losses(ctx: Ctx):
    """Two losses on one forward, backpropagated separately (the first with retain_graph=True), one step."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        out = model(x)
        loss1 = F.cross_entropy(out, y)
        loss2 = 0.1 * out.pow(2).mean()
        loss1.backward(retain_graph=True)
        loss2.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss1.item())


@idiom("gradient_penalty")
def _gradient_penalty(ctx: Ctx):
    """A gradient penalty on the inputs (WGAN-GP, R1): torch.autograd.grad(..., create_graph=True), then the
    loss plus the penalty backpropagated once."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        x.requires_grad_(True)
        out = model(x)
        (g,) = torch.autograd.grad(out.logsumexp(1).sum(), x, create_graph=True)
        loss = F.cross_entropy(out, y) + 0.1 * (g.flatten(1).norm(dim=1) - 1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("chained_swa")
def _chained_swa(ctx: Ctx):
    """ChainedScheduler (a warm-up and a decay at once) for the first half, then SWA: SWALR and an AveragedModel
    updated after every step(); the SWA model's parameters are compared too."""
    from torch.optim.swa_utils import SWALR
    sl = torch.optim.lr_scheduler
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters(), lr=0.1)
    ctx.attach(model, opt)
    chained = sl.ChainedScheduler([sl.LinearLR(opt, start_factor=0.3, total_iters=3),
                                   sl.ExponentialLR(opt, gamma=0.8)])
    swa_model = AveragedModel(model.module)
    swa = SWALR(opt, swa_lr=0.02, anneal_epochs=2)
    half = ctx.steps // 2

    def after(step):
        if step < half:
            chained.step()
        else:
            swa_model.update_parameters(model.module)
            swa.step()
    plain_loop(ctx, model, opt, after_step=after)
    for p in swa_model.parameters():
        ctx.record("swa", p)


@idiom("no_decay_by_name")
def _no_decay_by_name(ctx: Ctx):
    """The usual weight-decay split by parameter name (biases and norms without decay), AdamW, cosine schedule."""
    model = ctx.ddp(convnet(batchnorm=True))
    named = list(model.module.named_parameters())
    decay = [p for n, p in named if p.ndim > 1]
    no_decay = [p for n, p in named if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1}],
                            lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.steps)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, sched)


@idiom("parametrized")
def _parametrized(ctx: Ctx):
    """torch.nn.utils.parametrize: the new weight_norm (parametrizations.weight_norm) on the first linear layer and
    a custom symmetric parametrization on the last: their parameters live in ParametrizationList modules, which
    the layer calls inside its own forward."""
    class Scaled(nn.Module):
        def forward(self, w):
            return w * 0.5

    net = convnet()
    torch.nn.utils.parametrizations.weight_norm(net[5])
    torch.nn.utils.parametrize.register_parametrization(net[7], "weight", Scaled())
    model = ctx.ddp(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("eval_inference_mode")
def _eval_inference_mode(ctx: Ctx):
    """Validation under torch.inference_mode() (Lightning's default) after some step()s: the forward applies the
    pending updates there; Adam's state is created in the probe iteration, SGD's momentum later (a layer
    unused until then)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def evaluate(step):
        if step % 3 == 1:
            model.eval()
            with torch.inference_mode():
                ctx.record("eval_out", model(x_eval))
            model.train()
    plain_loop(ctx, model, opt, after_step=evaluate)


@idiom("model_zero_grad_to_zeros")
def _model_zero_grad_to_zeros(ctx: Ctx):
    """model.zero_grad(set_to_none=False) after step (the module's, not the optimizer's)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, zero_grad_after=False,
               after_step=lambda _step: model.zero_grad(set_to_none=False))


# -- reads of the gradients that begin after the probe (the first iteration) ---------------------------------------
WARMUP = 3  # the iteration from which the late idioms read the gradients (overlap mode has begun by then)


def total_grad_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


@idiom("grad_norm_logged_late")
def _grad_norm_logged_late(ctx: Ctx):
    """The total gradient norm logged every fourth iteration from iteration 3 on (3, 7), after step() and before
    zero_grad() (where a loop logs it every 100 steps); also the momentum buffer's norm then, after the read."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)

    def log(step):
        if step % 4 == WARMUP:
            ctx.record("grad_norm", total_grad_norm(model))
    plain_loop(ctx, model, opt, after_step=log)


@idiom("grad_norm_skip_after_warmup")
def _grad_norm_skip_after_warmup(ctx: Ctx):
    """Loss-spike protection that starts after a warm-up: from iteration 3 on, the step is skipped when the total
    gradient norm (read between backward() and step()) is over the mean of the earlier checked ones; the first
    iterations read no gradient (the probe sees none, so overlap mode is chosen)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    norms = []
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        skip = False
        if step >= WARMUP:
            norm = total_grad_norm(model)
            skip = bool(norms) and norm > sum(norms) / len(norms)
            norms.append(norm)
            ctx.record("grad_norm", norm)
        if not skip:
            opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("skipped", float(skip))


@idiom("clip_grad_norm_after_warmup")
def _clip_grad_norm_after_warmup(ctx: Ctx):
    """clip_grad_norm_ switched on after a warm-up (from iteration 3 on; it clips: CLIP_NORM is under the norm)."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= WARMUP:
            ctx.record("total_norm", nn.utils.clip_grad_norm_(model.parameters(), max_norm=CLIP_NORM))
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("grad_scaler_after_warmup")
def _grad_scaler_after_warmup(ctx: Ctx):
    """fp32 for the first iterations, then fp16 autocast with a GradScaler from iteration 3 on (its first scale
    overflows: some steps skipped, later ones taken; unscale_ called explicitly on even iterations)."""
    dev = ctx.device.type
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 20, growth_interval=2)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        if step < WARMUP:
            plain = F.cross_entropy(model(x), y)
            plain.backward()
            opt.step()
            opt.zero_grad()
            ctx.record("loss", plain.item())
            continue
        with torch.autocast(dev, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step % 2 == 0:
            scaler.unscale_(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.record("loss", loss.float().item())
        ctx.record("scale", scale)
        ctx.record("skipped", float(scaler.get_scale() < scale))


# -- review 4 (a researcher's loops, continued): a backward that no step() follows, two DDP models, and more ----------
@idiom("accumulate_without_no_sync")
def _accumulate_without_no_sync(ctx: Ctx):
    """Gradient accumulation without ``no_sync()``: two micro-batches, each backward synchronized, one step (under
    DDP ``.grad`` holds the first average when the second backward adds to it)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        for micro in range(2):
            x, y = ctx.images(step, micro)
            loss = F.cross_entropy(model(x), y) / 2
            loss.backward()
            ctx.record("loss", loss.item())
        opt.step()
        opt.zero_grad()


@idiom("skip_step_keep_grads")
def _skip_step_keep_grads(ctx: Ctx):
    """The step skipped when the loss (all-reduced: the same decision on every rank) is over the mean of the earlier
    ones, zero_grad() only after a step taken (the skipped gradients add to the next); ReduceLROnPlateau fed the
    all-reduced loss."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.0)
    ctx.attach(model, opt)
    seen = []
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = float(mean) / ctx.world
        skip = bool(seen) and mean > sum(seen) / len(seen)
        seen.append(mean)
        if not skip:
            opt.step()
            opt.zero_grad()
        sched.step(mean)
        ctx.record("loss", mean)
        ctx.record("skipped", float(skip))
        ctx.record("lr", opt.param_groups[0]["lr"])


@idiom("no_sync_skipped_step")
def _no_sync_skipped_step(ctx: Ctx):
    """Accumulation with ``no_sync()`` (two micro-batches, the first under it) whose step is skipped at iteration 3
    with the gradients kept, so the next iteration's micro-batches add to that synchronized average."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        for micro in range(2):
            x, y = ctx.images(step, micro)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / 2
                loss.backward()
            ctx.record("loss", loss.item())
        if step != WARMUP:
            opt.step()
            opt.zero_grad()


@idiom("second_backward_late")
def _second_backward_late(ctx: Ctx):
    """From iteration 3 on, two losses on one forward backpropagated separately (the first with retain_graph=True:
    DDP synchronizes only it), the total gradient norm logged before step() on odd iterations."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward(retain_graph=step >= WARMUP)
        if step >= WARMUP:
            (0.1 * out.pow(2).mean()).backward()
            if step % 2:
                ctx.record("grad_norm", total_grad_norm(model))
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(99)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, z):
        return self.net(z)


def discriminator() -> nn.Module:
    torch.manual_seed(98)
    return nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


@idiom("gan_two_models")
def _gan_two_models(ctx: Ctx):
    """A GAN: generator and discriminator each a DDP model with its own optimizer, each attached; zero_grad() right
    after each step, so the discriminator's gradients from the generator's backward add to its next backward (DCGAN
    with zero_grad placed so). The generator's parameters are compared too."""
    gen = DDP(Generator().to(ctx.device), bucket_cap_mb=ctx.args.bucket_cap_mb)
    disc = ctx.ddp(discriminator())
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    ctx.attach(disc, opt_d)
    ctx.attach_other(gen, opt_g)
    for step in range(ctx.steps):
        g = ctx.gen(step)
        real, z = (torch.randn(16, 16, generator=g) + 1.0).to(ctx.device), torch.randn(16, 8, generator=g)
        fake = gen(z.to(ctx.device))
        loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        loss_g = F.softplus(-disc(fake)).mean()
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad()
        ctx.record("loss_d", loss_d.item())
        ctx.record("loss_g", loss_g.item())
    for p in gen.module.parameters():  # (a forward-free read: the guard applies the generator's last step first)
        ctx.record("generator", p)


@idiom("freeze_midrun")
def _freeze_midrun(ctx: Ctx):
    """The first conv frozen halfway through (``requires_grad_(False)``; DDP built with find_unused_parameters=True,
    which such a loop needs); the optimizer keeps it (its grad is None from then on)."""
    model = ctx.ddp(convnet(), find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)

    def freeze(step):
        if step == ctx.steps // 2:
            model.module[0].requires_grad_(False)
    plain_loop(ctx, model, opt, before_forward=freeze)


@idiom("eval_before_step")
def _eval_before_step(ctx: Ctx):
    """Validation between backward() and step() every other iteration (model.eval(), torch.no_grad(), BatchNorm);
    the eval outputs are compared too."""
    model = ctx.ddp(convnet(batchnorm=True))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                ctx.record("eval_out", model(x_eval))
            model.train()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("sampler_last_batch")
def _sampler_last_batch(ctx: Ctx):
    """A DataLoader over a DistributedSampler, ``set_epoch`` every epoch, drop_last=False: the last batch of each
    epoch is smaller (2 epochs)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(44, 3, 8, 8, generator=g), torch.randint(0, 10, (44,), generator=g))
    sampler = DistributedSampler(data, num_replicas=ctx.world, rank=ctx.rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=False)
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ctx.record("loss", loss.item())
            ctx.record("batch", len(x))


@idiom("parameter_hooks")
def _parameter_hooks(ctx: Ctx):
    """Hooks of the user's on parameters: a gradient hook halving the first conv's gradient (``register_hook``) and a
    post-accumulate-grad hook logging a norm (this rank's gradient, before DDP averages it); the norms compared."""
    model = ctx.ddp(convnet())
    model.module[0].weight.register_hook(lambda grad: grad * 0.5)
    model.module[5].weight.register_post_accumulate_grad_hook(lambda p: ctx.record("norm", p.grad.norm().item()))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("unfreeze_late_grad_norm")
def _unfreeze_late_grad_norm(ctx: Ctx):
    """Fine-tuning: the first conv frozen after DDP is made and before attach (DDP all-reduces it: built with
    find_unused_parameters=True), unfrozen at iteration 3; the total gradient norm logged from then on, between
    backward() and step()."""
    model = ctx.ddp(convnet(), find_unused_parameters=True)
    model.module[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        if step == WARMUP:
            model.module[0].requires_grad_(True)
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= WARMUP:
            ctx.record("grad_norm", total_grad_norm(model))
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("unfreeze_late_ema")
def _unfreeze_late_ema(ctx: Ctx):
    """The same frozen-then-unfrozen first conv, with an EMA of the weights written by hand (a loop over the
    parameters, in order) after every step(); the EMA is compared too."""
    model = ctx.ddp(convnet(), find_unused_parameters=True)
    model.module[0].requires_grad_(False)
    ema = [p.detach().clone() for p in model.module.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)

    def update(_step):
        with torch.no_grad():
            for e, p in zip(ema, model.module.parameters(), strict=True):
                e.mul_(0.8).add_(p, alpha=0.2)
    plain_loop(ctx, model, opt, after_step=update,
               before_forward=lambda step: step == WARMUP and model.module[0].requires_grad_(True))
    for e in ema:
        ctx.record("ema", e)


class ScaledByHead(nn.Module):
    """A parent whose forward reads its head's weight (a statistic, under no_grad) before the head runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.trunk = nn.Linear(32, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        with torch.no_grad():
            scale = self.head.weight.abs().mean()
        return self.head(torch.relu(self.trunk(x))) / scale


@idiom("parent_reads_child_weight")
def _parent_reads_child_weight(ctx: Ctx):
    """A parameter read by a parent's forward before its own module runs (no_grad: nothing is saved for backward,
    so autograd would not notice a stale value)."""
    model = ctx.ddp(ScaledByHead())
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.vectors)


class HeadEmbeddingLM(nn.Module):
    """Input embeddings looked up in the output layer's weight (tied by use, not by a shared module), before the
    output layer runs: an embedding saves only its indices for backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.hidden = nn.Linear(50, 16)
        self.out = nn.Linear(16, 50, bias=False)

    def forward(self, tokens):
        e = F.embedding(tokens, self.out.weight.t())  # (50 rows of 16 columns, transposed: 16 x 50 -> rows 0..15)
        return self.out(torch.tanh(self.hidden(e.mean(1))))


@idiom("embedding_from_output_layer")
def _embedding_from_output_layer(ctx: Ctx):
    """The output layer's weight used as the input embedding table (``F.embedding``) before the layer runs."""
    model = ctx.ddp(HeadEmbeddingLM())
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=lambda step: tuple(t % 16 for t in ctx.tokens(step)))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@idiom("two_ddp_one_optimizer")
def _two_ddp_one_optimizer(ctx: Ctx):
    """An encoder and a decoder each wrapped in DDP, one optimizer over both. The optimizer can go to one attach
    only (a second overlap attach of it is refused, before any collective); the other model is attached without it
    (hook mode), and the optimizer's step takes its parameters at step(), as its DDP averaged them. The encoder's
    parameters are compared too."""
    net = EncoderDecoder()
    enc = DDP(net.encoder.to(ctx.device), bucket_cap_mb=ctx.args.bucket_cap_mb)
    dec = ctx.ddp(net.decoder)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=2e-3)
    ctx.attach(dec, opt)
    if ctx.mode == "overlap":
        try:
            shim.attach(enc, opt, levels=ctx.args.levels, agent_socket=ctx.args.agent_socket)
        except ValueError as exc:
            assert "already given to shim.attach" in str(exc), exc
        else:
            raise AssertionError("a second overlap attach of one optimizer was not refused")
    if ctx.mode != "ddp":
        ctx.others.append(shim.attach(enc, levels=ctx.args.levels, agent_socket=ctx.args.agent_socket,
                                      link_bps=ctx.args.link_bps))
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(dec(enc(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
    for p in enc.module.parameters():
        ctx.record("encoder", p)


@idiom("rank0_validation_barrier")
def _rank0_validation_barrier(ctx: Ctx):
    """Validation on rank 0 alone (``model.module``, eval, no_grad) after the first iteration and every fourth,
    the other ranks waiting at a barrier: a forward that one rank runs alone (the planner's agreement on its
    measurement, a collective, was made at the forward after the measured iteration: on rank 0 here, alone)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def validate(step):
        if step % 4 == 0:
            if ctx.rank == 0:
                model.eval()
                with torch.no_grad():
                    ctx.record("eval_out", model.module(x_eval))
                model.train()
            dist.barrier()
    plain_loop(ctx, model, opt, after_step=validate)


@idiom("prepend_hook_after_attach")
def _prepend_hook_after_attach(ctx: Ctx):
    """A forward pre-hook of the user's registered after attach with ``prepend=True`` (so it runs before the shim's
    own) that logs the layer's weight norm; the norms are compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    model.module[5].register_forward_pre_hook(lambda m, _i: ctx.record("norm", m.weight.norm().item()), prepend=True)
    plain_loop(ctx, model, opt)


@idiom("global_forward_pre_hook")
def _global_forward_pre_hook(ctx: Ctx):
    """A global module forward pre-hook (``register_module_forward_pre_hook``: runs before every module's own
    hooks) logging each linear layer's weight norm; the norms are compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)

    def log(m, _inputs):
        if isinstance(m, nn.Linear):
            ctx.record("norm", m.weight.norm().item())
    hook = torch.nn.modules.module.register_module_forward_pre_hook(log)
    try:
        plain_loop(ctx, model, opt)
    finally:
        hook.remove()


@idiom("grad_scaler_disabled")
def _grad_scaler_disabled(ctx: Ctx):
    """The usual AMP switch turned off: ``GradScaler(enabled=False)`` and ``autocast(enabled=False)``, the loop
    still calling ``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()`` (a disabled scaler's
    step is the optimizer's own)."""
    dev = ctx.device.type
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler(dev, enabled=False)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        with torch.autocast(dev, dtype=torch.float16, enabled=False):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class OpCounter(torch.overrides.TorchFunctionMode):
    """A user's torch-function mode: counts the torch operations of a block."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@idiom("user_function_mode")
def _user_function_mode(ctx: Ctx):
    """A mode of the user's (an operation counter) entered before the forward and exited after step(), an EMA of
    the weights written by hand after it: the mode's exit must pop the user's mode (TorchFunctionMode.__exit__ pops
    whatever is on top), and the EMA see the updated weights; the EMA is compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    ema = [p.detach().clone() for p in model.module.parameters()]
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        counter = OpCounter()
        with counter:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
        assert not any(m is counter for m in stack), "the user's mode is still on the stack after its block"
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, model.module.parameters(), strict=True):
                e.mul_(0.8).add_(p, alpha=0.2)
        ctx.record("loss", loss.item())
    for e in ema:
        ctx.record("ema", e)


@idiom("close_before_step")
def _close_before_step(ctx: Ctx):
    """``handle.close()`` between backward() and step() at iteration 5 (a time budget reached, the rest of the run
    as plain DDP): the step after it takes DDP's averaged gradients."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 5 and ctx.handle is not None:
            ctx.handle.close()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class SAM(torch.optim.Optimizer):
    """Sharpness-Aware Minimization as most code has it (github.com/davda54/sam, ASAM with ``adaptive=True``): a
    wrapper whose ``param_groups`` are its base optimizer's; ``first_step`` perturbs the weights along the
    gradient, ``second_step`` restores them (``p.data = old_p``) and takes the base optimizer's step."""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([((torch.abs(p) if g["adaptive"] else 1.0) * p.grad).norm(p=2)
                                            for g in self.param_groups for p in g["params"] if p.grad is not None]))
        for g in self.param_groups:
            scale = g["rho"] / (grad_norm + 1e-12)
            for p in g["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_((torch.pow(p, 2) if g["adaptive"] else 1.0) * p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def sam_loop(ctx: Ctx, adaptive: bool, first_no_sync: bool) -> None:
    model = ctx.ddp(convnet())
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, adaptive=adaptive, lr=0.05, momentum=0.9)
    ctx.attach(model, opt.base_optimizer)  # the optimizer that steps (SAM itself is not per-parameter)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        with (model.no_sync() if first_no_sync else contextlib.nullcontext()):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.first_step(zero_grad=True)
        F.cross_entropy(model(x), y).backward()
        opt.second_step(zero_grad=True)
        ctx.record("loss", loss.item())


@idiom("sam")
def _sam(ctx: Ctx):
    """SAM: two forward-backward passes per step, both synchronized, the weights perturbed in between along the
    first (averaged) gradients and restored by ``p.data = old_p`` before the base SGD's step."""
    sam_loop(ctx, adaptive=False, first_no_sync=False)


class LayerDropNet(nn.Module):
    """An MLP of residual blocks, each block skipped at random in training (LayerDrop / stochastic depth), with a
    per-rank generator: a block may be used on one rank and not another, or on none."""

    def __init__(self, gen):
        super().__init__()
        torch.manual_seed(1234)
        self.inp = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 10)
        self.gen = gen

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            if float(torch.rand((), generator=self.gen)) >= 0.5:
                h = h + torch.relu(b(h))
        return self.out(h)


@idiom("layerdrop_per_rank")
def _layerdrop_per_rank(ctx: Ctx):
    """LayerDrop with find_unused_parameters=True: each block used or dropped at random, per rank and step; SGD
    with momentum and weight decay."""
    model = ctx.ddp(LayerDropNet(torch.Generator().manual_seed(7 + 31 * ctx.rank)), find_unused_parameters=True)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.vectors)


@idiom("eval_partial_then_ema")
def _eval_partial_then_ema(ctx: Ctx):
    """After step(): a validation forward under no_grad that does not run every module (the auxiliary branch is
    for training only), then an EMA of every weight kept by hand; the EMA compared too."""
    net = Branchy()
    del net.never
    model = ctx.ddp(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=True), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            ctx.record("val", model(x, use_branch=False))
        model.train()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters(), strict=True):
                e.lerp_(p, 0.1)
        ctx.record("loss", loss.item())
    for i, e in enumerate(ema):
        ctx.record(f"ema{i}", e)


# -- review 7 (loops not yet in the matrix) -------------------------------------------------------------------------
@idiom("adafactor_autocast")
def _adafactor_autocast(ctx: Ctx):
    """Adafactor (fp32 parameters, one dtype: per parameter) with the forward under torch.autocast in bfloat16 and
    step() outside it: its factored second moment is a matmul (row_var @ col_var), which autocast runs in bf16. The
    deferred step runs in the next forward's pre-hooks, inside autocast: it must run as step() did (until
    2026-11-27 it ran in bf16 there, silently: 3e-2 relative from DDP after 8 steps at 2 ranks)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, forward_context=lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16))


@idiom("kept_tensors_saved_wrapper_hook")
def _kept_tensors_saved_wrapper_hook(ctx: Ctx):
    """Uses of the weights, gradients and optimizer state that no torch operation on them shows: a forward pre-hook
    on the DDP model itself (not its module, registered before attach) logging the first layer's weight norm, which
    runs before the inner module's forward; model.module.state_dict() taken once before the loop (its tensors share
    the parameters' storage) and optimizer.state_dict() taken once after the first step (its tensors are the
    momentum buffers, updated in place), each torch.save'd after some later step()s; and a dump of the gradients
    (torch.save({name: p.grad})) between backward() and step() in some iterations after the probe. torch.save reads a
    tensor through untyped_storage() alone. All must see what DDP's loop sees there (until 2026-11-27: the norm
    3.8e-4, the saved weights 7e-2, the saved momenta about 1 and the saved gradients 1.25 relative off, silently:
    this rank's own gradients); the norms and the saved tensors are compared."""
    import io
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    model.register_forward_pre_hook(lambda m, _i: ctx.record("hook_norm", m.module[0].weight.norm().item()))
    ctx.attach(model, opt)
    kept = {"model": model.module.state_dict()}

    def saved(obj) -> dict:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf)

    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= 2 and step % 2 == 0:
            for k, v in saved({n: p.grad for n, p in model.module.named_parameters()}).items():
                ctx.record(f"saved_grad_{k}", v)
        opt.step()
        if step == 0:
            kept["opt"] = opt.state_dict()
        if step % 3 == 1:  # the optimizer's first: a flush for the model's would apply its pending updates too
            for i, st in saved(kept["opt"])["state"].items():
                ctx.record(f"saved_momentum_{i}", st["momentum_buffer"])
            for k, v in saved(kept["model"]).items():
                ctx.record(f"saved_{k}", v)
        opt.zero_grad()
        ctx.record("loss", loss.item())


class NoisySGD(torch.optim.SGD):
    """SGD plus Gaussian noise on each update (SGLD-style), drawn from the global generator."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.randn_like(p), alpha=1e-3)


@idiom("noisy_optimizer_dropout")
def _noisy_optimizer_dropout(ctx: Ctx):
    """An optimizer declared per parameter (per_parameter_optimizer=True) that draws noise from the global generator
    (SGLD-style), and a model with dropout (the same generator). Overlap mode would take the draws later and in parts,
    interleaved with dropout's: the probe sees the step change the generator's state and falls back to hook mode
    (until 2026-11-27 it overlapped, silently: 0.16 relative from DDP after 8 steps)."""
    torch.manual_seed(1234)
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))
    model = ctx.ddp(net)
    opt = NoisySGD(model.parameters(), lr=0.05, momentum=0.9)
    if ctx.mode != "ddp":
        ctx.handle = shim.attach(model, optimizer=opt if ctx.mode == "overlap" else None, levels=ctx.args.levels,
                                 agent_socket=ctx.args.agent_socket, link_bps=ctx.args.link_bps,
                                 per_parameter_optimizer=True if ctx.mode == "overlap" else None)
    torch.manual_seed(4321)
    plain_loop(ctx, model, opt)


# -- review s7 (loops not yet in the matrix, 2) -------------------------------------------------------------------
@idiom("functional_call_traced")
def _functional_call_traced(ctx: Ctx):
    """Weights read after step() by code that does not run the model's own modules' forwards: torch.func.functional_call
    of model.module with detached aliases of its parameters kept from before the loop (they share the parameters'
    memory; the module's forward runs with them in the parameters' place), a torch.jit.trace of model.module made
    before the loop (it shares the parameters, and runs its operations in C++) called after step(), and a second
    trace made after step() halfway through, called in the later iterations. All must see the updated weights (until
    2026-11-27 the aliased and the early traced outputs were 9e-2 relative off, silently, and the trace after step()
    raised the tracer's "Tried to trace Future"); the outputs are compared."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    aliases = {k: v.detach() for k, v in model.module.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tracer's warnings about the shim's hooks)
        early = torch.jit.trace(model.module, ctx.images(999)[0])
    late = []

    def after(step):
        x, _y = ctx.images(step + 1000)
        with torch.no_grad():
            if step % 3 == 0:
                ctx.record("aliased", torch.func.functional_call(model.module, aliases, (x,)))
            elif step % 3 == 1:
                ctx.record("traced_early", early(x))
            elif not late:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    late.append(torch.jit.trace(model.module, x))
            else:
                ctx.record("traced_late", late[0](x))
    plain_loop(ctx, model, opt, after_step=after)


# -- review s8 (loops not yet in the matrix, 3) -------------------------------------------------------------------
@idiom("late_state_inference")
def _late_state_inference(ctx: Ctx):
    """A branch first used after the probe (its momentum buffers made by a deferred step), and validation under
    torch.inference_mode() right after that step() (Lightning's default): the deferred step runs in the validation
    forward, where it would make the new state inference tensors, which the next step cannot update in place (until
    2026-11-27 overlap mode raised there, "Inplace update to inference tensor outside InferenceMode", where DDP
    trains on); set_to_none=False keeps the gradient tensors across steps."""
    model = ctx.ddp(Branchy(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    x_eval = ctx.vectors(10_000)[0]
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=step >= 3), y)
        loss.backward()
        opt.step()
        if step in (3, 5):
            model.eval()
            with torch.inference_mode():
                ctx.record("eval_out", model(x_eval, use_branch=True))
            model.train()
        opt.zero_grad(set_to_none=False)
        ctx.record("loss", loss.item())


# -- review s8 (loops not yet in the matrix, 4) -------------------------------------------------------------------
@idiom("wrapped_optimizer_step")
def _wrapped_optimizer_step(ctx: Ctx):
    """``optimizer.step`` replaced on the instance before attach by a function of the user's: a LARS-like wrapper
    that scales every gradient by the global norm first, and counts its calls (logged). Overlap mode would call it
    once per part, on that part's parameters (until 2026-11-27 it did, silently: the parameters 1.1e-3 from DDP
    after 8 steps, 13 calls counted for 8 steps); it falls back to hook mode at attach. An LR scheduler made before
    attach (torch's own wrapper of ``step``) still overlaps (the scheduled idioms)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    own, calls = opt.step, [0]

    def step(closure=None):
        calls[0] += 1
        with torch.no_grad():
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            torch._foreach_mul_(grads, 1.0 / (1.0 + total.item()))
        return own(closure)
    opt.step = step
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)
    ctx.record("calls", calls[0])


@idiom("class_wrapped_optimizer_step")
def _class_wrapped_optimizer_step(ctx: Ctx):
    """``torch.optim.SGD.step`` replaced on the class before attach by a user's wrapper that scales every gradient by
    the global norm first (as ``wrapped_optimizer_step`` on the instance), and after 4 steps wrapped once more by a
    call counter that also halves the gradients (a patch applied late). Overlap mode falls back to hook mode at
    attach, and the later wrapper is called from then on, as under DDP. Until 2026-11-27 neither was seen: overlap
    mode called the first once per part (the parameters 1.1e-2 from DDP after 8 steps at 2 ranks, 14 calls counted
    for 8), and kept calling the function of attach time after the second came (4 calls of it missed)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    own, calls = torch.optim.SGD.step, [0, 0]

    @functools.wraps(own)
    def scaled(self, closure=None):
        calls[0] += 1
        with torch.no_grad():
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            torch._foreach_mul_(grads, 1.0 / (1.0 + total.item()))
        return own(self, closure)

    def counted(self, closure=None):  # (and halves the step: a late wrapper that changed nothing would not show)
        calls[1] += 1
        with torch.no_grad():
            torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None], 0.5)
        return scaled(self, closure)
    def late(step):
        if step == 4:
            torch.optim.SGD.step = counted
    torch.optim.SGD.step = scaled
    try:
        ctx.attach(model, opt)
        plain_loop(ctx, model, opt, before_forward=late)
    finally:
        torch.optim.SGD.step = own
    ctx.record("calls", calls[0])
    ctx.record("late_calls", calls[1])


@idiom("rollback_after_backward")
def _rollback_after_backward(ctx: Ctx):
    """A NaN loss (every rank, step 4) seen after backward(): the model and the optimizer restored from in-memory
    copies (``load_state_dict``), no ``step()``, on to the next batch; at step 6 only the last layer is restored
    (its own ``load_state_dict``) and the step taken on the gradients. Until 2026-11-27 overlap mode raised at the
    next backward ("changed after backward() although no optimizer.step()"), where DDP trains on."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    snap = (copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict()))
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        if step == 4:
            loss = loss * float("nan")
        loss.backward()
        if not torch.isfinite(loss):
            model.module.load_state_dict(snap[0])
            opt.load_state_dict(snap[1])
            opt.zero_grad()
            ctx.record("rolled_back", step)
            continue
        if step == 6:
            model.module[7].load_state_dict({k[2:]: v for k, v in snap[0].items() if k.startswith("7.")})
        opt.step()
        opt.zero_grad()
        snap = (copy.deepcopy(model.module.state_dict()), copy.deepcopy(opt.state_dict()))
        ctx.record("loss", loss.item())

# -- review s9 (loops people write): a new optimizer mid-run ----------------------------------------------------
@idiom("switch_optimizer_reattach")
def _switch_optimizer_reattach(ctx: Ctx):
    """Adam for the first half, then a new optimizer (SGD with momentum) over the same parameters, as a two-stage
    fine-tuning loop makes one: at the switch the shim's handle is closed and the new optimizer attached (overlap
    mode takes over one optimizer's step(); an optimizer not attached that steps DDP's parameters raises). Until
    2026-11-27 that second attach was refused: the closed attach's comm hook, which DDP keeps for good, was taken for
    a hook of the user's."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        if step == ctx.steps // 2:
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if ctx.handle is not None:
                ctx.handle.close()
                ctx.attach(model, opt)
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class MomentumEncoder(nn.Module):
    """An online network and a momentum (EMA) copy of it, the copy updated from the online weights at the start of
    the training forward (under no_grad, before the online network runs: MoCo-like code), from iteration ``start``
    on; the copy's softmax is a second target of the loss."""

    def __init__(self, start: int):
        super().__init__()
        self.online = convnet()
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.start, self.calls = start, 0

    def forward(self, x, x2):
        if self.training:
            if self.calls >= self.start:
                with torch.no_grad():
                    for t, o in zip(self.target.parameters(), self.online.parameters(), strict=True):
                        t.mul_(0.9).add_(o, alpha=0.1)
            self.calls += 1
        with torch.no_grad():
            target = self.target(x2).softmax(1)
        return self.online(x), target


@idiom("momentum_encoder_after_warmup")
def _momentum_encoder_after_warmup(ctx: Ctx):
    """The momentum encoder's update in the forward begins after a warm-up (WARMUP), so the probe's forward does not
    see the online weights read before their modules run. Until 2026-11-27 overlap mode read them before their update
    there, silently: the momentum encoder 1.9e-2 relative off DDP after 8 steps at 2 ranks, the online weights 6.7e-4;
    the guard now stays armed through the forward for the parameters not yet applied."""
    model = ctx.ddp(MomentumEncoder(start=WARMUP))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        out, target = model(x, ctx.images(step, 1)[0])
        loss = F.cross_entropy(out, y) + F.cross_entropy(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class ReadsFirstEarly(nn.Module):
    """A large first layer (its all-reduce, DDP's last bucket, ends last) whose weight's norm the parent reads under
    no_grad before calling it, from its 5th call on (a statistic of the weights, as ``UsesOtherEarly``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.first = nn.Linear(3 * 8 * 8, 4096)
        self.head = nn.Linear(4096, 10)
        self.calls = 0

    def forward(self, x):
        scale = 1.0
        if self.calls >= 4:
            with torch.no_grad():
                scale = self.first.weight.norm()
        self.calls += 1
        return self.head(torch.relu(self.first(x.flatten(1)))) * scale


@idiom("validation_thread_reads_early")
def _validation_thread_reads_early(ctx: Ctx):
    """A validation thread started right after step() (joined before the next forward) runs the inner module, whose
    parent reads the first layer's weight before that layer runs: no guard watches that thread, so its forward
    applies every pending update first. Until 2026-11-27 its outputs read the weight before its update while the
    all-reduce was in flight (the parameters exact, the recorded outputs off, silently)."""
    inner = ReadsFirstEarly()
    model = ctx.ddp(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out = {}

        def validate(x=x, out=out):  # (every output, not their sum: at 3 ranks a sum near 0 magnifies rounding)
            with torch.no_grad():
                out["val"] = inner(x)
        thread = threading.Thread(target=validate)
        thread.start()
        thread.join()
        ctx.record("val", out["val"])
        ctx.record("loss", loss.item())


# -- session 10 ---------------------------------------------------------------------------------------------------
@torch.jit.script
def scripted_norms(weights: list[torch.Tensor]) -> torch.Tensor:
    """A logged statistic of the weights, as TorchScript (its operations run in C++, out of the guard's sight)."""
    return torch.stack([w.norm() for w in weights])


@idiom("scripted_function_reads_weights")
def _scripted_function_reads_weights(ctx: Ctx):
    """Weights read after step() through TorchScript called from Python, which runs its operations in C++: a
    scripted function given the weights (a logged norm), and a traced copy of the model whose ``forward`` method is
    called directly (no module call, so no forward pre-hook). Until 2026-11-28 both read the weights before their
    update, silently (1.1e-1 relative off DDP's records after 8 steps at 2 ranks); the guard now takes such a
    call as a use."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tracer's warnings about the shim's hooks)
        traced = torch.jit.trace(model.module, ctx.images(999)[0])
    weights = [p for p in model.module.parameters() if p.dim() > 1]

    def after(step):
        with torch.no_grad():
            if step % 2 == 0:
                ctx.record("norms", scripted_norms(weights))
            else:
                ctx.record("traced_forward", traced.forward(ctx.images(step + 1000)[0]))
    plain_loop(ctx, model, opt, after_step=after)


@idiom("dcp_get_state_dict_stateless")
def _dcp_get_state_dict_stateless(ctx: Ctx):
    """A checkpoint taken with ``torch.distributed.checkpoint.state_dict.get_state_dict`` every 3rd iteration, before
    the forward, with SGD without momentum: its optimizer state stays empty, so get_state_dict initialises it by
    setting every ``.grad`` to zeros and calling ``optimizer.step()`` at lr 0 (a second step with no backward since
    the last). Until 2026-11-28 overlap mode raised there ("optimizer.step() without a synchronized backward()"), a
    correct loop refused; the saved parameters' sum is compared too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)

    def save(step):
        if step % 3 == 1:
            msd, _osd = get_state_dict(model, opt)
            ctx.record("saved", sum(v.double().sum() for v in msd.values()))
    plain_loop(ctx, model, opt, before_forward=save)


@idiom("averaged_model_of_ddp")
def _averaged_model_of_ddp(ctx: Ctx):
    """SWA over the DDP model itself (``AveragedModel(model)``, PyTorch's SWA recipe, a deep copy of the DDP model
    made after attach) from iteration 3 on, then ``update_bn`` through the copy; and a snapshot
    ``copy.deepcopy(model)`` kept as a hand-written EMA. Until 2026-11-28 both deep copies raised in both modes (the
    shim's state in the DDP model's comm hooks refused deep copies, with a message about Lightning's ddp_spawn),
    where plain DDP trains on."""
    from torch.optim.swa_utils import update_bn

    model = ctx.ddp(convnet(batchnorm=True))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    swa = AveragedModel(model)
    ema = {}

    def average(step):
        if step >= 3:
            swa.update_parameters(model)
        if step == 1:
            ema["model"] = copy.deepcopy(model)
        elif step > 1:
            with torch.no_grad():
                for e, p in zip(ema["model"].parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 0.2)
    plain_loop(ctx, model, opt, after_step=average)
    update_bn([ctx.images(s)[0] for s in range(100, 103)], swa)
    for t in [*swa.module.module.parameters(), *swa.module.module.buffers(), *ema["model"].parameters()]:
        ctx.record("averaged", t)


@idiom("whole_model_saved")
def _whole_model_saved(ctx: Ctx):
    """The whole module pickled (``torch.save(model.module)``, loaded back with ``weights_only=False``) right after
    attach and after every step(); the loaded copies' parameters are compared too. Until 2026-11-28 the first save
    raised in both modes ("Can't pickle local object 'Recorder._post.<locals>.hook'": the planner's timing hooks,
    on the modules until the first iteration has ended) where plain DDP saves."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)

    def save(_step):
        buf = io.BytesIO()
        torch.save(model.module, buf)
        buf.seek(0)
        ctx.record("saved", torch.cat([p.flatten() for p in torch.load(buf, weights_only=False).parameters()]))
    save(-1)
    plain_loop(ctx, model, opt, after_step=save)

@idiom("regroup_after_step")
def _regroup_after_step(ctx: Ctx):
    """Param groups edited by hand right after ``step()``, by identity (no torch operation on a parameter): at
    step 3 the first conv moves to a slow group (a lower learning rate for the stem after a warm-up), at step 5
    the second conv is frozen and dropped from the optimizer (``find_unused_parameters=True``). Under DDP the
    ``step()`` before each edit updated them with their old group."""
    model = ctx.ddp(convnet(), find_unused_parameters=True)
    m = model.module
    opt = torch.optim.SGD([{"params": list(m.parameters()), "lr": 0.05}, {"params": [], "lr": 0.001}], momentum=0.9)
    ctx.attach(model, opt)

    def regroup(step):
        if step in (3, 5):
            ids = {id(p) for p in m[0 if step == 3 else 2].parameters()}
            moved = [p for p in opt.param_groups[0]["params"] if id(p) in ids]
            opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if id(p) not in ids]
            if step == 3:
                opt.param_groups[1]["params"].extend(moved)
            else:
                for p in moved:
                    p.requires_grad = False
    plain_loop(ctx, model, opt, after_step=regroup)


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as the usual implementations write it: an ``Optimizer`` subclass around the
    inner one (``.optimizer``, sharing its ``param_groups``), slow weights in its own state, every ``k`` steps
    ``_foreach_lerp_`` of the slow weights and a copy into the parameters through ``.data``."""

    def __init__(self, optimizer, k: int = 3, alpha: float = 0.5):
        self.optimizer, self.k, self.alpha, self.count = optimizer, k, alpha, 0
        self.param_groups, self.defaults = optimizer.param_groups, optimizer.defaults
        self.state = collections.defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.count += 1
        if self.count % self.k == 0:
            fast = [p for g in self.param_groups for p in g["params"]]
            slow = [self.state[p].setdefault("slow", p.detach().clone()) for p in fast]
            torch._foreach_lerp_(slow, fast, self.alpha)
            for p, s in zip(fast, slow, strict=True):
                p.data.copy_(s)
        return loss


@idiom("lookahead_optimizer")
def _lookahead_optimizer(ctx: Ctx):
    """A ``Lookahead`` wrapper around AdamW given to ``attach`` (the shim takes its ``.optimizer``); the wrapper's
    step steps the inner one, then reads and writes every parameter."""
    model = ctx.ddp(convnet())
    opt = Lookahead(torch.optim.AdamW(model.parameters(), lr=2e-3))
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)

class TinyTransformer(nn.Module):
    """Token embedding, two ``nn.TransformerEncoderLayer`` (torch's fused fast path in eval mode), a linear head."""

    def __init__(self, seed: int = 1234):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 32)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                         enable_nested_tensor=False)
        self.out = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.out(self.enc(self.embed(tokens)).mean(1))


@idiom("transformer_teacher_eval")
def _transformer_teacher_eval(ctx: Ctx):
    """Distillation from a frozen transformer teacher (eval mode, ``no_grad``: torch's fast path) whose soft targets
    are computed between ``step()`` and the student's forward, and a validation forward of the student in eval mode
    after ``step()``. torch takes the fast path only with no torch-function mode on the stack."""
    teacher = TinyTransformer(seed=99).to(ctx.device).eval().requires_grad_(False)
    model = ctx.ddp(TinyTransformer())
    opt = sgd(model.parameters())  # (not Adam: the key bias has no gradient but rounding noise, which Adam amplifies)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.tokens(step)
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        out = model(x)
        loss = F.cross_entropy(out, y) + F.kl_div(out.log_softmax(-1), soft, reduction="batchmean")
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            ctx.record("eval", model(ctx.tokens(step + 50)[0]))
        model.train()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("compiled_teacher")
def _compiled_teacher(ctx: Ctx):
    """Distillation from a ``torch.compile``d frozen teacher (eval mode, ``no_grad``) whose soft targets are computed
    between ``step()`` and the student's forward, and a compiled function that reads the student's weights through a
    closure right after ``step()`` (a logged weight norm). Both run with the shim's modes off the stack. The teacher
    uses ``aot_eager``: with inductor (19 s of a cold compile per launch, a fifth of the suite's conformance time) it
    was 2.2e-7 off before the fix (2026-11-28, by hand); without the fix the weight norm raises inside the shim."""
    torch.manual_seed(7)
    teacher = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10),
                                          nn.LogSoftmax(-1)).to(ctx.device).eval().requires_grad_(False),
                            backend="aot_eager")
    torch.manual_seed(1234)
    model = ctx.ddp(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)

    @torch.compile(backend="eager")  # (dynamo alone: a second inductor compile would cost seconds)
    def weight_norm():
        return torch.stack([p.detach().square().sum() for p in model.module.parameters()]).sum().sqrt()

    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        with torch.no_grad():
            soft = teacher(x).exp()
        ctx.record("soft", soft)
        out = model(x)
        loss = F.cross_entropy(out, y) + F.kl_div(out.log_softmax(-1), soft, reduction="batchmean")
        loss.backward()
        opt.step()
        ctx.record("weight_norm", weight_norm())
        opt.zero_grad()
        ctx.record("loss", loss.item())


# -- review 2026-11-28: modes disabling torch functions, steps skipped per rank, reentrant checkpointing
class OpCounterDisabling(torch.overrides.TorchFunctionMode):
    """An operation counter whose handler runs each operation with torch functions disabled, the modes below it
    included (``with torch._C.DisableTorchFunction(): return func(...)``, a pattern of user-written modes)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


@idiom("user_mode_disabling_torch_function")
def _user_mode_disabling_torch_function(ctx: Ctx):
    """Such a mode around step(), around an EMA of the weights right after it, and from iteration 3 on around a
    logged gradient norm before step(): no mode below it sees those operations (the shim's guard and gradient watch),
    so the shim acts at the entry of DisableTorchFunction instead; the EMA and the norms are compared too."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    params = list(model.module.parameters())
    ema = [p.detach().clone() for p in params]
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= 3:
            with OpCounterDisabling():
                ctx.record("grad_norm", torch.stack([p.grad.norm() for p in params]).norm())
        with OpCounterDisabling():
            opt.step()
        with OpCounterDisabling(), torch.no_grad():
            for e, p in zip(ema, params, strict=True):
                e.mul_(0.8).add_(p, alpha=0.2)
        opt.zero_grad()
        ctx.record("loss", loss.item())
    for e in ema:
        ctx.record("ema", e)


@idiom("skip_step_on_one_rank")
def _skip_step_on_one_rank(ctx: Ctx):
    """Rank 1 skips optimizer.step() (its gradients zeroed all the same) in the first iteration, which the probe
    watches, and in the 5th: the ranks diverge under DDP, and must diverge alike through the shim."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if not (ctx.rank == 1 and step in (0, 4)):
            opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


class CheckpointedReentrant(Checkpointed):
    """The head recomputed in backward by reentrant checkpointing (its input requires grad)."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.head, self.convs(x), use_reentrant=True)


@idiom("checkpoint_reentrant")
def _checkpoint_reentrant(ctx: Ctx):
    """Reentrant activation checkpointing (DDP with static_graph=True, as it requires): the head's forward and its
    pre-hooks run again inside backward, after its bucket may have been launched."""
    model = ctx.ddp(CheckpointedReentrant(), static_graph=True)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


# -- review loops9 (2026-11-28): per-parameter hooks, collectives, resets, foreach, legacy saves, dtype changes -----
@idiom("post_accumulate_clip_hook", start=0)
@idiom("post_accumulate_clip_hook_late", start=3)
def _post_accumulate_clip_hook(ctx: Ctx, start: int):
    """From iteration ``start`` on (0, or 3: after the probe), a ``register_post_accumulate_grad_hook`` on every
    parameter clamps this rank's gradient in place as it is accumulated (per-parameter clipping before the
    all-reduce) and logs its norm."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)

    def hook(p):
        p.grad.clamp_(-CLIP_VALUE, CLIP_VALUE)
        ctx.record("clipped_norm", p.grad.norm().item())

    def before(step):
        if step == start:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hook)
    plain_loop(ctx, model, opt, before_forward=before)


@idiom("broadcast_rank0_weights")
def _broadcast_rank0_weights(ctx: Ctx):
    """Rank 1 skips its step in iteration 2 (the ranks drift apart); every 3rd iteration, right after step(), every
    parameter is re-synchronised from rank 0 with ``dist.broadcast(p, 0)`` under ``no_grad`` (no ``.data``: the
    collective alone uses the parameter), and each rank logs a weight sum."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if not (ctx.rank == 1 and step == 2):
            opt.step()
        if step % 3 == 2:
            with torch.no_grad():
                for p in model.parameters():
                    dist.broadcast(p, 0)
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("w0", model.module[0].weight.detach().sum())


@idiom("reset_to_best_model_only")
def _reset_to_best_model_only(ctx: Ctx):
    """The best weights (lowest mean loss over the ranks so far) kept as a deep copy of
    ``model.module.state_dict()``; after iteration 5 the model is reset to them with ``load_state_dict`` while the
    optimizer keeps its (Adam) state."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ctx.attach(model, opt)
    best = {"loss": float("inf")}
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the ranks' mean loss: every rank keeps the same best weights
        if mean.item() / ctx.world < best["loss"]:
            best.update(loss=mean.item() / ctx.world, state=copy.deepcopy(model.module.state_dict()))
        if step == 5:
            model.module.load_state_dict(best["state"])
        ctx.record("loss", loss.item())


@idiom("foreach_decay_and_ema")
def _foreach_decay_and_ema(ctx: Ctx):
    """Right after step(): decoupled weight decay by hand over ``model.parameters()``
    (``torch._foreach_mul_`` in place, under ``no_grad``) and an EMA ``torch._foreach_lerp_(ema, params, 0.1)``."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]

    def after(step):
        params = list(model.parameters())
        with torch.no_grad():
            torch._foreach_mul_(params, 1 - 0.05 * 0.01)
            torch._foreach_lerp_(ema, params, 0.1)
        ctx.record("ema", torch.stack([e.sum() for e in ema]))
    plain_loop(ctx, model, opt, after_step=after)


@idiom("legacy_save_keep_vars")
def _legacy_save_keep_vars(ctx: Ctx):
    """Right after step(), inside ``torch.no_grad()``: ``torch.save(model.state_dict(keep_vars=True), buf,
    _use_new_zipfile_serialization=False)`` (the parameters themselves, legacy format), read back and logged."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)

    def after(step):
        buf = io.BytesIO()
        with torch.no_grad():
            torch.save(model.module.state_dict(keep_vars=True), buf, _use_new_zipfile_serialization=False)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        ctx.record("saved", torch.stack([t.double().sum() for t in saved.values()]))
    plain_loop(ctx, model, opt, after_step=after)

@idiom("spectral_norm_legacy")
def _spectral_norm_legacy(ctx: Ctx):
    """A GAN discriminator's layers under the legacy ``nn.utils.spectral_norm`` (its forward pre-hook runs a power
    iteration, writing the ``u``/``v`` buffers in place from ``weight_orig``, and sets ``weight``), with Adam."""
    net = convnet()
    for i in (0, 2, 5):
        nn.utils.spectral_norm(net[i])
    model = ctx.ddp(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.0, 0.9))
    ctx.attach(model, opt)

    def after(step):
        if step % 2 == 1:
            model.eval()
            with torch.no_grad():
                ctx.record("eval", model(ctx.images(1000)[0]))
            model.train()
    plain_loop(ctx, model, opt, after_step=after)


@idiom("to_float64_midrun")
def _to_float64_midrun(ctx: Ctx):
    """``model.to(torch.float64)`` before the forward of iteration 3 (the parameters' dtype changed under a DDP built
    over float32 ones), the batch cast to match. Plain DDP silently stops all-reducing from there (the ranks end
    5-47% apart): every mode must end equal to it rank by rank."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        if step == 3:
            model.to(torch.float64)
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())

@idiom("update_bn_live_model")
def _update_bn_live_model(ctx: Ctx):
    """SWA's ``torch.optim.swa_utils.update_bn`` over a few batches run on the live DDP model itself (its BatchNorm
    statistics reset and recomputed by forwards under ``no_grad``, in train mode) right after step() of
    iterations 3 and 7, then an eval forward."""
    model = ctx.ddp(convnet(batchnorm=True))
    opt = sgd(model.parameters())
    ctx.attach(model, opt)

    def after(step):
        if step % 4 == 3:
            torch.optim.swa_utils.update_bn([ctx.images(500 + i)[0] for i in range(3)], model)
            model.eval()
            with torch.no_grad():
                ctx.record("eval", model(ctx.images(1000)[0]))
            model.train()
    plain_loop(ctx, model, opt, after_step=after)


@idiom("manual_grad_all_reduce_late")
def _manual_grad_all_reduce_late(ctx: Ctx):
    """From iteration 3 on, code ported from a loop without DDP all-reduces the gradients again by hand between
    backward() and step() (``dist.all_reduce(p.grad)``, ``p.grad /= world``), and logs a gradient norm."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= 3:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world
            ctx.record("grad_norm", model.module[7].weight.grad.norm())
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())

class CosineHeadNet(nn.Module):
    """A backbone returning embeddings and a cosine-classifier head whose weight the LOSS code uses (ArcFace/CosFace
    style: ``F.linear(F.normalize(emb), F.normalize(model.module.head.weight))``); ``head``'s forward never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10, bias=False)

    def forward(self, x):
        return self.backbone(x)


@idiom("cosine_head_in_loss")
def _cosine_head_in_loss(ctx: Ctx):
    """A cosine-classifier head (ArcFace/CosFace style) whose weight only the loss code uses, outside the DDP
    forward, through ``model.module.head.weight``: the probe sees it get a gradient with no forward of its module."""
    model = ctx.ddp(CosineHeadNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        emb = model(x)
        logits = 16.0 * F.linear(F.normalize(emb), F.normalize(model.module.head.weight))
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


# -- session 12 ---------------------------------------------------------------------------------------------------
@idiom("iterations_on_pool_threads")
def _iterations_on_pool_threads(ctx: Ctx):
    """Iterations run as tasks of two thread-pool workers in turn (both alive): forward, backward, a logged gradient
    norm (from the 5th on), ``step()`` and an EMA of the weights on one thread, the next iteration on the other; then
    the handle closed on a third thread and two more iterations on the main thread. Until 2026-11-28 the guard and
    the gradient watch stayed on the first worker's stack: the other's EMA read the weights before their update and
    its logged norm this rank's own gradients, silently; a close() on another thread left them there and torch's
    ``DisableTorchFunction`` wrapped."""
    import concurrent.futures

    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]

    def iteration(step):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step >= 4:  # (after the probe: a read there sends the job to hook mode)
            ctx.record("grad_norm", torch.stack([p.grad.norm() for p in model.parameters()]).norm())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, model.parameters(), strict=True):
                e.mul_(0.9).add_(p.detach(), alpha=0.1)
        ctx.record("loss", loss.item())
        ctx.record("ema", torch.cat([e.flatten() for e in ema]).norm())

    with concurrent.futures.ThreadPoolExecutor(1) as one, concurrent.futures.ThreadPoolExecutor(1) as two:
        for step in range(ctx.steps):
            (one, two)[step % 2].submit(iteration, step).result()
    if ctx.handle is not None:
        closing = threading.Thread(target=ctx.handle.close)
        closing.start()
        closing.join()
    for step in range(ctx.steps, ctx.steps + 2):
        iteration(step)


# -- session 13 (loops10) -------------------------------------------------------------------------------------------
@idiom("maml_double_backward")
def _maml_double_backward(ctx: Ctx):
    """MAML-like: an inner step by ``torch.autograd.grad(..., create_graph=True)`` on the parameters through the DDP
    forward, the outer loss through ``torch.func.functional_call(model.module, fast_weights)``, its backward
    (double backward through the inner gradients) synchronized by DDP, Adam. Its path: the shim's gradient hooks on
    the parameters fire in ``autograd.grad`` too, a backward DDP does not synchronize (exact, overlap mode)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    names = [n for n, _ in model.module.named_parameters()]
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        xq, yq = ctx.images(step, micro=1)
        params = list(model.module.parameters())
        inner = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(inner, params, create_graph=True)
        fast = {n: p - 0.1 * g for n, p, g in zip(names, params, grads, strict=True)}
        outer = F.cross_entropy(torch.func.functional_call(model.module, fast, (xq,)), yq)
        outer.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", outer.item())


@idiom("data_reinit_alias")
def _data_reinit_alias(ctx: Ctx):
    """The head re-initialised mid-run by ``p.data = fresh`` right after step() (new storage), its momentum dropped;
    an alias ``head.weight.data`` taken then and logged after every later step(). Its path: the guard's storage spans
    of a parameter whose storage changed after attach (the alias's use applies the pending update; exact, overlap)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    alias = []

    def after(step):
        head = model.module[-1]
        if step == 3:
            g = torch.Generator().manual_seed(7)
            head.weight.data = torch.randn(head.weight.shape, generator=g).mul_(0.01).to(ctx.device)
            opt.state.pop(head.weight, None)
            alias.append(head.weight.data)
        elif alias:
            ctx.record("alias_norm", alias[0].norm().item())
    plain_loop(ctx, model, opt, after_step=after)


@idiom("grad_penalty_params_late")
def _grad_penalty_params_late(ctx: Ctx):
    """A gradient-norm penalty on the parameters switched on after a warm-up (from iteration 3):
    ``torch.autograd.grad(loss, params, create_graph=True)``, then ``(loss + penalty).backward()``; ``zero_grad``
    alternating ``set_to_none`` True and False. Its path: that non-synchronized backward first seen after the probe
    (exact, overlap mode)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        if step >= 3:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + 0.1 * sum(g.pow(2).sum() for g in grads)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ctx.record("loss", loss.item())


@idiom("freeze_without_find_unused")
def _freeze_without_find_unused(ctx: Ctx):
    """The first conv frozen after the 4th step() with DDP built without find_unused_parameters: the next backward
    never finishes DDP's reduction (its last bucket is never ready), DDP's step takes each rank's own gradients and
    DDP raises at the forward after. The loop logs a gradient norm before that step and catches the error (an
    emergency checkpoint): the norm and the parameters then are compared. Until 2026-11-28 overlap mode stepped on
    the averages of the buckets that were ready, and the norm read them: 2.5e-3 off, silently."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    try:
        for step in range(ctx.steps):
            x, y = ctx.images(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if step >= 4:  # (after the probe) a gradient norm logged: DDP's .grad is this rank's own here
                ctx.record("grad_norm", torch.stack([p.grad.norm() for p in model.parameters()
                                                     if p.grad is not None]).norm())
            opt.step()
            if step == 3:
                model.module[0].requires_grad_(False)
            opt.zero_grad(set_to_none=False)  # (the .grad tensors stay: the read is of those DDP wrote)
            ctx.record("loss", loss.item())
    except RuntimeError as exc:
        assert "finished reduction" in str(exc), exc
        ctx.record("raised", 1)


# -- session 14 (loops11) -------------------------------------------------------------------------------------------
@idiom("bf16_parameters")
def _bf16_parameters(ctx: Ctx):
    """A model trained in bf16 (``model.to(torch.bfloat16)`` before DDP, no autocast: its gradients, DDP's buckets and
    their all-reduces are bf16), SGD with momentum. Its path: a 16-bit bucket at 3 ranks goes uncut (gloo sums each
    element in an order set by its place in the all-reduced buffer; until 2026-11-28 the shim's pieces left each
    step's averaged gradient a bf16 rounding off DDP's, 1.1e-2 relative after 8 steps at 3 ranks, silently)."""
    torch.manual_seed(1234)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = ctx.ddp(net.to(torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


# torch.optim's other per-parameter classes (shim.overlap.PER_PARAMETER_OPTIMIZERS), each with options that keep more
# per-parameter state, in both implementations (single-tensor and foreach)
OPTIMIZER_FAMILY = (("Adagrad", {"lr": 0.01, "lr_decay": 0.01, "weight_decay": 1e-3}),
                    ("Adadelta", {"lr": 1.0, "weight_decay": 1e-3}),
                    ("Adamax", {"lr": 2e-3, "weight_decay": 1e-3}),
                    ("ASGD", {"lr": 0.05, "t0": 2, "weight_decay": 1e-3}),
                    ("NAdam", {"lr": 2e-3, "decoupled_weight_decay": True, "weight_decay": 1e-2}),
                    ("RAdam", {"lr": 2e-3, "weight_decay": 1e-3}),
                    ("RMSprop", {"lr": 5e-4, "centered": True, "momentum": 0.9}),
                    ("Rprop", {"lr": 1e-3}))


@idiom("optimizer_family")
def _optimizer_family(ctx: Ctx):
    """One model per optimizer of ``OPTIMIZER_FAMILY`` (foreach on every other one), trained one after the other,
    each attached with its optimizer and closed after its loop; every model's final parameters are compared. Its path:
    overlap mode's deferred step over subsets of the parameters for each class it declares per-parameter (until
    2026-11-28 only SGD, Adam, AdamW and Adafactor were run by any test; all exact then)."""
    for i, (name, kw) in enumerate(OPTIMIZER_FAMILY):
        model = ctx.ddp(convnet())
        opt = getattr(torch.optim, name)(model.parameters(), **dict(kw, foreach=i % 2 == 1))
        last = i == len(OPTIMIZER_FAMILY) - 1
        (ctx.attach if last else ctx.attach_other)(model, opt)  # (the last one's handle: the cell's stats)
        for step in range(ctx.steps):
            x, y = ctx.images(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ctx.record(f"{name}_loss", loss.item())
        handle = ctx.handle if last else (ctx.others[-1] if ctx.others else None)
        if handle is not None and not last:
            mode = handle.stats()["mode"]
            assert mode == ("overlap" if ctx.mode == "overlap" else "hook"), (name, mode, handle.stats()["mode_reason"])
            handle.close()
        ctx.record(f"{name}_params", nn.utils.parameters_to_vector(model.parameters()))


# -- review 4 (loops users write that the matrix did not hold) ---------------------------------------------------
@idiom("sgd_mixed_dtypes")
def _sgd_mixed_dtypes(ctx: Ctx):
    """An fp32 layer and a bf16 one in one DDP model (a bucket per dtype), SGD with momentum (per parameter)."""
    model = ctx.ddp(MixedDtypes())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.vectors)


@idiom("requires_grad_off_eval")
def _requires_grad_off_eval(ctx: Ctx):
    """An evaluation pass with the whole model's ``requires_grad_(False)`` (no ``no_grad``) after some step()s,
    ``requires_grad_(True)`` after it."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def validate(step):
        if step % 3 == 1:
            model.requires_grad_(False)
            model.eval()
            ctx.record("eval_out", model(x_eval))
            model.train()
            model.requires_grad_(True)
    plain_loop(ctx, model, opt, after_step=validate)


@idiom("module_eval_all_ranks")
def _module_eval_all_ranks(ctx: Ctx):
    """Validation through ``model.module`` (bypassing DDP) on every rank after every other step(), under no_grad."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def validate(step):
        if step % 2 == 0:
            with torch.no_grad():
                ctx.record("eval_out", model.module(x_eval))
    plain_loop(ctx, model, opt, after_step=validate)


@idiom("fused_sgd")
def _fused_sgd(ctx: Ctx):
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, fused=True)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("sgd_closure")
def _sgd_closure(ctx: Ctx):
    """``optimizer.step(closure)`` with SGD: the closure zeroes, forwards and backwards."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    def closure_for(x, y):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return closure
    for step in range(ctx.steps):
        loss = opt.step(closure_for(*ctx.images(step)))
        ctx.record("loss", loss.item())


@idiom("broadcast_buffers_off")
def _broadcast_buffers_off(ctx: Ctx):
    """BatchNorm with ``broadcast_buffers=False`` (each rank keeps its own running statistics)."""
    model = ctx.ddp(convnet(batchnorm=True), broadcast_buffers=False)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("tensor_lr_scheduler")
def _tensor_lr_scheduler(ctx: Ctx):
    """Adam with a tensor learning rate (as torch's tutorial on compiled optimizers has it) and an LR scheduler
    stepped after step(): the scheduler writes the new rate into that tensor in place (``fill_``)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(5e-3), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    ctx.attach(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 3 * s))
    plain_loop(ctx, model, opt, sched=sched)

class ViTish(nn.Module):
    """Parameters on modules whose forward never runs: a position embedding on the root, per-block scales in an
    ``nn.ParameterList``, an ``nn.MultiheadAttention`` (its out_proj's weight used functionally), dropout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(50, 32, max_norm=1.0)
        self.pos = nn.Parameter(torch.randn(1, 4, 32) * 0.02)
        self.attn = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(32)) for _ in range(2)])
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        h = h + self.scales[0] * self.attn(h, h, h, need_weights=False)[0]
        h = h + self.scales[1] * self.mlp(h)
        return self.head(h.mean(1))


@idiom("vit_like")
def _vit_like(ctx: Ctx):
    model = ctx.ddp(ViTish())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    torch.manual_seed(7 + ctx.rank)  # dropout's generator, seeded before attach (which must not draw from it)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.tokens)


@idiom("transformer_train")
def _transformer_train(ctx: Ctx):
    model = ctx.ddp(TinyTransformer())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.tokens)


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0][:, -1])


@idiom("lstm")
def _lstm(ctx: Ctx):
    model = ctx.ddp(LSTMNet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, batch=ctx.tokens)


@idiom("weight_norm_legacy")
def _weight_norm_legacy(ctx: Ctx):
    net = convnet()
    net[5] = nn.utils.weight_norm(net[5])
    net[7] = nn.utils.weight_norm(net[7])
    model = ctx.ddp(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("zero_grad_after_forward")
def _zero_grad_after_forward(ctx: Ctx):
    """zero_grad() between the forward and backward(), a branch used on some steps (find_unused_parameters)."""
    net = Branchy()
    model = ctx.ddp(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=step % 3 == 1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.record("loss", loss.item())

@idiom("find_unused_zero_grad_keep")
def _find_unused_zero_grad_keep(ctx: Ctx):
    """find_unused_parameters=True, a branch used on some steps only (by every rank, or by rank 0 alone), gradients
    zeroed with set_to_none=False (kept as zeros): weight decay and momentum move the unused branch under DDP."""
    model = ctx.ddp(Branchy(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=step % 3 == 1 or (step == 4 and ctx.rank == 0)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        ctx.record("loss", loss.item())


def eval_with_grad(ctx: Ctx, find_unused: bool):
    """Validation that forgot ``torch.no_grad()``: ``model.eval(); model(x)`` with autograd on and no backward after
    it, every other iteration right after step() (BatchNorm: eval uses the running statistics)."""
    model = ctx.ddp(convnet(batchnorm=True), find_unused_parameters=find_unused)
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def validate(step):
        if step % 2 == 0:
            model.eval()
            out = model(x_eval)
            ctx.record("eval_out", out)
            model.train()
    plain_loop(ctx, model, opt, after_step=validate)


idiom("eval_with_grad")(functools.partial(eval_with_grad, find_unused=False))
idiom("eval_with_grad_find_unused")(functools.partial(eval_with_grad, find_unused=True))

@idiom("forward_without_backward")
def _forward_without_backward(ctx: Ctx):
    """A forward in training mode with autograd on whose output is only logged (no backward), right after step()
    every other iteration (DDP without find_unused_parameters allows it)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    x_eval = ctx.images(10_000)[0]

    def log(step):
        if step % 2 == 0:
            ctx.record("eval_out", model(x_eval))
    plain_loop(ctx, model, opt, after_step=log)

def dino_clip(model, clip: float) -> None:
    """DINO's ``clip_gradients``: each parameter's gradient clipped on its own norm, through ``.grad.data``."""
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)


def dino_loop(ctx: Ctx, start: int, cancel: bool = True):
    """DINO's loop (facebookresearch/dino): per-parameter clipping through ``.grad.data`` from iteration ``start``
    on, the last layer's gradients dropped (``p.grad = None``) in the first iterations, and a momentum teacher
    updated through ``.data`` after step() (``param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)``)."""
    model = ctx.ddp(convnet())
    teacher = copy.deepcopy(model.module).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.04)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        with torch.no_grad():
            target = F.softmax(teacher(x), -1)
        loss = F.cross_entropy(model(x), y) + F.cross_entropy(model(x), target)
        opt.zero_grad()
        loss.backward()
        if step >= start:
            dino_clip(model, 0.05)
        if cancel and step < 2:
            for n, p in model.module.named_parameters():
                if n.startswith("7."):
                    p.grad = None
        opt.step()
        with torch.no_grad():
            for param_q, param_k in zip(model.module.parameters(), teacher.parameters(), strict=True):
                param_k.data.mul_(0.99).add_((1 - 0.99) * param_q.detach().data)
        ctx.record("loss", loss.item())
    ctx.record("teacher", nn.utils.parameters_to_vector(teacher.parameters()))


idiom("dino_clip")(functools.partial(dino_loop, start=0))
idiom("dino_clip_late")(functools.partial(dino_loop, start=3, cancel=False))

@idiom("tensor_betas_in_place")
def _tensor_betas_in_place(ctx: Ctx):
    """Adam with tensor betas (no recompilation of a compiled step when they change) whose first beta a momentum
    schedule of the user's writes in place (``group['betas'][0].fill_(...)``) right after step(). Until 2026-11-28
    overlap mode's stamp at step() copied a tensor directly in a group but not one inside a tuple, so the deferred
    step took the beta written after step(): 0.3 relative off DDP after 8 steps at 2 ranks, silently."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(5e-3), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    ctx.attach(model, opt)

    def momentum_schedule(step):
        for g in opt.param_groups:
            g["betas"][0].fill_(0.5 + 0.4 * step / ctx.steps)
    plain_loop(ctx, model, opt, after_step=momentum_schedule)

@idiom("checkpoint_reentrant_no_static")
def _checkpoint_reentrant_no_static(ctx: Ctx):
    """Reentrant checkpointing (Transformers' default until 4.35) in a DDP without static_graph: each parameter is
    used once per backward, which DDP allows."""
    model = ctx.ddp(CheckpointedReentrant())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)

def fused_scaler_loop(ctx: Ctx, warmup: int):
    """AdamW(fused=True) under a GradScaler from iteration ``warmup`` on: GradScaler hands a fused optimizer its
    scale (``optimizer.grad_scale``, ``found_inf``) and lets the fused step unscale, with no ``unscale_`` first."""
    dev = ctx.device.type
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, fused=True)
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 20, growth_interval=2)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        if step < warmup:
            plain = F.cross_entropy(model(x), y)
            plain.backward()
            opt.step()
            opt.zero_grad()
            ctx.record("loss", plain.item())
            continue
        with torch.autocast(dev, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ctx.record("loss", loss.float().item())
        ctx.record("scale", scale)


idiom("fused_adamw_grad_scaler")(functools.partial(fused_scaler_loop, warmup=0))
idiom("fused_adamw_grad_scaler_late")(functools.partial(fused_scaler_loop, warmup=3))


def data_clamp_loop(ctx: Ctx, start: int, assign: bool):
    """WGAN's weight clipping as its reference code has it: ``p.data.clamp_(-c, c)`` (or ``p.data = p.data.clamp(...)``)
    over every parameter right after step(), from iteration ``start`` on."""
    model = ctx.ddp(convnet())
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-4)
    ctx.attach(model, opt)

    def clamp(step):
        if step >= start:
            for p in model.parameters():
                if assign:
                    p.data = p.data.clamp(-CLAMP, CLAMP)
                else:
                    p.data.clamp_(-CLAMP, CLAMP)
    plain_loop(ctx, model, opt, after_step=clamp)


idiom("data_clamp_late")(functools.partial(data_clamp_loop, start=3, assign=False))
idiom("data_assign_clamp_late")(functools.partial(data_clamp_loop, start=3, assign=True))

@idiom("accumulate_via_module")
def _accumulate_via_module(ctx: Ctx):
    """Accumulation without ``no_sync``: the first micro-batches through ``model.module`` (bypassing DDP, so its
    backward is not synchronized), the last through the DDP model, whose backward all-reduces the sum."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        for micro in range(3):
            x, y = ctx.images(step, micro)
            loss = F.cross_entropy((model.module if micro < 2 else model)(x), y) / 3
            loss.backward()
            ctx.record("loss", loss.item())
        opt.step()
        opt.zero_grad()


@idiom("static_graph_unused")
def _static_graph_unused(ctx: Ctx):
    """static_graph=True over a model with a submodule never used (DDP finds it unused in the first iteration and
    leaves it out from then on) and a branch used in every iteration."""
    model = ctx.ddp(Branchy(), static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.vectors(step)
        loss = F.cross_entropy(model(x, use_branch=True), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


# -- review loops2 (2026-11-28): user-written optimizers and loops around the optimizer ----------------------------
class LARS(torch.optim.Optimizer):
    """LARS as timm and most code write it: an ``Optimizer`` subclass with its own ``step()``, a trust ratio per
    parameter (its weight norm over its gradient's), momentum in ``self.state``."""

    def __init__(self, params, lr=0.1, momentum=0.9, weight_decay=1e-4, eta=1e-3):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=g["weight_decay"])
                wn, gn = p.norm(), d.norm()
                d = d.mul(torch.where((wn > 0) & (gn > 0), g["eta"] * wn / gn, torch.ones_like(wn)))
                buf = self.state[p].setdefault("mu", torch.zeros_like(p))
                buf.mul_(g["momentum"]).add_(d)
                p.add_(buf, alpha=-g["lr"])

    @torch.no_grad()
    def decay_momentum(self, factor: float):
        """A user's method called between steps: the momenta scaled in place through ``self.state``."""
        for st in self.state.values():
            st["mu"].mul_(factor)


class CountingAdam(torch.optim.Optimizer):
    """Adam written by hand with its step count in the param group (``group["step"]``, as timm's Lamb keeps it):
    an int rebound each step, or a tensor incremented in place (``tensor_step``)."""

    def __init__(self, params, lr=2e-3, tensor_step=False):
        super().__init__(params, dict(lr=lr, step=torch.tensor(0.0) if tensor_step else 0))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            if isinstance(g["step"], torch.Tensor):
                g["step"] += 1
            else:
                g["step"] = g["step"] + 1
            t = float(g["step"])
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.addcdiv_(m / (1 - 0.9 ** t), (v / (1 - 0.999 ** t)).sqrt().add_(1e-8), value=-g["lr"])


def user_optimizer_loop(ctx: Ctx, make, declared: bool, decay: bool = False):
    """A user-written optimizer, given to ``attach`` as is (``declared``: with ``per_parameter_optimizer=True``);
    ``decay``: the momenta scaled through ``self.state`` after every other ``step()``."""
    model = ctx.ddp(convnet())
    opt = make(model.parameters())
    if ctx.mode == "ddp":
        pass
    elif declared:
        ctx.handle = shim.attach(model, optimizer=opt if ctx.mode == "overlap" else None, levels=ctx.args.levels,
                                 agent_socket=ctx.args.agent_socket, link_bps=ctx.args.link_bps,
                                 per_parameter_optimizer=True if ctx.mode == "overlap" else None)
    else:
        ctx.attach(model, opt)
    plain_loop(ctx, model, opt, after_step=(lambda s: opt.decay_momentum(0.5) if s % 2 else None) if decay else None)


idiom("lars_subclass")(functools.partial(user_optimizer_loop, make=LARS, declared=False))
idiom("lars_declared")(functools.partial(user_optimizer_loop, make=LARS, declared=True, decay=True))
idiom("group_step_counter_int")(functools.partial(user_optimizer_loop, make=CountingAdam, declared=True))
idiom("group_step_counter_tensor")(functools.partial(
    user_optimizer_loop, make=functools.partial(CountingAdam, tensor_step=True), declared=True))


class GlobalNormSGD(torch.optim.Optimizer):
    """Each update divided by the norm of ALL gradients (LAMB's ``max_grad_norm`` clipping, apex-style): not per
    parameter, whatever its author may declare."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads]))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (norm + 1e-6), alpha=-g["lr"])


class CallCountAdam(CountingAdam):
    """``CountingAdam`` with its step count kept as an attribute (``self.t``), advanced once per call of ``step()``."""

    def __init__(self, params, lr=2e-3):
        super().__init__(params, lr=lr)
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for g in self.param_groups:
            g["step"] = self.t - 1  # (CountingAdam's step advances it to self.t)
        return super().step(closure)


idiom("global_norm_declared")(functools.partial(user_optimizer_loop, make=GlobalNormSGD, declared=True))
idiom("call_count_declared")(functools.partial(user_optimizer_loop, make=CallCountAdam, declared=True))


@idiom("clip_later_declared")
def _clip_later_declared(ctx: Ctx):
    """``ClipAboveSGD`` declared per parameter, its ``max_norm`` lowered under the gradients' norm after the 3rd
    ``step()``: from then on its update of a parameter depends on all the others. The loop takes an iteration again
    when its forward raises the shim's error about it (the shim has then put DDP's step in place and gone on in hook
    mode); under DDP nothing raises."""
    model = ctx.ddp(convnet())
    opt = ClipAboveSGD(model.parameters(), lr=5e-2)
    if ctx.mode != "ddp":
        ctx.handle = shim.attach(model, optimizer=opt if ctx.mode == "overlap" else None, levels=ctx.args.levels,
                                 agent_socket=ctx.args.agent_socket, link_bps=ctx.args.link_bps,
                                 per_parameter_optimizer=True if ctx.mode == "overlap" else None)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        try:
            loss = F.cross_entropy(model(x), y)
        except RuntimeError as exc:  # (once, in overlap mode: the iteration after the clipping began)
            if "per_parameter_optimizer=True" not in str(exc):
                raise
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step == 2:
            opt.max_norm = CLIP_NORM
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("kept_exp_avg_in_place")
def _kept_exp_avg_in_place(ctx: Ctx):
    """Adam's first moments kept by the loop (references taken from ``opt.state`` after the first step) and scaled
    in place after every other later ``step()``, without going through ``opt.state`` again (the ``_foreach`` form
    from iteration 4 on)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    kept: list = []

    def damp(step):
        nonlocal kept
        if step == 0:
            kept = [opt.state[p]["exp_avg"] for p in model.parameters()]
        elif step % 2 == 0:
            if step < 4:
                for t in kept:
                    t.mul_(0.3)
            else:
                torch._foreach_mul_(kept, 0.3)
    plain_loop(ctx, model, opt, after_step=damp)


@idiom("plateau_allreduced_metric")
def _plateau_allreduced_metric(ctx: Ctx):
    """``ReduceLROnPlateau`` fed a validation loss all-reduced over the ranks (``dist.all_reduce``) after every
    ``step()``: eval mode, ``no_grad``, then ``sched.step(metric)``."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    ctx.attach(model, opt)

    def validate(step):
        model.eval()
        with torch.no_grad():
            vx, vy = ctx.images(1000 + step)
            metric = F.cross_entropy(model(vx), vy)
        model.train()
        dist.all_reduce(metric)
        sched.step(metric.item() / ctx.world)
        ctx.record("metric", metric.item())
    plain_loop(ctx, model, opt, after_step=validate)


@idiom("optimizer_in_backward")
def _optimizer_in_backward(ctx: Ctx):
    """The optimizer-in-backward pattern: one SGD per parameter stepped by a ``register_post_accumulate_grad_hook``
    (this rank's gradient, before DDP averages it), which then zeroes it; no optimizer for ``attach`` (hook mode)."""
    model = ctx.ddp(convnet())
    opts = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    ctx.attach(model, None)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ctx.record("loss", loss.item())


@idiom("step_every_batch_zero_every_3")
def _step_every_batch_zero_every_3(ctx: Ctx):
    """``step()`` after every batch, ``zero_grad()`` every 3rd, the backward synchronized only then (``no_sync``
    for the others): the steps between are each rank's own."""
    model = ctx.ddp(convnet())
    opt = sgd(model.parameters())
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        last = step % 3 == 2
        with contextlib.nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x), y) / 3
            loss.backward()
        opt.step()
        if last:
            opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("loss_per_rank_batch_size")
def _loss_per_rank_batch_size(ctx: Ctx):
    """Uneven batches without ``join`` (rank r has 16 - 5r samples), the loss summed and scaled by the all-reduced
    global batch size times the world size, so that DDP's average is the global mean."""
    model = ctx.ddp(convnet())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        n = 16 - 5 * ctx.rank
        total = torch.tensor(float(n))
        dist.all_reduce(total)
        loss = F.cross_entropy(model(x[:n]), y[:n], reduction="sum") * ctx.world / total
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


def dropout_mlp() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 64),
                         nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 10))


@idiom("manual_seed_in_loop")
def _manual_seed_in_loop(ctx: Ctx):
    """Dropout, ``torch.manual_seed`` reset at the top of every iteration (per rank and step) and after ``step()``."""
    model = ctx.ddp(dropout_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt, before_forward=lambda s: torch.manual_seed(77 + s + 1000 * ctx.rank),
               after_step=lambda s: torch.manual_seed(5 + s))


@idiom("module_backward_hooks")
def _module_backward_hooks(ctx: Ctx):
    """Module hooks of the user's that change gradients: ``register_full_backward_hook`` halving a layer's input
    gradient and ``register_full_backward_pre_hook`` doubling another's output gradient."""
    model = ctx.ddp(convnet())
    model.module[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    model.module[5].register_full_backward_pre_hook(lambda m, go: (go[0] * 2.0,))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ctx.attach(model, opt)
    plain_loop(ctx, model, opt)


@idiom("grow_model_reattach")
def _grow_model_reattach(ctx: Ctx):
    """A layer added after 4 steps: a new DDP over the old layers and the new one, its parameters added to the
    optimizer as a param group (SGD with momentum: the old momenta kept), the handle closed and attached again."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        if step == 4:
            torch.manual_seed(99)
            extra = nn.Linear(10, 10)
            if ctx.handle is not None:
                ctx.handle.close()
            model = ctx.ddp(nn.Sequential(*model.module, extra))
            opt.add_param_group({"params": extra.parameters()})
            ctx.attach(model, opt)
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())


@idiom("no_sync_forward_decides_late")
def _no_sync_forward_decides_late(ctx: Ctx):
    """From iteration 3 on, three micro-batches per step with ``no_sync()`` around the forward or the backward only:
    DDP decides at the forward whether a backward synchronizes, so the first (forward under it, backward outside) and
    the third are local, and the second (forward outside, backward under it) is synchronized, its average then added
    to by the third's gradient before ``step()``."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        for micro in range(3 if step >= WARMUP else 1):
            x, y = ctx.images(step, micro)
            local = step >= WARMUP and micro != 1
            with model.no_sync() if local else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / (3 if step >= WARMUP else 1)
            with model.no_sync() if step >= WARMUP and micro == 1 else contextlib.nullcontext():
                loss.backward()
            ctx.record("loss", loss.item())
        opt.step()
        opt.zero_grad()


@idiom("optimizer_load_new_lr_before_step")
def _optimizer_load_new_lr_before_step(ctx: Ctx):
    """SGD with momentum; the optimizer's ``state_dict()`` kept (deep copy) at iteration 2 with a new learning rate
    and momentum written into its param group, and loaded between ``backward()`` and ``step()`` at iteration 5 (a
    resume from an edited checkpoint: ``load_state_dict`` replaces the param group dicts that ``step()`` reads)."""
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    kept = {}
    for step in range(ctx.steps):
        x, y = ctx.images(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 2:
            kept["opt"] = copy.deepcopy(opt.state_dict())
            kept["opt"]["param_groups"][0].update(lr=0.2, momentum=0.5)
        if step == 5:
            opt.load_state_dict(kept["opt"])
        opt.step()
        opt.zero_grad()
        ctx.record("loss", loss.item())
        ctx.record("lr", opt.param_groups[0]["lr"])


@idiom("uneven_accumulation_per_rank")
def _uneven_accumulation_per_rank(ctx: Ctx):
    """Accumulation with ``no_sync()`` over a number of micro-batches that differs between the ranks and the steps
    (1 to 3: ``1 + (step + rank) % 3``, as when each rank accumulates up to a token budget): under DDP only the
    synchronized backward, one per step on every rank, has to match across the ranks."""
    model = ctx.ddp(convnet())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(ctx.steps):
        k = 1 + (step + ctx.rank) % 3
        for micro in range(k):
            x, y = ctx.images(step, micro)
            with model.no_sync() if micro < k - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x), y) / k
                loss.backward()
            ctx.record("loss", loss.item())
        opt.step()
        opt.zero_grad()


@idiom("step_post_hook_late", where="before_forward")
@idiom("step_pre_hook_late", where="before_step")
@idiom("global_step_hook_late", where="after_step")
def _step_hooks_late(ctx: Ctx, where: str):
    """Step hooks registered mid-run (a callback that starts an EMA, a gradient-scale warm-up, a logging library's
    global hook), once overlap mode has begun: at iteration 4 before the forward, an EMA in a post-hook
    (``step_post_hook_late``); at iteration 4 between ``backward()`` and ``step()``, a pre-hook halving every
    gradient (``step_pre_hook_late``); at iteration 3 right after ``step()``, a global post-hook
    (``register_optimizer_step_post_hook``) logging a weight norm (``global_step_hook_late``). Under DDP a hook runs
    from the first ``step()`` after its registration; the EMA and the logged norms are compared too."""
    import torch.optim.optimizer as optim
    model = ctx.ddp(convnet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt)
    ema = [p.detach().clone() for p in model.parameters()]

    def post(*_args):
        with torch.no_grad():
            for e, p in zip(ema, model.parameters(), strict=True):
                e.mul_(0.8).add_(p, alpha=0.2)

    def pre(optimizer, *_args):
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)

    def logged(*_args):
        ctx.record("norm", model.module[0].weight.norm())

    removable = None
    try:
        for step in range(ctx.steps):
            if where == "before_forward" and step == 4:
                opt.register_step_post_hook(post)
            x, y = ctx.images(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if where == "before_step" and step == 4:
                opt.register_step_pre_hook(pre)
            opt.step()
            if where == "after_step" and step == 3:
                removable = optim.register_optimizer_step_post_hook(logged)
            opt.zero_grad()
            ctx.record("loss", loss.item())
    finally:
        if removable is not None:  # (a global hook: not into the next cells)
            removable.remove()
    for e in ema:
        ctx.record("ema", e)


MAIN_IDIOMS = [name for name in IDIOMS if name != "checkpoint_resume"]


# -- the driver -------------------------------------------------------------------------------------------------
def run_cell(name: str, mode: str, args, rank: int, world: int, device: torch.device) -> None:
    ctx = Ctx(mode, rank, world, device, args.steps, args)
    error, stats = None, {}
    t0 = time.perf_counter()
    try:
        IDIOMS[name](ctx)
    except Exception:  # noqa: BLE001 - a failing cell is a result; the next cells still run
        error = traceback.format_exc()
    if ctx.handle is not None:
        try:
            stats = ctx.handle.stats()
        except Exception:  # noqa: BLE001
            stats = {"stats_error": traceback.format_exc()}
    for handle in [h for h in (ctx.handle, *ctx.others) if h is not None]:
        try:
            handle.close()
        except Exception:  # noqa: BLE001
            error = (error or "") + "handle.close() raised:\n" + traceback.format_exc()
    seconds = time.perf_counter() - t0
    state = {}
    if ctx.model is not None:
        try:
            state = {k: v.detach().cpu().clone() for k, v in ctx.model.module.state_dict().items()}
        except Exception:  # noqa: BLE001
            error = (error or "") + "state_dict() raised:\n" + traceback.format_exc()
    errors: list = [None] * world
    dist.all_gather_object(errors, error)  # every rank knows whether the cell failed somewhere
    for handle in [h for h in (ctx.handle, *ctx.others) if h is not None and not args.keep_groups]:
        for group in getattr(getattr(handle, "state", None), "groups", None) or []:  # each attach made `levels`
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
    base = os.path.join(args.out, f"{name}-{mode}-{rank}")
    torch.save({"state": state, "extras": {k: torch.tensor(v, dtype=torch.float64) for k, v in ctx.extras.items()}},
               base + ".pt")
    with open(base + ".json", "w") as fh:
        json.dump({"stats": stats, "error": error, "errors": errors, "seconds": seconds, "world": world,
                   "device": str(device)}, fh, default=str)
    if rank == 0:
        failed = [r for r, e in enumerate(errors) if e]
        line = f"[conformance] {name}-{mode}-{world}: {seconds:.2f}s "
        line += f"ERROR on ranks {failed}: {errors[failed[0]].strip().splitlines()[-1]}" if failed else "done"
        print(line, flush=True)
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for the cells' results (and the checkpoints)")
    p.add_argument("--idioms", default=None, help="comma-separated idioms (default: all but checkpoint_resume; "
                                                  "with --resume: checkpoint_resume)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--resume", action="store_true", help="the fresh-process half of the checkpoint idiom")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, default=0.01)
    p.add_argument("--link-bps", type=float, default=2e8)
    p.add_argument("--agent-socket", default="/nonexistent/tensorlane.sock")
    p.add_argument("--timeout", type=float, default=180, help="seconds a collective may hang before it fails")
    p.add_argument("--keep-groups", action="store_true", help="do not destroy the shim's groups after a cell")
    p.add_argument("--list", action="store_true", help="print the idioms and exit")
    args = p.parse_args()
    if args.list:
        print("\n".join(IDIOMS))
        return 0
    if not args.out:
        p.error("--out is required")
    names = (args.idioms.split(",") if args.idioms else (["checkpoint_resume"] if args.resume else MAIN_IDIOMS))
    unknown = [n for n in names if n not in IDIOMS]
    modes = args.modes.split(",")
    if unknown or any(m not in MODES for m in modes):
        p.error(f"unknown idiom or mode: {unknown or modes}; idioms: {', '.join(IDIOMS)}")
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*agent.*")  # the absent agent: one warning per attach
    timeout = datetime.timedelta(seconds=args.timeout)
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout  # the shim's new_group() calls take the default timeout: bound them too
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    t0 = time.perf_counter()
    for name in names:
        for mode in modes:
            run_cell(name, mode, args, rank, world, device)
    if rank == 0:
        print(f"[conformance] {len(names) * len(modes)} cells on {world} ranks in {time.perf_counter() - t0:.1f}s",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
