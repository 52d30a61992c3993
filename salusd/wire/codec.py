"""Message codec: a JSON header whose tensors, byte strings and pickled objects point at binary
parts, so tensor bytes never pass through JSON.

A message is JSON data (dicts with str keys, lists, numbers, strings, None) that may also hold
`torch.Tensor`, `bytes` and `Pickled(obj)` values. Each of those becomes a reference object in the
header, the only dicts that carry the reserved key "$":

    {"$": "t", "dtype": "float32", "shape": [2, 3], "seg": 0, "off": 128}   a tensor
    {"$": "b", "len": 10, "seg": 0, "off": 192}                            bytes
    {"$": "p", "data": <bytes ref>, "storages": [<uint8 tensor ref>, ...]}  a pickled object

`seg` 0 is the frame's inline body, `seg` 1 its shared-memory segment (`segment.py`); parts of
at least `shm_threshold` bytes go to the segment. Offsets are 64-byte aligned. Pickled objects
are written with cloudpickle (so classes from the client's `__main__` travel by value) and, the
way `torch.save` does it, with their tensor storages taken out of the pickle as parts: a model's
weights then cross in shared memory like any large tensor and arrive without a copy.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import mmap
import pickle
from typing import Any

import cloudpickle
import torch

from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.frames import ALIGN, FrameError
from salus.daemon.wire.refs import DTYPE_NAMES, check_aligned, part_offset, tensor_spec

_PAD = bytes(ALIGN)
Segment = mmap.mmap | bytearray | memoryview  # received: mapped, copied or lent out of a pool
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_NAME = {d: n for n, d in DTYPES.items()}
# Compact headers name a dtype by its index in refs.DTYPE_NAMES.
DTYPE_CODES: dict[torch.dtype, int] = {DTYPES[n]: i for i, n in enumerate(DTYPE_NAMES)
                                       if n in DTYPES}
DTYPES_BY_CODE: dict[int, torch.dtype] = {i: d for d, i in DTYPE_CODES.items()}


class Pickled:
    """Wrap an object to send it with cloudpickle; `what` names it in error messages as it
    reads after "cannot pickle" ("the call's result", "call arguments")."""

    __slots__ = ("obj", "what")

    def __init__(self, obj: Any, what: str = "object") -> None:
        self.obj = obj
        self.what = what


class PickledPayload:
    """A received pickled object; `load()` runs the unpickler (which may import and run code)."""

    def __init__(self, data: bytes, storages: list[torch.Tensor]) -> None:
        self.data = data
        self.storages = storages

    def load(self, what: str = "object", *, own: bool = False) -> Any:
        """Unpickle; raises BadRequest with the reason when the payload cannot be rebuilt.

        The tensors are views of the frame (its shared-memory segment) unless `own`: then they
        are copied into memory of their own first, as state that lives long should be (the
        segment's pages are shared-memory pages, which the kernel does not back with huge
        pages)."""
        try:
            storages = [s.clone() for s in self.storages] if own else self.storages
            return _StorageUnpickler(self.data, storages).load()
        except Exception as exc:
            raise BadRequest(
                f"could not unpickle the {what}: {type(exc).__name__}: {exc}; the classes and "
                "functions it uses must be defined in the script or importable by salusd"
            ) from exc


class Encoded:
    """An encoded message: header (padded to ALIGN bytes), inline body buffers, and the
    (offset, bytes) parts of the shared-memory segment; `keepalive` holds what the views borrow.
    Sizes are in bytes."""

    __slots__ = ("header", "inline", "inline_size", "segment", "segment_size", "keepalive")

    def __init__(self, header: bytes = b"") -> None:
        self.header = header
        self.inline: list[bytes | memoryview] = []
        self.inline_size = 0
        self.segment: list[tuple[int, memoryview]] = []
        self.segment_size = 0
        self.keepalive: list[object] = []

    def add_part(self, view: memoryview, shm_threshold: float) -> tuple[int, int]:
        """Place `view` in the segment (at least `shm_threshold` bytes) or inline; returns
        (segment number, byte offset): 1 is the shared-memory segment, 0 the inline body."""
        n = len(view)
        if n >= shm_threshold:
            off = self.segment_size
            self.segment.append((off, view))
            self.segment_size = round_up(off + n)
            return 1, off
        off = round_up(self.inline_size)
        if off > self.inline_size:
            self.inline.append(_PAD[: off - self.inline_size])
        self.inline.append(view)
        self.inline_size = off + n
        return 0, off


def encode(message: Any, *, shm_threshold: float) -> Encoded:
    """Encode `message`; parts of at least `shm_threshold` bytes go to the segment.

    Raises TypeError for values that cannot be sent.
    """
    enc = _Encoder(shm_threshold)
    text = json.dumps(message, default=enc.default, separators=(",", ":")).encode()
    enc.out.header = text + b" " * (-len(text) % ALIGN)
    return enc.out


def decode(data: bytearray, header_len: int, segment: Segment | None) -> Any:
    """Decode a frame: `data` is header then inline body; tensors are views of `data` and of
    `segment` (no copy). Raises FrameError (recoverable) on any inconsistency."""
    try:
        decoder = json.JSONDecoder(object_hook=_Decoder(data, header_len, segment).hook)
        return decoder.decode(data[:header_len].decode())
    except FrameError:
        raise
    except Exception as exc:
        raise FrameError(f"frame header could not be decoded: {type(exc).__name__}: "
                         f"{exc}") from None


def round_up(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return n + (-n % ALIGN)


def raw_bytes(t: torch.Tensor, nbytes: int) -> memoryview:
    """The bytes of contiguous CPU tensor `t` without a copy (ctypes keeps torch-only clients
    free of a numpy requirement); the caller keeps `t` alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def sendable(t: torch.Tensor) -> torch.Tensor:
    """`t` as a strided CPU tensor with its conjugate and negative bits resolved (copied only
    when it is not one already; it may still be non-contiguous). TypeError for a tensor that
    cannot be sent."""
    if t.dtype not in _DTYPE_NAME:  # the allow-list also keeps quantized tensors out
        raise TypeError(f"tensors of dtype {t.dtype} cannot be sent")
    if t.layout is not torch.strided or t.is_nested or t.is_meta:
        raise TypeError(f"only dense tensors with data can be sent, got {t.layout} on "
                        f"{t.device}")
    if not t.is_cpu or t.is_conj() or t.is_neg():
        t = t.detach().cpu().resolve_conj().resolve_neg()
    return t


