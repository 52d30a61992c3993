"""The executor's per-call peak meter (salusd/executor/peak.py) on the CPU, in a process forked
as executors are and in the test process itself; the expected peak is the size of a buffer the
call touches, independent of how the meter reads it."""

from __future__ import annotations

import mmap
import os

import pytest

from salus.daemon.executor.peak import PeakMeter

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                reason="needs Linux /proc/self/clear_refs")


def _own(nbytes: int) -> mmap.mmap:
    """`nbytes` of new anonymous memory with every page written, so resident. Not a
    bytearray: malloc may hand back pages an earlier test freed and that are still resident
    (glibc raises its mmap threshold after large frees), and those would not grow the set."""
    buf = mmap.mmap(-1, nbytes)
    for at in range(0, nbytes, mmap.PAGESIZE):
        buf[at] = 1
    return buf


def _touch(nbytes: int) -> None:
    _own(nbytes).close()


def _peaks(meter: PeakMeter) -> tuple[int, int]:
    """(peak of a call touching 96 MiB, peak of the next call touching nothing)."""
    meter.set_baseline()
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


def test_pages_of_files_are_not_the_calls_memory(tmp_path) -> None:
    """A call that reads a 32 MiB file through a mapping grows the resident set by file pages
    (as a first step does with libtorch's code): they are left out of its peak, while 32 MiB of
    its own memory in the same call counts."""
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(32 * MIB))
    meter = PeakMeter()
    meter.set_baseline()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        meter.start()
        checksum = sum(view[i] for i in range(0, len(view), 4096))  # touch every page
        file_only = meter.peak()
        meter.start()
        own = _own(32 * MIB)
        both = meter.peak()
        own.close()
    assert checksum >= 0 and file_only is not None and both is not None
    assert file_only <= 8 * MIB, file_only
    assert 28 * MIB <= both <= 44 * MIB, both
