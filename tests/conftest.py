"""Settings every test process shares: one intra-op thread per process, and hypothesis
without deadlines. A test that needs a daemon process starts it with `daemon_proc.salusd`."""

from __future__ import annotations

import os

from hypothesis import settings

# Two cores here: keep each process's torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Property tests check properties, not speed: with the suite's files run in parallel
# (`make test`: pytest-xdist) an example may take longer than hypothesis's default 200 ms.
settings.register_profile("salusd", deadline=None)
settings.load_profile("salusd")

