"""Read the local GPUs' links with nvidia-ml-py (pynvml) into a `Topology`.

NVLink: every active link becomes one directed link per side, at the per-direction rate of its
NVLink generation; a link whose far end is not a GPU (an NVSwitch) goes to a switch node named
after the far end's PCI bus id. PCIe: GPUs that share a CPU socket (common ancestor below
NVML_TOPOLOGY_SYSTEM) hang off one node "cpu<k>" at the rate of their current PCIe link, and
the sockets are joined by `socket_gbps` links. PCIe switches between a GPU and its socket are
not modelled.
"""

from __future__ import annotations

from typing import Any

from .topology import Link, Topology

# GB/s per link and direction by NVLink generation (P100, V100, A100, H100, B200).
NVLINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# GB/s per lane and direction by PCIe generation (after 8b/10b or 128b/130b coding).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def _nvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("Topology.probe() needs nvidia-ml-py on a GPU machine: "
                           "pip install 'salusd[gpu]'") from exc
    return pynvml


def _bus(pci: Any) -> str:
    bus = pci.busId
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).lower()


def probe(socket_gbps: float = 10.0) -> Topology:
    """The NVLink and PCIe links of every GPU NVML sees (capacities in GB/s per direction)."""
    nvml = _nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise RuntimeError(f"NVML could not start ({exc}); is the NVIDIA driver loaded?") from exc
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        bus_to_gpu = {_bus(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        links: list[Link] = []
        switches: list[str] = []
        for i, h in enumerate(handles):
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    far = _bus(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link))
                    gbps = NVLINK_GBPS.get(nvml.nvmlDeviceGetNvLinkVersion(h, link), 25.0)
                except nvml.NVMLError:
                    continue  # link index not present on this GPU
                if far in bus_to_gpu:
                    links.append(Link(i, bus_to_gpu[far], gbps, "nvlink"))
                    continue
                name = f"nvswitch:{far}"
                if name not in switches:
                    switches.append(name)
                links += [Link(i, name, gbps, "nvlink"), Link(name, i, gbps, "nvlink")]
        sockets: list[list[int]] = []
        for i, h in enumerate(handles):
            for group in sockets:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(h, handles[group[0]])
                if level < nvml.NVML_TOPOLOGY_SYSTEM:
                    group.append(i)
                    break
            else:
                sockets.append([i])
        for k, group in enumerate(sockets):
            cpu = f"cpu{k}"
            switches.append(cpu)
            for i in group:
                gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(handles[i])
                width = nvml.nvmlDeviceGetCurrPcieLinkWidth(handles[i])
                gbps = PCIE_LANE_GBPS.get(gen, 0.985) * width
                links += [Link(i, cpu, gbps, "pcie"), Link(cpu, i, gbps, "pcie")]
        for a in range(len(sockets)):
            for b in range(len(sockets)):
                if a != b:
                    links.append(Link(f"cpu{a}", f"cpu{b}", socket_gbps, "pcie"))
        return Topology(range(len(handles)), links, switches, name="probed")
    finally:
        nvml.nvmlShutdown()
