"""Capacities and routes that planners share: what a device-to-device hop costs the hardware.

Parallel links of one kind between the same two nodes are pooled into one resource whose
capacity is their sum (data is striped over them, as NCCL does over a doubled NVLink). A hop
from device u to device v may take a direct link of any kind, or a fewest-hop path through
switches (PCIe switches, CPU sockets, NVSwitch chips); devices never relay inside a hop, since
relaying through a device is what a tree edge already expresses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

import networkx as nx
import numpy as np

from .topology import Node, Topology

LinkKey = tuple[Node, Node, str]
Route = tuple[int, ...]


class Fabric:
    """Pooled links (`keys`, `capacity` in GB/s) and candidate routes per device pair."""

    def __init__(self, topology: Topology, max_routes: int = 16) -> None:
        self.topology = topology
        self.devices = topology.devices()
        pooled: dict[LinkKey, float] = {}
        for lk in topology.links():
            key = (lk.src, lk.dst, lk.kind)
            pooled[key] = pooled.get(key, 0.0) + lk.capacity_gbps
        self.keys: list[LinkKey] = list(pooled)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.capacity = np.array([pooled[k] for k in self.keys], dtype=np.float64)
        self.routes = self._routes(max_routes)

    def _routes(self, max_routes: int) -> dict[tuple[int, int], list[Route]]:
        best_hop: dict[tuple[Node, Node], int] = {}
        for i, (a, b, _kind) in enumerate(self.keys):
            if (a, b) not in best_hop or self.capacity[i] > self.capacity[best_hop[a, b]]:
                best_hop[a, b] = i
        switches = set(self.topology.switches())
        core = nx.DiGraph()
        core.add_nodes_from(switches)
        core.add_edges_from((a, b) for a, b in best_hop if a in switches and b in switches)
        routes: dict[tuple[int, int], list[Route]] = {}
        for u in self.devices:
            for v in self.devices:
                if u == v:
                    continue
                direct = [(i,) for i, (a, b, _k) in enumerate(self.keys) if (a, b) == (u, v)]
                g = core.copy()
                g.add_edges_from((u, s) for s in switches if (u, s) in best_hop)
                g.add_edges_from((s, v) for s in switches if (s, v) in best_hop)
                relayed: list[Route] = []
                if g.has_node(u) and g.has_node(v) and nx.has_path(g, u, v):
                    paths = islice(nx.all_shortest_paths(g, u, v), max_routes)
                    relayed = [tuple(best_hop[p, q] for p, q in zip(path, path[1:], strict=False))
                               for path in paths]
                if direct or relayed:
                    routes[u, v] = direct + relayed
        return routes

    def use_vector(self, routes: Iterable[Route]) -> np.ndarray:
        """How many times a tree whose edges take `routes` crosses each pooled link."""
        use = np.zeros(len(self.keys))
        for route in routes:
            for i in route:
                use[i] += 1
        return use

    def route_keys(self, route: Route) -> tuple[LinkKey, ...]:
        """The pooled links a route crosses, as `(src, dst, kind)`."""
        return tuple(self.keys[i] for i in route)

    def route_index(self, keys: Sequence[LinkKey]) -> Route:
        """Inverse of `route_keys`; raises ValueError for a link this topology lacks."""
        try:
            return tuple(self.index[k] for k in keys)
        except KeyError as exc:
            raise ValueError(f"link {exc.args[0]} is not in topology {self.topology.name!r}") \
                from exc

    def min_cut(self, root: int) -> float:
        """min over devices v != root of the max flow root -> v, in GB/s.

        No broadcast from `root` can beat it; with no switches it is exactly the best packing
        of spanning arborescences (Edmonds' theorem)."""
        g = nx.DiGraph()
        for (a, b, _k), cap in zip(self.keys, self.capacity, strict=True):
            prev = g.get_edge_data(a, b, {"capacity": 0.0})["capacity"]
            g.add_edge(a, b, capacity=prev + float(cap))
        return min(nx.maximum_flow_value(g, root, v) for v in self.devices if v != root)

