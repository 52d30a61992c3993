"""How a client waits for its calls' replies on the job's direct line.

A process blocked in `recv` lets its CPU idle, and on the 2-vCPU build VM the wake-up costs more
than the hop itself: the executor's send pays for waking the idle vCPU, the client runs its
next steps on cold caches, and the executor's next call ran 60 % slower than the same step in a
loop (docs/runtime.md, "Where a call's time goes"). A client that is polling when the reply
comes pays none of that. So the client sleeps until `spin_s` before the time it expects the
reply (the last round trip after the request was sent) and polls, yielding the CPU, from there
until `spin_s` past it: a short call's reply is polled for from the start, a long call's wait
costs the CPU only its last `spin_s`. A reply that comes early wakes the sleep as a blocked
`recv` would; one later than the window is waited for blocked. Polling stops for `BACK_OFF_S`
once `BACK_OFF_AFTER` polls in a row found another process wanting the CPU.

One such poll alone says little: the daemon wakes every 20 ms to take its executors' reports,
and a yield that ran it once in a while is no sign of a busy CPU. With a single one enough, a
loop of blocking small steps on the quiet build VM (one-off count, 3306 waits) skipped polling
in 2898 of its waits, backing off anew every 0.1 s; a CPU that is really wanted turns every
poll away, three in a row at once.

Long calls were waited for blocked until the polling above was measured stage by stage
(`bench/call_stages.py`: the time from the request to the function's start plus from its end to
the reply in the client's hands, beside the function's own time, which polling does not
change): for the ~2 ms and the 6 ms steps of `bench/overhead.py` a blocked client spent 283-293
and 323-361 µs there, one that slept and then polled 230-234 and 289 µs (one-off runs, two
each).
"""

from __future__ import annotations

import os
import time
from collections import deque

from salus.daemon.wire.channel import Channel

SPIN_US = 300.0  # see ReplyWait
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
        """Sleep until `spin` before the head request's reply is due (woken early when it
        comes), then poll for it until `spin` after; a `recv` after this blocks only when the
        reply is later than that. The sleep's grain is poll's millisecond (rounded down), so
        the poll takes up to a millisecond more."""
        if not self.spin or not self.sent_at or channel.buffered():
            return
        now = time.perf_counter()
        if now < self.calm_at:
            return
        left = self.expected - (now - self.sent_at[0])
        if left > self.spin:
            if channel.readable(left - self.spin):
                return  # it came early, or a line the job printed did
            now = time.perf_counter()
            left = self.expected - (now - self.sent_at[0])
        window = max(0.0, left) + self.spin
        if channel.poll(window):
            self.turned_away = 0
        elif time.perf_counter() - now < window:  # a yield ran another process
            self.turned_away += 1
            if self.turned_away >= BACK_OFF_AFTER:
                self.calm_at, self.turned_away = time.perf_counter() + BACK_OFF_S, 0
