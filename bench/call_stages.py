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
(`SALUS_CLIENT_SPIN_US=0`). Prints one JSON object (p50s, microseconds).

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
from pathlib import Path
from typing import Any

import torch
from overhead import mlp  # the same models as bench/overhead.py
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.launch import running_daemon

BLOCKS = 5


def _timed_step(s: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One optimizer step; returns (began, ended) on the monotonic clock, float64."""
    began = time.monotonic()
    s.opt.zero_grad()
    s.loss_fn(s.model(x), y).backward()
    s.opt.step()
    return torch.tensor([began, time.monotonic()], dtype=torch.float64)


def _direct(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module, x: torch.Tensor,
            y: torch.Tensor, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - began)
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
    out["cpu_count"], out["loadavg_1m"] = os.cpu_count(), os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
