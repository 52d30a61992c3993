"""`Comm`: the collectives a gang's replicas use, with the torch.distributed calling convention.

A Comm wraps one ``torch.distributed`` process group (the gang's). Every call writes its result
into the tensors it is given; ``async_op=True`` returns a `Work` handle whose ``wait()`` returns
once the result is there (until then the caller leaves those tensors alone). All calls of a
Comm run on its one worker thread, in call order, so ranks that make the same calls in the same
order issue the same collectives in the same order, even with several asynchronous calls in
flight; compute in the calling thread overlaps them. While a call is in flight, issue no other
collective on the same group outside the Comm.

Allreduce algorithms (``algorithm=``):

- ``"ring"``: the backend's own allreduce (gloo: ring; NCCL: its ring or tree choice).
- ``"tree"``: Blink's packed trees over the Comm's `Topology` (default: every pair of ranks
  linked alike), run with point-to-point sends (`tree.TreeAllreduce`). Planned once per Comm,
  on first use, by rank 0, and broadcast so that every rank runs the same plan.
- ``"hierarchical"``: reduce-scatter inside each node, allreduce of the shard across nodes,
  all-gather inside the node; only ``1 / local_size`` of the data crosses nodes.
- ``"auto"``: ``ring`` below `AUTO_SMALL_BYTES` (one latency-bound call), ``hierarchical``
  when the gang spans several nodes with several ranks each, ``tree`` when the plan's modelled
  broadcast rate beats packed rings on the same topology by `AUTO_TREE_GAIN`, else ``ring``.
  The choice is kept in ``last_algorithm`` and ``stats``.
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from salus.daemon.services.collectives import Topology, Work
from salus.daemon.services.collectives.execute import DEFAULT_CHUNK_BYTES
from salus.daemon.services.hitopk import hitopk_allreduce, hitopk_shard
from salus.daemon.services.sparse_allreduce import all_gather, node_layout, reduce_scatter
from salus.daemon.services.topk import DENSE_BELOW_NUMEL

from .buckets import BUCKET_BYTES, flatten_grads, plan_buckets, unflatten_grads
from .pto import ShardedOptimizer
from .traffic import (
    CommStats,
    all_gather_bytes,
    all_to_all_bytes,
    broadcast_bytes,
    ring_allreduce_bytes,
)
from .tree import REDUCE_OPS, TreeAllreduce, TreeRoutes, fully_connected, plan_routes

Algorithm = Literal["auto", "ring", "tree", "hierarchical"]
ALGORITHMS: tuple[str, ...] = ("auto", "ring", "tree", "hierarchical")

AUTO_SMALL_BYTES = 256 * 1024
"""``auto`` sends tensors smaller than this (bytes) with the backend's allreduce."""
AUTO_TREE_GAIN = 1.2
"""``auto`` runs trees when their modelled rate is at least this multiple of the rings'."""


