"""Frameworks that own DDP use the shim (docs/frameworks.md): PyTorch Lightning and Hugging Face Accelerate, the
real libraries (the `frameworks` extra), 2 ranks on the namespace testbed with an agent on each host; Lightning
Fabric, the Transformers ``Trainer``, Lightning's tuner and the Lightning and Accelerate loops around the step
(accumulation, clipping, bf16, manual optimization, resuming; marked ``torch``, not ``netns``): 2 ranks under
torchrun on loopback, no agent (the shim warns and trains), final parameters compared with the same run without
the shim.

Each worker (tests/framework_workers/) trains the same small model once without the shim and once with it, in
one process per host namespace, gloo over eth0. The test checks that both runs end with the same parameters,
that the flows of every level were registered with each host's agent while training (the workers ask their
agent before closing the shim) and withdrawn after, and that the shim's counters show all-reduces on every level.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from bench.agents import running_agents
from testbed import Testbed

pytestmark = pytest.mark.concurrent  # netns tests here run beside another file's (make test; pyproject markers)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "framework_workers")
LEVELS = 3


def run_workers(tb, agents, script: str, out, port: int, args: list[str], extra_env=None,
                timeout: float = 150) -> list[str]:
    """Run ``script`` once per host namespace (rank = host index - 1) and wait; return the outputs.

    Fails with both outputs when a worker exits non-zero or runs past ``timeout`` (the others are killed)."""
    procs = []
    world = len(tb.hosts)
    try:
        for rank, host in enumerate(tb.hosts):
            env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                       MASTER_ADDR=tb.host(1).ip, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       NODE_RANK=str(rank), **(extra_env or {}))
            for var in ("TORCHELASTIC_RUN_ID", "TENSORLANE_JOB", "TENSORLANE_DISABLE"):
                env.pop(var, None)
            procs.append(host.popen([sys.executable, os.path.join(WORKERS, script), "--out", str(out),
                                     "--agent-socket", agents[host.index].socket, *args],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outputs = [q.communicate()[0] for q in procs]
                pytest.fail(f"{script} ran past {timeout} s:\n" + "\n---\n".join(o[-3000:] for o in outputs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if [p.returncode for p in procs] != [0] * world:
        pytest.fail(f"{script} exited {[p.returncode for p in procs]}:\n"
                    + "\n---\n".join(o[-4000:] for o in outputs))
    return outputs


def load(out, variant: str, rank: int) -> tuple[dict, dict]:
    import torch

    return (torch.load(out / f"{variant}-{rank}.pt"),
            json.loads((out / f"{variant}-{rank}.json").read_text()))


def rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


def check_shim_record(tb, rank: int, record: dict, job: str, agent_log: str = "") -> None:
    """Every level's flows were registered with this host's agent under ``job`` (this host -> the other),
    withdrawn after close; the shim counted all-reduces on every level. ``agent_log``: the tail of that agent's log,
    for the message."""
    host, other = tb.host(rank + 1), tb.host(2 - rank)
    flows = record["flows_during"]
    assert {f["level"] for f in flows} == set(range(LEVELS)), (  # (a string: pytest shortens a tuple's repr)
        f"{job} rank {rank}: flows {flows}; polls unanswered {record.get('flows_poll_errors')}; the agent's flows "
        f"{record.get('agent_flows_all')}; the shim's flows {record.get('shim_flows')}; the process's connections "
        f"{record.get('own_flows')}; stats {record['stats']}; the agent's log:\n{agent_log}")
    assert all(f["src"] == host.ip and f["dst"] == other.ip for f in flows), flows
    assert record["flows_after_close"] == [], (job, rank, record["flows_after_close"])
    stats = record["stats"]
    assert sorted(int(k) for k in stats["flows"]) == list(range(LEVELS)), stats["flows"]
    assert all(n >= 1 for n in stats["flows"].values()), stats["flows"]
    assert [lv["level"] for lv in stats["levels"]] == list(range(LEVELS)), stats["levels"]
    assert all(lv["allreduces"] >= 1 and lv["bytes"] > 0 for lv in stats["levels"]), stats["levels"]
    assert stats["agent"]["registrations"] >= 1 and stats["agent"]["failures"] == 0, stats["agent"]


@pytest.mark.netns
def test_lightning_ddp_strategy_with_shim_hook(tmp_path):
    job = "fw-lightning"
    variants = ("shim", "shim-learn")  # comm_state(module=model); comm_state() learning levels from the buckets
    with Testbed(hosts=2, rate="200mbit", name="fwl") as tb, \
            running_agents(tb, hosts=[1, 2], levels=LEVELS) as agents:
        outs = run_workers(tb, agents, "lightning_worker.py", tmp_path, 29710,
                           ["--variants", ",".join(("plain", *variants)), "--steps", "6", "--levels", str(LEVELS),
                            "--job", job])
        logs = [f"{agents[i].stderr_tail(2000)}\nthe worker's output:\n{outs[i - 1][-2000:]}" for i in (1, 2)]
        for i in (1, 2):
            with agents[i].client() as c:
                assert [f for f in c.list()["flows"] if f["job"].startswith(job)] == []
    for rank in (0, 1):
        plain, plain_rec = load(tmp_path, "plain", rank)
        assert plain_rec["global_step"] == 6 and plain_rec["world_size"] == 2, plain_rec
        assert plain_rec["initial_changed"]  # it trained
        assert min(plain_rec["grad_norms"]) > 0.05, plain_rec["grad_norms"]  # gradient_clip_val clipped every step
        assert len(set(plain_rec["lrs"])) == 3, plain_rec["lrs"]  # the step-interval scheduler ran
        for variant in variants:
            got, rec = load(tmp_path, variant, rank)
            assert rec["global_step"] == 6, rec
            assert (rec["grad_norms"], rec["lrs"]) == (plain_rec["grad_norms"], plain_rec["lrs"]), variant
            assert rel_diff(got, plain) == 0.0, variant  # bit for bit
            check_shim_record(tb, rank, rec, f"{job}-{variant}", logs[rank])
            assert rec["stats"]["mode"] == "hook"  # Lightning steps with a closure: hook mode only
    for variant in variants:
        assert rel_diff(load(tmp_path, variant, 1)[0], load(tmp_path, variant, 0)[0]) == 0.0


@pytest.mark.netns
def test_lightning_ddp_spawn_refused_clearly(tmp_path):
    """``DDPStrategy(start_method="spawn")`` pickles the Trainer with the shim's state for the processes it starts:
    the shim's own TypeError, naming ddp_spawn and the way out, before anything trains (one process, loopback: no
    testbed needed). In the same process: ``devices=1`` with the default strategy (no DDP) and ``CommHook`` kept
    trains as Lightning alone, with the shim's warning (until 2026-11-28 a bare AttributeError)."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29712", NODE_RANK="0")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TENSORLANE_JOB",
                "TENSORLANE_DISABLE"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, os.path.join(WORKERS, "lightning_worker.py"), "--out", str(tmp_path),
                           "--variants", "shim-spawn,plain-single,shim-single", "--nodes", "1", "--agent-socket",
                           "/nonexistent/tl.sock"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-4000:]
    _params, rec = load(tmp_path, "shim-spawn", 0)
    assert "tensorlane" in rec.get("error", "") and "ddp_spawn" in rec["error"], rec
    assert "start_method='popen'" in rec["error"], rec["error"]
    assert not rec["initial_changed"], rec
    plain, plain_rec = load(tmp_path, "plain-single", 0)
    single, single_rec = load(tmp_path, "shim-single", 0)
    assert "error" not in single_rec and single_rec["global_step"] == plain_rec["global_step"] > 0, single_rec
    assert single_rec["initial_changed"] and rel_diff(plain, single) == 0.0
    assert any("one process" in w and "nothing to prioritise" in w for w in single_rec["warnings"]), single_rec


