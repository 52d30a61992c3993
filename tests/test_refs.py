"""The daemon's torch-free reference checks (`wire/refs.py`) refuse exactly the frames the
executors' decoders (`codec.decode`, `compact.decode`) would fail on: random corruptions of real
frames are decoded both ways and must agree."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from salus.daemon.wire import codec, compact, refs
from salus.daemon.wire.errors import BadRequest
from salus.daemon.wire.frames import ALIGN, FrameError


def _decodes(fn: object, *args: object) -> bool:
    try:
        fn(*args)  # type: ignore[operator]
    except FrameError:
        return False
    return True


def _checks(fn: object, *args: object) -> bool:
    try:
        fn(*args)  # type: ignore[operator]
    except BadRequest:
        return False
    return True


def test_the_dtype_table_is_torchs() -> None:
    for name, itemsize in refs.DTYPE_ITEMSIZES.items():
        assert getattr(torch, name).itemsize == itemsize, name
    assert list(codec.DTYPES) == list(refs.DTYPE_NAMES)


CANDIDATES: list[object] = [0, 1, 2, 3, 7, 64, 63, 4096, 10**12, -1, None, "0", True, 1.5,
                            "float32", "uint8", "nope", [], [1], [2, 3], [-1], [10**9], {},
                            "t", "b", "p", "q"]


@pytest.mark.parametrize("seed", range(4))
def test_json_reference_checks_agree_with_the_decoder(seed: int) -> None:
    rng = random.Random(seed)
    message = {"op": "attach", "x": torch.arange(6, dtype=torch.float32).view(2, 3),
               "y": [b"bytes", torch.zeros(0)], "z": codec.Pickled({"w": torch.ones(3)})}
    enc = codec.encode(message, shm_threshold=math.inf)
    body = b"".join(bytes(b) for b in enc.inline)
    original = json.loads(enc.header)
    disagreements = []
    for _ in range(400):
        header = json.loads(json.dumps(original))
        stack, found = [header], []
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                found.append(item)
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        for _ in range(rng.randint(1, 2)):
            target = rng.choice(found)
            target[rng.choice(["$", "dtype", "shape", "seg", "off", "len", "data",
                               "storages"])] = rng.choice(CANDIDATES)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % ALIGN)
        data = bytearray(text + body)
        decoded = _decodes(codec.decode, data, len(text), None)
        checked = _checks(refs.check_json, header, len(body), None)
        if decoded != checked:
            disagreements.append((header, decoded, checked))
    assert not disagreements, disagreements[:3]


@pytest.mark.parametrize("seed", range(4))
def test_compact_checks_agree_with_the_decoder(seed: int) -> None:
    rng = random.Random(seed)
    tensors = (torch.arange(6, dtype=torch.float32).view(2, 3).t(),
               torch.ones(5, dtype=torch.int64), torch.zeros(0),
               torch.tensor(3.0, dtype=torch.float64))
    enc = compact.encode(compact.Message(compact.OP_CALL, "12", tensors, 7),
                         shm_threshold=math.inf)
    body = b"".join(bytes(b) for b in enc.inline)
    disagreements = []
    for _ in range(600):
        header = bytearray(enc.header)
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] = rng.choice([0, 1, 2, 3, 4, 64, 127, 255,
                                                             rng.randrange(256)])
        data = bytearray(bytes(header) + body)
        decoded = _decodes(compact.decode, data, len(header), None)
        checked = _checks(refs.check_compact, bytes(header), len(body), None)
        if decoded != checked:
            disagreements.append((bytes(header).hex(), decoded, checked))
    assert not disagreements, disagreements[:3]
