"""The shim's per-level process groups, and the job they join at the local agent: one gloo group per priority level,
each level its own set of TCP connections, which the shim finds in /proc (``tensorlane.flows``: its own sockets
before and after each group's creation) and registers with the local agent under the job id, rank and level
(``shim/agent_link.py``).

- ``connect`` is the collective part of ``shim.attach`` and ``shim.comm_state``: the groups, a job id and a run
  token every rank agrees on (``agree_job_id``, ``agree_run``: rank 0 draws, ``broadcast_token`` carries), and
  the agent link holding the flows. A link whose groups were destroyed without ``close()`` is retired first, and
  a garbage collection at exit is registered once (docs/shim.md, Exit).
- Each level group takes the default group's timeout, is fully connected before it is used (a barrier), and
  then has its rendezvous keys deleted from the store (torchrun restarts: docs/shim.md, "torchrun restarts").

Usage: ``groups, link, flows, job = connect(levels=4, agent_socket=None, job=None)`` (every rank calls it)
"""
from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import uuid
import weakref

import torch
import torch.distributed as dist

from tensorlane.client import agent_socket as resolve_socket
from tensorlane.client import clean_job_id
from tensorlane.flows import new_flows, own_tcp_flows
from tensorlane.shim.agent_link import AgentLink

log = logging.getLogger("tensorlane.shim")
_TRUE = ("1", "true", "yes", "on")  # an environment variable's spellings of true (ddp._disabled)
_FALSE = ("", "0", "false", "no", "off")  # and of false, unset included


def default_job_id() -> str | None:
    """The job id named by the environment: TENSORLANE_JOB, else torchrun's run id (``--rdzv-id``) unless it is
    torchrun's default ``none``; None when neither names the job (``agree_job_id`` then makes one)."""
    raw = os.environ.get("TENSORLANE_JOB") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if raw.strip().lower() in ("", "none"):
        return None
    return clean_job_id(raw)


def agree_job_id(job: str | None = None, group=None) -> str:
    """A job id that is the same on every rank of this job and differs between jobs (a collective on ``group``).

    ``job`` or ``default_job_id()`` when given; otherwise rank 0 draws ``job-<12 hex digits>`` and broadcasts it,
    so that two jobs started without ``--rdzv-id`` (``TORCHELASTIC_RUN_ID=none`` for both) stay apart.
    Usage: ``job = agree_job_id(group=groups[0])``
    """
    job = job or default_job_id()
    if job is not None:
        return clean_job_id(job)
    return clean_job_id(broadcast_token(f"job-{uuid.uuid4().hex[:12]}", group=group))


TOKEN_BYTES = 64  # the longest token broadcast_token carries (job and run tokens are 16 and 20 characters)


def broadcast_token(token: str, group=None) -> str:
    """Rank 0's ``token`` (ASCII, at most TOKEN_BYTES) on every rank of ``group``: one uint8 tensor broadcast
    (on the current CUDA device where the group is NCCL's). Not ``broadcast_object_list``: that needs NumPy on
    the receiving ranks, which ``tensorlane[shim]`` does not install. Usage: ``run = broadcast_token("run-1f")``
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    raw = token.encode("ascii")[:TOKEN_BYTES] if dist.get_rank() == 0 else b""
    buf = torch.zeros(TOKEN_BYTES, dtype=torch.uint8, device=device)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0, group=group)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode("ascii")


SHARED_STORE_HINT = (
    "tensorlane: creating the shim's process group for level {level} failed under torchrun, whose workers share "
    "one store across restarts (TORCHELASTIC_USE_AGENT_STORE=True): a restarted worker can read the addresses that "
    "the workers before the restart left there, and connect to a process that is gone. Set "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node (a new store for each restart); "
    "docs/shim.md, \"torchrun restarts\". The error: {error}")


def _default_group_timeout():
    """The default process group's timeout (``init_process_group(timeout=...)``), or None where torch does not say.
    ``new_group`` without a timeout takes torch's default (30 min for gloo), not the user's: a hung peer then held
    the shim's all-reduces for 30 min where plain DDP's raised after the user's timeout (and torchrun restarted)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        for device in pg._device_types:
            return pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError) as e:
        log.debug("tensorlane: the default process group's timeout is unknown (%s); the level groups take torch's", e)
    return None


