"""Process groups and the pre-flight agreement step behind hierarchical sparse allreduce.

Ranks are laid out node-major: ``rank = node * local_size + local_rank``. The intra-node group of
a rank holds the ranks of its node; its inter-node group holds the ranks with the same local rank
on every node. ``torch.distributed.new_group`` must be called by every rank in the same order, so
all groups of a layout are created together, once, and cached.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["NodeLayout", "all_finite", "all_gather", "node_layout", "preflight", "reduce_scatter"]


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits in a node-major layout, with its two sub-groups.

    ``intra`` is ``None`` when ``local_size == 1`` and ``inter`` is ``None`` when there is one
    node: a collective over a single rank is skipped rather than issued.
    """

    world_size: int
    local_size: int
    num_nodes: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


_LAYOUTS: dict[tuple[int, int], tuple[object, NodeLayout]] = {}


def node_layout(local_size: int) -> NodeLayout:
    """The cached layout for ``local_size`` ranks per node over the default group.

    Creates every intra- and inter-node group on first use (collective: all ranks must call
    it with the same ``local_size``); a re-initialised default group gets fresh groups.
    """
    world = dist.group.WORLD
    world_size = dist.get_world_size()
    if local_size < 1 or world_size % local_size:
        raise ValueError(
            f"local_size={local_size} must divide the world size {world_size} "
            "(ranks are laid out node-major: rank = node * local_size + local_rank)"
        )
    key = (world_size, local_size)
    cached = _LAYOUTS.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    num_nodes = world_size // local_size
    rank = dist.get_rank()
    node, local_rank = divmod(rank, local_size)
    intra = inter = None
    if local_size > 1:
        for n in range(num_nodes):
            group = dist.new_group(list(range(n * local_size, (n + 1) * local_size)))
            if n == node:
                intra = group
    if num_nodes > 1:
        for lr in range(local_size):
            group = dist.new_group([n * local_size + lr for n in range(num_nodes)])
            if lr == local_rank:
                inter = group
    layout = NodeLayout(world_size, local_size, num_nodes, node, local_rank, intra, inter)
    _LAYOUTS[key] = (world, layout)
    return layout


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN or Inf (always true for integer and bool tensors).

    Uses one ``aminmax`` pass, since NaN and Inf propagate to the min or max; on CPU that is
    about 25x faster than ``isfinite(t).all()``.
    """
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    flat = torch.view_as_real(t).reshape(-1) if t.is_complex() else t.reshape(-1)
    lo, hi = torch.aminmax(flat)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def preflight(op: str, finite: bool, header: Mapping[str, int], device: torch.device) -> None:
    """Agree across all ranks, before any data moves, that the call is valid everywhere.

    One all-reduce (MAX) of ``world_size + 2 * len(header)`` int64 values tells every rank which
    ranks hold non-finite data and whether all ranks passed the same ``header`` (sizes, dtype,
    density...). On disagreement every rank raises the same ``ValueError``, instead of some
    ranks entering a collective the others never join.
    """
    world_size = dist.get_world_size()
    h = len(header)
    vec = torch.zeros(world_size + 2 * h, dtype=torch.int64, device=device)
    vec[dist.get_rank()] = 0 if finite else 1
    mine = torch.tensor(list(header.values()), dtype=torch.int64, device=device)
    vec[world_size : world_size + h] = mine
    vec[world_size + h :] = -mine
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    flags = vec[:world_size].nonzero().flatten().tolist()
    if flags:
        raise ValueError(
            f"{op}: rank(s) {flags} passed a tensor or residual containing NaN or Inf; "
            "nothing was exchanged on any rank. Check those ranks' gradients (loss scale, lr)."
        )
    hi = vec[world_size : world_size + h].tolist()
    lo = [-v for v in vec[world_size + h :].tolist()]
    if hi != lo:
        spread = {
            name: (a, b) for name, a, b in zip(header, lo, hi, strict=True) if a != b
        }
        raise ValueError(
            f"{op}: ranks disagree on the call, (min, max) over ranks: {spread}. "
            "Every rank must pass the same shape, dtype, density and local_size."
        )


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``inp`` over ``group`` and leave this rank's contiguous chunk in ``out``.

    Gloo's reduce-scatter sends the whole tensor, like an allreduce (measured: 2x the bytes of
    an all-to-all, and slower); there an all-to-all of the chunks and a local sum sends only the
    ``(size - 1) / size`` share. Other backends use their own reduce-scatter.
    """
    if dist.get_backend(group) == dist.Backend.GLOO:
        received = torch.empty_like(inp)
        dist.all_to_all_single(received, inp, group=group)
        torch.sum(received.view(dist.get_world_size(group), -1), dim=0, out=out)
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Concatenate every rank's ``inp`` (equal sizes) into ``out`` in group-rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)
