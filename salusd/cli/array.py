"""`salusd run --array 0-7 -- python sweep.py`: one script job per index, as Slurm's job
arrays.

Each task is a job of its own (its id, lane, limits, line in `salusd status`), run with
`SALUS_ARRAY_INDEX` (its index) and `SALUS_ARRAY_JOB_ID` (the first task's job id) in its
environment, as Slurm's SLURM_ARRAY_TASK_ID and SLURM_ARRAY_JOB_ID. As `sbatch --array` does,
each task writes its stdout and stderr to a file of its own (`--output`, default
`salus-%A_%a.out` in the working directory), not to this terminal, where eight interleaved
progress bars would be unreadable; its stdin is /dev/null. This process stays attached as a
single `salusd run` does: it says when each task ends, forwards the signals a single run
forwards to every running task (after SIGINT, SIGTERM or SIGHUP it submits no more), cancels
them all on a second Ctrl-C, and exits with the highest exit status of its tasks. With `%N`
at most N tasks run at once (the next is submitted as one ends).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass, field
from types import FrameType

from salus.daemon.cli.control import Control
from salus.daemon.cli.run import CANNOT_RUN, FORWARDED, INTERRUPT, final_status, run_request
from salus.daemon.wire import control_ops as ops
from salus.daemon.wire.errors import SalusError

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # no more tasks after these


@dataclass(eq=False)
class Task:
    """One running task: its index, job id, output file and its end of the socket pair."""

    index: int
    job: str
    output: str
    sock: socket.socket
    data: bytes = b""


@dataclass
class Array:
    """The tasks of one `salusd run --array`."""

    todo: list[int]
    most: int
    running: dict[socket.socket, Task] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    array_job: str | None = None
    stop: bool = False  # submit no more
    interrupts: int = 0
    cancelled: bool = False


def run_array(channel: Control, command: list[str], args: argparse.Namespace) -> int:
    """Submit a job per index of `args.array` and wait for them all: the highest status."""
    indexes, most = args.array
    array = Array(list(indexes), most or len(indexes))

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum in STOPPING:
            array.stop = True
        byte = INTERRUPT if signum == signal.SIGINT else FORWARDED[signal.Signals(signum)]
        if signum == signal.SIGINT:
            array.interrupts += 1
            if array.interrupts > 1:
                return  # the loop cancels them
        for task in array.running.values():
            with contextlib.suppress(OSError):
                task.sock.send(byte)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT,
                                                                       *FORWARDED)}
    try:
        _loop(channel, command, args, array)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    left = len(array.todo)
    if left:
        print(f"salusd run: {left} task(s) of array job {array.array_job} not submitted",
              file=sys.stderr)
    return max(array.statuses.values(), default=CANNOT_RUN)


def _loop(channel: Control, command: list[str], args: argparse.Namespace, array: Array) -> None:
    while array.running or (array.todo and not array.stop):
        while array.todo and not array.stop and len(array.running) < array.most:
            index = array.todo.pop(0)
            try:
                _submit(channel, command, args, array, index)
            except (SalusError, OSError) as exc:
                print(f"salusd run: task {index} not submitted: {exc}", file=sys.stderr)
                array.statuses[index] = CANNOT_RUN
                array.stop = True
        if array.interrupts > 1 and not array.cancelled:
            array.cancelled = True
            print(f"\nsalusd run: cancelling array job {array.array_job}", file=sys.stderr)
            for task in array.running.values():
                with contextlib.suppress(SalusError):
                    channel.call(ops.Cancel(task.job))
        if not array.running:
            continue
        readable, _, _ = select.select(list(array.running), [], [], 0.5)
        for sock in readable:
            task = array.running[sock]
            status, ended = _read(task)
            if ended:
                del array.running[sock]
                sock.close()
                array.statuses[task.index] = code = final_status(channel, task.job, status)
                print(f"salusd run: task {task.index} (job {task.job}) exited {code}; its "
                      f"output is in {task.output}", file=sys.stderr)


def _submit(channel: Control, command: list[str], args: argparse.Namespace, array: Array,
            index: int) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    request = dataclasses.replace(
        run_request(command, args), array_index=index,
        array_job=None if array.array_job is None else int(array.array_job))
    try:
        channel.send(request, theirs.fileno())
        theirs.close()
        job = str(channel.reply()["job"])
    except BaseException:
        ours.close()
        theirs.close()
        raise
    if array.array_job is None:
        array.array_job = job
        print(f"salusd run: array job {job}: {len(array.todo) + 1} task(s)", file=sys.stderr)
    output = (args.output.replace("%A", array.array_job).replace("%a", str(index))
              .replace("%j", job))
    task = Task(index, job, os.path.abspath(output), ours)
    array.running[ours] = task
    _send_stdio(task, truncate=True)


def _send_stdio(task: Task, *, truncate: bool) -> None:
    """Send the task's stdin (/dev/null), stdout and stderr (its output file) on its socket;
    a rerun (`--restart on-failure`) appends to the file."""
    out = os.open(task.output, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
                  | (os.O_TRUNC if truncate else os.O_APPEND), 0o666)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        socket.send_fds(task.sock, [b"stdio"], [null, out, out])
    finally:
        os.close(out)
        os.close(null)


def _read(task: Task) -> tuple[int | None, bool]:
    """What the task's socket says: (its exit status or None, whether it ended)."""
    try:
        chunk = task.sock.recv(4096)
    except ConnectionResetError:  # closed with the descriptors unread: never started
        chunk = b""
    if not chunk:
        return None, True
    task.data += chunk
    while b"\n" in task.data:
        line, task.data = task.data.split(b"\n", 1)
        message = json.loads(line)
        if "exit" in message:
            return int(message["exit"]), True
        if message.get("stdio"):
            _send_stdio(task, truncate=False)
    return None, False
