"""A high-priority inference job's p99 latency alone vs beside a best-effort training job, under
each policy (anchor: Tally +7.2 % p99, TGS +188.9 %).

Per policy, a fresh daemon on one device: the inference job (`job.inference`, priority 10 by
the control socket's `priority`) sends one batch every 5 ms and times each call at the client
(`time.perf_counter`, seconds; the output comes back to the host, so the call's kernels have
ended). First alone, then while a training job (priority 1, its own client process) trains
without pause. `p99_increase_pct` is 100 x (p99 beside / p99 alone - 1), both from this run;
`training_calls_per_s_beside` is what the best-effort job got meanwhile.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import kit
import models
import torch

import salus.adapters.torch as salus
from salus.daemon.cli.control import Control

POLICIES = ("fifo", "pack", "srtf", "fair")


def _latencies(infer: Any, x: torch.Tensor, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        infer(x)
        out.append(time.perf_counter() - start)
        time.sleep(0.005)
    return out


def _policy(tmp: Path, policy: str, cuda: bool, small: bool) -> dict[str, Any]:
    width, train_width = (2048, 4096) if cuda else (64, 256)
    calls = 40 if small else 300
    train_s = 2.0 if small else 8.0
    model = models.mlp(width).eval()
    x, _ = models.batch(width, 64)
    with kit.daemon(tmp, cuda=cuda, policy=policy, name=policy) as d:
        job = salus.connect(name="hi", iterations=2 * calls + 1, address=d.address)
        infer = job.inference(model)
        infer(x)  # admission and the measured first call
        with Control(d.address) as ctl:
            ctl.priority(str(job.id), 10.0)
        alone = _latencies(infer, x, calls)
        trainer = kit.client("train", d.address, "best-effort", str(train_s), str(train_width),
                             str(train_width))
        kit.wait_ready(trainer)
        kit.go(trainer)
        window = time.monotonic()
        beside = _latencies(infer, x, calls)
        window_s = time.monotonic() - window
        job.close()  # under fifo the trainer is admitted only now
        trained = kit.result_of(trainer)
    p99_alone, p99_beside = kit.percentile(alone, 99), kit.percentile(beside, 99)
    return {
        "p50_alone_ms": kit.percentile(alone, 50) * 1e3,
        "p99_alone_ms": p99_alone * 1e3,
        "p50_beside_ms": kit.percentile(beside, 50) * 1e3,
        "p99_beside_ms": p99_beside * 1e3,
        "p99_increase_pct": 100 * (p99_beside / p99_alone - 1),
        "training_calls_per_s_beside": sum(
            window <= t <= window + window_s for t in trained["ends"]) / window_s,
        "training_error": trained["error"],
    }


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"unit": "milliseconds per inference call, client side",
                           "anchor": "Tally +7.2 % p99, TGS +188.9 % (inference beside "
                                     "best-effort training)"}
    with tempfile.TemporaryDirectory(prefix="salusd-kit-p99-") as tmp:
        for policy in POLICIES:
            try:
                out[policy] = _policy(Path(tmp), policy, cuda, small)
            except Exception as exc:  # noqa: BLE001 - one policy's failure is its figure
                out[policy] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return out


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
