"""The references a frame makes to its own bytes, checked without torch.

A JSON header's tensor, byte-string and pickle references (`codec.py`) and a compact header's
tensor descriptors (`compact.py`) name a segment, an offset and a size. The executor decodes
them; the daemon, which never imports torch, checks them with these same rules before it
forwards a client's frame, so that a forged reference (an offset past the body, an unknown
dtype) is the client's `bad_request`, naming the field, and never an error inside the executor
that would cost the job. `codec` and `compact` take their dtype table, dimension limit and part
bounds from here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any, TypeVar

from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.frames import ALIGN, COMPACT_HEAD, OP_CALL, OP_RESULT, FrameError

# Bytes per element by dtype name. Compact headers name a dtype by its index here: append new
# dtypes, never reorder.
DTYPE_ITEMSIZES: dict[str, int] = {
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "complex32": 4, "complex64": 8,
    "complex128": 16, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
DTYPE_NAMES = tuple(DTYPE_ITEMSIZES)
MAX_DIMS = 64
STRIDED = 0x1
TENSOR = struct.Struct("<BBBBIQ")  # dtype code, ndim, segment, flags, reserved, offset
D = TypeVar("D")


def part_offset(seg: object, off: object, nbytes: int, body_bytes: int,
                segment_bytes: int | None) -> int:
    """`off` when a part of `nbytes` bytes at offset `off` of segment `seg` (0: the inline body
    of `body_bytes`, 1: the shared-memory segment of `segment_bytes`, None when the frame has
    none) lies inside it; FrameError otherwise."""
    if type(off) is not int or off < 0:
        raise FrameError(f"bad part offset {off!r}")
    if seg == 0:
        size = body_bytes
    elif seg == 1 and segment_bytes is not None:
        size = segment_bytes
    else:
        raise FrameError(f"part refers to segment {seg!r}, which the frame does not carry")
    if off + nbytes > size:
        raise FrameError(f"a part of {nbytes} bytes at offset {off} runs past the end of "
                         f"its {size}-byte segment")
    return off


def check_aligned(off: int, itemsize: int) -> None:
    if off % itemsize:
        raise FrameError(f"tensor offset {off} is not aligned to its {itemsize}-byte elements")


def dense_permutation(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when `strides` (in elements) lay `shape` out densely without overlap: contiguous up
    to an order of the dimensions, so its elements fill exactly prod(shape) slots from the
    first."""
    expected = 1
    for stride, size in sorted(zip(strides, shape, strict=True)):
        if size == 1:
            continue  # a size-1 dimension's stride never addresses memory
        if stride != expected:
            return False
        expected *= size
    return True


