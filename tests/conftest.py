"""Shared fixtures: small seeded models and an in-process daemon on CPU devices."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Two cores here: keep each process's torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Property tests check properties, not speed: with the suite's files run in parallel
# (`make test`: pytest-xdist) an example may take longer than hypothesis's default 200 ms.
settings.register_profile("salusd", deadline=None)
settings.load_profile("salusd")


@pytest.fixture
def daemon_factory() -> Iterator[object]:
    from salus.daemon.core import Daemon
    from salus.daemon.devices import cpu_devices

    made: list[Daemon] = []

    def make(policy: str = "pack", devices: int = 1, memory: int = 256 * 2**20) -> Daemon:
        d = Daemon(cpu_devices(devices, memory), policy)
        made.append(d)
        return d

    yield make
    for d in made:
        d.shutdown(timeout_s=30)