def part_region(data: bytearray, base: int, segment: Segment | None, seg: object,
                off: object, nbytes: int) -> tuple[bytearray | Segment, int]:
    """Where a part of `nbytes` bytes at offset `off` of segment `seg` lies: (buffer, absolute
    byte offset). `data` holds the header (`base` bytes) then the inline body. Raises
    FrameError when the part is not inside a segment the frame carries."""
    at = part_offset(seg, off, nbytes, len(data) - base,
                     len(segment) if segment is not None else None)
    if seg == 0:
        return data, base + at
    assert segment is not None
    return segment, at


def tensor_view(buf: bytearray | Segment, off: int, dtype: torch.dtype,
                numel: int) -> torch.Tensor:
    """A flat tensor of `numel` elements viewing `buf` from byte `off` (no copy); FrameError
    when `off` is not aligned to the element size."""
    check_aligned(off, dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=off)


class _Encoder:
    def __init__(self, shm_threshold: float) -> None:
        self.threshold = shm_threshold
        self.out = Encoded()

    def place(self, view: memoryview) -> dict[str, int]:
        seg, off = self.out.add_part(view, self.threshold)
        return {"seg": seg, "off": off}

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        t = sendable(t)
        if not t.is_contiguous():
            t = t.contiguous()
        ref: dict[str, Any] = {"$": "t", "dtype": _DTYPE_NAME[t.dtype], "shape": [*t.shape]}
        nbytes = t.nbytes
        if nbytes:
            self.out.keepalive.append(t)
            ref.update(self.place(raw_bytes(t, nbytes)))
        return ref

    def blob(self, data: bytes | bytearray | memoryview) -> dict[str, Any]:
        view = memoryview(data).cast("B")
        self.out.keepalive.append(data)
        return {"$": "b", "len": len(view), **(self.place(view) if len(view) else {})}

    def pickled(self, p: Pickled) -> dict[str, Any]:
        buf = io.BytesIO()
        pickler = _StoragePickler(buf, self)
        try:
            pickler.dump(p.obj)
        except Exception as exc:
            raise TypeError(f"cannot pickle {p.what}: {type(exc).__name__}: {exc}") from exc
        return {"$": "p", "data": self.blob(buf.getvalue()), "storages": pickler.refs}

    def default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, bytes | bytearray | memoryview):
            return self.blob(obj)
        if isinstance(obj, Pickled):
            return self.pickled(obj)
        raise TypeError(f"a {type(obj).__name__} cannot be sent over salusd's wire: use tensors, "
                        "numbers, strings, lists and dicts, or wrap it in Pickled")


