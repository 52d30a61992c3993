"""Round trip of a call to a job's executor with and without the executor's polling window.

Usage: .venv/bin/python bench/spin.py [--calls 300] [--blocks 12]

Starts two real daemons (CPU, one thread per executor), one with `SALUS_SPIN_US=0` (executors
block as soon as they are idle) and one with the default window (`salusd/executor/main.py`,
`spin_window_s`), opens one job on each whose call returns its argument (a 32 x 64 tensor), and
alternates blocks of ``--calls`` calls between them so both see the same machine load. Prints
one JSON object: p50 and p90 round trips (microseconds) and the ratio polling / blocking.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon
from salus.daemon.executor.spin import SPIN_US


def _echo(s: Any, x: torch.Tensor) -> torch.Tensor:
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modes = {"blocking": "0", "polling": str(SPIN_US)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    x = torch.randn(32, 64)
    with contextlib.ExitStack() as stack:
        calls = {}
        for mode, window in modes.items():
            os.environ["SALUS_SPIN_US"] = window  # the daemon passes it on to its executors
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="salusd-bench-")))
            daemon = stack.enter_context(running_daemon(tmp / "salusd.sock", state_dir=tmp,
                                                        cpu_threads=1))
            job = stack.enter_context(salus.connect(f"spin-{mode}", 10**9,
                                                    address=daemon.address))
            calls[mode] = job.attach(t=torch.zeros(1)).iteration(_echo)
        for call in calls.values():
            for _ in range(args.calls):
                call(x)
        for _ in range(args.blocks):
            for mode, call in calls.items():
                for _ in range(args.calls):
                    start = time.perf_counter()
                    call(x)
                    times[mode].append(time.perf_counter() - start)
    out: dict[str, Any] = {"bench": "spin", "unit": "microseconds per call round trip",
                           "window_us": SPIN_US}
    for mode, ts in times.items():
        out[mode] = {"p50_us": statistics.median(ts) * 1e6,
                     "p90_us": statistics.quantiles(ts, n=10)[-1] * 1e6}
    out["ratio_p50_polling_over_blocking"] = out["polling"]["p50_us"] / out["blocking"]["p50_us"]
    out["cpu_count"], out["loadavg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
