"""A GPU's health for the device plugin beyond its device node (`salusd/k8s/health.py`): a
critical Xid makes it Unhealthy for good, an application's Xid does not, nor one the operator
names in SALUS_IGNORE_XIDS; a GPU NVML no longer finds is Unhealthy; a board without Xid events
is watched by its node and NVML; without NVML the node alone says. NVML is a stand-in here (no
GPU): what it would report is raised by the test."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fake_nvml import FakeXidNvml

from salus.daemon.k8s.gpus import node_present
from salus.daemon.k8s.health import APPLICATION_XIDS, XidHealth, gpu_health, ignored_xids
from salus.daemon.k8s.units import GpuShare

GIB = 2**30
A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"


@pytest.fixture
def dev(tmp_path: Path) -> Path:
    for node in ("nvidia0", "nvidia1", "nvidiactl"):
        (tmp_path / node).touch()
    return tmp_path


def _health(dev: Path, nvml: FakeXidNvml, ignored: frozenset[int] = APPLICATION_XIDS
            ) -> XidHealth:
    gpus = [GpuShare(A, GIB, 0), GpuShare(B, GIB, 1)]
    return XidHealth(gpus, nvml, node_present(gpus, dev), ignored)


def test_a_critical_xid_makes_its_gpu_unhealthy_for_good_and_the_others_stay(
        dev: Path) -> None:
    nvml = FakeXidNvml({A: 0x8 | 0x2, B: 0x8})
    health = _health(dev, nvml)
    assert nvml.registered == {A: 0x8, B: 0x8}
    assert health(A) and health(B)
    nvml.xid(A, 79)  # fallen off the bus
    assert not health(A) and health(B)
    assert health.failed == {A: "critical Xid 79"}
    assert not health(A)  # no event since: still unhealthy
    health.close()
    assert nvml.freed == 1 and nvml.shutdowns == 1


def test_an_applications_xid_or_one_the_operator_ignores_leaves_the_gpu_healthy(
        dev: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SALUS_IGNORE_XIDS", "94, 95,bad")
    with caplog.at_level(logging.WARNING, "salusd.k8s"):
        ignored = ignored_xids()
    assert ignored == APPLICATION_XIDS | {94, 95}
    assert "'bad' is no Xid number" in caplog.text
    nvml = FakeXidNvml({A: 0x8, B: 0x8})
    health = _health(dev, nvml, ignored)
    for xid in (13, 31, 43, 45, 68, 109, 94):
        nvml.xid(A, xid)
    assert health(A)
    nvml.xid(A, 48)  # a double-bit ECC error
    assert not health(A)


def test_a_gpu_nvml_no_longer_finds_or_whose_node_went_is_unhealthy(dev: Path) -> None:
    nvml = FakeXidNvml({A: 0x8, B: 0x8})
    health = _health(dev, nvml)
    nvml.lost.add(B)
    assert health(A) and not health(B)
    assert health.failed[B].startswith("NVML no longer finds it")
    (dev / "nvidia0").unlink()
    assert not health(A)
    (dev / "nvidia0").touch()
    assert health(A)  # a node check, not an event: it counts while it lasts


def test_a_board_without_xid_events_is_watched_by_its_node_and_nvml(
        dev: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeXidNvml({A: 0x1, B: 0x8})  # A reports single-bit ECC events only
    with caplog.at_level(logging.WARNING, "salusd.k8s"):
        health = _health(dev, nvml)
    assert A not in nvml.registered
    assert f"{A} reports no Xid events" in caplog.text
    nvml.xid(A, 79)  # never delivered: it did not register
    assert health(A)
    nvml.lost.add(A)
    assert not health(A)


class _NoDriver(FakeXidNvml):
    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")


def test_without_nvml_the_device_node_alone_says(dev: Path) -> None:
    gpus = [GpuShare(A, GIB, 0)]
    present = node_present(gpus, dev)
    assert gpu_health(gpus, None, present) is present
    assert gpu_health(gpus, _NoDriver({A: 0x8}), present) is present
    assert isinstance(gpu_health(gpus, FakeXidNvml({A: 0x8}), present), XidHealth)
