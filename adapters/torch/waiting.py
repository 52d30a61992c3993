"""How a client waits for its calls' replies on the job's direct line.

A process blocked in `recv` lets its CPU idle, and on the 2-vCPU build VM the wake-up costs more
than the hop itself: the executor's send pays for waking the idle vCPU, the client runs its
next steps on cold caches, and the executor's next call ran 60 % slower than the same step in a
loop (docs/runtime.md, "Where a call's time goes"). A client that is polling when the reply
comes pays none of that. So for short calls (the last round trip under a millisecond) the
client polls, yielding the CPU, until `spin_s` past the time it expects the reply; never for
longer calls, and not for `BACK_OFF_S` once `BACK_OFF_AFTER` polls in a row found another
process wanting the CPU.

One such poll alone says little: the daemon wakes every 20 ms to take its executors' reports,
and a yield that ran it once in a while is no sign of a busy CPU. With a single one enough, a
loop of blocking small steps on the quiet build VM (one-off count, 3306 waits) skipped polling
in 2898 of its waits, backing off anew every 0.1 s; a CPU that is really wanted turns every
poll away, three in a row at once.
"""

from __future__ import annotations

import os
import time
from collections import deque

from salus.daemon.wire.channel import Channel

SPIN_US = 300.0  # see ReplyWait
# Longer calls are waited for blocked: polling beside a step of 2 ms or more slowed the step
# more than the wake-up costs (bench/overhead.py, about_2ms and about_6ms).
POLL_CALLS_UNDER_S = 1e-3
# Once a poll gave the CPU to another process, the client blocks for this long: a yield on a
# busy CPU can cost a whole time slice, more than the wake-up it would save.
BACK_OFF_S = 0.1
BACK_OFF_AFTER = 3  # polls in a row that gave the CPU away


def spin_s() -> float:
    """The polling window before an expected reply (seconds), from `$SALUS_CLIENT_SPIN_US`
    (microseconds, default `SPIN_US`; 0 turns polling off: the client blocks in recv)."""
    try:
        us = float(os.environ.get("SALUS_CLIENT_SPIN_US", SPIN_US))
    except ValueError:
        us = SPIN_US
    return max(0.0, min(us, 100_000.0)) / 1e6


class ReplyWait:
    """The requests in flight on one line (when each was sent) and the last round trip."""

    def __init__(self, spin: float) -> None:
        self.spin = spin
        self.expected = 0.0  # the last reply's round trip (seconds)
        self.sent_at: deque[float] = deque()
        self.calm_at = 0.0  # no polling before this time (perf_counter seconds)
        self.turned_away = 0  # polls in a row that gave the CPU to another process

    def sent(self) -> None:
        self.sent_at.append(time.perf_counter())

    def answered(self) -> None:
        if self.sent_at:
            self.expected = time.perf_counter() - self.sent_at.popleft()

    def before_recv(self, channel: Channel) -> None:
        """Poll for the head request's reply when it is due within `spin` (plus the part of
        the last round trip still to come, when that was under `POLL_CALLS_UNDER_S`); a `recv`
        after this blocks only when the reply is later than that."""
        if not self.spin or not self.sent_at or channel.buffered():
            return
        left = self.expected - (time.perf_counter() - self.sent_at[0])
        now = time.perf_counter()
        if now < self.calm_at:
            return
        if self.expected > POLL_CALLS_UNDER_S and left > 0:
            return
        window = max(0.0, left) + self.spin
        if channel.poll(window):
            self.turned_away = 0
        elif time.perf_counter() - now < window:  # a yield ran another process
            self.turned_away += 1
            if self.turned_away >= BACK_OFF_AFTER:
                self.calm_at, self.turned_away = time.perf_counter() + BACK_OFF_S, 0
