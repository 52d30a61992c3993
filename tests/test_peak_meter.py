"""The executor's per-call peak meter (salusd/executor/peak.py) on the CPU, in a process forked
as executors are and in the test process itself; the expected peak is the size of a buffer the
call touches, independent of how the meter reads it."""

from __future__ import annotations

import os

import pytest
import torch

from salus.daemon.executor.peak import PeakMeter

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                reason="needs Linux /proc/self/clear_refs")


def _touch(nbytes: int) -> None:
    buf = bytearray(nbytes)  # zero-filled: every page is written, so resident
    del buf


def _peaks(meter: PeakMeter) -> tuple[int, int]:
    """(peak of a call touching 96 MiB, peak of the next call touching nothing)."""
    meter.set_baseline(torch.device("cpu"))
    meter.start()
    _touch(96 * MIB)
    big = meter.peak()
    meter.start()
    small = meter.peak()
    assert big is not None and small is not None
    return big, small


def _check(big: int, small: int) -> None:
    assert 90 * MIB <= big <= 110 * MIB, big
    assert small <= 8 * MIB, small  # the mark was reset: the earlier call no longer counts


def test_a_forked_process_reads_the_mark_with_getrusage() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            meter = PeakMeter()
            big, small = _peaks(meter)
            os.write(write, f"{int(meter._rusage)} {big} {small}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        fast, big, small = (int(v) for v in f.read().split())
    assert os.waitpid(pid, 0)[1] == 0
    assert fast == 1  # a forked executor takes the cheap path
    _check(big, small)


def test_the_meter_is_right_in_this_process_and_through_proc() -> None:
    meter = PeakMeter()
    _check(*_peaks(meter))  # whichever path its check chose here
    meter._rusage = False  # /proc/self/status, the path kept where getrusage disagrees
    _check(*_peaks(meter))