WAIT_LEVELS_RANK = """
import gc, json, sys, time
import torch.distributed as dist
import common
from tensorlane.flows import flow_key, new_flows, own_flow_fds, own_tcp_flows
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
before = own_tcp_flows()
group = dist.new_group(backend="gloo")  # a shim level's group, as shim/groups.py _new_level_group makes it
dist.barrier(group=group)
key = flow_key(next(f for f in new_flows(before, own_tcp_flows()) if port not in (f["sport"], f["dport"])))

def agent_flows(socket, job, errors=None):  # the agent's view: its sweep keeps a flow while its socket is held
    if rank == 0:
        time.sleep(1.0)  # this rank is slowed down (a loaded machine): it looks after the other
    return [{"level": 0}] if key in own_flow_fds() else []

common.agent_flows = agent_flows
flows = common.wait_levels("agent.sock", "job", 1, timeout=1.0)
dist.destroy_process_group(group)  # the shim's close()
del group
gc.collect()
print(json.dumps(flows))
dist.destroy_process_group()
"""


@pytest.mark.torch
def test_wait_levels_returns_only_once_every_rank_has_looked(tmp_path):
    """``common.wait_levels`` is a collective: a rank that gets there first does not return, and so does not close the
    shim, until the other, slowed down, has seen its flows. Until 2026-11-29 it returned at once: its close destroyed
    the level groups, the slow rank's gloo closed its ends of those connections, its agent's sweep removed the
    job's flows as "sockets closed" and that rank found none (test_accelerate_prepare_then_attach and the Lightning
    test under load, about 3 runs in 60). Two ranks on loopback; each rank's agent is stood in for by whether the
    rank holds its level connection, established, at the time it is asked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((WORKERS, REPO)), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    procs = [subprocess.Popen([sys.executable, "-c", WAIT_LEVELS_RANK, str(rank), str(port)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        assert json.loads(out.strip().splitlines()[-1]) == [{"level": 0}], (rank, out[-3000:])


# variant -> the mode the shim must end in (overlap requested every time: shim.attach(model, optimizer))
ACCELERATE_MODES = {"basic": "overlap", "clip": "hook", "accum": "overlap", "accum_manual": "overlap",
                    "local_sgd": "overlap"}


@pytest.mark.netns
def test_accelerate_prepare_then_attach(tmp_path):
    job = "fw-acc"
    with Testbed(hosts=2, rate="200mbit", name="fwa") as tb, \
            running_agents(tb, hosts=[1, 2], levels=LEVELS) as agents:
        outs = run_workers(tb, agents, "accelerate_worker.py", tmp_path, 29711,
                           ["--variants", ",".join(ACCELERATE_MODES), "--levels", str(LEVELS), "--job", job])
        logs = [f"{agents[i].stderr_tail(2000)}\nthe worker's output:\n{outs[i - 1][-2000:]}" for i in (1, 2)]
        for i in (1, 2):
            with agents[i].client() as c:
                assert [f for f in c.list()["flows"] if f["job"].startswith(job)] == []
    for kind, mode in ACCELERATE_MODES.items():
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{kind}", rank)
            got, rec = load(tmp_path, f"shim-{kind}", rank)
            assert plain_rec["distributed_type"] == "MULTI_CPU" and plain_rec["num_processes"] == 2, plain_rec
            assert plain_rec["ddp"] == "DistributedDataParallel" and plain_rec["backend"] == "gloo", plain_rec
            assert plain_rec["steps"] == rec["steps"] == (3 if kind.startswith("accum") else 6), (plain_rec, rec)
            assert plain_rec["initial_changed"]  # it trained
            assert rel_diff(got, plain) == 0.0, kind  # bit for bit
            check_shim_record(tb, rank, rec, f"{job}-{kind}", logs[rank])
            stats = rec["stats"]
            assert stats["mode"] == mode, (kind, stats["mode"], stats.get("mode_reason"))
            if mode == "hook":
                assert "clip" in stats["mode_reason"], stats["mode_reason"]
            if mode == "overlap":  # accum_manual: the backwards after the first micro-batch of the 2 overlapped steps
                assert stats["overlap"]["averaged_unstepped"] == (2 if kind == "accum_manual" else 0), stats
            if kind == "clip":  # clipping was active (the norm of the averaged gradient, the same with the shim)
                assert min(plain_rec["grad_norms"]) > 0.05, plain_rec["grad_norms"]
                assert rec["grad_norms"] == pytest.approx(plain_rec["grad_norms"], rel=1e-5)
        if kind != "local_sgd":  # (its momentum buffers are each rank's own after the local steps, as under DDP)
            assert rel_diff(load(tmp_path, f"shim-{kind}", 1)[0], load(tmp_path, f"shim-{kind}", 0)[0]) == 0.0


def run_torchrun(script: str, out, args: list[str], timeout: float = 120) -> str:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT --out OUT ARGS`` on loopback (gloo), no agent; the output.
    Fails with the output when it exits non-zero or runs past ``timeout``."""
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TENSORLANE_AGENT_SOCKET=str(out / "no-agent.sock"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TENSORLANE_JOB", "TENSORLANE_DISABLE", "GLOO_SOCKET_IFNAME"):
        env.pop(var, None)
    try:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               os.path.join(WORKERS, script), "--out", str(out), *args], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} ran past {timeout} s:\n{(exc.stdout or '')[-4000:]}")
    if done.returncode != 0:
        pytest.fail(f"{script} exited {done.returncode}:\n{done.stdout[-6000:]}")
    return done.stdout


