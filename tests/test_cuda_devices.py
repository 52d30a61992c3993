"""CUDA devices by UUID (`salusd/devices/discovery.py`) and one executor's cost
(`salusd/devices/context_cost.py`).

On the CPU, NVML is a stand-in object with nvidia-ml-py's function names and return shapes, and
the `torch.cuda` probe's subprocess is a stand-in `run` that returns what the probe prints. The
`cuda`-marked tests run the real ones on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from salus.daemon.devices.context_cost import (
    CPU_EXECUTOR_BYTES,
    GPU_CONTEXT_ESTIMATE_BYTES,
    context_bytes,
    executor_cost,
)
from salus.daemon.devices.discovery import (
    CudaProbeError,
    DeviceSpec,
    cpu_devices,
    cuda_devices,
    nvml_devices,
    parse_probe,
    probe_cuda_devices,
    visible_uuids,
)
from salus.daemon.memory.reserve import blas_workspace_reserved

GIB = 2**30
A, B, C = ("GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
           "GPU-cccc3333-0000-0000-0000-000000000000")


class NVMLError(Exception):
    pass


@dataclass
class FakeNvml:
    """nvidia-ml-py's calls the daemon makes, over `gpus`: (uuid, name, total, used, processes)
    in NVML's (PCI bus) order; names and UUIDs as bytes, as nvidia-ml-py before 11.515 gives."""

    gpus: list[tuple[str, str, int, int, list[tuple[int, int | None]]]]
    starts: bool = True
    calls: list[str] = field(default_factory=list)
    NVMLError: type[Exception] = NVMLError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if not self.starts:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.gpus[handle][0].encode()

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self.gpus[handle][1].encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        _, _, total, used, _ = self.gpus[handle]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.gpus[handle][4]]


def _two_gpus() -> FakeNvml:
    return FakeNvml([(A, "NVIDIA H100 80GB HBM3", 80 * GIB, 2 * GIB, [(1, 2 * GIB)]),
                     (B, "NVIDIA H100 80GB HBM3", 80 * GIB, 0, [])])


def test_nvml_names_each_gpu_by_uuid_and_budgets_what_others_leave() -> None:
    nvml = _two_gpus()
    specs = nvml_devices(nvml, 0.9, None, None)
    assert specs == [
        DeviceSpec(0, "cuda", "cuda:0", "NVIDIA H100 80GB HBM3", int(78 * GIB * 0.9), uuid=A,
                   total_bytes=80 * GIB),
        DeviceSpec(1, "cuda", "cuda:1", "NVIDIA H100 80GB HBM3", int(80 * GIB * 0.9), uuid=B,
                   total_bytes=80 * GIB),
    ]
    assert specs[0].describe()["uuid"] == A
    assert nvml.calls == ["init", "shutdown"]


def test_the_daemons_own_use_is_not_counted_as_others() -> None:
    nvml = FakeNvml([(A, "gpu", 16 * GIB, 6 * GIB, [(os.getpid(), 2 * GIB), (7, None)])])
    (spec,) = nvml_devices(nvml, 0.5, None, None) or []
    assert spec.memory_bytes == (16 - 4) * GIB // 2


def test_cuda_visible_devices_by_uuid_renumbers_from_zero() -> None:
    (spec,) = nvml_devices(_two_gpus(), 0.9, "GPU-bbbb", None) or []
    assert (spec.index, spec.torch_device, spec.uuid) == (0, "cuda:0", B)


def test_an_index_is_nvmls_only_in_pci_bus_order() -> None:
    assert nvml_devices(_two_gpus(), 0.9, "1", None) is None  # CUDA's order: ask torch.cuda
    (spec,) = nvml_devices(_two_gpus(), 0.9, "1", "PCI_BUS_ID") or []
    assert spec.uuid == B


