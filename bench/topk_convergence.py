"""Convergence check: a small MLP on 4 gloo workers, dense allreduce vs hitopk at density 0.01.

Usage: .venv/bin/python bench/topk_convergence.py [--quick] [--steps N] [--density D]

Each worker trains the same MLP (64 -> 256 -> 256 -> 10, same initial weights) with SGD plus
momentum on its own stream of a synthetic 10-class task whose labels come from a fixed random
teacher network. The gradient of all parameters, flattened, is summed across workers either
with ``dist.all_reduce`` (dense) or with ``hitopk_allreduce`` (2 nodes x 2 local ranks, error
feedback) and divided by 4. Both runs see the same data in the same order. Reported: the
held-out loss after the same number of steps, and the ratio hitopk / dense (goal: <= 1.10).
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from salus.daemon.services.hitopk import hitopk_allreduce
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group

WORLD, LOCAL_SIZE = 4, 2
PG_TIMEOUT_S = 120
RUN_TIMEOUT_S = 3600  # the full-size run on 2 shared cores, with a wide margin
DIM, CLASSES, BATCH, LR, MOMENTUM = 64, 10, 64, 0.05, 0.9


def teacher() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
    )


def batch(labeller: nn.Module, gen: torch.Generator, size: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(size, DIM, generator=gen)
    with torch.no_grad():
        y = labeller(x).argmax(1)
    return x, y


def train(mode: str, steps: int, density: float, rank: int) -> dict[str, float]:
    """Train from the shared initial weights; returns held-out and last-steps training loss."""
    labeller, model = teacher(), student()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(100 + rank)
    residual = torch.zeros(sum(p.numel() for p in params))
    tail: list[float] = []
    for step in range(steps):
        x, y = batch(labeller, gen, BATCH)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        if mode == "dense":
            dist.all_reduce(flat)
        else:
            flat = hitopk_allreduce(flat, density, residual, local_size=LOCAL_SIZE, dense_below=0)
        flat /= WORLD
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()
        if step >= steps - 20:
            tail.append(loss.item())
    x, y = batch(labeller, torch.Generator().manual_seed(999), 4096)
    with torch.no_grad():
        held_out = float(loss_fn(model(x), y))
    return {"held_out_loss": held_out, "train_loss_last20": sum(tail) / len(tail)}


def _worker(rank: int, port: int, steps: int, density: float, out: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    result = {mode: train(mode, steps, density, rank) for mode in ("dense", "hitopk")}
    if rank == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 steps instead of 1000")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    steps = args.steps or (300 if args.quick else 1000)
    print(f"{WORLD} workers, {steps} steps, density {args.density}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as out:
        run_local_group(
            _worker, WORLD, (free_port(), steps, args.density, out), timeout_s=RUN_TIMEOUT_S
        )
        result = json.loads((Path(out) / "result.json").read_text())
    ratio = result["hitopk"]["held_out_loss"] / result["dense"]["held_out_loss"]
    params = sum(p.numel() for p in student().parameters())
    print(
        json.dumps(
            {
                "bench": "topk_convergence",
                "workers": WORLD,
                "layout": f"{WORLD // LOCAL_SIZE} nodes x {LOCAL_SIZE} local ranks",
                "parameters": params,
                "density": args.density,
                "steps": steps,
                "dense": result["dense"],
                "hitopk": result["hitopk"],
                "held_out_loss_ratio_hitopk_vs_dense": round(ratio, 4),
                "within_10_percent": ratio <= 1.10,
            }
        )
    )


if __name__ == "__main__":
    main()