# variant -> the mode the shim must end in (shim.attach(model, opt) on what fabric.setup returns; "hook": no opt)
FABRIC_MODES = {"basic": "overlap", "clip": "hook", "accum": "overlap", "hook": "hook", "save": "overlap",
                "compiled": "overlap"}


@pytest.mark.torch
def test_fabric_setup_then_attach(tmp_path):
    """Lightning Fabric: ``shim.attach(model, opt)`` on the ``_FabricModule`` and ``_FabricOptimizer`` that
    ``fabric.setup`` returns; each loop equal to the same loop without the shim bit for bit (parameters, losses,
    the norms ``fabric.clip_gradients`` returns, momentum buffers), and ``fabric.save`` writes the same file; a DDP of
    a compiled module (``_reapply_compile=False``) too, and Fabric's compiled DDP model refused, naming that."""
    run_torchrun("fabric_worker.py", tmp_path, ["--variants", ",".join([*FABRIC_MODES, "compile_refused"]),
                                                "--levels", str(LEVELS)])
    for rank in (0, 1):  # fabric.setup(torch.compile(model)) compiles the DDP model: refused, naming the way out
        _params, rec = load(tmp_path, "shim-compile_refused", rank)
        assert rec["ddp"] == "OptimizedModule" and "torch.compile'd" in (rec["error"] or ""), rec
        assert "_reapply_compile=False" in rec["error"], rec["error"]
    for kind, mode in FABRIC_MODES.items():
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{kind}", rank)
            got, rec = load(tmp_path, f"shim-{kind}", rank)
            assert plain_rec["world_size"] == 2 and plain_rec["ddp"] == "DistributedDataParallel", plain_rec
            assert plain_rec["backend"] == "gloo" and plain_rec["initial_changed"], plain_rec
            assert plain_rec["steps"] == rec["steps"] == 6, (plain_rec, rec)
            assert rel_diff(got, plain) == 0.0, kind  # bit for bit
            for key in ("losses", "grad_norms", "optimizer_state", "micro_batches"):
                assert rec[key] == plain_rec[key], (kind, key)
            stats = rec["stats"]
            assert stats["mode"] == mode, (kind, stats["mode"], stats.get("mode_reason"))
            if kind == "clip":  # clipping was active; the shim fell back to hook mode, saying why
                assert min(plain_rec["grad_norms"]) > 0.05 and "clipping" in stats["mode_reason"], rec
            assert [lv["level"] for lv in stats["levels"]] == list(range(LEVELS)), stats["levels"]
            assert all(lv["allreduces"] >= 1 for lv in stats["levels"]), stats["levels"]
            if kind == "save":
                assert rec["resumed_at"] == 3, rec
            if kind == "compiled":  # _reapply_compile=False: DDP(compiled module)
                assert rec["module"] == "OptimizedModule", rec
        assert rel_diff(load(tmp_path, f"shim-{kind}", 1)[0], load(tmp_path, f"shim-{kind}", 0)[0]) == 0.0
    # fabric.save after step 3 while the shim's updates were pending: the same bytes as without the shim
    assert (tmp_path / "ckpt-shim.pt").read_bytes() == (tmp_path / "ckpt-plain.pt").read_bytes()


