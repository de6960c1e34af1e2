"""A torch.distributed (gloo) all-reduce worker that times each all-reduce and reports its flows to the agent.

Run one per rank (inside a testbed host namespace, or on loopback with ``--ifname lo``)::

    python -m bench.allreduce --rank 0 --world 2 --master 198.18.0.1:29500 --size-mb 10 --iters 10 \
        --warmup 1 [--agent-socket /run/tensorlane/tw-h1/agent.sock --job demo --level 0] --json r0.json

After the process group is up and the warm-up all-reduce has opened gloo's connections, the worker finds its own
new TCP flows with ``shim.flows`` (leaving out the rendezvous store's connection) and registers them with the agent
at ``--level``; an absent agent is warned about once and the run goes on. Each timed all-reduce starts right after
a barrier; the JSON written to ``--json`` (``{rank}`` in the path is replaced) holds per-iteration times, local
and the maximum over ranks (what the slowest rank saw, i.e. the collective's time).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

from bench.workers import use_interface, write_json
from tensorlane.flows import new_flows, own_tcp_flows

MB = 1024 * 1024


def _parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected ADDR:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", type=_parse_master, required=True, metavar="ADDR:PORT",
                   help="rendezvous store (served by rank 0)")
    p.add_argument("--size-mb", type=float, default=10.0, help="all-reduced tensor size in MiB (float32)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--groups", type=int, default=1,
                   help="split each all-reduce over this many process groups (each has its own connections)")
    p.add_argument("--ifname", default=None,
                   help="interface gloo binds to (GLOO_SOCKET_IFNAME); default eth0 if present, else lo")
    p.add_argument("--agent-socket", default=None, help="register the flows with the agent on this socket")
    p.add_argument("--job", default="allreduce")
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for rendezvous and each collective")
    p.add_argument("--json", default=None, metavar="OUT", help="write results here ({rank} is replaced)")
    args = p.parse_args(argv)
    if args.world < 1 or not 0 <= args.rank < args.world:
        p.error(f"need 0 <= rank < world, got rank {args.rank}, world {args.world}")
    if args.iters < 1 or args.warmup < 0 or args.groups < 1 or args.size_mb <= 0:
        p.error("need --iters >= 1, --warmup >= 0, --groups >= 1, --size-mb > 0")
    return args


def _warn(msg: str) -> None:
    print(f"bench.allreduce: warning: {msg}", file=sys.stderr, flush=True)


def register_flows(socket_path: str, job: str, level: int, rank: int, flows: list[dict]) -> tuple[bool, str | None]:
    """Register ``flows`` with the agent; never raises (training goes on without the agent)."""
    from tensorlane.client import AgentClient, AgentError, AgentUnavailable

    if not flows:
        return False, "no flows found"
    try:
        with AgentClient(socket_path) as agent:
            agent.register(job, level=level, flows=flows, rank=rank)
        return True, None
    except AgentUnavailable as exc:
        _warn(f"agent unavailable, flows not prioritised: {exc}")
        return False, str(exc)
    except AgentError as exc:
        _warn(f"agent refused the flows: {exc}")
        return False, str(exc)


def unregister_flows(socket_path: str, job: str, flows: list[dict]) -> None:
    from tensorlane.client import AgentClient, AgentError, AgentUnavailable

    try:
        with AgentClient(socket_path) as agent:
            agent.unregister(job, flows=flows)
    except (AgentUnavailable, AgentError) as exc:
        _warn(f"could not unregister the flows: {exc}")


def main(argv=None) -> int:
    args = parse_args(argv)
    ifname = use_interface(args.ifname)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    master_addr, master_port = args.master
    before = own_tcp_flows()
    t_init = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    groups = [None] + [dist.new_group(list(range(args.world)), backend="gloo") for _ in range(args.groups - 1)]
    init_s = time.perf_counter() - t_init

    numel = max(args.groups, int(args.size_mb * MB) // 4)
    tensor = torch.ones(numel, dtype=torch.float32)
    chunks = list(torch.tensor_split(tensor, args.groups))

    def allreduce() -> None:
        works = [dist.all_reduce(c, group=g, async_op=True) for c, g in zip(chunks, groups)]
        for w in works:
            w.wait()

    for _ in range(args.warmup):
        allreduce()

    # gloo's connections now exist; the store's connection (to or from the master port) is not training data.
    def not_store(flow: dict) -> bool:
        return master_port not in (flow["dport"], flow["sport"]) or args.world == 1

    flows = [f for f in new_flows(before, own_tcp_flows()) if not_store(f)]
    registered, agent_error = False, None
    if args.agent_socket:
        registered, agent_error = register_flows(args.agent_socket, args.job, args.level, args.rank, flows)

    local = []
    try:
        for _ in range(args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            allreduce()
            local.append(time.perf_counter() - t0)
        times = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        collective = times.tolist()
        dist.barrier()
    finally:
        if registered:
            unregister_flows(args.agent_socket, args.job, flows)
    dist.destroy_process_group()

    result = {
        "rank": args.rank, "world": args.world, "size_bytes": numel * 4, "groups": args.groups,
        "iters": args.iters, "warmup": args.warmup, "init_s": init_s,
        "times_s": collective, "local_times_s": local, "median_s": statistics.median(collective),
        "flows": flows, "registered": registered, "agent_error": agent_error, "level": args.level,
        "job": args.job, "ifname": ifname, "end_time": time.time(),
    }
    if args.json:
        write_json(args.json, result, rank=args.rank)
    print(f"rank {args.rank}: median {result['median_s'] * 1000:.1f} ms over {args.iters} all-reduces of "
          f"{numel * 4 / MB:.1f} MiB; {len(flows)} flows{' registered' if registered else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
