"""MSTopK's two primitives as CUDA kernels (cupy ``RawKernel``) over memory torch allocated.

`topk.mstopk` runs one driver (the threshold bisection) over either primitive set; this one
is used for CUDA tensors when cupy is installed (``salusd[gpu-cu12]`` / ``[gpu-cu13]``):

- **count**: elements ``>= thr``, a grid-stride loop with a warp-shuffle block reduction and
  one 64-bit ``atomicAdd`` per block; the driver reads the count back (one synchronisation per
  bisection step, as ``int(torch.count_nonzero(...))`` does on the torch path).
- **compaction**: tiles of ``TILE`` elements; a first kernel counts each tile's sure elements
  (``>= hi``) and band elements (``[lo, hi)``), torch scans the tile counts, and a second kernel
  writes each tile's indices at its offsets, in index order within the tile (warp ballots and a
  prefix over the block's warps). The output is therefore the torch path's, element for
  element: every sure index ascending, then the lowest band indices up to ``k``.

Scratch and output are torch tensors (the caching allocator books them, unlike cupy's pool),
shared with cupy through DLPack; kernels run on torch's current stream of the tensor's device.
Thresholds are passed in the magnitudes' dtype, as torch casts a Python scalar for ``a >= thr``.
"""

from __future__ import annotations

import functools
import math
from string import Template
from types import ModuleType
from typing import Any

import torch

THREADS = 256
ROUNDS = 16
TILE = THREADS * ROUNDS
_COUNT_BLOCKS = 1024  # grid-stride: enough blocks to fill an H100/H200 several times over

_SOURCE = Template(r"""
#define THREADS $threads
#define ROUNDS $rounds
#define TILE (THREADS * ROUNDS)
#define WARPS (THREADS / 32)

extern "C" __global__ void count_at_least_$suffix(
        const $scalar* a, long long n, $scalar thr, unsigned long long* count) {
    unsigned long long mine = 0;
    for (long long i = (long long)blockIdx.x * THREADS + threadIdx.x; i < n;
         i += (long long)gridDim.x * THREADS) {
        mine += a[i] >= thr;
    }
    __shared__ unsigned long long warps[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, off);
    if (lane == 0) warps[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long total = 0;
        for (int w = 0; w < WARPS; ++w) total += warps[w];
        if (total) atomicAdd(count, total);
    }
}

extern "C" __global__ void tile_counts_$suffix(
        const $scalar* a, long long n, $scalar lo, $scalar hi,
        long long* sure_counts, long long* band_counts) {
    const long long base = (long long)blockIdx.x * TILE;
    int sure = 0, band = 0;
    for (int r = 0; r < ROUNDS; ++r) {
        const long long i = base + r * THREADS + threadIdx.x;
        if (i < n) {
            const $scalar v = a[i];
            const bool s = v >= hi;
            sure += s;
            band += !s && v >= lo;
        }
    }
    __shared__ int warp_sure[WARPS], warp_band[WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        sure += __shfl_down_sync(0xffffffffu, sure, off);
        band += __shfl_down_sync(0xffffffffu, band, off);
    }
    if (lane == 0) {
        warp_sure[warp] = sure;
        warp_band[warp] = band;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        long long s = 0, b = 0;
        for (int w = 0; w < WARPS; ++w) {
            s += warp_sure[w];
            b += warp_band[w];
        }
        sure_counts[blockIdx.x] = s;
        band_counts[blockIdx.x] = b;
    }
}

extern "C" __global__ void compact_$suffix(
        const $scalar* a, long long n, $scalar lo, $scalar hi,
        const long long* sure_starts, const long long* band_starts,
        long long hi_count, long long band_cap, long long* out) {
    __shared__ int warp_sure[WARPS], warp_band[WARPS];
    __shared__ long long run_sure, run_band;
    if (threadIdx.x == 0) {
        run_sure = sure_starts[blockIdx.x];
        run_band = band_starts[blockIdx.x];
    }
    __syncthreads();
    const long long base = (long long)blockIdx.x * TILE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    for (int r = 0; r < ROUNDS; ++r) {
        const long long i = base + r * THREADS + threadIdx.x;
        bool s = false, b = false;
        if (i < n) {
            const $scalar v = a[i];
            s = v >= hi;
            b = !s && v >= lo;
        }
        const unsigned sure_mask = __ballot_sync(0xffffffffu, s);
        const unsigned band_mask = __ballot_sync(0xffffffffu, b);
        if (lane == 0) {
            warp_sure[warp] = __popc(sure_mask);
            warp_band[warp] = __popc(band_mask);
        }
        __syncthreads();
        long long at_sure = run_sure + __popc(sure_mask & below);
        long long at_band = run_band + __popc(band_mask & below);
        for (int w = 0; w < warp; ++w) {
            at_sure += warp_sure[w];
            at_band += warp_band[w];
        }
        if (s) out[at_sure] = i;
        if (b && at_band < band_cap) out[hi_count + at_band] = i;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < WARPS; ++w) {
                run_sure += warp_sure[w];
                run_band += warp_band[w];
            }
        }
        __syncthreads();
    }
}
""")

