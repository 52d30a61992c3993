"""Policy outcomes on synthetic traces, each against fifo simulated on the same trace.

* srtf vs fifo, average JCT, on a mix of short and long training jobs arriving over time
  (Salus reports 3.19x for SRTF over FIFO on its training mix; this trace is ours, not theirs);
* pack vs fifo, makespan, on jobs that each keep at most a quarter of a device busy
  (util <= 0.25), all submitted at once: pack runs several at a time where memory allows. Such
  jobs are usually small models, so the main figure uses the small models of the table
  (alexnet, googlenet); the same trace over every model shows how memory limits packing.

Prints progress on stderr and one JSON object on stdout.

    .venv/bin/python bench/sim_policies.py [--quick] [--devices N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from salus.scheduler.report import summarize
from salus.scheduler.sim import simulate
from salus.scheduler.traces import TraceJob, synthetic


def _run(trace: list[TraceJob], policy: str, devices: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    summary = summarize(simulate(trace, policy, devices=devices))
    print(f"[sim_policies] {policy}: {len(trace)} jobs on {devices} device(s), "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="200 jobs")
    args = parser.parse_args()
    n = 200 if args.quick else args.jobs

    mix = synthetic(n, seed=args.seed, devices=args.devices, load=args.load)
    fifo, srtf = _run(mix, "fifo", args.devices), _run(mix, "srtf", args.devices)

    small, every = ("alexnet", "googlenet"), None
    pack_runs = {}
    for label, models in (("small_models", small), ("all_models", every)):
        light = synthetic(n, seed=args.seed, devices=args.devices, burst=True,
                          utils=(0.1, 0.15, 0.2, 0.25), models=models)
        pack_runs[label] = (_run(light, "fifo", args.devices), _run(light, "pack", args.devices))

    out = {
        "devices": args.devices,
        "jobs": n,
        "srtf_vs_fifo": {
            "trace": f"synthetic short/long mix, Poisson arrivals at load {args.load}, "
                     f"seed {args.seed}",
            "fifo_avg_jct_s": round(fifo["avg_jct_s"], 1),
            "srtf_avg_jct_s": round(srtf["avg_jct_s"], 1),
            "fifo_over_srtf_avg_jct": round(fifo["avg_jct_s"] / srtf["avg_jct_s"], 2),
            "fifo_over_srtf_p95_jct": round(fifo["p95_jct_s"] / srtf["p95_jct_s"], 2),
            "salus_reported_fifo_over_srtf": 3.19,
        },
        "pack_vs_fifo": {
            label: {
                "trace": f"synthetic short/long mix of {'/'.join(models or ['all'])} models, "
                         f"util 0.10-0.25, all submitted at t=0, seed {args.seed}",
                "fifo_makespan_s": round(f["makespan_s"], 1),
                "pack_makespan_s": round(p["makespan_s"], 1),
                "fifo_over_pack_makespan": round(f["makespan_s"] / p["makespan_s"], 2),
                "fifo_device_utilisation": round(f["device_utilisation"], 3),
                "pack_device_utilisation": round(p["device_utilisation"], 3),
            }
            for (label, models), (f, p) in zip(
                (("small_models", small), ("all_models", every)), pack_runs.values(), strict=True
            )
        },
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
