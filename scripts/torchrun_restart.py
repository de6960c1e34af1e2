"""A real multi-node ``torchrun --max-restarts`` on the namespace testbed, with agents, and a worker SIGKILLed
mid-training (docs/shim.md, "torchrun restarts"). Needs root.

Builds a 2-host testbed (name ``--name``, always torn down), starts an agent on each host, and runs
``scripts/elastic_worker.py`` twice under ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d
--max-restarts 2`` on both hosts: through the shim (overlap mode) and as plain DDP. In each run rank 1's worker is
SIGKILLed in the middle of epoch ``--kill-epoch``; torchrun restarts both workers, which resume from the last
epoch's checkpoint. Checks: both ranks started again (new pids) from that checkpoint, TORCHELASTIC_RUN_ID and the
shim's job id are the rdzv id before and after, the killed run's flows are gone from both agents and the new run's
are registered, no job id conflict is reported at any poll on the way, no flows are left at the end, and the final
parameters of the two runs are equal bit for bit. Prints the measurements as JSON; exit status 1 when a check fails.
About 80 s on 2 shared cores.

    .venv/bin/python scripts/torchrun_restart.py [--name h12tr] [--json FILE]

In the host namespaces torchrun needs two options (the namespaces share the machine's host name, which resolves to
127.0.0.1): ``--rdzv-conf is_host=1`` on the host whose address is the rdzv endpoint, and ``--local-addr ADDR``
(the host's own address) on every host; and restarts need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, with or without
the shim (``--share-store`` leaves torchrun's default, whose worker store keeps the killed attempt's keys: torch's
default group can read them; the shim's level groups delete theirs once connected). docs/testbed.md and
docs/shim.md ("torchrun restarts") explain.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.agents import running_agents  # noqa: E402
from testbed import Testbed  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "scripts", "elastic_worker.py")


def read_json(path: str) -> dict | None:
    """The JSON object at ``path``, or None while it is not there."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait_for(predicate, timeout: float, what: str, procs=()):
    """Poll ``predicate`` every 0.1 s until it is truthy (its value) or ``timeout`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a torchrun exited while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def torchrun_argv(tb, index: int, rdzv_id: str, port: int, out: str, mode: str, args) -> list[str]:
    """torchrun on host ``index``: c10d rendezvous at host 1, its own address as --local-addr."""
    host = tb.host(index)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{tb.host(1).ip}:{port}", "--rdzv-id", rdzv_id,
            "--max-restarts", "2", "--monitor-interval", "0.5", "--local-addr", host.ip]
    if index == 1:
        argv += ["--rdzv-conf", "is_host=1"]
    return argv + [WORKER, "--out", out, "--mode", mode, "--epochs", str(args.epochs), "--steps", str(args.steps)]


def flows_of(agent, job: str) -> list[dict]:
    """The agent's registered flows of ``job``."""
    with agent.client(timeout=2) as c:
        return c.list(job=job)["flows"]


def flow_keys(flows: list[dict]) -> set:
    """Each flow as a hashable (src, sport, dst, dport)."""
    return {(f["src"], f["sport"], f["dst"], f["dport"]) for f in flows}


