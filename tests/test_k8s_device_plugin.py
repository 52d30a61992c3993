"""The device plugin of `salusd.io/gpu-mem` against a fake kubelet: a real gRPC `Registration`
server on a unix socket that records what registers, then dials the plugin back and drives
`ListAndWatch`, `GetPreferredAllocation` and `Allocate` as the kubelet does, and a fake
PodResources server that says which pods hold which units. The GPUs are made-up lists of
uuids and budgets (no GPU here); expected values are written out by hand from them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from daemon_proc import wait_until
from fake_nvml import FakeXidNvml

from salus.daemon.devices.discovery import DeviceSpec
from salus.daemon.k8s.plugin import GpuMemPlugin, PluginConfig, for_devices
from salus.daemon.k8s.third_party import deviceplugin_pb2 as dp
from salus.daemon.k8s.third_party import deviceplugin_pb2_grpc as dp_grpc
from salus.daemon.k8s.third_party import podresources_pb2 as pr
from salus.daemon.k8s.third_party import podresources_pb2_grpc as pr_grpc
from salus.daemon.k8s.units import GpuShare

GIB = 2**30
A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"
WAIT_S = 10.0


class FakeKubelet(dp_grpc.RegistrationServicer):
    """The kubelet's side: `Registration` on `<dir>/kubelet.sock`, and a client of the
    plugin's socket once it registered."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.requests: list[dp.RegisterRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        dp_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
        self.server.start()
        self.channels: list[grpc.Channel] = []

    def Register(self, request: dp.RegisterRequest, context: object) -> dp.Empty:
        self.requests.append(request)
        return dp.Empty()

    def dial(self) -> dp_grpc.DevicePluginStub:
        """The plugin the last registration named, as the kubelet reaches it."""
        channel = grpc.insecure_channel(f"unix://{self.dir / self.requests[-1].endpoint}")
        self.channels.append(channel)
        return dp_grpc.DevicePluginStub(channel)

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        self.server.stop(None).wait()
        (self.dir / "kubelet.sock").unlink(missing_ok=True)


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources `List`: `pods` maps "namespace/name" to its containers'
    (container name, resource name, device IDs)."""

    def __init__(self, socket: Path) -> None:
        self.pods: dict[str, list[tuple[str, str, list[str]]]] = {}
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def List(self, request: pr.ListPodResourcesRequest,
             context: object) -> pr.ListPodResourcesResponse:
        self.calls += 1
        pods = []
        for key, containers in dict(self.pods).items():
            namespace, name = key.split("/")
            pods.append(pr.PodResources(namespace=namespace, name=name, containers=[
                pr.ContainerResources(name=c, devices=[
                    pr.ContainerDevices(resource_name=r, device_ids=ids)])
                for c, r, ids in containers]))
        return pr.ListPodResourcesResponse(pod_resources=pods)

    def stop(self) -> None:
        self.server.stop(None).wait()


@pytest.fixture
def root() -> Iterator[Path]:
    """A short directory: a unix socket's path must fit in 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    (path / "device-plugins").mkdir()
    (path / "dev").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(root: Path, **changes: object) -> PluginConfig:
    values: dict[str, object] = dict(
        device_plugins_dir=root / "device-plugins", pod_resources_socket=root / "pr.sock",
        alloc_root=root / "alloc", state_dir=root / "state", dev=root / "dev", poll_s=0.05,
        pod_resources_every_s=3600.0)
    values.update(changes)
    return PluginConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def kubelet(root: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(root / "device-plugins")
    yield fake
    fake.stop()


@pytest.fixture
def plugins() -> Iterator[list[GpuMemPlugin]]:
    started: list[GpuMemPlugin] = []
    yield started
    for plugin in started:
        plugin.stop()


def start(plugins: list[GpuMemPlugin], gpus: list[GpuShare], cfg: PluginConfig,
          health: Callable[[str], bool] = lambda uuid: True) -> GpuMemPlugin:
    plugin = GpuMemPlugin(gpus, health, cfg)
    plugins.append(plugin)
    plugin.start()
    return plugin


def ids(uuid: str, *indices: int) -> list[str]:
    return [f"{uuid}::{i}" for i in indices]


def test_registers_then_advertises_every_gib_of_each_budget(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    # 3.5 GiB -> 3 units, 2 GiB and 100 bytes -> 2 units: whole GiB only
    start(plugins, [GpuShare(A, 3 * GIB + GIB // 2), GpuShare(B, 2 * GIB + 100)], config(root))
    (request,) = kubelet.requests  # registered in start(), the kubelet being there
    assert request.version == "v1beta1"
    assert request.resource_name == "salusd.io/gpu-mem"
    assert (root / "device-plugins" / request.endpoint).exists()
    assert request.options.get_preferred_allocation_available
    assert not request.options.pre_start_required

    stub = kubelet.dial()
    assert stub.GetDevicePluginOptions(dp.Empty(), timeout=5).get_preferred_allocation_available
    stream = stub.ListAndWatch(dp.Empty(), timeout=30)
    first = next(stream)
    assert sorted((d.ID, d.health) for d in first.devices) == sorted(
        [(i, "Healthy") for i in ids(A, 0, 1, 2) + ids(B, 0, 1)])
    stream.cancel()


def test_list_and_watch_sends_the_list_again_when_a_gpu_turns_unhealthy(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    healthy = {A: True, B: True}
    start(plugins, [GpuShare(A, 2 * GIB), GpuShare(B, 1 * GIB)], config(root),
          health=lambda uuid: healthy[uuid])
    stream = kubelet.dial().ListAndWatch(dp.Empty(), timeout=30)
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    healthy[B] = False
    update = {d.ID: d.health for d in next(stream).devices}
    assert update == {ids(A, 0)[0]: "Healthy", ids(A, 1)[0]: "Healthy",
                      ids(B, 0)[0]: "Unhealthy"}
    healthy[B] = True
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    stream.cancel()


def test_a_health_check_that_raises_reports_the_gpu_unhealthy(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    def health(uuid: str) -> bool:
        if uuid == B:
            raise RuntimeError("NVML lost the GPU")
        return True
    start(plugins, [GpuShare(A, GIB), GpuShare(B, GIB)], config(root), health=health)
    stream = kubelet.dial().ListAndWatch(dp.Empty(), timeout=30)
    assert {d.ID: d.health for d in next(stream).devices} == {
        ids(A, 0)[0]: "Healthy", ids(B, 0)[0]: "Unhealthy"}
    stream.cancel()


def preferred(stub: dp_grpc.DevicePluginStub, available: list[str], size: int,
              must: list[str] | None = None) -> list[str]:
    reply = stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                               must_include_deviceIDs=must or [],
                                               allocation_size=size)]), timeout=5)
    (answer,) = reply.container_responses
    return list(answer.deviceIDs)


def test_preferred_allocation_keeps_a_container_on_the_gpu_with_most_free_units(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    start(plugins, [GpuShare(A, 4 * GIB), GpuShare(B, 6 * GIB)], config(root))
    stub = kubelet.dial()
    # free: all 4 of A, 3 of B's 6 (B::0, B::2, B::4 are taken), listed interleaved
    free = [*ids(B, 5), *ids(A, 3, 0), *ids(B, 1, 3), *ids(A, 2, 1)]
    assert preferred(stub, free, 3) == ids(A, 0, 1, 2)  # both fit: A has more free
    assert preferred(stub, free, 4) == ids(A, 0, 1, 2, 3)  # only A fits
    only_b_fits = [*ids(A, 0), *ids(B, 1, 3, 5)]
    assert preferred(stub, only_b_fits, 2) == ids(B, 1, 3)
    # B::5 must be in it: the rest comes from B, though A has more free
    assert preferred(stub, free, 2, must=ids(B, 5)) == ids(B, 5, 1)
    # 5 fit on no GPU: the answer spans them, the fuller one first
    assert preferred(stub, free, 5) == [*ids(A, 0, 1, 2, 3), *ids(B, 1)]


def allocate(stub: dp_grpc.DevicePluginStub, *containers: list[str]) -> dp.AllocateResponse:
    return stub.Allocate(dp.AllocateRequest(container_requests=[
        dp.ContainerAllocateRequest(devices_ids=c) for c in containers]), timeout=5)


def test_allocate_grants_device_nodes_a_directory_of_its_own_and_the_address(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    for node in ("nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools
        (root / "dev" / node).touch()
    plugin = start(plugins, [GpuShare(A, 4 * GIB, minor=0), GpuShare(B, 8 * GIB, minor=1)],
                   config(root))
    units = ids(B, 2, 3, 7)
    (reply,) = allocate(kubelet.dial(), units).container_responses

    assert sorted((d.container_path, d.host_path, d.permissions) for d in reply.devices) == [
        ("/dev/nvidia-uvm", str(root / "dev" / "nvidia-uvm"), "rw"),
        ("/dev/nvidia1", str(root / "dev" / "nvidia1"), "rw"),
        ("/dev/nvidiactl", str(root / "dev" / "nvidiactl"), "rw")]
    (mount,) = reply.mounts
    assert mount.container_path == "/run/salusd" and not mount.read_only
    directory = Path(mount.host_path)
    assert directory.parent == root / "alloc" and directory.is_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    assert reply.envs["SALUS_ADDRESS"] == "unix:///run/salusd/salusd.sock"
    assert reply.envs["NVIDIA_VISIBLE_DEVICES"] == B
    assert "CUDA_MPS_PIPE_DIRECTORY" not in reply.envs
    granted = json.loads(reply.envs["SALUS_GRANT"])
    assert granted == {"allocation": directory.name, "uuid": B, "units": 3,
                       "unit_bytes": GIB}

    (row,) = plugin.allocations()
    assert (row.id, row.uuid, row.units, row.directory) == (directory.name, B, 3,
                                                            str(directory))
    assert sorted(row.device_ids) == sorted(units) and row.pod is None
    recorded = json.loads((root / "state" / "k8s-allocations.json").read_text())
    assert [(r["id"], r["uuid"], sorted(r["device_ids"])) for r in recorded["allocations"]] \
        == [(directory.name, B, sorted(units))]


def test_allocations_survive_a_restart_of_the_plugin(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    gpus = [GpuShare(A, 4 * GIB)]
    first = start(plugins, gpus, config(root))
    reply = allocate(kubelet.dial(), ids(A, 0), ids(A, 1, 2))
    made = sorted(Path(r.mounts[0].host_path).name for r in reply.container_responses)
    first.stop()
    plugins.remove(first)
    again = start(plugins, gpus, config(root))
    assert sorted(a.id for a in again.allocations()) == made
    assert sorted(a.units for a in again.allocations()) == [1, 2]
    assert len(kubelet.requests) == 2  # the new process registered too


def test_allocate_with_mps_grants_the_pipe_directory_and_shared_memory(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    pipe = root / "mps" / A / "pipe"
    start(plugins, [GpuShare(A, 2 * GIB), GpuShare(B, 2 * GIB)],
          config(root, mps_pipes={A: str(pipe)}))
    stub = kubelet.dial()
    (on_a,) = allocate(stub, ids(A, 1)).container_responses
    assert sorted((m.container_path, m.host_path) for m in on_a.mounts)[:2] == [
        ("/dev/shm", "/dev/shm"), ("/run/nvidia-mps", str(pipe))]
    assert on_a.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"
    (on_b,) = allocate(stub, ids(B, 0)).container_responses  # B's MPS did not start
    assert [m.container_path for m in on_b.mounts] == ["/run/salusd"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in on_b.envs


def test_allocate_refuses_units_of_two_gpus_or_unknown_ones_and_grants_nothing(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, 2 * GIB), GpuShare(B, 2 * GIB)], config(root))
    stub = kubelet.dial()
    for request, words in (([ids(A, 0), [*ids(A, 1), *ids(B, 0)]], "one GPU"),
                           ([ids(A, 2)], "no such"),
                           ([["GPU-cccc::0"]], "not a GPU of this salusd"),
                           ([["nvidia0"]], "not a salusd.io/gpu-mem unit")):
        with pytest.raises(grpc.RpcError) as caught:
            allocate(stub, *request)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words in caught.value.details()
    assert plugin.allocations() == []
    assert list((root / "alloc").iterdir()) == []


def test_units_given_again_supersede_the_allocation_that_held_them(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, 4 * GIB)], config(root))
    stub = kubelet.dial()
    old = Path(allocate(stub, ids(A, 0, 1)).container_responses[0].mounts[0].host_path)
    new = Path(allocate(stub, ids(A, 1, 2)).container_responses[0].mounts[0].host_path)
    assert [a.id for a in plugin.allocations()] == [new.name]
    assert not old.exists() and new.is_dir()


@pytest.mark.parametrize("kubelet_empties_the_dir", [True, False])
def test_a_restarted_kubelet_brings_a_new_registration(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin],
        kubelet_empties_the_dir: bool) -> None:
    plugin = start(plugins, [GpuShare(A, 2 * GIB)], config(root))
    assert len(kubelet.requests) == 1
    kubelet.stop()  # kubelet.sock deleted
    if kubelet_empties_the_dir:  # as a real kubelet does at start
        for path in (root / "device-plugins").iterdir():
            path.unlink()
    time.sleep(0.2)  # a few of the plugin's polls see no kubelet
    restarted = FakeKubelet(root / "device-plugins")
    try:
        # The kubelet holds the request before the plugin's Register call returns
        # and counts it: wait for the count, not for the request.
        wait_until(lambda: plugin.registrations == 2, WAIT_S, "the plugin to register again")
        assert restarted.requests[0].resource_name == "salusd.io/gpu-mem"
        stream = restarted.dial().ListAndWatch(dp.Empty(), timeout=30)
        assert sorted(d.ID for d in next(stream).devices) == ids(A, 0, 1)
        stream.cancel()
        time.sleep(0.3)
        assert len(restarted.requests) == 1  # once per kubelet, not once per poll
    finally:
        restarted.stop()


def test_a_plugin_started_before_the_kubelet_registers_when_it_comes(
        root: Path, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, GIB)], config(root))
    assert plugin.registrations == 0
    late = FakeKubelet(root / "device-plugins")
    try:
        wait_until(lambda: late.requests, WAIT_S, "the plugin to register")
    finally:
        late.stop()


def test_pod_resources_name_each_allocation_and_free_those_whose_pod_is_gone(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    pods = FakePodResources(root / "pr.sock")
    try:
        plugin = start(plugins, [GpuShare(A, 4 * GIB), GpuShare(B, 4 * GIB)],
                       config(root, unlisted_grace_s=3600.0))
        stub = kubelet.dial()
        replies = allocate(stub, ids(A, 0, 1), ids(B, 3)).container_responses
        train, sidecar = (Path(r.mounts[0].host_path) for r in replies)
        pods.pods = {"ml/train-0": [("main", "salusd.io/gpu-mem", ids(A, 0, 1)),
                                    ("side", "salusd.io/gpu-mem", ids(B, 3))],
                     "other/x": [("c", "nvidia.com/gpu", ids(A, 2))]}
        plugin.reconcile()
        rows = {a.id: (a.pod, a.container) for a in plugin.allocations()}
        assert rows == {train.name: ("ml/train-0", "main"), sidecar.name: ("ml/train-0", "side")}

        # another resource naming the same IDs does not keep an allocation alive
        pods.pods = {"other/x": [("c", "nvidia.com/gpu", ids(B, 3))],
                     "ml/train-0": [("main", "salusd.io/gpu-mem", ids(A, 0, 1))]}
        plugin.reconcile()
        assert [a.id for a in plugin.allocations()] == [train.name]
        assert not sidecar.exists() and train.is_dir()
        recorded = json.loads((root / "state" / "k8s-allocations.json").read_text())
        assert [r["id"] for r in recorded["allocations"]] == [train.name]
    finally:
        pods.stop()


def test_an_allocation_never_listed_is_freed_after_the_grace_only(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    pods = FakePodResources(root / "pr.sock")
    try:
        plugin = start(plugins, [GpuShare(A, 2 * GIB)], config(root, unlisted_grace_s=1.0))
        allocate(kubelet.dial(), ids(A, 0))
        plugin.reconcile()
        assert len(plugin.allocations()) == 1  # the pod may not be listed yet
        time.sleep(1.1)
        plugin.reconcile()
        assert plugin.allocations() == [] and list((root / "alloc").iterdir()) == []
    finally:
        pods.stop()


def test_nothing_is_freed_while_the_pod_resources_api_does_not_answer(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, 2 * GIB)], config(root, unlisted_grace_s=0.0))
    allocate(kubelet.dial(), ids(A, 0))
    plugin.reconcile()  # no server on pr.sock
    assert len(plugin.allocations()) == 1


def test_the_plugin_lists_pods_by_itself_every_interval(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    pods = FakePodResources(root / "pr.sock")
    try:
        plugin = start(plugins, [GpuShare(A, 2 * GIB)],
                       config(root, pod_resources_every_s=0.1, unlisted_grace_s=3600.0))
        (reply,) = allocate(kubelet.dial(), ids(A, 1)).container_responses
        pods.pods = {"ns/p": [("c", "salusd.io/gpu-mem", ids(A, 1))]}
        wait_until(lambda: [a.pod for a in plugin.allocations()] == ["ns/p"], WAIT_S,
                   "the allocation to be matched to pod ns/p")
        pods.pods = {}
        wait_until(lambda: plugin.allocations() == [], WAIT_S, "the allocation to go")
        assert not Path(reply.mounts[0].host_path).exists()
        assert pods.calls >= 2
    finally:
        pods.stop()


def test_stop_ends_the_watch_streams_and_removes_the_socket(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, GIB)], config(root))
    stream = kubelet.dial().ListAndWatch(dp.Empty(), timeout=30)
    next(stream)

    def drain() -> None:
        with contextlib.suppress(grpc.RpcError):  # the stream may end cancelled
            for _ in stream:
                pass
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    plugin.stop()
    plugins.remove(plugin)
    assert not plugin.socket.exists()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert not any(t.name == "salusd-device-plugin" for t in threading.enumerate())
    assert os.listdir(root / "device-plugins") == ["kubelet.sock"]


class NoNvml:
    """NVML on a host whose driver is not loaded."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")


def two_gpus(root: Path) -> tuple[Path, list[DeviceSpec]]:
    """GPUs A (minor 4, 2 GiB budget) and B (minor 6, 3 GiB): the driver's /proc files under
    root/proc, their device nodes under root/dev, and the daemon's devices."""
    proc = root / "proc"
    for bus, uuid, minor in (("0000:18:00.0", A, 4), ("0000:2a:00.0", B, 6)):
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(f"GPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
    for node in ("nvidia4", "nvidia6", "nvidiactl"):
        (root / "dev" / node).touch()
    return proc, [DeviceSpec(0, "cuda", "cuda:0", "H200", 2 * GIB + 5, uuid=A),
                  DeviceSpec(1, "cuda", "cuda:1", "H200", 3 * GIB, uuid=B)]


def test_the_daemons_gpus_become_units_and_a_vanished_node_makes_its_gpu_unhealthy(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    proc, devices = two_gpus(root)
    plugin = for_devices(devices, root, root / "alloc", root / "state",
                         {B: str(root / "pipe-b")}, nvml=NoNvml(), proc=proc, dev=root / "dev")
    assert plugin is not None
    assert plugin.config.pod_resources_socket == root / "pod-resources" / "kubelet.sock"
    plugins.append(plugin)
    plugin.start()
    stub = kubelet.dial()
    stream = stub.ListAndWatch(dp.Empty(), timeout=30)
    assert sorted(d.ID for d in next(stream).devices) == [*ids(A, 0, 1), *ids(B, 0, 1, 2)]
    (reply,) = allocate(stub, ids(B, 2)).container_responses
    assert sorted(d.container_path for d in reply.devices) == ["/dev/nvidia6", "/dev/nvidiactl"]
    assert reply.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"

    (root / "dev" / "nvidia4").unlink()  # the driver lost A
    health = {d.ID: d.health for d in next(stream).devices}
    assert health == {**dict.fromkeys(ids(A, 0, 1), "Unhealthy"),
                      **dict.fromkeys(ids(B, 0, 1, 2), "Healthy")}
    stream.cancel()
    assert for_devices([], root, root / "alloc", None, None) is None


def test_a_critical_xid_reported_by_nvml_makes_that_gpus_units_unhealthy(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    """The daemon's plugin watches NVML's Xid events (a stand-in NVML here): a critical Xid
    on A reaches the kubelet as A's units Unhealthy, B's staying Healthy."""
    proc, devices = two_gpus(root)
    nvml = FakeXidNvml({A: 0x8, B: 0x8})
    plugin = for_devices(devices, root, root / "alloc", root / "state", None, nvml=nvml,
                         proc=proc, dev=root / "dev")
    assert plugin is not None
    plugins.append(plugin)
    plugin.start()
    stream = kubelet.dial().ListAndWatch(dp.Empty(), timeout=30)
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    nvml.xid(A, 79)
    health = {d.ID: d.health for d in next(stream).devices}
    assert health == {**dict.fromkeys(ids(A, 0, 1), "Unhealthy"),
                      **dict.fromkeys(ids(B, 0, 1, 2), "Healthy")}
    stream.cancel()
    plugin.stop()
    assert nvml.freed == 1  # the event set goes with the plugin


def test_an_allocation_that_cannot_be_recorded_is_refused_and_leaves_nothing(
        root: Path, kubelet: FakeKubelet, plugins: list[GpuMemPlugin]) -> None:
    plugin = start(plugins, [GpuShare(A, 2 * GIB)], config(root))
    (root / "state" / "k8s-allocations.tmp").mkdir()  # the table's file cannot be written
    with pytest.raises(grpc.RpcError) as caught:
        allocate(kubelet.dial(), ids(A, 0), ids(A, 1))
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "k8s-allocations.tmp" in caught.value.details()
    assert plugin.allocations() == [] and list((root / "alloc").iterdir()) == []
