"""Sparse allreduce over 4 gloo processes on loopback: dense vs flat top-k vs hierarchical top-k.

Usage: .venv/bin/python bench/hitopk.py [--quick] [--numel N] [--density D] [--repeats R]

Four processes, laid out as 2 nodes x 2 local ranks for the hierarchical scheme, sum one
float32 tensor (25M elements; 4M with --quick) with:
- ``dense``: ``dist.all_reduce``;
- ``flat_topk``: top-(density * numel) of each rank's tensor, all-gather of values and int32
  indices over all ranks, summed;
- ``hitopk``: ``hitopk_allreduce(density, local_size=2)``.
Bytes sent per rank are measured (``wchar`` of ``/proc/self/io``: gloo writes to its sockets
with write/writev); seconds are the median over repeats of the slowest rank. All processes share
this machine's cores and one loopback device, so there is no slow inter-node link here: the
time ratios show compute and copy costs, the byte ratios what a real network would carry. For
``hitopk`` the bytes of its inter-node collectives are also counted on their own (the
collective helpers are wrapped to read ``wchar`` around each call), next to the model
``(nodes - 1) * k_shard * (4 + 4)``. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from salus.daemon.services import hitopk as topk_module
from salus.daemon.services.hitopk import hitopk_allreduce
from salus.daemon.services.procgroup import free_port, init_loopback, leave_group, run_local_group
from salus.daemon.services.sparse_allreduce import all_gather, node_layout
from salus.daemon.services.topk import topk

WORLD, LOCAL_SIZE = 4, 2
PG_TIMEOUT_S = 300
RUN_TIMEOUT_S = 3600  # the full-size run on 2 shared cores, with a wide margin


def written_bytes() -> int:
    """Bytes this process has passed to write-type syscalls (sockets included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def flat_topk_allreduce(t: torch.Tensor, density: float) -> torch.Tensor:
    """Baseline: every rank's top-k, all-gathered over the whole world and summed."""
    k = max(1, math.ceil(density * t.numel()))
    vals, idx = topk(t, k)
    all_vals = vals.new_empty(WORLD * k)
    all_idx = torch.empty(WORLD * k, dtype=torch.int32)
    world = dist.group.WORLD
    assert world is not None
    all_gather(all_vals, vals, world)
    all_gather(all_idx, idx.to(torch.int32), world)
    return torch.zeros_like(t).index_add_(0, all_idx, all_vals)


Collective = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]


def count_inter_node_bytes(counter: list[int]) -> None:
    """Wrap hitopk's collective helpers so that bytes sent in inter-node groups add to counter."""

    def counted(fn: Collective) -> Collective:
        def run(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
            before = written_bytes()
            fn(out, inp, group)
            if group is node_layout(LOCAL_SIZE).inter:
                counter[0] += written_bytes() - before

        return run

    topk_module.all_gather = counted(topk_module.all_gather)
    topk_module.reduce_scatter = counted(topk_module.reduce_scatter)


def _worker(rank: int, port: int, numel: int, density: float, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    init_loopback(rank, WORLD, port, timeout_s=PG_TIMEOUT_S)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    schemes: dict[str, Callable[[], object]] = {
        "dense": lambda: dist.all_reduce(x.clone()),
        "flat_topk": lambda: flat_topk_allreduce(x, density),
        "hitopk": lambda: hitopk_allreduce(x, density, local_size=LOCAL_SIZE),
    }
    inter = [0]
    count_inter_node_bytes(inter)
    stats: dict[str, dict[str, list[float]]] = {}
    for name, run in schemes.items():
        run()  # warm-up: creates the cached sub-groups, connects sockets
        secs, sent, sent_inter = [], [], []
        for _ in range(repeats):
            dist.barrier()
            inter[0] = 0
            before, start = written_bytes(), time.perf_counter()
            run()
            secs.append(time.perf_counter() - start)
            sent.append(float(written_bytes() - before))
            sent_inter.append(float(inter[0]))
        stats[name] = {"seconds": secs, "bytes": sent, "inter_node_bytes": sent_inter}
    torch.save(stats, Path(out) / f"rank{rank}.pt")
    leave_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M elements instead of 25M")
    parser.add_argument("--numel", type=int, default=None)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    numel = args.numel or (4_000_000 if args.quick else 25_000_000)
    print(f"{WORLD} processes, {numel} float32, density {args.density}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as out:
        run_local_group(
            _worker,
            WORLD,
            (free_port(), numel, args.density, args.repeats, out),
            timeout_s=RUN_TIMEOUT_S,
        )
        per_rank = [torch.load(Path(out) / f"rank{r}.pt") for r in range(WORLD)]
    result: dict[str, dict[str, float]] = {}
    for name in per_rank[0]:
        # The slowest rank bounds each repeat; bytes: the busiest rank's median.
        slowest = [max(r[name]["seconds"][i] for r in per_rank) for i in range(args.repeats)]
        sent = max(statistics.median(r[name]["bytes"]) for r in per_rank)
        result[name] = {"seconds": statistics.median(slowest), "bytes_sent_per_rank": int(sent)}
    hitopk_inter = max(statistics.median(r["hitopk"]["inter_node_bytes"]) for r in per_rank)
    dense = result["dense"]
    for scheme in result.values():
        scheme["time_ratio_vs_dense"] = round(scheme["seconds"] / dense["seconds"], 3)
        scheme["bytes_ratio_vs_dense"] = round(
            scheme["bytes_sent_per_rank"] / dense["bytes_sent_per_rank"], 4
        )
        scheme["seconds"] = round(scheme["seconds"], 4)
    shard = -(-numel // LOCAL_SIZE)
    k_shard = min(shard, max(1, math.ceil(args.density * shard - 1e-9)))
    nodes = WORLD // LOCAL_SIZE
    print(
        json.dumps(
            {
                "bench": "hitopk",
                "world": WORLD,
                "layout": f"{nodes} nodes x {LOCAL_SIZE} local ranks",
                "numel": numel,
                "density": args.density,
                "repeats": args.repeats,
                "schemes": result,
                "hitopk_inter_node_bytes_per_rank": {
                    "measured": int(hitopk_inter),
                    "modelled": (nodes - 1) * k_shard * (4 + 4),
                    "ratio_vs_dense_total": round(hitopk_inter / dense["bytes_sent_per_rank"], 5),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
