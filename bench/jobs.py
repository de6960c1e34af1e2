"""Jobs sharing hosts: job completion times of *mixes* of training jobs under FIFO and under the agent's job
policies (``static``, ``rotate``, ``intensity``: agent/jobs.py, docs/jobs.md), against each job alone.

On one namespace testbed (2 hosts at 50 Mbit/s by default: :data:`DEFAULT_RATE`; 4 for ``spread4``) every mix runs its
jobs side by side: each job is plain DDP (``bench.worker training --mode ddp``, gloo) over an emulated model
(``bench.models``), one rank on each of its two hosts, a fixed number of iterations, its flows registered with its
host's agent at level 0 under its own job id. The jobs of a mix differ in model size and iteration time, and each
communicates for only part of its iteration (``comm_s`` = its gradients' all-reduce at link rate, 30-60 % of its solo
iteration), so that priority can make them interleave: the favoured job communicates at full rate while the others
compute (CASSINI, Crux, MLTCP).

Mixes (:data:`MIXES`; periods and offsets are multiplied by ``time_scale``, 0.5 in the quick mode):

``collide2``  resnet50 (comm 0.5 of its period) and bert_base (0.35), both scaled to the same 1.2 s solo
              iteration, released together: their communication collides under FIFO (the CASSINI case);
``collide2x`` the same case with communication that cannot overlap with compute: resnet50 (0.45) and bert_base
              (0.4), each reducing all its gradients after backward (one DDP bucket, :data:`ONE_BUCKET_MB`);
``stagger2``  vgg16 (0.45 of 1.0 s) and resnet50 (0.4 of 1.5 s), the second 2 s later;
``stagger3``  resnet50 (0.3 of 1.2 s), vgg16 (0.3 of 1.0 s), bert_base (0.3 of 1.5 s), 1.5 s apart;
``stagger4``  stagger3's jobs (vgg16 at 0.35) plus resnet50 (0.35 of 0.9 s), 1 s apart: more than the link;
``spread4``   four jobs (0.4-0.45 of 0.9-1.5 s, 1 s apart) on a ring of four hosts (:data:`MIX_HOSTS`): each
              host's link carries two of them, within the link, and each host's agent sees only those two;
``oversub2``  two identical resnet50 jobs, compute = communication (0.82 s each): more than the link;
``collide2e``, ``collide3`` (opt-in, not in :data:`DEFAULT_MIXES`): colliding variants, resnet50 (0.45) and
              bert_base (0.42); resnet50, bert_base, vgg16 at 0.3 each; all at 1.2 s, released together;
``apart4``    (opt-in) spread4's jobs, each on its own two hosts (8 hosts): no link shared, so its loss against
              alone is what eight ranks at once cost on this machine's CPUs.

A job's ``param_scale`` is ``bench.models.balanced_scales(profile, rate, 2, fraction x period)[0]`` and its
``compute_scale`` is solved so that ``policies.execution.ddp_iteration`` (calibrated as ``bench.validate`` found this
testbed: :data:`ALPHA_S`, :data:`COMPUTE_FACTOR`) predicts the period as its solo iteration. Per mix: ``fits_link`` =
on every host's link, the sum over its jobs of ``comm_s / solo_iteration_s`` <= 1 (predicted solo iterations),
``collides`` = every job has the same period (within 2 %) and the same start offset. A design's fifth entry, when
given, is DDP's bucket in MB of the full-size model (the worker's ``--bucket-cap-mb`` divided by ``param_scale``).

Phases per mix, each with fresh agents and one release barrier (every rank sets up first -- imports, rendezvous,
DDP's construction, the shim's, the registration of its flows, the warm-up iterations -- then waits for a go file
that holds its start time):
``solo`` (each job alone, one after the other in one phase: agents with ``job_policy = "none"``), ``solo_shim``
(the same, every job with the shim), ``fifo`` (``none``: all jobs' flows at level 0, FIFO between jobs),
``static`` (``job_priority`` from the job order), ``rotate`` and ``alternate`` (``rotate_epoch_s`` =
``epoch_factor`` x the longest predicted solo iteration), ``intensity`` (``job_intensity`` = each job's
compute_s / comm_s, Crux's GPU intensity), ``shortest`` (no table: the jobs' shims, in hook mode at one level,
report the bytes of one step, fewest first), ``measured_intensity`` (no table: the jobs as in ``shortest`` report
their step bytes and agreed compute time, most compute per byte first; 4 warm-up iterations instead of 1, so that the
ranks' first agreement, at the end of their third step, is in before the release) and ``levels`` (``none``, every
job with the shim: overlap mode, its tensors on the shim's levels; judged against the faster of its two solo runs);
opt-in, ``static_levels`` (``static``'s order, every job with the shim as in ``levels``, its levels inside its job's
band), ``intensity_hook`` (``intensity``'s table, the jobs as in ``shortest``), ``static_present`` and
``intensity_present`` (those orders with ``job_share`` split among the jobs present, not those sending),
``static_held``, ``intensity_held`` and ``shortest_held`` (those orders with ``job_hold_s`` = :data:`HELD_S`, or
``--held-s``), ``fifo_control`` (FIFO
once more, an A/A control: its ratios to FIFO are the machine's spread, and no target judges it) and ``slowdown``
(no table: the jobs as in ``measured_intensity`` also report the window of their last steps at every step's end; the
job furthest behind its ideal step first, re-ranked by the agents every ``job_sample_s``). Job ``i``
starts ``offset_s`` after the common release; its JCT runs from its own start to the end of its slowest rank's last
iteration. Each rank reads, before it exits, ``tcpi_total_rto`` of its TCP connections to its peer (``rto``:
retransmission timeouts, summed over the job's ranks; None on kernels older than 6.7), ``late_s`` of its emulated
compute (``compute_late_s``: how late the sleeps woke up in all; the emulated device takes that back from the next
kernel, so it gauges the machine's load and is not time added to the JCT) and, over the timed iterations, the
seconds its threads spent on a CPU and in a run queue waiting for one (``cpu_s``, ``cpu_wait_s``).

Targets per mix (:data:`TARGETS`, for the policy :data:`RECOMMENDED` for the mix's kind): on a mix that fits the
link, every job's JCT <= 1.02 x its FIFO JCT and <= 1.15 x its solo JCT; on a colliding mix the average JCT
<= 0.80 x FIFO's; on a mix that does not fit, no job above 1.05 x its FIFO JCT under any policy (averages reported).

Usage: ``python -m bench.jobs --json out.json [--quick] [--mixes collide2,...] [--policies fifo,static,...]``
(root: it builds network namespaces), or ``run(quick=True)`` from Python. The workers are ``python -m bench.jobs
worker --ready F --go F -- TRAINING-ARGS`` (``bench.worker``'s ``training`` held at a barrier before its timed
iterations, reading its sockets' retransmission timeouts before it exits).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

from bench.workers import (
    REPO_ROOT,
    ScenarioError,
    cli,
    needs_root,
    progress_printer,
    ratio,
    reap_workers,
    scratch_dir,
    show_figures,
    tail,
    text_table,
    wait_worker,
    worker_env,
)
from tensorlane.policies.jobs import REPORTED_INPUTS, ROTATING

RECOMMENDED = {"colliding": "static", "staggered": "levels", "oversubscribed": "levels"}  # docs/jobs.md, measured
# The agent settings docs/jobs.md recommends per kind, beyond the defaults: on a link the jobs oversubscribe, large
# guaranteed parts, so that no job order takes much from any job (the default's small parts keep the colliding
# mix's interleaving); what the run passes (--job-share) wins.
RECOMMENDED_AGENT = {"oversubscribed": {"job_share": 0.95}}


def mix_agent(kind: str, passed: dict) -> dict:
    """The agent settings a mix of ``kind`` runs with: :data:`RECOMMENDED_AGENT`'s for the kind, then what the run
    passed (``passed`` wins). Usage: ``mix_agent("oversubscribed", {})["job_share"] == 0.95``"""
    return {**RECOMMENDED_AGENT.get(kind, {}), **passed}


def mix_kind(fits_link: bool, collides: bool) -> str:
    """What an operator can tell about a mix before it runs: ``colliding`` (the jobs share a period and start
    together, and their communication fits the link), ``staggered`` (it fits, but they do not collide) or
    ``oversubscribed`` (their communication needs more than the link)."""
    if not fits_link:
        return "oversubscribed"
    return "colliding" if collides else "staggered"


def recommended_policy(fits_link: bool, collides: bool) -> str:
    """The job policy docs/jobs.md recommends for a mix of this kind (:data:`RECOMMENDED`): the one its targets
    judge. Usage: ``recommended_policy(True, True) == "static"``"""
    return RECOMMENDED[mix_kind(fits_link, collides)]
POLICIES = ("fifo", "static", "rotate", "alternate", "intensity", "shortest", "measured_intensity", "levels")
# opt-in (--policies): ``static_levels``, static's job order with every job running the shim (its levels inside
# its job's band); ``intensity_hook``, intensity's table with shortest's jobs (the shim in hook mode at one level),
# which tells the order's effect from the shim's where both orders agree; ``static_present`` and
# ``intensity_present``, those orders with job_share split among the jobs present (the agents' "present"), beside
# the default split among the jobs sending: the two ways side by side in one run; ``static_held``,
# ``intensity_held`` and ``shortest_held``, those orders with a job counted as sending for HELD_S (or the run's
# ``held_s``) after its last backlog (the agents' job_hold_s), beside the run's own job_hold_s; ``fifo_control``,
# FIFO once more: an A/A control, whose JCTs against FIFO's show how far this machine moves a ratio with no policy
# at all (not a policy: no target judges it); ``slowdown``, the job furthest behind its ideal step over its last
# steps first (the agents' job_policy "slowdown"), its jobs as measured_intensity's (the shim in hook mode at one
# level, whose reports carry the window of its last steps); ``static_auto`` and ``shortest_auto``, those orders
# with the agents' job_share "auto" (the part follows whether the jobs saturate the link) instead of the mix's
# recommended job_share: what an agent finds by itself beside what the operator sets by the mix's kind
OPT_IN_POLICIES = ("static_levels", "intensity_hook", "static_present", "intensity_present", "static_held",
                   "intensity_held", "shortest_held", "fifo_control", "slowdown", "static_auto", "shortest_auto")
CONTROLS = ("fifo", "fifo_control")  # FIFO and its A/A control: what the policies are judged against
HELD_S = 0.2
SOLOS = ("solo", "solo_shim")
DEFAULT_PHASES = (*SOLOS, *POLICIES)
PHASES = (*DEFAULT_PHASES, *OPT_IN_POLICIES)
AGENT_POLICY = {"solo": "none", "solo_shim": "none", "fifo": "none", "static": "static", "rotate": "rotate",
                "alternate": "alternate", "intensity": "intensity", "shortest": "shortest", "levels": "none",
                "static_levels": "static", "intensity_hook": "intensity", "measured_intensity": "measured_intensity",
                "static_present": "static", "intensity_present": "intensity", "static_held": "static",
                "intensity_held": "intensity", "shortest_held": "shortest", "fifo_control": "none",
                "slowdown": "slowdown", "static_auto": "static", "shortest_auto": "shortest"}
PHASE_AGENT = {"static_present": {"job_share_among": "present"},  # a phase's own agent settings: they win
               "intensity_present": {"job_share_among": "present"},
               "static_held": {"job_hold_s": HELD_S}, "intensity_held": {"job_hold_s": HELD_S},
               "shortest_held": {"job_hold_s": HELD_S},  # a held phase's hold: the run's held_s
               "static_auto": {"job_share": "auto"}, "shortest_auto": {"job_share": "auto"}}
SAMPLED = ("job_sample_s", "job_hold_s")  # agent settings only for parts among the jobs sending
# what each job runs: plain DDP at one level, DDP with the shim (overlap, the shim's levels in layer order), or
# (``shortest``) the shim in hook mode at one level, unpartitioned: plain DDP's schedule (one all-reduce per DDP
# bucket), with the reports of its step bytes that the agents order the jobs by
JOB_MODE = {"solo_shim": "shim_overlap", "levels": "shim_overlap", "static_levels": "shim_overlap",
            "shortest": "shim", "shortest_held": "shim", "intensity_hook": "shim", "measured_intensity": "shim",
            "slowdown": "shim", "shortest_auto": "shim"}
HOOK_ONE_LEVEL = {"levels": 1, "shim_policy": "layer_order"}
JOB_SHIM = {"shortest": HOOK_ONE_LEVEL, "shortest_held": HOOK_ONE_LEVEL, "shortest_auto": HOOK_ONE_LEVEL,
            "intensity_hook": HOOK_ONE_LEVEL,
            "measured_intensity": {**HOOK_ONE_LEVEL, "warmup": 4},  # (a real job's first steps are few of many)
            "slowdown": {**HOOK_ONE_LEVEL, "warmup": 4}}  # (ranked once the compute time is agreed, as above)
# (profile, communication fraction of the period, period s, start offset s[, DDP bucket MB of the full-size model]);
# None, None: compute = communication. The bucket defaults to DDP's 25 MB; ONE_BUCKET_MB puts every gradient in one
# bucket, reduced after backward ends: communication that cannot overlap with compute.
ONE_BUCKET_MB = 1e6
MIXES = {
    "collide2": [("resnet50", 0.5, 1.2, 0.0), ("bert_base", 0.35, 1.2, 0.0)],
    "stagger2": [("vgg16", 0.45, 1.0, 0.0), ("resnet50", 0.4, 1.5, 2.0)],
    "stagger3": [("resnet50", 0.3, 1.2, 0.0), ("vgg16", 0.3, 1.0, 1.5), ("bert_base", 0.3, 1.5, 3.0)],
    "stagger4": [("resnet50", 0.3, 1.2, 0.0), ("vgg16", 0.35, 1.0, 1.0), ("bert_base", 0.3, 1.5, 2.0),
                 ("resnet50", 0.35, 0.9, 3.0)],
    "oversub2": [("resnet50", None, None, 0.0), ("resnet50", None, None, 0.0)],
    # opt-in (--mixes): colliding variants that ask how much FIFO loses when the phases collide (docs/jobs-measured.md)
    "collide2e": [("resnet50", 0.45, 1.2, 0.0), ("bert_base", 0.42, 1.2, 0.0)],
    "collide3": [("resnet50", 0.3, 1.2, 0.0), ("bert_base", 0.3, 1.2, 0.0), ("vgg16", 0.3, 1.2, 0.0)],
    # the CASSINI case with phases that block: each job reduces its gradients after backward (one bucket), so its
    # communication is a phase of its own and FIFO's collisions lengthen every iteration by the other's bytes
    "collide2x": [("resnet50", 0.45, 1.2, 0.0, ONE_BUCKET_MB), ("bert_base", 0.4, 1.2, 0.0, ONE_BUCKET_MB)],
    # four jobs spread over four hosts in a ring (MIX_HOSTS): every host, and so every link, carries two of them
    "spread4": [("resnet50", 0.45, 1.2, 0.0), ("vgg16", 0.4, 1.0, 1.0), ("bert_base", 0.45, 1.5, 2.0),
                ("resnet50", 0.4, 0.9, 3.0)],
    # opt-in: spread4's jobs with no link shared (MIX_HOSTS): what running eight ranks at once costs on this
    # machine's CPUs alone, the part of spread4's loss against alone that no order of the link can take back
    "apart4": [("resnet50", 0.45, 1.2, 0.0), ("vgg16", 0.4, 1.0, 1.0), ("bert_base", 0.45, 1.5, 2.0),
               ("resnet50", 0.4, 0.9, 3.0)],
}
# the testbed hosts of each job's two ranks (rank 0 first); a mix not listed runs every job on hosts 1 and 2
MIX_HOSTS = {"spread4": ((1, 2), (2, 3), (3, 4), (4, 1)), "apart4": ((1, 2), (3, 4), (5, 6), (7, 8))}
DEFAULT_HOSTS = (1, 2)
# collide2x first: bench.report's headline is the first colliding mix that fits the link, and collide2x is the case
# CASSINI models (communication a phase of its own); collide2's FIFO costs its jobs too little for any order to reach
# 0.80x (docs/jobs-measured.md)
DEFAULT_MIXES = ("collide2x", "collide2", "stagger2", "stagger3", "stagger4", "spread4", "oversub2")
QUICK_MIXES = ("collide2",)
# 50 Mbit/s: on this 2-core machine the kernel's and gloo's work per byte (veth, bridge, HTB, the reduction) takes
# CPU from the jobs, so at higher rates a favoured job misses its solo speed for want of CPU, not of link. collide2,
# static: 18.6 s vs 16.3 s alone at 200 Mbit/s, 16.3 s vs 15.7 s at 100. collide2x, static: at 100 Mbit/s the
# favoured job's median iteration was 3-10 % above its solo one in three runs (each job's ranks 5-7 s on a CPU); at
# 50 Mbit/s, with half the bytes in the same periods, 0-4 % (about 3 s on a CPU), and static 0.76-0.77x FIFO in every
# run (docs/jobs-measured.md, "The link's rate and the CPU"). The periods and fractions do not depend on the rate
# (bench.models scales the gradients' bytes to it).
DEFAULT_RATE = "50mbit"
OVERSUB_COMM_S = 0.75    # oversub2: bench.models' default balance, compute = communication
TARGETS = {"fits_vs_fifo_max": 1.02, "fits_vs_solo_max": 1.15, "collide_avg_vs_fifo_max": 0.80,
           "oversub_vs_fifo_max": 1.05}
DEFAULT_ITERS = 12
DEFAULT_WARMUP = 1        # DDP's first iteration (bucket rebuild) runs before the release, outside every JCT
QUICK_ITERS = 4
QUICK_TIME_SCALE = 0.5
DEFAULT_EPOCH_FACTOR = 2.0
START_DELAY_S = 0.5
# the testbed as bench.validate calibrated it (results/validate.json): per-all-reduce startup and how much longer
# the emulated compute takes than its nominal sleeps on this machine
ALPHA_S = 3.3e-3
COMPUTE_FACTOR = 1.05
TCP_INFO_LEN = 256
TCPI_TOTAL_RTO = 240       # u16 tcpi_total_rto (Linux 6.7+)
TCPI_TOTAL_RTO_TIME = 244  # u32 tcpi_total_rto_time, ms


# ---- the worker: set-up first, then its start; its sockets' retransmission timeouts at the end -------------------

def tcp_info_rto(info: bytes) -> tuple[int | None, int | None]:
    """``(tcpi_total_rto, tcpi_total_rto_time ms)`` of a TCP_INFO reply; None where the kernel's is too short."""
    rto = int.from_bytes(info[TCPI_TOTAL_RTO:TCPI_TOTAL_RTO + 2], sys.byteorder) \
        if len(info) >= TCPI_TOTAL_RTO + 2 else None
    rto_ms = int.from_bytes(info[TCPI_TOTAL_RTO_TIME:TCPI_TOTAL_RTO_TIME + 4], sys.byteorder) \
        if len(info) >= TCPI_TOTAL_RTO_TIME + 4 else None
    return rto, rto_ms


