"""Top-k selectors on CPU: time of mstopk and sampled vs torch.topk(sorted=False), and recall.

Usage: .venv/bin/python bench/topk.py [--quick] [--repeats N]

For each size d and density (k = density * d) all three run round-robin on the same Gaussian
vector, so load from other processes hits them alike; times are medians, and the 1-minute load
average at start and end is reported since a busy machine stretches every time. The baseline is
``torch.topk(x.abs(), k, sorted=False)`` (selection by magnitude needs the abs). Recall is the
share of selected entries whose magnitude reaches the k-th largest (so ties count as hits),
on Gaussian and Student-t (df = 1.5, heavy-tailed) inputs. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from salus.daemon.services.topk import mstopk, sampled_topk

Selector = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]

METHODS: dict[str, Selector] = {
    "torch_topk": lambda x, k: torch.topk(x.abs(), k, sorted=False),
    "mstopk": lambda x, k: mstopk(x, k),
    "sampled": lambda x, k: sampled_topk(x, k),
}


def recall(x: torch.Tensor, k: int, select: Selector) -> float:
    """Share of the selection that belongs to a true top-k by magnitude."""
    kth = torch.topk(x.abs(), k).values[-1]
    vals, _ = select(x, k)
    return float((vals.abs() >= kth).double().mean())


def time_round_robin(x: torch.Tensor, k: int, repeats: int) -> dict[str, float]:
    """Median seconds per method, the methods interleaved within each repeat."""
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    for _ in range(repeats):
        for name, select in METHODS.items():
            start = time.perf_counter()
            select(x, k)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d in 1M, 4M instead of 1M, 25M")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [1_000_000, 4_000_000] if args.quick else [1_000_000, 25_000_000]
    load_start = os.getloadavg()[0]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for d in sizes:
        inputs = {
            "gaussian": torch.randn(d, generator=gen),
            "student_t": torch.distributions.StudentT(1.5).sample((d,)),
        }
        for density in (0.001, 0.01):
            k = int(density * d)
            print(f"d={d} density={density}", file=sys.stderr)
            secs = time_round_robin(inputs["gaussian"], k, args.repeats)
            rows.append(
                {
                    "d": d,
                    "density": density,
                    "k": k,
                    "median_ms": {m: round(s * 1e3, 2) for m, s in secs.items()},
                    "speedup_vs_torch_topk": {
                        m: round(secs["torch_topk"] / secs[m], 2) for m in ("mstopk", "sampled")
                    },
                    "recall": {
                        dist: {m: recall(x, k, METHODS[m]) for m in ("mstopk", "sampled")}
                        for dist, x in inputs.items()
                    },
                }
            )
    goal_row = next(r for r in rows if r["d"] == sizes[-1] and r["density"] == 0.001)
    speedup = goal_row["speedup_vs_torch_topk"]["sampled"]
    min_recall = min(v["sampled"] for v in goal_row["recall"].values())
    print(
        json.dumps(
            {
                "bench": "topk",
                "device": "cpu",
                "torch_threads": torch.get_num_threads(),
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                "loadavg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                "results": rows,
                "goal_sampled_2x_at_largest_d_density_0.001": {
                    "d": sizes[-1],
                    "speedup": speedup,
                    "min_recall": min_recall,
                    "met": speedup >= 2.0 and min_recall >= 0.99,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
