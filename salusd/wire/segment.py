"""Shared-memory segments that carry a frame's large tensors without a copy on the receiver.

A segment is a POSIX shared-memory file made with `memfd_create` (anonymous: it has no name in
/dev/shm) and passed over the unix socket as a file descriptor (SCM_RIGHTS).

Ownership and clean-up, the reason this is not `multiprocessing.shared_memory`:

- The sender creates the memfd, writes the tensor bytes, seals it against shrinking, growing and
  writing, sends the descriptor with the frame and closes its own descriptor right away.
- The receiver checks the seals and size, maps it copy-on-write and closes the descriptor. Its
  tensors are views of that mapping; the memory goes back to the kernel when the last tensor
  (hence the mapping) is freed.
- Nothing is ever unlinked because nothing is ever named: the kernel reference-counts the file,
  so a client killed at any point (before sending, with the descriptor in flight, or after) leaks
  nothing, and a daemon running as another user needs no permission on the segment. Named
  segments would need an unlink by exactly one side, a sweep for crashed peers, and modes that let
  the daemon's user open them.
- The seals are what make mapping a peer's memory safe: a sender cannot truncate the file under
  the receiver's mapping (SIGBUS) nor change the bytes after sending.

Linux only (memfd, sealing); where it is missing `available()` is false and tensors go inline.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Sequence

_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(
    fcntl, "F_SEAL_WRITE", 0
) | getattr(fcntl, "F_SEAL_SEAL", 0)
_REQUIRED_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_WRITE", 0)


def available() -> bool:
    """True when this platform can create sealed memfd segments (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def create(parts: Sequence[tuple[int, memoryview]], size: int) -> int:
    """Write `parts` (byte offset, bytes) into a new sealed segment of `size` bytes.

    Returns the file descriptor; the caller sends it and then closes it.
    """
    fd = os.memfd_create("salus-tensors", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for offset, view in parts:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed_size(fd: int) -> int:
    """The size in bytes of the segment `fd` (which stays open). Raises ValueError when the
    descriptor is not a sealed memfd: mapping a file the peer could still truncate would let it
    crash the reader with SIGBUS. The daemon checks a client's segment with this before it
    forwards the frame, so the executor never gets one it would refuse."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        raise ValueError("the descriptor sent with the frame is not a shared-memory segment")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise ValueError("shared-memory segment is not sealed against shrinking and writing")
    return info.st_size


def open_mapping(fd: int) -> mmap.mmap:
    """Map a received segment copy-on-write (writable, private) and close `fd`; ValueError as
    `sealed_size` says."""
    try:
        size = sealed_size(fd)
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