def job_socket_fds(before: list[dict], master_port: int) -> list[int]:
    """This process's file descriptors of its job's TCP connections: the established flows opened since ``before``
    less the rendezvous store's (``bench.worker.job_flows``, the flows the worker registers), found by inode."""
    from bench.worker import job_flows
    from tensorlane.flows import FlowKey, flow_key, parse_proc_net_tcp, socket_fds

    wanted = {flow_key(f) for f in job_flows(before, master_port)}
    by_inode = socket_fds("self")
    fds = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/self/net/{table}") as fh:
            for inode, _, (laddr, lport), (raddr, rport) in parse_proc_net_tcp(fh.read(), v6, set(by_inode)):
                if FlowKey("tcp", str(laddr), lport, str(raddr), rport) in wanted:
                    fds.append(by_inode[inode])
    return sorted(set(fds))


def socket_rto(before: list[dict], master_port: int) -> dict:
    """``{"rto", "rto_time_ms", "rto_sockets"}``: the sum of ``tcpi_total_rto`` (and its time) over this process's
    connections to its job's peers (:func:`job_socket_fds`); None where the kernel does not report it."""
    import socket

    total, total_ms, n = 0, 0, 0
    for fd in job_socket_fds(before, master_port):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            rto, rto_ms = tcp_info_rto(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN))
        except OSError:
            continue
        finally:
            s.close()
        total = None if rto is None or total is None else total + rto
        total_ms = None if rto_ms is None or total_ms is None else total_ms + rto_ms
        n += 1
    return {"rto": total if n else None, "rto_time_ms": total_ms if n else None, "rto_sockets": n}


