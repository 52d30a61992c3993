"""How a call's arguments reach the replicas of a gang job (``salus.connect(devices=N)``).

A gang job's call runs on every replica. By default each tensor argument of one or more
dimensions is split along dim 0 into N nearly equal parts (`torch.tensor_split`) and replica r
gets part r; other arguments and 0-d tensors reach every replica whole. Two markers say
otherwise for one argument:

- ``PerReplica(items)``: replica r gets ``items[r]`` (one batch per replica, made by the client);
- ``Whole(value)``: every replica gets ``value`` whole, tensors included.

They live in the wire package because the client builds them and the executors read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_REPLICAS = 1024


@dataclass(frozen=True)
class PerReplica:
    """One value per replica, in rank order."""

    items: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.items) <= MAX_REPLICAS:
            raise ValueError(f"per_replica takes 1 to {MAX_REPLICAS} values, one per replica; "
                             f"got {len(self.items)}")

    def pick(self, rank: int, world: int) -> Any:
        if len(self.items) != world:
            raise ValueError(f"per_replica was given {len(self.items)} values, but the job has "
                             f"{world} replicas: give one per replica")
        return self.items[rank]


@dataclass(frozen=True)
class Whole:
    """A value every replica gets whole (not split along dim 0)."""

    value: Any
