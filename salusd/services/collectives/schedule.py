"""The pipeline both the executor and the link-model timer follow, step by step.

A tensor of `numel` elements is cut into K near-equal groups, and group k into one chunk per
tree sized by the tree's weight (largest remainder); K is set so the heaviest tree's chunks hold
about `chunk_bytes`. Chunk k of every tree moves in the same step, so each tree gets bandwidth
in proportion to its weight, and the data finishes in memory order.

Broadcast: chunk k crosses edge (p, c) at step k + depth(p). Reduce: chunk k crosses c -> p, and
is added there, at step k + height(c) (height: edges down to the deepest leaf below), so a node
sends only after all its children have added into it. Allreduce runs the reduce, then the
broadcast shifted by H = max height of a root, which starts chunk k down a tree as soon as the
root holds its sum. No two transfers of one step touch the same region of the same buffer
unless both only read it or both add into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .plan import TreePlan


@dataclass(frozen=True)
class Transfer:
    """Move elements [start, stop) of tree `tree`'s chunk `chunk` from the buffer at device
    position `src` to the one at `dst`: add into it when `reduce`, else overwrite it."""

    tree: int
    chunk: int
    src: int
    dst: int
    start: int
    stop: int
    reduce: bool


def split_by_weight(total: int, weights: list[float]) -> list[int]:
    """`total` items split in proportion to `weights` (largest remainder; sums to `total`)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    sizes = np.floor(exact).astype(np.int64)
    short = total - int(sizes.sum())
    sizes[np.argsort(-(exact - sizes), kind="stable")[:short]] += 1
    return sizes.tolist()


class Pipeline:
    """Chunk layout and step schedule of one collective over `plan` (see module docstring)."""

    def __init__(self, plan: TreePlan, numel: int, element_size: int, chunk_bytes: int) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int (bytes), got {chunk_bytes!r}")
        self.plan = plan
        pos = {d: i for i, d in enumerate(plan.topology.devices())}
        self.root = pos[plan.root]
        self.edges = [[(pos[u], pos[v]) for u, v in edges] for edges, _w in plan.trees]
        weights = plan.weights()
        chunk_elems = max(1, chunk_bytes // max(1, element_size))
        heaviest = numel * max(weights) / sum(weights)
        self.n_chunks = max(1, math.ceil(heaviest / chunk_elems))
        self.chunks: list[list[tuple[int, int]]] = [[] for _ in weights]
        offset = 0
        for group in split_by_weight(numel, [1.0] * self.n_chunks):
            for t, size in enumerate(split_by_weight(group, weights)):
                self.chunks[t].append((offset, offset + size))
                offset += size
        self.depth = [self._depths(edges) for edges in self.edges]
        self.height = [self._heights(edges) for edges in self.edges]
        self.root_height = max(h[self.root] for h in self.height)

    def _depths(self, edges: list[tuple[int, int]]) -> dict[int, int]:
        depth = {self.root: 0}
        for u, v in edges:  # parents come before children
            depth[v] = depth[u] + 1
        return depth

    def _heights(self, edges: list[tuple[int, int]]) -> dict[int, int]:
        height = {v: 0 for _u, v in edges} | {self.root: 0}
        for u, v in reversed(edges):
            height[u] = max(height[u], height[v] + 1)
        return height

    def _place(self, steps: list[list[Transfer]], step: int, t: int, k: int, src: int, dst: int,
               reduce: bool) -> None:
        start, stop = self.chunks[t][k]
        if stop > start:
            while len(steps) <= step:
                steps.append([])
            steps[step].append(Transfer(t, k, src, dst, start, stop, reduce))

    def broadcast_steps(self, shift: int = 0) -> list[list[Transfer]]:
        """Root to leaves; `shift` delays every step (used to follow a reduce)."""
        steps: list[list[Transfer]] = []
        for t, edges in enumerate(self.edges):
            for k in range(self.n_chunks):
                for u, v in edges:
                    self._place(steps, shift + k + self.depth[t][u], t, k, u, v, False)
        return steps

    def reduce_steps(self) -> list[list[Transfer]]:
        """Leaves to root, adding into each parent's buffer."""
        steps: list[list[Transfer]] = []
        for t, edges in enumerate(self.edges):
            for k in range(self.n_chunks):
                for u, v in edges:
                    self._place(steps, k + self.height[t][v], t, k, v, u, True)
        return steps

    def allreduce_steps(self) -> list[list[Transfer]]:
        """Reduce, then broadcast of each chunk as soon as every root holds that chunk's sum."""
        down = self.broadcast_steps(shift=self.root_height)
        up = self.reduce_steps()
        return [(up[s] if s < len(up) else []) + (down[s] if s < len(down) else [])
                for s in range(max(len(up), len(down)))]
