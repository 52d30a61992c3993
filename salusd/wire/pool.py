"""A job's direct line keeps one shared-memory segment per direction (its pool) for the large
tensors of its frames, instead of a new segment per frame.

A segment of its own per frame (`segment.py`) costs a memfd created, sized, written, sealed and
mapped, and the receiver's page faults on a fresh mapping: a 4 MiB call argument added about
4.1 ms to a call on the 2-vCPU build VM, where copying 4 MiB takes about 0.29 ms
(`bench/overhead.py`, `argument_4MiB`). Through the pool a frame's segment costs two copies of
its bytes: the sender's into the pool, the receiver's out of it.

Layout, little endian: bytes 0-7 the sequence number of the last frame the receiver took, or
RETIRED (written by the receiver), 8-15 the size of the current frame's segment in bytes, 16-23 its
sequence number; the segment itself from byte 64 (`DATA`).

- The sender writes a frame into the pool only when the receiver has taken every frame before
  it (a call answered before the next is sent always finds it so); otherwise, and for frames
  over MAX_POOL_BYTES, the frame takes a sealed segment of its own as before.
- The receiver copies the frame's bytes into memory of its own before it marks the frame taken,
  so the sender may overwrite them at once and the call's tensors never change under the job.
- Or it lends them out in place (`PoolReader.lend`: the executor's side, where the frame is a
  call's arguments) and marks the frame taken once the call ran and nothing views them any
  more (`give_back`). Where a tensor still views them (the job kept its argument, or returned
  it and the reply waits), the receiver writes RETIRED instead: the pool stays mapped for that
  tensor, which never changes, and the sender makes a new pool for its next frame. This saves
  the receiver's copy: 45 µs of a 256 KiB argument on the build VM (`bench/call_stages.py`,
  six_ms, to the function's start 154 against 106-111 µs, one-off A/B runs).
- The pool is sealed against shrinking, so a mapping of it can never fault (SIGBUS), but not
  against writing. It is therefore used only on a job's direct line, whose two ends both run as
  the job's owner; the daemon refuses a frame flagged FLAG_POOL (`frames.KNOWN_FLAGS` leaves
  it out), so no pooled frame ever passes through it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import struct
import sys
from collections.abc import Sequence

DATA = 64
MIN_POOL_BYTES = 1 << 20
MAX_POOL_BYTES = 256 << 20
RETIRED = (1 << 64) - 1  # the receiver's mark: a tensor still views the pool, make a new one
_U64 = struct.Struct("<Q")
_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0)


class PoolWriter:
    """The sending side: the pool it writes into, grown (replaced) when a frame needs more."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.seq = 0

    def write(self, parts: Sequence[tuple[int, memoryview]], size: int) -> tuple[bool, int | None]:
        """Put one frame's segment, `parts` of (byte offset, bytes) over `size` bytes, in the
        pool: (whether it went there, the descriptor to send with the frame when the pool is
        new; the caller closes it once sent)."""
        taken = _U64.unpack_from(self.map, 0)[0] if self.map is not None else self.seq
        if size > MAX_POOL_BYTES or taken not in (self.seq, RETIRED):
            return False, None  # too large, or the receiver has not taken the last frame
        fd = None
        if self.map is None or taken == RETIRED or size > len(self.map) - DATA:
            fd = self._replace(max(MIN_POOL_BYTES, 1 << (size + DATA - 1).bit_length()))
        assert self.map is not None
        view = memoryview(self.map)
        try:
            for offset, part in parts:
                view[DATA + offset:DATA + offset + len(part)] = part
        finally:
            view.release()
        self.seq += 1
        _U64.pack_into(self.map, 8, size)
        _U64.pack_into(self.map, 16, self.seq)
        return True, fd

    def _replace(self, nbytes: int) -> int:
        """A new pool of `nbytes` bytes in place of the old; its descriptor."""
        fd = os.memfd_create("salus-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEAL_SHRINK)
            new = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        if self.map is not None:
            self.map.close()
        self.map, self.seq = new, 0
        return fd

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None


class PoolReader:
    """The receiving side: the peer's pool, once a frame brought it."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.fd: int | None = None  # the pool's descriptor, kept to hand the line on
        self._lent: tuple[int, memoryview] | None = None  # (sequence number, view) lent out

    def adopt(self, fd: int) -> None:
        """Map the pool the peer sent (`fd`, owned from now on) in place of the last;
        ValueError (and `fd` closed) when it is not a pool: a regular memory file of at least
        DATA bytes sealed against shrinking."""
        try:
            info = os.fstat(fd)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not stat.S_ISREG(info.st_mode) or info.st_size < DATA or not seals & _SEAL_SHRINK:
                raise ValueError("the descriptor sent as the line's pool is not a memory file "
                                 "sealed against shrinking")
            new = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self.close()
        self.map, self.fd = new, fd

    def take(self) -> bytearray | None:
        """A copy of the current frame's segment (None: it has none), and the frame marked
        taken; ValueError when there is no pool or the size in it is out of bounds."""
        seq, size = self._current()
        data = None
        if size:
            assert self.map is not None
            view = memoryview(self.map)
            try:
                data = bytearray(view[DATA:DATA + size])
            finally:
                view.release()
        self.taken(seq)
        return data

    @property
    def lending(self) -> bool:
        """Whether a frame is lent out (`lend`) and not given back yet."""
        return self._lent is not None

    def lend(self) -> memoryview | None:
        """The current frame's segment in place (None: it has none); `give_back` once the
        tensors made from it are done with. ValueError as `take`."""
        seq, size = self._current()
        if not size:
            self.taken(seq)
            return None
        assert self.map is not None
        view = memoryview(self.map)
        try:
            lent = view[DATA:DATA + size]  # a slice outlives its parent's release
        finally:
            view.release()
        self._lent = (seq, lent)
        return lent

    def give_back(self, *, leaving: bool = False, retire: bool = True) -> bool | None:
        """Mark the frame lent out taken when no tensor views it any more (True); else retire
        the pool: left mapped for the tensors that view it, and the sender told to make a new
        one (False), or with `retire` False keep it lent (None). None: nothing was lent. A
        tensor made from the lent view (`torch.frombuffer`) holds a reference to it.
        `leaving`: the line goes on in another process and this one never reads those tensors
        again: the frame is taken."""
        if self._lent is None:
            return None
        seq, lent = self._lent
        viewed = sys.getrefcount(lent) > 3  # more than `lent`, `_lent` and the argument
        if viewed and not leaving:
            if not retire:
                return None
            self._lent = None
            if self.map is not None:
                _U64.pack_into(self.map, 0, RETIRED)
            self.map = None  # unmapped once the last such tensor is gone
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            return False
        self._lent = None
        if not viewed:
            lent.release()
        self.taken(seq)
        return True

    def _current(self) -> tuple[int, int]:
        if self.map is None:
            raise ValueError("a frame points into the line's pool before the pool came")
        size, seq = _U64.unpack_from(self.map, 8)[0], _U64.unpack_from(self.map, 16)[0]
        if size > len(self.map) - DATA:
            raise ValueError(f"a pooled segment of {size} bytes is larger than the pool")
        return seq, size

    def taken(self, seq: int) -> None:
        """Mark frame `seq` taken: the sender may write the next into the pool."""
        if self.map is not None:
            _U64.pack_into(self.map, 0, seq)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # tensors lent out of it still view it:
                self.map.close()  # unmapped after them
            self.map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
