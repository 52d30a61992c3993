"""The data plane wire: frames, inline and shared-memory tensors, pickled objects, bad input,
and the compact frames of the per-iteration ops."""

from __future__ import annotations

import gc
import json
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from salus.daemon.wire import compact, segment
from salus.daemon.wire.address import default_socket_path, format_address, parse_address
from salus.daemon.wire.channel import (
    DEFAULT_SHM_THRESHOLD,
    Channel,
    ConnectionClosed,
    FrameError,
    FrameTooLarge,
    Pickled,
    PickledPayload,
    error_from_reply,
)
from salus.daemon.wire.codec import DTYPE_CODES, DTYPES
from salus.daemon.wire.errors import BadRequest, UnknownJob
from salus.daemon.wire.frames import (
    FLAG_COMPACT,
    FLAG_POOL,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    json_frame,
)

FIXED = struct.Struct("<4sBBHIQ")  # the documented frame layout, written out independently
needs_memfd = pytest.mark.skipif(not segment.available(), reason="needs Linux memfd sealing")


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a), Channel(b)
    yield left, right
    left.close()
    right.close()


def roundtrip(sender: Channel, receiver: Channel, message: Any) -> Any:
    """Send from a thread (a large inline frame would fill the socket buffer) and receive."""
    errors: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(message)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        return receiver.recv()
    finally:
        thread.join(10)
        if errors:
            raise errors[0]


def raw_frame(header: bytes, body: bytes = b"", flags: int = 0, magic: bytes = MAGIC) -> bytes:
    header = header + b" " * (-len(header) % 64)
    return FIXED.pack(magic, VERSION, flags, 0, len(header), len(body)) + header + body


def memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:salus-tensors" in line for line in f)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


SAMPLES = {
    "float32": torch.randn(3, 4),
    "float64": torch.randn(5, dtype=torch.float64),
    "float16": torch.randn(2, 2).half(),
    "bfloat16": torch.randn(7).bfloat16(),
    "int64": torch.arange(-5, 5),
    "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.randn(3, dtype=torch.complex64),
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0),
    "empty2d": torch.empty(3, 0, 2, dtype=torch.int32),
    "transposed": torch.randn(4, 6).t(),
    "strided": torch.arange(40.0).view(5, 8)[::2, 1::3],
    "expanded": torch.randn(1, 3).expand(4, 3),
    "conj": torch.randn(4, dtype=torch.complex64).conj(),
    "requires_grad": torch.randn(3, requires_grad=True),
}


def test_tensors_of_many_dtypes_and_layouts_round_trip(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    got = roundtrip(left, right, {"op": "t", "tensors": SAMPLES, "n": 3, "s": "x", "z": None})
    assert got["n"] == 3 and got["s"] == "x" and got["z"] is None
    for name, sent in SAMPLES.items():
        received = got["tensors"][name]
        assert received.dtype == sent.dtype, name
        assert received.shape == sent.shape, name
        assert torch.equal(received, sent.detach().resolve_conj()), name
        assert not received.requires_grad


def test_received_tensors_are_writable_and_independent(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    sent = torch.zeros(16)
    got = roundtrip(left, right, {"x": sent})
    got["x"] += 1
    assert torch.equal(sent, torch.zeros(16))


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=4),
    dtype=st.sampled_from([torch.float32, torch.int16, torch.float64, torch.bool, torch.uint8]),
    threshold=st.sampled_from([1, 64, DEFAULT_SHM_THRESHOLD]),
)
def test_any_shape_round_trips_inline_or_in_shared_memory(
    shape: list[int], dtype: torch.dtype, threshold: int
) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a, shm_threshold=threshold), Channel(b)
    try:
        sent = (torch.rand(shape) * 100).to(dtype)
        got = roundtrip(left, right, {"x": sent, "pair": [sent, 1.5]})
        assert torch.equal(got["x"], sent) and torch.equal(got["pair"][0], sent)
        assert got["x"].shape == sent.shape and got["pair"][1] == 1.5
    finally:
        left.close()
        right.close()


