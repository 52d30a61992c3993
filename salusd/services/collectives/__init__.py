"""Topology-aware collectives (Blink): trees packed over the links a job actually has.

- `Topology`: devices, switches and directed links with capacities (GB/s) and kinds; presets
  `Topology.dgx1p()`, `dgx1v()`, `dgx2()`, `pcie_box(n)`; `subgraph`, JSON `save`/`load`,
  `Topology.probe()` on a GPU machine.
- `pack_trees(topology, root, eps)`: spanning arborescences packed by multiplicative weights,
  certified within (1 - eps) of the best broadcast rate; `minimize_trees(plan)`: the ILP that
  keeps that rate (within eps) with as few trees as possible.
- `pack_rings`, `ring_rate`, `ring_plan`: NCCL-style rings, for comparison.
- `tree_broadcast`, `tree_allreduce`: in-place collectives over the daemon's devices;
  `simulate(plan, nbytes)`: the link-model time of the same pipeline.
- `three_phase_allreduce`: local reduce, cross-node allreduce (torch.distributed), local
  broadcast.
"""

from .execute import Work, tree_allreduce, tree_broadcast
from .ilp import minimize_trees
from .multinode import three_phase_allreduce
from .plan import TreePlan
from .rings import Ring, best_ring, pack_rings, ring_plan, ring_rate
from .simulate import simulate
from .topology import LINK_KINDS, Link, Topology
from .treegen import pack_trees

__all__ = [
    "LINK_KINDS",
    "Link",
    "Ring",
    "Topology",
    "TreePlan",
    "Work",
    "best_ring",
    "minimize_trees",
    "pack_rings",
    "pack_trees",
    "ring_plan",
    "ring_rate",
    "simulate",
    "three_phase_allreduce",
    "tree_allreduce",
    "tree_broadcast",
]
