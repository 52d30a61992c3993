"""What the device plugin learns of the GPUs: units from budgets, minor numbers from the
driver's /proc files or NVML (made-up ones here), health from the device nodes, and nothing on
a host without GPUs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from salus.daemon.devices.discovery import DeviceSpec, cpu_devices
from salus.daemon.k8s.allocations import Allocation, AllocationTable
from salus.daemon.k8s.gpus import minors_from_nvml, minors_from_proc, node_present, shares
from salus.daemon.k8s.units import GpuShare, parse_unit, unit_ids

GIB = 2**30
A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"


def gpu(index: int, uuid: str, budget: int) -> DeviceSpec:
    return DeviceSpec(index, "cuda", f"cuda:{index}", "H200", budget, uuid=uuid,
                      total_bytes=141 * GIB)


def test_unit_ids_name_the_gpu_and_count_whole_gib() -> None:
    assert unit_ids(GpuShare(A, 3 * GIB - 1)) == [f"{A}::0", f"{A}::1"]
    assert unit_ids(GpuShare(A, GIB - 1)) == []
    assert parse_unit(f"{B}::12") == (B, 12)
    for bad in ("GPU-x", "GPU-x::", "::3", "GPU-x::-1"):
        with pytest.raises(ValueError, match="not a salusd.io/gpu-mem unit"):
            parse_unit(bad)
    # a 141 GiB GPU's last ID is within the kubelet's 63 characters
    assert max(len(i) for i in unit_ids(GpuShare(A, 141 * GIB))) == len(A) + len("::140")


def write_information(root: Path, bus: str, uuid: str, minor: int) -> None:
    (root / bus).mkdir(parents=True)
    (root / bus / "information").write_text(
        f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 180\nGPU UUID: \t {uuid}\n"
        f"Video BIOS: \t 96.00.9f.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
        f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")


def test_minor_numbers_from_the_driver_proc_files(tmp_path: Path) -> None:
    write_information(tmp_path, "0000:18:00.0", A, 3)
    write_information(tmp_path, "0000:2a:00.0", B, 0)
    (tmp_path / "0000:3b:00.0").mkdir()
    (tmp_path / "0000:3b:00.0" / "information").write_text("garbled\n")
    assert minors_from_proc(tmp_path) == {A: 3, B: 0}
    assert minors_from_proc(tmp_path / "absent") == {}


class FakeNvml(SimpleNamespace):
    class NVMLError(Exception):
        pass

    def __init__(self, minors: dict[str, int], start: bool = True) -> None:
        super().__init__(minors=minors, start=start, shut=0)

    def nvmlInit(self) -> None:
        if not self.start:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.minors:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetMinorNumber(self, handle: str) -> int:
        return self.minors[handle]


def test_minor_numbers_from_nvml_and_none_for_a_gpu_nobody_knows(tmp_path: Path) -> None:
    nvml = FakeNvml({A: 5})
    assert minors_from_nvml([A, B], nvml) == {A: 5}
    assert nvml.shut == 1
    assert minors_from_nvml([A], FakeNvml({A: 5}, start=False)) == {}
    write_information(tmp_path, "0000:2a:00.0", B, 2)
    found = shares([gpu(0, A, 10 * GIB), gpu(1, B, 20 * GIB)], nvml=FakeNvml({A: 5}),
                   proc=tmp_path)
    assert found == [GpuShare(A, 10 * GIB, 5), GpuShare(B, 20 * GIB, 2)]
    assert shares([gpu(0, A, GIB)], nvml=FakeNvml({}), proc=tmp_path) == [GpuShare(A, GIB)]


def test_a_host_without_gpus_has_nothing_to_advertise() -> None:
    assert shares(cpu_devices(2, 64 * 2**20)) == []


def test_a_gpu_is_healthy_while_its_device_node_exists(tmp_path: Path) -> None:
    (tmp_path / "nvidia3").touch()
    healthy = node_present([GpuShare(A, GIB, 3), GpuShare(B, GIB, None)], tmp_path)
    assert healthy(A) and not healthy(B) and not healthy("GPU-other")
    (tmp_path / "nvidiactl").touch()  # B's minor is unknown: the control node stands in
    assert healthy(B)
    (tmp_path / "nvidia3").unlink()
    assert not healthy(A)


def test_an_unreadable_allocation_table_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "k8s-allocations.json"
    table = AllocationTable(path)
    row = Allocation("a1", A, (f"{A}::0",), str(tmp_path / "a1"), 1.5)
    assert table.add([row]) == []
    assert AllocationTable(path).all() == [row]
    path.write_text("{not json")
    assert AllocationTable(path).all() == []
    assert (tmp_path / "k8s-allocations.bad").read_text() == "{not json"
    assert not path.exists()
