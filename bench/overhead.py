"""Added latency per iteration through salusd vs the same loop in process.

Starts a real `salusd serve` (CPU, one thread per process on both sides) and drives it through
the torch adapter. Two models: a tiny MLP (the overhead itself), through `job.train_step` and
through the job contract (`@remote.iteration` over the attached state), and one sized so a
direct iteration takes about 2 ms. Direct and daemon iterations are measured in
alternating blocks so both see the same machine load. Prints one JSON object (microseconds).

    .venv/bin/python bench/overhead.py [--iterations 1000] [--blocks 5]
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

import torch
from torch import nn

import salus.adapters.torch as salus
from salus.daemon.launch import running_daemon


def _model(width: int) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 10))
    return m, torch.optim.SGD(m.parameters(), lr=0.01), nn.CrossEntropyLoss()


def _direct_step(width: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    model, opt, loss_fn = _model(width)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _times(step: Callable[[torch.Tensor, torch.Tensor], float], x: torch.Tensor,
           y: torch.Tensor, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(x, y)
        out.append(time.perf_counter() - t0)
    return out


def _width_for(target_s: float, x: torch.Tensor, y: torch.Tensor) -> int:
    """The hidden width whose direct iteration takes about `target_s` seconds."""
    best = (float("inf"), 64)
    for width in (64, 128, 256, 384, 512, 768, 1024):
        t = statistics.median(_times(_direct_step(width), x, y, 30)[5:])
        best = min(best, (abs(t - target_s), width))
    return best[1]


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e6


def _iteration(s: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same step written with the job contract: the user's own function over `s`."""
    s.opt.zero_grad()  # type: ignore[attr-defined]
    loss = s.loss_fn(s.model(x), y)  # type: ignore[attr-defined]
    loss.backward()
    s.opt.step()  # type: ignore[attr-defined]
    return loss.detach()


def _compare(address: str, width: int, x: torch.Tensor, y: torch.Tensor, iterations: int,
             blocks: int, *, function_api: bool = False) -> dict[str, float]:
    direct: list[float] = []
    daemon: list[float] = []
    model, opt, loss_fn = _model(width)
    with salus.connect(name=f"overhead-{width}", iterations=iterations * blocks,
                       address=address) as job:
        if function_api:
            fn = job.attach(model=model, opt=opt, loss_fn=loss_fn).iteration(_iteration)

            def remote(x: torch.Tensor, y: torch.Tensor) -> float:
                return float(fn(x, y))
        else:
            remote = job.train_step(model, opt, loss_fn)
        _times(remote, x, y, 20)  # admission and the measured first iteration
        local = _direct_step(width)
        _times(local, x, y, 20)
        per_block = iterations // blocks
        for b in range(blocks):
            direct += _times(local, x, y, per_block)
            daemon += _times(remote, x, y, per_block)
            print(f"width {width}: block {b + 1}/{blocks}", file=sys.stderr)
    d50, s50 = _pct(direct, 50), _pct(daemon, 50)
    return {
        "hidden_width": width,
        "direct_p50_us": d50,
        "direct_p99_us": _pct(direct, 99),
        "daemon_p50_us": s50,
        "daemon_p99_us": _pct(daemon, 99),
        "added_p50_us": s50 - d50,
        "added_p99_us": _pct(daemon, 99) - _pct(direct, 99),
        "ratio_p50": s50 / d50,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with (tempfile.TemporaryDirectory(prefix="salusd-bench-") as tmp,
          running_daemon(Path(tmp) / "salusd.sock", state_dir=Path(tmp), cpu_memory="1G",
                         cpu_threads=1) as daemon):
        tiny = _compare(daemon.address, 16, x, y, args.iterations, args.blocks)
        function_api = _compare(daemon.address, 16, x, y, args.iterations, args.blocks,
                                function_api=True)
        width = _width_for(0.002, x, y)
        two_ms = _compare(daemon.address, width, x, y, args.iterations // 2, args.blocks)
    print(json.dumps({
        "bench": "overhead",
        "unit": "microseconds per training iteration",
        "tiny": tiny,
        "tiny_function_api": function_api,
        "about_2ms": two_ms,
        "goals": {"added_p50_us_tiny": 150, "ratio_p50_at_2ms": 1.10},
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