def _wait_for_go(ready: str, go: str, timeout: float) -> None:
    """Create ``ready``, wait (bounded) for ``go`` (it holds a wall-clock start time) and sleep until then."""
    with open(ready, "w") as fh:
        fh.write(repr(time.time()))
    deadline = time.monotonic() + timeout
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {go} within {timeout:g} s")
        time.sleep(0.01)
    with open(go) as fh:
        start = float(fh.read())
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)


def releases(args: tuple, kwargs: dict) -> bool:
    """Whether a ``dist.barrier(*args, **kwargs)`` call is on the default group (``bench.worker``'s barrier before
    the timed iterations), not on a group of the shim's. Usage: ``releases((), {}) and not releases((), {"group": g})``
    """
    return kwargs.get("group", args[0] if args else None) is None


def _master_port(training: list[str]) -> int:
    """The port of ``--master ADDR:PORT`` in ``bench.worker training``'s arguments."""
    return int(training[training.index("--master") + 1].rpartition(":")[2])


def worker(argv: list[str]) -> int:
    """``worker --ready FILE --go FILE [--timeout S] -- TRAINING-ARGS``: run
    ``bench.worker.training_main(TRAINING-ARGS)`` with two changes. Its first ``dist.barrier()`` on the default group
    (the one before the timed iterations, after rendezvous, DDP's set-up, the shim's, the registration of the flows
    and the warm-up iterations) is followed by a barrier across all jobs: create ``--ready``, wait (bounded) for
    ``--go`` and sleep until the start time written in it. (The shim's own barriers, on its level groups, pass
    through: until 2026-11-24 the first of them released the jobs, so that a shim job's set-up and warm-up ran after
    the release.)
    Its ``dist.destroy_process_group()`` first reads ``tcpi_total_rto`` of its connections to its peer
    (:func:`socket_rto`), which then goes into its result JSON (``rto``, ``rto_time_ms``, ``rto_sockets``)."""
    p = argparse.ArgumentParser(prog="python -m bench.jobs worker")
    p.add_argument("--ready", required=True)
    p.add_argument("--go", required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("training", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rest = args.training[1:] if args.training[:1] == ["--"] else args.training
    import torch.distributed as dist

    import bench.worker as bench_worker
    from tensorlane.flows import own_tcp_flows

    before, port, rto = own_tcp_flows(), _master_port(rest), {}
    real_barrier, real_destroy, real_write = dist.barrier, dist.destroy_process_group, bench_worker.write_result
    first = [True]

    def barrier(*a, **kw):
        out = real_barrier(*a, **kw)
        if first[0] and releases(a, kw):
            first[0] = False
            _wait_for_go(args.ready, args.go, args.timeout)
        return out

    def destroy(*a, **kw):
        if not rto:
            rto.update(socket_rto(before, port))
        return real_destroy(*a, **kw)

    dist.barrier, dist.destroy_process_group = barrier, destroy
    bench_worker.write_result = lambda a, result: real_write(a, {**result, **rto})
    return bench_worker.training_main(rest)


# ---- the mixes: jobs scaled to a period and a communication fraction ---------------------------------------------

def predicted_iter_s(profile: str, param_scale: float, compute_scale: float, link_bps: float,
                     bucket_mb: float | None = None) -> float:
    """Plain DDP's iteration alone on the testbed as ``policies.execution.ddp_iteration`` predicts it (the
    calibration of ``bench.validate``: payload rate, :data:`ALPHA_S`, :data:`COMPUTE_FACTOR`), with buckets of
    ``bucket_mb`` MB of the full-size model (None: DDP's 25 MB)."""
    from bench.validate import DDP_BUCKET_MB, emulated_profile
    from tensorlane.policies.execution import TCP_PAYLOAD_FRACTION, HostCosts, ddp_iteration
    from tensorlane.policies.model import CostModel

    prof = emulated_profile(profile, param_scale, compute_scale, COMPUTE_FACTOR)
    cost = CostModel(2, link_bps * TCP_PAYLOAD_FRACTION, 0.0, ALPHA_S)
    host = HostCosts(launch_s=3.3e-5, copy_bps=4e9, wake_s=7e-5)
    mb = DDP_BUCKET_MB if bucket_mb is None else bucket_mb
    return ddp_iteration(prof, cost, int(mb / param_scale * (1 << 20)), host=host).iter_s


def compute_scale_for(profile: str, param_scale: float, period_s: float, link_bps: float,
                      bucket_mb: float | None = None) -> float:
    """The compute scale whose predicted solo iteration (:func:`predicted_iter_s`) is ``period_s`` (bisection, 60
    steps); ValueError when even no compute is slower than that."""
    lo, hi = 1e-4, 1000.0
    if predicted_iter_s(profile, param_scale, lo, link_bps, bucket_mb) > period_s:
        raise ValueError(f"{profile} at param_scale {param_scale:g}: no compute scale gives a {period_s:g} s "
                         "iteration (communication alone takes longer)")
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted_iter_s(profile, param_scale, mid, link_bps, bucket_mb) < period_s:
            lo = mid
        else:
            hi = mid
    return round(lo, 4)


def job_spec(jid: str, design: tuple, link_bps: float, iters: int, warmup: int, time_scale: float) -> dict:
    """One job of a mix from its design ``(profile, fraction, period_s, offset_s[, bucket_mb])`` (:data:`MIXES`):
    its scales, gradient bytes, ``comm_s`` (all gradients at link rate), nominal ``compute_s``, predicted
    ``solo_iter_s``, ``comm_fraction`` (comm_s / solo_iter_s), Crux's ``intensity`` (compute_s / comm_s), its start
    offset and ``bucket_mb`` (DDP's bucket, MB of the full-size model; None: DDP's default)."""
    from bench.models import balanced_scales, compute_s, gradient_bytes
    from bench.models import comm_s as comm_time

    profile, fraction, period, offset, *more = design
    bucket_mb = more[0] if more else None
    if fraction is None:   # compute = communication (bench.models' balance)
        ps, cs = balanced_scales(profile, link_bps, 2, OVERSUB_COMM_S * time_scale)
    else:
        ps = balanced_scales(profile, link_bps, 2, fraction * period * time_scale)[0]
        cs = compute_scale_for(profile, ps, period * time_scale, link_bps, bucket_mb)
    comm, compute = comm_time(profile, 2, link_bps, ps), compute_s(profile, cs)
    solo = predicted_iter_s(profile, ps, cs, link_bps, bucket_mb)
    return {"id": jid, "profile": profile, "param_scale": ps, "compute_scale": cs, "bucket_mb": bucket_mb,
            "iters": iters, "warmup": warmup, "gradient_bytes": gradient_bytes(profile, ps), "comm_s": comm,
            "compute_s": compute,
            "solo_iter_s": solo, "comm_fraction": comm / solo, "intensity": round(compute / comm, 3),
            "offset_s": offset * time_scale,
            "design": {"fraction": fraction, "period_s": None if period is None else period * time_scale}}


def mix_specs(mix: str, name: str, link_bps: float, iters: int, warmup: int = DEFAULT_WARMUP, time_scale: float = 1.0
              ) -> list[dict]:
    """The jobs of ``mix`` (ids ``NAME-MIX-j0``, ...; job 0 has the highest static priority), each with the
    ``hosts`` of its two ranks (:func:`placement`)."""
    return [dict(job_spec(f"{name}-{mix}-j{i}", design, link_bps, iters, warmup, time_scale), hosts=hosts)
            for i, (design, hosts) in enumerate(zip(MIXES[mix], placement(mix), strict=True))]


def placement(mix: str) -> tuple[tuple[int, int], ...]:
    """The testbed hosts of each job's two ranks in ``mix`` (:data:`MIX_HOSTS`; else every job on
    :data:`DEFAULT_HOSTS`). Usage: ``placement("spread4")[3] == (4, 1)``"""
    return MIX_HOSTS.get(mix, (DEFAULT_HOSTS,) * len(MIXES[mix]))


def link_loads(specs: list[dict], fractions: list[float] | None = None) -> dict[int, float]:
    """Per testbed host, the sum of the communication fractions (default each job's predicted ``comm_fraction``)
    of the jobs with a rank there: the load of that host's link, both ways (a 2-rank all-reduce sends as much as it
    receives). Usage: ``max(link_loads(specs).values()) <= 1.0`` is ``fits_link``."""
    loads: dict[int, float] = {}
    for s, f in zip(specs, fractions or [s["comm_fraction"] for s in specs], strict=True):
        for h in s["hosts"]:
            loads[h] = loads.get(h, 0.0) + f
    return dict(sorted(loads.items()))


def mix_hosts(specs: list[dict]) -> list[int]:
    """The testbed hosts a mix's jobs run on."""
    return sorted({h for s in specs for h in s["hosts"]})


def mix_setup(mix: str, specs: list[dict], epoch_factor: float, epoch_s: float | None) -> dict:
    """A mix's set-up before any phase: its jobs (with their ``hosts``), ``link_loads`` (per host, the sum of its
    jobs' comm fractions), ``link_load`` (the largest), ``fits_link``, ``collides``, the rotation ``epoch_s`` and
    the ``recommended`` policy."""
    keys = ("profile", "param_scale", "compute_scale", "bucket_mb", "gradient_bytes", "comm_s", "compute_s",
            "solo_iter_s", "comm_fraction", "intensity", "offset_s", "design", "hosts")
    loads = link_loads(specs)
    load = max(loads.values())
    periods = [s["solo_iter_s"] for s in specs]
    same_period = max(periods) <= 1.02 * min(periods)
    collides = len(specs) > 1 and same_period and len({s["offset_s"] for s in specs}) == 1
    epoch = epoch_s or max(0.5, round(epoch_factor * max(periods), 1))
    return {"name": mix, "fits_link": load <= 1.0, "collides": collides, "link_load": load,
            "link_loads": {str(h): v for h, v in loads.items()}, "hosts": mix_hosts(specs),
            "kind": mix_kind(load <= 1.0, collides), "recommended": recommended_policy(load <= 1.0, collides),
            "epoch_s": epoch, "iters": specs[0]["iters"],
            "jobs": [{"job": s["id"], **{k: s[k] for k in keys}} for s in specs]}


# ---- one phase: the jobs of a mix at once (or, solo, one after the other) ----------------------------------------

@dataclasses.dataclass
class Rank:
    """One worker process: its job, rank, host and files."""

    job: str
    rank: int
    host: object
    out: str
    ready: str
    go: str
    log: object
    proc: subprocess.Popen

    def what(self, tag: str) -> str:
        return f"{tag}: {self.job} rank {self.rank} on {self.host.name}"


def _training_argv(tb, job: dict, rank: int, index: int, json_path: str, sockets, timeout: float) -> list[str]:
    """``bench.worker training`` arguments of ``job``'s rank ``rank`` on testbed host ``index`` (plain DDP, gloo,
    its flows registered at level 0 with the host's agent when ``sockets`` has one)."""
    host, mode = tb.host(index), job.get("mode", "ddp")
    master = tb.host(job["hosts"][0])
    argv = ["--rank", str(rank), "--world", "2", "--master", f"{master.ip}:{job['port']}",
            "--profile", job["profile"], "--mode", mode, "--iters", str(job["iters"]),
            "--warmup", str(job["warmup"]), "--param-scale", f"{job['param_scale']:g}",
            "--compute-scale", f"{job['compute_scale']:g}", "--job", job["id"],
            "--ifname", host.ifname, "--link-rate", str(int(tb.rate_bps)),
            "--json", json_path, "--timeout", str(int(timeout))]
    if mode != "ddp":  # the shim registers under the job's own id, so that a job order knows it
        argv += ["--levels", str(job["levels"]), "--shim-job", job["id"]]
        if job.get("shim_policy"):  # else the worker's default, the planner
            argv += ["--policy", job["shim_policy"]]
    if job.get("bucket_mb") is not None:   # the design's DDP bucket (the shim's modes use the same)
        argv += ["--bucket-cap-mb", f"{job['bucket_mb'] / job['param_scale']:g}"]
    if sockets and index in sockets:
        argv += ["--agent-socket", sockets[index], "--ddp-level", "0"]
    return argv


def _start_ranks(tb, jobs: list[dict], sockets, workdir: str, tag: str, timeout: float, wait_s: float,
                 ranks: list[Rank]) -> None:
    """Start both ranks of every job (on its ``hosts``) as ``worker`` processes, each job with its own go file;
    append each to ``ranks`` as it starts. ``wait_s``: how long a worker may wait for its go file."""
    for job in jobs:
        go = os.path.join(workdir, f"{tag}-{job['id']}.go")
        for path in (go, go + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for rank, index in enumerate(job["hosts"]):
            host = tb.host(index)
            base = os.path.join(workdir, f"{tag}-{job['id']}-r{rank}")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base + ".ready")
            argv = [sys.executable, "-m", "bench.jobs", "worker", "--ready", base + ".ready", "--go", go,
                    "--timeout", str(int(wait_s)), "--",
                    *_training_argv(tb, job, rank, index, base + ".json", sockets, timeout)]
            log = open(base + ".log", "wb")  # noqa: SIM115 (closed by reap_workers)
            ranks.append(Rank(job["id"], rank, host, base + ".json", base + ".ready", go, log,
                              host.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=worker_env(), cwd=REPO_ROOT)))


def _await_ready(ranks: list[Rank], tag: str, ready_timeout: float) -> None:
    """Wait (bounded) until every worker has created its ready file; ScenarioError if one exits first."""
    deadline = time.monotonic() + ready_timeout
    while not all(os.path.exists(r.ready) for r in ranks):
        for r in ranks:
            if r.proc.poll() is not None:
                raise ScenarioError(f"{r.what(tag)} exited {r.proc.returncode} before its start (worker() holds "
                                    "each job at its first dist.barrier(), the one bench.worker training calls "
                                    f"before its timed iterations); log:\n{tail(r.log.name)}")
        if time.monotonic() > deadline:
            raise ScenarioError(f"{tag}: workers not ready after {ready_timeout:g} s (set-up)")
        time.sleep(0.05)


def _write_go(go: str, start: float) -> None:
    """Write the wall-clock ``start`` into ``go`` atomically."""
    with open(go + ".tmp", "w") as fh:
        fh.write(repr(start))
    os.replace(go + ".tmp", go)


def _release(ranks: list[Rank], jobs: list[dict], tag: str, timeout: float, sequential: bool) -> dict[str, float]:
    """Release the jobs and wait for every worker (bounded); return each job's start (wall clock). At once: job
    ``i`` starts ``offset_s`` after one common instant. ``sequential``: one job after the other, each alone."""
    starts = {}
    waves = [[j] for j in jobs] if sequential else [jobs]
    for wave in waves:
        t0 = time.time() + START_DELAY_S
        for job in wave:
            starts[job["id"]] = t0 + (0.0 if sequential else job["offset_s"])
            _write_go(next(r.go for r in ranks if r.job == job["id"]), starts[job["id"]])
        budget = START_DELAY_S + max(j["offset_s"] for j in wave) + timeout
        deadline = time.monotonic() + budget
        for r in (r for r in ranks if r.job in {j["id"] for j in wave}):
            wait_worker(r.proc, deadline, budget, r.what(tag), r.log.name)
    return starts


def run_jobs(tb, jobs: list[dict], sockets: dict[int, str] | None, workdir: str, tag: str, timeout: float,
             sequential: bool = False, ready_timeout: float = 240.0) -> dict[str, dict]:
    """Start every rank of every job in ``jobs`` (dicts: id, profile, param_scale, compute_scale, iters, warmup,
    port, offset_s, hosts), release them (:func:`_release`), wait for all (bounded) and return per job ``{start,
    results}`` (its ranks' JSON). Raises ScenarioError with the failing worker's log; every worker still running is
    killed on the way out."""
    ranks: list[Rank] = []
    wait_s = ready_timeout + 30 + (len(jobs) * (timeout + 10) if sequential else 0)
    try:
        _start_ranks(tb, jobs, sockets, workdir, tag, timeout, wait_s, ranks)
        _await_ready(ranks, tag, ready_timeout)
        starts = _release(ranks, jobs, tag, timeout, sequential)
        out: dict[str, dict] = {j["id"]: {"start": starts[j["id"]], "results": []} for j in jobs}
        for r in ranks:
            with open(r.out) as fh:
                out[r.job]["results"].append(json.load(fh))
        return out
    finally:
        reap_workers((r.log, r.proc) for r in ranks)


def job_figures(run: dict) -> dict:
    """One job's figures from its ranks' JSON (:func:`run_jobs`): ``jct_s`` (the slowest rank's time from the
    job's start to the end of its last iteration), ``end_s`` (its last process's end), ``median_iter_s``, ``rto``
    and ``rto_time_ms`` (summed over ranks; None if a rank could not read them) and whether its flows were
    registered with the agents. ``rto_sockets``: how many connections the ranks read them from.
    ``compute_late_s``: the most any rank's emulated compute woke up late over its run (``bench.models``'
    ``late_s``; taken back from the next kernel, so a gauge of the machine's load, not of time added).
    ``cpu_s`` and ``cpu_wait_s``: its ranks' threads' seconds on a CPU and in a run queue over the timed
    iterations (``bench.models.process_schedstat``), summed over ranks; None without schedstat."""
    rs = run["results"]
    mode = rs[0]["mode_order"][0]

    def summed(vals):
        return None if any(v is None for v in vals) else sum(vals)

    def total(key):
        return summed([r.get(key) for r in rs])

    def total_first(key):  # a timed span's figure, summed over the ranks
        return summed([(r["modes"][mode].get(key) or [None])[0] for r in rs])

    return {"jct_s": max(r["modes"][mode]["spans_s"][0] for r in rs),
            "end_s": max(r["end_time"] for r in rs) - run["start"],
            "median_iter_s": max(r["modes"][mode]["median_s"] for r in rs),
            "rto": total("rto"), "rto_time_ms": total("rto_time_ms"), "rto_sockets": total("rto_sockets"),
            "compute_late_s": _max([(r.get("stream_stats") or {}).get("late_s") for r in rs]),
            "cpu_s": total_first("cpu_spans_s"), "cpu_wait_s": total_first("cpu_wait_spans_s"),
            "registered": all(_registered(r, mode) for r in rs)}


def _registered(result: dict, mode: str) -> bool:
    """Whether a rank's flows went to its agent: plain DDP's (``ddp_registered``), or the shim's registrations."""
    if mode == "ddp":
        return bool(result.get("ddp_registered"))
    agent = ((result["modes"][mode].get("shim_stats") or {}).get("agent") or {})
    return agent.get("registrations", 0) > 0 and not agent.get("failures") and not agent.get("refusals")


def tcp_counters(host) -> dict[str, int]:
    """The host namespace's TCP retransmitted segments and retransmission timeouts, and what tells reordering from
    loss: reorderings seen (``TCPSACKReorder``), duplicate segments the peers reported (``TCPDSACKRecv``: a
    retransmission that was not needed) and window reductions undone for them (``TCPDSACKUndo``) (kernel counters)."""
    out = {}
    for path, table, names in (("/proc/net/snmp", "Tcp:", ("RetransSegs",)),
                               ("/proc/net/netstat", "TcpExt:", ("TCPTimeouts", "TCPSACKReorder", "TCPDSACKRecv",
                                                                "TCPDSACKUndo"))):
        lines = [ln.split() for ln in host.run(["cat", path]).stdout.splitlines() if ln.startswith(table)]
        if len(lines) >= 2:
            row = dict(zip(lines[0][1:], lines[1][1:], strict=False))
            out.update({n: int(row[n]) for n in names if n in row})
    return out


def agent_extra(phase: str, specs: list[dict], epoch_s: float, overrides: dict | None = None,
                held_s: float = HELD_S) -> dict:
    """The agents' config fields of ``phase``: the job policy and its table or epoch, then ``overrides`` (the
    fields the run passes to every agent: ``min_share``, ``ack_priority``; ``job_share`` and the others of a job
    order only to a job policy's, and ``job_sample_s``, ``job_hold_s`` only where the parts follow the jobs
    sending), then the phase's own (:data:`PHASE_AGENT`; a held phase's ``job_hold_s`` is ``held_s``)."""
    extra: dict = {"job_policy": AGENT_POLICY[phase]}
    own = {k: held_s if k == "job_hold_s" else v for k, v in PHASE_AGENT.get(phase, {}).items()}
    if extra["job_policy"] == "static":
        extra["job_priority"] = {s["id"]: i for i, s in enumerate(specs)}
    elif extra["job_policy"] in ROTATING:
        extra["rotate_epoch_s"] = epoch_s
    elif extra["job_policy"] == "intensity":
        extra["job_intensity"] = {s["id"]: float(s["intensity"]) for s in specs}
    overrides = dict(overrides or {})
    if extra["job_policy"] == "none":
        for key in ("job_share", "job_share_among", *SAMPLED):  # the agent refuses them without a job order
            overrides.pop(key, None)
    merged = extra | overrides | own
    if merged.get("job_share") == 0:  # a strict order: no parts to split, sample or hold (the agent refuses them)
        for key in ("job_share_among", "job_hold_s", *(() if merged["job_policy"] == "slowdown" else SAMPLED)):
            merged.pop(key, None)
    if merged.get("job_share_among", "sending") != "sending":
        for key in SAMPLED:
            merged.pop(key, None)
    return merged


def phase_timeout(specs: list[dict]) -> float:
    """Seconds a job may take once released: generous (6 x its iterations at the slower of compute and
    communication, for every job sharing the link) plus set-up slack."""
    return 120 + 6 * len(specs) * max((s["iters"] + 1) * max(s["comm_s"], s["compute_s"]) for s in specs)


class OrderWatch:
    """Reads an agent's job order once a second while a phase runs (a thread, stopped on exit): ``order`` is the
    last one seen with all ``jobs`` of its host present (with the jobs' reported ``step_bytes`` and ``compute_s``
    under ``shortest`` and ``measured_intensity``), None if never."""

    def __init__(self, agent, jobs: int, period_s: float = 1.0):
        self.agent, self.jobs, self.period_s, self.order = agent, jobs, period_s, None
        self.busy: list[float] = []  # job_share "auto": the share of busy samples the agent held, once a second
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="order-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                jp = self.agent.status()["job_policy"]
            except Exception:  # noqa: BLE001 - a missed reading is only a missed reading
                continue
            if len(jp.get("order", ())) >= self.jobs > 1:
                self.order = {"order": jp["order"], **{k: jp[k] for k in REPORTED_INPUTS if k in jp}}
            if jp.get("link_busy") is not None:
                self.busy.append(jp["link_busy"])

    def __enter__(self) -> OrderWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def run_phase(tb, phase: str, specs: list[dict], tag: str, workdir: str, levels: int, epoch_s: float,
              overrides: dict | None = None, held_s: float = HELD_S) -> dict:
    """One phase: fresh agents with the phase's job policy on the jobs' hosts, then the jobs of ``specs`` (the solo
    phases, ``solo`` and ``solo_shim``: one after the other, each alone); returns per job (``specs`` order)
    :func:`job_figures` as ``jobs``, the hosts' TCP counters over the phase (``tcp``) and the first host's agent's
    ``order_changes`` and ``share_changes`` (how often the sending jobs changed the parts of ``job_share``)."""
    from bench.agents import running_agents

    adir = os.path.join(workdir, f"agents-{tag}")
    extra = agent_extra(phase, specs, epoch_s, overrides, held_s)
    specs = [{**s, "mode": JOB_MODE.get(phase, "ddp"), "levels": levels, **JOB_SHIM.get(phase, {})} for s in specs]
    indexes = mix_hosts(specs)
    hosts = [tb.host(i) for i in indexes]
    tcp0 = [tcp_counters(h) for h in hosts]
    with running_agents(tb, levels=levels, hosts=indexes, workdir=adir, config_extra=extra) as agents, \
            OrderWatch(agents[indexes[0]], len([s for s in specs if indexes[0] in s["hosts"]])) as watch:
        runs = run_jobs(tb, specs, {i: a.socket for i, a in agents.items()}, workdir, tag, phase_timeout(specs),
                        sequential=phase in SOLOS)
        status = agents[indexes[0]].status()
        agent_cpu = [a.cpu_s() for a in agents.values()]
    tcp1 = [tcp_counters(h) for h in hosts]
    jobs = [job_figures(runs[s["id"]]) for s in specs]
    unregistered = [s["id"] for s, j in zip(specs, jobs, strict=True) if not j["registered"]]
    if unregistered:
        raise ScenarioError(f"{tag}: flows not registered with the agents: {', '.join(unregistered)}")
    jp = status["job_policy"]
    auto = {"saturation_changes": jp.get("saturation_changes"), "saturated_s": jp.get("saturated_s"),
            "link_busy": watch.busy} if jp.get("job_share_auto") else None
    return {"jobs": jobs, "order_changes": jp.get("changes"), "order": watch.order,
            "share_changes": jp.get("share_changes"), "auto": auto,
            "agent_cpu_s": None if None in agent_cpu else sum(agent_cpu),
            "tcp": {k: sum(b.get(k, 0) - a.get(k, 0) for a, b in zip(tcp0, tcp1, strict=True)) for k in tcp1[0]}}


# ---- a mix: every phase, the figures per policy and the targets --------------------------------------------------

def _mean(values: list):
    """The mean of ``values`` (None if any is None or there are none); integers stay integers when all equal."""
    if not values or any(v is None for v in values):
        return None
    if len(set(values)) == 1:
        return values[0]
    return statistics.fmean(values)


def _solo_key(spec: dict, phase: str = "solo") -> tuple:
    """Jobs with equal keys run alike alone: one solo run serves them all (in a mix and across mixes)."""
    return (phase, spec["profile"], spec["param_scale"], spec["compute_scale"], spec.get("bucket_mb"), spec["iters"],
            spec["warmup"])


def policy_block(ids: list[str], runs: list[dict], fifo: list[float] | None, solo: list[float] | None) -> dict:
    """One policy's figures of a mix from its ``runs`` (one :func:`run_phase` per repetition): per job the mean
    JCT over repetitions with its FIFO and solo JCT and ratios, the average JCT (and vs FIFO's), the TCP counters
    and agents' order changes of each run."""
    jobs = []
    for i, jid in enumerate(ids):
        per = [r["jobs"][i] for r in runs]
        jct = statistics.fmean(p["jct_s"] for p in per)
        f, s = (fifo[i] if fifo else None), (solo[i] if solo else None)
        jobs.append({"job": jid, "jct_s": jct, "fifo_jct_s": f, "solo_jct_s": s, "rto": _mean([p["rto"] for p in per]),
                     "rto_time_ms": _mean([p["rto_time_ms"] for p in per]),
                     "rto_sockets": _mean([p["rto_sockets"] for p in per]), "vs_fifo": ratio(jct, f),
                     "vs_solo": ratio(jct, s), "median_iter_s": statistics.fmean(p["median_iter_s"] for p in per),
                     "end_s": statistics.fmean(p["end_s"] for p in per), "jct_reps_s": [p["jct_s"] for p in per],
                     **_load_means(per)})
    avg = statistics.fmean(j["jct_s"] for j in jobs)
    fifo_avg = statistics.fmean(fifo) if fifo else None
    return {"jobs": jobs, "avg_jct_s": avg, "avg_vs_fifo": ratio(avg, fifo_avg),
            "max_vs_fifo": _max([j["vs_fifo"] for j in jobs]), "max_vs_solo": _max([j["vs_solo"] for j in jobs]),
            "tcp": [r["tcp"] for r in runs], "order_changes": [r["order_changes"] for r in runs],
            "share_changes": [r.get("share_changes") for r in runs],
            **({"auto": [r.get("auto") for r in runs]} if any(r.get("auto") for r in runs) else {}),
            "agent_cpu_s": [r.get("agent_cpu_s") for r in runs],
            "orders": [r.get("order") for r in runs]}


LOAD_KEYS = ("compute_late_s", "cpu_s", "cpu_wait_s")  # what the machine's CPU was doing meanwhile


def _load_means(per: list[dict]) -> dict:
    """:data:`LOAD_KEYS` of one job, each the mean over its runs ``per`` (None where a run lacks it)."""
    return {k: _mean([p.get(k) for p in per]) for k in LOAD_KEYS}


def _max(values: list):
    """The largest of ``values``, None if any is None."""
    return None if not values or any(v is None for v in values) else max(values)


def _target(name: str, text: str, value, limit: float) -> dict:
    return {"name": name, "text": text, "value": value, "limit": limit,
            "met": None if value is None else value <= limit}


def mix_targets(mix: dict) -> list[dict]:
    """The targets of one mix (module docstring; :data:`TARGETS`), judged on its ``policies``."""
    pols, rec = mix["policies"], mix["recommended"]
    r = pols.get(rec) or {}
    out = []
    if mix["fits_link"]:
        out.append(_target("fits_vs_fifo", f"{rec}: every job's JCT <= {TARGETS['fits_vs_fifo_max']:g} x its FIFO "
                           "JCT", r.get("max_vs_fifo"), TARGETS["fits_vs_fifo_max"]))
        out.append(_target("fits_vs_solo", f"{rec}: every job's JCT <= {TARGETS['fits_vs_solo_max']:g} x its solo "
                           "JCT", r.get("max_vs_solo"), TARGETS["fits_vs_solo_max"]))
    if mix["collides"] and mix["fits_link"]:
        out.append(_target("collide_avg_vs_fifo", f"{rec}: average JCT <= {TARGETS['collide_avg_vs_fifo_max']:g} x "
                           "FIFO's", r.get("avg_vs_fifo"), TARGETS["collide_avg_vs_fifo_max"]))
    if not mix["fits_link"]:
        others = [p for name, p in pols.items() if name not in CONTROLS]
        worst = _max([p.get("max_vs_fifo") for p in others]) if others else None
        out.append(_target("oversub_vs_fifo", f"every policy: no job's JCT above {TARGETS['oversub_vs_fifo_max']:g} "
                           "x its FIFO JCT", worst, TARGETS["oversub_vs_fifo_max"]))
    return out


def _progress_phase(progress, mix: str, phase: str, ph: dict, ids: list[str]) -> None:
    def load(j):  # what the machine's CPU was doing meanwhile
        out = "" if j.get("compute_late_s") is None else f", compute late {j['compute_late_s']:.2f} s"
        if j.get("cpu_s") is not None:
            out += f", CPU {j['cpu_s']:.1f} s, run queue {j['cpu_wait_s']:.2f} s"
        return out

    jobs = ", ".join(f"{jid.rsplit('-', 1)[-1]} {j['jct_s']:.1f} s (rto {j['rto']}{load(j)})" for jid, j in zip(
        ids, ph["jobs"], strict=True))
    cpu = "" if ph.get("agent_cpu_s") is None else f"; agents' CPU {ph['agent_cpu_s']:.2f} s"
    progress(f"  {mix} {phase:9s} JCT {jobs}; hosts' TCP timeouts {ph['tcp'].get('TCPTimeouts')}, "
             f"retransmitted segments {ph['tcp'].get('RetransSegs')}{cpu}")


def _run_solo(ctx: dict, mix: str, specs: list[dict], rep: int, phase: str = "solo") -> None:
    """A solo phase (``solo``: plain DDP; ``solo_shim``: with the shim) of one repetition: every job of ``specs``
    whose solo run is not yet in ``ctx["solo"]`` for this repetition, one after the other; results go to
    ``ctx["solo"][key][rep]``."""
    todo = {}
    for s in specs:
        if rep not in ctx["solo"].setdefault(_solo_key(s, phase), {}):
            todo.setdefault(_solo_key(s, phase), s)
    if not todo:
        return
    jobs = [dict(s, port=next(ctx["ports"]), offset_s=0.0) for s in todo.values()]
    ph = run_phase(ctx["tb"], phase, jobs, f"{mix}-{phase}-{rep}", ctx["workdir"], ctx["levels"], 1.0,
                   ctx["agent"])
    _progress_phase(ctx["progress"], mix, phase, ph, [j["id"] for j in jobs])
    for key, fig in zip(todo, ph["jobs"], strict=True):
        ctx["solo"][key][rep] = dict(fig, tcp=ph["tcp"], measured_in=mix)


def _solo_block(ctx: dict, specs: list[dict], reps: int, phase: str = "solo") -> dict:
    """The mix's ``solo`` (or ``solo_shim``) figures: per job the mean over repetitions of its solo run."""
    jobs = []
    for s in specs:
        per = [ctx["solo"][_solo_key(s, phase)][rep] for rep in range(reps)]
        jobs.append({"job": s["id"], "jct_s": statistics.fmean(p["jct_s"] for p in per),
                     "median_iter_s": statistics.fmean(p["median_iter_s"] for p in per),
                     "rto": _mean([p["rto"] for p in per]), "rto_time_ms": _mean([p["rto_time_ms"] for p in per]),
                     "rto_sockets": _mean([p["rto_sockets"] for p in per]), "jct_reps_s": [p["jct_s"] for p in per],
                     **_load_means(per), "measured_in": per[0]["measured_in"]})
    return {"jobs": jobs}


def _solo_for(policy: str, solo: dict | None, solo_shim: dict | None) -> list[float] | None:
    """The solo JCTs a policy is judged against: each job alone with plain DDP; for the jobs that run the shim's
    overlap (``levels``), the smaller of that and the job alone with the shim, so that the shim's own gain alone is
    not counted as a gain of sharing (``shortest``'s hook mode at one level keeps plain DDP's schedule)."""
    plain = [j["jct_s"] for j in solo["jobs"]] if solo else None
    if JOB_MODE.get(policy, "ddp") != "shim_overlap" or not solo_shim:
        return plain
    shim = [j["jct_s"] for j in solo_shim["jobs"]]
    return shim if plain is None else [min(a, b) for a, b in zip(plain, shim, strict=True)]


def run_mix(ctx: dict, mix: str, specs: list[dict], phases, reps: int) -> dict:
    """Every phase of ``mix`` ``reps`` times (order rotating per repetition, each on fresh ports), then the figures
    per policy (FIFO as ``fifo`` too), the solo figures, the measured link load and the targets."""
    out = mix_setup(mix, specs, ctx["epoch_factor"], ctx["epoch_s"])
    agent = mix_agent(out["kind"], ctx["agent"])
    out["job_share"] = agent.get("job_share", agent_default("job_share"))
    out["job_hold_s"] = agent.get("job_hold_s", agent_default("job_hold_s"))
    if any(p in PHASE_AGENT and "job_hold_s" in PHASE_AGENT[p] for p in phases):
        out["held_s"] = ctx["held_s"]
    ids = [s["id"] for s in specs]
    runs: dict[str, list[dict]] = {p: [] for p in phases if p not in SOLOS}
    for rep in range(reps):
        k = rep % len(phases)
        for phase in list(phases[k:]) + list(phases[:k]):
            if phase in SOLOS:
                _run_solo(ctx, mix, specs, rep, phase)
                continue
            jobs = [dict(s, port=next(ctx["ports"])) for s in specs]
            ph = run_phase(ctx["tb"], phase, jobs, f"{mix}-{phase}-{rep}", ctx["workdir"], ctx["levels"],
                           out["epoch_s"], agent, ctx["held_s"])
            _progress_phase(ctx["progress"], mix, phase, ph, ids)
            runs[phase].append(ph)
    solo = _solo_block(ctx, specs, reps) if "solo" in phases else None
    solo_shim = _solo_block(ctx, specs, reps, "solo_shim") if "solo_shim" in phases else None
    fifo_jct = ([statistics.fmean(r["jobs"][i]["jct_s"] for r in runs["fifo"]) for i in range(len(ids))]
                if runs.get("fifo") else None)
    out["policies"] = {p: policy_block(ids, rs, fifo_jct, _solo_for(p, solo, solo_shim)) for p, rs in runs.items()}
    out["solo"], out["solo_shim"] = solo, solo_shim
    if solo:
        loads = link_loads(specs, [s["comm_s"] / j["median_iter_s"] for s, j in zip(specs, solo["jobs"], strict=True)])
        out["link_load_measured"] = max(loads.values())
    out["targets"] = mix_targets(out)
    met = [t["met"] for t in out["targets"]]
    out["pass"] = None if not met or any(m is None for m in met) else all(met)
    return out


# ---- the run ------------------------------------------------------------------------------------------------------

def machine() -> dict:
    """What the figures were measured on."""
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as fh:
        mem = round(int(fh.readline().split()[1]) / 2**20, 1)
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "mem_gib": mem, "loadavg": list(os.getloadavg())}


