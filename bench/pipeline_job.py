"""Pipeline jobs through the daemon on 2 CPU devices, one SIMULATED slower: measured iteration
time of the sky (and the optimal) split against the even split.

Usage: .venv/bin/python bench/pipeline_job.py [--quick] [--iterations N] [--rounds R]
                                              [--slowdown F]

A salusd is started with 2 CPU devices (one intra-op thread each) and `--cpu-device-slowdown
1,F` (F = 2 by default): a simulation, in which device 1's executors sleep (F - 1) x the CPU
time of each of their forward and backward computations. The job is a stack of BLOCKS equal
blocks (Linear(WIDTH, WIDTH) + Tanh) trained with SGD (momentum) on batches of BATCH samples in
MICROBATCHES micro-batches, submitted with "devices": 2, "pipeline": true and each placement in
turn, for --rounds rounds (the placements alternate, so load that drifts touches all alike).
Each job plans its own split in its first iteration: the replicas benchmark their devices (with
the simulated factor) and links, replica 0 profiles the model and runs the allocator.

Iteration time is measured in the job, on replica 0: the time between the ends of consecutive
iterations (its `evaluate` runs after each), median over the iterations after the first
WARMUP + 1 (the first plans the split; the second may be re-admitted with its measured
memory). Per placement the median over rounds is reported, with the split each job chose and
the cost model's GPipe iteration (its stage times are per micro-batch: their sum plus
MICROBATCHES - 1 times the slowest), read from the jobs' final checkpoints.
`speedup_sky_over_even` is even's iteration time over sky's (> 1: sky is faster). All
processes share this machine's cores with whatever else runs on it (`os.getloadavg` is
reported). This file is also the jobs' entrypoint (`make_job`): the benchmark copies it into
the daemon's job root. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BLOCKS, WIDTH, BATCH, SAMPLES, MICROBATCHES = 12, 1024, 256, 1024, 4
WARMUP = 2
PLACEMENTS = ("even", "sky", "optimal")


def make_job() -> dict[str, Any]:
    """The benchmark's job, as the daemon's executors load it."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                            for _ in range(BLOCKS)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, WIDTH, generator=g)
    data = DataLoader(TensorDataset(x, torch.tanh(x.flip(1))), batch_size=BATCH)
    ends: list[float] = []

    def evaluate(s: Any) -> float:  # seconds per iteration so far, warm-up left out
        ends.append(time.perf_counter())
        gaps = [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:], strict=False)]
        return statistics.median(gaps) if gaps else -1.0

    return {"state": {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-3,
                                                             momentum=0.9)},
            "loss": nn.functional.mse_loss, "data": data, "evaluate": evaluate, "every": 1}


def run_job(client: Any, placement: str, iterations: int, state: Path) -> dict[str, Any]:
    """Submit one pipeline job, wait for its end and final checkpoint; its measured and
    predicted iteration times and its split."""
    from salus.daemon.executor import checkpoint

    job = client.call("POST", "/v1/jobs", {
        "name": f"pipeline-{placement}", "entrypoint": "pipeline_job.py:make_job",
        "iterations": iterations, "devices": 2, "pipeline": True, "placement": placement,
        "microbatches": MICROBATCHES})
    deadline = time.monotonic() + 600
    while True:
        info = client.get(f"/v1/jobs/{job['id']}")
        if info["state"] == "failed":
            raise RuntimeError(f"the {placement} job failed: {info['reason']}")
        if info["state"] == "finished" and (info["checkpoint"] or {}).get("iteration") == (
                iterations):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {placement} job did not end within 600 s")
        time.sleep(0.1)
    loaded = checkpoint.load_latest(state / "checkpoints" / str(job["id"]) / "replica0")
    assert loaded is not None
    plan = loaded.payload["objects"]["pipeline"]
    stages = list(plan.stage_times_s)
    return {"iteration_s": float(info["last_evaluation"]), "boundaries": list(plan.boundaries),
            "predicted_iteration_s": sum(stages) + (MICROBATCHES - 1) * max(stages)}


def main() -> None:
    from salus.daemon.cli.launch import running_daemon
    from salus.daemon.rest.client import RestClient

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 10 iterations")
    parser.add_argument("--iterations", type=int, default=None, help="per job (default 30)")
    parser.add_argument("--rounds", type=int, default=None, help="jobs per placement (3)")
    parser.add_argument("--slowdown", type=float, default=2.0,
                        help="device 1's simulated compute factor (default 2)")
    args = parser.parse_args()
    iterations = args.iterations or (10 if args.quick else 30)
    rounds = args.rounds or (1 if args.quick else 3)
    if iterations < WARMUP + 3:
        parser.error(f"--iterations must be at least {WARMUP + 3}")
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLACEMENTS}
    with tempfile.TemporaryDirectory(prefix="salus-pipeline-bench-") as tmp:
        root, state = Path(tmp) / "job-root", Path(tmp) / "state"
        root.mkdir()
        shutil.copy(__file__, root / "pipeline_job.py")
        with running_daemon(Path(tmp) / "salusd.sock", state_dir=state, cpu_devices=2,
                            cpu_memory="2G", cpu_threads=1, log_file=Path(tmp) / "salusd.log",
                            extra_args=["--cpu-device-slowdown", f"1,{args.slowdown}",
                                        "--job-root", str(root),
                                        "--checkpoint-every", "1000000"]):
            url = (state / "http.url").read_text().strip()
            token = (state / "admin.token").read_text().strip()
            with RestClient(url, token) as client:
                for r in range(rounds):
                    for placement in PLACEMENTS:
                        run = run_job(client, placement, iterations, state)
                        print(f"round {r} {placement}: {run}", file=sys.stderr)
                        runs[placement].append(run)
    result: dict[str, Any] = {
        "devices": 2, "compute_slowdowns_simulated": [1.0, args.slowdown],
        "model": {"blocks": BLOCKS, "width": WIDTH, "batch": BATCH,
                  "microbatches": MICROBATCHES},
        "iterations_per_job": iterations, "iterations_timed_per_job": iterations - WARMUP - 1,
        "rounds": rounds, "cpu_cores": os.cpu_count(),
        "load_average_1min_before": round(load_before, 2),
    }
    for placement, jobs in runs.items():
        result[placement] = {
            "iteration_s": round(statistics.median(j["iteration_s"] for j in jobs), 5),
            "predicted_iteration_s": round(
                statistics.median(j["predicted_iteration_s"] for j in jobs), 5),
            "boundaries": [j["boundaries"] for j in jobs],
        }
    even = result["even"]["iteration_s"]
    result["speedup_sky_over_even"] = round(even / result["sky"]["iteration_s"], 3)
    result["speedup_optimal_over_even"] = round(even / result["optimal"]["iteration_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
