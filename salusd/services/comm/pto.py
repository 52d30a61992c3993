"""PTO, the parallel tensor operator (Shi et al., MLSys 2021): each replica updates 1/N of the
parameters with the averaged gradients, then an all-gather restores every parameter everywhere.

Sharding is flat, so every replica gets the same number of elements: the parameters of each
param group (one flat space per dtype and device inside it) are concatenated and cut into N
equal slices; rank r owns slice r. The part of a parameter that falls in this rank's slice
becomes a *piece*: a leaf tensor the shard optimizer updates. The shard optimizer has the user
optimizer's class and one param group per user group, with that group's hyperparameters and
pieces, so its state (momentum, Adam moments) covers 1/N of the elements. An elementwise
optimizer (SGD, Adam, AdamW, RMSprop, Adagrad...) updates a piece exactly as it would update
those elements of the whole parameter; one that looks across a parameter (LBFGS, LAMB-style
trust ratios, Adafactor) would not: step those unsharded. A piece whose parameter has no
gradient gets ``grad=None`` and is skipped, as ``torch.optim`` skips the whole parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from salus.daemon.services.optimizers import rebuilt

# (output, input): concatenate every rank's equal-sized ``input`` into ``output`` in rank order.
Gather = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class _Piece:
    param: torch.Tensor
    start: int  # offset of the piece in the flattened parameter
    stop: int
    at: int  # offset of the piece in this rank's slice
    tensor: torch.Tensor  # the leaf the shard optimizer updates


@dataclass
class _Space:
    """One flat space: the parameters of one group with one dtype and device."""

    params: list[torch.Tensor]
    slice_len: int  # elements per rank, the last slices padded
    pieces: list[_Piece]


def _layout_key(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)


class ShardedOptimizer:
    """The shard of ``optimizer`` that group rank ``rank`` of ``size`` updates (module docstring).

    ``gather(output, input)`` all-gathers equal-sized slices over the ranks. The user's
    optimizer keeps its param groups (LR schedulers keep acting on them) but no state: every
    ``step`` copies its hyperparameters into the shard optimizer first.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, rank: int, size: int,
                 gather: Gather) -> None:
        self.source = optimizer
        self._layout = _layout_key(optimizer)
        self._rank = rank
        self._size = size
        self._gather = gather
        self._spaces: list[_Space] = []
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            pieces: list[torch.Tensor] = []
            for params in self._split_by_kind(group["params"]):
                space = self._space(params)
                self._spaces.append(space)
                pieces += [piece.tensor for piece in space.pieces]
            groups.append({"params": pieces, **hyper})
        self.shard: torch.optim.Optimizer | None = None
        if any(g["params"] for g in groups):
            self.shard = rebuilt(optimizer, groups)

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` still has the param groups this shard was cut from."""
        return optimizer is self.source and _layout_key(optimizer) == self._layout

    @staticmethod
    def _split_by_kind(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        return list(kinds.values())

    def _space(self, params: list[torch.Tensor]) -> _Space:
        total = sum(p.numel() for p in params)
        slice_len = -(-total // self._size)
        lo, hi = self._rank * slice_len, min((self._rank + 1) * slice_len, total)
        pieces = []
        offset = 0
        for p in params:
            start, stop = max(lo, offset), min(hi, offset + p.numel())
            if start < stop:
                leaf = p.detach().reshape(-1)[start - offset : stop - offset].clone()
                pieces.append(_Piece(p, start - offset, stop - offset, start - lo, leaf))
            offset += p.numel()
        return _Space(params, slice_len, pieces)

    def step(self) -> None:
        """Update this rank's pieces from the parameters' current ``.grad``, then all-gather.

        Collective over the ranks (the gather). Gradients must already be averaged.
        """
        if self.shard is not None:
            for mine, theirs in zip(self.shard.param_groups, self.source.param_groups,
                                    strict=True):
                mine.update({k: v for k, v in theirs.items() if k != "params"})
            with torch.no_grad():
                for space in self._spaces:
                    for piece in space.pieces:
                        piece.tensor.copy_(piece.param.reshape(-1)[piece.start : piece.stop])
                        grad = piece.param.grad
                        piece.tensor.grad = (
                            None if grad is None else grad.reshape(-1)[piece.start : piece.stop]
                        )
            self.shard.step()
            for space in self._spaces:
                for piece in space.pieces:
                    piece.tensor.grad = None  # drop the view: it pins the full gradient
        with torch.no_grad():
            for space in self._spaces:
                self._restore(space)

    def _restore(self, space: _Space) -> None:
        first = space.params[0]
        mine = first.new_zeros(space.slice_len)
        for piece in space.pieces:
            mine[piece.at : piece.at + piece.stop - piece.start] = piece.tensor
        full = first.new_empty(space.slice_len * self._size)
        self._gather(full, mine)
        offset = 0
        for p in space.params:
            p.copy_(full[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_bytes(self) -> int:
        """Bytes of tensors in this rank's optimizer state (momentum, moments, step counts)."""
        if self.shard is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for state in self.shard.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