@needs_memfd
def test_large_tensors_are_mapped_from_shared_memory_and_freed(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    shm_before = set(os.listdir("/dev/shm"))
    fds_before, maps_before = open_fds(), memfd_mappings()
    big = torch.randn(512, 256)  # 512 KiB, over the threshold
    small = torch.randn(10)
    got = roundtrip(left, right, {"big": big, "also": big[:, :128], "small": small})
    assert torch.equal(got["big"], big) and torch.equal(got["also"], big[:, :128])
    assert torch.equal(got["small"], small)
    # The receiver's tensors are views of one memfd mapping: no copy out of shared memory.
    with open("/proc/self/maps") as f:
        spans = [tuple(int(v, 16) for v in line.split()[0].split("-"))
                 for line in f if "memfd:salus-tensors" in line]
    ptr = got["big"].data_ptr()
    assert any(lo <= ptr < hi for lo, hi in spans)
    assert memfd_mappings() == maps_before + 1
    # Nothing was ever named in /dev/shm, and once the tensors die the memory is gone.
    assert set(os.listdir("/dev/shm")) == shm_before
    del got
    gc.collect()
    assert memfd_mappings() == maps_before
    assert open_fds() == fds_before


class Box:
    """A class the receiver rebuilds from the pickle."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_objects_travel_with_cloudpickle_and_keep_tensor_identity(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair

    class Local(torch.nn.Module):  # defined in a function: cloudpickle ships it by value
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Linear(300, 300)  # 360 KB of weights: shared memory
            self.small = torch.nn.Linear(300, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.small(torch.relu(self.big(x)))

    model = Local()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    scale = 3.0
    got = roundtrip(left, right, {"objects": Pickled((model, optimizer, lambda o, t: scale * o,
                                                      Box(7)))})
    assert isinstance(got["objects"], PickledPayload)
    model2, optimizer2, loss2, box = got["objects"].load()
    assert box.value == 7 and float(loss2(torch.tensor(2.0), None)) == 6.0
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(a is b for a, b in zip(model2.parameters(),
                                      optimizer2.param_groups[0]["params"], strict=True))
    for p in model.parameters():
        q = next(q for q in model2.parameters() if q.shape == p.shape and torch.equal(q, p))
        assert torch.equal(optimizer.state[p]["exp_avg"], optimizer2.state[q]["exp_avg"])
    x = torch.randn(3, 300)
    assert torch.allclose(model(x), model2(x))


def test_unpicklable_payload_gives_bad_request(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    got = roundtrip(left, right, {"blob": b"\x80\x05not a pickle"})
    payload = PickledPayload(got["blob"], [])
    with pytest.raises(BadRequest, match="could not unpickle the model"):
        payload.load("model")


def test_unsendable_values_raise_type_error(pair: tuple[Channel, Channel]) -> None:
    left, _ = pair
    with pytest.raises(TypeError, match="cannot be sent"):
        left.send({"x": object()})
    for bad in (torch.eye(3).to_sparse(), torch.empty(3, device="meta")):
        with pytest.raises(TypeError, match="only dense tensors with data"):
            left.send({"x": bad})
    with pytest.raises(TypeError, match="cannot pickle lock: "):
        left.send({"x": Pickled(threading.Lock(), "lock")})


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (b"{not json", "could not be decoded"),
        (b'{"x": {"$": "t", "dtype": "float32", "shape": [4], "seg": 0, "off": 0}}', "past"),
        (b'{"x": {"$": "t", "dtype": "nope", "shape": [1], "seg": 0, "off": 0}}', "dtype"),
        (b'{"x": {"$": "t", "dtype": "int8", "shape": [-1], "seg": 0, "off": 0}}', "shape"),
        (b'{"x": {"$": "t", "dtype": "int8", "shape": [1], "seg": 1, "off": 0}}', "segment"),
        (b'{"x": {"$": "t", "dtype": "int32", "shape": [1], "seg": 0, "off": 2}}', "aligned"),
        (b'{"x": {"$": "zz"}}', "reference kind"),
        (b'{"x": {"$": "p", "data": 1, "storages": []}}', "pickled"),
        (b"\xff\xfe", "could not be decoded"),
    ],
)
def test_bad_headers_are_recoverable_errors(pair: tuple[Channel, Channel], header: bytes,
                                            reason: str) -> None:
    left, right = pair
    left.sock.sendall(raw_frame(header, body=bytes(8)))
    with pytest.raises(FrameError, match=reason) as info:
        right.recv()
    assert info.value.recoverable
    left.send({"next": 1})
    assert right.recv() == {"next": 1}


def test_bad_magic_and_truncation_are_not_recoverable(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    left.sock.sendall(raw_frame(b"{}", magic=b"HTTP"))
    with pytest.raises(FrameError, match="magic") as info:
        right.recv()
    assert not info.value.recoverable

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    receiver = Channel(b)
    a.sendall(raw_frame(b'{"a": 1}', body=bytes(100))[:-30])
    a.close()
    with pytest.raises(FrameError, match="middle of a frame") as info:
        receiver.recv()
    assert not info.value.recoverable
    receiver.close()


def test_clean_close_between_frames(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    left.send({"last": True})
    left.sock.shutdown(socket.SHUT_WR)
    assert right.recv() == {"last": True}
    with pytest.raises(ConnectionClosed):
        right.recv()


def test_oversized_frames_are_skipped_and_refused_before_sending() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = Channel(a, shm_threshold=float("inf"))
    receiver = Channel(b, max_frame_bytes=4096)
    try:
        with pytest.raises(FrameTooLarge, match="exceeds") as info:
            roundtrip(sender, receiver, {"x": torch.zeros(10_000)})
        assert info.value.recoverable
        assert roundtrip(sender, receiver, {"after": 1}) == {"after": 1}
        sender.peer_max_frame_bytes = 4096
        with pytest.raises(FrameTooLarge, match="4096-byte frame limit"):
            sender.send({"x": torch.zeros(10_000)})
        a.sendall(FIXED.pack(MAGIC, VERSION, 0, 0, 64, 1 << 40))
        with pytest.raises(FrameError, match="far over") as info:
            receiver.recv()
        assert not info.value.recoverable
    finally:
        sender.close()
        receiver.close()


@needs_memfd
def test_segments_must_be_sealed_and_announced(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    frame = raw_frame(b'{"x": {"$": "t", "dtype": "uint8", "shape": [4], "seg": 1, "off": 0}}',
                      flags=1)
    with tempfile.TemporaryFile() as unsealed:
        unsealed.write(bytes(64))
        unsealed.flush()
        left.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     struct.pack("i", unsealed.fileno()))])
        with pytest.raises(FrameError, match="not sealed"):
            right.recv()
    left.sock.sendall(frame)
    with pytest.raises(FrameError, match="no descriptor"):
        right.recv()
    left.send({"still": "in step"})
    assert right.recv() == {"still": "in step"}


def test_remote_error_codes_map_to_salus_errors() -> None:
    assert isinstance(error_from_reply("unknown_job", "no job 7"), UnknownJob)
    assert isinstance(error_from_reply("too_large", "big"), FrameTooLarge)
    err = error_from_reply("from the future", "m")
    assert type(err).__name__ == "SalusError" and str(err) == "m"


def test_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_address("unix:///run/salusd/salusd.sock") == "/run/salusd/salusd.sock"
    for bad in ("tcp://127.0.0.1:9", "/run/x.sock", "unix://relative/x.sock", "unix:/x"):
        with pytest.raises(ValueError, match="unix:///"):
            parse_address(bad)
    assert format_address("/a/b.sock") == "unix:///a/b.sock"
    monkeypatch.setenv("SALUS_ADDRESS", "unix:///tmp/elsewhere.sock")
    assert default_socket_path() == "/tmp/elsewhere.sock"
    monkeypatch.delenv("SALUS_ADDRESS")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_socket_path() == "/run/user/1234/salusd/salusd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_socket_path() == "/home/someone/.local/state/salusd/salusd.sock"


def test_frame_layout_is_as_documented(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    left.send({"op": "ping", "x": torch.arange(3, dtype=torch.int32)})
    raw = right.sock.recv(1 << 16)
    magic, version, flags, reserved, header_len, body_len = FIXED.unpack_from(raw)
    assert (magic, version, flags, reserved) == (MAGIC, VERSION, 0, 0)
    assert FIXED.size == HEADER_BYTES and header_len % 64 == 0
    assert len(raw) == HEADER_BYTES + header_len + body_len
    header = json.loads(raw[HEADER_BYTES:HEADER_BYTES + header_len])
    ref = header["x"]
    body = raw[HEADER_BYTES + header_len:]
    assert ref["dtype"] == "int32" and ref["shape"] == [3]
    assert body[ref["off"]:ref["off"] + 12] == torch.arange(3, dtype=torch.int32).numpy().tobytes()


# ---- compact frames (step / infer) ------------------------------------------------------------

HEAD = struct.Struct("<BBHId")  # compact head and tensor descriptor, written out independently
DESC = struct.Struct("<BBBBIQ")


def compact_frame(header: bytes, body: bytes = b"", flags: int = FLAG_COMPACT) -> bytes:
    header = header + bytes(-len(header) % 64)
    return FIXED.pack(MAGIC, VERSION, flags, 0, len(header), len(body)) + header + body


def descriptor(code: int, shape: list[int], seg: int = 0, off: int = 0, flags: int = 0,
               reserved: int = 0, strides: list[int] | None = None) -> bytes:
    dims = [*shape, *(strides or [])]
    return DESC.pack(code, len(shape), seg, flags, reserved, off) + struct.pack(
        f"<{len(dims)}q", *dims)


def infer_request(x: torch.Tensor) -> compact.Message:
    return compact.Message(compact.OP_CALL, "42", (x,))


def every_dtype_sample(dtype: torch.dtype) -> torch.Tensor:
    raw = torch.arange(-6, 6, dtype=torch.int64).view(3, 4)
    if dtype.is_complex:
        return torch.complex(raw.float(), -raw.float()).to(dtype)
    if dtype.is_floating_point:
        return (raw.float() / 4).to(dtype)
    if dtype == torch.bool:
        return raw > 0
    return raw.to(dtype) if dtype.is_signed else raw.abs().to(dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_compact_round_trips_every_dtype(pair: tuple[Channel, Channel], name: str) -> None:
    left, right = pair
    sent = every_dtype_sample(DTYPES[name])
    got = roundtrip(left, right, compact.Message(compact.OP_CALL, "7", (sent, sent[0])))
    assert type(got) is compact.Message and got.op == compact.OP_CALL and got.job == "7"
    for received, expected in zip(got.tensors, (sent, sent[0]), strict=True):
        assert received.dtype == expected.dtype and received.shape == expected.shape
        assert received.view(torch.uint8).equal(expected.contiguous().view(torch.uint8))


def test_compact_tensors_keep_layout_and_values(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    channels_last = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    cases = {**SAMPLES, "channels_last": channels_last, "size1": torch.randn(4, 1).t()}
    for name, sent in cases.items():
        got = roundtrip(left, right, infer_request(sent)).tensors[0]
        expected = sent.detach().resolve_conj()
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name
        assert not got.requires_grad, name
    # A permuted dense layout arrives as it was sent; a slice or an expansion arrives contiguous.
    for name in ("transposed", "channels_last"):
        sent = cases[name]
        got = roundtrip(left, right, infer_request(sent)).tensors[0]
        assert got.stride() == sent.stride(), name
    for name in ("strided", "expanded"):
        assert roundtrip(left, right, infer_request(cases[name])).tensors[0].is_contiguous()


def test_compact_loss_reply_and_received_tensors_are_writable(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    got = roundtrip(left, right, compact.Message(compact.OP_RESULT, value=0.1 + 0.2))
    assert got.op == compact.OP_RESULT and got.value == 0.1 + 0.2 and got.tensors == ()
    sent = torch.zeros(4, 3)
    out = roundtrip(left, right, compact.Message(compact.OP_RESULT, tensors=(sent,)))
    out.tensors[0].add_(1)
    assert torch.equal(sent, torch.zeros(4, 3)) and torch.equal(out.tensors[0], sent + 1)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=4),
    dtype=st.sampled_from([torch.float32, torch.int16, torch.float64, torch.bool, torch.uint8]),
    threshold=st.sampled_from([1, 64, DEFAULT_SHM_THRESHOLD]),
    permute=st.randoms(use_true_random=False),
)
def test_compact_any_shape_and_permutation_round_trips(
    shape: list[int], dtype: torch.dtype, threshold: int, permute: Any
) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a, shm_threshold=threshold), Channel(b)
    try:
        order = list(range(len(shape)))
        permute.shuffle(order)
        sent = (torch.rand(shape) * 100).to(dtype).permute(order)
        got = roundtrip(left, right, compact.Message(compact.OP_CALL, "j", (sent, sent.sum())))
        assert torch.equal(got.tensors[0], sent) and got.tensors[0].shape == sent.shape
        assert torch.equal(got.tensors[1], sent.sum()) and got.tensors[1].dim() == 0
    finally:
        left.close()
        right.close()


@needs_memfd
def test_compact_large_tensors_travel_in_shared_memory(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    fds_before, maps_before = open_fds(), memfd_mappings()
    big = torch.randn(256, 512).t()  # 512 KiB, transposed: sent with its strides, no copy
    got = roundtrip(left, right, compact.Message(compact.OP_CALL, "1", (big, torch.ones(3))))
    x = got.tensors[0]
    assert torch.equal(x, big) and x.stride() == big.stride()
    assert memfd_mappings() == maps_before + 1
    del got, x
    gc.collect()
    assert memfd_mappings() == maps_before and open_fds() == fds_before


def test_compact_refuses_unsendable_tensors_before_sending(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    with pytest.raises(TypeError, match="only dense tensors with data"):
        left.send(infer_request(torch.eye(3).to_sparse()))
    with pytest.raises(TypeError, match="carries tensors"):
        left.send(compact.Message(compact.OP_CALL, "1", ([1.0],)))
    with pytest.raises(ValueError, match="cannot be sent"):
        left.send(compact.Message(compact.OP_CALL, "1", (torch.ones(1),) * 256))
    left.send({"still": "in step"})
    assert right.recv() == {"still": "in step"}


def test_compact_frame_layout_is_as_documented(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    x = torch.arange(6, dtype=torch.int32).view(2, 3)
    left.send(compact.Message(compact.OP_CALL, "12", (x, x.t())))
    raw = right.sock.recv(1 << 16)
    _, _, flags, _, header_len, body_len = FIXED.unpack_from(raw)
    assert flags == FLAG_COMPACT and header_len % 64 == 0
    assert len(raw) == HEADER_BYTES + header_len + body_len
    header = raw[HEADER_BYTES:HEADER_BYTES + header_len]
    assert HEAD.unpack_from(header) == (compact.OP_CALL, 2, 2, 0, 0.0)
    assert header[16:18] == b"12"
    code, ndim, seg, tflags, _, off = DESC.unpack_from(header, 18)
    assert (code, ndim, seg, tflags) == (DTYPE_CODES[torch.int32], 2, 0, 0)
    assert struct.unpack_from("<2q", header, 34) == (2, 3)
    body = raw[HEADER_BYTES + header_len:]
    assert body[off:off + 24] == x.numpy().tobytes()
    _, ndim, _, tflags, _, off2 = DESC.unpack_from(header, 50)
    assert (ndim, tflags) == (2, 1) and struct.unpack_from("<4q", header, 66) == (3, 2, 1, 3)
    assert body[off2:off2 + 24] == x.numpy().tobytes()  # the transpose's storage, as it lies


F32 = DTYPE_CODES[torch.float32]


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (HEAD.pack(9, 0, 0, 0, 0.0), "unknown compact op 9"),
        (HEAD.pack(compact.OP_CALL, 1, 500, 0, 0.0), "job id .500 bytes. runs past"),
        (HEAD.pack(compact.OP_CALL, 1, 2, 0, 0.0) + b"\xff\xfe" + descriptor(F32, [1]),
         "could not be decoded: UnicodeDecodeError"),
        (HEAD.pack(compact.OP_CALL, 1, 48, 0, 0.0) + b"j" * 48, "descriptor runs past"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(250, [1]), "dtype code 250"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + DESC.pack(F32, 65, 0, 0, 0, 0),
         "ndim 65"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [1], flags=4), "flags 0x4"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [1], reserved=1),
         "reserved 0x1"),
        (HEAD.pack(compact.OP_CALL, 1, 32, 0, 0.0) + b"j" * 32 + DESC.pack(F32, 3, 0, 0, 0, 0),
         "sizes run past"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [2, -1]), "non-negative"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [4]), "runs past the end"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [1 << 40, 1 << 40]),
         "runs past the end"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [1], seg=1), "segment 1"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [1], off=2), "aligned"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0)
         + descriptor(F32, [2], flags=1, strides=[0]), "densely"),
        (HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0)
         + descriptor(F32, [2, 1], flags=1, strides=[1, -3]), "densely"),
        (HEAD.pack(compact.OP_RESULT, 0, 0, 0, 0.0) + bytes(64) + b"\x01", "fields end at byte 16"),
        (b"", "shorter than its 16-byte head"),
    ],
)
def test_malformed_compact_headers_are_recoverable_errors(
    pair: tuple[Channel, Channel], header: bytes, reason: str
) -> None:
    left, right = pair
    left.sock.sendall(compact_frame(header, body=bytes(8)))
    with pytest.raises(FrameError, match=reason) as info:
        right.recv()
    assert info.value.recoverable
    left.send(compact.Message(compact.OP_RESULT, value=2.0))
    assert right.recv().value == 2.0


@settings(max_examples=200, deadline=None)
@given(header=st.binary(min_size=0, max_size=200), body=st.binary(max_size=64),
       op=st.sampled_from(sorted(compact.OP_NAMES)))
def test_random_compact_headers_give_frame_errors_or_messages(header: bytes, body: bytes,
                                                              op: int) -> None:
    data = bytearray(HEAD.pack(op, header[0] % 3 if header else 0, min(len(header), 3), 0, 0.0)
                     + header)
    data += bytes(-len(data) % 64)
    header_len = len(data)
    data += body
    try:
        got = compact.decode(data, header_len, None)
    except FrameError as exc:
        assert exc.recoverable
    else:
        assert type(got) is compact.Message and all(isinstance(t, torch.Tensor)
                                                    for t in got.tensors)


@needs_memfd
def test_compact_segment_must_be_announced_and_sealed(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    header = HEAD.pack(compact.OP_CALL, 1, 0, 0, 0.0) + descriptor(F32, [4], seg=1)
    left.sock.sendall(compact_frame(header, flags=FLAG_COMPACT | 1))
    with pytest.raises(FrameError, match="no descriptor"):
        right.recv()
    with tempfile.TemporaryFile() as unsealed:
        unsealed.write(bytes(64))
        unsealed.flush()
        left.sock.sendmsg([compact_frame(header, flags=FLAG_COMPACT | 1)],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                            struct.pack("i", unsealed.fileno()))])
        with pytest.raises(FrameError, match="not sealed"):
            right.recv()
    left.sock.sendall(compact_frame(header, flags=FLAG_COMPACT | 16))
    with pytest.raises(FrameError, match="malformed frame .flags 0x12"):
        right.recv()
    left.sock.sendall(compact_frame(header, flags=FLAG_COMPACT | FLAG_POOL))
    with pytest.raises(FrameError, match="before the pool came"):
        right.recv()
    left.send(compact.Message(compact.OP_RESULT, value=1.0))
    assert right.recv().value == 1.0


def test_a_socket_travels_with_a_socket_frame_and_works(pair: tuple[Channel, Channel]) -> None:
    left, right = pair
    mine, theirs = socket.socketpair()
    left.send_socket({"op": "channel", "job": "3"}, theirs.fileno())
    theirs.close()
    got = right.recv()
    assert got["op"] == "channel" and got["job"] == "3"
    received = socket.socket(fileno=got.pop("socket_fd"))
    with received, mine:
        mine.sendall(b"ping")
        assert received.recv(4) == b"ping"
    left.sock.sendall(compact_frame(bytes(64), flags=FLAG_COMPACT | 4))  # no descriptor came
    with pytest.raises(FrameError, match="socket frame must be JSON"):
        right.recv()


def test_frame_buffered_says_whether_recv_needs_the_socket(
        pair: tuple[Channel, Channel]) -> None:
    """The executor reads every call already buffered before it runs them (`frame_buffered`):
    true exactly while a whole next frame sits in the buffer, so that recv does not block."""
    a, b = pair
    assert not b.frame_buffered()
    a.send_many([{"n": 0}, compact.Message(compact.OP_CALL, "1", (torch.ones(3),), 0),
                 {"n": 2}])
    assert b.recv() == {"n": 0}  # one recvmsg took all three frames
    assert b.frame_buffered()
    assert torch.equal(b.recv().tensors[0], torch.ones(3))
    assert b.frame_buffered()
    assert b.recv() == {"n": 2}
    assert not b.frame_buffered()
    first = b"".join(json_frame({"n": 3}).buffers())
    second = b"".join(json_frame({"n": 4}).buffers())
    a.sock.sendall(first + second[:HEADER_BYTES + 2])  # a frame, then part of the next
    assert b.recv() == {"n": 3}
    assert not b.frame_buffered()  # its header is here, not all of it
    a.sock.sendall(second[HEADER_BYTES + 2:])
    assert b.recv() == {"n": 4}
