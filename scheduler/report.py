"""Metrics, tables and plots for simulator results (times in seconds).

JCT = finish - submit; queueing = first iteration - submit; makespan = last finish - first
submit. Device utilisation is the busy share of the devices over the makespan: a device running
jobs whose utils sum to U is busy min(1, U), and under the interference model that integrates to
Σ util x gang x solo seconds over all jobs, which is what `summarize` divides by
devices x makespan.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from salus.scheduler.sim_model import SimResult

BASELINE = "fifo"
_RATIO_METRICS = ("avg_jct_s", "p50_jct_s", "p95_jct_s", "makespan_s", "avg_queue_s")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(result: SimResult) -> dict[str, Any]:
    """One flat dict of the run's metrics (seconds; utilisation in [0, 1])."""
    recs = result.records
    jcts = [r.jct_s for r in recs]
    makespan = max(r.finish_s for r in recs) - min(r.submit_s for r in recs)
    busy = math.fsum(r.util * r.gang * r.solo_s for r in recs)
    return {
        "policy": result.policy,
        "devices": result.devices,
        "device_memory_mb": result.device_memory_bytes / (1 << 20),
        "jobs": len(recs),
        "avg_jct_s": math.fsum(jcts) / len(jcts),
        "p50_jct_s": percentile(jcts, 50),
        "p95_jct_s": percentile(jcts, 95),
        "max_jct_s": max(jcts),
        "makespan_s": makespan,
        "avg_queue_s": math.fsum(r.queue_s for r in recs) / len(recs),
        "device_utilisation": busy / (result.devices * makespan) if makespan > 0 else 0.0,
        "gang_jobs_shrunk": result.shrunk_gangs,
        "events": result.events,
    }


def ratios(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each policy's time metrics divided by fifo's (below 1 = faster than fifo)."""
    base = summaries.get(BASELINE)
    if base is None:
        return {}
    return {
        name: {m: _div(s[m], base[m]) for m in (*_RATIO_METRICS, "device_utilisation")}
        for name, s in summaries.items()
    }


def _div(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else math.inf)


def emit(
    results: Mapping[str, SimResult], *, trace: str, as_json: bool, compare: bool
) -> None:
    """Print results: one JSON object, or a rich summary / comparison table."""
    summaries = {name: summarize(r) for name, r in results.items()}
    if as_json:
        if compare:
            first = next(iter(summaries.values()))
            out: dict[str, Any] = {
                "trace": trace,
                "devices": first["devices"],
                "jobs": first["jobs"],
                "policies": summaries,
                "ratio_to_fifo": ratios(summaries),
            }
        else:
            out = {"trace": trace, **next(iter(summaries.values()))}
        print(json.dumps(out, indent=None, sort_keys=False))
        return
    from rich.console import Console

    console = Console(width=None if Console().is_terminal else 110)
    if compare:
        console.print(compare_table(summaries, trace))
    else:
        console.print(summary_table(next(iter(summaries.values())), trace))


def summary_table(s: Mapping[str, Any], trace: str) -> Any:
    from rich.table import Table

    table = Table(title=f"{trace}: {s['policy']} on {s['devices']} device(s)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("jobs", *_RATIO_METRICS, "max_jct_s", "device_utilisation", "gang_jobs_shrunk"):
        value = s[key]
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    return table


def compare_table(summaries: Mapping[str, Mapping[str, Any]], trace: str) -> Any:
    from rich.table import Table

    first = next(iter(summaries.values()))
    caption = "x fifo = value / fifo's value (below 1 is better for times)"
    if first["gang_jobs_shrunk"]:
        caption += (f"; {first['gang_jobs_shrunk']} gang jobs asked for more devices than exist "
                    f"and ran on all {first['devices']}, iteration time x asked/devices")
    table = Table(
        title=f"{trace}: {first['jobs']} jobs on {first['devices']} device(s)", caption=caption
    )
    for name, justify in (
        ("policy", "left"), ("avg JCT s", "right"), ("x fifo", "right"), ("p50 JCT s", "right"),
        ("p95 JCT s", "right"), ("x fifo", "right"), ("makespan s", "right"),
        ("x fifo", "right"), ("avg queue s", "right"), ("util", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rel = ratios(summaries)
    for name, s in summaries.items():
        r = rel.get(name, {})
        table.add_row(
            name,
            f"{s['avg_jct_s']:,.1f}", _x(r.get("avg_jct_s")),
            f"{s['p50_jct_s']:,.1f}",
            f"{s['p95_jct_s']:,.1f}", _x(r.get("p95_jct_s")),
            f"{s['makespan_s']:,.1f}", _x(r.get("makespan_s")),
            f"{s['avg_queue_s']:,.1f}",
            f"{s['device_utilisation']:.2f}",
        )
    return table


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_jct_cdf(results: Mapping[str, SimResult], path: str) -> None:
    """Write a PNG with one JCT CDF per policy (log-scaled seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        jcts = sorted(r.jct_s for r in result.records)
        n = len(jcts)
        ax.step(jcts, [(i + 1) / n for i in range(n)], where="post", label=name)
    first = next(iter(results.values()))
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT CDF, {len(first.records)} jobs on {first.devices} device(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
