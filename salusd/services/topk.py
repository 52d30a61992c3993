"""Magnitude top-k for gradient sparsification, and hierarchical top-k sparse allreduce.

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
Everything is plain torch and runs on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import math
import operator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, overload

import torch
import torch.distributed as dist

from salus.daemon.services.collectives.execute import Work
from salus.daemon.services.sparse_allreduce import (
    NodeLayout,
    all_finite,
    all_gather,
    node_layout,
    preflight,
    reduce_scatter,
)

__all__ = [
    "AUTO_MAX_DENSITY",
    "AUTO_MIN_NUMEL",
    "DENSE_BELOW_NUMEL",
    "Method",
    "choose_method",
    "hitopk_allreduce",
    "hitopk_shard",
    "mstopk",
    "sampled_topk",
    "topk",
]

Method = Literal["auto", "mstopk", "sampled", "exact"]
_METHODS = ("auto", "mstopk", "sampled", "exact")

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

_FLOAT_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_async_worker: ThreadPoolExecutor | None = None


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


def _count_at_least(a: torch.Tensor, thr: float) -> int:
    return int(torch.count_nonzero(a >= thr))


def mstopk(x: torch.Tensor, k: int, iterations: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """MSTopK: ``k`` entries of largest magnitude, by bisection on a threshold (no sort).

    Bisects a threshold between ``mean(|x|)`` (``min(|x|)`` when fewer than ``k`` elements reach
    the mean) and ``max(|x|)`` for ``iterations`` steps, keeping ``lo`` with at least ``k``
    elements ``>= lo`` and ``hi`` with at most ``k`` elements ``>= hi``. Returns every element
    ``>= hi`` plus the lowest-index elements of the band ``[lo, hi)`` up to exactly ``k``.

    Guarantee: an unselected element exceeds a selected one in magnitude by less than the final
    band width ``hi - lo <= (max|x| - min|x|) / 2**iterations``; when a step hits a count of
    exactly ``k`` the result is an exact top-k. Cost: about ``iterations + 6`` passes over ``x``.

    Returns ``(values, indices)`` with ``values == x.reshape(-1)[indices]``.
    """
    op = "mstopk"
    flat, k = _flatten(x, k, op)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"{op}: iterations must be an int >= 1, got {iterations!r}")
    n = flat.numel()
    if k == 0:
        return _none(flat)
    if k == n:
        return _every(flat, op)
    a = _magnitude(flat)
    top = float(a.max())
    if not math.isfinite(top):
        raise _non_finite(op)
    lo = float(a.mean())
    if _count_at_least(a, lo) < k:
        lo = float(a.min())
    hi, hi_count = top, _count_at_least(a, top)
    if hi_count > k:
        # More than k ties at the maximum: the band is exactly those ties.
        lo, hi, hi_count = top, math.inf, 0
    for _ in range(iterations):
        mid = lo + (hi - lo) / 2
        if hi_count == k or not lo < mid < hi:
            break
        count = _count_at_least(a, mid)
        if count <= k:
            hi, hi_count = mid, count
        else:
            lo = mid
    if hi_count == k:
        idx = (a >= hi).nonzero().flatten()
    else:
        band = (a >= lo).nonzero().flatten()
        sure = a[band] >= hi
        idx = torch.cat([band[sure], band[~sure][: k - hi_count]])
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
    if method not in _METHODS:
        raise ValueError(f"topk: method must be one of {_METHODS}, got {method!r}")
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


def hitopk_shard(numel: int, density: float, local_size: int) -> tuple[int, int]:
    """``(shard_len, k)``: elements in each rank's shard and how many of them it sends."""
    shard_len = -(-numel // local_size)
    # The epsilon keeps density * shard_len from rounding up past an exact integer.
    return shard_len, min(shard_len, max(1, math.ceil(density * shard_len - 1e-9)))


def _check_hitopk_args(
    tensor: torch.Tensor,
    density: float,
    residual: torch.Tensor | None,
    local_size: int,
    method: str,
    dense_below: int,
) -> None:
    op = "hitopk_allreduce"
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _FLOAT_CODES:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{op}: tensor must be float16/bfloat16/float32/float64, got {got}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"{op}: density must be a number in (0, 1], got {density!r}")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"{op}: local_size must be an int >= 1, got {local_size!r}")
    if method not in _METHODS:
        raise ValueError(f"{op}: method must be one of {_METHODS}, got {method!r}")
    if isinstance(dense_below, bool) or not isinstance(dense_below, int) or dense_below < 0:
        raise ValueError(f"{op}: dense_below must be an int >= 0, got {dense_below!r}")
    if residual is not None and (
        not isinstance(residual, torch.Tensor)
        or residual.shape != tensor.shape
        or residual.dtype != tensor.dtype
        or residual.device != tensor.device
        or not residual.is_contiguous()
    ):
        raise ValueError(
            f"{op}: residual must be a contiguous tensor with the tensor's shape "
            f"{tuple(tensor.shape)}, dtype {tensor.dtype} and device {tensor.device}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call init_process_group")


