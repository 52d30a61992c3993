"""Data-plane latency: round trips through the unix-socket server vs the same call in process.

Usage: .venv/bin/python bench/wire.py [--quick] [--iterations N]

The server runs in a child process with a JobService that trains synchronously on the
connection's thread (no scheduler), so the socket numbers are the transport's cost plus the
same tiny iteration; this process is the client (salus.adapters.torch). Measured, interleaved
in rounds so load from other processes hits all alike:

- raw_echo: 64 bytes there and back on a bare unix socket between the same two processes (the
  floor any IPC round trip pays);
- ping: an adapter ping (framing, JSON, dispatch);
- step_socket / step_direct: one training step of Linear(16, 4) on an 8-row batch through the
  socket, and the same service call in process;
- a 1 MiB batch through shared memory vs inline in the frame.

Prints one JSON object: p50/p99 in microseconds, the socket's added p50 over the direct call,
its share of the 150 us per-iteration budget, and the ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

import salus.adapters.torch as salus
from salus.daemon.errors import UnknownJob
from salus.daemon.ipc.server import SocketServer

BUDGET_US = 150.0


class SyncService:
    """JobService that runs each call at once on the caller's thread."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.jobs: dict[str, dict[str, Any]] = {}

    def _job(self, job_id: str, owner: str) -> dict[str, Any]:
        if job_id not in self.jobs:
            raise UnknownJob(f"no job {job_id!r}")
        return self.jobs[job_id]

    def open_job(self, owner: str, name: str, iterations: int, kind: str) -> str:
        job_id = str(next(self.ids))
        self.jobs[job_id] = {}
        return job_id

    def setup_training(self, job_id: str, owner: str, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer,
                       loss_fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
        self._job(job_id, owner).update(model=model, optimizer=optimizer, loss_fn=loss_fn)
        return {}

    def setup_inference(self, job_id: str, owner: str, model: torch.nn.Module) -> dict[str, Any]:
        self._job(job_id, owner)["model"] = model
        return {}

    def step(self, job_id: str, owner: str, inputs: torch.Tensor,
             target: torch.Tensor) -> Future[float]:
        job, done = self._job(job_id, owner), Future[float]()
        job["optimizer"].zero_grad()
        loss = job["loss_fn"](job["model"](inputs), target)
        loss.backward()
        job["optimizer"].step()
        done.set_result(float(loss.detach()))
        return done

    def infer(self, job_id: str, owner: str, inputs: torch.Tensor) -> Future[torch.Tensor]:
        done = Future[torch.Tensor]()
        with torch.no_grad():
            done.set_result(self._job(job_id, owner)["model"](inputs))
        return done

    def state_dict(self, job_id: str, owner: str) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._job(job_id, owner)["model"].state_dict().items()}

    def job_info(self, job_id: str, owner: str) -> dict[str, Any]:
        return {"id": job_id}

    def close_job(self, job_id: str, owner: str) -> None:
        self.jobs.pop(job_id, None)


def serve(path: str, ready: Any, stop: Any) -> None:
    """Child process: the socket server and a bare echo socket beside it."""
    torch.set_num_threads(1)
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.bind(path + ".echo")
    echo.listen(1)

    def echo_loop() -> None:
        conn, _ = echo.accept()
        while data := conn.recv(4096):
            conn.sendall(data)

    threading.Thread(target=echo_loop, daemon=True).start()
    with SocketServer(path, SyncService()):
        ready.set()
        stop.wait()


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return {"p50": round(statistics.median(us), 1), "p99": round(us[int(0.99 * (len(us) - 1))], 1)}


def timed(fn: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def tiny_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 round trips per measurement")
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args()
    n = args.iterations or (300 if args.quick else 3000)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="salus-bench-", dir="/tmp") as tmp:
        path = os.path.join(tmp, "salusd.sock")
        ready, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(target=serve, args=(path, ready, stop), daemon=True)
        child.start()
        try:
            if not ready.wait(120):
                raise RuntimeError("the benchmark server did not start")
            result = measure(path, n)
        finally:
            stop.set()
            child.join(30)
    result.update(quick=args.quick, iterations=n)
    print(json.dumps(result))


def measure(path: str, n: int) -> dict[str, Any]:
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.connect(path + ".echo")
    payload = bytes(64)

    def raw_echo() -> None:
        echo.sendall(payload)
        echo.recv(4096)

    x, y = torch.randn(8, 16), torch.randn(8, 4)
    big_x, big_y = torch.randn(16384, 16), torch.randn(16384, 4)  # 1 MiB + 256 KiB
    direct = SyncService()
    direct_id = direct.open_job("bench", "direct", n, "training")
    direct.setup_training(direct_id, "bench", *tiny_job())
    job = salus.connect("bench", n, address=f"unix://{path}")
    step = job.train_step(*tiny_job())
    cases: dict[str, Callable[[], object]] = {
        "raw_echo": raw_echo,
        "ping": job.ping,
        "step_socket": lambda: step(x, y),
        "step_direct": lambda: direct.step(direct_id, "bench", x, y).result(),
    }
    big: dict[str, Callable[[], object]] = {"big_shm": lambda: step(big_x, big_y)}

    def big_inline() -> object:
        job._channel.shm_threshold = float("inf")
        try:
            return step(big_x, big_y)
        finally:
            job._channel.shm_threshold = 256 * 1024

    big["big_inline"] = big_inline
    samples: dict[str, list[int]] = {name: [] for name in [*cases, *big]}
    for _ in range(50):  # warm-up
        for fn in cases.values():
            fn()
    print(f"measuring {n} round trips per case", file=sys.stderr)
    for i in range(n):
        for name, fn in cases.items():
            samples[name].append(timed(fn))
        if i % 10 == 0:
            for name, fn in big.items():
                samples[name].append(timed(fn))
    job.close()
    echo.close()
    stats = {name: percentiles(s) for name, s in samples.items()}
    added = stats["step_socket"]["p50"] - stats["step_direct"]["p50"]
    return {
        "unit": "microseconds",
        "model": "Linear(16, 4), SGD, batch 8",
        **{f"{name}_us": value for name, value in stats.items()},
        "step_added_us_p50": round(added, 1),
        "step_added_share_of_150us_budget": round(added / BUDGET_US, 3),
        "step_socket_over_direct_p50": round(stats["step_socket"]["p50"]
                                             / stats["step_direct"]["p50"], 2),
        "ping_over_raw_echo_p50": round(stats["ping"]["p50"] / stats["raw_echo"]["p50"], 2),
        "big_batch_bytes": big_x.nbytes + big_y.nbytes,
        "big_inline_over_shm_p50": round(stats["big_inline"]["p50"]
                                         / stats["big_shm"]["p50"], 2),
    }


if __name__ == "__main__":
    main()
