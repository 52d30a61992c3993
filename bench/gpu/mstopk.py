"""MSTopK (salusd/services/topk.py) against `torch.topk` on the kit's device: the share of the
exact top-k's values it selects (`recall`, by magnitude), the share of its indices that
`torch.topk` also picks (`index_agreement`; ties at the threshold may differ), and the time
of each, synchronised, median of several runs. On a GPU `mstopk` runs its cupy kernels where
cupy is installed (`kernel_is_gpu`), else the torch passes."""

from __future__ import annotations

import statistics
import time
from typing import Any

import kit
import torch

from salus.daemon.services.topk import mstopk, mstopk_kernel


def _timed(fn: Any, device: torch.device, runs: int) -> tuple[Any, float]:
    out = fn()  # warm: kernels compiled, workspaces taken
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def measure(cuda: bool, small: bool) -> dict[str, Any]:
    device = torch.device("cuda" if cuda else "cpu")
    n = (1 << 20) if small else (1 << 26)
    k = n // 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    runs = 5 if small else 10
    (values, indices), ms_time = _timed(lambda: mstopk(x, k), device, runs)
    (exact, exact_indices), topk_time = _timed(lambda: torch.topk(x.abs(), k), device, runs)
    threshold = exact.min()
    recall = float((values.abs() >= threshold).sum()) / k
    agreement = float(torch.isin(indices, exact_indices).sum()) / k
    return {
        "elements": n, "k": k, "device": str(device),
        "kernel": mstopk_kernel(x), "kernel_is_gpu": mstopk_kernel(x) == "cupy",
        "recall": recall, "index_agreement": agreement,
        "mstopk_ms": ms_time * 1e3, "torch_topk_ms": topk_time * 1e3,
        "mstopk_over_topk": ms_time / topk_time,
    }


if __name__ == "__main__":
    kit.step_main(measure, __doc__)
