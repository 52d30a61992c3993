"""How often a `sched_yield` takes long without giving the CPU to another task.

Usage: .venv/bin/python bench/yield_gaps.py [--seconds 2]

A polling side (`salusd/wire/channel.py`, `spin`) yields the CPU at each empty look and used
to take any yield slower than `YIELD_TAKEN_S` for a sign that another process wants the CPU.
In a VM a yield also takes that long when the host runs something else on the vCPU, or an
interrupt comes; no task of the machine ran, and the CPU is still the poller's. This bench
yields in a loop for `--seconds`, alone on its CPU, then again with a busy process pinned to the
same CPU, and counts the slow yields and how many of them raised this thread's involuntary
context switches (a yield that ran another task does). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from salus.daemon.wire.channel import YIELD_TAKEN_S, involuntary_switches


def yields(seconds: float) -> dict[str, Any]:
    """Yield for `seconds`: durations and the slow yields, split by whether they switched."""
    clock = time.perf_counter
    gaps: list[float] = []
    switched = 0
    switches = involuntary_switches()
    end = clock() + seconds
    while (now := clock()) < end:
        os.sched_yield()
        gap = clock() - now
        gaps.append(gap)
        if gap > YIELD_TAKEN_S:
            before, switches = switches, involuntary_switches()
            switched += switches != before
    gaps.sort()
    slow = sum(g > YIELD_TAKEN_S for g in gaps)
    return {
        "yields": len(gaps),
        "p50_us": gaps[len(gaps) // 2] * 1e6,
        "p99_us": gaps[int(len(gaps) * 0.99)] * 1e6,
        "max_us": gaps[-1] * 1e6,
        "slow_per_s": slow / seconds,
        "slow_that_ran_another_task": switched,
        "slow_without_a_switch": slow - switched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    out: dict[str, Any] = {"bench": "yield_gaps", "slow_means_over_us": YIELD_TAKEN_S * 1e6}
    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    os.sched_setaffinity(0, {cpu})
    try:
        print("yielding alone on the CPU ...", file=sys.stderr)
        out["alone"] = yields(args.seconds)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            os.sched_setaffinity(hog.pid, {cpu})
            time.sleep(0.05)
            print("yielding beside a busy process on the same CPU ...", file=sys.stderr)
            out["beside_a_busy_process"] = yields(args.seconds)
        finally:
            hog.kill()
            hog.wait()
    finally:
        os.sched_setaffinity(0, mine)
    alone = out["alone"]
    slow = alone["slow_that_ran_another_task"] + alone["slow_without_a_switch"]
    out["alone_slow_without_a_switch_share"] = alone["slow_without_a_switch"] / max(1, slow)
    out["cpu_count"] = os.cpu_count()
    out["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
