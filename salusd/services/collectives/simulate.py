"""Link-model timer: how long a plan's broadcast or allreduce takes on the modelled hardware.

It walks the same step schedule the executor runs (`schedule.Pipeline`). A step lasts
`step_latency_s` plus the time its busiest pooled link needs: the bytes of every transfer of
the step crossing that link, over its capacity. Steps run one after another, so the model
charges pipeline fill and drain, and contention between trees that share a link.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from .fabric import Fabric, Route
from .plan import TreePlan
from .schedule import Pipeline

DEFAULT_STEP_LATENCY_S = 5e-6


def _reduce_route(fabric: Fabric, plan: TreePlan, tree: int, edge: int) -> Route:
    """Route of a reduce transfer child -> parent: the tree edge's route reversed, else the
    first route the fabric knows for that pair."""
    keys = plan.routes[tree][edge]
    reverse = tuple((b, a, kind) for a, b, kind in reversed(keys))
    if all(k in fabric.index for k in reverse):
        return fabric.route_index(reverse)
    u, v = plan.trees[tree][0][edge]
    if (v, u) not in fabric.routes:
        raise ValueError(f"no link {v} -> {u} for the reduce phase of tree {tree}")
    return fabric.routes[v, u][0]


def simulate(plan: TreePlan, nbytes: int, op: Literal["broadcast", "allreduce"] = "broadcast",
             *, chunk_bytes: int = 1 << 20,
             step_latency_s: float = DEFAULT_STEP_LATENCY_S) -> float:
    """Predicted seconds for `op` of `nbytes` bytes over `plan` (capacities in GB/s = 1e9 B/s)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if op not in ("broadcast", "allreduce"):
        raise ValueError(f"op must be 'broadcast' or 'allreduce', got {op!r}")
    if step_latency_s < 0:
        raise ValueError(f"step_latency_s must be >= 0, got {step_latency_s}")
    if nbytes == 0:
        return 0.0
    fabric = plan.fabric
    pipe = Pipeline(plan, nbytes, 1, chunk_bytes)
    pos = {d: i for i, d in enumerate(plan.topology.devices())}
    down: dict[tuple[int, int, int], Route] = {}
    up: dict[tuple[int, int, int], Route] = {}
    for t, (edges, _w) in enumerate(plan.trees):
        for j, (u, v) in enumerate(edges):
            down[t, pos[u], pos[v]] = fabric.route_index(plan.routes[t][j])
            if op == "allreduce":
                up[t, pos[v], pos[u]] = _reduce_route(fabric, plan, t, j)
    steps = pipe.allreduce_steps() if op == "allreduce" else pipe.broadcast_steps()
    seconds = 0.0
    for step in steps:
        load = np.zeros(len(fabric.keys))
        for tr in step:
            route = (up if tr.reduce else down)[tr.tree, tr.src, tr.dst]
            np.add.at(load, list(route), tr.stop - tr.start)
        seconds += step_latency_s + float((load / (fabric.capacity * 1e9)).max())
    return seconds