@overload
def hitopk_allreduce(
    tensor: torch.Tensor,
    density: float,
    residual: torch.Tensor | None = ...,
    *,
    local_size: int,
    group: dist.ProcessGroup | None = ...,
    method: Method = ...,
    dense_below: int = ...,
    async_op: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def hitopk_allreduce(
    tensor: torch.Tensor,
    density: float,
    residual: torch.Tensor | None = ...,
    *,
    local_size: int,
    group: dist.ProcessGroup | None = ...,
    method: Method = ...,
    dense_below: int = ...,
    async_op: Literal[True],
) -> Work: ...


def hitopk_allreduce(
    tensor: torch.Tensor,
    density: float,
    residual: torch.Tensor | None = None,
    *,
    local_size: int,
    group: dist.ProcessGroup | None = None,
    method: Method = "auto",
    dense_below: int = DENSE_BELOW_NUMEL,
    async_op: bool = False,
) -> torch.Tensor | Work:
    """Sum ``tensor`` over ``group`` in place, sending only its largest entries between nodes.

    Ranks are node-major within ``group`` (default: the default group; ``rank = node *
    local_size + local_rank``). Steps: reduce-scatter inside the node; top-``ceil(density *
    shard)`` of this rank's shard (``topk`` with ``method``); all-gather of values and indices
    among the ranks with the same local rank on every node, summed into a dense shard;
    all-gather of the shards inside the node. Every rank ends with the same values in
    ``tensor``; ``density=1`` gives the dense sum.

    ``residual`` (same shape, dtype, device; contiguous) turns on error feedback: it is added
    to ``tensor`` first and then overwritten with what this rank did not send, so the sum over
    calls of the results plus the final residuals of all ranks equals the sum of all inputs.
    Tensors with fewer than ``dense_below`` elements use one dense allreduce (residual cleared).

    The torch.distributed convention: the result is written into ``tensor``; with
    ``async_op=True`` the call returns at once with a ``Work`` handle whose ``wait()`` returns
    when ``tensor`` holds the sum (or re-raises the error); until then neither ``tensor`` nor
    ``residual`` may be touched, and no other collective may be issued on ``group`` (the
    collectives run on a worker thread, in call order). Without ``async_op`` it returns
    ``tensor`` itself, so existing ``x = hitopk_allreduce(x, ...)`` code keeps working.

    Collective: every rank must call it with the same shape, dtype, density, local_size and
    dense_below. A first tiny all-reduce checks that, and NaN/Inf on any rank, so every rank
    raises the same ``ValueError`` before any data moves (``tensor`` and ``residual`` are then
    unchanged). Blocking calls are bounded by the process group's timeout.
    """
    _check_hitopk_args(tensor, density, residual, local_size, method, dense_below)

    def run() -> None:
        _hitopk(tensor, density, residual, local_size, group, method, dense_below)

    if not async_op:
        run()
        return tensor
    global _async_worker
    if _async_worker is None:
        _async_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salus-hitopk")
    return Work(_async_worker.submit(run))


def _hitopk(
    tensor: torch.Tensor,
    density: float,
    residual: torch.Tensor | None,
    local_size: int,
    group: dist.ProcessGroup | None,
    method: Method,
    dense_below: int,
) -> None:
    op = "hitopk_allreduce"
    flat = tensor.reshape(-1)
    n = flat.numel()
    sparse = n >= dense_below
    finite = all_finite(flat) and (residual is None or all_finite(residual))
    header = {
        "numel": n,
        "dtype": _FLOAT_CODES[tensor.dtype],
        "local_size": local_size,
        "density_ppb": round(density * 1e9),
        "sparse": int(sparse),
    }
    preflight(op, finite, header, flat.device, group)
    acc = flat.clone() if residual is None else flat + residual.view(-1)
    if not sparse:
        dist.all_reduce(acc, group=group)
        if residual is not None:
            residual.zero_()
    else:
        acc = _hierarchical(acc, density, residual, node_layout(local_size, group), method)
    tensor.copy_(acc.view(tensor.shape))


def _hierarchical(
    acc: torch.Tensor,
    density: float,
    residual: torch.Tensor | None,
    layout: NodeLayout,
    method: Method,
) -> torch.Tensor:
    n = acc.numel()
    shard_len, k = hitopk_shard(n, density, layout.local_size)
    padded = acc
    if shard_len * layout.local_size != n:
        padded = torch.cat([acc, acc.new_zeros(shard_len * layout.local_size - n)])
    shard = padded
    if layout.intra is not None:
        shard = padded.new_empty(shard_len)
        reduce_scatter(shard, padded, layout.intra)
    vals, idx = topk(shard, k, method=method)
    if residual is not None:
        _keep_unsent(residual.view(-1), shard, idx, layout.local_rank * shard_len)
    summed = torch.zeros_like(shard)
    if layout.inter is None:
        summed[idx] = vals
    else:
        gathered_vals = vals.new_empty(layout.num_nodes * k)
        all_gather(gathered_vals, vals, layout.inter)
        # Shard offsets fit in int32 below 2**31 elements: half the index bytes on the wire.
        wire_idx = idx.to(torch.int32) if shard_len < 2**31 else idx
        gathered_idx = wire_idx.new_empty(layout.num_nodes * k)
        all_gather(gathered_idx, wire_idx, layout.inter)
        summed.index_add_(0, gathered_idx, gathered_vals)
    if layout.intra is None:
        return summed[:n]
    full = summed.new_empty(shard_len * layout.local_size)
    all_gather(full, summed, layout.intra)
    return full[:n]


def _keep_unsent(res: torch.Tensor, shard: torch.Tensor, sent: torch.Tensor, start: int) -> None:
    """Residual := this rank's shard minus what it sent; zero elsewhere (others own it)."""
    res.zero_()
    stop = min(start + shard.numel(), res.numel())
    if stop > start:
        unsent = shard.clone()
        unsent[sent] = 0
        res[start:stop] = unsent[: stop - start]
