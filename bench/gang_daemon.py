"""Data-parallel jobs through salusd: a 2-replica interactive gang against a one-device job.

Usage: .venv/bin/python bench/gang_daemon.py [--steps 40] [--rounds 3]

Starts a real `salusd serve` with 2 CPU devices (one intra-op thread per executor) and trains
the two models of `bench/dataparallel.py` through the torch adapter:

- ``compute_bound``: 3 linear layers of 256 x 256 on 4096 samples per step;
- ``comm_bound``: 4 linear layers of 1024 x 1024 (16.8 MB of gradients) on 16 samples.

``one_device`` is `salus.connect(...)` with one device: each step on the whole batch in one
executor. The gang variants are `salus.connect(..., devices=2)`: the daemon sends each call to
both replicas, each steps on half the batch and averages gradients with
`s.comm.all_reduce_gradients` by the named algorithm (``ring``, ``tree``), or at density 0.01
(``sparse``; within one node Hi-TopK reduces dense, so this measures its bookkeeping), or with
``ring`` and then PTO's `s.comm.sharded_step` instead of ``opt.step()`` (``pto``). Variants take
turns for ``--rounds`` rounds of ``--steps`` steps, so all see the same machine load; a
variant's step time is the median of its client-side call times. ``speedup_vs_one_device`` is
the one-device job's step time over the variant's (2.0 would be perfect scaling on 2 devices);
``bytes_per_step_per_replica`` is what the job's `comm` counters say (job info). Prints one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon

MODELS: dict[str, tuple[int, int, int]] = {  # name: (width, layers, global batch)
    "compute_bound": (256, 3, 4096),
    "comm_bound": (1024, 4, 16),
}
GANG_VARIANTS = ("ring", "tree", "sparse", "pto")


def _model(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks[:-1])
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _one_device(s: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    s.opt.step()
    return float(loss)


def _gang(s: Any, x: torch.Tensor, y: torch.Tensor, variant: str) -> float:
    s.opt.zero_grad()
    loss = nn.functional.mse_loss(s.model(x), y)
    loss.backward()
    if variant == "sparse":
        s.comm.all_reduce_gradients(s.model, density=0.01)
    else:
        s.comm.all_reduce_gradients(s.model, algorithm="ring" if variant == "pto" else variant)
    if variant == "pto":
        s.comm.sharded_step(s.opt)
    else:
        s.opt.step()
    return float(loss)


def _open(address: str, model_name: str, variant: str, steps: int) -> tuple[salus.Job, Any]:
    width, layers, _ = MODELS[model_name]
    model, opt = _model(width, layers)
    devices = 1 if variant == "one_device" else 2
    job = salus.connect(f"{model_name}-{variant}", steps, address=address, devices=devices)
    remote = job.attach(model=model, opt=opt)
    if devices == 1:
        return job, remote.iteration(_one_device)
    step = remote.iteration(_gang)
    return job, lambda x, y: step(x, y, salus.whole(variant))


def _bench_model(address: str, model_name: str, steps: int, rounds: int) -> dict[str, Any]:
    width, _, batch = MODELS[model_name]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    variants = ["one_device", *GANG_VARIANTS]
    opened = {v: _open(address, model_name, v, steps * rounds + 3) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _, step in opened.values():
        for _ in range(3):  # admission and the measured first call
            step(x, y)
    for r in range(rounds):
        for variant, (_, step) in opened.items():
            for _ in range(steps):
                start = time.perf_counter()
                step(x, y)
                times[variant].append(time.perf_counter() - start)
        print(f"{model_name}: round {r + 1}/{rounds}", file=sys.stderr)
    out: dict[str, Any] = {}
    base = statistics.median(times["one_device"])
    for variant, (job, _) in opened.items():
        median = statistics.median(times[variant])
        comm = job.info().get("comm") or {}
        calls = steps * rounds + 3
        out[variant] = {
            "step_ms": median * 1e3,
            "speedup_vs_one_device": base / median,
            "bytes_per_step_per_replica": (int(comm.get("bytes_sent", 0)) // 2 // calls
                                           if comm else 0),
            "last_algorithm": comm.get("last_algorithm"),
        }
        job.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp), cpu_devices=2,
                         cpu_memory="2G", cpu_threads=1) as daemon):
        for model_name in MODELS:
            results[model_name] = _bench_model(daemon.address, model_name, args.steps,
                                               args.rounds)
    print(json.dumps({
        "bench": "gang_daemon",
        "unit": "per training step, client side, through salusd with 2 CPU devices",
        **results,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