class _StoragePickler(cloudpickle.Pickler):
    """cloudpickle with tensor storages sent as parts (as torch.save does with persistent ids)."""

    def __init__(self, file: io.BytesIO, encoder: _Encoder) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.encoder = encoder
        self.refs: list[dict[str, Any]] = []
        self.index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, _DTYPE_NAME.get(obj.dtype)
            if dtype is None:
                raise TypeError(f"tensors of dtype {obj.dtype} cannot be sent")
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        key = untyped._cdata
        if key not in self.index:
            self.index[key] = len(self.refs)
            as_bytes = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
            self.refs.append(self.encoder.tensor(as_bytes))
        return ("s", self.index[key], dtype)


class _StorageUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self.storages = storages

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "s"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, index, dtype = pid
        if not (isinstance(index, int) and 0 <= index < len(self.storages)):
            raise pickle.UnpicklingError(f"storage {index!r} is not in the frame")
        untyped = self.storages[index].untyped_storage()
        if dtype is None:
            return untyped
        if dtype not in DTYPES:
            raise pickle.UnpicklingError(f"unknown storage dtype {dtype!r}")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=DTYPES[dtype],
                                          _internal=True)


class _Decoder:
    def __init__(self, data: bytearray, header_len: int, segment: Segment | None) -> None:
        self.data, self.base, self.segment = data, header_len, segment

    def region(self, ref: dict[str, Any], nbytes: int) -> tuple[bytearray | Segment, int]:
        return part_region(self.data, self.base, self.segment, ref.get("seg"), ref.get("off"),
                           nbytes)

    def tensor(self, ref: dict[str, Any]) -> torch.Tensor:
        dtype, shape = tensor_spec(ref, DTYPES)
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        buf, off = self.region(ref, numel * dtype.itemsize)
        flat = tensor_view(buf, off, dtype, numel)
        if len(shape) == 1:
            return flat
        return flat.view(*shape) if shape else flat.view(())  # view(*dims) parses fastest

    def blob(self, ref: dict[str, Any]) -> bytes:
        n = ref.get("len")
        if type(n) is not int or n < 0:
            raise FrameError(f"bad byte-string length {n!r}")
        if n == 0:
            return b""
        buf, off = self.region(ref, n)
        return bytes(memoryview(buf)[off:off + n])

    def hook(self, obj: dict[str, Any]) -> Any:
        kind = obj.get("$")
        if kind is None:
            return obj
        if kind == "t":
            return self.tensor(obj)
        if kind == "b":
            return self.blob(obj)
        if kind == "p":
            data, storages = obj.get("data"), obj.get("storages")
            if not isinstance(data, bytes) or not (
                isinstance(storages, list) and all(
                    isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1
                    for s in storages)):
                raise FrameError("a pickled object needs bytes 'data' and uint8 'storages'")
            return PickledPayload(data, storages)
        raise FrameError(f"unknown reference kind {kind!r}")
