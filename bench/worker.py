"""The benchmarks' distributed worker: one process per rank, started by a runner with a sub-command.

Run one per rank (inside a testbed host namespace, or on loopback with ``--ifname lo``)::

    python -m bench.worker allreduce --rank 0 --world 2 --master 198.18.0.1:29500 --size-mb 10 --iters 10 \
        --warmup 1 [--agent-socket /run/tensorlane/tw-h1/agent.sock --job demo --level 0] --json r0.json
    python -m bench.worker training --rank 0 --world 2 --master 198.18.0.1:29600 --profile resnet50 \
        --mode ddp,app_order,shim_overlap --rounds 3 --iters 7 --warmup 2 --param-scale 5 --compute-scale 10.416 \
        [--agent-socket /run/tensorlane/tp-h1/agent.sock --job prio --levels 4] --link-rate 200mbit --json r0.json
    python -m bench.worker realtrain --rank 0 --world 2 --master 198.18.0.1:29700 --modes ddp,shim_clip \
        --agent-socket /run/tensorlane/tr-h1/agent.sock --json r0.json

Every sub-command takes ``--rank``, ``--world``, ``--master ADDR:PORT`` (the rendezvous store, served by rank 0),
``--ifname`` (the interface gloo binds to, GLOO_SOCKET_IFNAME; default eth0 if present, else lo),
``--agent-socket``, ``--job``, ``--timeout`` (seconds for rendezvous and each collective) and ``--json OUT``
(``{rank}`` in the path is replaced); it joins one gloo process group and writes its figures to ``--json``.

``allreduce`` (``bench.contention``)
    A bare all-reduce of ``--size-mb`` MiB (float32), split over ``--groups`` process groups. After the warm-up
    all-reduce has opened gloo's connections, the worker finds its own new TCP flows with ``tensorlane.flows``
    (leaving out the rendezvous store's connection) and registers them with the agent at ``--level``; an absent
    agent is warned about once and the run goes on. Each timed all-reduce starts right after a barrier; the JSON
    holds per-iteration times, local and the maximum over ranks (what the slowest rank saw, the collective's time).

``training`` (``bench.priority``, ``bench.contention``, ``bench.overhead``, ``bench.validate``, ``bench.jobs``)
    Data-parallel training over an emulated model (``bench.models``): plain DDP, or DDP with the shim.
    ``--mode`` takes one mode or a comma-separated list; with a list, every round runs each mode once (a fresh
    model, DDP wrapper, optimizer and, for the shim modes, ``shim.attach``), the order rotating from round to
    round, so that the modes are measured side by side under the same machine noise. Modes:

    ``ddp``: plain ``DistributedDataParallel`` (gloo) with buckets of ``25 MB / param_scale`` (DDP's default bucket
    size, scaled like the parameters). With ``--agent-socket`` its gloo connections are found in /proc after the
    warm-up and registered at ``--ddp-level`` (default 0; -1 leaves them unregistered), all at one level: the job
    is protected from other traffic but its tensors are not ordered.
    ``shim``: ``shim.attach(ddp, levels=L)``: each bucket's pieces on L priority levels (layer order), no overlap.
    ``shim_overlap``: ``shim.attach(ddp, optimizer=opt, levels=L)``: priority levels and overlap (each parameter is
    updated when its all-reduce completes; the next forward starts while later layers still synchronise).
    ``app_order``: application-level ordering only (what ByteScheduler does without network priority), as the shim
    gives it: ``shim.attach(ddp, optimizer=opt, levels=1)``. One process group, so one flow class at one level:
    buckets go to the network in the order they become ready and overlap the next forward, and the forward
    pre-hooks take each layer's update in layer order, but the network never lets an urgent piece overtake one
    already queued (no preemption, no credit-based holding back either: the shim has no such scheduler).
    ``compute``: no communication: forward + backward + step of the bare emulated model on every rank at once (the
    realised compute floor under the same machine load).
    ``calibrate``: no model: times uncontended all-reduces on the default group (4 KiB, 1 MiB and 4 MiB, back to
    back after a barrier each; the maximum over ranks), the host time to issue one asynchronous all-reduce (as the
    shim's hook does: narrow, ``all_reduce(async_op=True)``, future, done callback), the wake-up of a thread
    waiting for a completed all-reduce, the emulated device's time lost per all-reduce completing with a Python
    callback while the thread computes (``callback_stall``), and the host copy rate of ``Tensor.div``: the inputs
    of ``policies.execution``'s host costs (``bench.validate`` fits alpha and the link's payload rate from the
    all-reduce times). Its JSON entry is ``modes["calibrate"]["calibration"]``.

    The shim modes use DDP buckets of ``--shim-bucket-cap-mb`` (default: the same as plain DDP) and
    ``--partition-bytes`` (default: the shim's own). ``--configs JSON`` (or ``@FILE``) names further shim
    configurations that ``--mode`` may list beside the modes above, so that several of them are measured
    interleaved in one run::

        --configs '{"c1": {"base": "shim_overlap", "levels": 2, "policy": "layer_order", "partition_bytes": 65536,
                           "bucket_cap_mb": 0.2}}' --mode ddp,shim_overlap,c1

    Fields (all optional): ``base`` (``shim_overlap``, ``app_order`` or ``shim``; default ``shim_overlap``),
    ``levels``, ``policy``, ``partition_bytes`` (null: the shim's own), ``bucket_cap_mb`` (DDP's bucket size in
    that configuration), ``layer_levels`` (a level per parameter, forward order, set on the shim's state after
    ``attach``: levels the shim's own policies do not give).

    Timing: after ``--warmup`` iterations (and, in overlap modes, ``flush()``), one barrier aligns the ranks; then
    ``iters + 1`` iterations run back to back and iteration ``i``'s time is the interval between the starts of
    iterations ``i`` and ``i + 1`` (the extra iteration is not timed: it absorbs the last one's communication).
    There is no barrier per iteration: it would drain the pipeline that overlap builds, and its flow is
    unregistered. The JSON's ``times_s`` are, per iteration, the maximum over ranks (the slowest rank);
    ``phases_s`` the local medians of forward (including waits in the shim's pre-hooks), backward (including DDP's
    wait for its all-reduces) and step; ``late_wakeups_s`` how late the emulated compute's sleeps woke up (machine
    noise), and ``device_idle_s`` how long the emulated device sat idle (waits for all-reduces and anything else
    that was not this thread's own CPU work; see ``bench.models.emulate_compute``), per phase (the forward's
    includes the pause since the previous backward).

``realtrain`` (``bench.realtrain``)
    The small real CNN of ``bench.realtrain`` (bf16 autocast, LR warm-up, optional clipping): every mode
    ``--rounds`` times (rotating), the losses and iteration times of each run (see that module).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from datetime import timedelta

from bench.workers import jsonable, register_flows, unregister_flows, use_interface, write_json

MB = 1024 * 1024

# ------------------------------------------------------------------------------------------- shared by every mode


def parse_master(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (IPv6 in brackets or not) as ``(addr, port)``. Usage: ``parse_master("10.0.0.1:29500")``"""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def worker_parser(mode: str, description: str, job: str, timeout: float, required: bool = True,
                  json_required: bool = False) -> argparse.ArgumentParser:
    """A sub-command's parser holding the arguments every mode takes (module docstring); ``required``: whether
    ``--rank``, ``--world`` and ``--master`` must be given (else rank 0 of 1, no master).

    Usage: ``p = worker_parser("allreduce", "...", job="allreduce", timeout=60.0); p.add_argument(...)``
    """
    p = argparse.ArgumentParser(prog=f"python -m bench.worker {mode}", description=description)
    p.add_argument("--rank", type=int, required=required, default=0)
    p.add_argument("--world", type=int, required=required, default=1)
    p.add_argument("--master", type=parse_master, required=required, default=None, metavar="ADDR:PORT",
                   help="rendezvous store (served by rank 0)")
    p.add_argument("--ifname", default=None,
                   help="interface gloo binds to (GLOO_SOCKET_IFNAME); default eth0 if present, else lo")
    p.add_argument("--agent-socket", default=None, help="the local agent's socket (register the flows with it)")
    p.add_argument("--job", default=job)
    p.add_argument("--timeout", type=float, default=timeout, help="seconds for rendezvous and each collective")
    p.add_argument("--json", default=None, required=json_required, metavar="OUT",
                   help="write results here ({rank} is replaced)")
    return p


