"""Unchanged scripts under `salusd run` against the same scripts run as plain processes.

(a) Per step: a plain training loop (an MLP whose width gives about 0.7, 1 and 3 ms steps here,
found by timing candidate widths in this process) times each of its iterations itself; it runs
as a direct process and under `salusd run`, alternating, `--blocks` times each, and the ratio is
of the medians of the per-step times (start-up excluded). Under `salusd run` every optimizer
step is an iteration boundary: the time the boundary takes is inside the measured step.
(b) Makespan: `--jobs` copies of a ~1 ms-step script started at once as plain processes, and at
once under `salusd run` (start-up included: interpreter, torch import, admission), in ABBA order
(`--rounds` times; the medians compared), against one CPU daemon with `--devices` CPU devices
and one intra-op thread per job on both sides.
Goals (issue 32): per-step ratio <= 1.05 at every width; makespan ratio <= 1.0.
Prints one JSON object.

    .venv/bin/python bench/script_jobs.py [--steps 400] [--blocks 3] [--jobs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from salus.daemon.cli.launch import running_daemon

TARGETS_MS = (0.7, 1.0, 3.0)
WARMUP = 20
# The training loop, timed step by step: the script runs it, and `_step_s` runs it in this
# process to find the widths.
LOOP = textwrap.dedent("""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
""")
SCRIPT = ("import json, sys, time\nimport torch\nfrom torch import nn\n"
          "width, steps = int(sys.argv[1]), int(sys.argv[2])\n" + LOOP
          + 'print(json.dumps({"times": times}))\n')


def _step_s(width: int, steps: int = 60) -> float:
    """The median step time of the script's loop at `width`, in this process."""
    scope: dict[str, Any] = {"torch": torch, "nn": nn, "time": time, "width": width,
                             "steps": steps}
    exec(LOOP, scope)  # noqa: S102 - the bench's own loop, as the script runs it
    return statistics.median(scope["times"][10:])


def widths_for(targets_ms: tuple[float, ...]) -> dict[float, int]:
    """For each target, the width (a multiple of 32) whose step is closest to it, trying
    widths upwards until a step takes twice the largest target."""
    measured: dict[int, float] = {}
    for width in range(32, 4097, 32):
        measured[width] = _step_s(width) * 1e3
        if measured[width] > 2 * max(targets_ms):
            break
    return {t: min(measured, key=lambda w: abs(measured[w] - t)) for t in targets_ms}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _direct(script: Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]


def _under_salusd(address: str, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "salus.daemon.cli", "run", "--socket",
            address.removeprefix("unix://"), "--", sys.executable, str(script), *args]


def _times(argv: list[str], cwd: Path) -> list[float]:
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    times: list[float] = json.loads(done.stdout.splitlines()[-1])["times"]
    return times[WARMUP:]


def per_step(address: str, script: Path, target_ms: float, width: int, steps: int,
             blocks: int) -> dict[str, Any]:
    direct: list[float] = []
    daemon: list[float] = []
    for block in range(blocks):
        direct += _times(_direct(script, str(width), str(steps)), script.parent)
        daemon += _times(_under_salusd(address, script, str(width), str(steps)), script.parent)
        print(f"per step, width {width}: block {block + 1}/{blocks}", file=sys.stderr)
    d50, s50 = statistics.median(direct) * 1e3, statistics.median(daemon) * 1e3
    return {"target_ms": target_ms, "width": width, "steps_timed": len(direct),
            "direct_p50_ms": d50, "salusd_p50_ms": s50, "ratio": s50 / d50,
            "direct_mean_ms": statistics.fmean(direct) * 1e3,
            "salusd_mean_ms": statistics.fmean(daemon) * 1e3, "goal": 1.05,
            "met": s50 / d50 <= 1.05}


def makespan(commands: list[list[str]], cwd: Path) -> float:
    """Seconds from starting every command at once to the last one's exit."""
    start = time.perf_counter()
    procs = [subprocess.Popen(c, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    for argv, proc in zip(commands, procs, strict=True):
        _, err = proc.communicate(timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {err[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of each per-step run")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=8, help="scripts at once, for the makespan")
    parser.add_argument("--job-steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--policy", default="pack")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ABBA rounds of the makespan comparison (medians are reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("timing widths ...", file=sys.stderr)
    widths = widths_for(TARGETS_MS)
    with tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        with running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp) / "state",
                            policy=args.policy, cpu_devices=args.devices, cpu_memory="2G",
                            cpu_threads=1) as daemon:
            steps = [per_step(daemon.address, script, t, widths[t], args.steps, args.blocks)
                     for t in TARGETS_MS]
            job = [str(widths[1.0]), str(args.job_steps)]
            runs: dict[str, list[float]] = {"processes": [], "salusd": []}
            order = ["processes", "salusd", "salusd", "processes"] * args.rounds
            for n, kind in enumerate(order):  # ABBA: both see the same drift in load
                print(f"makespan {n + 1}/{len(order)}: {args.jobs} "
                      f"{'plain processes' if kind == 'processes' else 'salusd run jobs'} at "
                      "once ...", file=sys.stderr)
                argv = (_direct(script, *job) if kind == "processes"
                        else _under_salusd(daemon.address, script, *job))
                runs[kind].append(makespan([argv] * args.jobs, script.parent))
            plain, through = statistics.median(runs["processes"]), statistics.median(runs["salusd"])
    print(json.dumps({
        "bench": "script_jobs",
        "per_step": steps,
        "per_step_met": all(s["met"] for s in steps),
        "makespan": {"jobs": args.jobs, "steps_each": args.job_steps, "width": widths[1.0],
                     "processes_s": plain, "salusd_run_s": through, "ratio": through / plain,
                     "runs_s": runs,
                     "goal": 1.0, "met": through / plain <= 1.0},
        "daemon": {"cpu_devices": args.devices, "policy": args.policy, "threads_per_job": 1},
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
