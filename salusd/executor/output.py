"""What a job prints: the executor's `sys.stdout` and `sys.stderr` once it is the jobs' owner.

Each complete line (and what is left on `flush`) goes to the job's output file when the daemon
gave one (`Become.log`; bounded, see `salusd/state/job_output.py`) and, while the job's client
has a direct channel open, to the client at once as `{"op": "output", "stream", "text"}`: the
job's function runs on the executor's main thread, so a line printed during a call reaches the
client before the call's result. Python's `warnings` write to `sys.stderr` and come along.
Without a file and a channel, lines go where they went before: the daemon's log.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, TextIO

from salus.daemon.state.job_output import OutputFile

if TYPE_CHECKING:  # a script's output goes through here too, in executors without torch
    from salus.daemon.wire.channel import Channel

MAX_LINE_CHARS = 64 << 10  # a longer line is cut here and marked
CUT_MARK = " [salusd: line cut at 65536 characters]\n"


HOLD_REPLIES = 8  # at most this many results held back on a job's line ...
HOLD_S = 0.002  # ... the first for at most this long, each of a call this short at most


class OutputSink:
    """Where the lines of both streams go: the job's output file and the client's channel.
    It also sends the executor's replies on that channel, in one order with the lines: `lock`
    guards every send there, so that a line printed on another thread never lands inside a
    reply, and results held back (`hold`) go out before anything sent after them."""

    def __init__(self, path: str | None, fallback: dict[str, TextIO]) -> None:
        self.lock = threading.RLock()
        self.path = path
        self.channel: Channel | None = None
        self._fallback = fallback
        self._file = OutputFile(path) if path is not None else None
        self._held: list[object] = []
        self._held_since = 0.0

    # ---- replies ----------------------------------------------------------------------------
    def may_hold(self, now: float) -> bool:
        """Whether one more result may wait for the next: a client that keeps several calls
        in flight (`RemoteFunction.submit`) then wakes once for up to `HOLD_REPLIES` of them
        instead of once per call, and each wake-up of a process takes the CPU from a step (8
        jobs on 2 cores: docs/runtime.md, "Packing"). Bounded in count and in age (the first
        held at most `HOLD_S` ago); the executor holds only results of calls shorter than
        `HOLD_S` (`Executor._answer_client`)."""
        return not self._held or (len(self._held) < HOLD_REPLIES
                                  and now - self._held_since < HOLD_S)

    @property
    def holding(self) -> bool:
        """Whether results are held back."""
        return bool(self._held)

    def hold(self, reply: object, now: float) -> None:
        """Keep `reply` (a compact result, which always encodes) to send with the next."""
        with self.lock:
            if not self._held:
                self._held_since = now
            self._held.append(reply)

    def send(self, reply: object) -> None:
        """Send the results held back, then `reply`, in one `sendmsg`. TypeError (nothing
        sent, the held results kept) when `reply` cannot be encoded; OSError when the client
        went away."""
        with self.lock:
            if self.channel is None:
                return
            self.channel.send_many([*self._held, reply])
            self._held.clear()

    def release(self) -> None:
        """Send the results held back, if any (before the executor waits or does other work)."""
        with self.lock:
            if self._held and self.channel is not None:
                held, self._held = self._held, []
                try:
                    self.channel.send_many(held)
                except OSError:
                    self.channel = None  # the client went away; the executor notices on recv

    def attach(self, channel: Channel) -> None:
        with self.lock:
            self.channel = channel

    def detach(self) -> None:
        with self.lock:
            self.channel = None
            self._held.clear()  # the client is gone, or its line moves after a release

    def forked(self) -> None:
        """In a process the job forked (a DataLoader worker): the channel's frames are the
        executor's alone, and a lock another thread held at the fork would never be released."""
        self.lock = threading.RLock()
        self.channel = None
        self._held = []

    def line(self, stream: str, text: str) -> None:
        """One line of `stream` ("stdout" or "stderr"), or what is left of one on flush."""
        with self.lock:
            if self.path is not None:
                self._to_file(text.encode("utf-8", "replace"))
            if self.channel is not None:
                try:
                    self.send({"op": "output", "stream": stream, "text": text})
                except OSError:
                    self.channel = None  # the client went away; the executor notices on recv
            if self.path is None and self.channel is None:
                self._fallback[stream].write(text)
                self._fallback[stream].flush()

    def _to_file(self, data: bytes) -> None:
        assert self._file is not None
        try:
            self._file.write(data)
        except OSError as exc:  # a full or gone disk costs the job its log, not its run
            self.path, self._file = None, None
            self._fallback["stderr"].write(f"salusd: job output file unusable: {exc}\n")


