"""The daemon's I/O loop: one thread, non-blocking sockets, a selector, timers.

Every socket the daemon talks over (clients, executors, the zygote) is a `Link`: a
`FrameReader` for what comes in and a queue of frames going out, each frame's descriptor
attached to its first byte. No thread waits on an idle connection. Other threads (signal
handling, the REST server) hand work to the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import array
import contextlib
import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from salus.daemon.wire.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    VERSION,
    FrameError,
    FrameReader,
    RawFrame,
    error_reply_frame,
)

log = logging.getLogger("salusd.loop")
FrameHandler = Callable[["Link", RawFrame], None]
_MAX_BUFFERS = 64


@dataclass(eq=False)
class _Out:
    """Bytes queued for one `sendmsg`, with the descriptor that rides on their first byte."""

    bufs: list[memoryview]
    fd: int | None = None
    started: bool = False


@dataclass(eq=False)
class Link:
    """One connected socket in the loop. `on_frame` gets each complete frame, `on_close` runs
    once when the link is closed (by the peer, an error, or `Loop.close`)."""

    sock: socket.socket
    on_frame: FrameHandler
    on_close: Callable[[Link, str], None]
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    reader: FrameReader = field(init=False)
    out: deque[_Out] = field(default_factory=deque)
    out_bytes: int = 0
    closed: bool = False
    close_after_flush: bool = False
    explain_errors: bool = False  # a broken frame gets an error frame before the close
    broken: bool = False  # framing was lost: nothing more is read

    def __post_init__(self) -> None:
        self.sock.setblocking(False)
        self.reader = FrameReader(self.sock, self.max_frame_bytes)


class Loop:
    """A selector loop with timers; `clock` gives seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float], *,
                 max_pending_bytes: int = 512 * 2**20) -> None:
        self.clock = clock
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0  # held by partly received frames, all links together
        self.selector = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._soon: deque[Callable[[], None]] = deque()
        self._soon_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.links: set[Link] = set()
        self._dirty: dict[int, Link] = {}  # links with frames queued since the last flush

    # ---- scheduling -------------------------------------------------------------------------
    def call_later(self, delay_s: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._timers, (self.clock() + delay_s, next(self._seq), fn))

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        with self._soon_lock:
            self._soon.append(fn)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def add_reader(self, sock: socket.socket | int, fn: Callable[[], object]) -> None:
        """Call `fn` whenever `sock` (a socket or a descriptor) is readable."""
        self.selector.register(sock, selectors.EVENT_READ, fn)

    # ---- links ------------------------------------------------------------------------------
    def add(self, link: Link) -> Link:
        self.links.add(link)
        self.selector.register(link.sock, selectors.EVENT_READ, link)
        return link

    def send(self, link: Link, frame: RawFrame) -> None:
        """Queue `frame` on `link` (its descriptor is closed once sent). Queued frames are
        written at the end of the loop's turn, those of one turn together in one `sendmsg` per
        descriptor: a message and the frame that goes with it wake the peer once, not twice."""
        if link.closed:
            frame.close_fd()
            return
        bufs = [memoryview(b) for b in frame.buffers() if b]
        last = link.out[-1] if link.out else None
        if (last is not None and not last.started and len(last.bufs) < _MAX_BUFFERS
                and (frame.fd is None or last.fd is None)):
            # The peer queues a descriptor until the frame that claims it: one may arrive
            # with the first byte of the frames before its own.
            last.bufs.extend(bufs)
            last.fd = frame.fd if frame.fd is not None else last.fd
        else:
            link.out.append(_Out(bufs, frame.fd))
        link.out_bytes += frame.size()
        frame.fd = None
        self._dirty[id(link)] = link

    def flush_all(self) -> None:
        """Write what every link has queued (the loop does this at the end of each turn)."""
        while self._dirty:
            _, link = self._dirty.popitem()
            if not link.closed and link.out:
                self._flush(link)

    def close(self, link: Link, reason: str) -> None:
        if link.closed:
            return
        link.closed = True
        self.links.discard(link)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(link.sock)
        for out in link.out:
            if out.fd is not None:
                os.close(out.fd)
        link.out.clear()
        self.pending_bytes -= link.reader.pending_bytes
        link.reader.close()
        link.sock.close()
        try:
            link.on_close(link, reason)
        except Exception:
            log.exception("closing a connection failed; the daemon goes on")

    def _flush(self, link: Link) -> None:
        try:
            while link.out:
                out = link.out[0]
                bufs, fd = out.bufs, out.fd
                ancillary = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                             if fd is not None else [])
                out.started = True
                sent = link.sock.sendmsg(bufs, ancillary)
                if fd is not None:
                    os.close(fd)
                    out.fd = None
                link.out_bytes -= sent
                while bufs and sent >= len(bufs[0]):
                    sent -= len(bufs[0])
                    bufs.pop(0)
                if bufs:
                    bufs[0] = bufs[0][sent:]
                    break
                link.out.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self.close(link, f"send failed: {exc}")
            return
        events = ((0 if link.broken else selectors.EVENT_READ)
                  | (selectors.EVENT_WRITE if link.out else 0))
        with contextlib.suppress(KeyError, ValueError):
            self.selector.modify(link.sock, events, link)
        if not link.out and link.close_after_flush:
            self.close(link, "closed after its last reply")

    def _read(self, link: Link) -> None:
        if link.broken:
            return
        before = link.reader.pending_bytes
        try:
            frames, closed = link.reader.read(self.clock())
        except FrameError as exc:
            self.pending_bytes += link.reader.pending_bytes - before
            self._refuse(link, exc)
            return
        except OSError as exc:
            self.close(link, f"receive failed: {exc}")
            return
        self.pending_bytes += link.reader.pending_bytes - before
        if self.pending_bytes > self.max_pending_bytes:
            log.warning("dropping a connection: partly received frames hold %d bytes, over "
                        "the %d-byte cap", self.pending_bytes, self.max_pending_bytes)
            for frame in frames:
                frame.close_fd()
            self.close(link, "too much data in unfinished frames")
            return
        for frame in frames:
            if link.closed:
                frame.close_fd()
                continue
            try:
                link.on_frame(link, frame)
            except Exception:  # a bug handling one frame must not take the daemon down
                log.exception("handling a frame failed; the daemon goes on")
                frame.close_fd()
        if closed:
            self.close(link, "the peer closed the connection")

    def _refuse(self, link: Link, exc: FrameError) -> None:
        """A frame broke the protocol: a peer that wants to know why gets one error frame (in
        its own protocol version, which it can parse), then the connection closes."""
        if not link.explain_errors or exc.recoverable:
            self.close(link, str(exc))
            return
        link.broken = link.close_after_flush = True
        self.send(link, error_reply_frame(exc, getattr(exc, "version", VERSION)))
        self._dirty.pop(id(link), None)
        self._flush(link)

    # ---- running ----------------------------------------------------------------------------
    def run_once(self, max_wait_s: float = 1.0) -> None:
        """Wait for I/O (at most until the next timer, or `max_wait_s`), then handle it."""
        timeout = max_wait_s
        if self._timers:
            timeout = max(0.0, min(timeout, self._timers[0][0] - self.clock()))
        if self._soon:
            timeout = 0.0
        for key, events in self.selector.select(timeout):
            target = key.data
            if target is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif isinstance(target, Link):
                if events & selectors.EVENT_WRITE and not target.closed:
                    self._flush(target)
                if events & selectors.EVENT_READ and not target.closed:
                    self._read(target)
            else:
                target()
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            self._guard(fn)
        while True:
            with self._soon_lock:
                if not self._soon:
                    break
                fn = self._soon.popleft()
            self._guard(fn)
        self.flush_all()

    @staticmethod
    def _guard(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:
            log.exception("loop callback failed")

    def shutdown(self) -> None:
        for link in list(self.links):
            self.close(link, "salusd stopped")
        self.selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
