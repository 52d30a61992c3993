"""The link graph collectives plan over: devices, switches and directed links with capacities.

A `Topology` is a directed multigraph. Devices are integer ids (the daemon's device indices);
switches (PCIe switches, CPU root complexes, NVSwitch chips) are string names that relay traffic
but hold no buffers. Every physical link appears once per direction, parallel links repeat, and
each carries a capacity in GB/s (10**9 bytes per second) per direction and a kind.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Node = int | str
LINK_KINDS = ("nvlink", "pcie", "network")


@dataclass(frozen=True)
class Link:
    """One directed physical link: `capacity_gbps` in GB/s in the src -> dst direction."""

    src: Node
    dst: Node
    capacity_gbps: float
    kind: str


class Topology:
    """Devices (int ids, in order), switches (str names) and directed links between them."""

    def __init__(
        self,
        devices: Iterable[int],
        links: Iterable[Link | tuple[Node, Node, float, str]],
        switches: Iterable[str] = (),
        name: str = "",
    ) -> None:
        self._devices = tuple(devices)
        self._switches = tuple(switches)
        self.name = name
        for d in self._devices:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise TypeError(f"device ids must be non-negative ints, got {d!r}")
        for s in self._switches:
            if not isinstance(s, str) or not s:
                raise TypeError(f"switch names must be non-empty strings, got {s!r}")
        for label, ids in (("device", self._devices), ("switch", self._switches)):
            dup = [x for x, n in Counter(ids).items() if n > 1]
            if dup:
                raise ValueError(f"{label} ids repeat: {dup}")
        nodes = set(self._devices) | set(self._switches)
        self._links = tuple(self._check_link(lk, nodes) for lk in links)

    @staticmethod
    def _check_link(link: Link | tuple[Node, Node, float, str], nodes: set[Node]) -> Link:
        lk = link if isinstance(link, Link) else Link(*link)
        if lk.src not in nodes or lk.dst not in nodes:
            raise ValueError(f"link {lk.src!r}->{lk.dst!r} names a node not in the topology")
        if lk.src == lk.dst:
            raise ValueError(f"link {lk.src!r}->{lk.dst!r} is a self-loop")
        cap = lk.capacity_gbps
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap):
            raise TypeError(f"link {lk.src!r}->{lk.dst!r}: capacity must be a finite number")
        if cap <= 0:
            raise ValueError(f"link {lk.src!r}->{lk.dst!r}: capacity must be > 0 GB/s, got {cap}")
        if lk.kind not in LINK_KINDS:
            raise ValueError(f"link {lk.src!r}->{lk.dst!r}: kind {lk.kind!r} not in {LINK_KINDS}")
        return Link(lk.src, lk.dst, float(cap), lk.kind)

    def devices(self) -> list[int]:
        """The device ids, in order: `tensors[i]` of a collective lives on `devices()[i]`."""
        return list(self._devices)

    def switches(self) -> list[str]:
        """The relay nodes (no buffers): PCIe switches, CPU sockets, NVSwitch chips."""
        return list(self._switches)

    def links(self) -> tuple[Link, ...]:
        """Every directed link; parallel links repeat."""
        return self._links

    def edges(self) -> list[tuple[Node, Node, float, str]]:
        """`(src, dst, capacity_gbps, kind)` per directed link; parallel links repeat."""
        return [(lk.src, lk.dst, lk.capacity_gbps, lk.kind) for lk in self._links]

    def link_count(self, device: Node, kind: str) -> int:
        """Number of outgoing links of `kind` at `device` (each physical link counted once)."""
        return sum(1 for lk in self._links if lk.src == device and lk.kind == kind)

    def subgraph(self, device_ids: Sequence[int]) -> Topology:
        """The topology restricted to `device_ids` (in that order, original ids kept).

        Switches stay where they still join kept nodes; dead-end switch branches are dropped."""
        ids = list(device_ids)
        unknown = [d for d in ids if d not in self._devices]
        if unknown:
            raise ValueError(f"devices {unknown} are not in topology {self.name!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"device ids repeat in {ids}")
        switches = set(self._switches)
        links = [lk for lk in self._links if _kept(lk, set(ids), switches)]
        while True:
            neighbours: dict[Node, set[Node]] = {s: set() for s in switches}
            for lk in links:
                for a, b in ((lk.src, lk.dst), (lk.dst, lk.src)):
                    if a in neighbours:
                        neighbours[a].add(b)
            dead = {s for s, nb in neighbours.items() if len(nb) <= 1}
            if not dead:
                break
            switches -= dead
            links = [lk for lk in links if lk.src not in dead and lk.dst not in dead]
        kept = [s for s in self._switches if s in switches]
        return Topology(ids, links, kept, name=f"{self.name}{ids}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON description: name, devices, switches and one entry per directed link."""
        return {
            "name": self.name,
            "devices": list(self._devices),
            "switches": list(self._switches),
            "links": [
                {"src": lk.src, "dst": lk.dst, "capacity_gbps": lk.capacity_gbps, "kind": lk.kind}
                for lk in self._links
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        """Inverse of `to_dict`; raises ValueError naming the missing or malformed field."""
        if not isinstance(data, dict):
            raise TypeError(f"a topology description is a JSON object, got {type(data).__name__}")
        missing = {"devices", "links"} - data.keys()
        if missing:
            raise ValueError(f"topology description lacks {sorted(missing)}")
        try:
            links = [
                Link(e["src"], e["dst"], e["capacity_gbps"], e["kind"]) for e in data["links"]
            ]
        except (KeyError, TypeError) as exc:
            raise ValueError(
                "each link needs src, dst, capacity_gbps and kind, e.g. "
                '{"src": 0, "dst": 1, "capacity_gbps": 25.0, "kind": "nvlink"}'
            ) from exc
        return cls(data["devices"], links, data.get("switches", ()), name=data.get("name", ""))

    def save(self, path: str | Path) -> None:
        """Write the JSON description to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a JSON description written by `save` (or by hand)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return (
            self._devices == other._devices
            and self._switches == other._switches
            and Counter(self._links) == Counter(other._links)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Topology({self.name!r}, devices={len(self._devices)}, "
            f"switches={len(self._switches)}, links={len(self._links)})"
        )

    @classmethod
    def dgx1p(cls, nvlink_gbps: float = 20.0, pcie_gbps: float = 12.0,
              qpi_gbps: float = 10.0) -> Topology:
        """DGX-1 with 8 P100: 4 NVLinks per GPU; see `presets.dgx1p`."""
        from .presets import dgx1p

        return dgx1p(nvlink_gbps, pcie_gbps, qpi_gbps)

    @classmethod
    def dgx1v(cls, nvlink_gbps: float = 25.0, pcie_gbps: float = 12.0,
              qpi_gbps: float = 10.0) -> Topology:
        """DGX-1 with 8 V100: hybrid cube-mesh, 6 NVLinks per GPU; see `presets.dgx1v`."""
        from .presets import dgx1v

        return dgx1v(nvlink_gbps, pcie_gbps, qpi_gbps)

    @classmethod
    def dgx2(cls, nvlink_gbps: float = 25.0) -> Topology:
        """DGX-2: 16 V100 behind 12 NVSwitch chips; see `presets.dgx2`."""
        from .presets import dgx2

        return dgx2(nvlink_gbps)

    @classmethod
    def pcie_box(cls, n: int, pcie_gbps: float = 12.0) -> Topology:
        """`n` devices behind one PCIe switch; see `presets.pcie_box`."""
        from .presets import pcie_box

        return pcie_box(n, pcie_gbps)

    @classmethod
    def probe(cls) -> Topology:
        """The local GPUs' NVLink and PCIe links, read with nvidia-ml-py; see `probe.probe`."""
        from .probe import probe

        return probe()


def _kept(link: Link, devices: set[int], switches: set[str]) -> bool:
    return all(n in devices or n in switches for n in (link.src, link.dst))
