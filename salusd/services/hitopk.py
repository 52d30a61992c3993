"""Hierarchical top-k sparse allreduce with error feedback (the Hi-TopK scheme of the MLSys
2021 paper that `topk.py`'s MSTopK comes from): each node reduces its ranks' gradients into
shards, each shard's top-k crosses nodes, and what a rank did not send stays in its residual.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.distributed as dist

from salus.daemon.services.collectives.execute import SerialWorker, Work
from salus.daemon.services.sparse_allreduce import (
    NodeLayout,
    all_finite,
    all_gather,
    node_layout,
    preflight,
    reduce_scatter,
)
from salus.daemon.services.topk import DENSE_BELOW_NUMEL, FLOAT_CODES, METHODS, Method, topk

__all__ = ["hitopk_allreduce", "hitopk_shard"]
_async_worker = SerialWorker("salus-hitopk")


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
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_CODES:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{op}: tensor must be float16/bfloat16/float32/float64, got {got}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"{op}: density must be a number in (0, 1], got {density!r}")
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"{op}: local_size must be an int >= 1, got {local_size!r}")
    if method not in METHODS:
        raise ValueError(f"{op}: method must be one of {METHODS}, got {method!r}")
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

    work = _async_worker.launch(run, async_op)
    return tensor if work is None else work


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
        "dtype": FLOAT_CODES[tensor.dtype],
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