class Comm:
    """Collectives over the replicas of a gang (see the module docstring).

    ``group``: the gang's process group (default: the default group); ranks below are ranks in
    it. ``topology``: the model ``tree`` plans over, ``devices()[i]`` being rank i's device
    (default: `fully_connected`). ``local_size``: ranks per node, node-major (default: ranks
    whose host name matches, when hosts form equal contiguous blocks; else 1).
    ``chunk_bytes``: the tree pipeline's chunk; ``bucket_bytes``: the gradient bucket cap.

    Collective: every rank of the group constructs it, before issuing calls on the group
    elsewhere (it all-gathers host names when ``local_size`` is not given, and makes the
    intra- and inter-node sub-groups).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        topology: Topology | None = None,
        local_size: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Comm needs torch.distributed.init_process_group() to have run")
        resolved = dist.group.WORLD if group is None else group
        assert resolved is not None
        self.group: dist.ProcessGroup = resolved
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the Comm's group")
        self.size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.topology = topology or fully_connected(self.size)
        if len(self.topology.devices()) != self.size:
            raise ValueError(f"the topology has {len(self.topology.devices())} devices but the "
                             f"group has {self.size} ranks; give one device per rank")
        self.local_size = self._local_size() if local_size is None else local_size
        if self.local_size < 1 or self.size % self.local_size:
            raise ValueError(f"local_size={self.local_size} must divide the group size "
                             f"{self.size}")
        # Sub-groups now, in program order: made later on the worker thread, their creation
        # could interleave differently on each rank with new_group calls of the caller.
        self._layout = node_layout(self.local_size, self.group)
        self.chunk_bytes = chunk_bytes
        self.bucket_bytes = bucket_bytes
        self.stats = CommStats()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="salus-comm")
        self._routes: TreeRoutes | None = None
        self._tree: TreeAllreduce | None = None
        # Error-feedback residual per gradient bucket: (the bucket's parameters, residual).
        self._residuals: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._shards: weakref.WeakKeyDictionary[torch.optim.Optimizer, ShardedOptimizer] = (
            weakref.WeakKeyDictionary()
        )

    def _local_size(self) -> int:
        hosts: list[str | None] = [None] * self.size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        run = 1
        while run < self.size and hosts[run] == hosts[0]:
            run += 1
        blocks = [hosts[i : i + run] for i in range(0, self.size, run)]
        same_block = all(len(set(b)) == 1 and len(b) == run for b in blocks)
        distinct = len({b[0] for b in blocks}) == len(blocks)
        return run if same_block and distinct else 1

    @property
    def last_algorithm(self) -> str | None:
        """The allreduce algorithm of the last finished ``all_reduce`` call."""
        return self.stats.last_algorithm

    def new_group(self, backend: str = "gloo") -> dist.ProcessGroup:
        """A new process group over this Comm's ranks, e.g. a gloo side channel for host data
        that must not queue behind (or interleave with) this Comm's calls.

        Collective: over the default group when this Comm's group is the default group (every
        process calls it, in the same order as its other ``new_group`` calls), else over this
        Comm's ranks only.
        """
        ranks = dist.get_process_group_ranks(self.group)
        local = self.group is not dist.group.WORLD
        group = dist.new_group(ranks, backend=backend, use_local_synchronization=local)
        assert group is not None
        return group

    def close(self) -> None:
        """Finish queued calls and stop the worker thread."""
        self._worker.shutdown(wait=True)

    def _launch(self, run: Callable[[], None], async_op: bool) -> Work | None:
        future = self._worker.submit(run)
        if async_op:
            return Work(future)
        future.result()
        return None

    # Allreduce ------------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        algorithm: Algorithm = "auto",
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``tensor`` over the group with ``op`` (SUM, PRODUCT, MIN, MAX), in place.

        ``algorithm``: see the module docstring. Returns None, or a `Work` with ``async_op``.
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be SUM, PRODUCT, MIN or MAX, got {op}")

        def run() -> None:
            chosen = self._choose(tensor) if algorithm == "auto" else algorithm
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
            sent = self._all_reduce_flat(flat, op, chosen)
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))
            self.stats.last_algorithm = chosen
            self.stats.add(f"all_reduce.{chosen}", sent)

        return self._launch(run, async_op)

    def _choose(self, tensor: torch.Tensor) -> str:
        """The algorithm ``auto`` runs for ``tensor`` (collective on first use of the plan)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.size == 1 or nbytes < AUTO_SMALL_BYTES:
            return "ring"
        if 1 < self.local_size < self.size:
            return "hierarchical"
        routes = self._planned_routes()
        if routes.tree_rate >= AUTO_TREE_GAIN * routes.ring_rate:
            return "tree"
        return "ring"

    def _planned_routes(self) -> TreeRoutes:
        """The tree plan of this Comm, made by rank 0 on first use and broadcast (collective)."""
        if self._routes is None:
            box: list[TreeRoutes | None] = [None]
            if self.rank == 0:
                box[0] = plan_routes(self.topology)
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            assert box[0] is not None
            self._routes = box[0]
        return self._routes

    def _all_reduce_flat(self, flat: torch.Tensor, op: dist.ReduceOp.RedOpType,
                         algorithm: str) -> int:
        nbytes = flat.numel() * flat.element_size()
        if self.size == 1:
            return 0
        if algorithm == "ring":
            dist.all_reduce(flat, op=op, group=self.group)
            return ring_allreduce_bytes(nbytes, self.size)
        if algorithm == "tree":
            if self._tree is None:
                self._tree = TreeAllreduce(self._planned_routes().plan, self.group, self.rank,
                                           self.chunk_bytes)
            return self._tree(flat, op)
        return self._hierarchical(flat, op)

    def _hierarchical(self, flat: torch.Tensor, op: dist.ReduceOp.RedOpType) -> int:
        layout = self._layout
        n, size = flat.numel(), flat.element_size()
        shard_len = -(-n // layout.local_size)
        sent = 0
        shard = flat
        if layout.intra is not None:
            padded = flat
            if shard_len * layout.local_size != n:
                padded = torch.cat([flat, flat.new_zeros(shard_len * layout.local_size - n)])
            shard = flat.new_empty(shard_len)
            reduce_scatter(shard, padded, layout.intra, op)
            sent += all_to_all_bytes(padded.numel() * size, layout.local_size)
        if layout.inter is not None:
            dist.all_reduce(shard, op=op, group=layout.inter)
            sent += ring_allreduce_bytes(shard.numel() * size, layout.num_nodes)
        if layout.intra is not None:
            if shard_len * layout.local_size == n:
                all_gather(flat, shard, layout.intra)
            else:
                full = flat.new_empty(shard_len * layout.local_size)
                all_gather(full, shard, layout.intra)
                flat.copy_(full[:n])
            sent += all_gather_bytes(shard_len * size, layout.local_size)
        return sent

    def sparse_all_reduce(
        self,
        tensor: torch.Tensor,
        density: float,
        residual: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Sum ``tensor`` in place, sending only the top ``density`` share between nodes.

        The hierarchical top-k allreduce of `hitopk_allreduce` over this Comm's group and
        ``local_size``; ``residual`` (same shape, dtype, device) keeps what this rank did not
        send and adds it back next call (error feedback). ``density=1`` is the dense sum.
        """

        def run() -> None:
            hitopk_allreduce(tensor, density, residual, local_size=self.local_size,
                             group=self.group, dense_below=DENSE_BELOW_NUMEL)
            self.stats.add("sparse_all_reduce", self._sparse_bytes(tensor, density))

        return self._launch(run, async_op)

    def _sparse_bytes(self, tensor: torch.Tensor, density: float) -> int:
        """Bytes this rank sent in one `hitopk_allreduce` call (its pre-flight included)."""
        n, size = tensor.numel(), tensor.element_size()
        sent = ring_allreduce_bytes(8 * (self.size + 10), self.size)  # pre-flight header
        if n < DENSE_BELOW_NUMEL:
            return sent + ring_allreduce_bytes(n * size, self.size)
        local, nodes = self.local_size, self.size // self.local_size
        shard_len, k = hitopk_shard(n, density, local)
        if local > 1:
            sent += all_to_all_bytes(shard_len * local * size, local)
            sent += all_gather_bytes(shard_len * size, local)
        if nodes > 1:
            index_size = 4 if shard_len < 2**31 else 8
            sent += all_gather_bytes(k * (size + index_size), nodes)
        return sent

    # Other collectives -------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` (``src``: group rank)."""

        def run() -> None:
            dist.broadcast(tensor, group=self.group, group_src=src)
            nbytes = tensor.numel() * tensor.element_size()
            sent = broadcast_bytes(nbytes, self.size, self.rank, src, self.backend)
            self.stats.add("broadcast", sent)

        return self._launch(run, async_op)

    def all_gather(
        self,
        output: torch.Tensor | list[torch.Tensor],
        tensor: torch.Tensor,
        async_op: bool = False,
    ) -> Work | None:
        """Every rank's ``tensor`` into ``output``, in rank order: a list of ``size`` tensors
        (``dist.all_gather``) or one tensor of ``size`` times the elements
        (``dist.all_gather_into_tensor``)."""

        def run() -> None:
            if isinstance(output, torch.Tensor):
                all_gather(output, tensor, self.group)
            else:
                dist.all_gather(output, tensor, group=self.group)
            nbytes = tensor.numel() * tensor.element_size()
            self.stats.add("all_gather", all_gather_bytes(nbytes, self.size))

        return self._launch(run, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: torch.Tensor | Sequence[torch.Tensor],
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``inputs`` over the group with ``op`` and leave rank r's part in ``output``:
        ``inputs`` is a list of ``size`` tensors shaped like ``output`` (``dist.reduce_scatter``)
        or one contiguous tensor of ``size`` times its elements (``reduce_scatter_tensor``)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be SUM, PRODUCT, MIN or MAX, got {op}")

        def run() -> None:
            if isinstance(inputs, torch.Tensor):
                flat = inputs.reshape(-1)
            else:
                flat = torch.cat([t.reshape(-1) for t in inputs])
            if flat.numel() != self.size * output.numel():
                raise ValueError(f"reduce_scatter: {flat.numel()} input elements for {self.size} "
                                 f"ranks of {output.numel()}")
            out = output.view(-1) if output.is_contiguous() else output.new_empty(output.numel())
            reduce_scatter(out, flat, self.group, op)
            if out.data_ptr() != output.data_ptr():
                output.copy_(out.view_as(output))
            nbytes = flat.numel() * flat.element_size()
            self.stats.add("reduce_scatter", all_to_all_bytes(nbytes, self.size))

        return self._launch(run, async_op)

    def gather_batch(self, value: Any, dst: int = 0) -> Any:
        """The whole batch's `value` on rank ``dst`` (None on the others): every rank's
        ``value`` (a pytree of the same structure on every rank), gathered in rank order, with
        tensors of one or more dimensions concatenated along dim 0 and other leaves as rank 0
        has them. It undoes the split of a gang's batch: an inference call returns its
        whole batch's outputs with ``return s.comm.gather_batch(s.model(x))``. Collective;
        tensors travel pickled on the CPU (``dist.gather_object``)."""
        host = pytree.tree_map(
            lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)
        gathered: list[Any] | None = [None] * self.size if self.rank == dst else None

        def run() -> None:
            dist.gather_object(host, gathered, group=self.group, group_dst=dst)
            sent = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(host)
                       if isinstance(t, torch.Tensor))
            self.stats.add("gather", 0 if self.rank == dst else sent)

        self._launch(run, async_op=False)
        if gathered is None:
            return None
        return pytree.tree_map(_concat_dim0, *gathered)

    # Training helpers -----------------------------------------------------------------------

    def all_reduce_gradients(
        self,
        model: nn.Module,
        algorithm: Algorithm = "auto",
        density: float | None = None,
    ) -> None:
        """Average every gradient of ``model`` over the replicas, DDP-style.

        Gradients go in buckets of at most ``bucket_bytes`` bytes (reverse parameter order, as
        DDP), all in flight at once; ``density`` sends each bucket with `sparse_all_reduce` and
        a residual per bucket kept in this Comm (error feedback). A parameter without a
        gradient on some ranks counts as zero there; one without a gradient on every rank is
        left without one, as DDP leaves globally unused parameters.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                               device=params[0].device)
        self.all_reduce(present, algorithm="ring")
        used = [p for p, count in zip(params, present.tolist(), strict=True) if count > 0]
        buckets = plan_buckets(used, self.bucket_bytes)
        residuals: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}
        in_flight = []
        for bucket in buckets:
            flat = flatten_grads(bucket, used)
            if density is None:
                work = self.all_reduce(flat, algorithm=algorithm, async_op=True)
            else:
                members: list[torch.Tensor] = [used[i] for i in bucket.params]
                key = tuple(id(p) for p in members)
                _, residual = self._residuals.get(key, (members, None))
                if residual is None or residual.shape != flat.shape:
                    residual = torch.zeros_like(flat)
                residuals[key] = (members, residual)
                work = self.sparse_all_reduce(flat, density, residual, async_op=True)
            in_flight.append((bucket, flat, work))
        if density is not None:
            self._residuals = residuals  # buckets of another layout are forgotten
        for bucket, flat, work in in_flight:
            assert work is not None
            work.wait()
            flat.div_(self.size)
            unflatten_grads(flat, bucket, used)

    def sharded_step(self, optimizer: torch.optim.Optimizer) -> None:
        """PTO: step ``optimizer`` on this rank's 1/N of the parameters, then all-gather.

        Call after the gradients are averaged (`all_reduce_gradients`) and instead of
        ``optimizer.step()``. The shard optimizer (same class and defaults, over this rank's
        pieces of each param group) is made on first call and again when the optimizer's
        param groups change; each step copies lr and the other hyperparameters from
        ``optimizer.param_groups``, so LR schedulers on ``optimizer`` keep working. Only the
        shard holds state: optimizer memory per replica falls by N. Collective.
        """
        shard = self._shards.get(optimizer)
        if shard is None or not shard.matches(optimizer):
            shard = ShardedOptimizer(optimizer, self.rank, self.size, self._gather)
            self._shards[optimizer] = shard
        shard.step()
        # LR schedulers on `optimizer` warn unless its own step ran; this call stands for it.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def checkpoint_state(self) -> dict[str, Any]:
        """What a job's checkpoint keeps of this Comm: each sharded optimizer's shard state
        (this rank's 1/N) and each gradient bucket's error-feedback residual.

        Optimizers and parameters appear as the objects themselves: pickled in one payload with
        the job's objects (as the executor's checkpoint does), they come back as the restored
        job's own, which `restore_state` needs.
        """
        return {
            "rank": self.rank, "size": self.size,
            "shards": [(opt, shard.shard.state_dict() if shard.shard is not None else None)
                       for opt, shard in self._shards.items()],
            "residuals": [(params, residual) for params, residual in self._residuals.values()],
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` returned, on the same rank of a group of the same
        size (a shard's state is this rank's slice). Not collective."""
        if (state["rank"], state["size"]) != (self.rank, self.size):
            raise ValueError(f"the Comm state was saved by rank {state['rank']} of "
                             f"{state['size']}; this is rank {self.rank} of {self.size}")
        for optimizer, shard_state in state["shards"]:
            shard = ShardedOptimizer(optimizer, self.rank, self.size, self._gather)
            if shard.shard is not None and shard_state is not None:
                shard.shard.load_state_dict(shard_state)
            self._shards[optimizer] = shard
        self._residuals = {tuple(id(p) for p in params): (list(params), residual)
                           for params, residual in state["residuals"]}

    def _gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self.all_gather(output, tensor)

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Bytes of optimizer state this replica holds for ``optimizer`` (default: all that
        `sharded_step` has stepped)."""
        if optimizer is not None:
            shard = self._shards.get(optimizer)
            return 0 if shard is None else shard.state_bytes()
        return sum(shard.state_bytes() for shard in self._shards.values())


def _concat_dim0(first: Any, *rest: Any) -> Any:
    """One leaf of a gathered batch: tensors of one or more dimensions concatenated along
    dim 0 in rank order; anything else as the first rank has it."""
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat([first, *rest])
    return first