# variant -> how the shim is attached in the TrainerCallback and the mode it must end in
TRANSFORMERS_MODES = {"default": "hook", "clip": "hook", "noclip": "hook", "accum": "hook"}


@pytest.mark.torch
def test_transformers_trainer_callback_attach(tmp_path):
    """Hugging Face Transformers' ``Trainer``: a ``TrainerCallback`` attaches at ``on_train_begin`` to
    ``trainer.model_wrapped`` (Accelerate's DDP model), closes at ``on_train_end``; 8 steps equal to the same
    ``Trainer`` without the shim bit for bit (parameters, the logged losses, gradient norms and learning rates).
    Hook mode in every loop: given the optimizer, the shim falls back, since the Trainer runs ``clip_grad_norm_`` after
    every synchronized backward (for its logged norm even with ``max_grad_norm=0``). ``torch_compile=True`` is refused
    in the callback, naming it."""
    run_torchrun("transformers_worker.py", tmp_path, ["--variants", ",".join([*TRANSFORMERS_MODES, "compile_refused"]),
                                                      "--levels", str(LEVELS)])
    for rank in (0, 1):  # torch_compile=True: Accelerate compiles the DDP model; refused before the first step
        _params, rec = load(tmp_path, "shim-compile_refused", rank)
        assert rec["ddp"] == "OptimizedModule" and "torch_compile=False" in (rec["error"] or ""), rec
        assert rec["global_step"] == 0 and not rec["initial_changed"], rec
    for kind, mode in TRANSFORMERS_MODES.items():
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{kind}", rank)
            got, rec = load(tmp_path, f"shim-{kind}", rank)
            assert plain_rec["world_size"] == 2 and plain_rec["ddp"] == "DistributedDataParallel", plain_rec
            assert plain_rec["backend"] == "gloo" and plain_rec["initial_changed"], plain_rec
            assert plain_rec["global_step"] == rec["global_step"] == 8, (plain_rec, rec)
            assert rel_diff(got, plain) == 0.0, kind  # bit for bit
            for key in ("losses", "grad_norms", "lrs"):
                assert len(rec[key]) == 8 and rec[key] == plain_rec[key], (kind, key)
            stats = rec["stats"]
            assert stats["mode"] == mode, (kind, stats["mode"], stats.get("mode_reason"))
            if kind in ("clip", "noclip"):  # overlap asked for, refused by the probe with its reason
                assert "gradients were changed" in stats["mode_reason"], stats["mode_reason"]
            if kind == "clip":
                assert min(plain_rec["grad_norms"]) > 0.05, plain_rec["grad_norms"]  # clipping bit on every step
            assert [lv["level"] for lv in stats["levels"]] == list(range(LEVELS)), stats["levels"]
            assert all(lv["allreduces"] >= 1 for lv in stats["levels"]), stats["levels"]
        assert rel_diff(load(tmp_path, f"shim-{kind}", 1)[0], load(tmp_path, f"shim-{kind}", 0)[0]) == 0.0


