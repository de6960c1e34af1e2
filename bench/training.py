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

The shim modes use DDP buckets of ``--shim-bucket-cap-mb`` (default: the same as plain DDP) and
``--partition-bytes`` (default: the shim's own).

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

from bench.workers import use_interface, write_json

MODES = ("ddp", "shim", "shim_overlap", "app_order", "compute")
SHIM_MODES = ("shim", "shim_overlap", "app_order")
OVERLAP_MODES = ("shim_overlap", "app_order")
DDP_DEFAULT_BUCKET_MB = 25.0


def _parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes must be a comma-separated subset of {','.join(MODES)}, not {text!r}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode is repeated in {text!r}")
    return modes


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
    p.add_argument("--policy", default="layer_order", help="the shim's level policy")
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
    p.add_argument("--json", default=None, metavar="OUT", help="write results here ({rank} is replaced)")
    args = p.parse_args(argv)
    if args.mode == ["compute"] and args.master is None:
        args.world, args.rank = 1, 0
    elif args.master is None:
        p.error("--master is needed unless --mode compute")
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


def _jsonable(obj):
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return repr(obj)


def main(argv=None) -> int:
    args = parse_args(argv)
    ifname = use_interface(args.ifname)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench import models
    from bench.models import STREAM_STATS, compute_s, emulated_model, gradient_bytes, lower_bound_s, synthetic_batch
    from shim.flows import new_flows, own_tcp_flows

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
                    "late_backward": [], "idle_forward": [], "idle_backward": [], "stats": [], "spans": []} for m in args.mode}

    def run_mode(mode: str) -> None:
        nonlocal ddp_flows, ddp_registered, agent_error
        model = emulated_model(args.profile, param_scale, compute_scale, seed=args.seed)
        if mode == "compute":
            net = model
        else:
            net = DDP(model, bucket_cap_mb=shim_bucket_mb if mode in SHIM_MODES else bucket_mb)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        handle = None
        if mode in SHIM_MODES:
            import shim

            kw = {"levels": 1 if mode == "app_order" else args.levels, "agent_socket": args.agent_socket,
                  "job": f"{args.job}-{mode}", "policy": args.policy}
            if args.partition_bytes is not None:
                kw["partition_bytes"] = args.partition_bytes
            if mode in OVERLAP_MODES:
                kw["optimizer"] = opt
            handle = shim.attach(net, **kw)
        rec = per_mode[mode]

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
            if mode == "ddp" and args.agent_socket and args.ddp_level >= 0 and not ddp_registered and distributed:
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
                rec["stats"].append(_jsonable(handle.stats()))
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
        modes_out[mode] = {
            "times_s": rec["times"], "local_times_s": rec["local"], "median_s": statistics.median(rec["times"]),
            "mean_s": statistics.fmean(rec["times"]), "spans_s": rec["spans"],
            "phases_s": {k: statistics.median(rec[k]) for k in ("forward", "backward", "step")},
            "late_wakeups_s": {k: statistics.median(rec[f"late_{k}"]) for k in ("forward", "backward")},
            "device_idle_s": {k: statistics.median(rec[f"idle_{k}"]) for k in ("forward", "backward")},
            "shim_stats": rec["stats"][-1] if rec["stats"] else None,
            "levels": (1 if mode == "app_order" else args.levels) if mode in SHIM_MODES else None,
            "bucket_cap_mb": None if mode == "compute" else (shim_bucket_mb if mode in SHIM_MODES else bucket_mb),
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
    if args.json:
        write_json(args.json, result, rank=args.rank)
    for mode, m in modes_out.items():
        ph = m["phases_s"]
        print(f"rank {args.rank}: {args.profile} {mode}: median {m['median_s'] * 1000:.0f} ms over "
              f"{len(m['times_s'])} iterations (forward {ph['forward'] * 1000:.0f} ms, backward "
              f"{ph['backward'] * 1000:.0f} ms, step {ph['step'] * 1000:.0f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
