"""A blocking channel of JSON frames only, over the standard library.

What a script job's executor and the daemon exchange is JSON (the executor's messages, and the
client's socket as a socket frame), so the executor of an interpreter without torch speaks it
with this channel (`executor/script_only.py`). The frames are `frames.py`'s, the ones
`Channel` (which also carries tensors and pickles, and so imports torch) reads and writes.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from typing import Any

from salus.daemon.wire.frames import (
    FLAG_SOCKET,
    ConnectionClosed,
    FrameError,
    FrameReader,
    RawFrame,
    json_frame,
)


class JsonChannel:
    """Send and receive JSON messages on a connected AF_UNIX stream socket `sock` (blocking;
    one reader and one writer at a time). A socket frame's descriptor arrives in the message
    under "socket_fd" (`frames.passed_fd`), as `Channel.recv` gives it."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._reader = FrameReader(sock)
        self._frames: deque[RawFrame] = deque()

    def send(self, message: Any) -> None:
        self.sock.sendall(b"".join(json_frame(message).buffers()))

    def send_socket(self, message: dict[str, Any], fd: int) -> None:
        """Send `message` with the descriptor `fd` (a socket frame; `fd` stays the caller's)."""
        frame = json_frame(message)
        frame.flags |= FLAG_SOCKET
        socket.send_fds(self.sock, [b"".join(frame.buffers())], [fd])

    def buffered(self) -> bool:
        """Whether a whole frame was read off the socket and not yet received."""
        return bool(self._frames)

    def ready(self) -> bool:
        """Whether a `recv` now would find something to read without waiting for it."""
        return self.buffered() or bool(select.select([self.sock], [], [], 0)[0])

    def recv(self) -> Any:
        """The next message; ConnectionClosed once the peer closed between frames, FrameError
        for a frame that is not JSON."""
        while not self._frames:
            frames, closed = self._reader.read(time.monotonic())
            self._frames.extend(frames)
            if closed and not self._frames:
                raise ConnectionClosed("the peer closed the connection")
        frame = self._frames.popleft()
        fd, frame.fd = frame.fd, None
        try:
            message = frame.json()
        except FrameError:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None and frame.flags & FLAG_SOCKET and isinstance(message, dict):
            message["socket_fd"] = fd  # the receiver owns the descriptor now
        elif fd is not None:
            os.close(fd)
        return message

    def close(self) -> None:
        """Close the socket and any descriptor received and not handed out."""
        self._reader.close()
        for frame in self._frames:
            frame.close_fd()
        self._frames.clear()
        self.sock.close()