@pytest.mark.torch
def test_lightning_lr_find_then_fit(tmp_path):
    """Lightning's learning-rate finder, ``Tuner(trainer).lr_find(model)`` and then ``trainer.fit(model)`` on the same
    Trainer: the tuner's own fit (trial steps, then its checkpoint restored) and the real fit's new DDP model. With
    the ``CommHook`` callback (CPU) the trial steps are plain DDP (the tuner ends its fit in ``on_fit_start``, before
    the callback registers), with ``comm_state(module=model)`` and with ``comm_state()`` learning its levels in the
    fit; with the hook registered by the strategy (as on CUDA) one ``comm_state()`` serves both DDP models, its levels
    learnt in the trial steps. Both end equal to the run without the shim bit for bit, with the
    same trial losses and suggested rate."""
    run_torchrun("lightning_tuner_worker.py", tmp_path, ["--variants", "lr_find,lr_find-learn,lr_find-cuda"])
    fit_steps = 3 * 6  # EPOCHS x batches per rank and epoch
    for variant, trials_via_shim in (("lr_find", False), ("lr_find-learn", False), ("lr_find-cuda", True)):
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{variant}", rank)
            got, rec = load(tmp_path, f"shim-{variant}", rank)
            assert plain_rec["world_size"] == 2 and plain_rec["global_step"] == rec["global_step"] == fit_steps, rec
            assert rel_diff(got, plain) == 0.0, variant  # bit for bit
            assert len(rec["trial_losses"]) == 16 and rec["trial_losses"] == plain_rec["trial_losses"], variant
            assert rec["suggested"] == plain_rec["suggested"] != 0.05, (rec["suggested"], plain_rec["suggested"])
            expected = fit_steps + (16 if trials_via_shim else 0)  # one bucket: one all-reduce per level and step
            # (lr_find-learn: every piece at the last level until the levels are learnt, in the fit's second step)
            least = fit_steps - (1 if variant == "lr_find-learn" else 0)
            assert rec["allreduces"][-1] == expected and min(rec["allreduces"]) >= least, rec["allreduces"]
            assert rec["hook_registered_by_callback"] == (not trials_via_shim), rec
        assert rel_diff(load(tmp_path, f"shim-{variant}", 1)[0], load(tmp_path, f"shim-{variant}", 0)[0]) == 0.0


