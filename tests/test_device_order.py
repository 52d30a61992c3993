"""`LoadOrder`: admission's walk over devices by (admitted jobs, index), kept as jobs come and
go, against a sort of the devices done afresh after every change."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from salus.scheduler.devices import Device, LoadOrder


@settings(max_examples=100, deadline=None)
@given(devices=st.integers(1, 12),
       moves=st.lists(st.tuples(st.integers(0, 11), st.booleans()), max_size=60))
def test_walk_is_the_sorted_order_after_every_move(
    devices: int, moves: list[tuple[int, bool]]
) -> None:
    book = [Device(i, 1 << 30) for i in range(devices)]
    order = LoadOrder(book)
    for index, admit in moves:
        dev = book[index % devices]
        if not admit and dev.jobs == 0:
            continue
        before = dev.jobs
        dev.jobs += 1 if admit else -1
        order.moved(dev, before)
        expected = sorted(range(devices), key=lambda i: (book[i].jobs, i))
        assert [d.index for d in order] == expected
