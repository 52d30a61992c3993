"""Data-parallel training step: a 2-process gang with `Comm` against one process, per algorithm.

Usage: .venv/bin/python bench/dataparallel.py [--quick] [--steps S] [--rounds R]

Two models, each trained with SGD (momentum) on a fixed global batch:
- ``comm_bound``: 4 linear layers of 1024 x 1024 (4.2M parameters, 16.8 MB of gradients) on 16
  samples: communication dominates the step;
- ``compute_bound``: 3 linear layers of 256 x 256 (0.2M parameters) on 4096 samples: compute
  dominates.
One process runs the whole batch with one thread. The gang splits it over 2 processes (gloo on
loopback, one thread each), laid out as 2 nodes of 1 process (``Comm(local_size=1)``, as a gang
over two machines would be: hierarchical top-k sparsifies only what crosses nodes, and
``hierarchical`` is then a plain allreduce between the nodes). It averages gradients with
``all_reduce_gradients`` by each algorithm (``ring``, ``tree``, ``hierarchical``, ``auto``), by
top-k at density 0.01 (``sparse``), and with ``ring`` followed by PTO's ``sharded_step`` instead
of ``opt.step()`` (``pto``). Variants take turns for ``--rounds`` rounds of ``--steps`` steps; a
variant's step time is the median over its steps of the slower rank. ``speedup_vs_one_process``
is the one process's step time over the gang's (2.0 would be perfect scaling). Bytes per replica
per step: what ``comm.stats`` counted and what the process wrote (``wchar`` of
``/proc/self/io``: gloo's socket writes). All processes share this machine's cores with whatever
else runs on it (``os.getloadavg`` is reported). Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from salus.daemon.services.comm import Comm
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

WORLD = 2
PG_TIMEOUT_S = 300
RUN_TIMEOUT_S = 1800
VARIANTS = ["ring", "tree", "hierarchical", "auto", "sparse", "pto"]
MODELS: dict[str, tuple[int, int, int]] = {  # name: (width, layers, global batch)
    "comm_bound": (1024, 4, 16),
    "compute_bound": (256, 3, 4096),
}
SPARSE_DENSITY = 0.01


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def make_batch(width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def written_bytes() -> int:
    """Bytes this process has passed to write-type syscalls (sockets included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def time_steps(step: Callable[[], None], steps: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per call of ``step``, ``steps`` times after one warm-up call."""
    step()
    out = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def one_process(steps: int, rounds: int) -> dict[str, float]:
    """Median step time (s) of each model on the whole batch in this process."""
    torch.set_num_threads(1)
    result = {}
    for name, (width, layers, batch) in MODELS.items():
        model = make_model(width, layers)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = make_batch(width, batch)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt,
                 x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        result[name] = statistics.median(time_steps(step, steps * rounds, lambda: None))
    return result


def _worker(rank: int, port: int, steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    comm = Comm(local_size=1)
    record: dict[str, Any] = {}
    for name, (width, layers, batch) in MODELS.items():
        model = make_model(width, layers)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = make_batch(width, batch)
        per = batch // WORLD
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        runs: dict[str, dict[str, list[float]]] = {
            v: {"seconds": [], "counted": [], "written": []} for v in VARIANTS
        }

        def make_step(variant: str, model: nn.Module = model, opt: torch.optim.Optimizer = opt,
                      x: torch.Tensor = x, y: torch.Tensor = y) -> Callable[[], None]:
            def step() -> None:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if variant == "sparse":
                    comm.all_reduce_gradients(model, density=SPARSE_DENSITY)
                elif variant == "pto":
                    comm.all_reduce_gradients(model, algorithm="ring")
                else:
                    comm.all_reduce_gradients(model, algorithm=variant)
                if variant == "pto":
                    comm.sharded_step(opt)
                else:
                    opt.step()

            return step

        auto_picked = None
        for _ in range(rounds):
            for variant in VARIANTS:
                counted, written = comm.stats.bytes_sent, written_bytes()
                secs = time_steps(make_step(variant), steps, dist.barrier)
                # Warm-up step included in the byte counts; the barriers' bytes are tiny.
                runs[variant]["seconds"] += secs
                runs[variant]["counted"].append((comm.stats.bytes_sent - counted) / (steps + 1))
                runs[variant]["written"].append((written_bytes() - written) / (steps + 1))
                if variant == "auto":
                    auto_picked = comm.last_algorithm
        record[name] = {"runs": runs, "auto_picked": auto_picked}
    torch.save(record, Path(out) / f"rank{rank}.pt")
    comm.close()
    leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under ~2 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="steps per variant and round")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 10)
    rounds = args.rounds or (3 if args.quick else 5)
    load_before = os.getloadavg()[0]
    baseline = one_process(steps, rounds)
    print(f"one process: {baseline}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as out:
        run_local_group(_worker, WORLD, (free_port(), steps, rounds, out), timeout_s=RUN_TIMEOUT_S)
        per_rank = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    result: dict[str, object] = {
        "world": WORLD,
        "steps_per_variant": steps * rounds,
        "cpu_cores": os.cpu_count(),
        "load_average_1min_before": round(load_before, 2),
        "models": {},
    }
    models: dict[str, object] = {}
    for name, (width, layers, batch) in MODELS.items():
        params = sum(p.numel() for p in make_model(width, layers).parameters())
        gang: dict[str, dict[str, float]] = {}
        for variant in VARIANTS:
            runs = [r[name]["runs"][variant] for r in per_rank]
            slowest = [max(secs) for secs in zip(*(r["seconds"] for r in runs), strict=True)]
            step_s = statistics.median(slowest)
            gang[variant] = {
                "step_s": round(step_s, 5),
                "speedup_vs_one_process": round(baseline[name] / step_s, 3),
                "bytes_sent_per_replica_per_step": int(
                    max(statistics.median(r["counted"]) for r in runs)),
                "bytes_written_per_replica_per_step": int(
                    max(statistics.median(r["written"]) for r in runs)),
            }
        dense = gang["ring"]["bytes_sent_per_replica_per_step"]
        for v in gang.values():
            v["bytes_ratio_vs_ring"] = round(v["bytes_sent_per_replica_per_step"] / dense, 4)
        models[name] = {
            "parameters": params,
            "gradient_bytes": params * 4,
            "global_batch": batch,
            "one_process_step_s": round(baseline[name], 5),
            "auto_picked": per_rank[0][name]["auto_picked"],
            "gang": gang,
        }
    result["models"] = models
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