@pytest.mark.torch
def test_lightning_comm_hook_refuses_a_strategy_without_ddp():
    """``CommHook`` on a multi-process strategy that does not wrap the module in DDP (FSDP, DeepSpeed, model
    parallel: GPU-only in Lightning 2.6, so its ``on_fit_start`` is called here with such a Trainer's two
    attributes it reads): the shim's TypeError naming DDPStrategy, before the first step (until 2026-11-28 a bare
    AttributeError, or FSDP's own ``register_comm_hook`` taking a hook that expects DDP's buckets)."""
    import types

    import torch.nn as nn

    import tensorlane.shim.lightning as shim_lightning
    from tensorlane import shim

    state = shim.comm_state(2)
    trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(model=nn.Linear(2, 2)))
    try:
        with pytest.raises(TypeError, match="needs Lightning's DDP strategy.*Linear"):
            shim_lightning.CommHook(state).on_fit_start(trainer, None)
    finally:
        state.close()


# variant -> the global step both runs must end at (2 ranks, 6 batches of 8 per rank and epoch)
LIGHTNING_LOOPS = {"accum": 4, "bf16": 6, "manual": 12, "resume": 10, "limit": 12, "plateau": 24, "manual2": 18}


@pytest.mark.torch
def test_lightning_loops(tmp_path):
    """Lightning (hook mode, ``comm_state(module=model)`` + ``CommHook``) under torchrun: ``accumulate_grad_batches=4``
    with value clipping (short last groups), ``precision="bf16-mixed"`` with norm clipping, manual optimization
    (``manual_backward``, ``clip_gradients``), ``fit(ckpt_path=...)`` from a mid-epoch checkpoint in a fresh Trainer
    and state, ``limit_train_batches`` over 3 epochs, a validation loop every second epoch feeding a
    ``ReduceLROnPlateau`` beside a step scheduler, manual optimization with two optimizers and schedulers under
    ``find_unused_parameters=True, static_graph=True``: each equal to the run without the shim bit for bit
    (parameters, per-step losses, optimizer state, learning rates, validation losses and logged metrics).
    ``Tuner.scale_batch_size`` is refused by Lightning under DDP, shim or not."""
    variants = ",".join([*LIGHTNING_LOOPS, "scale_batch_size"])
    run_torchrun("lightning_loops_worker.py", tmp_path, ["--variants", variants])
    for rank in (0, 1):
        for name in ("plain", "shim"):
            _params, rec = load(tmp_path, f"{name}-scale_batch_size", rank)
            assert "not supported with distributed strategies" in rec["error"] and rec["global_step"] == 0, rec
    for variant, steps in LIGHTNING_LOOPS.items():
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{variant}", rank)
            got, rec = load(tmp_path, f"shim-{variant}", rank)
            assert plain_rec["world_size"] == 2 and plain_rec["global_step"] == rec["global_step"] == steps, rec
            assert rel_diff(got, plain) == 0.0, variant  # bit for bit
            for key in ("losses", "optimizer", "precision", "lrs", "val_losses", "metrics"):
                assert rec[key] == plain_rec[key], (variant, key)
            assert rec["mode"] == "hook" and min(rec["allreduces"]) >= 1, rec
            if variant == "bf16":
                assert rec["precision"] == "bf16-mixed", rec
            if variant == "plateau":  # validated at epochs 2 and 4 (+ the sanity check); the plateau rate cut once
                assert len(plain_rec["val_losses"]) == 6 and "val_loss" in plain_rec["metrics"], plain_rec
                assert plain_rec["lrs"][-1][0] < 0.05 * 0.7 ** 12 * 0.9, plain_rec["lrs"]
            if variant == "manual2":  # both schedulers moved the rates; the second optimizer moved the unused layer
                assert plain_rec["lrs"][-1][0] < 0.05 and plain_rec["lrs"][-1][1] < 2e-3, plain_rec["lrs"]
            if variant == "resume":  # 4 steps before the checkpoint through the first state, 6 after through the second
                assert rec["first_allreduces"] == [4, 4, 4] and rec["allreduces"] == [6, 6, 6], rec
        assert rel_diff(load(tmp_path, f"shim-{variant}", 1)[0], load(tmp_path, f"shim-{variant}", 0)[0]) == 0.0


