"""A blocking message channel over a connected unix stream socket (the adapter's and the
executors' side of the wire; the daemon routes frames with `frames.FrameReader` instead).

The frame layout is in `frames.py`; what a JSON header and its parts mean is `codec.py`; the
compact header of the per-iteration calls is `compact.py`; the segment is `segment.py`.
`Channel.send` picks the compact form for a `compact.Message` and JSON for anything else;
`recv` returns what was sent. A frame whose header + body exceeds `max_frame_bytes` is read and
discarded (up to DRAIN_LIMIT_BYTES) and reported as FrameTooLarge, so the connection stays
usable; a bad magic or version, or a stream that ends mid-frame, cannot be resynchronised and
the connection must be dropped. A frame of another protocol version that is a small JSON error
reply (what salusd sends before it drops a peer it cannot read) is read first, and what it says
goes into the error.
"""

from __future__ import annotations

import array
import json
import math
import os
import resource
import select
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from salus.daemon.wire import codec, compact, segment
from salus.daemon.wire.codec import Pickled, PickledPayload
from salus.daemon.wire.frames import ANC_BYTES as _ANC_BYTES
from salus.daemon.wire.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FIXED,
    FLAG_COMPACT,
    FLAG_POOL,
    FLAG_SEGMENT,
    FLAG_SOCKET,
    FLAGS_WITH_FD,
    HEADER_BYTES,
    KNOWN_FLAGS,
    MAGIC,
    MAX_QUEUED_FDS,
    RECV_FLAGS,
    VERSION,
    ConnectionClosed,
    FrameError,
    FrameTooLarge,
    VersionMismatch,
    error_from_reply,
    passed_fd,
    queue_descriptors,
    reply_result,
    unpack_fixed,
)
from salus.daemon.wire.pool import PoolReader, PoolWriter

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_SHM_THRESHOLD", "Channel", "ConnectionClosed",
    "FrameError", "FrameTooLarge", "Pickled", "PickledPayload", "error_from_reply",
    "involuntary_switches", "passed_fd", "reply_result", "spin",
]

DEFAULT_SHM_THRESHOLD = 256 * 1024
DRAIN_LIMIT_BYTES = 1024 * 1024 * 1024
_FIXED = FIXED
_CHANNEL_FLAGS = KNOWN_FLAGS | FLAG_POOL  # the daemon refuses FLAG_POOL; a direct line takes it
_RECV_FLAGS = RECV_FLAGS
_MAX_QUEUED_FDS = MAX_QUEUED_FDS
_READ_BUFFER_BYTES = 64 * 1024
_CTRUNC = int(socket.MSG_CTRUNC)  # plain ints: enum arithmetic costs microseconds per frame
_IOV_LIMIT = 512
_OTHER_VERSION_REPLY_BYTES = 64 * 1024
YIELD_TAKEN_S = 50e-6  # a sched_yield that took longer ran another process: the CPU is wanted
T = TypeVar("T")


def spin(look: Callable[[], T], until: float) -> T | None:
    """Poll with `look()` without sleeping until it finds something (returned) or the
    `time.perf_counter` deadline `until` passes. Each empty look yields the CPU, and polling
    stops early once a yield let another process run: where the CPU is wanted, the caller
    sleeps instead. None when nothing came.

    A yield that took longer than `YIELD_TAKEN_S` is checked against this thread's count of
    involuntary context switches, which a yield that ran another task raises: in a VM a yield
    takes that long also when the host ran something else on the vCPU or an interrupt came
    (about 30 times a second on the build VM, `bench/yield_gaps.py`), and then the CPU is
    still ours."""
    clock = time.perf_counter
    now = clock()
    switches = involuntary_switches()
    while now < until:
        found = look()
        if found:
            return found
        os.sched_yield()
        then, now = now, clock()
        if now - then > YIELD_TAKEN_S:
            before, switches = switches, involuntary_switches()
            if switches != before:
                return None
    return None


