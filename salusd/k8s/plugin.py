"""The kubelet device plugin of `salusd.io/gpu-mem`, served from inside salusd.

Lifecycle (the kubelet's device plugin protocol, v1beta1): serve `DevicePlugin` on a unix
socket in the kubelet's device-plugins dir, then `Register` on the kubelet's `kubelet.sock`
there; the kubelet dials back, reads the options and keeps a `ListAndWatch` stream open, which
gets the whole unit list again whenever a GPU's health changes. A restarted kubelet makes a
new `kubelet.sock` (and empties the dir): one thread polls the socket's identity every
`poll_s` seconds, serves again if the plugin's own socket went, and registers again. The same
thread asks the daemon's health callable about every GPU, and every `pod_resources_every_s`
seconds lists the kubelet's pods (PodResources) to name each allocation's pod and free the
allocations whose pod is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from salus.daemon.devices.discovery import DeviceSpec, _import_nvml
from salus.daemon.k8s.allocations import FILE_NAME, Allocation, AllocationTable
from salus.daemon.k8s.gpus import PROC_GPUS, node_present, shares
from salus.daemon.k8s.grants import Grant, grant
from salus.daemon.k8s.health import gpu_health
from salus.daemon.k8s.podresources import DEFAULT_SOCKET, PodResourcesClient
from salus.daemon.k8s.third_party import deviceplugin_pb2 as pb
from salus.daemon.k8s.third_party import deviceplugin_pb2_grpc as pb_grpc
from salus.daemon.k8s.units import (
    RESOURCE,
    UNIT_BYTES,
    GpuShare,
    by_gpu,
    preferred,
    unit_ids,
)

log = logging.getLogger("salusd.k8s")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"

Health = Callable[[str], bool]  # GPU uuid -> healthy


class AllocationListener(Protocol):
    """Told of every allocation's life, from the plugin's threads (`pod_sockets.PodSockets`
    listens on each one's socket)."""

    def opened(self, allocation: Allocation) -> None: ...

    def named(self, allocation_id: str, pod: str) -> None: ...

    def freed(self, allocation: Allocation, why: str) -> None: ...


@dataclass(frozen=True)
class PluginConfig:
    """Where the plugin meets the kubelet and where it keeps its grants (paths on the host;
    seconds)."""

    device_plugins_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = DEFAULT_SOCKET
    alloc_root: Path = Path("/run/salusd/alloc")  # one directory per allocation, under it
    state_dir: Path | None = None  # where the allocation table is kept (None: memory only)
    endpoint: str = "salusd-gpu-mem.sock"  # the plugin's socket, in device_plugins_dir
    mps_pipes: Mapping[str, str] | None = None  # GPU uuid -> MPS pipe dir; None: no MPS
    dev: Path = Path("/dev")
    poll_s: float = 1.0
    pod_resources_every_s: float = 10.0
    unlisted_grace_s: float = 60.0  # an allocation no pod was ever listed with is freed after
    register_timeout_s: float = 5.0


class GpuMemPlugin:
    """The plugin over `gpus` (their units, from their budgets), healthy as `health` says.
    `start()` serves and registers and returns; `stop()` ends it all."""

    def __init__(self, gpus: Sequence[GpuShare], health: Health, config: PluginConfig) -> None:
        if not gpus:
            raise ValueError("the device plugin needs at least one GPU")
        self.gpus = {g.uuid: g for g in gpus}
        self.health = health
        self.config = config
        self.table = AllocationTable(
            None if config.state_dir is None else config.state_dir / FILE_NAME)
        self.registrations = 0  # successful Register calls, for tests and logs
        self._healthy = {u: True for u in self.gpus}
        self._version = 0  # bumped at every change of the device list
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._server: Any = None
        self._registered: tuple[int, int] | None = None  # kubelet.sock's (inode, ctime)
        self._register_failed: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._pods: PodResourcesClient | None = None
        self._pods_failing = False
        self.listener: AllocationListener | None = None  # set before start()

    @property
    def socket(self) -> Path:
        return self.config.device_plugins_dir / self.config.endpoint

    def start(self) -> None:
        """Serve the plugin's socket, register if the kubelet is there (else as soon as it
        is), and start the watching thread."""
        self.config.alloc_root.mkdir(parents=True, exist_ok=True)
        # root's alone: an allocation's socket serves whoever reaches it, so only the pod it is
        # mounted in may (a bind mount is reached through its own directory, 0755, never
        # through this one); on the node, root only, whoever knows the (random) id
        os.chmod(self.config.alloc_root, 0o700)
        if self.config.state_dir is not None:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self._poll_health()
        if self.listener is not None:  # allocations restored from the table
            for allocation in self.table.all():
                self.listener.opened(allocation)
        self._serve()
        self._pods = PodResourcesClient(self.config.pod_resources_socket)
        self._watch_kubelet()
        self._thread = threading.Thread(target=self._run, name="salusd-device-plugin",
                                        daemon=True)
        self._thread.start()
        log.info("device plugin %s: %d GiB units on %d GPU(s), socket %s", RESOURCE,
                 sum(g.units for g in self.gpus.values()), len(self.gpus), self.socket)

    def stop(self) -> None:
        """Stop watching, end the ListAndWatch streams and stop serving (the kubelet then
        takes the resource's units off the node); allocations stay recorded."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
            self._server = None
        if self._pods is not None:
            self._pods.close()
        close = getattr(self.health, "close", None)
        if close is not None:  # `health.XidHealth` holds NVML's event set
            close()
        self.socket.unlink(missing_ok=True)

    def allocations(self) -> list[Allocation]:
        """Every allocation granted and not yet freed, oldest first."""
        return self.table.all()

    def devices(self) -> list[pb.Device]:
        """The unit list ListAndWatch sends: every unit, healthy as its GPU is."""
        return [pb.Device(ID=device_id, health=HEALTHY if self._healthy[g.uuid] else UNHEALTHY)
                for g in self.gpus.values() for device_id in unit_ids(g)]

    # -- serving and registering

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
        self.config.device_plugins_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)  # left by an earlier salusd
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8,
                                                        thread_name_prefix="salusd-dp"))
        pb_grpc.add_DevicePluginServicer_to_server(Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def _register(self) -> None:
        kubelet = self.config.device_plugins_dir / KUBELET_SOCKET
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            pb_grpc.RegistrationStub(channel).Register(pb.RegisterRequest(
                version=API_VERSION, endpoint=self.config.endpoint, resource_name=RESOURCE,
                options=options()), timeout=self.config.register_timeout_s)

    def _watch_kubelet(self) -> None:
        """Register with the kubelet whose socket is there now, once per socket: a new
        kubelet.sock is a restarted kubelet, which has also removed the plugin's socket."""
        try:
            st = os.stat(self.config.device_plugins_dir / KUBELET_SOCKET)
        except FileNotFoundError:
            return
        ident = (st.st_ino, st.st_ctime_ns)
        if ident == self._registered:
            return
        if not self.socket.exists():
            log.info("the plugin's socket %s is gone: serving it again", self.socket)
            self._serve()
        try:
            self._register()
        except grpc.RpcError as exc:
            if ident != self._register_failed:  # once per kubelet socket, not every second
                log.error("registering %s with the kubelet failed: %s", RESOURCE,
                          exc.details() if hasattr(exc, "details") else exc)
                self._register_failed = ident
            return
        self._registered = ident
        self.registrations += 1
        log.info("registered %s with the kubelet (%s)", RESOURCE,
                 "first time" if self.registrations == 1 else "the kubelet restarted")

    # -- the watching thread

    def _run(self) -> None:
        next_pods = 0.0
        while not self._stop.wait(self.config.poll_s):
            try:
                self._watch_kubelet()
                self._poll_health()
                if time.monotonic() >= next_pods:
                    next_pods = time.monotonic() + self.config.pod_resources_every_s
                    self.reconcile()
            except Exception:  # the thread must outlive any one bad tick
                log.exception("the device plugin's watch failed; trying again")

    def _poll_health(self) -> None:
        now = {}
        for uuid in self.gpus:
            try:
                now[uuid] = bool(self.health(uuid))
            except Exception as exc:
                log.warning("health of %s unknown (%s): reported Unhealthy", uuid, exc)
                now[uuid] = False
        if now != self._healthy:
            for uuid in now:
                if now[uuid] != self._healthy[uuid]:
                    log.warning("%s is now %s", uuid, HEALTHY if now[uuid] else UNHEALTHY)
            with self._changed:
                self._healthy = now
                self._version += 1
                self._changed.notify_all()

    def reconcile(self) -> None:
        """Name each allocation's pod from the kubelet's PodResources `List`, and free the
        allocations whose pod is gone: listed before and not now, or never listed within
        `unlisted_grace_s` of its `Allocate`. Nothing is freed when the kubelet does not
        answer."""
        assert self._pods is not None, "start() first"
        try:
            holders = self._pods.holders(RESOURCE)
        except grpc.RpcError as exc:
            if not self._pods_failing:
                log.warning("the kubelet's PodResources API (%s) does not answer: %s; "
                            "allocations are kept until it does", self._pods.socket,
                            exc.details() if hasattr(exc, "details") else exc)
                self._pods_failing = True
            return
        self._pods_failing = False
        now = time.time()
        for allocation in self.table.all():
            refs = [holders[d] for d in allocation.device_ids if d in holders]
            if refs:
                self.table.name_pod(allocation.id, refs[0].pod, refs[0].container)
                if self.listener is not None and allocation.pod != refs[0].pod:
                    self.listener.named(allocation.id, refs[0].pod)
            elif allocation.pod is not None:
                self._free(allocation, f"its pod {allocation.pod} is gone")
            elif now - allocation.created >= self.config.unlisted_grace_s:
                self._free(allocation, f"no pod held its units within "
                           f"{self.config.unlisted_grace_s:g} s")

    def _free(self, allocation: Allocation, why: str) -> None:
        # The directory first: once the table no longer lists the allocation, nothing of it
        # is left on the node.
        self._remove_directory(allocation)
        self.table.remove(allocation.id)
        if self.listener is not None:
            self.listener.freed(allocation, why)
        log.info("allocation %s (%d GiB of %s) freed: %s", allocation.id, allocation.units,
                 allocation.uuid, why)

    def _remove_directory(self, allocation: Allocation) -> None:
        directory = Path(allocation.directory)
        if directory.parent != self.config.alloc_root:  # never outside the plugin's root
            log.error("allocation %s names %s, outside %s: left in place", allocation.id,
                      directory, self.config.alloc_root)
            return
        shutil.rmtree(directory, ignore_errors=True)

    # -- what the servicer asks

    def watch(self, active: Callable[[], bool]) -> Iterator[pb.ListAndWatchResponse]:
        """The unit list now, then again after every change, while `active()` and not
        stopped."""
        seen = -1
        while active() and not self._stop.is_set():
            with self._changed:
                if self._version == seen:  # a second at most, to notice the kubelet leave
                    self._changed.wait(timeout=1.0)
                version = self._version
            if version != seen and not self._stop.is_set():
                seen = version
                yield pb.ListAndWatchResponse(devices=self.devices())

    def allocate(self, requests: Sequence[Sequence[str]]) -> list[tuple[Allocation, Grant]]:
        """One allocation per container request (its unit IDs), each in a new directory
        under the allocation root. ValueError says why a request cannot be granted; then
        nothing is granted."""
        checked = [self._check(ids) for ids in requests]
        made: list[tuple[Allocation, Grant]] = []
        try:
            for gpu, ids in checked:
                allocation = self._new_allocation(gpu, ids)
                pipe = None if self.config.mps_pipes is None else self.config.mps_pipes.get(
                    gpu.uuid)
                made.append((allocation, grant(allocation, gpu, dev=self.config.dev,
                                               mps_pipe=pipe)))
            superseded = self.table.add([allocation for allocation, _ in made])
        except OSError:
            for allocation, _ in made:
                self._remove_directory(allocation)
            raise
        for old in superseded:
            self._remove_directory(old)
            if self.listener is not None:
                self.listener.freed(old, "the kubelet gave its units again")
            log.info("allocation %s superseded (the kubelet gave its units again)", old.id)
        for allocation, _ in made:
            if self.listener is not None:
                self.listener.opened(allocation)
            log.info("allocated %s: %d GiB of %s, directory %s", allocation.id,
                     allocation.units, allocation.uuid, allocation.directory)
        return made

    def _check(self, ids: Sequence[str]) -> tuple[GpuShare, tuple[str, ...]]:
        if not ids:
            raise ValueError(f"a container asked for no {RESOURCE} units")
        groups = by_gpu(ids)
        if len(groups) != 1:
            raise ValueError(f"a container's {RESOURCE} units must all be on one GPU, these "
                             f"are on {len(groups)} ({', '.join(groups)}): no GPU had "
                             f"{len(ids)} GiB free")
        (uuid, units), = groups.items()
        gpu = self.gpus.get(uuid)
        if gpu is None:
            raise ValueError(f"{uuid} is not a GPU of this salusd")
        known = set(unit_ids(gpu))
        unknown = [d for d in units if d not in known]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: no such {RESOURCE} unit here")
        return gpu, tuple(units)

    def _new_allocation(self, gpu: GpuShare, ids: tuple[str, ...]) -> Allocation:
        allocation_id = uuidlib.uuid4().hex[:16]
        directory = self.config.alloc_root / allocation_id
        directory.mkdir(mode=0o755)
        os.chmod(directory, 0o755)  # whatever the umask: the pod's users reach the socket
        return Allocation(allocation_id, gpu.uuid, ids, str(directory), time.time())


def for_devices(devices: Sequence[DeviceSpec], kubelet_dir: Path, alloc_root: Path,
                state_dir: Path | None, mps_pipes: Mapping[str, str] | None, *,
                nvml: Any | None = None, proc: Path = PROC_GPUS,
                dev: Path = Path("/dev")) -> GpuMemPlugin | None:
    """The plugin of a daemon's devices, not started: its CUDA devices' budgets in units,
    healthy as `health.gpu_health` says (device node, NVML, critical Xids), meeting the
    kubelet under `kubelet_dir`
    (device-plugins/ and pod-resources/kubelet.sock). None when there is no GPU. `nvml`,
    `proc`, `dev`: where GPU facts are read (see `gpus.py`)."""
    gpus = shares(devices, nvml=nvml, proc=proc)
    if not gpus:
        return None
    config = PluginConfig(device_plugins_dir=kubelet_dir / "device-plugins",
                          pod_resources_socket=kubelet_dir / "pod-resources" / "kubelet.sock",
                          alloc_root=alloc_root, state_dir=state_dir, mps_pipes=mps_pipes,
                          dev=dev)
    nvml = nvml if nvml is not None else _import_nvml()
    return GpuMemPlugin(gpus, gpu_health(gpus, nvml, node_present(gpus, dev)), config)


def for_test_gpus(gpus: Sequence[str], kubelet_dir: Path, alloc_root: Path,
                  state_dir: Path | None) -> GpuMemPlugin:
    """The plugin over made-up GPUs ("GPU-uuid=GiB" each, always healthy, no device node),
    for tests of the daemon's pod sockets on a host without a GPU: their allocations are
    served on device 0 (`pod_sockets.PodSockets`). ValueError for a malformed entry."""
    shares_ = []
    for text in gpus:
        uuid, sep, gib = text.partition("=")
        if not sep or not uuid.startswith("GPU-") or not gib.isdigit() or int(gib) < 1:
            raise ValueError(f"a test GPU is 'GPU-<uuid>=<GiB>', not {text!r}")
        shares_.append(GpuShare(uuid, int(gib) * UNIT_BYTES))
    config = PluginConfig(device_plugins_dir=kubelet_dir / "device-plugins",
                          pod_resources_socket=kubelet_dir / "pod-resources" / "kubelet.sock",
                          alloc_root=alloc_root, state_dir=state_dir)
    return GpuMemPlugin(shares_, lambda uuid: True, config)


def options() -> pb.DevicePluginOptions:
    return pb.DevicePluginOptions(pre_start_required=False,
                                  get_preferred_allocation_available=True)


class Servicer(pb_grpc.DevicePluginServicer):
    """The gRPC face of a `GpuMemPlugin`: messages in, the plugin's answers out."""

    def __init__(self, plugin: GpuMemPlugin) -> None:
        self.plugin = plugin

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return options()

    def ListAndWatch(self, request: pb.Empty,
                     context: Any) -> Iterator[pb.ListAndWatchResponse]:
        yield from self.plugin.watch(context.is_active)

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: Any) -> pb.PreferredAllocationResponse:
        try:
            answers = [preferred(list(r.available_deviceIDs),
                                 list(r.must_include_deviceIDs), r.allocation_size)
                       for r in request.container_requests]
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.PreferredAllocationResponse(container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers])

    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        try:
            made = self.plugin.allocate([list(r.devices_ids) for r in request.container_requests])
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OSError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"salusd could not make the allocation "
                          f"(its directory under {self.plugin.config.alloc_root}, or its record "
                          f"in the state dir): {exc}")
        return pb.AllocateResponse(container_responses=[_response(g) for _, g in made])

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()  # not asked for (pre_start_required is false)


def _response(g: Grant) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=g.envs,
        mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path,
                         read_only=m.read_only) for m in g.mounts],
        devices=[pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path,
                               permissions=d.permissions) for d in g.devices])