def agent_default(name: str):
    """The agent's default of config field ``name`` (its Config's). Usage: ``agent_default("min_share")``"""
    from tensorlane.agent.config import Config

    return next(f.default for f in dataclasses.fields(Config) if f.name == name)


def _check(mixes, phases) -> None:
    """ValueError unless ``mixes`` and ``phases`` are non-empty subsets of the known ones."""
    if not mixes or set(mixes) - set(MIXES):
        raise ValueError(f"mixes must be a subset of {', '.join(MIXES)}, not {mixes!r}")
    if not phases or set(phases) - set(PHASES):
        raise ValueError(f"policies must be a subset of {', '.join(PHASES)}, not {phases!r}")


def _describe_mix(setup: dict) -> str:
    jobs = "; ".join(f"{j['job'].rsplit('-', 1)[-1]} {j['profile']} comm {j['comm_s']:.2f} s of "
                     f"{j['solo_iter_s']:.2f} s ({j['comm_fraction']:.2f}), intensity {j['intensity']:g}, "
                     f"+{j['offset_s']:g} s, hosts {'-'.join(map(str, j['hosts']))}" for j in setup["jobs"])
    return (f"{setup['name']}: {jobs}; link load {setup['link_load']:.2f} (fits {setup['fits_link']}), collides "
            f"{setup['collides']}, epoch {setup['epoch_s']:g} s")


