"""A client of the kubelet's PodResources API v1 (`List`): which pod and container hold each
device ID of a resource.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from salus.daemon.k8s.third_party import podresources_pb2 as pb
from salus.daemon.k8s.third_party import podresources_pb2_grpc as pb_grpc

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass(frozen=True)
class PodRef:
    """A container of a pod: the pod as "namespace/name", and the container's name."""

    pod: str
    container: str


class PodResourcesClient:
    """Calls `List` on the kubelet's socket (`socket`), each call within `timeout_s` seconds.
    The channel reconnects by itself when the kubelet restarts."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._stub = pb_grpc.PodResourcesListerStub(self._channel)

    def holders(self, resource: str) -> dict[str, PodRef]:
        """Device ID -> the container holding it, for every device of `resource` the kubelet
        lists. Raises grpc.RpcError when the kubelet does not answer."""
        reply = self._stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout_s)
        found: dict[str, PodRef] = {}
        for pod in reply.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name != resource:
                        continue
                    for device_id in devices.device_ids:
                        found[device_id] = PodRef(f"{pod.namespace}/{pod.name}",
                                                  container.name)
        return found

    def close(self) -> None:
        self._channel.close()
