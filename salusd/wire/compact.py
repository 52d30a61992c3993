"""Compact frames: a struct-packed header for the per-iteration calls and their replies.

A job's iteration crosses the socket thousands of times, so calls whose arguments are a flat
tuple of tensors, and replies that are a tensor, a float, None or a flat tuple of tensors, skip
JSON and pickle: the frame's flags carry FLAG_COMPACT (`frames.py`) and the header is, little
endian,

    bytes 0-15   op (u8), tensor count (u8), job-id length in bytes (u16), aux (u32),
                 value (f64)
    then         the job id, UTF-8
    then         per tensor 16 bytes: dtype code (u8, `codec.DTYPE_CODES`), ndim (u8),
                 segment (u8: 0 inline body, 1 shared memory), flags (u8: bit 0 = strides
                 follow), reserved u32 (0), byte offset in its segment (u64);
                 then ndim i64 sizes, then ndim i64 strides (in elements) when flagged
    zero-padded to a multiple of 64 bytes (`frames.ALIGN`).

Ops and what they carry:

    OP_CALL    request  job; aux = function id (bits 0-15) | AUX_RNG; tensors = the arguments
    OP_RESULT  reply    aux = result kind (bits 0-3: KIND_*) | AUX_RNG; tensors; value

With AUX_RNG the last tensor is the caller's (request) or the job's (reply) random-generator
state (`torch.get_rng_state()`), sent only when it changed. Errors, and every other request,
use the JSON header of `codec.py`. A peer sends compact frames only after the other side's
`ping` reply announced `"compact": REVISION`.

A contiguous tensor goes out as its bytes (no copy) and arrives as a `torch.frombuffer` view of
the frame. A tensor whose strides are a permutation of a contiguous layout (a transpose,
channels-last) goes out the same way with its strides, so it arrives with its layout; any other
strided tensor (a slice, an expansion) is made contiguous first. Decoding checks every field
against the frame and raises a recoverable FrameError, never anything else.
"""

from __future__ import annotations

import math
import struct

import torch

from salus.daemon.wire.codec import (
    DTYPE_CODES,
    DTYPES_BY_CODE,
    Encoded,
    FrameError,
    Segment,
    part_region,
    raw_bytes,
    sendable,
    tensor_view,
)
from salus.daemon.wire.frames import (
    ALIGN,
    COMPACT_HEAD,
    COMPACT_REVISION,
    OP_CALL,
    OP_RESULT,
)
from salus.daemon.wire.refs import MAX_DIMS, dense_permutation

REVISION = COMPACT_REVISION
OP_NAMES = {OP_CALL: "call", OP_RESULT: "result"}
AUX_RNG = 1 << 16
KIND_MASK = 0xF
KIND_TUPLE, KIND_TENSOR, KIND_FLOAT, KIND_NONE = 0, 1, 2, 3
MAX_TENSORS = 255
_STRIDED = 0x1
_HEAD = COMPACT_HEAD
_TENSOR = struct.Struct("<BBBBIQ")
# One struct per (ndim, strided): a descriptor packs and unpacks in one call.
_DESC = [struct.Struct(f"<BBBBIQ{n}q") for n in range(MAX_DIMS + 1)]
_DESC_STRIDED = [struct.Struct(f"<BBBBIQ{2 * n}q") for n in range(MAX_DIMS + 1)]
_MAX_JOB_BYTES = 0xFFFF


class Message:
    """A compact request or reply: `op` (OP_*), `job` id (empty in replies), `tensors`, `aux`
    (function id or result kind, with AUX_RNG) and a float `value` (KIND_FLOAT results)."""

    __slots__ = ("op", "job", "tensors", "aux", "value")

    def __init__(self, op: int, job: str = "", tensors: tuple[torch.Tensor, ...] = (),
                 aux: int = 0, value: float = 0.0) -> None:
        self.op = op
        self.job = job
        self.tensors = tensors
        self.aux = aux
        self.value = value

    def __repr__(self) -> str:
        return (f"Message({OP_NAMES.get(self.op, self.op)}, job={self.job!r}, "
                f"{len(self.tensors)} tensors, value={self.value!r})")


def encode(message: Message, *, shm_threshold: float) -> Encoded:
    """Encode `message`; tensors of at least `shm_threshold` bytes go to the segment.

    Raises TypeError for a tensor that cannot be sent and ValueError for a message that does
    not match its op.
    """
    op, tensors = message.op, message.tensors
    if op not in OP_NAMES or len(tensors) > MAX_TENSORS:
        raise ValueError(f"compact op {op} with {len(tensors)} tensors cannot be sent")
    job = message.job.encode()
    if len(job) > _MAX_JOB_BYTES:
        raise ValueError(f"a job id is at most {_MAX_JOB_BYTES} bytes, got {len(job)}")
    out = Encoded()
    parts = [_HEAD.pack(op, len(tensors), len(job), message.aux, message.value), job]
    for t in tensors:
        _describe(t, out, shm_threshold, parts)
    header = b"".join(parts)
    out.header = header + bytes(-len(header) % ALIGN)
    return out