def run(mixes=None, quick: bool = False, name: str = "tj", rate: str = DEFAULT_RATE, iters: int | None = None,
        warmup: int = DEFAULT_WARMUP, policies=DEFAULT_PHASES, reps: int = 1,
        epoch_factor: float = DEFAULT_EPOCH_FACTOR, epoch_s: float | None = None, min_share: float | None = None,
        levels: int = 4, progress=print, port_base: int = 29700, workdir: str | None = None,
        ack_priority: bool | None = None, job_share: float | None = None, min_rate: str | int | None = None,
        queue_limit: int | None = None, job_share_among: str | None = None, job_sample_s: float | None = None,
        job_hold_s: float | None = None, held_s: float = HELD_S) -> dict:
    """Run the benchmark on a fresh testbed ``name`` (2 hosts; 4 with ``spread4``: :data:`MIX_HOSTS`); return
    ``{"mixes": [...], ...}`` (docs/jobs-measured.md).

    ``policies``: the phases (``solo`` and the policies, FIFO as ``fifo``); ``reps`` > 1 repeats every phase (order
    rotating) and takes each job's mean JCT. ``min_share``, ``min_rate`` (a rate, bits/s or 0), ``queue_limit``
    (packets per class), ``ack_priority``, ``job_share``, ``job_share_among``, ``job_sample_s``, ``job_hold_s`` None:
    the agent's default (not passed; the job fields go only to the phases with a job order). ``held_s``: the
    ``job_hold_s`` of the held phases (``static_held``, ``intensity_held``, ``shortest_held``).
    Usage: ``run(quick=True)``
    """
    from tensorlane.agent.config import parse_min_rate
    from testbed import Testbed

    mixes = tuple(mixes or (QUICK_MIXES if quick else DEFAULT_MIXES))
    phases = tuple(p for p in PHASES if p in policies)   # canonical order
    _check(mixes, tuple(policies))
    iters = iters or (QUICK_ITERS if quick else DEFAULT_ITERS)
    time_scale = QUICK_TIME_SCALE if quick else 1.0
    progress = progress or (lambda *a, **k: None)
    n_hosts = max(h for m in mixes for pair in placement(m) for h in pair)
    result: dict = {"rate": rate, "hosts": n_hosts, "ranks_per_job": 2, "iters": iters, "warmup": warmup, "reps": reps,
                    "quick": quick, "time_scale": time_scale, "policies": list(phases),
                    "recommended": dict(RECOMMENDED), "recommended_agent": dict(RECOMMENDED_AGENT),
                    "epoch_factor": epoch_factor, "epoch_s": epoch_s, "levels": levels,
                    "min_share": agent_default("min_share") if min_share is None else min_share,
                    "min_share_passed": min_share is not None,
                    "min_rate_bps": agent_default("min_rate_bps") if min_rate is None else parse_min_rate(min_rate),
                    "min_rate_passed": min_rate is not None,
                    "queue_limit_packets": (agent_default("queue_limit_packets") if queue_limit is None
                                            else queue_limit),
                    "queue_limit_passed": queue_limit is not None,
                    "ack_priority": agent_default("ack_priority") if ack_priority is None else ack_priority,
                    "ack_priority_passed": ack_priority is not None,
                    "job_share": agent_default("job_share") if job_share is None else job_share,
                    "job_share_passed": job_share is not None,
                    "job_share_among": agent_default("job_share_among") if job_share_among is None else job_share_among,
                    "job_share_among_passed": job_share_among is not None,
                    "job_sample_s": agent_default("job_sample_s") if job_sample_s is None else job_sample_s,
                    "job_hold_s": agent_default("job_hold_s") if job_hold_s is None else job_hold_s,
                    "job_sampling_passed": job_sample_s is not None or job_hold_s is not None, "machine": machine(),
                    "targets": dict(TARGETS),
                    "prediction": {"alpha_s": ALPHA_S, "compute_factor": COMPUTE_FACTOR}, "mixes": []}
    t_start = time.monotonic()
    progress(f"testbed {name}: {n_hosts} hosts at {rate}; mixes {', '.join(mixes)}; {iters} iterations per job; phases "
             f"{', '.join(phases)}; min_share {result['min_share']:g}"
             + ("" if min_share is not None else " (the agent's default)")
             + f", min_rate {result['min_rate_bps'] / 1e6:g} Mbit/s"
             + ("" if min_rate is not None else " (the agent's default)")
             + f"; ack_priority {result['ack_priority']}; job_share {result['job_share']:g} among the jobs "
             + result["job_share_among"]
             + f" (samples every {result['job_sample_s']:g} s, held {result['job_hold_s']:g} s)")
    with scratch_dir(workdir, "tensorlane-jobs-") as workdir, Testbed(hosts=n_hosts, rate=rate, name=name) as tb:
        result["link_bps"] = tb.rate_bps
        passed = {"min_share": min_share, "min_rate": min_rate, "queue_limit_packets": queue_limit,
                  "ack_priority": ack_priority, "job_share": job_share, "job_share_among": job_share_among,
                  "job_sample_s": job_sample_s, "job_hold_s": job_hold_s}
        ctx = {"tb": tb, "workdir": workdir, "levels": levels, "progress": progress,
               "agent": {k: v for k, v in passed.items() if v is not None},
               "ports": itertools.count(port_base + 1), "epoch_factor": epoch_factor, "epoch_s": epoch_s,
               "solo": {}, "held_s": held_s}
        for mix in mixes:
            specs = mix_specs(mix, name, tb.rate_bps, iters, warmup, time_scale)
            progress(_describe_mix(mix_setup(mix, specs, epoch_factor, epoch_s)))
            m = run_mix(ctx, mix, specs, phases, reps)
            result["mixes"].append(m)
            progress(f"{mix}: " + "; ".join(f"{t['name']} {_fmt(t['value'])} (<= {t['limit']:g}): "
                                            f"{_verdict(t['met'])}" for t in m["targets"]))
    result["elapsed_s"] = time.monotonic() - t_start
    result["pass"] = {m["name"]: m["pass"] for m in result["mixes"]}
    return result


