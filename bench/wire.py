"""Data-plane cost: the compact step/infer frames vs the JSON frames, and both vs in process.

Usage: .venv/bin/python bench/wire.py [--quick] [--iterations N]

The server runs in a child process with a JobService that answers on the connection's thread
(no scheduler); this process is the client (salus.adapters.torch). Two connections, one speaking
the compact frames (what the adapter picks when the daemon offers them) and one held to the JSON
frames (what every call used before), run the same cases in interleaved blocks so that load from
other processes hits both alike:

- raw_echo: 64 bytes there and back on a bare unix socket (the floor of any IPC round trip);
- ping: an adapter ping (JSON framing and dispatch);
- noop_step_{compact,json}: a step whose service call does no work: the transport alone;
- step_{compact,json} and step_direct: one training step of Linear(16, 4) on an 8-row batch
  through the socket, and the same service call in process;
- big_{shm,inline}: a 1.25 MiB batch through shared memory vs inline (compact frames).

Per case it reports wall-clock p50/p99 per call and CPU time per call on each side: the client's
`time.process_time()` and the server process's scheduler CPU time (all its threads, from
/proc/<pid>/task/*/schedstat), measured around whole blocks. CPU time is the figure to compare
on a loaded machine: wake-up latency inflates wall time but costs no CPU. Prints one JSON object
(microseconds) with the compact/JSON ratios.
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
NOOP = "noop"  # jobs opened with this name do no work in step()


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
        self.jobs[job_id] = {"noop": name == NOOP}
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
        if job["noop"]:
            done.set_result(0.0)
            return done
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


def process_cpu_ns(pid: int) -> int | None:
    """CPU time (nanoseconds) that the scheduler charged to all threads of `pid`; None where
    /proc has no schedstat."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total


def tiny_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.mse_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 calls per case")
    parser.add_argument("--iterations", type=int, default=None, help="calls per case")
    args = parser.parse_args()
    n = args.iterations or (400 if args.quick else 4000)
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
            assert child.pid is not None
            result = measure(path, child.pid, n)
        finally:
            stop.set()
            child.join(30)
    result.update(quick=args.quick, iterations=n, cpu_count=os.cpu_count(),
                  loadavg_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(result))


def connect(path: str, name: str, n: int, compact: bool) -> salus.Job:
    job = salus.connect(name, n, address=f"unix://{path}")
    if not compact:
        job._compact = False  # hold this connection to the JSON frames
    return job


def measure(path: str, server_pid: int, n: int) -> dict[str, Any]:
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
    jobs = {kind: connect(path, "bench", n, kind == "compact") for kind in ("compact", "json")}
    noop_jobs = {kind: connect(path, NOOP, n, kind == "compact") for kind in ("compact", "json")}
    steps = {kind: job.train_step(*tiny_job()) for kind, job in jobs.items()}
    noops = {kind: job.train_step(*tiny_job()) for kind, job in noop_jobs.items()}
    big_job = jobs["compact"]

    def big_inline() -> object:
        big_job._channel.shm_threshold = float("inf")
        try:
            return steps["compact"](big_x, big_y)
        finally:
            big_job._channel.shm_threshold = 256 * 1024

    cases: dict[str, Callable[[], object]] = {
        "raw_echo": raw_echo,
        "ping": jobs["json"].ping,
        "noop_step_compact": lambda: noops["compact"](x, y),
        "noop_step_json": lambda: noops["json"](x, y),
        "step_compact": lambda: steps["compact"](x, y),
        "step_json": lambda: steps["json"](x, y),
        "step_direct": lambda: direct.step(direct_id, "bench", x, y).result(),
        "big_shm": lambda: steps["compact"](big_x, big_y),
        "big_inline": big_inline,
    }
    rare = {"big_shm", "big_inline"}  # 1.25 MiB calls: a tenth as many
    block = 50
    wall: dict[str, list[int]] = {name: [] for name in cases}
    cpu: dict[str, list[tuple[float, float | None]]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        for _ in range(20):
            fn()
    print(f"measuring {n} calls per case in blocks of {block}", file=sys.stderr)
    for r in range(max(1, n // block)):
        for name, fn in cases.items():
            if name in rare and r % 10:
                continue
            wall[name] += run_block(fn, block, cpu[name], server_pid)
        if r % 10 == 0:
            print(f"round {r + 1}/{max(1, n // block)}", file=sys.stderr)
    for job in (*jobs.values(), *noop_jobs.values()):
        job.close()
    echo.close()
    return summarise(wall, cpu)


def run_block(fn: Callable[[], object], block: int, cpu: list[tuple[float, float | None]],
              server_pid: int) -> list[int]:
    """Run `fn` `block` times; appends (client, server) CPU microseconds per call to `cpu` and
    returns each call's wall time in nanoseconds."""
    times = []
    server0 = process_cpu_ns(server_pid)
    client0 = time.process_time()
    for _ in range(block):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    client = (time.process_time() - client0) / block * 1e6
    server1 = process_cpu_ns(server_pid)
    server = None if server0 is None or server1 is None else (server1 - server0) / block / 1e3
    cpu.append((client, server))
    return times


def summarise(wall: dict[str, list[int]],
              cpu: dict[str, list[tuple[float, float | None]]]) -> dict[str, Any]:
    stats: dict[str, dict[str, float | None]] = {}
    for name, samples in wall.items():
        us = sorted(s / 1000 for s in samples)
        clients = [c for c, _ in cpu[name]]
        servers = [s for _, s in cpu[name] if s is not None]
        stats[name] = {
            "p50": round(statistics.median(us), 1),
            "p99": round(us[int(0.99 * (len(us) - 1))], 1),
            "client_cpu": round(statistics.median(clients), 1),
            "server_cpu": round(statistics.median(servers), 1) if servers else None,
        }

    def ratio(a: str, b: str, key: str) -> float | None:
        num, den = stats[a][key], stats[b][key]
        return None if num is None or not den else round(num / den, 3)

    added = {kind: round(stats[f"step_{kind}"]["p50"] or 0.0, 1)
             - (stats["step_direct"]["p50"] or 0.0) for kind in ("compact", "json")}
    return {
        "unit": "microseconds per call (p50/p99 wall; cpu: median over blocks of 50 calls)",
        "model": "Linear(16, 4), SGD, batch 8",
        **{f"{name}_us": value for name, value in stats.items()},
        "step_added_us_p50": {kind: round(v, 1) for kind, v in added.items()},
        "step_added_share_of_150us_budget": {kind: round(v / BUDGET_US, 3)
                                             for kind, v in added.items()},
        "compact_over_json": {
            "noop_client_cpu": ratio("noop_step_compact", "noop_step_json", "client_cpu"),
            "noop_server_cpu": ratio("noop_step_compact", "noop_step_json", "server_cpu"),
            "noop_p50": ratio("noop_step_compact", "noop_step_json", "p50"),
            "step_client_cpu": ratio("step_compact", "step_json", "client_cpu"),
            "step_server_cpu": ratio("step_compact", "step_json", "server_cpu"),
            "step_p50": ratio("step_compact", "step_json", "p50"),
        },
        "step_compact_over_direct_p50": ratio("step_compact", "step_direct", "p50"),
        "ping_over_raw_echo_p50": ratio("ping", "raw_echo", "p50"),
        "big_batch_bytes": 16384 * 20 * 4,
        "big_inline_over_shm_p50": ratio("big_inline", "big_shm", "p50"),
    }


if __name__ == "__main__":
    main()
