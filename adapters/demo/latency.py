"""A high-priority inference job's latency, alone and beside a training script.

The inference job runs in this process: through the daemon as `job.inference(model)` with
priority 10 (the `fair` policy serves the least attained service / priority first), or directly
(`model(x)`). It sends one batch every `GAP_S` and times each call at the caller
(`time.perf_counter`, seconds). The training job beside it is `train.py`, started with
`salusd run` (priority 1) or as a plain process; only calls made after its first optimizer step
and before it exits count as beside it.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import salus.adapters.torch as salus
from salus.daemon.cli.control import Control
from salus.demo.scripts import ScriptJob, command, plain_env
from salus.demo.workloads import WORKLOADS

GAP_S = 0.005
PRIORITY = 10.0
INFERENCE = "infer-mlp"


@dataclass(frozen=True)
class Latency:
    """Latencies (seconds) of calls alone and beside training; how long the training job took
    from its first step to its exit (seconds)."""

    alone: list[float]
    beside: list[float]
    training_s: float


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def _timed(call: Callable[[], object], calls: int,
           while_alive: subprocess.Popen[str] | None = None) -> list[float]:
    out = []
    for _ in range(calls):
        if while_alive is not None and while_alive.poll() is not None:
            break
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
        time.sleep(GAP_S)
    return out


def _beside(call: Callable[[], object], calls: int, trainer: subprocess.Popen[str]) -> Latency:
    """Time `calls` calls once `trainer` has made its first step, then wait for it."""
    assert trainer.stdout is not None
    if not trainer.stdout.readline():  # its first step's line
        raise RuntimeError(f"the training job beside inference exited {trainer.wait()}")
    began = time.monotonic()
    beside = _timed(call, calls, trainer)
    trainer.wait()
    trained = time.monotonic() - began
    if trainer.returncode != 0:
        raise RuntimeError(f"the training job beside inference exited {trainer.returncode}")
    return Latency([], beside, trained)


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    workload = WORKLOADS[INFERENCE]
    torch.manual_seed(0)
    model = workload.build()[0]
    x, _ = workload.batch(torch.Generator().manual_seed(1))
    return model, x


def through_salusd(address: str, socket: Path, train: ScriptJob, calls: int,
                   threads: int) -> Latency:
    model, x = _model()
    with salus.connect(name=f"{INFERENCE} (priority {PRIORITY:g})", iterations=4 * calls,
                       address=address) as job:
        infer = job.inference(model)
        infer(x)  # admission and the first, measured call
        with Control(address) as ctl:
            ctl.priority(str(job.id), PRIORITY)
        alone = _timed(lambda: infer(x), calls)
        trainer = subprocess.Popen(command(train, socket), env=plain_env(threads), text=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        beside = _beside(lambda: infer(x), calls, trainer)
    return Latency(alone, beside.beside, beside.training_s)


def plain(train: ScriptJob, calls: int, threads: int) -> Latency:
    model, x = _model()
    torch.set_num_threads(threads)

    def infer() -> None:
        with torch.inference_mode():
            model(x)

    infer()
    alone = _timed(infer, calls)
    trainer = subprocess.Popen(command(train, None), env=plain_env(threads), text=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    beside = _beside(infer, calls, trainer)
    return Latency(alone, beside.beside, beside.training_s)
