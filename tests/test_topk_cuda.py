"""MSTopK's CUDA kernels (salusd/services/topk_cuda.py) against torch on the same GPU: the
count pass equals `torch.count_nonzero`, the compaction gives the torch passes' indices in the
same order, and the result keeps a true top-k's recall. Needs a CUDA device and cupy."""

from __future__ import annotations

import pytest
import torch

from salus.daemon.services import topk_cuda
from salus.daemon.services.topk import mstopk, mstopk_kernel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(topk_cuda.cupy_module() is None, reason="needs cupy"),
]

GPU = torch.device("cuda", 0)
# Sizes around the kernels' block and tile edges, and one past 2**24.
SIZES = [1, 31, 255, 256, 257, topk_cuda.TILE - 1, topk_cuda.TILE, topk_cuda.TILE + 1,
         3 * topk_cuda.TILE + 17, (1 << 24) + 3]


def test_auto_picks_the_cupy_kernels_for_a_cuda_tensor() -> None:
    assert mstopk_kernel(torch.ones(4, device=GPU)) == "cupy"
    assert mstopk_kernel(torch.ones(4)) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_the_count_pass_equals_torch(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device=GPU).manual_seed(n)
    a = torch.randn(n, generator=g, device=GPU, dtype=dtype).abs()
    passes = topk_cuda.CupyPasses(a)
    for thr in (0.0, 0.1, 0.5, 1.0, 2.5, float(a.max()), float(a.max()) + 1.0, float("inf")):
        assert passes.count_at_least(thr) == int(torch.count_nonzero(a >= thr)), thr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int8])
@pytest.mark.parametrize("n", SIZES[2:])
@pytest.mark.parametrize("iterations", [3, 20])
def test_the_kernels_give_the_torch_passes_indices(n: int, dtype: torch.dtype,
                                                   iterations: int) -> None:
    g = torch.Generator(device=GPU).manual_seed(n + iterations)
    x = (torch.randint(-128, 128, (n,), generator=g, device=GPU, dtype=dtype)
         if dtype == torch.int8 else (torch.randn(n, generator=g, device=GPU) * 50).to(dtype))
    for k in (1, n // 100 + 1, n // 3, n - 1):
        vals, idx = mstopk(x, k, iterations, kernel="cupy")
        ref_vals, ref_idx = mstopk(x, k, iterations, kernel="torch")
        assert idx.device == x.device and idx.dtype == torch.int64 and idx.numel() == k
        assert torch.equal(idx, ref_idx), (n, k)
        assert torch.equal(vals, ref_vals)


def test_ties_at_the_maximum_and_all_equal() -> None:
    x = torch.zeros(10_000, device=GPU)
    x[::7] = 3.0
    for k in (1, 100, 1428, 1429, 5000):
        assert torch.equal(mstopk(x, k, kernel="cupy")[1], mstopk(x, k, kernel="torch")[1])
    same = torch.full((9_999,), -2.0, device=GPU)
    assert torch.equal(mstopk(same, 77, kernel="cupy")[1], torch.arange(77, device=GPU))


@pytest.mark.parametrize("k", [1000, 20_000, 200_000])
def test_recall_against_torch_topk(k: int) -> None:
    g = torch.Generator(device=GPU).manual_seed(k)
    x = torch.randn(1 << 22, generator=g, device=GPU)
    vals, idx = mstopk(x, k, kernel="cupy")
    assert torch.unique(idx).numel() == k
    assert torch.equal(vals, x[idx])
    kth = torch.topk(x.abs(), k).values[-1]
    recall = float((vals.abs() >= kth).double().mean())
    assert recall >= 0.99, recall
    # With the band narrowed to one float32 value at most, the selection is a true top-k.
    _, exact_idx = mstopk(x, k, iterations=64, kernel="cupy")
    chosen = torch.zeros(x.numel(), dtype=torch.bool, device=GPU)
    chosen[exact_idx] = True
    assert float(x.abs()[chosen].min()) >= float(x.abs()[~chosen].max())


def test_runs_on_the_current_torch_stream() -> None:
    x = torch.randn(1 << 20, device=GPU)
    want = mstopk(x, 5000, kernel="torch")[1]
    side = torch.cuda.Stream(GPU)
    side.wait_stream(torch.cuda.current_stream(GPU))
    with torch.cuda.stream(side):
        y = x * 1.0  # written on the side stream: the kernels must run after it
        got = mstopk(y, 5000, kernel="cupy")[1]
    side.synchronize()
    assert torch.equal(got, want)