# ---- the tables ---------------------------------------------------------------------------------------------------

def _fmt(v, spec: str = ".2f") -> str:
    """A number with ``spec``, "-" for None."""
    return "-" if v is None else format(v, spec)


def _verdict(met) -> str:
    return {True: "met", False: "MISSED", None: "-"}[met]


def format_mix(mix: dict) -> str:
    """One mix's table: a row per policy (and solo), per job its JCT, x FIFO, x solo and retransmission timeouts,
    then the average; the targets under it."""
    short = [j["job"].rsplit("-", 1)[-1] for j in mix["jobs"]]
    head = ("policy", *(f"{s} ({j['profile']}) JCT xFIFO xsolo rto" for s, j in zip(short, mix["jobs"],
                                                                                 strict=True)), "avg", "avg xFIFO")
    rows = [head]
    blocks = list(mix["policies"].items()) + [(s, mix[s]) for s in SOLOS if mix.get(s)]
    for name, b in blocks:
        cells = [f"{j['jct_s']:.1f} s {_fmt(j.get('vs_fifo'))} {_fmt(j.get('vs_solo'))} {_fmt(j['rto'], '.3g')}"
                 for j in b["jobs"]]
        avg = statistics.fmean(j["jct_s"] for j in b["jobs"])
        rows.append((name + (" *" if name == mix["recommended"] else ""), *cells, f"{avg:.1f} s",
                     _fmt(b.get("avg_vs_fifo"))))
    lines = [f"{mix['name']}: link load {mix['link_load']:.2f} (fits_link {mix['fits_link']}), collides "
             f"{mix['collides']}, rotation epoch {mix['epoch_s']:g} s, job_share {mix.get('job_share', 0.0):g}"
             + (f", job_hold_s {mix['job_hold_s']:g}" if mix.get("job_hold_s") else "") + "; "
             "* recommended"]
    lines += text_table(rows)
    lines += [f"  target {t['text']}: {_fmt(t['value'])} {_verdict(t['met'])}" for t in mix["targets"]]
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """Every mix's table (:func:`format_mix`, its header with the mix's own ``job_share``) and the agents'
    ``min_share`` and ``job_share``."""
    tail_line = (f"min_share {result['min_share']:g}" + ("" if result.get("min_share_passed") else
                                                          " (the agent's default)")
                 + ("" if result.get("min_rate_bps") is None else f", min_rate {result['min_rate_bps'] / 1e6:g} Mbit/s"
                    + ("" if result.get("min_rate_passed") else " (the agent's default)"))
                 + f"; job_share {result.get('job_share', 0.0):g}" + ("" if result.get("job_share_passed") else
                                                                     " (the agent's default)")
                 + (f" among the jobs {result['job_share_among']}" if "job_share_among" in result else
                    " among the jobs present"))
    return "\n\n".join([*(format_mix(m) for m in result["mixes"]), tail_line])


