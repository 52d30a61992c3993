"""Packing: 8 small training jobs and 16 inference models, through salusd and without it.

1. Makespan of 8 small training jobs started at once: through the daemon under `pack` (lanes in
   parallel) and under `fifo` (one job at a time per device), against 8 separate processes
   running the same loops at once without the daemon. Through the daemon each loop submits
   its steps and reads the last loss at the end (`TrainStep.submit`, as the adapter's docs
   advise for a loop that does not need each loss at once); `pack_blocking` is the same `pack`
   run with each loss read before the next step, as the direct loop does.
2. Memory of 16 inference models (about 17 MiB of parameters each): one daemon holding all 16
   (the daemon, its zygote and the 16 executor processes forked from it, all counted) against
   16 separate processes each holding one. Memory is PSS (proportional set size, from
   /proc/PID/smaps_rollup): pages shared between processes are split between them, so the sum
   over a group of processes is what the group costs the machine; RSS sums are reported too,
   but count shared pages once per process. The daemon's clients hold their own copy of the
   model on the host, reported apart. Salus reports 42x fewer GPUs for inference.

With `--phases`, the training part also times each job's phases through the daemon (`pack`,
steps submitted):
connect, attach and define; the first call; the other iterations; `info` (medians over the
jobs, milliseconds), to show what a short job's makespan is made of; and the CPU time the
clients and the executors spent per iteration in those loops (`loop_cpu_us_per_iteration`,
microseconds), against a direct step's (`direct_step_cpu_us`: 8 plain processes' CPU time
over their iterations, in the same run).

Prints one JSON object.

    .venv/bin/python bench/packing.py [--devices 1] [--jobs 8] [--only training|inference]
                                      [--phases]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from salus.daemon.cli.launch import DaemonProcess, running_daemon
from salus.demo.jobs import Launched, launch
from salus.demo.scripts import group_memory, memory, tree


def _daemon(tmp: Path, policy: str, devices: int) -> AbstractContextManager[DaemonProcess]:
    return running_daemon(tmp / f"salusd-{policy}.sock", state_dir=tmp, policy=policy,
                          cpu_devices=devices)


def _makespan(results: list[dict[str, Any]]) -> float:
    return max(r["end_wall"] for r in results) - min(r["start_wall"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--only", choices=("training", "inference"),
                        help="run one of the two parts")
    parser.add_argument("--jobs", type=int, default=8, help="training jobs at once")
    parser.add_argument("--phases", action="store_true",
                        help="time the phases of each job through the daemon")
    parser.add_argument("--phase-client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase_client:
        _phase_client(args.phase_client)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    out: dict[str, Any] = {"bench": "packing", "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp:
        if args.only != "inference":
            out["training"] = _training(Path(tmp), args.devices, args.jobs)
            if args.phases:
                out["training"]["phases_ms"] = _phases(Path(tmp), args.devices, args.jobs)
        if args.only != "training":
            out["inference"] = _inference(Path(tmp), args.devices)
    print(json.dumps(out))


def _training(tmp: Path, devices: int, jobs: int) -> dict[str, Any]:
    train = ["small-mlp"] * jobs
    spans = {}
    for run, policy, blocking in (("pack", "pack", False), ("pack_blocking", "pack", True),
                                  ("fifo", "fifo", False)):
        print(f"{jobs} training jobs through salusd ({run}) ...", file=sys.stderr)
        with _daemon(tmp, policy, devices) as daemon:
            spans[run] = _makespan(launch(train, daemon.address, blocking=blocking))
    print(f"{jobs} training jobs as separate processes ...", file=sys.stderr)
    spans["processes"] = _makespan(launch(train, "direct"))
    return {
        "jobs": jobs,
        "makespan_s": spans,
        "pack_over_fifo": spans["pack"] / spans["fifo"],
        "pack_over_processes": spans["pack"] / spans["processes"],
        "pack_blocking_over_processes": spans["pack_blocking"] / spans["processes"],
    }


def _cpu_s() -> float:
    """CPU seconds this process used so far (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _executor_cpu_s(s: Any) -> float:
    """`_cpu_s` of the executor process: run there as a function of the job."""
    return _cpu_s()


def _phase_client(address: str) -> None:
    """One small-mlp job through the daemon at `address`, started on a line from stdin; prints
    one JSON object: the wall-clock times (seconds) at which its phases ended, and the CPU
    seconds its client and its executor spent in its loop of other iterations (read just
    outside that loop's timing, by a call to the executor that is not an iteration)."""
    import salus.adapters.torch as salus
    from salus.demo.jobs import WORKLOADS, _setup, _submitted_loop

    w = WORKLOADS["small-mlp"]
    model, opt, loss_fn, batches = _setup(w)
    print("ready", flush=True)
    sys.stdin.readline()
    t = [time.time()]
    with salus.connect(name=w.name, iterations=w.iterations, address=address) as job:
        assert opt is not None
        step = job.train_step(model, opt, loss_fn)
        assert job.remote is not None
        executor_cpu = job.remote.function(_executor_cpu_s)
        executor_cpu.changes_state = False
        t.append(time.time())
        step(*batches[0])
        t.append(time.time())
        client_began, executor_began = _cpu_s(), executor_cpu()
        loop_began = time.time()
        _submitted_loop(step, batches[1:])
        t.append(time.time())
        cpu = {"client": _cpu_s() - client_began, "executor": executor_cpu() - executor_began}
        info_began = time.time()
        job.info()
        t.append(time.time())
        job.close(pull=True)
    print(json.dumps({"ends": t, "loop_began": loop_began, "info_began": info_began,
                      "cpu": cpu, "iterations": len(batches) - 1}), flush=True)


def _phases(tmp: Path, devices: int, jobs: int) -> dict[str, float]:
    """Medians over `jobs` small-mlp jobs started at once through a `pack` daemon of how long
    each phase took (milliseconds), and the loops' makespan (the first loop's start to the
    last one's end)."""
    print(f"phases of {jobs} training jobs through salusd (pack) ...", file=sys.stderr)
    with _daemon(tmp, "pack", devices) as daemon:
        procs = [subprocess.Popen([sys.executable, __file__, "--phase-client", daemon.address],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for _ in range(jobs)]
        ends: list[dict[str, Any]] = []
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:
                assert p.stdout is not None
                ends.append(json.loads(p.stdout.readline()))
        finally:
            for p in procs:
                p.wait(timeout=120)
    began = {"connect_attach_define": lambda r: r["ends"][0], "first_call": lambda r: r["ends"][1],
             "other_iterations": lambda r: r["loop_began"], "info": lambda r: r["info_began"]}
    out: dict[str, Any] = {name: statistics.median(
        (r["ends"][i + 1] - start(r)) * 1e3 for r in ends)
        for i, (name, start) in enumerate(began.items())}
    out["loops_makespan"] = (max(r["ends"][3] for r in ends)
                             - min(r["loop_began"] for r in ends)) * 1e3
    import torch

    from salus.demo.jobs import WORKLOADS, _setup, run_direct

    torch.set_num_threads(1)
    w = WORKLOADS["small-mlp"]
    run_direct(w)  # warm: the first steps in a process cost more
    prepared = _setup(w)
    cpu_began = _cpu_s()
    run_direct(w, prepared=prepared)  # this process, alone: its loop's CPU per step
    out["direct_step_cpu_us"] = (_cpu_s() - cpu_began) / w.iterations * 1e6
    iterations = sum(r["iterations"] for r in ends)
    out["loop_cpu_us_per_iteration"] = {
        side: sum(r["cpu"][side] for r in ends) / iterations * 1e6
        for side in ("client", "executor")}
    return out


def _inference(tmp: Path, devices: int) -> dict[str, Any]:
    print("16 inference models in one daemon ...", file=sys.stderr)
    infer = ["infer-mlp"] * 16
    with (_daemon(tmp, "pack", devices) as daemon,
          Launched(infer, daemon.address, hold=True) as group):
        pids = tree(daemon.pid)
        daemon_pss, daemon_rss = group_memory(pids)
        by_process = {pid: memory(pid)[0] for pid in pids}
        client_rss = sum(r["rss_bytes"] for r in group.results)
    print("16 inference models as separate processes ...", file=sys.stderr)
    with Launched(infer, "direct", hold=True) as group:
        process_pss, process_rss = group_memory([r["pid"] for r in group.results])
    return {
        "models": 16,
        "daemon_processes": len(pids),
        "daemon_pss_bytes": daemon_pss,
        "daemon_pss_by_process_bytes": sorted(by_process.values(), reverse=True),
        "processes_pss_bytes": process_pss,
        "processes_over_daemon_pss": process_pss / daemon_pss,
        "daemon_rss_sum_bytes": daemon_rss,
        "processes_rss_sum_bytes": process_rss,
        "daemon_clients_rss_bytes": client_rss,
    }


if __name__ == "__main__":
    main()