def run_job(tb, agents, out: str, mode: str, rdzv_id: str, port: int, args) -> dict:
    """One torchrun job on both hosts with host 2's worker SIGKILLed mid-epoch; what was seen."""
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0" if args.share_store else "1")
    env.pop("TENSORLANE_JOB", None)
    procs, logs, seen = [], [], {"mode": mode}
    t0 = time.monotonic()
    try:
        for i in (1, 2):
            logs.append(open(os.path.join(out, f"torchrun-{i}.log"), "w"))  # noqa: SIM115 (closed in finally)
            procs.append(tb.host(i).popen(torchrun_argv(tb, i, rdzv_id, port, out, mode, args),
                                          env=dict(env, TENSORLANE_AGENT_SOCKET=agents[i].socket),
                                          stdout=logs[-1], stderr=subprocess.STDOUT))
        prog = wait_for(lambda: (p := read_json(os.path.join(out, "progress-1.json"))) and p["epoch"] == args.kill_epoch
                        and p["step"] >= args.steps // 2 and p, 120, "epoch's middle", procs)
        if mode != "ddp":
            seen["flows_before"] = {i: flows_of(agents[i], rdzv_id) for i in (1, 2)}
        os.kill(prog["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        seen["killed"] = prog
        for rank in (0, 1):
            seen[f"start-{rank}-1"] = wait_for(lambda r=rank: read_json(os.path.join(out, f"start-{r}-1.json")), 90,
                                               f"rank {rank}'s restart", procs)
        if mode != "ddp":
            old = {i: flow_keys(seen["flows_before"][i]) for i in (1, 2)}
            # the restarted workers register their own flows (new ports); the old ones are withdrawn
            seen["conflict_runs_max"] = 0

            def only_new() -> bool:
                for i in (1, 2):  # any conflict the agents report on the way is kept
                    runs = agents[i].status().get("job_conflict_runs") or {}
                    seen["conflict_runs_max"] = max([seen["conflict_runs_max"], *runs.values()])
                return all((k := flow_keys(flows_of(agents[i], rdzv_id))) and not k & old[i] for i in (1, 2))

            wait_for(only_new, 30, "the new run's flows only", procs)
            seen["new_flows_s"] = round(time.monotonic() - t_kill, 2)
            seen["flows_after"] = {i: flows_of(agents[i], rdzv_id) for i in (1, 2)}
            seen["status_after"] = {i: {k: agents[i].status().get(k) for k in ("flows", "jobs", "job_conflicts",
                                                                                "job_conflict_runs")}
                                    for i in (1, 2)}
        for p in procs:
            p.wait(timeout=120)
        seen["returncodes"] = [p.returncode for p in procs]
        seen["wall_s"] = round(time.monotonic() - t0, 1)
        if mode != "ddp":
            seen["status_end"] = {i: {k: agents[i].status().get(k) for k in ("flows", "job_conflicts")}
                                  for i in (1, 2)}
        for rank in (0, 1):
            seen[f"start-{rank}-0"] = read_json(os.path.join(out, f"start-{rank}-0.json"))
            seen[f"stats-{rank}"] = read_json(os.path.join(out, f"stats-{rank}-1.json"))
        return seen
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()


def checks(shim: dict, ddp: dict, rdzv_id: str, out: str, shim_mode: str = "overlap") -> dict[str, bool]:
    """The checks on both runs' observations and final parameters (the shim's run in ``shim_mode``)."""
    import torch

    res = {}
    for name, seen in (("overlap", shim), ("ddp", ddp)):
        res[f"{name}: both torchruns exit 0"] = seen["returncodes"] == [0, 0]
        res[f"{name}: both ranks restarted once, from the checkpoint"] = all(
            seen[f"start-{r}-1"]["pid"] != seen[f"start-{r}-0"]["pid"]
            and seen[f"start-{r}-1"]["start_epoch"] == seen["killed"]["epoch"] for r in (0, 1))
        res[f"{name}: TORCHELASTIC_RUN_ID is the rdzv id before and after"] = all(
            seen[f"start-{r}-{n}"]["run_id"] == rdzv_id for r in (0, 1) for n in (0, 1))
    res["overlap: the shim's job id is the rdzv id before and after"] = all(
        shim[f"start-{r}-{n}"]["job"] == rdzv_id for r in (0, 1) for n in (0, 1))
    res["overlap: flows registered on both agents before the kill"] = all(shim["flows_before"][i] for i in (1, 2))
    res["overlap: the killed run's flows withdrawn, the new run's registered"] = all(
        shim["flows_after"][i] and not flow_keys(shim["flows_after"][i]) & flow_keys(shim["flows_before"][i])
        for i in (1, 2))
    res["overlap: no job id conflict"] = shim["conflict_runs_max"] == 0 and all(
        not s["job_conflicts"] and not s["job_conflict_runs"] for s in shim["status_after"].values())
    res["overlap: no flows left after the job"] = all(s["flows"] == 0 for s in shim["status_end"].values())
    res[f"overlap: ran in {shim_mode} mode after the restart"] = all(shim[f"stats-{r}"]["mode"] == shim_mode
                                                                for r in (0, 1))
    a = [torch.load(os.path.join(out, "overlap", f"final-{r}.pt")) for r in (0, 1)]
    b = [torch.load(os.path.join(out, "ddp", f"final-{r}.pt")) for r in (0, 1)]
    res["final parameters equal plain DDP's bit for bit (both ranks)"] = all(
        torch.equal(a[r][k], b[r][k]) for r in (0, 1) for k in b[r])
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="trst", help="testbed name ([a-z0-9]{1,8})")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kill-epoch", type=int, default=2)
    p.add_argument("--share-store", action="store_true",
                   help="keep torchrun's shared worker store (its default): stale keys across restarts")
    p.add_argument("--modes", default="overlap,ddp", help="which runs (the checks need both)")
    p.add_argument("--shim-mode", default="overlap", choices=["overlap", "hook"],
                   help="the shim's mode in the run through it (hook: attach without the optimizer)")
    p.add_argument("--json", default=None, help="also write the measurements here")
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="torchrun-restart-")
    rdzv_id = "trst-job"
    t0 = time.monotonic()
    with Testbed(hosts=2, rate="200mbit", name=args.name) as tb, running_agents(tb, levels=2) as agents:
        seen = {mode: run_job(tb, agents, os.path.join(out, mode), args.shim_mode if mode == "overlap" else mode,
                              rdzv_id, port, args)
                for mode, port in (("overlap", 29431), ("ddp", 29432)) if mode in args.modes.split(",")}
    shim, ddp = seen.get("overlap"), seen.get("ddp")
    res = checks(shim, ddp, rdzv_id, out, args.shim_mode) if shim and ddp else {}
    report = {"checks": res, "overlap": shim, "ddp": ddp, "out": out, "total_s": round(time.monotonic() - t0, 1)}
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    for name, ok in res.items():
        print(("PASS " if ok else "FAIL ") + name)
    return 0 if res and all(res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
