"""A job's output file in its checkpoint directory: where each replica's goes, and reading a
piece of it for `salusd logs` and `GET /v1/jobs/{id}/log`.

The executor writes it (`salusd/executor/output.py`): what the job prints to stdout and
stderr, line by line, rotated at `MAX_FILE_BYTES` into `<name>.1` (one previous file kept).
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


def writer_uid(owner_uid: int) -> int:
    """The uid a job's executor runs as: its owner's under a root daemon, else the daemon's."""
    return owner_uid if os.geteuid() == 0 else os.geteuid()
