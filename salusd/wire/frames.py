"""Frames without their payloads: the fixed header, a non-blocking reader, JSON-only frames.

The daemon routes frames between clients and executors without decoding their tensors or
unpickling their objects, so this module imports only the standard library (no torch). A frame
(all integers little endian):

    bytes 0-3    magic b"SLUS"
    byte  4      version
    byte  5      flags: bit 0 = a descriptor travels with the frame (a shared-memory segment
                 on the data plane; an executor's socket from the daemon to the zygote),
                 bit 1 = the header is compact (binary, `compact.py`) rather than JSON,
                 bit 2 = the descriptor is a connected socket: a job's direct call channel,
                 bit 3 = the segment is in the sender's pool (`pool.py`; a descriptor with it
                 is a new pool), only on a job's direct line: the daemon refuses it
    bytes 6-7    reserved, 0
    bytes 8-11   header length in bytes (uint32): JSON space-padded, or compact zero-padded,
                 to a multiple of 64
    bytes 12-19  body length in bytes (uint64): the inline binary parts
    then the header, then the body.

`FrameReader` assembles frames from whatever a non-blocking socket hands it. It holds only the
bytes that arrived (a frame that announces 64 MiB and sends nothing pins nothing), and says
since when a frame has been incomplete so the server can drop peers that stall mid-frame.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from salus.daemon.wire.errors import ERRORS_BY_CODE, BadRequest, SalusError

MAGIC = b"SLUS"
VERSION = 2
FLAG_SEGMENT = 0x1
FLAG_COMPACT = 0x2
FLAG_SOCKET = 0x4
FLAG_POOL = 0x8
FLAGS_WITH_FD = FLAG_SEGMENT | FLAG_SOCKET
KNOWN_FLAGS = FLAG_SEGMENT | FLAG_COMPACT | FLAG_SOCKET
FIXED = struct.Struct("<4sBBHIQ")
HEADER_BYTES = FIXED.size
ALIGN = 64
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_QUEUED_FDS = 4
ANC_BYTES = socket.CMSG_SPACE(MAX_QUEUED_FDS * array.array("i").itemsize)
RECV_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_CTRUNC = int(socket.MSG_CTRUNC)
# The compact head (op u8, tensor count u8, job-id length u16, aux u32, value f64), its
# revision and ops: see compact.py, which the daemon does not import (it needs torch).
COMPACT_HEAD = struct.Struct("<BBHId")
COMPACT_REVISION = 2
OP_CALL, OP_RESULT = 3, 0x83
FUNCTION_MASK = 0xFFFF
MAX_JSON_DEPTH = 64  # lists and dicts in a JSON header; a pytree of arguments is far shallower
_TOO_DEEP = (f"the JSON header nests lists and objects more than {MAX_JSON_DEPTH} levels deep; "
             "send flatter arguments")


class FrameError(BadRequest):
    """A frame could not be read. `recoverable` is False when the stream lost its framing and
    the connection must be dropped; otherwise the frame was consumed whole."""

    code = "bad_frame"

    def __init__(self, message: str, *, recoverable: bool = True) -> None:
        super().__init__(message)
        self.recoverable = recoverable


class ConnectionClosed(ConnectionError):
    """The peer closed the connection between two frames."""


class FrameTooLarge(FrameError):
    """A frame's inline part (header + body) is over the receiver's limit."""

    code = "too_large"


class VersionMismatch(FrameError):
    """A salusd frame of another protocol version. The fixed header has had the same layout in
    every version, so its lengths can still be read (and an error sent back in the peer's
    version, which it can parse)."""

    def __init__(self, version: int, header_len: int, body_len: int) -> None:
        super().__init__(f"frame version {version}, this side speaks {VERSION}: install "
                         "matching salusd and adapter versions", recoverable=False)
        self.version, self.header_len, self.body_len = version, header_len, body_len


def unpack_fixed(buf: bytes | bytearray, offset: int = 0) -> tuple[int, int, int]:
    """(flags, header bytes, body bytes) of the fixed header at `buf[offset:]`; FrameError
    (framing lost) when it is not a salusd frame, VersionMismatch for another version's."""
    magic, version, flags, _, header_len, body_len = FIXED.unpack_from(buf, offset)
    if magic != MAGIC:
        raise FrameError(f"not a salusd frame (magic {bytes(magic)!r}, expected {MAGIC!r}): "
                         "is this a salusd socket, and the client a salusd client?",
                         recoverable=False)
    if version != VERSION:
        raise VersionMismatch(version, header_len, body_len)
    return flags, header_len, body_len


