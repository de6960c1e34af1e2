"""What the framework workers share: the model, the data, and the records they leave for tests/test_frameworks.py.

Each worker runs in one testbed host namespace with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (and the
framework's own variables) set by the test, trains the same small model once per variant, and writes
OUT/VARIANT-RANK.pt (final parameters) and OUT/VARIANT-RANK.json (the shim's stats, the agent's view of the
job's flows while training and after close).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.nn as nn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tensorlane.client import AgentClient  # noqa: E402

SAMPLES = 96  # per run, over all ranks: enough for a few steps of a batch of 8 per rank


def make_model() -> nn.Module:
    """A small CNN with several parameter-owning layers (so that every level gets a piece)."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def dataset(samples: int = SAMPLES) -> torch.utils.data.TensorDataset:
    """The same inputs and labels on every rank and every run; the frameworks' samplers split them by rank."""
    g = torch.Generator().manual_seed(4321)
    return torch.utils.data.TensorDataset(torch.randn(samples, 3, 8, 8, generator=g),
                                          torch.randint(0, 10, (samples,), generator=g))


def params_of(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def agent_flows(socket: str | None, job: str | None, errors: list | None = None) -> list[dict]:
    """The flows the host's agent holds for ``job`` (every job's: None); [] when no agent answers (``errors``
    gets why)."""
    if not socket:
        return []
    try:
        with AgentClient(socket, timeout=1.0) as c:
            return list(c.list(job=job)["flows"])  # (None: every job's)
    except OSError as exc:
        if errors is not None:
            errors.append(f"{time.time():.3f} {type(exc).__name__}: {exc}")
        return []


def wait_levels(socket: str | None, job: str, levels: int, timeout: float = 10.0,
                record: dict | None = None, state=None) -> list[dict]:
    """Poll the agent until it holds flows of ``job`` at every level (or ``timeout``); return its last answer.
    When it never did, ``record`` gets what tells why (for the test's message): the polls that got no answer
    (``flows_poll_errors``), every flow the agent holds (``agent_flows_all``), the flows the shim's ``state`` found
    at each level (``shim_flows``) and the process's established TCP connections now (``own_flows``).

    A collective where torch.distributed is initialized (every rank calls it): it returns once every rank has looked,
    so that no rank closes the shim (destroying its level groups) while another still polls. Until 2026-11-29 a rank
    that got there first closed at once: the other rank's gloo closed its ends of those connections on the peer's
    FIN, its agent's sweep (every 0.5 s) removed the job's flows as "sockets closed", and that rank, slowed down on a
    loaded machine, found none (tests/test_frameworks.py, about 3 runs in 60 under three busy loops)."""
    deadline, errors = time.monotonic() + timeout, []
    flows = agent_flows(socket, job, errors)
    while {f["level"] for f in flows} != set(range(levels)) and time.monotonic() < deadline:
        time.sleep(0.1)
        flows = agent_flows(socket, job, errors)
    if record is not None and {f["level"] for f in flows} != set(range(levels)):
        record["flows_poll_errors"] = errors[-20:]
        record["agent_flows_all"] = agent_flows(socket, None, errors)
        from tensorlane.flows import own_tcp_flows
        record["own_flows"] = [(f["sport"], f["dst"], f["dport"]) for f in own_tcp_flows()]
        if state is not None:
            record["shim_flows"] = {lvl: [(f["sport"], f["dst"], f["dport"]) for f in fl]
                                    for lvl, fl in (state.flows or {}).items()}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank has looked: now any may close
    return flows


def wait_gone(socket: str | None, job: str, timeout: float = 5.0) -> list[dict]:
    """Poll the agent until it holds no flow of ``job`` (or ``timeout``); return its last answer."""
    deadline = time.monotonic() + timeout
    flows = agent_flows(socket, job)
    while flows and time.monotonic() < deadline:
        time.sleep(0.1)
        flows = agent_flows(socket, job)
    return flows


def save(out: str, variant: str, rank: int, params: dict, record: dict) -> None:
    torch.save(params, os.path.join(out, f"{variant}-{rank}.pt"))
    with open(os.path.join(out, f"{variant}-{rank}.json"), "w") as fh:
        json.dump(record, fh, default=str)


def finish() -> int:
    """The worker's end: every rank past its saves, the default group destroyed where one was made (not after
    Lightning's shim-spawn alone: no process trained), the DDP models and their process groups freed now, not in the
    interpreter's exit (docs/shim.md, Exit). Returns the exit status."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    gc.collect()
    return 0