_SCALARS = {torch.float32: ("float", "f32"), torch.float64: ("double", "f64")}


def source(dtype: torch.dtype) -> str:
    """The CUDA C++ source of the three kernels for magnitudes of `dtype` (float32/float64)."""
    scalar, suffix = _SCALARS[dtype]
    return _SOURCE.substitute(threads=THREADS, rounds=ROUNDS, scalar=scalar, suffix=suffix)


@functools.cache
def cupy_module() -> ModuleType | None:
    """cupy, imported on first use (None when it is not installed)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@functools.cache
def _kernels(dtype: torch.dtype, device_index: int) -> dict[str, Any] | Exception:
    """The three kernels for `dtype`, compiled for the device (NVRTC, cached by cupy on disk),
    or why they could not be (kept, so a failed build is not retried at every call)."""
    cupy = cupy_module()
    assert cupy is not None
    code = source(dtype)
    suffix = _SCALARS[dtype][1]
    try:
        with cupy.cuda.Device(device_index):
            kernels = {name: cupy.RawKernel(code, f"{name}_{suffix}")
                       for name in ("count_at_least", "tile_counts", "compact")}
            for kernel in kernels.values():
                kernel.compile()
    except Exception as exc:
        return exc
    return kernels


class CupyPasses:
    """MSTopK's count and compaction over the magnitudes `a` (a contiguous 1-D float32 or
    float64 CUDA tensor), on torch's current stream of its device."""

    def __init__(self, a: torch.Tensor) -> None:
        if not a.is_cuda or a.dtype not in _SCALARS or a.dim() != 1 or not a.is_contiguous():
            raise ValueError("CupyPasses needs a contiguous 1-D float32/float64 CUDA tensor")
        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("the CUDA MSTopK kernel needs cupy: pip install "
                               "'salusd[gpu-cu12]' or 'salusd[gpu-cu13]'")
        self.cupy = cupy
        self.a = a
        self.n = a.numel()
        self.index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        kernels = _kernels(a.dtype, self.index)
        if isinstance(kernels, Exception):
            raise RuntimeError(f"the CUDA MSTopK kernels did not build: {kernels}") from kernels
        self.kernels = kernels
        self.scalar = cupy.float32 if a.dtype == torch.float32 else cupy.float64
        self.count = torch.zeros(1, dtype=torch.int64, device=a.device)

    def _launch(self, name: str, blocks: int, *args: Any) -> None:
        cupy = self.cupy
        stream = torch.cuda.current_stream(self.a.device)
        with cupy.cuda.Device(self.index), cupy.cuda.ExternalStream(stream.cuda_stream):
            shared = [cupy.from_dlpack(x) if isinstance(x, torch.Tensor) else x for x in args]
            self.kernels[name]((blocks,), (THREADS,), tuple(shared))

    def count_at_least(self, thr: float) -> int:
        """Elements of `a` that are ``>= thr`` (compared in `a`'s dtype)."""
        self.count.zero_()
        blocks = min(_COUNT_BLOCKS, math.ceil(self.n / THREADS))
        self._launch("count_at_least", blocks, self.a, self.cupy.int64(self.n),
                     self.scalar(thr), self.count)
        return int(self.count.item())

    def select(self, lo: float, hi: float, hi_count: int, k: int) -> torch.Tensor:
        """Indices of every element ``>= hi`` (`hi_count` of them, ascending), then of the
        lowest-index elements in ``[lo, hi)`` up to `k` in all (int64, on `a`'s device)."""
        cupy, device = self.cupy, self.a.device
        tiles = math.ceil(self.n / TILE)
        sure = torch.empty(tiles, dtype=torch.int64, device=device)
        band = torch.empty(tiles, dtype=torch.int64, device=device)
        n, lo_, hi_ = cupy.int64(self.n), self.scalar(lo), self.scalar(hi)
        self._launch("tile_counts", tiles, self.a, n, lo_, hi_, sure, band)
        sure_starts = torch.cumsum(sure, 0).sub_(sure)
        band_starts = torch.cumsum(band, 0).sub_(band)
        out = torch.empty(k, dtype=torch.int64, device=device)
        self._launch("compact", tiles, self.a, n, lo_, hi_, sure_starts, band_starts,
                     cupy.int64(hi_count), cupy.int64(k - hi_count), out)
        return out