def involuntary_switches() -> int:
    """This thread's involuntary context switches so far (a yield that ran another task
    counts as one)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Channel:
    """Blocking message channel over a connected AF_UNIX stream socket (one reader and one
    writer at a time; callers serialise).

    `max_frame_bytes` bounds received frames (header + inline body, in bytes);
    `peer_max_frame_bytes` bounds sent ones (the peer's limit, when known). Tensors and byte
    strings of at least `shm_threshold` bytes go through a shared-memory segment: with `pool`
    (a job's direct line, never one to the daemon) through this line's pool (`pool.py`), which
    its first frame announces; a channel whose peer announced one answers through its own.
    With `borrow` (the executor's end of a job's line) a pooled frame's tensors view the peer's
    pool in place until `give_back` rather than a copy of it (`pool.PoolReader.lend`).
    """

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 shm_threshold: float = DEFAULT_SHM_THRESHOLD, pool: bool = False,
                 borrow: bool = False) -> None:
        if not isinstance(max_frame_bytes, int) or max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be an int of at least 1024, "
                             f"got {max_frame_bytes!r}")
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.peer_max_frame_bytes = max_frame_bytes
        self.shm_threshold = shm_threshold if segment.available() else math.inf
        self._buf = bytearray(_READ_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._fds: deque[int] = deque()
        self._pool_out = PoolWriter() if pool and segment.available() else None
        self._pool_in = PoolReader()
        self.borrow = borrow
        self._poller: select.poll | None = None

    # ---- sending ---------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Send one message: a `compact.Message` with a compact header, anything else as JSON.
        TypeError for values that cannot be sent; FrameTooLarge (before anything is written)
        when the inline part exceeds the peer's limit."""
        self.send_many([message])

    def send_many(self, messages: list[Any]) -> None:
        """Send several messages in one `sendmsg`, so the peer wakes once for all of them. At
        most one of them may carry a shared-memory segment (its descriptor rides on the first
        byte; the peer keeps it for the frame that claims it)."""
        buffers: list[bytes | memoryview] = []
        total = 0
        fd: int | None = None
        keep: list[object] = []
        try:
            for message in messages:
                frame_fd = self._encode(message, buffers, keep, announce=fd is None)
                if frame_fd is not None:
                    if fd is not None:
                        os.close(frame_fd)
                        raise ValueError("send_many takes at most one message with a segment")
                    fd = frame_fd
            total = sum(memoryview(b).nbytes for b in buffers)
            self._send_all(buffers, total, fd)
        finally:
            if fd is not None:
                os.close(fd)

    def _encode(self, message: Any, buffers: list[bytes | memoryview], keep: list[object],
                announce: bool = True) -> int | None:
        """Append `message`'s frame to `buffers`; returns its segment's (or new pool's)
        descriptor, if any. `announce`: the frame may bring the line's first pool."""
        if type(message) is compact.Message:
            enc = compact.encode(message, shm_threshold=self.shm_threshold)
            flags = FLAG_COMPACT
        else:
            enc = codec.encode(message, shm_threshold=self.shm_threshold)
            flags = 0
        size = len(enc.header) + enc.inline_size
        if size > self.peer_max_frame_bytes:
            raise FrameTooLarge(
                f"message of {size} bytes exceeds the {self.peer_max_frame_bytes}-byte frame "
                f"limit (tensors of at least {self.shm_threshold} bytes go through shared "
                "memory and do not count); send fewer or smaller values per call")
        keep.append(enc)
        fd = None
        pool = self._pool_out
        pooled = False
        if pool is not None and (enc.segment_size or announce and pool.map is None):
            pooled, fd = pool.write(enc.segment, enc.segment_size)
        if pooled:
            flags |= FLAG_POOL
        elif enc.segment_size:
            fd = segment.create(enc.segment, enc.segment_size)
        if fd is not None:
            flags |= FLAG_SEGMENT
        buffers += [_FIXED.pack(MAGIC, VERSION, flags, 0, len(enc.header), enc.inline_size),
                    enc.header, *enc.inline]
        return fd

    def _send_all(self, buffers: list[bytes | memoryview], total: int, fd: int | None) -> None:
        """One sendmsg of `buffers` (`total` bytes) with `fd` attached, then the rest if the
        kernel took only part."""
        if len(buffers) > _IOV_LIMIT:
            buffers = [b"".join(buffers)]
        ancillary = []
        if fd is not None:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        sent = self.sock.sendmsg(buffers, ancillary)
        if sent == total:
            return
        # A blocking send may still stop early (a signal); the descriptor went with byte 0.
        for buf in buffers:
            n = memoryview(buf).nbytes
            if sent >= n:
                sent -= n
                continue
            self.sock.sendall(memoryview(buf)[sent:])
            sent = 0

    # ---- receiving -------------------------------------------------------------------------
    def recv(self) -> Any:
        """Receive one message: JSON data, or a `compact.Message` for a compact frame.

        Raises ConnectionClosed when the peer closed between frames, FrameError when a frame is
        bad (its `recoverable` says whether the next frame can still be read; FrameTooLarge
        frames were skipped and are recoverable), OSError from the socket.
        """
        if not self._fill(HEADER_BYTES):
            raise ConnectionClosed("the peer closed the connection")
        try:
            flags, header_len, body_len = unpack_fixed(self._buf, self._start)
        except VersionMismatch as exc:
            raise self._other_version(exc) from None
        self._start += HEADER_BYTES
        size = header_len + body_len
        fd = self._fds.popleft() if flags & FLAGS_WITH_FD and self._fds else None
        sock_fd = None
        try:
            if size > self.max_frame_bytes:
                if size > DRAIN_LIMIT_BYTES:
                    raise FrameError(f"frame of {size} bytes is far over the limit",
                                     recoverable=False)
                self._skip(size)
                raise FrameTooLarge(
                    f"frame of {size} bytes exceeds this side's {self.max_frame_bytes}-byte "
                    "limit; large tensors go through shared memory, so split the data")
            data = self._read(size)
            if flags & ~_CHANNEL_FLAGS or header_len % codec.ALIGN:
                raise FrameError(f"malformed frame (flags {flags:#x}, header {header_len} bytes)")
            mapping: codec.Segment | None = None
            if flags & FLAG_POOL:
                if flags & FLAG_SOCKET:
                    raise FrameError("a socket frame cannot point into a pool")
                pool_fd, fd = (fd if flags & FLAG_SEGMENT else None), None
                mapping = self._pooled(pool_fd)
            elif flags & FLAG_SOCKET:
                if fd is None or flags & FLAG_SEGMENT or flags & FLAG_COMPACT:
                    raise FrameError("a socket frame must be JSON and carry only the socket")
                sock_fd, fd = fd, None
            elif flags & FLAG_SEGMENT:
                if fd is None:
                    raise FrameError("the frame announces a shared-memory segment but no "
                                     "descriptor came with it")
                descriptor, fd = fd, None
                try:
                    mapping = segment.open_mapping(descriptor)
                except (ValueError, OSError) as exc:
                    raise FrameError(f"cannot map the frame's shared memory: {exc}") from None
        finally:
            if fd is not None:
                os.close(fd)
        if flags & FLAG_COMPACT:
            return compact.decode(data, header_len, mapping)
        message = codec.decode(data, header_len, mapping)
        if sock_fd is not None:
            if not isinstance(message, dict):
                os.close(sock_fd)
                raise FrameError("a socket frame's header must be a JSON object")
            message["socket_fd"] = sock_fd  # the receiver owns the descriptor now
        return message

    def _pooled(self, fd: int | None) -> bytearray | memoryview | None:
        """The segment of a frame flagged FLAG_POOL, copied out of the peer's pool (adopted
        from `fd` when the frame brings a new one), or lent in place (`borrow`); from now on
        this side answers through a pool of its own."""
        data: bytearray | memoryview | None
        try:
            if fd is not None:
                self._pool_in.adopt(fd)
            if self.borrow and not self._pool_in.lending:
                data = self._pool_in.lend()
            else:  # (a peer that wrote a frame into a pool still lent out is answered too)
                data = self._pool_in.take()
        except (ValueError, OSError) as exc:
            raise FrameError(f"cannot read the line's pool: {exc}") from None
        if self._pool_out is None and segment.available():
            self._pool_out = PoolWriter()
        return data

    def _other_version(self, exc: VersionMismatch) -> FrameError:
        """The error for a frame of another protocol version: with what the peer said when the
        frame is a small JSON error reply (a salusd that cannot read a frame answers with one
        before it closes), else `exc` itself. Not recoverable either way."""
        size = exc.header_len + exc.body_len
        if size > _OTHER_VERSION_REPLY_BYTES or exc.header_len % codec.ALIGN:
            return exc
        self._start += HEADER_BYTES
        try:
            reply = json.loads(bytes(self._read(size)[:exc.header_len]).decode())
        except (FrameError, OSError, ValueError, RecursionError):
            return exc
        if not (isinstance(reply, dict) and reply.get("ok") is False):
            return exc
        return FrameError(f"{exc}; salusd said: {str(reply.get('message'))[:2000]}",
                          recoverable=False)

    @property
    def lending(self) -> bool:
        """Whether a pooled frame's tensors view the peer's pool until `give_back`."""
        return self._pool_in.lending

    def give_back(self, *, leaving: bool = False, retire: bool = True) -> None:
        """Done with the frames received so far: the pooled frame lent out (`borrow`) is marked
        taken, or, when a tensor still views it (the job kept it), its pool retired and this
        line copies pooled frames from then on (a job that keeps its arguments would otherwise
        hold a pool per call); with `retire` False such a frame stays lent instead.
        `leaving`: the line goes on in another process, and this one never uses those tensors
        again: the frame is marked taken whatever views it here."""
        if self._pool_in.give_back(leaving=leaving, retire=retire) is False:
            self.borrow = False

    def pool_descriptor(self) -> int | None:
        """The descriptor of the pool the peer sends large tensors through (None: none yet),
        for handing this line on to another process (which `adopt_pool`s it)."""
        return self._pool_in.fd

    def adopt_pool(self, fd: int) -> None:
        """Read the peer's pooled frames from the pool `fd` (owned from now on): the line was
        handed on from a process that had it."""
        self._pool_in.adopt(fd)

    def buffered(self) -> bool:
        """Whether bytes of a next frame are already read (select would not see them)."""
        return self._end > self._start

    def ready(self) -> bool:
        """Whether a `recv` now would find something to read without waiting for it."""
        return self.buffered() or bool(select.select([self.sock], [], [], 0)[0])

    def frame_buffered(self) -> bool:
        """Whether a whole next frame is already read, so that `recv` returns it (or raises
        its error) without touching the socket."""
        have = self._end - self._start
        if have < HEADER_BYTES:
            return False
        try:
            _, header_len, body_len = unpack_fixed(self._buf, self._start)
        except FrameError:
            return True  # recv raises it at once
        return have >= HEADER_BYTES + header_len + body_len

    def readable(self, seconds: float) -> bool:
        """Sleep until a next frame's bytes arrive, at most `seconds` (rounded down to whole
        milliseconds, poll's grain); whether they came."""
        return self._end > self._start or bool(self._look(int(seconds * 1000)))

    def _look(self, timeout_ms: int) -> list[tuple[int, int]]:
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        return self._poller.poll(timeout_ms)

    def poll(self, seconds: float) -> bool:
        """Wait up to `seconds` without sleeping for a next frame's bytes (`spin`); whether
        they came."""
        if self._end > self._start:
            return True
        return bool(spin(lambda: self._look(0), time.perf_counter() + seconds))

    def send_socket(self, message: dict[str, Any], fd: int) -> None:
        """Send JSON `message` with the connected socket `fd` (FLAG_SOCKET); the caller keeps
        its own descriptor and closes it."""
        enc = codec.encode(message, shm_threshold=math.inf)
        fixed = _FIXED.pack(MAGIC, VERSION, FLAG_SOCKET, 0, len(enc.header), enc.inline_size)
        self._send_all([fixed, enc.header, *enc.inline],
                       HEADER_BYTES + len(enc.header) + enc.inline_size, fd)

    def _recv_some(self) -> int:
        """One recvmsg into the free tail of the buffer; queues descriptors that come along."""
        got, ancillary, msg_flags, _ = self.sock.recvmsg_into([self._view[self._end:]],
                                                              _ANC_BYTES, _RECV_FLAGS)
        queue_descriptors(ancillary, msg_flags, self._fds)
        self._end += got
        return got

    def _fill(self, n: int) -> bool:
        """Buffer at least `n` bytes; False on a clean end of stream before any of them."""
        while self._end - self._start < n:
            if len(self._buf) - self._start < n:
                pending = bytes(self._view[self._start:self._end])
                self._buf[: len(pending)] = pending
                self._start, self._end = 0, len(pending)
            if self._recv_some() == 0:
                if self._end == self._start:
                    return False
                raise FrameError("the connection closed in the middle of a frame",
                                 recoverable=False)
        return True

    def _read(self, size: int) -> bytearray:
        """The next `size` bytes in a fresh buffer (tensors will be views of it)."""
        data = bytearray(size)
        out = memoryview(data)
        have = min(size, self._end - self._start)
        out[:have] = self._view[self._start:self._start + have]
        self._start += have
        while have < size:
            need = size - have
            if need >= len(self._buf):
                got = self.sock.recv_into(out[have:], need, socket.MSG_WAITALL)
            elif self._fill(need):
                out[have:] = self._view[self._start:self._start + need]
                self._start, got = self._start + need, need
            else:
                got = 0
            if got == 0:
                raise FrameError("the connection closed in the middle of a frame",
                                 recoverable=False)
            have += got
        return data

    def _skip(self, size: int) -> None:
        """Read and discard `size` bytes."""
        take = min(size, self._end - self._start)
        self._start += take
        size -= take
        while size:
            self._start = self._end = 0
            got = self.sock.recv_into(self._view, min(size, len(self._buf)))
            if got == 0:
                raise FrameError("the connection closed in the middle of a frame",
                                 recoverable=False)
            size -= got

    def close(self) -> None:
        """Close the socket and any descriptors received but not claimed by a frame."""
        while self._fds:
            os.close(self._fds.popleft())
        if self._pool_out is not None:
            self._pool_out.close()
        self._pool_in.close()
        self.sock.close()
