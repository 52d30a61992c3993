"""Where a call's time goes: the stages of a training step's round trip through salusd.

Starts a real `salusd serve` (CPU, one thread per process) and runs a step through the job
contract whose function notes, on the clock both processes share (CLOCK_MONOTONIC), when it
began and ended. The client notes when it sent and when the reply was back, so each call splits
into: client to function start (encode, send, executor wake-up, decode, random state, peak
meter), the function itself (beside the same step run directly in this process), and function
end to the result in the client's hands (result, send, client wake-up, decode); `hop` is those
two together, per call: what the call costs beyond its function, which the direct step's
variance between blocks (up to 20 % on the build VM) does not blur. Cases: the tiny MLP of
`overhead.py`, its ~2 ms MLP (width 768) and the 6 ms MLP (3 layers of width 512, batch
128 x 512), each with the client polling for its reply (the default) and blocking
(`SALUS_CLIENT_SPIN_US=0`). `steps_per_call`: the tiny step's own CPU time (this thread's,
`time.thread_time`) in a direct loop and inside calls that run it 1, 2 or 4 times, the first
step of a call apart from the later ones: what the serve loop's work between two calls costs
the step after it. Prints one JSON object (p50s, microseconds).

    .venv/bin/python bench/call_stages.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from overhead import mlp  # the same models as bench/overhead.py
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.cli.launch import running_daemon

BLOCKS = 5


def _timed_step(s: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer step; returns (began, ended) on the monotonic clock, float64."""
    began = time.monotonic()
    s.opt.zero_grad()
    s.loss_fn(s.model(x), y).backward()
    s.opt.step()
    return torch.tensor([began, time.monotonic()], dtype=torch.float64)


def _k_steps(s: Any, k: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`k` optimizer steps; each one's CPU time (this thread's), float64."""
    times = []
    for _ in range(int(k)):
        began = time.thread_time()
        s.opt.zero_grad()
        s.loss_fn(s.model(x), y).backward()
        s.opt.step()
        times.append(time.thread_time() - began)
    return torch.tensor(times, dtype=torch.float64)


def _steps_per_call(address: str, calls: int) -> dict[str, float]:
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    model, opt, loss_fn = mlp(16)
    direct = _direct(model, opt, loss_fn, x, y, calls, clock=time.thread_time)
    out = {"direct_step_cpu_p50_us": statistics.median(direct[calls // 10:]) * 1e6}
    with salus.connect(name="steps-per-call", iterations=10 * calls, address=address) as job:
        fn = job.attach(model=model, opt=opt, loss_fn=loss_fn).iteration(_k_steps)
        for k in (1, 2, 4):
            times = [fn(torch.tensor(float(k)), x, y).tolist() for _ in range(calls)]
            times = times[calls // 10:]
            out[f"k{k}_first_cpu_p50_us"] = statistics.median(t[0] for t in times) * 1e6
            if k > 1:
                out[f"k{k}_later_cpu_p50_us"] = statistics.median(
                    v for t in times for v in t[1:]) * 1e6
        job.close(pull=False)
    out["k1_first_over_direct"] = out["k1_first_cpu_p50_us"] / out["direct_step_cpu_p50_us"]
    return out


def _direct(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module, x: torch.Tensor,
            y: torch.Tensor, calls: int,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """`calls` steps in this process, each one's time on `clock` (seconds)."""
    times = []
    for _ in range(calls):
        began = clock()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(clock() - began)
    return times


def _case(address: str, width: int, inputs: int, hidden: int, batch: int, calls: int,
          poll: bool) -> dict[str, float]:
    x, y = torch.randn(batch, inputs), torch.randint(0, 10, (batch,))
    os.environ["SALUS_CLIENT_SPIN_US"] = "300" if poll else "0"  # read when the line opens
    stages: dict[str, list[float]] = {"to_function": [], "function": [], "back": [],
                                      "hop": [], "round_trip": []}
    with salus.connect(name=f"stages-{width}", iterations=calls + 50, address=address) as job:
        model, opt, loss_fn = mlp(width, inputs, hidden)
        step = job.attach(model=model, opt=opt, loss_fn=loss_fn).iteration(_timed_step)
        for _ in range(50):
            step(x, y)
        local = mlp(width, inputs, hidden)
        direct = _direct(*local, x, y, 20)[:0]
        for _ in range(BLOCKS):  # alternating, so that both see the same machine load
            direct += _direct(*local, x, y, calls // BLOCKS)
            for _ in range(calls // BLOCKS):
                sent = time.monotonic()
                began, ended = step(x, y).tolist()
                back = time.monotonic()
                stages["to_function"].append(began - sent)
                stages["function"].append(ended - began)
                stages["back"].append(back - ended)
                stages["hop"].append((began - sent) + (back - ended))
                stages["round_trip"].append(back - sent)
        job.close(pull=False)
    out = {f"{name}_p50_us": statistics.median(v) * 1e6 for name, v in stages.items()}
    out["direct_step_p50_us"] = statistics.median(direct) * 1e6
    out["function_over_direct"] = out["function_p50_us"] / out["direct_step_p50_us"]
    out["added_p50_us"] = out["round_trip_p50_us"] - out["direct_step_p50_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"bench": "call_stages", "unit": "microseconds"}
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp), cpu_memory="1G",
                         cpu_threads=1) as daemon):
        for poll in (True, False):
            wait = "polling" if poll else "blocking"
            print(f"tiny, client {wait} ...", file=sys.stderr)
            out[f"tiny_{wait}"] = _case(daemon.address, 16, 64, 2, 32, args.calls, poll)
            print(f"~2 ms, client {wait} ...", file=sys.stderr)
            out[f"two_ms_{wait}"] = _case(daemon.address, 768, 64, 2, 32, args.calls // 4, poll)
            print(f"6 ms, client {wait} ...", file=sys.stderr)
            out[f"six_ms_{wait}"] = _case(daemon.address, 512, 512, 3, 128, args.calls // 8,
                                          poll)
        print("steps per call ...", file=sys.stderr)
        out["steps_per_call"] = _steps_per_call(daemon.address, args.calls // 4)
    out["cpu_count"], out["loadavg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
