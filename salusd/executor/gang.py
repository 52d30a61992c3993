"""One replica of a gang job: the process group over the gang's executors, and its batch shard.

A gang job (``"devices": N`` in a batch job, ``salus.connect(devices=N)`` for a script) runs in
N executors, one per device, all running the same entrypoint or the same client calls. The
daemon picks a loopback port (or, for a gang across nodes, names the cluster's store,
`salusd/cluster.py`) and tells each replica its rank when it loads or attaches the job; the
replicas join one ``torch.distributed`` group (gloo on CPU devices, NCCL on CUDA ones) and the
job's functions get it as ``s.comm`` (`salus.daemon.services.comm.Comm`). A batch job's replica
0 broadcasts its tensors to the others once the job is loaded, as DDP does when it wraps a
model, so replicas start equal even when the entrypoint does not seed its initialisation (an
interactive job's replicas load the same attached bytes). A replica never leaves the group: its
executor ends with ``os._exit`` when the job ends, and a peer still inside a collective then
gets an error within `GANG_TIMEOUT_S` instead of destroying a group under it (which makes gloo
abort).

A batch job's replicas iterate the same data in the same order (same random state at each epoch
start, as the cursor restores it) and each keeps its slice of each batch, as each replica of an
interactive job keeps its slice of each call's arguments (`shard`): tensors are split along dim
0 into N nearly equal parts (`torch.tensor_split`), replica r keeping part r. With a batch size
that N divides and a mean-reduced loss, averaged gradients (``s.comm.all_reduce_gradients``)
equal the gradient of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from salus.daemon.services.procgroup import init_loopback, init_through_store
from salus.daemon.wire.executor_ops import GangPlace
from salus.daemon.wire.replicas import PerReplica, Whole

if TYPE_CHECKING:
    from salus.daemon.services.comm import Comm

GANG_TIMEOUT_S = 120.0
"""Bounds the gang's rendezvous and each of its collectives (a lost replica becomes an error)."""


@dataclass(frozen=True)
class GangSpec:
    """Where this replica stands in its gang.

    A gang on one node rendezvouses on loopback ``port`` (replica 0 hosts the store). A gang
    across nodes (`salusd/cluster.py`) goes through the cluster's store at ``store``
    (HOST:PORT) under the prefix ``key``; ``local`` replicas run on each node (ranks are
    node-major), and ``loopback`` says every node is on this machine.
    """

    rank: int
    world: int
    port: int = 0
    store: str | None = None
    key: str = ""
    local: int = 0  # replicas per node; 0: all of them (one node)
    loopback: bool = True

    @classmethod
    def of(cls, place: GangPlace | None) -> GangSpec | None:
        """The replica's place as the daemon sent it (None: no gang), checked."""
        if place is None:
            return None
        spec = cls(place.rank, place.world, place.port or 0, place.store, place.key or "",
                   place.local or 0, True if place.loopback is None else place.loopback)
        port = spec.port if spec.store is None else int(spec.store.rpartition(":")[2])
        if not 0 <= spec.rank < spec.world or not 0 < port < 65536 or not (
                0 <= spec.local <= spec.world):
            raise ValueError(f"bad gang placement {place!r}")
        return spec

    @property
    def local_size(self) -> int:
        return self.local or self.world


def backend_for(device: torch.device) -> str:
    """The process group's backend for replicas on `device`: NCCL on CUDA (gloo supports only
    broadcast and all_reduce on CUDA tensors: the tree collectives' isend/irecv and the sparse
    allreduce's all_gather would fail), gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def join(spec: GangSpec, device: torch.device) -> Comm:
    """Join the gang's process group on `device`'s backend (blocks until every replica has)
    and wrap it in a Comm whose nodes are the gang's nodes (the hierarchical and top-k
    algorithms use them). The collectives (and the scipy and networkx they plan with) are
    imported here, by the replicas that use them, not by every executor the zygote forks."""
    from salus.daemon.services.comm import Comm

    backend = backend_for(device)
    if spec.store is None:
        init_loopback(spec.rank, spec.world, spec.port, timeout_s=GANG_TIMEOUT_S,
                      backend=backend)
    else:
        host, _, port = spec.store.rpartition(":")
        init_through_store(spec.rank, spec.world, host, int(port), spec.key,
                           timeout_s=GANG_TIMEOUT_S, backend=backend, loopback=spec.loopback)
    return Comm(local_size=spec.local_size)


def state_tensors(objects: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a job's state that replicas must hold equal: module parameters and
    buffers, and top-level tensors (in a fixed order, the same on every replica)."""
    found: list[torch.Tensor] = []
    for name in sorted(objects):
        obj = objects[name]
        if isinstance(obj, nn.Module):
            found += [t.data for t in obj.parameters()] + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            found.append(obj.data)
    return found


def broadcast_state(comm: Comm, objects: dict[str, Any]) -> None:
    """Make every replica's state equal to replica 0's."""
    works = [comm.broadcast(t, src=0, async_op=True) for t in state_tensors(objects)]
    for work in works:
        assert work is not None
        work.wait()


def shard(batch: Any, rank: int, world: int) -> Any:
    """Replica `rank`'s part of `batch`: every tensor split along dim 0 into `world` parts;
    other leaves (and 0-d tensors) are kept whole; a `PerReplica` gives its item `rank`, a
    `Whole` its value (`salus.daemon.wire.replicas`)."""

    def part(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return torch.tensor_split(leaf, world)[rank]
        if isinstance(leaf, PerReplica):
            return leaf.pick(rank, world)
        if isinstance(leaf, Whole):
            return leaf.value
        return leaf

    return pytree.tree_map(part, batch)
