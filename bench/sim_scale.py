"""Simulator scale: wall seconds to replay a synthetic trace under each policy.

Default: 100,000 jobs (short/long training mix, Poisson arrivals at 90% load) on 64 devices of
16 GB; the scale goal is 1,000,000 jobs on 512 devices in under 60 s per policy. Prints progress
on stderr and one JSON object on stdout: per policy the wall and CPU seconds (CPU time says
more than wall time on a shared machine), the 1-minute load average before and after, events
handled and simulated makespan, and each policy's wall time relative to fifo's in the same run;
`trace_cpu_s` is the CPU time of generating the trace, shared by the policies of one run.

    .venv/bin/python bench/sim_scale.py [--jobs N] [--devices D] [--policies P,...] [--quick]
    .venv/bin/python bench/sim_scale.py --jobs 1000000 --devices 512 --policies srtf
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from salus.scheduler.policies import POLICIES
from salus.scheduler.report import summarize
from salus.scheduler.sim import simulate
from salus.scheduler.traces import synthetic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="10,000 jobs")
    args = parser.parse_args()
    jobs_n = 10_000 if args.quick else args.jobs
    c0 = time.process_time()
    trace = synthetic(jobs_n, seed=args.seed, devices=args.devices, load=args.load)
    out: dict[str, object] = {
        "jobs": jobs_n,
        "devices": args.devices,
        "load": args.load,
        "trace_cpu_s": round(time.process_time() - c0, 2),
        "iterations": sum(j.iterations for j in trace),
    }
    per: dict[str, dict[str, float]] = {}
    for name in args.policies.split(","):
        print(f"[sim_scale] {name}: {jobs_n} jobs on {args.devices} devices", file=sys.stderr)

        def progress(done: int, total: int, now_s: float, name: str = name) -> None:
            print(f"[sim_scale] {name}: {done}/{total} finished (virtual {now_s:,.0f} s)",
                  file=sys.stderr, flush=True)

        load_before = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(trace, name, devices=args.devices, progress=progress)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = summarize(result)
        per[name] = {
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "load_before": round(load_before, 1),
            "load_after": round(os.getloadavg()[0], 1),
            "events": result.events,
            "events_per_s": round(result.events / wall),
            "avg_jct_s": round(s["avg_jct_s"], 1),
            "makespan_s": round(s["makespan_s"], 1),
        }
        print(f"[sim_scale] {name}: {wall:.1f} s wall, {cpu:.1f} s CPU, {result.events} events",
              file=sys.stderr)
    out["policies"] = per
    if "fifo" in per:
        out["wall_vs_fifo"] = {n: round(p["wall_s"] / per["fifo"]["wall_s"], 2)
                               for n, p in per.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