_ERRORS: dict[str, type[SalusError]] = {
    **ERRORS_BY_CODE, FrameError.code: FrameError, FrameTooLarge.code: FrameTooLarge,
}


def error_from_reply(code: object, message: object) -> SalusError:
    """The salus error a remote error reply stands for (SalusError for an unknown code)."""
    cls = _ERRORS.get(code, SalusError) if isinstance(code, str) else SalusError
    return cls(str(message))


def reply_result(reply: object) -> object:
    """The result of a JSON reply; raises the salus error of an error reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise FrameError(f"salusd sent a malformed reply: {reply!r}")
    if reply["ok"]:
        return reply.get("result")
    raise error_from_reply(reply.get("code"), reply.get("message"))


def passed_fd(message: Any) -> int | None:
    """The descriptor a socket frame brought (`Channel.recv` and `JsonChannel.recv`
    put it under "socket_fd"; the receiver owns it), or None."""
    fd = message.get("socket_fd") if isinstance(message, dict) else None
    return fd if isinstance(fd, int) else None


@dataclass(eq=False)
class RawFrame:
    """One whole frame as received: its flags, header and body bytes, and the shared-memory
    descriptor that came with it (owned by the frame until `close_fd` or it is sent on)."""

    flags: int
    header: bytes
    body: bytes
    fd: int | None = None
    version: int = VERSION  # another only for an error sent to a peer of that version

    @property
    def compact(self) -> bool:
        return bool(self.flags & FLAG_COMPACT)

    def buffers(self) -> list[bytes]:
        """The frame's bytes as they go on the wire."""
        fixed = FIXED.pack(MAGIC, self.version, self.flags, 0, len(self.header),
                           len(self.body))
        return [fixed, self.header, self.body]

    def size(self) -> int:
        return HEADER_BYTES + len(self.header) + len(self.body)

    def json(self) -> object:
        """The JSON header as plain data: tensor, bytes and pickle references stay the dicts
        they are in the header (nothing is decoded). FrameError for a compact frame, a header
        that is not UTF-8 JSON (as the executors decode it) or one nested deeper than
        MAX_JSON_DEPTH."""
        if self.compact:
            raise FrameError("expected a JSON frame, got a compact one")
        try:
            message = json.loads(self.header.decode())
        except ValueError as exc:
            raise FrameError(f"frame header is not UTF-8 JSON: {exc}") from None
        except RecursionError:
            raise FrameError(_TOO_DEEP) from None
        if self.header.count(b"[") + self.header.count(b"{") > MAX_JSON_DEPTH and (
                json_depth(message) > MAX_JSON_DEPTH):
            raise FrameError(_TOO_DEEP)
        return message

    def compact_head(self) -> tuple[int, str, int]:
        """(op, job id, aux) of a compact frame; FrameError when it is malformed."""
        if len(self.header) < COMPACT_HEAD.size:
            raise FrameError("compact header shorter than its head")
        op, _count, job_len, aux, _value = COMPACT_HEAD.unpack_from(self.header, 0)
        end = COMPACT_HEAD.size + job_len
        if end > len(self.header):
            raise FrameError("the job id runs past the compact header")
        try:
            job = self.header[COMPACT_HEAD.size:end].decode()
        except UnicodeDecodeError:
            raise FrameError("the job id is not UTF-8") from None
        return op, job, aux

    def duplicate(self) -> RawFrame:
        """The same frame with its own copy of the descriptor (to send it twice)."""
        return RawFrame(self.flags, self.header, self.body,
                        os.dup(self.fd) if self.fd is not None else None)

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def json_depth(value: object) -> int:
    """How deeply lists and dicts nest in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def error_reply_frame(exc: SalusError, version: int = VERSION) -> RawFrame:
    """The JSON error reply for `exc`, in frame `version` (a peer of another version can read
    it: the fixed header's layout and the reply's fields have not changed)."""
    frame = json_frame({"ok": False, "code": exc.code, "message": str(exc)})
    frame.version = version
    return frame


def queue_descriptors(ancillary: list[tuple[int, int, bytes]], msg_flags: int,
                      fds: deque[int]) -> None:
    """Queue the descriptors a recvmsg brought (they belong to the next frames that announce
    one); FrameError, not recoverable, when the peer sent more than frames can claim."""
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if msg_flags & _CTRUNC or len(fds) > MAX_QUEUED_FDS:
        raise FrameError("the peer sent more descriptors than frames", recoverable=False)


def json_frame(message: object) -> RawFrame:
    """A frame holding only JSON `message` (no tensors or pickles)."""
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode()
    return RawFrame(0, text + b" " * (-len(text) % ALIGN), b"")


@dataclass(eq=False)
class FrameReader:
    """Assembles frames from a non-blocking stream socket; one per connection.

    `max_frame_bytes` bounds a frame's header + body. `pending_bytes` is what an incomplete
    frame holds now; `started_at` when its first byte came (None between frames), on whatever
    clock the caller passes to `read`.
    """

    sock: socket.socket
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    started_at: float | None = None
    _buf: bytearray = field(default_factory=bytearray)
    _fds: deque[int] = field(default_factory=deque)

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def read(self, now: float, chunk: int = 256 * 1024) -> tuple[list[RawFrame], bool]:
        """Take what the socket has (one recvmsg) and return (complete frames, closed).

        Raises FrameError for a frame that breaks the protocol (not recoverable: the
        connection must be dropped) and OSError from the socket."""
        try:
            data, ancillary, msg_flags, _ = self.sock.recvmsg(chunk, ANC_BYTES, RECV_FLAGS)
        except (BlockingIOError, InterruptedError):
            return [], False
        queue_descriptors(ancillary, msg_flags, self._fds)
        if not data:
            if self._buf:
                raise FrameError("the connection closed in the middle of a frame",
                                 recoverable=False)
            return [], True
        if not self._buf:
            self.started_at = now
        self._buf += data
        frames = self._frames()
        if frames and self._buf:
            self.started_at = now  # the rest is a new frame, begun just now
        return frames, False

    def _frames(self) -> list[RawFrame]:
        out = []
        while len(self._buf) >= HEADER_BYTES:
            flags, header_len, body_len = unpack_fixed(self._buf)
            if flags & ~KNOWN_FLAGS or header_len % ALIGN:
                raise FrameError(f"malformed frame (flags {flags:#x}, header {header_len} "
                                 "bytes)", recoverable=False)
            size = header_len + body_len
            if size > self.max_frame_bytes:
                raise FrameTooLarge(f"frame of {size} bytes exceeds the {self.max_frame_bytes}"
                                    "-byte limit; large tensors go through shared memory, so "
                                    "split the data", recoverable=False)
            end = HEADER_BYTES + size
            if len(self._buf) < end:
                break
            fd = None
            if flags & FLAGS_WITH_FD:
                if not self._fds:
                    raise FrameError("a frame announces a shared-memory segment but no "
                                     "descriptor came with it", recoverable=False)
                fd = self._fds.popleft()
            header = bytes(self._buf[HEADER_BYTES:HEADER_BYTES + header_len])
            body = bytes(self._buf[HEADER_BYTES + header_len:end])
            del self._buf[:end]
            out.append(RawFrame(flags, header, body, fd))
        if not self._buf:
            self.started_at = None
        return out

    def close(self) -> None:
        """Close descriptors received but not claimed by a frame."""
        while self._fds:
            os.close(self._fds.popleft())
        self._buf.clear()
