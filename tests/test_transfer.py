"""Storages copied between host and device in chunks (salusd/executor/transfer.py): the plan
covers every byte once, in order, in chunks no larger than the bound; on a GPU a swap-out lands
in pinned host memory and a swap-in brings back the same bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from salus.daemon.executor.transfer import Piece, copy_storages, plan_chunks


@given(st.lists(st.integers(0, 5000), max_size=20), st.integers(1, 3000))
def test_the_plan_covers_every_byte_once_in_bounded_chunks(sizes: list[int],
                                                           chunk: int) -> None:
    chunks = plan_chunks(sizes, chunk)
    # Laid end to end, the pieces are the items' bytes in order: (item, byte) for every byte.
    laid = [(p.item, b) for c in chunks for p in c for b in range(p.start, p.stop)]
    assert laid == [(i, b) for i, size in enumerate(sizes) for b in range(size)]
    total = sum(sizes)
    assert len(chunks) == -(-total // chunk)  # ceil: every chunk but the last is full
    for c in chunks[:-1]:
        assert sum(p.stop - p.start for p in c) == chunk
    assert all(p.stop > p.start for c in chunks for p in c)
    if chunks:
        assert 0 < sum(p.stop - p.start for p in chunks[-1]) <= chunk


def test_a_plan_by_hand() -> None:
    assert plan_chunks([5, 0, 3, 9], 4) == [
        [Piece(0, 0, 4)], [Piece(0, 4, 5), Piece(2, 0, 3)], [Piece(3, 0, 4)], [Piece(3, 4, 8)],
        [Piece(3, 8, 9)]]
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([1], 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_swap_goes_through_pinned_host_memory_and_back_bit_equal() -> None:
    gpu = torch.device("cuda", 0)
    generator = torch.Generator().manual_seed(0)
    sizes = [0, 1, 4095, 3 * 2**20 + 7, 256]
    host = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    device = [h.to(gpu) for h in host]
    out = copy_storages(device, torch.device("cpu"), chunk_bytes=2**20)
    assert all(o.device.type == "cpu" and (o.is_pinned() or o.numel() == 0) for o in out)
    assert all(torch.equal(o, h) for o, h in zip(out, host, strict=True))
    back = copy_storages(out, gpu, chunk_bytes=2**20)
    assert all(b.device == gpu for b in back)
    assert all(torch.equal(b.cpu(), h) for b, h in zip(back, host, strict=True))