def check_json(message: object, body_bytes: int, segment_bytes: int | None) -> None:
    """Check every reference in a JSON header's `message` as `codec.decode` will;
    BadRequest naming the field (`objects.storages[0].dtype`) otherwise."""
    objects: list[tuple[dict[str, Any], str]] = []  # every dict, each before its contents
    stack: list[tuple[object, str]] = [(message, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, dict):
            objects.append((value, path))
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
    for value, path in reversed(objects):  # innermost first, as the decoder meets them
        try:
            _check_ref(value, body_bytes, segment_bytes)
        except FrameError as exc:
            raise BadRequest(f"field {path or 'the header'!r}: {exc}") from None


def _check_ref(ref: dict[str, Any], body_bytes: int, segment_bytes: int | None) -> None:
    kind = ref.get("$")
    if kind is None:
        return
    if kind == "t":
        itemsize, shape = tensor_spec(ref, DTYPE_ITEMSIZES)
        numel = math.prod(shape)
        if numel:
            check_aligned(part_offset(ref.get("seg"), ref.get("off"), numel * itemsize,
                                      body_bytes, segment_bytes), itemsize)
    elif kind == "b":
        n = ref.get("len")
        if type(n) is not int or n < 0:
            raise FrameError(f"bad byte-string length {n!r}")
        if n:
            part_offset(ref.get("seg"), ref.get("off"), n, body_bytes, segment_bytes)
    elif kind == "p":
        data, storages = ref.get("data"), ref.get("storages")
        if not (isinstance(data, dict) and data.get("$") == "b" and isinstance(storages, list)
                and all(isinstance(s, dict) and s.get("$") == "t" and s.get("dtype") == "uint8"
                        and isinstance(s.get("shape"), list) and len(s["shape"]) == 1
                        for s in storages)):
            raise FrameError("a pickled object needs bytes 'data' and uint8 'storages'")
    else:
        raise FrameError(f"unknown reference kind {kind!r}")


def tensor_spec(ref: dict[str, Any], dtypes: Mapping[str, D]) -> tuple[D, list[int]]:
    """A JSON tensor reference's dtype, looked up by name in `dtypes` (item sizes here, torch
    dtypes in `codec`), and its shape; FrameError naming what is wrong."""
    name, shape = ref.get("dtype"), ref.get("shape")
    dtype = dtypes.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise FrameError(f"unknown tensor dtype {name!r}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)):
        raise FrameError(f"tensor shape must be a list of non-negative ints, got {shape!r}")
    return dtype, shape


def check_compact(header: bytes, body_bytes: int, segment_bytes: int | None) -> None:
    """Check a compact header as `compact.decode` will; BadRequest naming the field
    otherwise."""
    try:
        _check_compact(header, body_bytes, segment_bytes)
    except FrameError as exc:
        raise BadRequest(f"compact frame: {exc}") from None
    except (struct.error, UnicodeDecodeError) as exc:
        raise BadRequest(f"compact frame: {exc}") from None


def _check_compact(header: bytes, body_bytes: int, segment_bytes: int | None) -> None:
    header_len = len(header)
    if header_len < COMPACT_HEAD.size:
        raise FrameError("the compact header is shorter than its head")
    op, count, job_len, _, _ = COMPACT_HEAD.unpack_from(header, 0)
    if op not in (OP_CALL, OP_RESULT):
        raise FrameError(f"unknown compact op {op}")
    pos = COMPACT_HEAD.size + job_len
    if pos > header_len:
        raise FrameError("the job id runs past the header")
    header[COMPACT_HEAD.size:pos].decode()
    for i in range(count):
        if pos + TENSOR.size > header_len:
            raise FrameError(f"tensor {i}'s descriptor runs past the end of the header")
        code, ndim, seg, flags, reserved, off = TENSOR.unpack_from(header, pos)
        if code >= len(DTYPE_NAMES):
            raise FrameError(f"tensor {i}: unknown dtype code {code}")
        if ndim > MAX_DIMS or flags & ~STRIDED or reserved:
            raise FrameError(f"tensor {i}: malformed descriptor (ndim {ndim}, flags "
                             f"{flags:#x}, reserved {reserved:#x})")
        dims = struct.Struct(f"<{2 * ndim if flags else ndim}q")
        end = pos + TENSOR.size + dims.size
        if end > header_len:
            raise FrameError(f"tensor {i}'s sizes run past the end of the header")
        fields = dims.unpack_from(header, pos + TENSOR.size)
        shape = fields[:ndim]
        if ndim and min(shape) < 0:
            raise FrameError(f"tensor {i}: sizes must be non-negative, got {list(shape)}")
        numel = math.prod(shape)
        if numel:
            itemsize = DTYPE_ITEMSIZES[DTYPE_NAMES[code]]
            check_aligned(part_offset(seg, off, numel * itemsize, body_bytes, segment_bytes),
                          itemsize)
            strides = fields[ndim:]
            if flags and (any(s < 0 for s in strides)
                          or not dense_permutation(shape, strides)):
                raise FrameError(f"tensor {i}: strides {list(strides)} do not lay out sizes "
                                 f"{list(shape)} densely")
        pos = end
    if pos + (-pos % ALIGN) != header_len:
        raise FrameError(f"the header is {header_len} bytes but its fields end at byte {pos}")
