"""`salusd run` relays its script's output: to its own stdout and stderr, and a copy to the job's
output file, which `salusd logs JOB` and `GET /v1/jobs/{id}/log` read.

The script does not get this process's stdout and stderr but, for each, a stand-in of the same
kind: a pseudo-terminal where it is a terminal (`os.openpty`, with the terminal's settings and
window size, kept in step on SIGWINCH), else a pipe. So `isatty()`, the interpreter's line or
block buffering, colours and progress bars (tqdm, rich) behave as in a direct run. Where stdout
and stderr are one file (a terminal, `2>&1`) the script gets one stand-in for both, so their
order is kept. A torchrun gang's ranks get one set each. stdin stays this process's own.

What the script writes is read here as it comes and written where this process's stdout or
stderr goes; the copy of a rank's two streams goes to its output file (`output.log`,
`output-replica<r>.log`) through the same `OutputFile` (rotated at 4 MiB, one previous file
kept) that the executor of a REST script job writes with. A pseudo-terminal with the usual
`onlcr` setting puts a `\\r` before each `\\n`; that one `\\r` is taken out again, in the copy
and in what goes on to the terminal (whose own `onlcr` puts it back), so both hold the script's
bytes exactly. This process runs as the job's owner, as that
executor does, so the file is the owner's and `salusd logs` reads it under the same checks.

Where the reader of this process's output goes away (`salusd run ... | head`), the stand-in
is closed on this side: the script's next write fails (EPIPE or EIO) as it would have. A full
or unusable disk stops the copy, never the relay.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import sys
import termios
import time
from dataclasses import dataclass, field

from salus.daemon.state.job_output import OutputFile

READ_BYTES = 65536
QUIET_S = 0.05  # after the script's status: its last output has arrived once this is quiet
DRAIN_MOST_S = 2.0  # what a process the script left behind writes on is not waited for


@dataclass(eq=False)
class _Stream:
    """One stand-in: the script's end (`theirs`), ours (`ours`, non-blocking; None once
    closed) and where its bytes go (`target`, this process's descriptor)."""

    target: int
    rank: int
    theirs: int
    ours: int | None
    onlcr: bool  # a pseudo-terminal that puts `\r` before each `\n`
    held_cr: bool = False  # the copy's last byte was a held-back `\r`

    def resize(self) -> None:
        """The terminal's window size onto the pseudo-terminal (its readers see it)."""
        if os.isatty(self.theirs) and self.ours is not None:
            with contextlib.suppress(OSError):
                size = fcntl.ioctl(self.target, termios.TIOCGWINSZ, b"\0" * 8)
                fcntl.ioctl(self.ours, termios.TIOCSWINSZ, size)

    def close(self) -> None:
        if self.ours is not None:
            os.close(self.ours)
            self.ours = None


def _stand_in(target: int, rank: int) -> _Stream:
    """A pseudo-terminal like the terminal `target`, or a pipe when it is none."""
    if os.isatty(target):
        ours, theirs = os.openpty()
        with contextlib.suppress(termios.error):
            termios.tcsetattr(theirs, termios.TCSANOW, termios.tcgetattr(target))
        oflag = termios.tcgetattr(theirs)[1]
        stream = _Stream(target, rank, theirs, ours,
                         onlcr=bool(oflag & termios.OPOST and oflag & termios.ONLCR))
        stream.resize()
    else:
        ours, theirs = os.pipe()
        stream = _Stream(target, rank, theirs, ours, onlcr=False)
    os.set_blocking(ours, False)
    os.set_inheritable(ours, False)
    return stream


def _same_file(a: int, b: int) -> bool:
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino, sa.st_rdev) == (sb.st_dev, sb.st_ino, sb.st_rdev)


def _own_fd(fd: int) -> int:
    """`fd` when it is open, else /dev/null (this process was started with it closed)."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        return os.open(os.devnull, os.O_RDWR)


@dataclass(eq=False)
class Relay:
    """The stand-ins of every rank's stdout and stderr, and the copies to their output
    files. `fds()` are what to wait on, `pump(fd)` moves what one has, `drain()` takes the
    last output once the script's status came; `close()` ends it all."""

    ranks: int
    stdin: int = field(init=False)
    streams: list[tuple[_Stream, _Stream]] = field(init=False, default_factory=list)
    copies: dict[int, OutputFile] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.stdin = _own_fd(0)
        out, err = _own_fd(1), _own_fd(2)
        shared = _same_file(out, err)
        for rank in range(self.ranks):
            stdout = _stand_in(out, rank)
            self.streams.append((stdout, stdout if shared else _stand_in(err, rank)))

    def stdio(self, rank: int) -> list[int]:
        """The descriptors to hand rank `rank`'s script: stdin, stdout, stderr."""
        stdout, stderr = self.streams[rank]
        return [self.stdin, stdout.theirs, stderr.theirs]

    def copy_to(self, paths: object) -> None:
        """Copy each rank's output to its file in `paths` (the daemon's `run` reply; None:
        it keeps no output files)."""
        if isinstance(paths, list) and len(paths) == self.ranks:
            self.copies = {rank: OutputFile(str(path)) for rank, path in enumerate(paths)}

    def _all(self) -> list[_Stream]:
        return list({id(s): s for pair in self.streams for s in pair}.values())

    def fds(self) -> list[int]:
        return [s.ours for s in self._all() if s.ours is not None]

    def resize(self) -> None:
        for stream in self._all():
            stream.resize()

    def pump(self, fd: int) -> None:
        """Move what the stand-in read at `fd` has to its target and to its rank's copy."""
        stream = next((s for s in self._all() if s.ours == fd), None)
        if stream is None:  # closed since `fds()` listed it
            return
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:  # EIO: a pseudo-terminal's every writer is gone
            if exc.errno != errno.EIO:
                raise
            data = b""
        if not data:
            stream.close()
            return
        try:  # a `\r\n` split between two reads keeps its `\r` here: the terminal shows alike
            _write_all(stream.target, data.replace(b"\r\n", b"\n") if stream.onlcr else data)
        except OSError:  # its reader went away: the script's next write fails, as it would
            stream.close()
        self._copy(stream, data)

    def _copy(self, stream: _Stream, data: bytes) -> None:
        copy = self.copies.get(stream.rank)
        if copy is None:
            return
        if stream.onlcr:
            data = (b"\r" if stream.held_cr else b"") + data
            stream.held_cr = data.endswith(b"\r")
            data = data[:-1] if stream.held_cr else data
            data = data.replace(b"\r\n", b"\n")
        try:
            copy.write(data)
        except OSError as exc:
            del self.copies[stream.rank]
            copy.close()
            print(f"salusd run: the job's output file {copy.path} is unusable, its copy stops "
                  f"(the output still comes here): {exc}", file=sys.stderr)

    def drain(self) -> None:
        """Relay what the script wrote before its status came (a pseudo-terminal hands it on
        a moment later), until its stand-ins are quiet for QUIET_S."""
        deadline = time.monotonic() + DRAIN_MOST_S
        while (fds := self.fds()) and time.monotonic() < deadline:
            ready = select.select(fds, [], [], QUIET_S)[0]
            if not ready:
                return
            for fd in ready:
                self.pump(fd)

    def close(self) -> None:
        for stream in self._all():
            if stream.held_cr and stream.rank in self.copies:
                with contextlib.suppress(OSError):
                    self.copies[stream.rank].write(b"\r")
            stream.close()
            os.close(stream.theirs)
        for copy in self.copies.values():
            copy.close()
        self.copies = {}
        self.streams = []


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`, waiting where it is non-blocking and full."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [])