def _describe(t: torch.Tensor, out: Encoded, shm_threshold: float, parts: list[bytes]) -> None:
    """Append `t`'s descriptor to `parts` and its bytes to `out`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a compact message carries tensors, got {type(t).__name__}")
    t = sendable(t)
    shape = t.shape
    strides = None
    if not t.is_contiguous():
        strides = t.stride()
        if not dense_permutation(shape, strides):
            t, strides = t.contiguous(), None
    nbytes = t.nbytes
    seg = off = 0
    if nbytes:
        out.keepalive.append(t)
        seg, off = out.add_part(raw_bytes(t, nbytes), shm_threshold)
    code, ndim = DTYPE_CODES[t.dtype], len(shape)
    if strides is None or not nbytes:
        parts.append(_DESC[ndim].pack(code, ndim, seg, 0, 0, off, *shape))
    else:
        parts.append(_DESC_STRIDED[ndim].pack(code, ndim, seg, _STRIDED, 0, off, *shape,
                                              *strides))


def decode(data: bytearray, header_len: int, segment: Segment | None) -> Message:
    """Decode a compact frame: `data` is the header (`header_len` bytes) then the inline body;
    tensors are views of `data` and of `segment` (no copy). Raises FrameError (recoverable) on
    any inconsistency."""
    try:
        return _decode(data, header_len, segment)
    except FrameError:
        raise
    except Exception as exc:
        raise FrameError(f"compact frame header could not be decoded: {type(exc).__name__}: "
                         f"{exc}") from None


def _decode(data: bytearray, header_len: int, segment: Segment | None) -> Message:
    if header_len < _HEAD.size:
        raise FrameError(f"compact header of {header_len} bytes is shorter than its "
                         f"{_HEAD.size}-byte head")
    op, count, job_len, aux, value = _HEAD.unpack_from(data, 0)
    if op not in OP_NAMES:
        raise FrameError(f"unknown compact op {op}; expected one of "
                         f"{sorted(OP_NAMES.values())}")
    pos = _HEAD.size + job_len
    if pos > header_len:
        raise FrameError(f"the job id ({job_len} bytes) runs past the {header_len}-byte header")
    job = data[_HEAD.size:pos].decode()
    tensors = []
    for _ in range(count):
        tensor, pos = _tensor(data, pos, header_len, segment)
        tensors.append(tensor)
    if pos + (-pos % ALIGN) != header_len:
        raise FrameError(f"compact header is {header_len} bytes but its fields end at byte {pos}")
    return Message(op, job, tuple(tensors), aux, value)


def _tensor(data: bytearray, pos: int, header_len: int,
            segment: Segment | None) -> tuple[torch.Tensor, int]:
    """The tensor described at byte `pos` of the header, and the position after it."""
    if pos + _TENSOR.size > header_len:
        raise FrameError("a tensor descriptor runs past the end of the header")
    code, ndim, seg, flags, reserved, off = _TENSOR.unpack_from(data, pos)
    dtype = DTYPES_BY_CODE.get(code)
    if dtype is None:
        raise FrameError(f"unknown tensor dtype code {code}")
    if ndim > MAX_DIMS or flags & ~_STRIDED or reserved:
        raise FrameError(f"malformed tensor descriptor (ndim {ndim}, flags {flags:#x}, "
                         f"reserved {reserved:#x})")
    desc = (_DESC_STRIDED if flags else _DESC)[ndim]
    end = pos + desc.size
    if end > header_len:
        raise FrameError("a tensor's sizes run past the end of the header")
    fields = desc.unpack_from(data, pos)
    shape = fields[6:6 + ndim]
    if ndim and min(shape) < 0:
        raise FrameError(f"tensor sizes must be non-negative, got {list(shape)}")
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype), end
    buf, at = part_region(data, header_len, segment, seg, off, numel * dtype.itemsize)
    flat = tensor_view(buf, at, dtype, numel)
    if flags:
        strides = fields[6 + ndim:]
        if any(s < 0 for s in strides) or not dense_permutation(shape, strides):
            raise FrameError(f"tensor strides {list(strides)} do not lay out sizes "
                             f"{list(shape)} densely")
        return flat.as_strided(shape, strides), end
    if ndim == 1:
        return flat, end
    return (flat.view(*shape) if ndim else flat.view(())), end
