"""A data-parallel training worker over an emulated model (``bench.models``): plain DDP, or DDP with the shim.

Run one per rank (inside a testbed host namespace, or on loopback with ``--ifname lo``)::

    python -m bench.training --rank 0 --world 2 --master 198.18.0.1:29600 --profile resnet50 \
        --mode ddp,app_order,shim_overlap --rounds 3 --iters 7 --warmup 2 --param-scale 5 --compute-scale 10.416 \
        [--agent-socket /run/tensorlane/tp-h1/agent.sock --job prio --levels 4] --link-rate 200mbit --json r0.json

``--mode`` takes one mode or a comma-separated list; with a list, every round runs each mode once (a fresh model,
DDP wrapper, optimizer and, for the shim modes, ``shim.attach``), the order rotating from round to round, so that
the modes are measured side by side under the same machine noise. Modes:

``ddp``
    Plain ``DistributedDataParallel`` (gloo) with buckets of ``25 MB / param_scale`` (DDP's default bucket size,
    scaled like the parameters). With ``--agent-socket`` its gloo connections are found in /proc after the
    warm-up and registered at ``--ddp-level`` (default 0; -1 leaves them unregistered), all at one level: the
    job is protected from other traffic but its tensors are not ordered.
``shim``
    ``shim.attach(ddp, levels=L)``: each bucket's pieces on L priority levels (layer order), no overlap.
``shim_overlap``
    ``shim.attach(ddp, optimizer=opt, levels=L)``: priority levels and overlap (each parameter is updated when
    its all-reduce completes; the next forward starts while later layers still synchronise).
``app_order``
    Application-level ordering only (what ByteScheduler does without network priority), as the shim gives it:
    ``shim.attach(ddp, optimizer=opt, levels=1)``. One process group, so one flow class at one level: buckets
    go to the network in the order they become ready and overlap the next forward, and the forward pre-hooks
    take each layer's update in layer order, but the network never lets an urgent piece overtake one already
    queued (no preemption, no credit-based holding back either: the shim has no such scheduler).
``compute``
    No communication: forward + backward + step of the bare emulated model on every rank at once (the realised
    compute floor under the same machine load).
``calibrate``
    No model: times uncontended all-reduces on the default group (4 KiB, 1 MiB and 4 MiB, back to back after a
    barrier each; the maximum over ranks), the host time to issue one asynchronous all-reduce (as the shim's hook
    does: narrow, ``all_reduce(async_op=True)``, future, done callback), the wake-up of a thread waiting for a
    completed all-reduce, the emulated device's time lost per all-reduce completing with a Python callback while
    the thread computes (``callback_stall``), and the host copy rate of ``Tensor.div``: the inputs of ``policies.execution``'s host
    costs (``bench.validate`` fits alpha and the link's payload rate from the all-reduce times). Its JSON entry
    is ``modes["calibrate"]["calibration"]``.

The shim modes use DDP buckets of ``--shim-bucket-cap-mb`` (default: the same as plain DDP) and
``--partition-bytes`` (default: the shim's own).

``--configs JSON`` (or ``@FILE``) names further shim configurations that ``--mode`` may list beside the modes
above, so that several of them are measured interleaved in one run::

    --configs '{"c1": {"base": "shim_overlap", "levels": 2, "policy": "layer_order", "partition_bytes": 65536,
                       "bucket_cap_mb": 0.2}}' --mode ddp,shim_overlap,c1

Fields (all optional): ``base`` (``shim_overlap``, ``app_order`` or ``shim``; default ``shim_overlap``),
``levels``, ``policy``, ``partition_bytes`` (null: the shim's own), ``bucket_cap_mb`` (DDP's bucket size in that
configuration), ``layer_levels`` (a level per parameter, forward order, set on the shim's state after ``attach``:
levels the shim's own policies do not give).

Timing: after ``--warmup`` iterations (and, in overlap modes, ``flush()``), one barrier aligns the ranks; then
``iters + 1`` iterations run back to back and iteration ``i``'s time is the interval between the starts of
iterations ``i`` and ``i + 1`` (the extra iteration is not timed: it absorbs the last one's communication). There
is no barrier per iteration: it would drain the pipeline that overlap builds, and its flow is unregistered. The
JSON's ``times_s`` are, per iteration, the maximum over ranks (the slowest rank); ``phases_s`` the local medians of
forward (including waits in the shim's pre-hooks), backward (including DDP's wait for its all-reduces) and step;
``late_wakeups_s`` how late the emulated compute's sleeps woke up (machine noise), and ``device_idle_s`` how long
the emulated device sat idle (waits for all-reduces and anything else that was not this thread's own CPU work;
see ``bench.models.emulate_compute``), per phase (the forward's includes the pause since the previous backward).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from datetime import timedelta

from bench.workers import jsonable, use_interface, write_json

MODES = ("ddp", "shim", "shim_overlap", "app_order", "compute", "calibrate")
SHIM_MODES = ("shim", "shim_overlap", "app_order")
OVERLAP_MODES = ("shim_overlap", "app_order")
DDP_DEFAULT_BUCKET_MB = 25.0
CONFIG_FIELDS = ("base", "levels", "policy", "partition_bytes", "bucket_cap_mb", "layer_levels")
CALIBRATION_SIZES = ((4096, 15), (1 << 20, 4), (4 << 20, 4))   # (bytes, repetitions) of the timed all-reduces


def _parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT, got {text!r}")
    return host.strip("[]"), int(port)


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--master", type=_parse_master, default=None, metavar="ADDR:PORT",
                   help="rendezvous store (served by rank 0); not needed for --mode compute alone")
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
    p.add_argument("--policy", default="planner", help="the shim's level policy (default: the shim's own default, the planner)")
    p.add_argument("--partition-bytes", type=int, default=None, help="the shim's partition size (default: its own)")
    p.add_argument("--agent-socket", default=None, help="the local agent's socket (shim modes; ddp: see --ddp-level)")
    p.add_argument("--job", default="train")
    p.add_argument("--ddp-level", type=int, default=0, help="level of plain DDP's flows when --agent-socket is given (-1: leave them unregistered)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--link-rate", default=None, help="link rate (e.g. 200mbit): adds lower_bound_s to the JSON")
    p.add_argument("--ifname", default=None,
                   help="interface gloo binds to (GLOO_SOCKET_IFNAME); default eth0 if present, else lo")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for rendezvous and each collective")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict-compute", action="store_true",
                   help="the training thread's CPU work adds to the emulated compute (no overlap with the device)")
    p.add_argument("--configs", default=None, metavar="JSON",
                   help="named shim configurations (JSON object, or @FILE) usable in --mode; see the module doc")
    p.add_argument("--json", default=None, metavar="OUT", help="write results here ({rank} is replaced)")
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
    if args.world < 1 or not 0 <= args.rank < args.world:
        p.error(f"need 0 <= rank < world, got rank {args.rank}, world {args.world}")
    if args.iters < 1 or args.warmup < 0 or args.levels < 1 or args.rounds < 1:
        p.error("need --iters >= 1, --warmup >= 0, --levels >= 1, --rounds >= 1")
    return args


def _scales(args) -> tuple[float, float]:
    from bench.models import DEFAULT_SCALES

    dps, dcs = DEFAULT_SCALES.get(args.profile, (1.0, 1.0))
    return (args.param_scale if args.param_scale is not None else dps,
            args.compute_scale if args.compute_scale is not None else dcs)




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
    dist.barrier()
    buf = torch.zeros(launches * 16)
    futs = []
    t0 = time.perf_counter()
    for k in range(launches):  # what the shim's hook does per piece
        piece = buf.narrow(0, 16 * k, 16)
        s0 = time.perf_counter()
        fut = dist.all_reduce(piece, async_op=True).get_future()
        fut.add_done_callback(lambda _f, s0=s0: time.perf_counter() - s0)
        futs.append(fut)
    launch = (time.perf_counter() - t0) / launches
    for fut in futs:
        fut.wait()
    stall = callback_stall(dist, torch)
    x = torch.ones((4 << 20) // 4)
    copy_times = []
    for _ in range(copies):
        c0 = time.perf_counter()
        x.div(2)
        copy_times.append(time.perf_counter() - c0)
    copy_bps = (4 << 20) / max(1e-9, statistics.median(copy_times))
    figures = torch.tensor(local + [launch, statistics.median(wakes) if wakes else 0.0, -copy_bps, stall],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    vals = figures.tolist()
    n = len(local)
    return {"samples": [[b, v] for b, v in zip(sizes_out, vals[:n])], "launch_s": vals[n], "wake_s": vals[n + 1],
            "copy_bps": -vals[n + 2], "callback_s": vals[n + 3], "launches": launches, "copies": copies}


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


def main(argv=None) -> int:
    args = parse_args(argv)
    ifname = use_interface(args.ifname)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import models
    from bench.models import (
        STREAM_STATS,
        compute_s,
        emulated_model,
        gradient_bytes,
        lower_bound_s,
        synthetic_batch,
    )
    from tensorlane.flows import new_flows, own_tcp_flows

    torch.set_num_threads(1)
    if args.strict_compute:
        models.CPU_OVERLAP = False
    param_scale, compute_scale = _scales(args)
    distributed = args.master is not None
    bucket_mb = args.bucket_cap_mb if args.bucket_cap_mb is not None else DDP_DEFAULT_BUCKET_MB / param_scale
    shim_bucket_mb = args.shim_bucket_cap_mb if args.shim_bucket_cap_mb is not None else bucket_mb
    x, target = synthetic_batch(args.rank, 0)

    before = own_tcp_flows()
    t_init = time.perf_counter()
    if distributed:
        master_addr, master_port = args.master
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=args.timeout))
    init_s = time.perf_counter() - t_init
    ddp_flows, ddp_registered, agent_error = [], False, None

    per_mode = {m: {"times": [], "local": [], "forward": [], "backward": [], "step": [], "late_forward": [],
                    "late_backward": [], "idle_forward": [], "idle_backward": [], "stats": [], "spans": [],
                    "calibration": []} for m in args.mode}

    def setting(mode: str) -> dict:
        """What one mode (or --configs name) runs: base mode, levels, policy, partition, bucket size."""
        cfg = args.configs.get(mode, {})
        base = cfg.get("base", mode)
        shim_mode = base in SHIM_MODES
        return {"base": base,
                "levels": cfg.get("levels", 1 if base == "app_order" else args.levels) if shim_mode else None,
                "policy": cfg.get("policy", args.policy) if shim_mode else None,
                "partition_bytes": cfg.get("partition_bytes", args.partition_bytes if shim_mode else None),
                "bucket_cap_mb": None if base in ("compute", "calibrate") else
                cfg.get("bucket_cap_mb", shim_bucket_mb if shim_mode else bucket_mb),
                "layer_levels": cfg.get("layer_levels")}

    def run_mode(mode: str) -> None:
        nonlocal ddp_flows, ddp_registered, agent_error
        st = setting(mode)
        base = st["base"]
        rec = per_mode[mode]
        if base == "calibrate":
            rec["calibration"].append(calibrate(dist, torch))
            return
        model = emulated_model(args.profile, param_scale, compute_scale, seed=args.seed)
        if base == "compute":
            net = model
        else:
            net = DDP(model, bucket_cap_mb=st["bucket_cap_mb"])
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        handle = None
        if base in SHIM_MODES:
            from tensorlane import shim

            kw = {"levels": st["levels"], "agent_socket": args.agent_socket, "job": f"{args.job}-{mode}",
                  "policy": st["policy"]}
            if st["partition_bytes"] is not None:
                kw["partition_bytes"] = int(st["partition_bytes"])
            if base in OVERLAP_MODES:
                kw["optimizer"] = opt
            handle = shim.attach(net, **kw)
            if st["layer_levels"] is not None:  # levels the shim's policies do not give: set them on its state
                params = [p for p in net.module.parameters() if p.requires_grad]
                if len(params) != len(st["layer_levels"]):
                    raise SystemExit(f"{mode}: layer_levels has {len(st['layer_levels'])} entries for "
                                     f"{len(params)} parameters")
                handle.state.param_level.update({id(p): int(lv) for p, lv in zip(params, st["layer_levels"])})

        def iteration(record: bool) -> None:
            l0, g0 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
            t0 = time.perf_counter()
            y = net(x)
            loss = (y - target).square().mean()
            t1 = time.perf_counter()
            l1, g1 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
            loss.backward()
            t2 = time.perf_counter()
            l2, g2 = STREAM_STATS["late_s"], STREAM_STATS["idle_s"]
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if record:
                rec["forward"].append(t1 - t0)
                rec["backward"].append(t2 - t1)
                rec["step"].append(t3 - t2)
                rec["late_forward"].append(l1 - l0)
                rec["late_backward"].append(l2 - l1)
                rec["idle_forward"].append(g1 - g0)
                rec["idle_backward"].append(g2 - g1)

        try:
            for _ in range(args.warmup):
                iteration(False)
            if handle is not None:
                handle.flush()
            if base == "ddp" and args.agent_socket and args.ddp_level >= 0 and not ddp_registered and distributed:
                from bench.allreduce import register_flows

                port = args.master[1]
                ddp_flows = [f for f in new_flows(before, own_tcp_flows()) if port not in (f["dport"], f["sport"])]
                ddp_registered, agent_error = register_flows(args.agent_socket, args.job, args.ddp_level, args.rank,
                                                             ddp_flows)
            if distributed:
                dist.barrier()
            models.reset_stream()
            starts = []
            for i in range(args.iters + 1):
                starts.append(time.perf_counter())
                iteration(i < args.iters)
            if handle is not None:
                handle.flush()
            rec["spans"].append(time.perf_counter() - starts[0])
            local = [b - a for a, b in itertools.pairwise(starts)]
            rec["local"].extend(local)
            if distributed:
                times = torch.tensor(local, dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                rec["times"].extend(times.tolist())
                dist.barrier()
            else:
                rec["times"].extend(local)
            if handle is not None:
                rec["stats"].append(jsonable(handle.stats()))
        finally:
            if handle is not None:
                handle.close()

    try:
        for r in range(args.rounds):
            k = r % len(args.mode)
            for mode in args.mode[k:] + args.mode[:k]:
                run_mode(mode)
    finally:
        if ddp_registered:
            from bench.allreduce import unregister_flows

            unregister_flows(args.agent_socket, args.job, ddp_flows)
    if distributed:
        dist.destroy_process_group()

    lb = None
    if distributed and args.link_rate:
        lb = lower_bound_s(args.profile, args.world, args.link_rate, param_scale, compute_scale)
    modes_out = {}
    for mode, rec in per_mode.items():
        st = setting(mode)
        if st["base"] == "calibrate":
            modes_out[mode] = {"calibration": rec["calibration"][-1] if rec["calibration"] else None,
                               "rounds": rec["calibration"]}
            continue
        modes_out[mode] = {
            "times_s": rec["times"], "local_times_s": rec["local"], "median_s": statistics.median(rec["times"]),
            "mean_s": statistics.fmean(rec["times"]), "spans_s": rec["spans"],
            "phases_s": {k: statistics.median(rec[k]) for k in ("forward", "backward", "step")},
            "late_wakeups_s": {k: statistics.median(rec[f"late_{k}"]) for k in ("forward", "backward")},
            "device_idle_s": {k: statistics.median(rec[f"idle_{k}"]) for k in ("forward", "backward")},
            "device_idle_per_iter_s": {k: rec[f"idle_{k}"] for k in ("forward", "backward")},
            "shim_stats": rec["stats"][-1] if rec["stats"] else None,
            "levels": st["levels"], "bucket_cap_mb": st["bucket_cap_mb"], "base": st["base"],
            "policy": st["policy"], "partition_bytes": st["partition_bytes"],
        }
    result = {
        "rank": args.rank, "world": args.world, "modes": modes_out, "mode_order": args.mode, "rounds": args.rounds,
        "profile": args.profile, "param_scale": param_scale, "compute_scale": compute_scale,
        "policy": args.policy, "partition_bytes": args.partition_bytes, "iters": args.iters, "warmup": args.warmup,
        "init_s": init_s, "gradient_bytes": gradient_bytes(args.profile, param_scale),
        "compute_nominal_s": compute_s(args.profile, compute_scale), "link_rate": args.link_rate,
        "lower_bound_s": lb, "ddp_flows": ddp_flows, "ddp_registered": ddp_registered, "agent_error": agent_error,
        "agent_socket": args.agent_socket, "job": args.job, "ifname": ifname, "stream_stats": dict(STREAM_STATS),
        "cpu_overlap": models.CPU_OVERLAP,
        "end_time": time.time(),
    }
    if len(args.mode) == 1:  # the one mode's figures at the top level too
        result.update({k: v for k, v in modes_out[args.mode[0]].items() if k in ("times_s", "median_s", "phases_s")})
    result["configs"] = args.configs
    if args.json:
        write_json(args.json, result, rank=args.rank)
    for mode, m in modes_out.items():
        if "calibration" in m:
            c = m["calibration"] or {}
            print(f"rank {args.rank}: calibrate: callback stall {c.get('callback_s', 0) * 1e6:.0f} us, "
                  f"launch {c.get('launch_s', 0) * 1e6:.0f} us, wake "
                  f"{c.get('wake_s', 0) * 1e6:.0f} us, copy {c.get('copy_bps', 0) / 1e9:.2f} GB/s, "
                  f"{len(c.get('samples', []))} timed all-reduces", flush=True)
            continue
        ph = m["phases_s"]
        print(f"rank {args.rank}: {args.profile} {mode}: median {m['median_s'] * 1000:.0f} ms over "
              f"{len(m['times_s'])} iterations (forward {ph['forward'] * 1000:.0f} ms, backward "
              f"{ph['backward'] * 1000:.0f} ms, step {ph['step'] * 1000:.0f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
