"""What a short job's start-up costs through salusd, phase by phase, and the optimizer-state
prediction that attach pays in a freshly forked executor.

1. `jobs`: for each workload (`small-mlp`: SGD; `mlp-adam`: Adam), `--jobs` jobs one after
   another through a real `salusd serve` (CPU, pack), each timed from the client: connect,
   attach (state shipped, admitted, loaded in an executor forked from the zygote), define,
   the first call (measured), the second call, `info` and `close(pull=True)`; medians, ms.
2. `prediction`: the bytes of optimizer state a job's first step will create, found in a
   process forked from a warmed one (as executors are) from the optimizer's layout
   (`salusd/executor/optimizer_state.py`) against stepping a fake copy of it, the way every
   optimizer was predicted before; `fake_over_layout` is the ratio of their times.

Prints one JSON object.

    .venv/bin/python bench/attach_cost.py [--jobs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import salus.adapters.torch as salus
from salus.adapters.torch.sugar import _train_step
from salus.daemon.cli.launch import running_daemon
from salus.daemon.executor import measure
from salus.daemon.executor.optimizer_state import layout_bytes
from salus.demo.jobs import WORKLOADS, _setup

PHASES = ("connect", "attach", "define", "first_call", "second_call", "info", "close_pull")


def _one_job(name: str, address: str) -> list[float]:
    w = WORKLOADS[name]
    model, opt, loss_fn, batches = _setup(w)
    assert opt is not None
    t = [time.perf_counter()]
    job = salus.connect(name=w.name, iterations=w.iterations, address=address)
    t.append(time.perf_counter())
    remote = job.attach(model=model, optimizer=opt, loss_fn=loss_fn)
    t.append(time.perf_counter())
    step = remote.iteration(_train_step)
    t.append(time.perf_counter())
    for x, y in batches[:2]:
        step(x, y)
        t.append(time.perf_counter())
    job.info()
    t.append(time.perf_counter())
    job.close(pull=True)
    t.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)]


def _jobs(address: str, jobs: int) -> dict[str, dict[str, float]]:
    out = {}
    for name in ("small-mlp", "mlp-adam"):
        print(f"{jobs} {name} jobs one after another ...", file=sys.stderr)
        rows = [_one_job(name, address) for _ in range(jobs)]
        out[name] = {f"{phase}_ms": statistics.median(col)
                     for phase, col in zip(PHASES, zip(*rows, strict=True), strict=True)}
    return out


def _in_fork(fn: Any) -> float:
    """Seconds `fn()` takes the first time in a child forked from this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        began = time.perf_counter()
        fn()
        os.write(write, repr(time.perf_counter() - began).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        seconds = float(f.read())
    os.waitpid(pid, 0)
    return seconds


def _prediction(repeats: int) -> dict[str, dict[str, float]]:
    measure.warm_up()  # as the zygote does before it forks executors
    out = {}
    for name in ("small-mlp", "mlp-adam"):
        print(f"optimizer-state prediction for {name} in forked processes ...", file=sys.stderr)
        _, opt, _, _ = _setup(WORKLOADS[name])
        assert opt is not None
        params = [p for g in opt.param_groups for p in g["params"]]
        layout = [_in_fork(lambda o=opt, ps=params: layout_bytes(o, ps))
                  for _ in range(repeats)]
        fake = [_in_fork(lambda o=opt, ps=params: measure._fake_optimizer_state(o, ps))
                for _ in range(repeats)]
        out[name] = {"layout_ms": statistics.median(layout) * 1e3,
                     "fake_step_ms": statistics.median(fake) * 1e3,
                     "fake_over_layout": statistics.median(fake) / statistics.median(layout),
                     "bytes": layout_bytes(opt, params) or 0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"bench": "attach_cost", "unit": "milliseconds"}
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp), cpu_threads=1)
          as daemon):
        out["jobs"] = _jobs(daemon.address, args.jobs)
    out["prediction"] = _prediction(5)
    out["cpu_count"], out["loadavg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
