"""Training restarted by ``torchrun --max-restarts 1`` (docs/shim.md, "torchrun restarts"): a worker fails, torchrun
restarts both, the script resumes from its checkpoint (model, optimizer, LR scheduler, sampler position, RNG), and
the final parameters equal plain DDP's. 2 ranks on loopback, gloo, no agent (the testbed run with agents:
``scripts/torchrun_restart.py``). Each torchrun here takes 20-40 s on 2 shared cores.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "restart_worker.py")


def torchrun(out, *args: str, timeout: float = 150) -> None:
    """``tests/restart_worker.py`` under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``; asserts that
    it ended with status 0 within ``timeout`` (torchrun and its workers stopped otherwise)."""
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.pop("TENSORLANE_JOB", None)
    with open(os.path.join(out, "log"), "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "--max-restarts", "1", "--monitor-interval", "0.5", WORKER, "--out", str(out), *args],
                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # SIGTERM: torchrun stops its workers (each in a session of its own)
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            rc = None
    with open(os.path.join(out, "log")) as f:
        ended = f"still running after {timeout} s" if rc is None else f"exit status {rc}"
        assert rc == 0, (f"torchrun {args}: {ended}", f.read()[-3000:])


def finals(out) -> list[dict]:
    """Each rank's final parameters."""
    import torch

    return [torch.load(os.path.join(out, f"final-{rank}.pt")) for rank in (0, 1)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain DDP's final parameters, trained without a failure (equal, bit for bit, to plain DDP through the same
    failure and resume: the worker restores everything the loop draws from)."""
    out = tmp_path_factory.mktemp("restarts") / "ddp"
    torchrun(out, "--mode", "ddp")
    return finals(out)


@pytest.mark.torch
@pytest.mark.parametrize("mode, resume, crash, step", [
    ("overlap", "ddp", "raise", 3),  # a checkpoint saved with an overlap step deferred, resumed without the shim
    ("hook", "hook", "kill", 4),  # SIGKILL between checkpoints: a step redone
    ("overlap", "overlap", "hang", 3),  # a rank hangs: its peer's next all-reduce times out after the user's 15 s
])
def test_a_worker_failure_restarted_by_torchrun_ends_as_plain_ddp(plain, tmp_path, mode, resume, crash, step):
    """Rank 1 fails in the first attempt (an exception, SIGKILL, or a hang) right after the checkpoint of ``step``
    or between checkpoints; torchrun restarts both workers, which resume in ``resume`` mode and end with plain DDP's
    parameters, bit for bit. The hang: the shim's level groups take the timeout given to ``init_process_group``;
    until 2026-11-28 they took torch's default (30 min for gloo), so the peer's all-reduce waited 30 min where plain
    DDP's raised after 15 s and torchrun restarted (this case then ran past its 150 s)."""
    import json

    import torch

    out = tmp_path / "run"
    torchrun(out, "--mode", mode, "--resume-mode", resume, "--crash", crash, "--crash-step", str(step),
             "--pg-timeout", "15")
    for rank in (0, 1):
        with open(out / f"start-{rank}-1.json") as f:
            start = json.load(f)
        assert start["mode"] == resume and start["step"] == step - step % 3, start  # restarted from the checkpoint
    for rank, (got, want) in enumerate(zip(finals(out), plain, strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name, float((got[name] - want[name]).abs().max()))


@pytest.mark.torch
def test_level_groups_take_the_default_groups_timeout(tmp_path):
    """The shim's level groups time out as the default group does (``init_process_group(timeout=...)``), in either
    mode; until 2026-11-28 they took torch's default, 30 min for gloo."""
    import datetime

    import torch
    import torch.distributed as dist

    from tensorlane import shim

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=7))
    try:
        for with_optimizer in (True, False):
            ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            handle = shim.attach(ddp, opt if with_optimizer else None, levels=2, policy="flat",
                                 agent_socket="/nonexistent/tl.sock")
            ddp(torch.ones(2, 4)).sum().backward()
            opt.step()
            timeouts = [g._get_backend(torch.device("cpu")).options._timeout for g in handle.state.groups]
            handle.close()
            assert timeouts == [datetime.timedelta(seconds=7)] * 2, timeouts
    finally:
        dist.destroy_process_group()


@pytest.mark.torch
def test_a_failed_all_reduce_in_hook_mode_raises_in_backward(tmp_path, monkeypatch):
    """A level's all-reduce that fails (its peer killed: gloo's "Connection closed by peer") makes DDP's backward
    raise, as plain DDP's does. Until 2026-11-28 hook mode collected the pieces' futures with ``collect_all``, which
    completes without error when a piece fails: the backward returned the bucket unaveraged, the step took it, and a
    survivor trained on to its next other collective, silently (on the testbed, ``scripts/torchrun_restart.py
    --shim-mode hook``: rank 0 trained out the epoch alone and saved that checkpoint, the restart resumed from it,
    the final parameters 4.6e-2 off plain DDP's)."""
    import torch
    import torch.distributed as dist

    from tensorlane import shim

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        handle = shim.attach(ddp, levels=2, policy="flat", agent_socket="/nonexistent/tl.sock")
        ddp(torch.ones(2, 4)).sum().backward()  # the groups made, the first iteration measured
        launch = handle.state.launch

        def failing_launch(buf, params, last_bucket):
            futures, pieces, launched = launch(buf, params, last_bucket)
            for f in futures:
                f.wait()
            failed = torch.futures.Future()
            failed.set_exception(RuntimeError("Connection closed by peer [127.0.0.1]:1 (injected)"))
            return [*futures[:-1], failed], pieces, launched

        monkeypatch.setattr(handle.state, "launch", failing_launch)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            ddp(torch.ones(2, 4)).sum().backward()
        monkeypatch.undo()
        handle.close()
    finally:
        dist.destroy_process_group()