def check_rank(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error unless ``0 <= rank < world``."""
    if args.world < 1 or not 0 <= args.rank < args.world:
        p.error(f"need 0 <= rank < world, got rank {args.rank}, world {args.world}")


def prepare(args: argparse.Namespace) -> str:
    """Pin gloo to ``args.ifname`` (see ``bench.workers.use_interface``) and torch to one thread; the interface."""
    ifname = use_interface(args.ifname)
    import torch

    torch.set_num_threads(1)
    return ifname


def start_group(args: argparse.Namespace) -> float:
    """Join the gloo process group of ``args.master`` as ``args.rank`` of ``args.world``; the seconds it took."""
    import torch.distributed as dist

    addr, port = args.master
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))
    return time.perf_counter() - t0


def rotation(modes: list[str], r: int) -> list[str]:
    """The order of ``modes`` in round ``r`` (rotated by ``r``).

    Usage: ``rotation(["a", "b", "c"], 1) == ["b", "c", "a"]``
    """
    k = r % len(modes)
    return modes[k:] + modes[:k]


def intervals(starts: list[float]) -> list[float]:
    """The gaps between consecutive start times (one fewer than ``starts``)."""
    return [b - a for a, b in itertools.pairwise(starts)]


def max_over_ranks(local: list[float]) -> list[float]:
    """Per entry, the maximum of ``local`` over every rank (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    times = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def write_result(args: argparse.Namespace, result: dict) -> None:
    """Write ``result`` to ``--json`` (``{rank}`` replaced), if given."""
    if args.json:
        write_json(args.json, result, rank=args.rank)


def _warn(msg: str) -> None:
    print(f"bench.worker: warning: {msg}", file=sys.stderr, flush=True)


def job_flows(before: list[dict], master_port: int, keep_store: bool = False) -> list[dict]:
    """This process's TCP flows opened since ``before`` (``own_tcp_flows()``), less the rendezvous store's
    connection (to or from ``master_port``: not training data) unless ``keep_store``."""
    from tensorlane.flows import new_flows, own_tcp_flows

    return [f for f in new_flows(before, own_tcp_flows())
            if keep_store or master_port not in (f["dport"], f["sport"])]


# ---------------------------------------------------------------------------------------------------- allreduce

def allreduce_args(argv=None) -> argparse.Namespace:
    """The ``allreduce`` sub-command's arguments (module docstring)."""
    p = worker_parser("allreduce", "A gloo all-reduce worker that times each all-reduce and reports its flows to "
                      "the agent.", job="allreduce", timeout=60.0)
    p.add_argument("--size-mb", type=float, default=10.0, help="all-reduced tensor size in MiB (float32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--groups", type=int, default=1,
                   help="split each all-reduce over this many process groups (each has its own connections)")
    p.add_argument("--level", type=int, default=0)
    args = p.parse_args(argv)
    check_rank(p, args)
    if args.iters < 1 or args.warmup < 0 or args.groups < 1 or args.size_mb <= 0:
        p.error("need --iters >= 1, --warmup >= 0, --groups >= 1, --size-mb > 0")
    return args


def _allreduce_of(args: argparse.Namespace):
    """The all-reduce to time: ``(run, numel)``; ``run()`` all-reduces the tensor, a chunk per process group."""
    import torch
    import torch.distributed as dist

    groups = [None] + [dist.new_group(list(range(args.world)), backend="gloo") for _ in range(args.groups - 1)]
    numel = max(args.groups, int(args.size_mb * MB) // 4)
    chunks = list(torch.tensor_split(torch.ones(numel, dtype=torch.float32), args.groups))

    def run() -> None:
        works = [dist.all_reduce(c, group=g, async_op=True) for c, g in zip(chunks, groups, strict=True)]
        for w in works:
            w.wait()

    return run, numel


def _timed(run, iters: int) -> tuple[list[float], list[float]]:
    """``iters`` calls of ``run``, each right after a barrier: ``(local seconds, maximum over ranks)``."""
    import torch.distributed as dist

    local = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        local.append(time.perf_counter() - t0)
    collective = max_over_ranks(local)
    dist.barrier()
    return local, collective


def allreduce_main(argv=None) -> int:
    """``python -m bench.worker allreduce ...``: time the all-reduces, register the flows; results to ``--json``."""
    from tensorlane.flows import own_tcp_flows

    args = allreduce_args(argv)
    ifname = prepare(args)
    import torch.distributed as dist

    before = own_tcp_flows()
    init_s = start_group(args)
    allreduce, numel = _allreduce_of(args)
    for _ in range(args.warmup):
        allreduce()
    # gloo's connections now exist; the store's connection (to or from the master port) is not training data.
    flows = job_flows(before, args.master[1], keep_store=args.world == 1)
    registered, agent_error = False, None
    if args.agent_socket:
        registered, agent_error = register_flows(args.agent_socket, args.job, args.level, flows, args.rank, _warn)
    try:
        local, collective = _timed(allreduce, args.iters)
    finally:
        if registered:
            unregister_flows(args.agent_socket, args.job, flows, _warn)
    dist.destroy_process_group()
    result = {
        "rank": args.rank, "world": args.world, "size_bytes": numel * 4, "groups": args.groups,
        "iters": args.iters, "warmup": args.warmup, "init_s": init_s,
        "times_s": collective, "local_times_s": local, "median_s": statistics.median(collective),
        "flows": flows, "registered": registered, "agent_error": agent_error, "level": args.level,
        "job": args.job, "ifname": ifname, "end_time": time.time(),
    }
    write_result(args, result)
    print(f"rank {args.rank}: median {result['median_s'] * 1000:.1f} ms over {args.iters} all-reduces of "
          f"{numel * 4 / MB:.1f} MiB; {len(flows)} flows{' registered' if registered else ''}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------- training

MODES = ("ddp", "shim", "shim_overlap", "app_order", "compute", "calibrate")
SHIM_MODES = ("shim", "shim_overlap", "app_order")
OVERLAP_MODES = ("shim_overlap", "app_order")
DDP_DEFAULT_BUCKET_MB = 25.0
CONFIG_FIELDS = ("base", "levels", "policy", "partition_bytes", "bucket_cap_mb", "layer_levels")
CALIBRATION_SIZES = ((4096, 15), (1 << 20, 4), (4 << 20, 4))   # (bytes, repetitions) of the timed all-reduces
RECORD_KEYS = ("times", "local", "forward", "backward", "step", "late_forward", "late_backward", "idle_forward",
               "idle_backward", "stats", "spans", "cpu_spans", "cpu_wait_spans", "calibration")


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated subset of {','.join(MODES)}, not {text!r}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode is repeated in {text!r}")
    return modes


def parse_configs(text: str | None) -> dict[str, dict]:
    """The ``--configs`` argument: a JSON object (or ``@FILE`` holding one) of named shim configurations.

    Usage: ``parse_configs('{"c1": {"levels": 2}}') == {"c1": {"base": "shim_overlap", "levels": 2}}``
    """
    if not text:
        return {}
    if text.startswith("@"):
        with open(text[1:]) as fh:
            text = fh.read()
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("--configs must be a JSON object of name -> configuration")
    out = {}
    for name, cfg in doc.items():
        if name in MODES or not name or "," in name or not isinstance(cfg, dict):
            raise ValueError(f"bad configuration name or body: {name!r}")
        unknown = set(cfg) - set(CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"configuration {name!r}: unknown field(s) {sorted(unknown)}")
        cfg = {"base": "shim_overlap", **cfg}
        if cfg["base"] not in SHIM_MODES:
            raise ValueError(f"configuration {name!r}: base must be one of {SHIM_MODES}")
        out[name] = cfg
    return out


def _training_parser() -> argparse.ArgumentParser:
    """The ``training`` sub-command's parser (module docstring)."""
    p = worker_parser("training", "A data-parallel training worker over an emulated model (bench.models): plain "
                      "DDP, or DDP with the shim.", job="train", timeout=120.0, required=False)
    p.add_argument("--profile", default="resnet50", help="policies/profiles name")
    p.add_argument("--mode", type=_parse_modes, default=["ddp"], help="one mode or a comma-separated list")
    p.add_argument("--rounds", type=int, default=1, help="run every mode this many times, interleaved")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per mode and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before each mode's timed ones")
    p.add_argument("--param-scale", type=float, default=None, help="default: bench.models.DEFAULT_SCALES")
    p.add_argument("--compute-scale", type=float, default=None, help="default: bench.models.DEFAULT_SCALES")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size; default 25 / param_scale")
    p.add_argument("--shim-bucket-cap-mb", type=float, default=None, help="DDP bucket size in the shim modes")
    p.add_argument("--levels", type=int, default=4, help="priority levels of the shim (app_order: always 1)")
    p.add_argument("--policy", default="planner", help="the shim's level policy (default: the planner)")
    p.add_argument("--partition-bytes", type=int, default=None, help="the shim's partition size (default: its own)")
    p.add_argument("--ddp-level", type=int, default=0,
                   help="level of plain DDP's flows when --agent-socket is given (-1: leave them unregistered)")
    p.add_argument("--shim-job", default=None,
                   help="the job id the shim registers under (default: JOB-MODE, each mode a job of its own)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--link-rate", default=None, help="link rate (e.g. 200mbit): adds lower_bound_s to the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict-compute", action="store_true",
                   help="the training thread's CPU work adds to the emulated compute (no overlap with the device)")
    p.add_argument("--configs", default=None, metavar="JSON",
                   help="named shim configurations (JSON object, or @FILE) usable in --mode; see the module doc")
    return p


def training_args(argv=None) -> argparse.Namespace:
    """The ``training`` sub-command's arguments, checked (``--configs`` parsed)."""
    p = _training_parser()
    args = p.parse_args(argv)
    try:
        args.configs = parse_configs(args.configs)
    except (ValueError, OSError) as exc:
        p.error(f"--configs: {exc}")
    bad = [m for m in args.mode if m not in MODES and m not in args.configs]
    if bad:
        p.error(f"unknown mode(s) {','.join(bad)}: modes are {','.join(MODES)} or a --configs name")
    if args.mode == ["compute"] and args.master is None:
        args.world, args.rank = 1, 0
    elif args.master is None:
        p.error("--master is needed unless --mode compute")
    if "calibrate" in args.mode and args.world < 2:
        p.error("--mode calibrate needs --world >= 2")
    check_rank(p, args)
    if args.iters < 1 or args.warmup < 0 or args.levels < 1 or args.rounds < 1:
        p.error("need --iters >= 1, --warmup >= 0, --levels >= 1, --rounds >= 1")
    return args


def _scales(args) -> tuple[float, float]:
    from bench.models import DEFAULT_SCALES

    dps, dcs = DEFAULT_SCALES.get(args.profile, (1.0, 1.0))
    return (args.param_scale if args.param_scale is not None else dps,
            args.compute_scale if args.compute_scale is not None else dcs)


def _timed_allreduces(dist, torch, sizes) -> tuple[list[float], list[int], list[float]]:
    """Each size's all-reduces after a barrier each: local seconds, their sizes and the callback wake-ups."""
    local, sizes_out, wakes = [], [], []
    for nbytes, reps in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        dist.all_reduce(t)  # warm the connection for this size
        for _ in range(reps):
            stamp: list[float] = []
            dist.barrier()
            t0 = time.perf_counter()
            fut = dist.all_reduce(t, async_op=True).get_future()
            fut.add_done_callback(lambda _f, stamp=stamp: stamp.append(time.perf_counter()))
            fut.wait()
            t1 = time.perf_counter()
            local.append(t1 - t0)
            sizes_out.append(nbytes)
            if stamp:
                wakes.append(max(0.0, t1 - stamp[0]))
    return local, sizes_out, wakes


def _launch_s(dist, torch, launches: int) -> float:
    """Median host seconds to issue one small asynchronous all-reduce with a callback, as the shim's hook does."""
    buf = torch.zeros(launches * 16)
    futs = []
    t0 = time.perf_counter()
    for k in range(launches):
        piece = buf.narrow(0, 16 * k, 16)
        s0 = time.perf_counter()
        fut = dist.all_reduce(piece, async_op=True).get_future()
        fut.add_done_callback(lambda _f, s0=s0: time.perf_counter() - s0)
        futs.append(fut)
    launch = (time.perf_counter() - t0) / launches
    for fut in futs:
        fut.wait()
    return launch


def calibrate(dist, torch, sizes=CALIBRATION_SIZES, launches: int = 40, copies: int = 10) -> dict:
    """Measurements for ``policies.execution``'s costs, on the default group (a collective: every rank calls it).

    Returns ``samples`` (``[bytes, seconds]`` of each timed all-reduce, the maximum over ranks), ``launch_s``
    (median host time to issue one asynchronous all-reduce the way the shim's hook does), ``wake_s`` (median delay
    from an all-reduce's completion callback to its waiting thread running again), ``copy_bps`` (host copy rate
    of ``Tensor.div`` on 4 MiB); the per-rank figures are combined by the maximum (times) or minimum (rate).
    Usage: ``calibrate(torch.distributed, torch)``
    """
    for _ in range(3):
        dist.all_reduce(torch.zeros(1))
    local, sizes_out, wakes = _timed_allreduces(dist, torch, sizes)
    dist.barrier()
    launch = _launch_s(dist, torch, launches)
    stall = callback_stall(dist, torch)
    x = torch.ones((4 << 20) // 4)
    copy_times = []
    for _ in range(copies):
        c0 = time.perf_counter()
        x.div(2)
        copy_times.append(time.perf_counter() - c0)
    copy_bps = (4 << 20) / max(1e-9, statistics.median(copy_times))
    vals = max_over_ranks(local + [launch, statistics.median(wakes) if wakes else 0.0, -copy_bps, stall])
    n = len(local)
    return {"samples": [[b, v] for b, v in zip(sizes_out, vals[:n], strict=True)], "launch_s": vals[n],
            "wake_s": vals[n + 1], "copy_bps": -vals[n + 2], "callback_s": vals[n + 3], "launches": launches,
            "copies": copies}


def callback_stall(dist, torch, kernels: int = 100, kernel_s: float = 0.003, reps: int = 5) -> float:
    """Emulated-device time lost per all-reduce completing with a Python done-callback while this thread computes.

    Runs ``kernels`` emulated kernels of ``kernel_s`` (``bench.models.emulate_compute``), once issuing a small
    asynchronous all-reduce with a callback like the shim's (a lock, a counter) before each kernel and once
    without, ``reps`` times each, alternating; returns (median idle with - median idle without) / ``kernels``,
    at least 0. A collective: every rank calls it. Usage: ``callback_stall(torch.distributed, torch)``
    """
    import threading

    from bench import models

    buf = torch.zeros(kernels * 256)
    lock = threading.Lock()
    counts = [0, 0.0]

    def once(with_ops: bool) -> float:
        dist.barrier()
        models.reset_stream()
        i0 = models.STREAM_STATS["idle_s"]
        futs = []
        for k in range(kernels):
            if with_ops:
                t0 = time.perf_counter()
                fut = dist.all_reduce(buf.narrow(0, 256 * k, 256), async_op=True).get_future()

                def record(_fut, t0=t0) -> None:
                    with lock:
                        counts[0] += 1
                        counts[1] += time.perf_counter() - t0
                fut.add_done_callback(record)
                futs.append(fut)
            models.emulate_compute(kernel_s)
        idle = models.STREAM_STATS["idle_s"] - i0
        for fut in futs:
            fut.wait()
        return idle

    base, with_ops = [], []
    for _ in range(reps):
        base.append(once(False))
        with_ops.append(once(True))
    models.reset_stream()
    return max(0.0, (statistics.median(with_ops) - statistics.median(base)) / kernels)


class TrainingWorker:
    """One rank of the ``training`` sub-command: its modes' records and plain DDP's flow registration.

    Usage: ``w = TrainingWorker(training_args(argv)); w.start(); w.run_rounds(); w.result(ifname)``
    """

    def __init__(self, args: argparse.Namespace):
        from bench.models import synthetic_batch

        self.args = args
        self.param_scale, self.compute_scale = _scales(args)
        self.distributed = args.master is not None
        self.bucket_mb = (args.bucket_cap_mb if args.bucket_cap_mb is not None
                          else DDP_DEFAULT_BUCKET_MB / self.param_scale)
        self.shim_bucket_mb = args.shim_bucket_cap_mb if args.shim_bucket_cap_mb is not None else self.bucket_mb
        self.x, self.target = synthetic_batch(args.rank, 0)
        self.records = {m: {k: [] for k in RECORD_KEYS} for m in args.mode}
        self.before: list[dict] = []
        self.init_s = 0.0
        self.ddp_flows: list[dict] = []
        self.ddp_registered, self.agent_error = False, None

    def start(self) -> None:
        """Note the flows that exist already and join the process group (if distributed)."""
        from tensorlane.flows import own_tcp_flows

        self.before = own_tcp_flows()
        if self.distributed:
            self.init_s = start_group(self.args)

    def setting(self, mode: str) -> dict:
        """What one mode (or --configs name) runs: base mode, levels, policy, partition, bucket size."""
        args = self.args
        cfg = args.configs.get(mode, {})
        base = cfg.get("base", mode)
        shim_mode = base in SHIM_MODES
        return {"base": base,
                "levels": cfg.get("levels", 1 if base == "app_order" else args.levels) if shim_mode else None,
                "policy": cfg.get("policy", args.policy) if shim_mode else None,
                "partition_bytes": cfg.get("partition_bytes", args.partition_bytes if shim_mode else None),
                "bucket_cap_mb": None if base in ("compute", "calibrate") else
                cfg.get("bucket_cap_mb", self.shim_bucket_mb if shim_mode else self.bucket_mb),
                "layer_levels": cfg.get("layer_levels")}

    def attach_shim(self, mode: str, st: dict, net, opt):
        """``shim.attach`` for a shim mode (with ``layer_levels`` set on its state, if given); the handle."""
        from tensorlane import shim

        kw = {"levels": st["levels"], "agent_socket": self.args.agent_socket,
              "job": self.args.shim_job or f"{self.args.job}-{mode}",
              "policy": st["policy"]}
        if st["partition_bytes"] is not None:
            kw["partition_bytes"] = int(st["partition_bytes"])
        if st["base"] in OVERLAP_MODES:
            kw["optimizer"] = opt
        handle = shim.attach(net, **kw)
        if st["layer_levels"] is not None:  # levels the shim's policies do not give: set them on its state
            params = [p for p in net.module.parameters() if p.requires_grad]
            if len(params) != len(st["layer_levels"]):
                raise SystemExit(f"{mode}: layer_levels has {len(st['layer_levels'])} entries for "
                                 f"{len(params)} parameters")
            handle.state.param_level.update({id(p): int(lv) for p, lv in zip(params, st["layer_levels"], strict=True)})
        return handle

    def build(self, mode: str, st: dict):
        """A fresh model, its DDP wrapper (not in ``compute``), optimizer and shim handle (or None)."""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from bench.models import emulated_model

        model = emulated_model(self.args.profile, self.param_scale, self.compute_scale, seed=self.args.seed)
        net = model if st["base"] == "compute" else DDP(model, bucket_cap_mb=st["bucket_cap_mb"])
        opt = torch.optim.SGD(net.parameters(), lr=self.args.lr)
        handle = self.attach_shim(mode, st, net, opt) if st["base"] in SHIM_MODES else None
        return net, opt, handle

    def iteration(self, net, opt, rec: dict | None) -> None:
        """One forward, backward and step; with ``rec``, its phases, late wake-ups and device idle go there."""
        from bench.models import STREAM_STATS

        l0, g0 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
        t0 = time.perf_counter()
        loss = (net(self.x) - self.target).square().mean()
        t1 = time.perf_counter()
        l1, g1 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
        loss.backward()
        t2 = time.perf_counter()
        l2, g2 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if rec is not None:
            for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2),
                               ("late_forward", l1 - l0), ("late_backward", l2 - l1), ("idle_forward", g1 - g0),
                               ("idle_backward", g2 - g1)):
                rec[key].append(value)

    def register_ddp(self) -> None:
        """Register plain DDP's gloo flows (after its warm-up) at ``--ddp-level``, once per worker."""
        args = self.args
        if not (args.agent_socket and args.ddp_level >= 0 and not self.ddp_registered and self.distributed):
            return
        self.ddp_flows = job_flows(self.before, args.master[1])
        self.ddp_registered, self.agent_error = register_flows(args.agent_socket, args.job, args.ddp_level,
                                                               self.ddp_flows, args.rank, _warn)

    def timed(self, net, opt, handle, rec: dict) -> None:
        """After a barrier, ``iters + 1`` iterations back to back; their start-to-start times go to ``rec``."""
        import torch.distributed as dist

        from bench import models

        if self.distributed:
            dist.barrier()
        models.reset_stream()
        cpu0 = models.process_schedstat()
        starts = []
        for i in range(self.args.iters + 1):
            starts.append(time.perf_counter())
            self.iteration(net, opt, rec if i < self.args.iters else None)
        if handle is not None:
            handle.flush()
        rec["spans"].append(time.perf_counter() - starts[0])
        cpu1 = models.process_schedstat()
        if cpu0 and cpu1:  # the process's threads: seconds on a CPU, and in a run queue waiting for one
            rec["cpu_spans"].append(cpu1[0] - cpu0[0])
            rec["cpu_wait_spans"].append(cpu1[1] - cpu0[1])
        local = intervals(starts)
        rec["local"].extend(local)
        if self.distributed:
            rec["times"].extend(max_over_ranks(local))
            dist.barrier()
        else:
            rec["times"].extend(local)

    def run_mode(self, mode: str) -> None:
        """One run of ``mode``: warm-up, (DDP's flows registered), the timed iterations, the shim's stats."""
        import torch
        import torch.distributed as dist

        st = self.setting(mode)
        rec = self.records[mode]
        if st["base"] == "calibrate":
            rec["calibration"].append(calibrate(dist, torch))
            return
        net, opt, handle = self.build(mode, st)
        try:
            for _ in range(self.args.warmup):
                self.iteration(net, opt, None)
            if handle is not None:
                handle.flush()
            if st["base"] == "ddp":
                self.register_ddp()
            self.timed(net, opt, handle, rec)
            if handle is not None:
                rec["stats"].append(jsonable(handle.stats()))
        finally:
            if handle is not None:
                handle.close()

    def run_rounds(self) -> None:
        """Every mode ``--rounds`` times, rotating; DDP's flows are unregistered at the end."""
        try:
            for r in range(self.args.rounds):
                for mode in rotation(self.args.mode, r):
                    self.run_mode(mode)
        finally:
            if self.ddp_registered:
                unregister_flows(self.args.agent_socket, self.args.job, self.ddp_flows, _warn)

    def mode_summary(self, mode: str) -> dict:
        """One mode's figures in the JSON (``modes[mode]``)."""
        rec, st = self.records[mode], self.setting(mode)
        if st["base"] == "calibrate":
            return {"calibration": rec["calibration"][-1] if rec["calibration"] else None,
                    "rounds": rec["calibration"]}
        return {
            "times_s": rec["times"], "local_times_s": rec["local"], "median_s": statistics.median(rec["times"]),
            "mean_s": statistics.fmean(rec["times"]), "spans_s": rec["spans"],
            "cpu_spans_s": rec["cpu_spans"], "cpu_wait_spans_s": rec["cpu_wait_spans"],
            "phases_s": {k: statistics.median(rec[k]) for k in ("forward", "backward", "step")},
            "late_wakeups_s": {k: statistics.median(rec[f"late_{k}"]) for k in ("forward", "backward")},
            "device_idle_s": {k: statistics.median(rec[f"idle_{k}"]) for k in ("forward", "backward")},
            "device_idle_per_iter_s": {k: rec[f"idle_{k}"] for k in ("forward", "backward")},
            "shim_stats": rec["stats"][-1] if rec["stats"] else None,
            "levels": st["levels"], "bucket_cap_mb": st["bucket_cap_mb"], "base": st["base"],
            "policy": st["policy"], "partition_bytes": st["partition_bytes"],
        }

    def result(self, ifname: str) -> dict:
        """The worker's JSON (module docstring)."""
        from bench import models

        args, ps, cs = self.args, self.param_scale, self.compute_scale
        lb = None
        if self.distributed and args.link_rate:
            lb = models.lower_bound_s(args.profile, args.world, args.link_rate, ps, cs)
        modes_out = {mode: self.mode_summary(mode) for mode in args.mode}
        result = {
            "rank": args.rank, "world": args.world, "modes": modes_out, "mode_order": args.mode,
            "rounds": args.rounds, "profile": args.profile, "param_scale": ps, "compute_scale": cs,
            "policy": args.policy, "partition_bytes": args.partition_bytes, "iters": args.iters,
            "warmup": args.warmup, "init_s": self.init_s, "gradient_bytes": models.gradient_bytes(args.profile, ps),
            "compute_nominal_s": models.compute_s(args.profile, cs), "link_rate": args.link_rate,
            "lower_bound_s": lb, "ddp_flows": self.ddp_flows, "ddp_registered": self.ddp_registered,
            "agent_error": self.agent_error, "agent_socket": args.agent_socket, "job": args.job, "ifname": ifname,
            "stream_stats": dict(models.STREAM_STATS), "cpu_overlap": models.CPU_OVERLAP, "end_time": time.time(),
        }
        if len(args.mode) == 1:  # the one mode's figures at the top level too
            result.update({k: v for k, v in modes_out[args.mode[0]].items()
                           if k in ("times_s", "median_s", "phases_s")})
        result["configs"] = args.configs
        return result


def print_training(result: dict) -> None:
    """One line per mode of a ``training`` worker's result (calibration: its figures)."""
    rank, profile = result["rank"], result["profile"]
    for mode, m in result["modes"].items():
        if "calibration" in m:
            c = m["calibration"] or {}
            print(f"rank {rank}: calibrate: callback stall {c.get('callback_s', 0) * 1e6:.0f} us, "
                  f"launch {c.get('launch_s', 0) * 1e6:.0f} us, wake "
                  f"{c.get('wake_s', 0) * 1e6:.0f} us, copy {c.get('copy_bps', 0) / 1e9:.2f} GB/s, "
                  f"{len(c.get('samples', []))} timed all-reduces", flush=True)
            continue
        ph = m["phases_s"]
        print(f"rank {rank}: {profile} {mode}: median {m['median_s'] * 1000:.0f} ms over "
              f"{len(m['times_s'])} iterations (forward {ph['forward'] * 1000:.0f} ms, backward "
              f"{ph['backward'] * 1000:.0f} ms, step {ph['step'] * 1000:.0f} ms)", flush=True)


def training_main(argv=None) -> int:
    """``python -m bench.worker training ...``: train every mode ``--rounds`` times; results to ``--json``."""
    from bench import models

    args = training_args(argv)
    ifname = prepare(args)
    import torch.distributed as dist

    if args.strict_compute:
        models.CPU_OVERLAP = False
    worker = TrainingWorker(args)
    worker.start()
    worker.run_rounds()
    if worker.distributed:
        dist.destroy_process_group()
    result = worker.result(ifname)
    del worker
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    write_result(args, result)
    print_training(result)
    return 0


# ---------------------------------------------------------------------------------------------------- realtrain

def realtrain_args(argv=None) -> argparse.Namespace:
    """The ``realtrain`` sub-command's arguments (defaults: ``bench.realtrain.DEFAULTS``)."""
    from bench.realtrain import DEFAULTS, MODES

    p = worker_parser("realtrain", "one rank of bench.realtrain", job="realtrain", timeout=300.0,
                      json_required=True)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before the timed ones")
    p.add_argument("--width", type=int, default=DEFAULTS["width"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--momentum", type=float, default=DEFAULTS["momentum"])
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"])
    p.add_argument("--warmup-steps", type=int, default=DEFAULTS["warmup_steps"], help="linear LR warm-up")
    p.add_argument("--max-norm", type=float, default=DEFAULTS["max_norm"], help="clip_grad_norm_ bound")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--levels", type=int, default=DEFAULTS["levels"])
    p.add_argument("--shim-bucket-mb", type=float, default=DEFAULTS["shim_bucket_mb"],
                   help="DDP bucket size in the shim modes (plain DDP keeps its default 25 MB)")
    args = p.parse_args(argv)
    check_rank(p, args)
    return args


def _cnn_training(args: argparse.Namespace, mode: str) -> dict:
    """A fresh CNN for ``mode``: ``net`` (DDP-wrapped unless ``compute``), ``params``, ``opt``, ``sched``,
    ``handle`` (the shim's, or None) and ``clip``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.models import small_cnn
    from bench.realtrain import CLIP_MODES, SHIM_MODES

    net = small_cnn(args.width, seed=args.seed)
    params = list(net.parameters())
    if mode != "compute":
        cap = args.shim_bucket_mb if mode in SHIM_MODES else 25.0
        # forward_sync_buffers=False: no BatchNorm-buffer broadcast on the default group before every forward
        # (the shim registers its own groups' flows only; under bulk that broadcast would sit in the lowest
        # class). Training mode normalises with batch statistics, so the losses do not depend on it.
        net = DDP(net, bucket_cap_mb=cap, forward_sync_buffers=False)
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    handle = None
    if mode in SHIM_MODES:
        from tensorlane import shim

        handle = shim.attach(net, opt, levels=args.levels, agent_socket=args.agent_socket, job=f"{args.job}-{mode}")
    return {"net": net, "params": params, "opt": opt, "sched": sched, "handle": handle, "clip": mode in CLIP_MODES}


def _cnn_step(args: argparse.Namespace, t: dict, batch, rec: dict, timed: bool) -> float:
    """One step of the CNN ``t`` (``_cnn_training``) on ``batch``: loss, gradient norm and LR go to ``rec``, and
    with ``timed`` its phases and CPU figures too; returns the step's start (perf_counter)."""
    import torch

    from bench.models import schedstat

    x, y = batch
    c0 = schedstat() or (0.0, 0.0)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(t["net"](x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    norm = torch.nn.utils.clip_grad_norm_(t["params"], args.max_norm) if t["clip"] else None
    rec["lrs"].append(t["opt"].param_groups[0]["lr"])
    t["opt"].step()
    t["sched"].step()
    t["opt"].zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    c1 = schedstat() or (0.0, 0.0)
    rec["losses"].append(loss.item())
    rec["grad_norms"].append(None if norm is None else norm.item())
    if timed:
        for key, value in (("cpu_s", c1[0] - c0[0]), ("cpu_wait_s", c1[1] - c0[1]), ("forward", t1 - t0),
                           ("backward", t2 - t1), ("step", t3 - t2)):
            rec[key].append(value)
    return t0


def realtrain_run(args: argparse.Namespace, mode: str, batches: list):
    """One run of ``mode`` over ``batches`` (the last step is not timed): its record, and its final parameters
    (flat). Usage: ``rec, flat = realtrain_run(args, "ddp", batches)``"""
    import torch
    import torch.distributed as dist

    t = _cnn_training(args, mode)
    handle = t["handle"]
    rec = {k: [] for k in ("losses", "grad_norms", "lrs", "forward", "backward", "step", "cpu_s", "cpu_wait_s")}
    starts = []
    try:
        dist.barrier()
        for s, batch in enumerate(batches):
            starts.append(_cnn_step(args, t, batch, rec, args.warmup <= s < len(batches) - 1))
        if handle is not None:
            handle.flush()
        end = time.perf_counter()
        rec["local_times_s"] = intervals(starts[args.warmup:])
        rec["span_s"] = end - starts[args.warmup]
        if handle is not None:
            st = handle.stats()
            rec.update(shim_mode=st.get("mode"), mode_reason=st.get("mode_reason"), shim_stats=jsonable(st))
    finally:
        if handle is not None:
            handle.close()
    if mode != "compute":
        dist.barrier()
    return rec, torch.cat([p.detach().reshape(-1) for p in t["params"]])


def _warm_process(args: argparse.Namespace, batches: list) -> None:
    """Warm the process up (oneDNN's bf16 primitives, the allocator) so that the first mode does not pay for it."""
    import torch

    from bench.models import small_cnn

    warm = small_cnn(args.width, seed=args.seed + 1)
    for s in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.cross_entropy(warm(batches[s][0]), batches[s][1]).backward()


def _param_diffs(runs: dict, finals: dict) -> None:
    """Against plain DDP on the same loop (clipping or not), this round: each run's largest parameter difference."""
    from bench.realtrain import CLIP_MODES

    for mode, flat in finals.items():
        ref = finals.get("ddp" if mode in CLIP_MODES else "ddp_noclip")
        if mode != "compute" and ref is not None:
            runs[mode][-1]["param_max_abs_diff_vs_ddp"] = float((flat - ref).abs().max())


def realtrain_main(argv=None) -> int:
    """``python -m bench.worker realtrain ...``: every mode ``--rounds`` times (rotating), the losses and
    iteration times of each run, to ``--json``."""
    args = realtrain_args(argv)
    ifname = prepare(args)
    import torch.distributed as dist

    from bench.models import small_cnn, synthetic_images

    modes = [m for m in args.modes.split(",") if m]
    steps = args.warmup + args.iters + 1   # the last one is not timed: it absorbs the previous one's communication
    batches = [synthetic_images(args.rank, s, args.batch, seed=args.seed) for s in range(steps)]
    start_group(args)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    _warm_process(args, batches)
    for r in range(args.rounds):
        finals = {}
        for mode in rotation(modes, r):
            rec, finals[mode] = realtrain_run(args, mode, batches)
            runs[mode].append(rec)
        _param_diffs(runs, finals)
    dist.destroy_process_group()
    gc.collect()  # free the DDP models and their process groups now, not in the interpreter's exit (docs/shim.md, Exit)
    write_result(args, {"rank": args.rank, "world": args.world, "runs": runs, "mode_order": modes,
                        "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "steps": steps,
                        "ifname": ifname, "params": sum(p.numel() for p in small_cnn(args.width).parameters()),
                        "end_time": time.time()})
    return 0


# ---------------------------------------------------------------------------------------------------------- main

SUBCOMMANDS = {"allreduce": allreduce_main, "training": training_main, "realtrain": realtrain_main}


def main(argv=None) -> int:
    """``python -m bench.worker MODE ARGS...``: run sub-command MODE (allreduce, training, realtrain) with ARGS."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: python -m bench.worker {{{','.join(SUBCOMMANDS)}}} ARGS... (MODE --help for its options)",
              file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