def test_visible_uuids_follow_cuda_visible_devices_rules() -> None:
    uuids = [A, B, C]
    assert visible_uuids(None, uuids, pci_order=False) == [A, B, C]
    assert visible_uuids("", uuids, pci_order=False) == []
    assert visible_uuids(f"{C},{A}", uuids, pci_order=False) == [C, A]
    assert visible_uuids("GPU-cccc,GPU-ffff,GPU-aaaa", uuids, pci_order=False) == [C]  # stops
    assert visible_uuids("GPU-,GPU-aaaa", uuids, pci_order=False) == []  # ambiguous prefix
    assert visible_uuids("2,0,7,1", uuids, pci_order=True) == [C, A]
    assert visible_uuids("MIG-1234", uuids, pci_order=True) is None


def test_without_a_driver_nvml_finds_nothing_and_no_device_node_means_no_probe() -> None:
    nvml = FakeNvml([], starts=False)
    assert nvml_devices(nvml, 0.9, None, None) is None
    if not os.path.exists("/dev/nvidiactl"):
        assert cuda_devices(nvml=nvml) == []


def test_an_nvml_error_on_a_gpu_leaves_the_answer_to_torch_cuda() -> None:
    nvml = _two_gpus()

    def lost(handle: int) -> SimpleNamespace:
        raise NVMLError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = lost
    assert nvml_devices(nvml, 0.9, None, None) is None
    assert nvml.calls == ["init", "shutdown"]


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu-memory-fraction"):
        cuda_devices(1.5, nvml=_two_gpus())


# ---- the torch.cuda probe -------------------------------------------------------------------
PROBE_OUT = (
    "some library's banner\n"
    '{"count": 2, "devices": ['
    '{"uuid": "aaaa1111-0000-0000-0000-000000000000", "name": "NVIDIA H200", '
    '"total_bytes": 150000000000, "free_bytes": 140000000000}, '
    '{"uuid": "GPU-cccc3333-0000-0000-0000-000000000000", "name": "NVIDIA H200", '
    '"total_bytes": 150000000000, "free_bytes": 149000000000}]}\n')


def test_the_probes_output_gives_devices_by_uuid() -> None:
    assert parse_probe(PROBE_OUT, 0.9) == [
        DeviceSpec(0, "cuda", "cuda:0", "NVIDIA H200", int(140e9 * 0.9), uuid=A,
                   total_bytes=150_000_000_000),
        DeviceSpec(1, "cuda", "cuda:1", "NVIDIA H200", int(149e9 * 0.9), uuid=C,
                   total_bytes=150_000_000_000),
    ]
    assert parse_probe('{"count": 0, "devices": []}', 0.9) == []


@pytest.mark.parametrize("out", ["", "not json", '{"count": 1, "devices": []}',
                                 '{"count": 1, "devices": [{"uuid": "x"}]}'])
def test_a_probe_that_prints_nonsense_is_a_clear_error(out: str) -> None:
    with pytest.raises(CudaProbeError, match="probe printed"):
        parse_probe(out, 0.9)


