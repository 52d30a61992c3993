"""Blink's packed trees run between processes, over a process group's point-to-point ops.

The plan is Blink's: `pack_trees` over a `Topology` whose ``devices()[i]`` is group rank i's
device, rooted at rank 0, and the chunked step schedule of `collectives.schedule.Pipeline`
(reduce toward the root along every tree, then broadcast back). Here each transfer of a step
becomes an ``isend`` on its source rank and an ``irecv`` on its destination rank; a rank posts
all of its transfers of a step at once, waits for them, then adds what it received. The
schedule guarantees that no region is read and written within one step, so sends read and
copies land in the live buffer directly; reduced data lands in a scratch buffer first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from salus.daemon.services.collectives import Topology, TreePlan, pack_trees, ring_rate
from salus.daemon.services.collectives.schedule import Pipeline

CPU_LINK_GBPS = 10.0
"""Capacity (GB/s per direction) of every link in the model of CPU processes on one host."""

_COMBINE: dict[dist.ReduceOp.RedOpType, Callable[[torch.Tensor, torch.Tensor], object]] = {
    dist.ReduceOp.SUM: lambda dst, src: dst.add_(src),
    dist.ReduceOp.PRODUCT: lambda dst, src: dst.mul_(src),
    dist.ReduceOp.MIN: lambda dst, src: torch.minimum(dst, src, out=dst),
    dist.ReduceOp.MAX: lambda dst, src: torch.maximum(dst, src, out=dst),
}
REDUCE_OPS = tuple(_COMBINE)


def fully_connected(n: int, gbps: float = CPU_LINK_GBPS) -> Topology:
    """``n`` devices with a direct link of ``gbps`` GB/s between every ordered pair.

    The model of CPU processes on one host: every pair talks over loopback and nothing tells
    one pair's path from another's.
    """
    links = [(a, b, gbps, "network") for a in range(n) for b in range(n) if a != b]
    return Topology(range(n), links, name=f"fully_connected{n}")


@dataclass(frozen=True)
class TreeRoutes:
    """A group's tree plan and what it is worth: ``tree_rate`` and ``ring_rate`` are the
    modelled broadcast rates (GB/s) of the packed trees and of NCCL-style packed rings on the
    same topology, which ``auto`` compares."""

    plan: TreePlan
    tree_rate: float
    ring_rate: float


def plan_routes(topology: Topology, eps: float = 0.05) -> TreeRoutes:
    """Pack trees rooted at ``topology.devices()[0]`` and rate rings on the same topology."""
    plan = pack_trees(topology, topology.devices()[0], eps)
    return TreeRoutes(plan, plan.rate, ring_rate(topology))


@dataclass(frozen=True)
class _Step:
    sends: tuple[tuple[int, int, int, int], ...]  # (peer, start, stop, tag)
    recvs: tuple[tuple[int, int, int, int, bool], ...]  # (peer, start, stop, tag, reduce)


class TreeAllreduce:
    """One group's tree allreduce: the plan, this rank's steps per tensor size (cached)."""

    _CACHED_SIZES = 64

    def __init__(self, plan: TreePlan, group: dist.ProcessGroup, rank: int,
                 chunk_bytes: int) -> None:
        self.plan = plan
        self.group = group
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self._steps: dict[tuple[int, int], tuple[_Step, ...]] = {}

    def _my_steps(self, numel: int, element_size: int) -> tuple[_Step, ...]:
        """The steps of an allreduce of ``numel`` elements in which this rank has transfers."""
        key = (numel, element_size)
        cached = self._steps.get(key)
        if cached is not None:
            return cached
        steps = []
        pipe = Pipeline(self.plan, numel, element_size, self.chunk_bytes)
        for step in pipe.allreduce_steps():
            # Within a step a tree uses an edge once per direction: (tree, reduce) tells apart
            # the transfers between one pair of ranks.
            sends = tuple((tr.dst, tr.start, tr.stop, 2 * tr.tree + tr.reduce)
                          for tr in step if tr.src == self.rank)
            recvs = tuple((tr.src, tr.start, tr.stop, 2 * tr.tree + tr.reduce, tr.reduce)
                          for tr in step if tr.dst == self.rank)
            if sends or recvs:
                steps.append(_Step(sends, recvs))
        if len(self._steps) >= self._CACHED_SIZES:
            self._steps.pop(next(iter(self._steps)))
        self._steps[key] = result = tuple(steps)
        return result

    def __call__(self, flat: torch.Tensor, op: dist.ReduceOp.RedOpType) -> int:
        """Reduce the contiguous 1-D ``flat`` over the group with ``op``, in place, along the
        trees (pipelined by chunks of ``chunk_bytes`` bytes). Returns the bytes this rank sent.
        """
        combine = _COMBINE[op]
        sent = 0
        size = flat.element_size()
        for step in self._my_steps(flat.numel(), size):
            ops = []
            for peer, start, stop, tag in step.sends:
                ops.append(dist.P2POp(dist.isend, flat[start:stop], group=self.group, tag=tag,
                                      group_peer=peer))
                sent += (stop - start) * size
            pending = []
            for peer, start, stop, tag, reduce in step.recvs:
                buf = flat.new_empty(stop - start) if reduce else flat[start:stop]
                ops.append(dist.P2POp(dist.irecv, buf, group=self.group, tag=tag,
                                      group_peer=peer))
                if reduce:
                    pending.append((start, stop, buf))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for start, stop, buf in pending:
                combine(flat[start:stop], buf)
        return sent
