"""Magnitude top-k for gradient sparsification (the allreduce built on it: `hitopk.py`).

Every selector returns exactly ``min(k, x.numel())`` unique indices into ``x.reshape(-1)``
(int64, in no particular order) and ``values == x.reshape(-1)[indices]``, ranked by ``|x|``:

- ``mstopk``: the MSTopK operator of Shi et al., "Towards Scalable Distributed Training of Deep
  Learning on Public Cloud Clusters" (MLSys 2021). Bisection on a threshold, no sort: a count
  pass per step, built for GPUs. Approximate inside a narrow boundary band.
- ``sampled_topk``: estimates the threshold from a random sample, keeps the candidates at or
  above it in one pass, and finishes with ``torch.topk`` on the candidates. The threshold sits
  a few standard deviations below the sample estimate, so the candidates hold the true top-k
  with high probability; when they do not, it falls back to the exact method. The result is
  therefore always an exact top-k.
- ``"exact"``: ``torch.topk`` on ``|x|``.

Magnitudes are taken in float32 (float64 for float64/complex128 and for 32/64-bit integers,
exact up to 2**53) after a dtype conversion, so integer minima such as ``int8 -128`` do not
overflow. Input with NaN or Inf raises ``ValueError``: a top-k by magnitude is undefined for it.
Everything runs on CPU and CUDA tensors alike in plain torch; ``mstopk`` on a CUDA tensor runs
its count and compaction passes as CUDA kernels when cupy is installed (`topk_cuda.py`).
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Literal, Protocol

import torch

from salus.daemon.services import topk_cuda
from salus.daemon.services.sparse_allreduce import all_finite

log = logging.getLogger("salusd.topk")

__all__ = [
    "AUTO_MAX_DENSITY",
    "AUTO_MIN_NUMEL",
    "DENSE_BELOW_NUMEL",
    "KERNELS",
    "Kernel",
    "Method",
    "FLOAT_CODES",
    "METHODS",
    "ThresholdPasses",
    "TorchPasses",
    "choose_kernel",
    "choose_method",
    "mstopk",
    "mstopk_kernel",
    "sampled_topk",
    "topk",
]

Method = Literal["auto", "mstopk", "sampled", "exact"]
METHODS = ("auto", "mstopk", "sampled", "exact")
Kernel = Literal["auto", "torch", "cupy"]
KERNELS = ("auto", "torch", "cupy")

AUTO_MIN_NUMEL = 1 << 20
"""``method="auto"`` uses ``exact`` below this many elements (sampling overhead dominates)."""
AUTO_MAX_DENSITY = 0.1
"""``method="auto"`` uses ``exact`` when ``k > AUTO_MAX_DENSITY * numel`` (few elements pruned)."""
DENSE_BELOW_NUMEL = 1 << 16
"""``hitopk_allreduce`` sends tensors with fewer elements than this with a dense allreduce."""

# Expected sample hits above the true threshold; more hits give a tighter threshold.
_SAMPLE_HITS = 64
_MIN_SAMPLE = 4096
_MAX_SAMPLE = 1 << 17
# Binomial standard deviations of margin below the sample estimate: misses < 1 call in 10**3.
_MARGIN_SIGMAS = 4.0
# Elements per CPU pass: bounded scratch for |x| and the mask, yet few parallel regions (each
# one a thread barrier that a busy machine stretches; 2**20 was 2x slower under load).
_CPU_CHUNK = 1 << 22

FLOAT_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}

def _flatten(x: torch.Tensor, k: int, op: str) -> tuple[torch.Tensor, int]:
    """``x`` as a flat tensor and ``k`` clamped to its size, after checking both."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(k, bool):
        raise TypeError(f"{op}: k must be an int, got bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__}") from None
    if k < 0:
        raise ValueError(f"{op}: k must be >= 0, got {k}")
    flat = x.reshape(-1)
    return flat, min(k, flat.numel())


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype in which magnitudes of ``dtype`` are compared without loss or overflow."""
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in (torch.complex128, torch.int32, torch.int64, torch.uint32, torch.uint64):
        return torch.float64
    return torch.float32


def _magnitude(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``|t|`` in the work dtype, written into ``out`` when given."""
    if out is None:
        out = torch.empty(t.shape, dtype=_work_dtype(t.dtype), device=t.device)
    if t.is_complex():
        out.copy_(t.abs())
    elif t.dtype == out.dtype:
        torch.abs(t, out=out)
    else:
        out.copy_(t)
        out.abs_()
    return out


