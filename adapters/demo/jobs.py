"""Client processes of the demo's workloads (`workloads.py`), each runnable directly (the
baseline) or as a client of a running daemon (`python -m salus.demo.jobs NAME ADDRESS`); the
benchmarks start groups of them with `launch` and `Launched`.

Every job is seeded, so a direct run and a daemon run see the same data and the same model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import salus.adapters.torch as salus
from salus.demo.workloads import WORKLOADS, Workload

__all__ = ["WORKLOADS", "Launched", "Workload", "launch", "run_client", "run_direct"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _loop(w: Workload, step: Callable[[torch.Tensor, torch.Tensor], float | None],
          batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    loss = None
    for x, y in batches:
        loss = step(x, y)
    return loss


def _submitted_loop(step: salus.TrainStep,
                    batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    """The loop as a script written for salusd runs it: each step submitted without waiting
    for its loss (`TrainStep.submit`; at most 32 in flight), the losses read at the end."""
    losses = [step.submit(x, y) for x, y in batches]
    return losses[-1].result() if losses else None


Prepared = tuple[nn.Module, torch.optim.Optimizer | None, Any, list[Any]]


def _setup(w: Workload) -> Prepared:
    torch.manual_seed(0)
    model, opt, loss_fn = w.build()
    g = torch.Generator().manual_seed(1)
    return model, opt, loss_fn, [w.batch(g) for _ in range(w.iterations)]


def run_direct(w: Workload, hold: Callable[[], None] = lambda: None,
               prepared: Prepared | None = None) -> dict[str, Any]:
    """The job's loop in this process, without the daemon (the baseline); `hold` runs while
    the model is still alive; `prepared` is the model and batches built beforehand."""
    model, opt, loss_fn, batches = prepared or _setup(w)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        if opt is None:
            with torch.inference_mode():
                model(x)
            return None
        opt.zero_grad()
        out = loss_fn(model(x), y)
        out.backward()
        opt.step()
        return float(out.detach())

    start_wall, start = time.time(), time.perf_counter()
    loss = _loop(w, step, batches)
    seconds = time.perf_counter() - start
    hold()
    return {"name": w.name, "kind": w.kind, "iterations": w.iterations, "seconds": seconds,
            "start_wall": start_wall, "end_wall": start_wall + seconds, "final_loss": loss,
            "rss_bytes": _rss_bytes()}


def run_client(w: Workload, address: str, hold: Callable[[], None] = lambda: None,
               prepared: Prepared | None = None, blocking: bool = False) -> dict[str, Any]:
    """The same loop through the daemon, as a training script would write it: its steps
    submitted (`_submitted_loop`), or with `blocking` each loss read before the next step as
    the direct loop does; `hold` runs before the job closes (benchmarks read memory figures
    then)."""
    model, opt, loss_fn, batches = prepared or _setup(w)
    start_wall, start = time.time(), time.perf_counter()
    with salus.connect(name=w.name, iterations=w.iterations, address=address) as job:
        if opt is None:
            infer = job.inference(model)
            loss = _loop(w, lambda x, _y: (infer(x), None)[1], batches)
        else:
            step = job.train_step(model, opt, loss_fn)
            loss = _loop(w, step, batches) if blocking else _submitted_loop(step, batches)
        info = job.info()
        seconds = time.perf_counter() - start
        hold()
        job.close(pull=True)  # the trained state back into `model`, as a script keeps it
    return {
        "name": w.name,
        "kind": w.kind,
        "iterations": w.iterations,
        "seconds": seconds,
        "start_wall": start_wall,
        "end_wall": start_wall + seconds,
        "mean_iteration_s": info.get("mean_iteration_s"),
        "device": info.get("device"),
        "lane": info.get("lane"),
        "final_loss": loss,
        "rss_bytes": _rss_bytes(),
    }


def launch(names: list[str], target: str, *, hold: bool = False,
           blocking: bool = False) -> list[dict[str, Any]]:
    """Run one process per workload name at once (`target`: a unix:// address, or 'direct'),
    released together once all have imported torch and built their models; `blocking`: see
    `run_client`."""
    with Launched(names, target, hold=hold, blocking=blocking) as group:
        return group.results


class Launched:
    """Client processes started together; a context manager that always reaps them.

    With `hold`, `results` holds each client's memory figures taken while its job is open;
    `release()` lets them finish."""

    def __init__(self, names: list[str], target: str, *, hold: bool = False,
                 blocking: bool = False) -> None:
        self.hold = hold
        args = (["--hold"] if hold else []) + (["--blocking"] if blocking else [])
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "salus.demo.jobs", n, target, *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for n in names
        ]
        for p in self.procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError("a client process failed to start")
        self._send()
        self.results = [json.loads(self._line(p)) for p in self.procs]

    @staticmethod
    def _line(p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a client process died (exit {p.wait()})")
        return line

    def _send(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()

    def release(self) -> None:
        """Let held clients close their jobs and exit."""
        if self.hold:
            self.hold = False
            self._send()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.close()


def main() -> None:
    """Client process: build, say `ready`, wait for `go`, run, print one JSON line.

    With `--hold` it prints its memory figures while the job is still open instead, and waits
    for one more line before it ends the job; with `--blocking` its daemon loop reads each
    loss before the next step (`run_client`)."""
    name, target = sys.argv[1], sys.argv[2]
    holding = "--hold" in sys.argv
    workload = WORKLOADS[name]
    prepared = _setup(workload)  # built before the start signal: only the loop is timed
    print("ready", flush=True)
    sys.stdin.readline()

    def hold() -> None:
        if holding:
            print(json.dumps({"name": name, "rss_bytes": _rss_bytes(), "pid": os.getpid()}),
                  flush=True)
            sys.stdin.readline()

    if target == "direct":
        result = run_direct(workload, hold, prepared)
    else:
        result = run_client(workload, target, hold, prepared, "--blocking" in sys.argv)
    if not holding:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