# variant -> the mode the shim must end in (shim.attach(model, opt) on what accelerator.prepare returns)
ACCELERATE_LOOPS = {"accum_clip": "hook", "bf16": "overlap", "no_sync": "overlap", "save_load": "overlap",
                    "clip_late": "hook", "zero_first": "overlap", "wclip": "overlap", "wassign": "overlap"}


@pytest.mark.torch
def test_accelerate_loops(tmp_path):
    """Accelerate under torchrun (no agent): ``accumulate`` (3) with ``clip_grad_norm_`` on every micro-batch,
    ``mixed_precision="bf16"``, ``accelerator.no_sync`` by hand, ``save_state`` mid-run and ``load_state`` into fresh
    objects with ``skip_first_batches`` and a new ``attach``, and ``clip_grad_norm_`` on every step with a bound
    reached only from the 4th step (the probe sees the gradients multiplied by 1.0), ``zero_grad()`` before the
    forward, and WGAN weight clipping after each step (``p.data.clamp_``, and ``p.data = ...``): each equal to the
    loop without the shim bit for bit (parameters, losses, returned norms, optimizer state), the saved files byte for
    byte."""
    import torch

    run_torchrun("accelerate_loops_worker.py", tmp_path, ["--variants", ",".join(ACCELERATE_LOOPS)])
    for kind, mode in ACCELERATE_LOOPS.items():
        for rank in (0, 1):
            plain, plain_rec = load(tmp_path, f"plain-{kind}", rank)
            got, rec = load(tmp_path, f"shim-{kind}", rank)
            assert plain_rec["distributed_type"] == "MULTI_CPU" and plain_rec["ddp"] == "DistributedDataParallel"
            assert rel_diff(got, plain) == 0.0, kind  # bit for bit
            for key in ("losses", "norms", "optimizer"):
                assert rec[key] == plain_rec[key], (kind, key)
            assert rec["mode"] == mode, (kind, rec["mode"], rec["mode_reason"])
            if kind in ("accum_clip", "clip_late"):  # the bound bit (from the 4th step for clip_late)
                assert "clipping" in rec["mode_reason"] and max(plain_rec["norms"]) > 0.05, rec
            if kind.startswith("w"):  # the clipping bit: every parameter within the bound, some on it
                assert max(float(v.abs().max()) for v in got.values()) == float(torch.tensor(0.1)), kind
            if kind == "save_load":  # the resumed last 3 steps: the same losses and parameters, overlap again
                for r in (plain_rec, rec):
                    assert r["resumed_equal"] and r["resumed_losses"] == plain_rec["losses"][3:], r
                assert rec["resumed_mode"] == "overlap" and rec["resumed_optimizer"] == plain_rec["optimizer"], rec
        assert rel_diff(load(tmp_path, f"shim-{kind}", 1)[0], load(tmp_path, f"shim-{kind}", 0)[0]) == 0.0
    saved = sorted(p.name for p in (tmp_path / "state-plain-save_load").iterdir())
    assert "model.safetensors" in saved and "optimizer.bin" in saved, saved
    for name in saved:
        assert ((tmp_path / "state-shim-save_load" / name).read_bytes()
                == (tmp_path / "state-plain-save_load" / name).read_bytes()), name
