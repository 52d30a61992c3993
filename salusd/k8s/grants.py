"""What `Allocate` puts into a container for its units of one GPU: the GPU's device nodes, a
mount of the allocation's own directory at /run/salusd, the MPS pipe directory and /dev/shm
when salusd runs MPS on that GPU, and the environment that names them.

Plain data: `plugin.py` turns a `Grant` into the kubelet's `ContainerAllocateResponse`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from salus.daemon.k8s.allocations import Allocation
from salus.daemon.k8s.units import UNIT_BYTES, GpuShare

CONTAINER_DIR = "/run/salusd"  # where the allocation's directory is mounted in the container
CONTAINER_SOCKET = f"{CONTAINER_DIR}/salusd.sock"
CONTAINER_MPS_PIPE = "/run/nvidia-mps"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")  # granted when they exist


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class Node:
    """A device node: its path in the container, on the host, and cgroup permissions."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Grant:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[Node] = field(default_factory=list)


def grant_text(allocation: Allocation) -> str:
    """`SALUS_GRANT`: JSON naming the allocation, its GPU and its units (GiB)."""
    return json.dumps({"allocation": allocation.id, "uuid": allocation.uuid,
                       "units": allocation.units, "unit_bytes": UNIT_BYTES},
                      separators=(",", ":"))


def grant(allocation: Allocation, gpu: GpuShare, *, dev: Path = Path("/dev"),
          mps_pipe: str | None = None) -> Grant:
    """The grant of `allocation` (units of `gpu`). `dev`: where the host's device nodes are
    (nodes that do not exist there are not granted); `mps_pipe`: the host directory of the
    GPU's MPS control daemon, None when salusd runs no MPS on it."""
    names = ([] if gpu.minor is None else [f"nvidia{gpu.minor}"]) + list(CONTROL_NODES)
    devices = [Node(f"/dev/{name}", str(dev / name)) for name in names
               if (dev / name).exists()]
    mounts = [Mount(CONTAINER_DIR, allocation.directory)]
    envs = {"SALUS_ADDRESS": f"unix://{CONTAINER_SOCKET}",
            "SALUS_GRANT": grant_text(allocation),
            # the NVIDIA container runtime, where it is the node's, brings this GPU's driver
            # libraries (and nothing of the other GPUs) into the container
            "NVIDIA_VISIBLE_DEVICES": allocation.uuid}
    if mps_pipe is not None:
        mounts += [Mount(CONTAINER_MPS_PIPE, mps_pipe), Mount("/dev/shm", "/dev/shm")]
        envs["CUDA_MPS_PIPE_DIRECTORY"] = CONTAINER_MPS_PIPE
    return Grant(envs, mounts, devices)