def test_the_probe_runs_python_with_the_nvml_based_check_and_a_time_limit() -> None:
    seen: dict[str, Any] = {}

    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kw, args=args)
        return subprocess.CompletedProcess(args, 0, PROBE_OUT, "")

    assert len(probe_cuda_devices(0.9, 30.0, run=run)) == 2
    assert seen["args"][:2] == [sys.executable, "-c"]
    assert "torch.cuda.get_device_properties" in seen["args"][2]
    assert seen["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    assert seen["timeout"] == 30.0


def test_a_failed_or_hung_probe_is_a_clear_error() -> None:
    def fails(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "Traceback\nRuntimeError: CUDA error\n")

    def hangs(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(args, kw["timeout"])

    with pytest.raises(CudaProbeError, match="exit status 1: .*CUDA error.*nvidia-ml-py"):
        probe_cuda_devices(run=fails)
    with pytest.raises(CudaProbeError, match="took over 5 s"):
        probe_cuda_devices(timeout_s=5, run=hangs)


# ---- one executor's cost ----------------------------------------------------------------------
GPU = DeviceSpec(0, "cuda", "cuda:0", "NVIDIA H100", 70 * GIB, uuid=A, total_bytes=80 * GIB)


def test_a_context_is_nvmls_use_by_the_process_minus_torchs_reserved_bytes() -> None:
    assert context_bytes('{"used": 555745280, "reserved": 2097152}') == 555745280 - 2097152
    assert context_bytes('{"used": null, "reserved": 2097152}') is None  # NVML: pid unseen
    assert context_bytes("Traceback") is None


def test_the_context_is_measured_on_that_gpu_alone() -> None:
    seen: dict[str, Any] = {}

    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kw)
        return subprocess.CompletedProcess(args, 0, '{"used": 500000000, "reserved": 0}\n', "")

    cost = executor_cost(GPU, run=run, environ={"PATH": "/bin"})
    # The context, and the cuBLAS(Lt) workspaces the probe's reserved bytes left out: 8 x 4096
    # KiB in a 32 MiB segment of their own and cuBLASLt's 1 MiB in a 2 MiB small segment.
    assert cost.workspace_bytes == 32 * 2**20 + 2 * 2**20
    assert (cost.bytes, cost.measured) == (500_000_000 + cost.workspace_bytes, True)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == A
    assert seen["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_the_workspace_booked_follows_the_callers_cublas_config() -> None:
    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 0, '{"used": 500000000, "reserved": 0}\n', "")

    # 2 x 4096 KiB + 8 x 16 KiB: between 1 and 10 MiB, so a 20 MiB segment; cuBLASLt 2 MiB.
    small = executor_cost(GPU, run=run, environ={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})
    assert small.workspace_bytes == 20 * 2**20 + 2 * 2**20
    assert executor_cost(cpu_devices(1, GIB)[0]).workspace_bytes == 0


def test_an_unmeasurable_context_books_the_estimate_and_a_cpu_device_its_executor() -> None:
    def no_nvml(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", "ModuleNotFoundError: pynvml")

    estimated = executor_cost(GPU, run=no_nvml)
    assert estimated.bytes == GPU_CONTEXT_ESTIMATE_BYTES + estimated.workspace_bytes
    assert not executor_cost(GPU, run=no_nvml).measured
    cpu = executor_cost(cpu_devices(1, GIB)[0])
    assert (cpu.bytes, cpu.measured) == (CPU_EXECUTOR_BYTES, False)


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs a CUDA device")
def test_nvml_and_torch_name_the_same_gpus_by_uuid() -> None:
    probed = probe_cuda_devices()
    if not probed:
        pytest.skip("needs a CUDA device")
    assert all(d.uuid and d.uuid.startswith(("GPU-", "MIG-")) for d in probed)
    pynvml = pytest.importorskip("pynvml")
    found = nvml_devices(pynvml, 0.9, os.environ.get("CUDA_VISIBLE_DEVICES"),
                         os.environ.get("CUDA_DEVICE_ORDER"))
    if found is not None:
        assert sorted(d.uuid or "" for d in found) == sorted(d.uuid or "" for d in probed)
        assert [d.total_bytes for d in found] == [
            next(p.total_bytes for p in probed if p.uuid == d.uuid) for d in found]


@pytest.mark.cuda
@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs a CUDA device")
def test_a_cuda_context_measures_between_100_mib_and_2_gib() -> None:
    pytest.importorskip("pynvml")
    probed = probe_cuda_devices()
    if not probed:
        pytest.skip("needs a CUDA device")
    cost = executor_cost(probed[0])
    assert cost.measured, cost.how
    assert 100 * 2**20 < cost.bytes < 2 * GIB


@pytest.mark.cuda
@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs a CUDA device")
def test_a_first_matmul_reserves_no_more_than_the_booked_workspace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    a = torch.ones(64, 64, device="cuda")
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    (a @ a).sum().item()
    grew = torch.cuda.memory_reserved() - before
    print(f"a first matmul reserved {grew} B")
    assert 0 < grew <= blas_workspace_reserved(os.environ)


def test_serve_refuses_a_gpu_memory_fraction_outside_zero_to_one(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "salus.daemon.cli", "serve", "--socket", str(tmp_path / "s.sock"),
         "--state-dir", str(tmp_path / "state"), "--gpu-memory-fraction", "1.5"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--gpu-memory-fraction must be in (0, 1], got 1.5" in done.stderr
