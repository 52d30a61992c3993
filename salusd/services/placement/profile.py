"""The saved result of the benchmark phase: what each layer costs and what each device offers.

A `Profile` is plain data (frozen dataclasses of ints, floats and strings) written as JSON, so a
planner can run later, elsewhere, or on a profile written by hand. Units are in the field names:
bytes, FLOPs (floating-point operations, a multiply-add counts 2), seconds, bytes per second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self


class _JsonProfile:
    """`to_json` and `from_json` of a profile dataclass; each one rebuilds itself from the
    parsed JSON object in `_from_dict`."""

    def to_json(self) -> str:
        """The profile as a JSON object."""
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Inverse of `to_json`."""
        return cls._from_dict(json.loads(text))

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        raise NotImplementedError


@dataclass(frozen=True)
class LayerProfile:
    """One layer (a top-level child module or a user-given block) at the profiled batch size.

    `activation_bytes` are the tensors autograd saves in the forward pass for the backward
    (the layer's own input included when saved); `output_bytes` is what the layer hands to the
    next one, sent over the link when a stage ends here. `*_bytes_accessed` estimate the memory
    traffic of the forward and backward passes: the bytes every non-view operator reads and
    writes.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    output_bytes: int
    forward_flops: int
    backward_flops: int
    forward_bytes_accessed: int
    backward_bytes_accessed: int

    @property
    def memory_bytes(self) -> int:
        """Bytes the layer holds on its device during training: state plus saved activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def flops(self) -> int:
        """FLOPs of one forward and one backward pass over the profiled batch."""
        return self.forward_flops + self.backward_flops

    @property
    def bytes_accessed(self) -> int:
        """Memory traffic in bytes of one forward and one backward pass over the batch."""
        return self.forward_bytes_accessed + self.backward_bytes_accessed


@dataclass(frozen=True)
class ModelProfile(_JsonProfile):
    """The layers of a model, in execution order, profiled at `batch_size` samples."""

    layers: tuple[LayerProfile, ...]
    batch_size: int

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(tuple(LayerProfile(**layer) for layer in data["layers"]), data["batch_size"])


@dataclass(frozen=True)
class DeviceProfile:
    """What one device achieved in the benchmark, and the memory the caller grants it.

    `flops_per_s` comes from a matmul-bound kernel, `bytes_per_s` from a memory-bound copy
    (bytes read plus bytes written per second); `memory_bytes` is the daemon's budget for the
    job on this device, not the device's total.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    memory_bytes: int


@dataclass(frozen=True)
class LinkProfile:
    """Point-to-point cost between devices: `latency_s[i][j]` seconds plus bytes over
    `bandwidth_bytes_per_s[i][j]`, for a message from device i to device j.

    Indices are positions in the cluster's device list; the diagonal is unused and holds 0.0.
    """

    latency_s: tuple[tuple[float, ...], ...]
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class ClusterProfile(_JsonProfile):
    """The devices a job may use, in pipeline order, and the links between them."""

    devices: tuple[DeviceProfile, ...]
    links: LinkProfile

    def __post_init__(self) -> None:
        n = len(self.devices)
        for label, matrix in (("latency_s", self.links.latency_s),
                              ("bandwidth_bytes_per_s", self.links.bandwidth_bytes_per_s)):
            if len(matrix) != n or any(len(row) != n for row in matrix):
                raise ValueError(f"links.{label} must be {n}x{n} for {n} devices")

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        links = data["links"]
        return cls(
            tuple(DeviceProfile(**d) for d in data["devices"]),
            LinkProfile(
                tuple(tuple(row) for row in links["latency_s"]),
                tuple(tuple(row) for row in links["bandwidth_bytes_per_s"]),
            ),
        )


@dataclass(frozen=True)
class Profile(_JsonProfile):
    """A model profile and a cluster profile: everything an allocator needs. As JSON, an object
    with keys "model" and "cluster"."""

    model: ModelProfile
    cluster: ClusterProfile

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(ModelProfile._from_dict(data["model"]),
                   ClusterProfile._from_dict(data["cluster"]))

    def save(self, path: str | Path) -> None:
        """Write the JSON profile to `path`."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by `save`."""
        return cls.from_json(Path(path).read_text())