def _split(text: str) -> tuple[str, ...]:
    """A comma-separated list as a tuple (empty items left out)."""
    return tuple(x for x in text.split(",") if x)


def main(argv=None) -> int:
    """``python -m bench jobs [--quick] [--json FILE] ...`` (or ``worker ...``): run, print the tables."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--quick", action="store_true",
                   help="the smoke test: collide2 only, periods halved, few iterations")
    p.add_argument("--mixes", default=None, help=f"comma-separated subset of {','.join(MIXES)} (default "
                                                 f"{','.join(DEFAULT_MIXES)}; quick: {','.join(QUICK_MIXES)})")
    p.add_argument("--policies", default=",".join(DEFAULT_PHASES),
                   help="comma-separated phases: solo and solo_shim (each job alone, plain DDP and with the "
                        f"shim), fifo and the policies: {','.join(PHASES)} (default all but the opt-in "
                        f"{','.join(OPT_IN_POLICIES)})")
    p.add_argument("--iters", type=int, default=None,
                   help=f"iterations per job (default {DEFAULT_ITERS}, quick {QUICK_ITERS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help="untimed iterations per job during set-up, before the release (default %(default)s: DDP's "
                        "first iteration is slower)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every phase (mean JCT per job)")
    p.add_argument("--epoch-factor", type=float, default=DEFAULT_EPOCH_FACTOR,
                   help="rotation epoch = this x the mix's longest predicted solo iteration (default %(default)g)")
    p.add_argument("--epoch-s", type=float, default=None, help="rotation epoch in seconds (overrides the factor)")
    p.add_argument("--min-share", type=float, default=None,
                   help="the agents' min_share (default: the agent's own default, not passed)")
    p.add_argument("--min-rate", default=None,
                   help="the agents' min_rate: a rate such as 1mbit, or 0 (default: the agent's own, not passed)")
    p.add_argument("--queue-limit", type=int, default=None,
                   help="the agents' queue_limit_packets, per class (default: the agent's own, not passed)")
    p.add_argument("--job-share", type=float, default=None,
                   help="the agents' job_share in the phases with a job order (default: the agent's own, not passed)")
    p.add_argument("--job-share-among", choices=("sending", "present"), default=None,
                   help="how the agents split job_share: among the jobs sending or all present (default: the "
                        "agent's own, not passed)")
    p.add_argument("--job-sample-s", type=float, default=None,
                   help="the agents' job_sample_s: how often they sample which jobs are sending (default: the "
                        "agent's own, not passed)")
    p.add_argument("--job-hold-s", type=float, default=None,
                   help="the agents' job_hold_s: how long a job counts as sending after its last backlog "
                        "(default: the agent's own, not passed)")
    p.add_argument("--held-s", type=float, default=HELD_S,
                   help=f"the job_hold_s of the held phases (static_held, intensity_held, shortest_held; default "
                        f"{HELD_S:g})")
    p.add_argument("--ack-priority", choices=("on", "off"), default=None,
                   help="the agents' ack_priority (default: the agent's own default, not passed)")
    p.add_argument("--rate", default=DEFAULT_RATE, help=f"the links' rate (default {DEFAULT_RATE}: see DEFAULT_RATE)")
    p.add_argument("--levels", type=int, default=4)
    p.add_argument("--name", default="tj", help="testbed name (namespaces NAME-h1, NAME-h2, NAME-sw)")
    args = p.parse_args(argv)
    if needs_root("the jobs benchmark"):
        return 2
    result = run(mixes=_split(args.mixes) if args.mixes else None, quick=args.quick, name=args.name, rate=args.rate,
                 iters=args.iters, warmup=args.warmup, policies=_split(args.policies), reps=args.reps,
                 epoch_factor=args.epoch_factor, epoch_s=args.epoch_s, min_share=args.min_share,
                 min_rate=None if args.min_rate is None else (0 if args.min_rate == "0" else args.min_rate),
                 queue_limit=args.queue_limit,
                 levels=args.levels, progress=progress_printer(), job_share=args.job_share,
                 job_share_among=args.job_share_among, job_sample_s=args.job_sample_s, job_hold_s=args.job_hold_s,
                 held_s=args.held_s,
                 ack_priority=None if args.ack_priority is None else args.ack_priority == "on")
    show_figures(format_table(result), result, args.json)
    return 0


if __name__ == "__main__":  # SIGTERM unwinds the benchmark (its clean-up runs), not the workers it starts
    cli(main, sigterm=sys.argv[1:2] != ["worker"])
