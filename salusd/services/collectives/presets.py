"""Documented machine layouts as `Topology` objects (capacities are per direction, in GB/s).

The numbers are modelled peak figures, not measurements: NVLink 1 (P100) carries 20 GB/s per
link and direction, NVLink 2 (V100) 25 GB/s; a PCIe 3.0 x16 hop is taken as 12 GB/s and the
inter-socket (QPI) hop as 10 GB/s. Pass other figures to the builders to model other boxes.

DGX-1 PCIe tree (both generations): GPU pairs (0,1), (2,3), (4,5), (6,7) each sit behind one
PCIe switch ("plx0".."plx3"); plx0/plx1 hang off CPU socket "cpu0", plx2/plx3 off "cpu1", and
the sockets are joined by QPI. The inter-socket hop is recorded with kind "pcie" because it
carries PCIe peer traffic.
"""

from __future__ import annotations

from itertools import combinations

from .topology import Link, Node, Topology

# DGX-1 with P100 (NVIDIA DGX-1 system architecture whitepaper, 2016): two fully connected
# quads 0-3 and 4-7 plus the four links i <-> i+4, one NVLink each: 4 NVLinks per GPU.
DGX1P_NVLINKS: dict[tuple[int, int], int] = {
    **{pair: 1 for pair in combinations(range(4), 2)},
    **{pair: 1 for pair in combinations(range(4, 8), 2)},
    **{(i, i + 4): 1 for i in range(4)},
}

# DGX-1 with V100, hybrid cube-mesh (NVIDIA DGX-1 with Tesla V100 system architecture
# whitepaper: a cube whose 12 edges carry NVLink, some of them doubled, plus the diagonals of
# two faces; 6 NVLinks per GPU). Link counts as `nvidia-smi topo -m` reports them on a DGX-1V
# (NV1/NV2): 16 connected pairs, 8 of them doubled, 24 NVLinks in all.
DGX1V_NVLINKS: dict[tuple[int, int], int] = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2,
    (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1, (4, 6): 1, (4, 7): 2,
    (5, 6): 2, (5, 7): 1,
    (6, 7): 2,
}  # fmt: skip


def _both_ways(a: Node, b: Node, gbps: float, kind: str, count: int = 1) -> list[Link]:
    return [Link(a, b, gbps, kind) for _ in range(count)] + [
        Link(b, a, gbps, kind) for _ in range(count)
    ]


def _dgx1_pcie(pcie_gbps: float, qpi_gbps: float) -> tuple[list[str], list[Link]]:
    switches = ["plx0", "plx1", "plx2", "plx3", "cpu0", "cpu1"]
    links: list[Link] = []
    for gpu in range(8):
        links += _both_ways(gpu, f"plx{gpu // 2}", pcie_gbps, "pcie")
    for plx in range(4):
        links += _both_ways(f"plx{plx}", f"cpu{plx // 2}", pcie_gbps, "pcie")
    links += _both_ways("cpu0", "cpu1", qpi_gbps, "pcie")
    return switches, links


def _dgx1(name: str, nvlinks: dict[tuple[int, int], int], nvlink_gbps: float,
          pcie_gbps: float, qpi_gbps: float) -> Topology:
    switches, links = _dgx1_pcie(pcie_gbps, qpi_gbps)
    for (a, b), count in nvlinks.items():
        links += _both_ways(a, b, nvlink_gbps, "nvlink", count)
    return Topology(range(8), links, switches, name=name)


def dgx1p(nvlink_gbps: float = 20.0, pcie_gbps: float = 12.0, qpi_gbps: float = 10.0) -> Topology:
    """DGX-1P: 8 P100, 4 NVLinks per GPU (`DGX1P_NVLINKS`) over the DGX-1 PCIe tree."""
    return _dgx1("dgx1p", DGX1P_NVLINKS, nvlink_gbps, pcie_gbps, qpi_gbps)


def dgx1v(nvlink_gbps: float = 25.0, pcie_gbps: float = 12.0, qpi_gbps: float = 10.0) -> Topology:
    """DGX-1V: 8 V100, hybrid cube-mesh with 6 NVLinks per GPU (`DGX1V_NVLINKS`)."""
    return _dgx1("dgx1v", DGX1V_NVLINKS, nvlink_gbps, pcie_gbps, qpi_gbps)


def dgx2(nvlink_gbps: float = 25.0) -> Topology:
    """DGX-2: 16 V100 on two baseboards of 6 NVSwitch chips each.

    Every GPU has one NVLink to each of the 6 switches on its baseboard (6 NVLinks per GPU);
    switch k of one baseboard joins switch k of the other with 8 NVLinks, so any GPU reaches any
    other at 6 x `nvlink_gbps`. PCIe is left out: NVSwitch dominates it on this machine."""
    switches = [f"nvswitch{b}.{k}" for b in range(2) for k in range(6)]
    links: list[Link] = []
    for gpu in range(16):
        for k in range(6):
            links += _both_ways(gpu, f"nvswitch{gpu // 8}.{k}", nvlink_gbps, "nvlink")
    for k in range(6):
        links += _both_ways(f"nvswitch0.{k}", f"nvswitch1.{k}", nvlink_gbps, "nvlink", 8)
    return Topology(range(16), links, switches, name="dgx2")


def pcie_box(n: int, pcie_gbps: float = 12.0) -> Topology:
    """`n` devices, each on one PCIe x16 link to a shared switch "pcie0" (no NVLink)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"pcie_box needs a positive device count, got {n!r}")
    links: list[Link] = []
    for d in range(n):
        links += _both_ways(d, "pcie0", pcie_gbps, "pcie")
    return Topology(range(n), links, ["pcie0"], name=f"pcie_box{n}")
