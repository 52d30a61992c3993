"""`python -m salus.scheduler.sim`: replay a trace file under one policy or all of them, and
print a summary, one JSON object or a comparison table (`report.py`); optionally plot the JCT
distribution per policy. The simulator itself is `sim.py`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from salus.scheduler.policies import POLICIES
from salus.scheduler.sim import Progress, simulate
from salus.scheduler.traces import TraceError, load_trace


def _stderr_progress(policy: str) -> Progress:
    def report(done: int, total: int, now_s: float) -> None:
        print(f"[sim {policy}] {done}/{total} jobs finished, virtual time {now_s:,.0f} s",
              file=sys.stderr, flush=True)

    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m salus.scheduler.sim`: simulate a trace and print a summary, JSON or a table."""
    parser = argparse.ArgumentParser(
        prog="python -m salus.scheduler.sim",
        description="Replay a job trace through salusd's iteration scheduler on a virtual clock.",
    )
    parser.add_argument("--trace", required=True, help="trace CSV file")
    parser.add_argument("--format", choices=["native", "tiresias"], default=None,
                        help="trace format (default: from the header)")
    parser.add_argument("--policy", choices=list(POLICIES), default="fifo")
    parser.add_argument("--devices", type=int, default=1, help="devices on the node")
    parser.add_argument("--device-memory-mb", type=float, default=16384.0,
                        help="memory per device, MiB (default 16384: a 16 GB V100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--compare", action="store_true",
                        help="run every policy; table with ratios against fifo")
    parser.add_argument("--plot", metavar="PNG", help="write the JCT CDF per policy to PNG")
    parser.add_argument("--exact", action="store_true",
                        help="one event per iteration (slow reference engine)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)

    from salus.scheduler import report

    try:
        jobs = load_trace(args.trace, args.format)
        policies = list(POLICIES) if args.compare else [args.policy]
        results = {}
        for name in policies:
            progress = None if args.quiet else _stderr_progress(name)
            results[name] = simulate(jobs, name, devices=args.devices,
                                     device_memory_mb=args.device_memory_mb, exact=args.exact,
                                     progress=progress)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.emit(results, trace=args.trace, as_json=args.json, compare=args.compare)
    if args.plot:
        report.plot_jct_cdf(results, args.plot)
        if not args.json:
            print(f"wrote {args.plot}", file=sys.stderr)
    return 0