def _non_finite(op: str) -> ValueError:
    return ValueError(f"{op}: x contains NaN or Inf; top-k by magnitude is undefined for it")


def _none(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return flat[:0].clone(), torch.empty(0, dtype=torch.int64, device=flat.device)


def _every(flat: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not all_finite(flat):
        raise _non_finite(op)
    return flat.clone(), torch.arange(flat.numel(), device=flat.device)


def _exact(flat: torch.Tensor, k: int, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    mags, idx = torch.topk(_magnitude(flat), k, sorted=False)
    # torch.topk ranks NaN above everything, so any NaN or Inf is among the winners.
    if not math.isfinite(float(mags.max())):
        raise _non_finite(op)
    return flat[idx], idx


class ThresholdPasses(Protocol):
    """The two primitives MSTopK's driver runs over the magnitudes: the torch path's
    (`TorchPasses`) or the CUDA kernels' (`topk_cuda.CupyPasses`); thresholds compare in the
    magnitudes' dtype."""

    def count_at_least(self, thr: float) -> int:
        """Elements ``>= thr``."""
        ...

    def select(self, lo: float, hi: float, hi_count: int, k: int) -> torch.Tensor:
        """Indices (int64) of every element ``>= hi`` (``hi_count`` of them), ascending, then
        of the lowest-index elements in ``[lo, hi)`` up to ``k`` in all."""
        ...


class TorchPasses:
    """`ThresholdPasses` in plain torch, on any device."""

    def __init__(self, a: torch.Tensor) -> None:
        self.a = a

    def count_at_least(self, thr: float) -> int:
        return int(torch.count_nonzero(self.a >= thr))

    def select(self, lo: float, hi: float, hi_count: int, k: int) -> torch.Tensor:
        a = self.a
        if hi_count == k:
            return (a >= hi).nonzero().flatten()
        band = (a >= lo).nonzero().flatten()
        sure = a[band] >= hi
        return torch.cat([band[sure], band[~sure][: k - hi_count]])


def choose_kernel(kernel: Kernel, is_cuda: bool, cupy_installed: bool) -> Literal["torch", "cupy"]:
    """The passes ``mstopk(kernel=...)`` runs: ``"auto"`` picks cupy's CUDA kernels for a CUDA
    tensor when cupy is installed, torch otherwise; ``"cupy"`` needs both."""
    if kernel not in KERNELS:
        raise ValueError(f"mstopk: kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "cupy" and not is_cuda:
        raise ValueError("mstopk: kernel='cupy' needs a CUDA tensor")
    if kernel == "cupy" and not cupy_installed:
        raise RuntimeError("mstopk: kernel='cupy' needs cupy: pip install 'salusd[gpu-cu12]' "
                           "or 'salusd[gpu-cu13]'")
    if kernel == "auto":
        return "cupy" if is_cuda and cupy_installed else "torch"
    return kernel


def mstopk_kernel(x: torch.Tensor, kernel: Kernel = "auto") -> Literal["torch", "cupy"]:
    """The passes ``mstopk(x, k, kernel=kernel)`` runs for ``x`` (see `choose_kernel`)."""
    return choose_kernel(kernel, x.is_cuda, x.is_cuda and topk_cuda.cupy_module() is not None)


def _cupy_passes(a: torch.Tensor, forced: bool) -> ThresholdPasses:
    try:
        return topk_cuda.CupyPasses(a)
    except Exception as exc:
        if forced:
            raise
        # cupy imports but its kernels do not build here (e.g. no NVRTC for its CUDA major).
        if not _fell_back:
            log.warning("mstopk: the CUDA kernels did not build (%s); using the torch path", exc)
            _fell_back.append(exc)
        return TorchPasses(a)


_fell_back: list[Exception] = []


def _bisect(a: torch.Tensor, k: int, iterations: int, passes: ThresholdPasses,
            op: str) -> tuple[float, float, int]:
    """MSTopK's driver over the magnitudes ``a``: the final ``(lo, hi, hi_count)`` with at
    least ``k`` elements ``>= lo`` and ``hi_count <= k`` elements ``>= hi``."""
    top = float(a.max())
    if not math.isfinite(top):
        raise _non_finite(op)
    lo = float(a.mean())
    if passes.count_at_least(lo) < k:
        lo = float(a.min())
    hi, hi_count = top, passes.count_at_least(top)
    if hi_count > k:
        # More than k ties at the maximum: the band is exactly those ties.
        lo, hi, hi_count = top, math.inf, 0
    for _ in range(iterations):
        mid = lo + (hi - lo) / 2
        if hi_count == k or not lo < mid < hi:
            break
        count = passes.count_at_least(mid)
        if count <= k:
            hi, hi_count = mid, count
        else:
            lo = mid
    return lo, hi, hi_count


def mstopk(
    x: torch.Tensor, k: int, iterations: int = 20, *, kernel: Kernel = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MSTopK: ``k`` entries of largest magnitude, by bisection on a threshold (no sort).

    Bisects a threshold between ``mean(|x|)`` (``min(|x|)`` when fewer than ``k`` elements reach
    the mean) and ``max(|x|)`` for ``iterations`` steps, keeping ``lo`` with at least ``k``
    elements ``>= lo`` and ``hi`` with at most ``k`` elements ``>= hi``. Returns every element
    ``>= hi`` plus the lowest-index elements of the band ``[lo, hi)`` up to exactly ``k``.

    Guarantee: an unselected element exceeds a selected one in magnitude by less than the final
    band width ``hi - lo <= (max|x| - min|x|) / 2**iterations``; when a step hits a count of
    exactly ``k`` the result is an exact top-k. Cost: about ``iterations + 6`` passes over ``x``.

    ``kernel`` picks the count and compaction passes (`choose_kernel`): ``"auto"`` runs cupy's
    CUDA kernels (`topk_cuda.py`) for a CUDA tensor when cupy is installed, else torch;
    ``"torch"`` or ``"cupy"`` force one. Both give the same indices in the same order.

    Returns ``(values, indices)`` with ``values == x.reshape(-1)[indices]``.
    """
    op = "mstopk"
    flat, k = _flatten(x, k, op)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"{op}: iterations must be an int >= 1, got {iterations!r}")
    n = flat.numel()
    kind = mstopk_kernel(flat, kernel)  # bad arguments fail before the k shortcuts
    if k == 0:
        return _none(flat)
    if k == n:
        return _every(flat, op)
    a = _magnitude(flat)
    passes = _cupy_passes(a, kernel == "cupy") if kind == "cupy" else TorchPasses(a)
    lo, hi, hi_count = _bisect(a, k, iterations, passes, op)
    idx = passes.select(lo, hi, hi_count, k)
    return flat[idx], idx


def _sample_threshold(flat: torch.Tensor, k: int, generator: torch.Generator) -> float:
    """A magnitude that at least ``k`` elements reach with high probability, from a sample."""
    n = flat.numel()
    q = k / n
    # At most n/16 draws: beyond that the sample costs more than the pass it saves.
    size = min(_MAX_SAMPLE, max(_MIN_SAMPLE, n // 16), math.ceil(_SAMPLE_HITS / q))
    pos = torch.randint(n, (size,), generator=generator, device=flat.device)
    sample = _magnitude(flat[pos])
    if not math.isfinite(float(sample.max())):
        raise _non_finite("sampled_topk")
    hits = size * q
    rank = math.ceil(hits + _MARGIN_SIGMAS * math.sqrt(hits * (1 - q))) + 1
    rank = min(size, max(1, rank))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def _candidates(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """Flat indices of elements with ``not |x| < thr``: those ``>= thr`` and every NaN."""
    n = flat.numel()
    chunk = n if flat.is_cuda else min(n, _CPU_CHUNK)
    mag = torch.empty(chunk, dtype=_work_dtype(flat.dtype), device=flat.device)
    mask = torch.empty(chunk, dtype=torch.bool, device=flat.device)
    parts = []
    for start in range(0, n, chunk):
        part = flat[start : start + chunk]
        m = part.numel()
        torch.lt(_magnitude(part, out=mag[:m]), thr, out=mask[:m])
        idx = mask[:m].logical_not_().nonzero().flatten()
        if idx.numel():
            parts.append(idx.add_(start))
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    return torch.cat(parts)


def sampled_topk(
    x: torch.Tensor, k: int, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by magnitude via a sampled threshold and a top-k over the candidates.

    Draws ``min(2**17, max(4096, numel / 16), 64 * numel / k)`` positions with replacement and
    takes as threshold the sample order statistic 4 binomial standard deviations below the
    expected rank of the k-th largest; keeps the elements at or above it in one chunked pass;
    runs ``torch.topk`` on those candidates. Fewer than ``k`` candidates (under 1 call in 10**3)
    falls back to ``torch.topk`` on all of ``x``, so the result is always exact. ``generator``
    (default: a fresh one seeded with 0, for reproducible runs) drives the sample.

    Returns ``(values, indices)`` with ``values == x.reshape(-1)[indices]``.
    """
    op = "sampled_topk"
    flat, k = _flatten(x, k, op)
    n = flat.numel()
    if k == 0:
        return _none(flat)
    if k == n:
        return _every(flat, op)
    if generator is None:
        generator = torch.Generator(device=flat.device)
        generator.manual_seed(0)
    cand = _candidates(flat, _sample_threshold(flat, k, generator))
    if cand.numel() < k:
        return _exact(flat, k, op)
    mags = _magnitude(flat[cand])
    if not math.isfinite(float(mags.max())):
        raise _non_finite(op)
    pick = torch.topk(mags, k, sorted=False).indices
    idx = cand[pick]
    return flat[idx], idx


def choose_method(numel: int, k: int) -> Literal["sampled", "exact"]:
    """The selector ``method="auto"`` uses: ``exact`` for small or dense selections.

    ``exact`` when ``numel < AUTO_MIN_NUMEL`` or ``k > AUTO_MAX_DENSITY * numel``, otherwise
    ``sampled`` (also exact, and faster there). ``mstopk`` is never chosen automatically: it is
    approximate, and on CPU its ``iterations`` count passes make it slower than ``exact``.
    """
    if numel < AUTO_MIN_NUMEL or k > AUTO_MAX_DENSITY * numel:
        return "exact"
    return "sampled"


def topk(
    x: torch.Tensor,
    k: int,
    method: Method = "auto",
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` entries of ``x`` with the largest magnitude, by the selector named in ``method``.

    ``method``: ``"exact"`` (``torch.topk`` on ``|x|``), ``"sampled"`` (``sampled_topk``,
    exact), ``"mstopk"`` (``mstopk`` with 20 iterations, approximate in a narrow band) or
    ``"auto"`` (see ``choose_method``). ``generator`` drives ``sampled`` only.

    Returns ``(values, indices)``: exactly ``min(k, x.numel())`` unique int64 indices into
    ``x.reshape(-1)``, unordered, and ``values == x.reshape(-1)[indices]``.
    """
    if method not in METHODS:
        raise ValueError(f"topk: method must be one of {METHODS}, got {method!r}")
    flat, k = _flatten(x, k, "topk")
    if method == "auto":
        method = choose_method(flat.numel(), k)
    if method == "mstopk":
        return mstopk(flat, k)
    if method == "sampled":
        return sampled_topk(flat, k, generator=generator)
    if k == 0:
        return _none(flat)
    if k == flat.numel():
        return _every(flat, "topk")
    return _exact(flat, k, "topk")
