"""Packed spanning trees vs NCCL-style rings on every DGX-1 allocation (Blink, Figure 5).

For every subset of 3 to 8 GPUs of the DGX-1P and DGX-1V presets, broadcasting from the lowest
GPU id: the rate of the tree packing (`pack_trees`, --eps) against the rate of the packed rings
measured in the same run (the baseline), the number of trees before and after the ILP
(`minimize_trees`, which may give up --ilp-eps of the rate), and the time to plan. Rates are
the models' figures in GB/s, not measurements. Progress and a table go to stderr; one JSON
object goes to stdout; the plot goes to --plot (default bench/out/treegen.png).

    .venv/bin/python bench/treegen.py [--quick] [--eps 0.005] [--ilp-eps 0.05] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from jsonout import stdout_to_stderr  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from salus.daemon.services.collectives import (  # noqa: E402
    Topology,
    minimize_trees,
    pack_rings,
    pack_trees,
)

PRESETS = {"dgx1p": Topology.dgx1p, "dgx1v": Topology.dgx1v}
SIZES = range(3, 9)
QUICK_PER_SIZE = 6
err = Console(stderr=True, width=120)


def subsets(quick: bool, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    chosen: list[tuple[int, ...]] = []
    for size in SIZES:
        every = list(combinations(range(8), size))
        chosen += sorted(rng.sample(every, min(QUICK_PER_SIZE, len(every)))) if quick else every
    return chosen


def measure(topo: Topology, gpus: tuple[int, ...], eps: float,
            ilp_eps: float) -> dict[str, Any]:
    sub = topo.subgraph(list(gpus))
    t0 = time.perf_counter()
    plan = pack_trees(sub, gpus[0], eps=eps)
    t1 = time.perf_counter()
    fewer = minimize_trees(plan, ilp_eps)
    t2 = time.perf_counter()
    rings = pack_rings(sub)
    ring = sum(r.rate for r in rings)
    return {
        "gpus": list(gpus),
        "tree_gbps": plan.rate,
        "tree_bound_gbps": plan.upper_bound,
        "ilp_gbps": fewer.rate,
        "ring_gbps": ring,
        "best_single_ring_gbps": max((r.rate for r in rings), default=0.0),
        "rings": len(rings),
        "trees_mwu": plan.explored,
        "trees_before_ilp": len(plan.trees),
        "trees_after_ilp": len(fewer.trees),
        "plan_s": t1 - t0,
        "ilp_s": t2 - t1,
        "speedup": plan.rate / ring,
    }


def summarise(rows: list[dict[str, Any]], eps: float) -> dict[str, Any]:
    speed = [r["speedup"] for r in rows]
    return {
        "allocations": len(rows),
        "speedup_vs_rings": {"min": min(speed), "median": statistics.median(speed),
                             "max": max(speed)},
        "trees_at_least_rings": sum(r["tree_gbps"] >= r["ring_gbps"] * (1 - 1e-9) for r in rows),
        "trees_within_eps_of_rings": sum(r["tree_gbps"] >= (1 - eps) * r["ring_gbps"]
                                         for r in rows),
        "rings_above_tree_bound": sum(r["ring_gbps"] > r["tree_bound_gbps"] * (1 + 1e-9)
                                      for r in rows),
        "ilp_rate_ratio_min": min(r["ilp_gbps"] / r["tree_gbps"] for r in rows),
        "trees_before_ilp_mean": statistics.mean(r["trees_before_ilp"] for r in rows),
        "trees_after_ilp_mean": statistics.mean(r["trees_after_ilp"] for r in rows),
        "trees_after_ilp_max": max(r["trees_after_ilp"] for r in rows),
        "plan_s_median": statistics.median(r["plan_s"] for r in rows),
        "plan_s_max": max(r["plan_s"] for r in rows),
        "ilp_s_median": statistics.median(r["ilp_s"] for r in rows),
        "ilp_s_max": max(r["ilp_s"] for r in rows),
        "best": max(rows, key=lambda r: r["speedup"])["gpus"],
    }


def table(name: str, rows: list[dict[str, Any]]) -> Table:
    t = Table(title=f"{name}: packed trees vs rings (broadcast, GB/s)")
    for col in ("GPUs", "allocs", "ring median", "tree median", "speedup min/med/max",
                "trees before -> after ILP", "plan s (median)"):
        t.add_column(col, justify="right")
    for size in SIZES:
        part = [r for r in rows if len(r["gpus"]) == size]
        if not part:
            continue
        sp = [r["speedup"] for r in part]
        t.add_row(
            str(size), str(len(part)),
            f"{statistics.median(r['ring_gbps'] for r in part):.1f}",
            f"{statistics.median(r['tree_gbps'] for r in part):.1f}",
            f"{min(sp):.2f} / {statistics.median(sp):.2f} / {max(sp):.2f}",
            f"{statistics.mean(r['trees_before_ilp'] for r in part):.1f} -> "
            f"{statistics.mean(r['trees_after_ilp'] for r in part):.1f}",
            f"{statistics.median(r['plan_s'] for r in part):.3f}",
        )
    return t


def _groups(rows: list[dict[str, Any]]) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """(size, first x, rows sorted by tree then ring rate) per GPU count."""
    x = 0
    for size in SIZES:
        part = sorted((r for r in rows if len(r["gpus"]) == size),
                      key=lambda r: (r["tree_gbps"], r["ring_gbps"]))
        yield size, x, part
        x += len(part)


def _frame(ax: Any, rows: list[dict[str, Any]]) -> None:
    for size, x, part in _groups(rows):
        if part:
            label = f"{size} GPUs" if len(part) > 20 else str(size)
            ax.text(x + len(part) / 2 - 0.5, 1.01, label, ha="center", va="bottom",
                    transform=ax.get_xaxis_transform(), fontsize=9)
            if x:
                ax.axvline(x - 0.5, color="0.75", lw=0.8)
    ax.set_xlim(-1, len(rows))
    ax.set_xlabel("allocation (sorted by tree rate within each GPU count)")
    ax.grid(axis="y", color="0.9")


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Per preset: each allocation's tree and ring rates (left) and the speedup (right)."""
    fig, axes = plt.subplots(len(results), 2, figsize=(16, 4.6 * len(results)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (rates, speed), (name, rows) in zip(axes, results.items(), strict=True):
        for size, x, part in _groups(rows):
            xs = range(x, x + len(part))
            rates.scatter(xs, [r["tree_gbps"] for r in part], s=16, c="tab:blue", marker="o",
                          label="packed trees" if size == 3 else None, zorder=2)
            rates.scatter(xs, [r["ring_gbps"] for r in part], s=16, c="tab:red", marker="x",
                          label="rings (NCCL-style)" if size == 3 else None, zorder=3)
            speed.scatter(xs, [r["speedup"] for r in part], s=12, c="tab:green", zorder=2)
        _frame(rates, rows)
        _frame(speed, rows)
        rates.set_title(f"{name}: broadcast rate per allocation", pad=18)
        rates.set_ylabel("broadcast rate (GB/s)")
        rates.set_ylim(bottom=0)
        rates.legend(loc="upper left")
        best = max(rows, key=lambda r: r["speedup"])
        speed.axhline(1.0, color="0.3", lw=0.8, ls="--")
        speed.set_title(f"{name}: trees / rings (max {best['speedup']:.1f}x on GPUs "
                        f"{best['gpus']})", pad=18)
        speed.set_ylabel("speedup over rings")
        speed.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_PER_SIZE} sampled allocations per GPU count instead of all")
    ap.add_argument("--eps", type=float, default=0.005,
                    help="tree packing accuracy: rate within (1 - eps) of the optimum")
    ap.add_argument("--ilp-eps", type=float, default=0.05,
                    help="rate the ILP may give up to use fewer trees")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed for --quick")
    ap.add_argument("--plot", type=Path,
                    default=Path(__file__).resolve().parent / "out" / "treegen.png")
    args = ap.parse_args()

    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    with stdout_to_stderr():
        for name, preset in PRESETS.items():
            topo = preset()
            rows = []
            for i, gpus in enumerate(subsets(args.quick, args.seed), 1):
                rows.append(measure(topo, gpus, args.eps, args.ilp_eps))
                if i % 25 == 0:
                    err.print(f"[dim]{name}: {i} allocations[/dim]")
            results[name] = rows
            err.print(table(name, rows))
        plot(results, args.plot)
    out = {
        "bench": "treegen",
        "baseline": "packed NCCL-style rings on the same allocation (same run)",
        "quick": args.quick,
        "eps": args.eps,
        "ilp_eps": args.ilp_eps,
        "wall_s": time.perf_counter() - started,
        "plot": str(args.plot),
        "presets": {name: summarise(rows, args.eps) for name, rows in results.items()},
    }
    err.print(f"plot: {args.plot}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
