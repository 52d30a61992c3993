"""Three-phase allreduce across nodes over torch.distributed (Blink's multi-machine protocol).

Each process is one node's daemon and holds one tensor per local device. Phase 1 reduces the
local tensors toward the plan's root along every tree (pipelined by chunks); phase 2 runs
`torch.distributed.all_reduce` among the nodes' roots, segment by segment, as soon as a segment
is fully reduced locally (asynchronous, so it overlaps the rest of phase 1); phase 3 broadcasts
each chunk back down the trees once the segments it covers are summed across nodes. The
segments are fixed slices of `chunk_bytes` of the whole tensor, so nodes with different local
topologies and plans still issue the same sequence of cross-node collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .execute import DEFAULT_CHUNK_BYTES, check_tensors, run_transfers
from .plan import TreePlan
from .schedule import Pipeline


def three_phase_allreduce(tensors: Sequence[torch.Tensor], plan: TreePlan,
                          group: dist.ProcessGroup | None = None, *,
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Sum `tensors` over all local devices and all nodes of `group`, in place.

    Every process of `group` must call it with tensors of the same shape and dtype and the same
    `chunk_bytes` (bytes). With gloo the tensors are CPU tensors; with NCCL the root's tensor
    must sit on the process's CUDA device."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("three_phase_allreduce needs torch.distributed.init_process_group() "
                           "to have run in this process")
    flat = [t.view(-1) for t in check_tensors(tensors, plan)]
    pipe = Pipeline(plan, flat[0].numel(), flat[0].element_size(), chunk_bytes)
    root = flat[pipe.root]
    seg = max(1, chunk_bytes // flat[0].element_size())
    n_segments = -(-root.numel() // seg)

    # Step after which each segment is fully reduced at the root.
    ready_after = [0] * n_segments
    for t, chunks in enumerate(pipe.chunks):
        for k, (a, b) in enumerate(chunks):
            for j in range(a // seg, -(-b // seg)):
                ready_after[j] = max(ready_after[j], k + pipe.height[t][pipe.root] - 1)

    # Segments go out in index order on every node, so the collectives match across nodes;
    # the chunk layout finishes in memory order, so this order is also the order they are ready.
    handles: list[dist.Work] = []

    def cross_node(upto_step: int) -> None:
        while len(handles) < n_segments and ready_after[len(handles)] <= upto_step:
            part = root[len(handles) * seg:(len(handles) + 1) * seg]
            handles.append(dist.all_reduce(part, group=group, async_op=True))

    reduce = pipe.reduce_steps()
    for s, step in enumerate(reduce):
        run_transfers(flat, step)
        cross_node(s)
    cross_node(len(reduce))

    waited = 0
    for step in pipe.broadcast_steps():
        for tr in step:
            if tr.src == pipe.root:
                last = -(-tr.stop // seg)
                while waited < last:
                    handles[waited].wait()
                    waited += 1
        run_transfers(flat, step)
    for work in handles[waited:]:
        work.wait()
