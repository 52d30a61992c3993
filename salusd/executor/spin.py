"""How long an executor polls for its next message before it blocks.

An executor polls, without sleeping, for a window after the last message: a training loop sends
its next call within microseconds of its result, and a call that finds the executor blocked
pays the wake-up path (`spin_window_s`). Each empty poll yields the CPU, so that where other
processes wait for it (many jobs on few cores) the window costs them nothing: polling without
yielding made 8 small jobs on 2 cores 1.2x slower per call (measured); and once a yield ran
another process, the executor stops polling and sleeps (`salusd/wire/channel.py`, `spin`).
"""

from __future__ import annotations

import os

SPIN_US = 200.0  # the default window (microseconds): see `spin_window_s`


def spin_window_s() -> float:
    """How long an executor polls for the next message before it blocks (seconds), from
    `$SALUS_SPIN_US` (microseconds, default `SPIN_US`; 0 turns polling off).

    A process blocked in `epoll_wait` lets its CPU idle, and the message that wakes it pays the
    kernel's (in a virtual machine, also the hypervisor's) wake-up path: 25-40 µs per hop on the
    2-vCPU build VM, against under 4 µs for a peer that polls. Polling is bounded to the window
    after each message, where the next call of a training loop comes, so an idle executor
    sleeps. The client does not poll while its call runs: where its CPU is a hyperthread
    sibling of the executor's, polling slowed the call itself by half (measured)."""
    try:
        us = float(os.environ.get("SALUS_SPIN_US", SPIN_US))
    except ValueError:
        us = SPIN_US
    return max(0.0, min(us, 100_000.0)) / 1e6
