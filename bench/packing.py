"""Packing: 8 small training jobs and 16 inference models, through salusd and without it.

1. Makespan of 8 small training jobs started at once: through the daemon under `pack` (lanes in
   parallel) and under `fifo` (one job at a time per device), against 8 separate processes
   running the same loops at once without the daemon.
2. Resident memory of 16 inference models (about 17 MiB of parameters each): one daemon holding
   all 16 against 16 separate processes each holding one. On the CPU backend "device memory" is
   the serving processes' resident set (VmRSS); the clients of the daemon hold their own copy of
   the model on the host too, reported apart. Salus reports 42x fewer GPUs for inference.

Prints one JSON object.

    .venv/bin/python bench/packing.py [--devices 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from salus.daemon.demo_jobs import Launched, launch
from salus.daemon.launch import DaemonProcess, running_daemon


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _daemon(tmp: Path, policy: str, devices: int) -> AbstractContextManager[DaemonProcess]:
    return running_daemon(tmp / f"salusd-{policy}.sock", state_dir=tmp, policy=policy,
                          cpu_devices=devices)


def _makespan(results: list[dict[str, Any]]) -> float:
    return max(r["end_wall"] for r in results) - min(r["start_wall"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    train = ["small-mlp"] * 8
    out: dict[str, Any] = {"bench": "packing", "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp:
        spans = {}
        for policy in ("pack", "fifo"):
            print(f"8 training jobs through salusd ({policy}) ...", file=sys.stderr)
            with _daemon(Path(tmp), policy, args.devices) as daemon:
                spans[policy] = _makespan(launch(train, daemon.address))
        print("8 training jobs as separate processes ...", file=sys.stderr)
        spans["processes"] = _makespan(launch(train, "direct"))
        out["training"] = {
            "jobs": 8,
            "makespan_s": spans,
            "pack_over_fifo": spans["pack"] / spans["fifo"],
            "pack_over_processes": spans["pack"] / spans["processes"],
        }

        print("16 inference models in one daemon ...", file=sys.stderr)
        infer = ["infer-mlp"] * 16
        with (_daemon(Path(tmp), "pack", args.devices) as daemon,
              Launched(infer, daemon.address, hold=True) as group):
            daemon_rss = _rss(daemon.pid)
            client_rss = sum(r["rss_bytes"] for r in group.results)
        print("16 inference models as separate processes ...", file=sys.stderr)
        with Launched(infer, "direct", hold=True) as group:
            process_rss = sum(r["rss_bytes"] for r in group.results)
        out["inference"] = {
            "models": 16,
            "daemon_rss_bytes": daemon_rss,
            "processes_rss_bytes": process_rss,
            "processes_over_daemon": process_rss / daemon_rss,
            "daemon_clients_rss_bytes": client_rss,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
