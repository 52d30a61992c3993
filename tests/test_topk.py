"""Magnitude top-k selectors: the exact-k contract, exactness, MSTopK's band guarantee, errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.services import topk as topk_mod
from salus.daemon.services.topk import (
    Kernel,
    choose_kernel,
    choose_method,
    mstopk,
    mstopk_kernel,
    sampled_topk,
    topk,
)

METHODS = ["exact", "sampled", "mstopk", "auto"]
EXACT_METHODS = ["exact", "sampled", "auto"]


def magnitudes(t: torch.Tensor) -> torch.Tensor:
    """|t| in float64, converting first so that int8 -128 does not overflow."""
    flat = t.reshape(-1)
    return flat.abs().double() if flat.is_complex() else flat.double().abs()


def check_contract(x: torch.Tensor, k: int, vals: torch.Tensor, idx: torch.Tensor) -> None:
    flat = x.reshape(-1)
    want = min(k, flat.numel())
    assert idx.dtype == torch.int64
    assert idx.shape == (want,)
    assert torch.unique(idx).numel() == want
    if want:
        assert int(idx.min()) >= 0 and int(idx.max()) < flat.numel()
    assert vals.dtype == x.dtype
    assert torch.equal(vals, flat[idx])


def check_exact(x: torch.Tensor, idx: torch.Tensor) -> None:
    """Every selected magnitude is >= every unselected one."""
    mags = magnitudes(x)
    chosen = torch.zeros(mags.numel(), dtype=torch.bool)
    chosen[idx] = True
    if chosen.any() and not chosen.all():
        assert mags[chosen].min() >= mags[~chosen].max()


def check_band(x: torch.Tensor, idx: torch.Tensor, iterations: int) -> None:
    """MSTopK: an unselected element beats a selected one by less than the final band width."""
    mags = magnitudes(x)
    chosen = torch.zeros(mags.numel(), dtype=torch.bool)
    chosen[idx] = True
    if chosen.any() and not chosen.all():
        width = float(mags.max() - mags.min()) / 2**iterations
        # The bisection runs in float32: allow its rounding of the thresholds.
        slack = 1e-6 * float(mags.max())
        assert float(mags[~chosen].max() - mags[chosen].min()) <= width + slack


def select(method: str, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return topk(x, k, method=method)


values_1d = st.one_of(
    # Small integers: many ties, zeros and sign changes.
    st.lists(st.integers(-4, 4), min_size=1, max_size=200).map(
        lambda v: torch.tensor(v, dtype=torch.float32)
    ),
    st.lists(
        st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32),
        min_size=1,
        max_size=200,
    ).map(lambda v: torch.tensor(v, dtype=torch.float32)),
)


@settings(max_examples=80, deadline=None)
@given(x=values_1d, k=st.integers(0, 210), method=st.sampled_from(METHODS))
def test_exactly_k_unique_indices_and_values_match(x: torch.Tensor, k: int, method: str) -> None:
    vals, idx = select(method, x, k)
    check_contract(x, k, vals, idx)


@settings(max_examples=80, deadline=None)
@given(x=values_1d, k=st.integers(0, 210), method=st.sampled_from(EXACT_METHODS))
def test_exact_methods_select_a_true_top_k(x: torch.Tensor, k: int, method: str) -> None:
    _, idx = select(method, x, k)
    check_exact(x, idx)


@settings(max_examples=80, deadline=None)
@given(x=values_1d, k=st.integers(0, 210), iterations=st.integers(1, 24))
def test_mstopk_band_guarantee(x: torch.Tensor, k: int, iterations: int) -> None:
    vals, idx = mstopk(x, k, iterations=iterations)
    check_contract(x, k, vals, idx)
    check_band(x, idx, iterations)


@pytest.mark.parametrize("method", METHODS)
def test_edge_sizes(method: str) -> None:
    x = torch.randn(3, 5)
    vals, idx = select(method, x, 0)
    assert vals.numel() == 0 and idx.numel() == 0
    for k in (15, 16, 1000):
        vals, idx = select(method, x, k)
        check_contract(x, k, vals, idx)
        assert sorted(idx.tolist()) == list(range(15))
    vals, idx = select(method, torch.empty(0), 3)
    assert vals.numel() == 0 and idx.numel() == 0


@pytest.mark.parametrize("method", METHODS)
def test_all_equal_and_ties_at_the_maximum(method: str) -> None:
    flat = torch.full((1000,), -2.5)
    vals, idx = select(method, flat, 10)
    check_contract(flat, 10, vals, idx)
    assert bool((vals == -2.5).all())
    # 30 ties at the maximum magnitude, k = 10: all ten must come from the ties.
    x = torch.randn(5000).clamp(-3, 3)
    x[torch.randperm(5000)[:30]] = torch.tensor([7.0, -7.0]).repeat(15)
    vals, idx = select(method, x, 10)
    check_contract(x, 10, vals, idx)
    assert bool((vals.abs() == 7.0).all())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_a_clear_error(method: str, bad: float) -> None:
    # Large enough that "auto" samples, with the bad value almost surely outside the sample.
    x = torch.randn(1 << 20)
    x[123_457] = bad
    for k in (1, 1000, 1 << 20):
        with pytest.raises(ValueError, match="NaN or Inf"):
            select(method, x, k)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
def test_dtypes(method: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    if dtype == torch.bool:
        x = torch.rand(4000, generator=g) > 0.7
    elif dtype.is_complex:
        x = torch.randn(4000, generator=g, dtype=dtype)
    elif dtype.is_floating_point:
        x = (torch.randn(4000, generator=g) * 50).to(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (4000,), generator=g)
        x = x.to(dtype)
        if info.min < 0:
            x[17] = info.min  # |min| does not fit in the dtype: must still rank highest
    vals, idx = select(method, x, 40)
    check_contract(x, 40, vals, idx)
    if method == "mstopk":
        check_band(x, idx, 20)
    else:
        check_exact(x, idx)
    if dtype.is_signed and not dtype.is_floating_point and not dtype.is_complex:
        assert 17 in idx.tolist()


def test_heavy_tailed_and_gaussian_recall() -> None:
    """sampled is exact; mstopk keeps >= 99% of a true top-k on both input shapes."""
    g = torch.Generator().manual_seed(0)
    n, k = 1 << 21, 2000
    inputs = {
        "gaussian": torch.randn(n, generator=g),
        "student_t": torch.distributions.StudentT(1.5).sample((n,)),
    }
    for name, x in inputs.items():
        kth = torch.topk(x.abs(), k).values[-1]
        for method in ("sampled", "auto", "mstopk"):
            vals, idx = select(method, x, k)
            check_contract(x, k, vals, idx)
            recall = float((vals.abs() >= kth).double().mean())
            want = 0.99 if method == "mstopk" else 1.0
            assert recall >= want, (name, method, recall)


def test_sampled_falls_back_when_the_sample_overshoots(monkeypatch: pytest.MonkeyPatch) -> None:
    # A negative margin puts the threshold above the k-th largest: too few candidates.
    monkeypatch.setattr(topk_mod, "_MARGIN_SIGMAS", -1000.0)
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    thr = topk_mod._sample_threshold(x, 500, torch.Generator().manual_seed(0))
    assert int((x.abs() >= thr).sum()) < 500
    vals, idx = sampled_topk(x, 500)
    check_contract(x, 500, vals, idx)
    check_exact(x, idx)


def test_sampled_is_reproducible_and_generator_driven() -> None:
    x = torch.randn(1 << 18)
    a = sampled_topk(x, 300)[1].sort().values
    b = sampled_topk(x, 300, generator=torch.Generator().manual_seed(9))[1].sort().values
    assert torch.equal(a, sampled_topk(x, 300)[1].sort().values)
    assert torch.equal(a, b)  # exact either way, and continuous values have no ties


def test_non_contiguous_and_multidimensional_input() -> None:
    x = torch.randn(300, 200).t()
    for method in METHODS:
        vals, idx = select(method, x, 77)
        check_contract(x, 77, vals, idx)


def test_auto_rule() -> None:
    assert choose_method(1000, 10) == "exact"
    assert choose_method(1 << 20, 1000) == "sampled"
    assert choose_method(1 << 20, (1 << 20) // 2) == "exact"


@pytest.mark.parametrize(
    ("call", "err", "match"),
    [
        (lambda: topk([1.0, 2.0], 1), TypeError, "torch.Tensor"),
        (lambda: topk(torch.ones(3), -1), ValueError, ">= 0"),
        (lambda: topk(torch.ones(3), 1.5), TypeError, "int"),
        (lambda: topk(torch.ones(3), True), TypeError, "bool"),
        (lambda: topk(torch.ones(3), 1, method="fast"), ValueError, "method"),
        (lambda: mstopk(torch.ones(3), 1, iterations=0), ValueError, "iterations"),
        (lambda: mstopk(torch.ones(3), 1, kernel="triton"), ValueError, "kernel"),
        (lambda: mstopk(torch.ones(3), 1, kernel="cupy"), ValueError, "CUDA tensor"),
    ],
)
def test_bad_arguments(call: Callable[[], object], err: type[Exception], match: str) -> None:
    with pytest.raises(err, match=match):
        call()


def reference_mstopk(x: torch.Tensor, k: int, iterations: int) -> list[int]:
    """The bisection as mstopk's docstring describes it, in numpy, thresholds compared in
    float32 (the magnitudes' dtype): every index >= hi ascending, then the lowest band ones."""
    a = np.abs(x.reshape(-1).numpy().astype(np.float32))

    def count(thr: float) -> int:
        return int(np.count_nonzero(a >= np.float32(thr)))

    top = float(a.max())
    lo = float(torch.from_numpy(a).mean())  # float32, summed as torch sums
    if count(lo) < k:
        lo = float(a.min())
    hi, hi_count = top, count(top)
    if hi_count > k:
        lo, hi, hi_count = top, math.inf, 0
    for _ in range(iterations):
        mid = lo + (hi - lo) / 2
        if hi_count == k or not lo < mid < hi:
            break
        c = count(mid)
        if c <= k:
            hi, hi_count = mid, c
        else:
            lo = mid
    sure = np.flatnonzero(a >= np.float32(hi))
    band = np.flatnonzero((a >= np.float32(lo)) & ~(a >= np.float32(hi)))
    return [*sure.tolist(), *band[: k - hi_count].tolist()]


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize(("n", "k", "iterations", "seed"), [
    (1000, 10, 20, 0), (4097, 300, 3, 1), (1 << 16, 1234, 8, 2), (257, 256, 20, 3)])
def test_mstopk_on_the_cpu_runs_the_torch_passes_and_matches_the_bisection(
        kernel: Kernel, n: int, k: int, iterations: int, seed: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    assert mstopk_kernel(x, kernel) == "torch"
    vals, idx = mstopk(x, k, iterations, kernel=kernel)
    check_contract(x, k, vals, idx)
    assert idx.tolist() == reference_mstopk(x, k, iterations)


def test_ties_at_the_maximum_match_the_bisection() -> None:
    x = torch.tensor([3.0, -3.0, 1.0, 3.0, 2.0, -3.0, 0.5])
    assert mstopk(x, 2)[1].tolist() == reference_mstopk(x, 2, 20) == [0, 1]


@pytest.mark.parametrize(("kernel", "is_cuda", "cupy", "want"), [
    ("auto", False, False, "torch"), ("auto", False, True, "torch"),
    ("auto", True, False, "torch"), ("auto", True, True, "cupy"),
    ("torch", True, True, "torch"), ("cupy", True, True, "cupy")])
def test_the_kernel_choice(kernel: Kernel, is_cuda: bool, cupy: bool, want: str) -> None:
    assert choose_kernel(kernel, is_cuda, cupy) == want


def test_forcing_the_cupy_kernel_without_cupy_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="needs cupy"):
        choose_kernel("cupy", True, False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_cpu_contract(method: str) -> None:
    x = torch.randn(1 << 21, device="cuda")
    vals, idx = select(method, x, 2000)
    assert vals.device == x.device and idx.device == x.device
    check_contract(x.cpu(), 2000, vals.cpu(), idx.cpu())
    if method != "mstopk":
        check_exact(x.cpu(), idx.cpu())
