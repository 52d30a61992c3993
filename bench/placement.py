"""Sky Computing placement on simulated heterogeneous clusters (arXiv 2202.11836, Table 3/Fig. 5).

For each cell of the anchor's grid (4..64 devices x 24..160 encoder layers of a BERT-large-like
model), the devices are drawn like the anchor's: one base device slowed per device by seeded
random factors (compute 1-2x, memory 1-3x, network 1-2x). Three allocators plan the same cost
model: `even` (same layer count per device), `sky` (two-phase heuristic) and `optimal` (MILP,
HiGHS, --time-limit seconds per cell). Reported per cell: the simulated GPipe iteration time of
each plan (--micro-batches), the speedup of sky and optimal over even, the gap of sky to the
optimum where HiGHS proved it, and each allocator's planning time.

The layer profile is measured, not a formula: the model's five distinct blocks (embeddings;
per encoder layer attention, intermediate, output; pooler+classifier head) are built at full
size on the meta device and profiled with `profile_model` (FlopCounterMode, saved tensors,
operator traffic) at --batch x --seq tokens; an L-layer model repeats the encoder blocks L
times (3L + 2 placement layers). Times are the cost model's, not measurements. Progress goes to
stderr; one JSON object goes to stdout; the plot to --plot.

    .venv/bin/python bench/placement.py [--quick] [--time-limit 20] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from jsonout import stdout_to_stderr  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

from salus.daemon.services.placement import (  # noqa: E402
    ClusterProfile,
    CostModel,
    DeviceProfile,
    LayerProfile,
    ModelProfile,
    PlacementInfeasible,
    Plan,
    allocate_even,
    allocate_optimal,
    allocate_sky,
    heterogeneous_cluster,
    profile_model,
)

DEVICES = (4, 8, 16, 32, 64)
LAYERS = (24, 48, 96, 160)
QUICK_DEVICES = (4, 8, 16, 32)
QUICK_LAYERS = (24, 96)
err = Console(stderr=True, width=140)


class Embeddings(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.word(ids) + self.position(pos))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(h // self.heads), dim=-1)
        context = (scores @ v).transpose(1, 2).reshape(b, s, h)
        return self.norm(x + self.out(context))


class Intermediate(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.gelu(self.dense(x)), x  # the residual travels with it


class Output(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, x = pair
        return self.norm(x + self.dense(h))


class Head(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def bert_blocks(args: argparse.Namespace) -> list[LayerProfile]:
    """[embeddings, attention, intermediate, output, head], profiled at full size on meta."""
    h = args.hidden
    with torch.device("meta"):
        blocks = [("embeddings", Embeddings(30522, args.seq, h)),
                  ("attention", Attention(h, args.heads)), ("intermediate", Intermediate(h)),
                  ("output", Output(h)), ("head", Head(h, 2))]
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    return list(profile_model(blocks, ids).layers)


def bert_model(blocks: list[LayerProfile], num_layers: int, batch: int) -> ModelProfile:
    emb, att, inter, out, head = blocks
    layers = [emb]
    for i in range(num_layers):
        layers += [replace(b, name=f"layer{i}.{b.name}") for b in (att, inter, out)]
    return ModelProfile(tuple([*layers, head]), batch)


def summary(plan: Plan, cluster: ClusterProfile, micro_batches: int) -> dict[str, Any]:
    return {
        "max_stage_time_s": plan.max_stage_time_s,
        "iteration_time_s": plan.iteration_time_s(micro_batches),
        "planning_s": plan.planning_s,
        "status": plan.status,
        "mip_gap": plan.mip_gap,
        "max_memory_fraction": max(m / d.memory_bytes for m, d in
                                   zip(plan.stage_memory_bytes, cluster.devices, strict=True)),
    }


def run_cell(blocks: list[LayerProfile], num_devices: int, num_layers: int,
             args: argparse.Namespace) -> dict[str, Any]:
    model = bert_model(blocks, num_layers, args.batch)
    base = DeviceProfile("dev", args.base_tflops * 1e12, args.base_gbps * 1e9,
                         int(args.base_memory_gib * 2**30))
    cluster = heterogeneous_cluster(base, num_devices, args.latency_us * 1e-6,
                                    args.network_gbps * 1e9, seed=args.seed)
    cost = CostModel(model, cluster)
    cell: dict[str, Any] = {"devices": num_devices, "layers": num_layers,
                            "placement_layers": len(model.layers)}
    plans: dict[str, Plan] = {}
    allocators: tuple[tuple[str, Callable[[CostModel], Plan]], ...] = (
        ("even", allocate_even), ("sky", allocate_sky),
        ("optimal", lambda c: allocate_optimal(c, time_limit_s=args.time_limit)))
    for name, allocate in allocators:
        start = time.perf_counter()
        try:
            plans[name] = allocate(cost)
        except PlacementInfeasible as exc:
            cell[name] = {"error": str(exc), "planning_s": time.perf_counter() - start}
        else:
            cell[name] = summary(plans[name], cluster, args.micro_batches)
    even, sky, opt = (plans.get(k) for k in ("even", "sky", "optimal"))
    m = args.micro_batches
    for name, plan in (("sky", sky), ("optimal", opt)):
        if even and plan:
            cell[f"{name}_speedup_over_even"] = even.iteration_time_s(m) / plan.iteration_time_s(m)
            cell[f"{name}_bottleneck_speedup_over_even"] = (even.max_stage_time_s
                                                            / plan.max_stage_time_s)
    if sky and opt and opt.status == "optimal":
        cell["sky_gap_to_optimal"] = sky.max_stage_time_s / opt.max_stage_time_s - 1
    elif sky and opt and opt.mip_gap is not None:
        # HiGHS's lower bound on the optimum is (1 - gap) x its best split's bottleneck.
        bound = opt.max_stage_time_s * (1 - opt.mip_gap)
        cell["sky_gap_to_optimal_at_most"] = sky.max_stage_time_s / bound - 1
    return cell


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(cells: list[dict[str, Any]]) -> None:
    table = Table(title="placement: simulated GPipe iteration time, sky and optimal vs even")
    for col in ("devices", "layers", "sky/even", "opt/even", "sky gap", "optimal",
                "mip gap", "even s", "sky s", "opt s"):
        table.add_column(col, justify="right")
    for c in cells:
        opt = c["optimal"]
        table.add_row(
            str(c["devices"]), str(c["layers"]),
            fmt(c.get("sky_speedup_over_even"), ".3f"),
            fmt(c.get("optimal_speedup_over_even"), ".3f"),
            fmt(c.get("sky_gap_to_optimal"), ".2%") if "sky_gap_to_optimal" in c
            else "<=" + fmt(c.get("sky_gap_to_optimal_at_most"), ".2%"),
            str(opt.get("status", "infeasible")), fmt(opt.get("mip_gap"), ".2%"),
            *(fmt(c[k]["planning_s"], ".3f") for k in ("even", "sky", "optimal")),
        )
    err.print(table)


def plot(cells: list[dict[str, Any]], layers: tuple[int, ...], path: Path) -> None:
    fig, (ax_speed, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, num_layers in enumerate(layers):
        row = [c for c in cells if c["layers"] == num_layers]
        color = f"C{i}"
        for key, style, label in (("sky_speedup_over_even", "-o", "sky"),
                                  ("optimal_speedup_over_even", "--s", "optimal")):
            pts = [(c["devices"], c[key]) for c in row if key in c]
            if pts:
                ax_speed.plot(*zip(*pts, strict=True), style, color=color,
                              label=f"{label}, {num_layers} layers")
        for key, style in (("sky", "-o"), ("optimal", "--s")):
            pts = [(c["devices"], c[key]["planning_s"]) for c in row]
            ax_time.plot(*zip(*pts, strict=True), style, color=color,
                         label=f"{key}, {num_layers} layers")
    ax_speed.axhline(1.0, color="grey", lw=0.8)
    ax_speed.set(xscale="log", xlabel="devices", ylabel="iteration speedup over even",
                 title="simulated GPipe iteration time")
    ax_time.set(xscale="log", yscale="log", xlabel="devices", ylabel="planning time (s)",
                title="planning time")
    for ax in (ax_speed, ax_time):
        ticks = sorted({c["devices"] for c in cells})
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"devices {QUICK_DEVICES} x layers {QUICK_LAYERS}, 10 s MILP limit")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="HiGHS seconds per cell (default 20, or 10 with --quick)")
    ap.add_argument("--micro-batches", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="sequences per mini-batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--base-tflops", type=float, default=14.0,
                    help="base device's achieved FLOP/s, in 10**12 (V100 fp32)")
    ap.add_argument("--base-gbps", type=float, default=800.0,
                    help="base device's memory bandwidth, GB/s")
    ap.add_argument("--base-memory-gib", type=float, default=32.0)
    ap.add_argument("--network-gbps", type=float, default=12.5,
                    help="base link bandwidth, GB/s (100 Gb/s)")
    ap.add_argument("--latency-us", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=Path("bench/out/placement.png"))
    args = ap.parse_args()
    if args.time_limit is None:
        args.time_limit = 10.0 if args.quick else 20.0
    devices = QUICK_DEVICES if args.quick else DEVICES
    layers = QUICK_LAYERS if args.quick else LAYERS
    torch.set_num_threads(1)
    blocks = bert_blocks(args)
    cells = []
    with stdout_to_stderr():
        for num_layers in layers:
            for num_devices in devices:
                cell = run_cell(blocks, num_devices, num_layers, args)
                err.log(f"{num_devices:3d} devices x {num_layers:3d} layers: "
                        f"sky/even {fmt(cell.get('sky_speedup_over_even'), '.3f')}, "
                        f"gap {fmt(cell.get('sky_gap_to_optimal'), '.2%')}, "
                        f"optimal {cell['optimal'].get('status', 'infeasible')}")
                cells.append(cell)
    report(cells)
    plot(cells, layers, args.plot)
    proved = [c["sky_gap_to_optimal"] for c in cells if "sky_gap_to_optimal" in c]
    speedups = [c["sky_speedup_over_even"] for c in cells if "sky_speedup_over_even" in c]
    planning = {k: [c[k]["planning_s"] for c in cells if "error" not in c[k]]
                for k in ("even", "sky", "optimal")}
    largest = cells[-1]
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "layer_profile": {
            b.name: {"flops": b.flops, "memory_bytes": b.memory_bytes,
                     "output_bytes": b.output_bytes, "bytes_accessed": b.bytes_accessed}
            for b in blocks},
        "cells": cells,
        "summary": {
            "sky_speedup_over_even": {
                "min": min(speedups, default=None), "max": max(speedups, default=None),
                "geomean": statistics.geometric_mean(speedups) if speedups else None,
                f"at_{largest['devices']}x{largest['layers']}":
                    largest.get("sky_speedup_over_even"),
            },
            "sky_gap_to_optimal": {
                "cells_proved": len(proved), "cells": len(cells),
                "at_most_where_unproved": [c["sky_gap_to_optimal_at_most"] for c in cells
                                           if "sky_gap_to_optimal_at_most" in c],
                "max": max(proved, default=None),
                "mean": statistics.fmean(proved) if proved else None,
            },
            "planning_s": {k: {"median": statistics.median(v), "max": max(v)}
                           for k, v in planning.items() if v},
        },
        "plot": str(args.plot),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
