"""Client processes of the kit's jobs: each prints `ready`, waits for a line on stdin, runs,
and prints one JSON line (times on the machine's monotonic clock, seconds).

    clients.py train ADDRESS NAME SECONDS WIDTH ROWS [FN]  # train through salusd for SECONDS
                                      # (0: until a `stop` line on stdin) with jobfns.FN
                                      # (default train); then its executor's memory_stats
    clients.py serve-train ADDRESS  # prints `ready` once imported, then runs one `train` per
                                    # stdin line NAME SECONDS WIDTH ROWS FN (empty line: end)
    clients.py hold-infer                              # an inference model on cuda:0, no salusd
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time

import jobfns
import models
import torch

import salus.adapters.torch as salus
from salus.demo.jobs import WORKLOADS

torch.set_num_threads(1)
MAX_S = 120.0  # a trainer told to run until stopped stops by itself after this


def _told_to_stop() -> bool:
    """Whether a line came on stdin (without waiting for one)."""
    return bool(select.select([sys.stdin], [], [], 0)[0])


def train(address: str, name: str, seconds: float, width: int, rows: int,
          fn: str = "train") -> None:
    """Train with `jobfns.<fn>` until `seconds` have passed after `go` (0: until told to stop,
    a line on stdin, at most `MAX_S`), or until a call fails; reports each call's end time, the
    first error, and its executor's `jobfns.memory_stats` after the last call."""
    model = models.mlp(width)
    x, y = models.batch(width, rows)
    ends: list[float] = []
    losses: list[float] = []
    error = None
    with salus.connect(name=name, iterations=10**6, address=address) as job:
        remote = job.attach(model=model, opt=models.sgd(model))
        step = remote.iteration(getattr(jobfns, fn))
        print("ready", flush=True)  # admission may wait for other jobs (fifo): not before go
        sys.stdin.readline()
        start = time.monotonic()
        limit = seconds if seconds > 0 else MAX_S
        while time.monotonic() - start < limit and not (seconds <= 0 and _told_to_stop()):
            try:
                losses.append(step(x, y))
            except Exception as exc:  # noqa: BLE001 - the failure is what gets reported
                error = f"{type(exc).__name__}: {exc}"[:500]
                break
            ends.append(time.monotonic())
        job_id = job.id
        stats = None
        if error is None:
            try:
                stats = remote.function(jobfns.memory_stats)()
            except Exception as exc:  # noqa: BLE001 - a figure of its own, not the run's error
                stats = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps({"name": name, "job_id": job_id, "calls": len(ends), "start": start,
                      "ends": ends, "error": error, "memory_stats": stats, "uid": os.getuid(),
                      "losses_finite": all(math.isfinite(v) for v in losses)}), flush=True)


def serve_train(address: str) -> None:
    """`train` one job after another in this process (torch is imported once): one per stdin
    line NAME SECONDS WIDTH ROWS FN (SECONDS > 0), until an empty line or the end of stdin."""
    print("ready", flush=True)
    while line := sys.stdin.readline().strip():
        name, seconds, width, rows, fn = line.split()
        train(address, name, float(seconds), int(width), int(rows), fn)


def hold_infer() -> None:
    """bench/packing.py's inference model (`infer-mlp`) on cuda:0 in this process, the baseline
    without salusd: runs 20 forward passes, prints its pid, and holds the model until another
    line comes."""
    workload = WORKLOADS["infer-mlp"]
    torch.manual_seed(0)
    model = workload.build()[0].to("cuda:0")
    x, _ = workload.batch(torch.Generator().manual_seed(1))
    print("ready", flush=True)
    sys.stdin.readline()
    with torch.inference_mode():
        for _ in range(20):
            model(x.to("cuda:0"))
    torch.cuda.synchronize()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()


def main() -> None:
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "train":
        train(args[0], args[1], float(args[2]), int(args[3]), int(args[4]), *args[5:6])
    elif kind == "serve-train":
        serve_train(args[0])
    elif kind == "hold-infer":
        hold_infer()
    else:
        raise SystemExit(f"unknown client kind {kind!r}")


if __name__ == "__main__":
    main()
