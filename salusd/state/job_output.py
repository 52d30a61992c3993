"""A job's output file in its checkpoint directory: where each replica's goes, and reading a
piece of it for `salusd logs` and `GET /v1/jobs/{id}/log`.

The executor writes it (`salusd/executor/output.py`, through `OutputFile`): what the job prints
to stdout and stderr, line by line, rotated at `MAX_FILE_BYTES` into `<name>.1` (one previous
file kept). For a `salusd run` job the client, which relays the script's output to its own
terminal, writes the same copy with the same `OutputFile` (`salusd/cli/relay.py`): it runs as
the job's owner, as the executor does.
"""

from __future__ import annotations

import errno
import os
import stat

MAX_FILE_BYTES = 4 << 20  # an output file is rotated past this size
MAX_READ_BYTES = 64 << 10  # one read answers at most this much
# What opening a path the job's owner put in the file's place fails with (a link, a path
# through a non-directory, a socket): a refusal, where running out of descriptors is not.
_REFUSED = {errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EACCES, errno.EPERM,
            errno.EOPNOTSUPP}


def output_path(checkpoint_dir: str, replica: int = 0) -> str:
    """The output file of replica `replica` of the job whose checkpoints go to
    `checkpoint_dir`: `output.log` for the first, `output-replica<r>.log` for the others."""
    name = "output.log" if replica == 0 else f"output-replica{replica}.log"
    return os.path.join(checkpoint_dir, name)


def read_output(path: str, offset: int | None, writer_uid: int,
                limit: int = MAX_READ_BYTES) -> tuple[bytes, int]:
    """At most `limit` bytes of the file `path` from byte `offset` (None: its last `limit`
    bytes), and the offset to read on from. An offset past the end (the file was rotated
    since) starts again at the beginning of the new file; a missing file reads as empty. A
    read cut at `limit` ends at its last whole line.

    The job's owner controls the directory, so the file must be a regular file (no link
    followed, no FIFO waited on) of the uid its executor ran as, `writer_uid` (a root daemon
    would otherwise hand the owner any file it can read); PermissionError when it is not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b"", 0
    except OSError as exc:
        if exc.errno not in _REFUSED:
            raise
        raise PermissionError(f"{path} is not a job's output file: {exc.strerror}") from None
    try:  # closed on every path: each read that leaked one would exhaust the daemon's table
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != writer_uid:
            raise PermissionError(f"{path} is not a regular file of uid {writer_uid}: it is "
                                  "not the job's output")
        start = max(0, st.st_size - limit) if offset is None else offset
        if start > st.st_size:
            start = 0
        data = os.pread(fd, limit, start)
    finally:
        os.close(fd)
    if len(data) == limit and b"\n" in data:
        data = data[:data.rindex(b"\n") + 1]  # whole lines: no character split
    return data, start + len(data)


class OutputFile:
    """Appends to a job's output file, rotating it into `<name>.1` (one previous file kept)
    once a write would take it past `MAX_FILE_BYTES`. Opened lazily, never through a link; a
    process running as root that makes the file gives it to the owner of its folder (the job's
    owner, whose uid `read_output` asks for). OSError for a full or gone disk: the caller
    stops copying, the job runs on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = 0

    def write(self, data: bytes) -> None:
        if self._fd is not None and self._size and self._size + len(data) > MAX_FILE_BYTES:
            os.close(self._fd)
            self._fd = None
            os.replace(self.path, self.path + ".1")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                               | os.O_NOFOLLOW, 0o600)
            st = os.fstat(self._fd)
            if os.geteuid() == 0:
                folder = os.stat(os.path.dirname(self.path) or ".")
                if st.st_uid != folder.st_uid:
                    os.fchown(self._fd, folder.st_uid, folder.st_gid)
            self._size = st.st_size
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self._size += written
            view = view[written:]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def writer_uid(owner_uid: int) -> int:
    """The uid a job's executor runs as: its owner's under a root daemon, else the daemon's."""
    return owner_uid if os.geteuid() == 0 else os.geteuid()
