"""Cheap per-call memory peaks of an executor process on a CPU device (bytes).

One executor holds one job, so its process memory is the job's: on the CPU the peak resident
set during a call (its high-water mark, reset before the call through `/proc/self/clear_refs`)
minus the resident set with the job's state in place sees every byte the call touched, tensors
and Python objects alike. The mark is read with `getrusage` (`ru_maxrss`, the same mark as
`VmHWM` for a process that forked and did not exit, about 1 µs) rather than by formatting
`/proc/self/status` (about 20 µs per call in an executor, measured); the meter checks once that
the two agree and keeps to /proc where they do not. Pages of files count in the resident set
too: a forked executor's first step faults in about 15 MiB of libtorch's code (measured), which
is not the job's memory. So whenever a call's peak is higher than any seen before, the meter
reads how much file-backed memory (`RssFile`) grew and moves it into the baseline; calls at an
already seen peak cost no /proc read. On a CUDA device the caching allocator's reserved peak
is used instead (`cuda_call.py`).
"""

from __future__ import annotations

import os
import resource


class _ProcStatus:
    """`/proc/self/status` kept open: one pread per look-up instead of open, parse, close."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)

    def kib(self, field: bytes) -> int:
        data = os.pread(self.fd, 8192, 0)
        at = data.find(field)
        if at < 0:
            return 0
        return int(data[at + len(field):data.index(b"kB", at)])


class PeakMeter:
    """Measures each call's peak above a baseline taken with the job's state in place."""

    def __init__(self) -> None:
        self.baseline = 0
        self._file = 0  # file-backed resident bytes counted in the baseline
        self._seen = 0  # the highest peak checked for file pages since the baseline
        self._status = _ProcStatus()
        try:
            self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self._clear = -1
        self._rusage = self._clear >= 0 and self._rusage_agrees()

    def _rusage_agrees(self) -> bool:
        """Whether `ru_maxrss` follows the reset high-water mark. It is the larger of the
        process's mark and one kept from before an `exec` or a thread group's exit, so after
        a reset it matches `VmHWM` unless such an older, higher mark is kept."""
        os.write(self._clear, b"5")
        hwm = self._status.kib(b"VmHWM:")
        return abs(_maxrss_kib() - hwm) <= 1024

    def set_baseline(self) -> None:
        """Call once the state is in place (and again after it moves)."""
        self.baseline = self._status.kib(b"VmRSS:") * 1024
        self._file = self._status.kib(b"RssFile:") * 1024
        self._seen = 0

    def start(self) -> None:
        if self._clear >= 0:
            os.write(self._clear, b"5")

    def peak(self) -> int | None:
        """Bytes above the baseline at the call's peak; None where it cannot be measured."""
        if self._clear < 0:
            return None
        kib = _maxrss_kib() if self._rusage else self._status.kib(b"VmHWM:")
        peak = max(0, kib * 1024 - self.baseline)
        return peak if peak <= self._seen else self._without_file_pages(peak)

    def _without_file_pages(self, peak: int) -> int:
        """`peak` less the file-backed pages the process gained since the baseline (code run
        for the first time): they stay resident, so they join the baseline."""
        now = self._status.kib(b"RssFile:") * 1024
        grown = max(0, now - self._file)
        self._file = now
        self.baseline += grown
        self._seen = max(0, peak - grown)
        return self._seen


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