class JobStream(io.TextIOBase):
    """One of the job's text streams: buffers a partial line and hands complete ones to the
    sink (longer than MAX_LINE_CHARS: cut, marked, the rest of that line dropped)."""

    encoding = "utf-8"  # libraries that print ask for it

    def __init__(self, name: str, sink: OutputSink) -> None:
        super().__init__()
        self.name = name
        self.sink = sink
        self._partial = ""
        self._cut = False  # dropping the rest of a line already cut

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        with self.sink.lock:
            rest = s
            while rest:
                head, newline, rest = rest.partition("\n")
                if self._cut:
                    self._cut = not newline
                    continue
                self._partial += head
                if len(self._partial) > MAX_LINE_CHARS:
                    self.sink.line(self.name, self._partial[:MAX_LINE_CHARS] + CUT_MARK)
                    self._partial, self._cut = "", not newline
                elif newline:
                    self.sink.line(self.name, self._partial + newline)
                    self._partial = ""
        return len(s)

    def flush(self) -> None:
        with self.sink.lock:
            if self._partial:
                text, self._partial = self._partial, ""
                self.sink.line(self.name, text)

    def isatty(self) -> bool:
        return False


class Streams:
    """The executor's `sys.stdout` and `sys.stderr`, pointed at the sink of the job whose code
    runs now (`use`); between jobs, at one that writes to the daemon's log."""

    def __init__(self, fallback: dict[str, TextIO]) -> None:
        self.fallback = fallback
        self.idle = OutputSink(None, fallback)
        self.stdout = JobStream("stdout", self.idle)
        self.stderr = JobStream("stderr", self.idle)
        self.sinks: set[OutputSink] = set()

    def sink(self, path: str | None) -> OutputSink:
        """A new job's sink: its output file `path` (None: none) and, later, its channel."""
        sink = OutputSink(path, self.fallback)
        self.sinks.add(sink)
        return sink

    def drop(self, sink: OutputSink) -> None:
        if self.stdout.sink is sink:
            self.use(self.idle)
        self.sinks.discard(sink)

    def use(self, sink: OutputSink) -> None:
        """From now on what is printed is `sink`'s job's; a partial line goes to the old one."""
        if self.stdout.sink is not sink:
            self.stdout.flush()
            self.stderr.flush()
            self.stdout.sink = self.stderr.sink = sink

    def forked(self) -> None:
        for sink in (self.idle, *self.sinks):
            sink.forked()


def install() -> Streams:
    """Make what jobs print go to their own sinks (`Streams.use`); the executor's own log
    records keep going to its stderr, the zygote's output pipe, whose lines the daemon logs
    (`zygotes.OutputRelay`)."""
    fallback: dict[str, TextIO] = {"stdout": sys.stdout, "stderr": sys.stderr}
    handler = logging.StreamHandler(fallback["stderr"])
    handler.setLevel(logging.WARNING)
    logging.getLogger("salusd").addHandler(handler)
    streams = Streams(fallback)
    os.register_at_fork(after_in_child=streams.forked)
    sys.stdout = streams.stdout
    sys.stderr = streams.stderr
    return streams