def _new_level_group(level: int):
    """One gloo group for ``level``, all its connections up (a collective), with the default group's timeout. Under
    torchrun's shared worker store a failure names the likely cause, the killed attempt's keys in that store
    (SHARED_STORE_HINT)."""
    try:
        group = dist.new_group(backend="gloo", timeout=_default_group_timeout())
        dist.barrier(group=group)  # every connection of the group is up
    except RuntimeError as e:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise
        raise RuntimeError(SHARED_STORE_HINT.format(level=level, error=e)) from e
    _forget_addresses(group)
    return group


def _gloo_lazy_init() -> bool:
    """Whether gloo connects a group's pairs at their first use (TORCH_GLOO_LAZY_INIT), reading its peers'
    addresses from the store then, not when the group is made."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() not in _FALSE


def _forget_addresses(group) -> None:
    """Delete ``group``'s own keys from the store (rank 0), once every rank of it is connected (the barrier after
    its creation): the addresses its ranks published there. Under torchrun's shared worker store a restarted
    worker's group of the same name (torch names groups by a counter) otherwise read a killed peer's address there
    before the peer wrote its new one, and gloo failed (connection refused); with no keys left it waits for the
    new ones. Only the group's own prefix is touched (``group.get_group_store()``); nothing is deleted where gloo
    connects lazily (its pairs read the keys later) or where the store cannot list its keys."""
    if dist.get_rank() != 0 or _gloo_lazy_init():
        return
    try:
        store = group.get_group_store()
        for key in store.list_keys():
            store.delete_key(key)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        log.debug("tensorlane: the process group's rendezvous keys were left in the store (%s)", e)


def _priority_groups(levels: int, master_port: str | None) -> tuple[list, dict[int, list[dict]]]:
    """Create one gloo group per level (a collective) and return the groups and each level's new TCP flows."""
    groups, flows = [], {}
    for level in range(levels):
        before = own_tcp_flows()
        group = _new_level_group(level)
        found = new_flows(before, own_tcp_flows())
        flows[level] = [f for f in found if not f["dst"].startswith("127.") and f["dst"] != "::1"
                        and str(f["dport"]) != master_port and str(f["sport"]) != master_port]
        groups.append(group)
    return groups, flows


def agree_run(group=None) -> str:
    """A token of this run of the job, the same on every rank (rank 0 draws it; a collective on ``group``). The
    agent uses it to notice two jobs that use the same job id on one host. Usage: ``run = agree_run(groups[0])``
    """
    return broadcast_token(f"run-{uuid.uuid4().hex[:16]}", group=group)


_EXIT_HOOK: list = []  # set once the exit's collection is registered


def _collect_at_exit() -> None:
    """Once per process: collect the garbage at exit, while Python still runs, so that a DDP model left in a
    reference cycle frees its process group and gloo's threads are joined before the interpreter tears down (a
    gloo thread that frees a backward's work after that aborts the rank: docs/shim.md, Exit)."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(gc.collect))


_LINKS: weakref.WeakSet = weakref.WeakSet()  # every attach's agent link in this process


def _groups_alive(groups: list) -> bool:
    """Whether the shim's per-level ``groups`` still exist in torch.distributed (``dist.destroy_process_group()``
    destroys them all; a later ``init_process_group`` does not bring them back). Usage: ``_groups_alive(groups)``"""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(groups[0])
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def connect(levels: int, agent_socket: str | None, job: str | None) -> tuple[list, AgentLink, dict, str]:
    """The collective part of starting: groups per level, the agreed job id and run, flows registered with the
    agent. An earlier attach whose groups were destroyed without ``close()`` is retired first: its flows, still
    registered (the handle keeps its groups' sockets), made a conflict of this process with itself."""
    _collect_at_exit()
    for old in list(_LINKS):
        old.check_alive()
    groups, flows = _priority_groups(levels, os.environ.get("MASTER_PORT"))
    job = agree_job_id(job, group=groups[0])
    link = AgentLink(resolve_socket(agent_socket), job,
                     rank=dist.get_rank(), run=agree_run(group=groups[0]))
    link.alive = functools.partial(_groups_alive, groups)
    _LINKS.add(link)
    for level, fl in flows.items():
        if fl:
            link.add(level, fl)
    if not any(flows.values()):  # every peer on this host: its connections are loopback, which no NIC carries
        log.warning("tensorlane: no connection of the shim's process groups leaves this host (its peers are all on "
                    "it, over loopback): nothing to prioritise on the network here; stats()['flows'] counts 0 at every "
                    "level")
    return groups, link, flows, job
